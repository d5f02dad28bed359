"""DCP storage reader for local filesystems that reads only the bytes it needs.

Reads any DCP checkpoint in torch's filesystem layout (ours, Megatron-Core's, plain
DCP's). Each data file is opened once and its items are read in offset order. Small
neighbouring items are fetched with one large read. For a tensor item, the
``torch.save`` archive is parsed (:mod:`.torch_save_zip`) and only the requested
region is read, straight into the destination tensor when its layout allows;
anything unexpected falls back to ``torch.load(weights_only=True)`` of the item.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import threading
import uuid
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..._torch_compat import METADATA_FILE_NAME
from ...errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from ..safety import load_metadata
from . import region_copy
from .byte_ranges import DataFile, ItemBytes
from .checksums import BlockVerifier
from .direct_items import direct_runs, window_after_miss
from .direct_large import LargeCheck
from .item_reader import parse_tensor_item
from .item_template import NotFastPath
from .location import CheckpointDir
from .metadata_index import INDEX_NAME, metadata_from_index
from .metadata_index_items import PendingItems
from .read_spans import LARGE_READ_BYTES, span_bytes, split_spans
from .resolve import is_url
from .staging_pool import callers_stream

logger = logging.getLogger(__name__)


def _offset(pair: tuple[ReadItem, Any]) -> int:
    return int(pair[1].offset)


def _length(pair: tuple[ReadItem, Any]) -> int:
    return int(pair[1].length)


class _ReadMetadata(NamedTuple):
    """A checkpoint's metadata and the file it came from (for error messages); with
    ``keys``, the metadata of those keys only (:meth:`FileSystemReader.read_metadata_of`)."""

    metadata: Metadata
    source: str
    keys: frozenset[str] | None = None


_PART = METADATA_FILE_NAME + "#part"  # memo of the metadata of some keys


def metadata_source(location: CheckpointDir) -> str:
    """The file the checkpoint's metadata was read from (``.metadata``, or its JSON
    index), to name in messages about its entries; ``.metadata`` before it is read."""
    read = location.memoized(METADATA_FILE_NAME) or location.memoized(_PART)
    return location.path(METADATA_FILE_NAME) if read is None else str(read.source)


class FileSystemReader(StorageReader):
    """Reads a DCP checkpoint from a local directory.

    Call sequence (``torch.distributed.checkpoint.load`` or our load strategy):

    1. (all ranks) ``reset(checkpoint_id)`` (optional), ``read_metadata()``.
    2. (all ranks) ``set_up_storage_reader(metadata, is_coordinator)``.
    3. (all ranks) ``prepare_local_plan``; (coordinator) ``prepare_global_plan``: unchanged.
    4. (all ranks) ``read_data(plan, planner)``: fills the planner's tensors and bytes.

    Args:
        path: the checkpoint directory.
        thread_count: threads that read at least (planner calls stay serialized); the
            storage may read with more (``parallel_reads``: the ``READ_THREADS`` knob on
            a local file system, whose files' reads the threads share by bytes;
            ``MSC_READ_THREADS`` files at once on msc://).
        fast_path: parse tensor items and read only the needed bytes; with False
            every tensor item is loaded with ``torch.load`` (as torch's reader does).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | CheckpointDir,
        thread_count: int = 1,
        fast_path: bool = True,
    ) -> None:
        super().__init__()
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        self._set_location(path)
        self.thread_count = thread_count
        self.fast_path = fast_path
        self.storage_data: dict[Any, Any] = {}
        self._names: dict[Any, str] = {}  # relative_path -> checked file name
        self.load_id = str(uuid.uuid4())
        self._readers = 1  # threads of read_data that keep a core busy reading
        self._part_bytes = 0  # a larger read is shared by threads (ItemBytes.part_bytes)

    def _metadata_path(self) -> str:
        return metadata_source(self.location)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load (optionally from another directory)."""
        self.storage_data = {}
        if checkpoint_id:
            self._set_location(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    def _set_location(self, path: str | os.PathLike[str] | CheckpointDir) -> None:
        self.location = CheckpointDir.of(path)
        self.path = self.location.root
        self.fs = self.location.fs

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Read ``.metadata`` with a restricted unpickler.

        Raises:
            CheckpointNotFoundError: the directory does not exist.
            IncompleteCheckpointError: it has no ``.metadata`` (the save never finished).
            IncompleteCheckpointError: also when DCP asks for rank-local metadata
                (``rank=``, after the global read failed): not supported.
        """
        if args or kwargs:
            # DCP asks for rank-local metadata (``rank=``) only after the global read failed.
            raise IncompleteCheckpointError(
                f"{self.path}: rank-local metadata files are not supported "
                f"(requested with {args or ''}{kwargs or ''})"
            )
        return self._stamped(self.location.memo(METADATA_FILE_NAME, self._parse_metadata))

    def read_metadata_of(self, keys: Collection[str]) -> Metadata:
        """The metadata a load of ``keys`` needs: their entries, item locations and
        ``mcore_data``, at least. Built from the JSON index without making the objects
        of the other keys (a pipeline stage of 4 reads about a quarter of them), where
        the checkpoint has one; the item locations are then built when
        :meth:`read_data` asks for those its plan reads (a
        :class:`~.metadata_index_items.PendingItems`: test it against None, not for
        truth). Otherwise (and where this location handle already holds the whole
        metadata) the whole metadata, as :meth:`read_metadata`.

        Once per location handle: a later call for keys outside the first call's
        reads the whole metadata, and keeps it for the calls after.

        Raises:
            as :meth:`read_metadata`.
        """
        location = self.location
        if location.memoized(METADATA_FILE_NAME) is None:
            part = location.memoized(_PART)
            if part is None:
                part = self._parse_metadata(frozenset(keys))
                location.memo(_PART if part.keys is not None else METADATA_FILE_NAME, lambda: part)
                return self._stamped(part)
            if part.keys.issuperset(keys):
                return self._stamped(part)
        return self.read_metadata()

    def files_of(self, keys: Collection[str]) -> set[str]:
        """The data files (checked names) holding items of ``keys``, from the metadata
        of those keys (:meth:`read_metadata_of`; item locations not built for this
        where they are pending)."""
        storage = self.read_metadata_of(keys).storage_data
        if storage is None:  # (not "or {}": the truth of PendingItems builds them all)
            return set()
        source = self._metadata_path()
        if isinstance(storage, PendingItems):
            names = storage.files_of(keys)
        else:
            names = {info.relative_path for index, info in storage.items() if index.fqn in keys}
        return {self.location.entry(name, source=source) for name in names}

    def _stamped(self, read: _ReadMetadata) -> Metadata:
        metadata = read.metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _parse_metadata(self, keys: frozenset[str] | None = None) -> _ReadMetadata:
        """``.metadata`` (once per location handle): built from its JSON index where the
        save wrote one that matches it (only the parts of ``keys`` where given), else
        parsed whole by the restricted unpickler."""
        path = self.location.path(METADATA_FILE_NAME)
        if not self.location.is_dir():
            raise CheckpointNotFoundError(f"checkpoint directory {self.path} does not exist")
        if not self.location.has(METADATA_FILE_NAME):
            raise IncompleteCheckpointError(
                f"{path} does not exist: {self.path} is not a finished DCP checkpoint "
                f"(its save did not complete, or it holds another format)"
            )
        data = self.location.read_bytes(METADATA_FILE_NAME)
        indexed = metadata_from_index(self.location, data, keys)  # no pickle to parse
        if indexed is not None:
            return _ReadMetadata(indexed, self.location.path(INDEX_NAME), keys)
        return _ReadMetadata(load_metadata(io.BytesIO(data), source=path), path)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Take the item locations from ``metadata``."""
        if metadata.storage_data is None:
            raise CorruptCheckpointError(
                f"{self.fs.join(self.path, METADATA_FILE_NAME)} has no storage_data "
                f"(item locations)"
            )
        self.storage_data = metadata.storage_data
        self._names = {}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` into the planner; a completed Future."""
        per_file: dict[str, list[tuple[ReadItem, Any]]] = {}
        total = 0  # bytes of every item read
        prepare = getattr(self.storage_data, "prepare", None)  # PendingItems: build these
        if prepare is not None:
            prepare(read_item.storage_index for read_item in plan.items)
        for read_item in plan.items:
            try:
                info = self.storage_data[read_item.storage_index]
            except KeyError:
                raise CorruptCheckpointError(
                    f"{self.path}: the metadata has no location for {read_item.storage_index}"
                ) from None
            name = self._names.get(info.relative_path)
            if name is None:
                name = self.location.entry(info.relative_path, source=self._metadata_path())
                self._names[info.relative_path] = name
            per_file.setdefault(name, []).append((read_item, info))
            total += info.length
        lock: AbstractContextManager[Any] = nullcontext()
        threads = self._threads_for(len(plan.items), total)
        runs = list(per_file.items())
        self._part_bytes = 0
        if threads > 1 and not self.fs.sequential_reads:  # the threads share bytes
            ordered = [(rel, sorted(items, key=_offset)) for rel, items in runs]
            self._part_bytes = span_bytes(total, threads)
            runs = split_spans(ordered, _length, self._part_bytes)
        threads = min(threads, len(runs))
        self._readers = self.fs.busy_readers(threads)
        if threads > 1:
            lock = threading.Lock()
            on_callers_stream = callers_stream()

            def read_run(rel: str, items: list[tuple[ReadItem, Any]]) -> None:
                with on_callers_stream():
                    self._read_file(rel, items, planner, lock)

            with ThreadPoolExecutor(threads, thread_name_prefix="dist-ckpt-read") as pool:
                jobs = [pool.submit(read_run, rel, items) for rel, items in runs]
                for job in jobs:
                    job.result()
        else:
            for rel, items in runs:
                self._read_file(rel, items, planner, lock)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _threads_for(self, count: int, nbytes: int) -> int:
        """Threads to read with: ``thread_count``, or more where the storage says so
        (``parallel_reads``). From a local file system, only where the items are large
        (1 MiB on average): reading those is a copy by the kernel, which threads share
        out (by bytes, see :mod:`.read_spans`); reading many small ones is mostly Python
        (each item's zip framing), at which threads only take turns. Object stores read
        several files at once whatever the items, to hide each request's latency.
        ``count`` items of ``nbytes`` bytes in all are read."""
        threads = max(self.thread_count, self.fs.parallel_reads())
        local = not self.fs.sequential_reads
        if threads > self.thread_count and local and nbytes < count * LARGE_READ_BYTES:
            threads = self.thread_count
        return max(1, threads)

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint directory."""
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a local directory path."""
        text = os.fspath(checkpoint_id)
        return not is_url(text) and os.path.isdir(text)

    # ----------------------------------------------------------------- per file

    def _read_file(
        self,
        relative_path: str,
        items: list[tuple[ReadItem, Any]],
        planner: LoadPlanner,
        lock: AbstractContextManager[Any],
    ) -> None:
        path = self.location.path(relative_path)
        items = sorted(items, key=lambda pair: pair[1].offset)
        keys = sorted({str(ri.storage_index.fqn) for ri, _ in items[:11]})  # for a message
        spans = [(info.offset, info.length) for _, info in items]
        stream, size = self.location.open_data_file(relative_path, keys, spans)
        with stream:
            file = DataFile(stream, path, size, self.fs.read_limits())
            file.readers = self._readers
            for read_item, info in items:
                file.check_range(info.offset, info.length, read_item)
            # Each item is verified after the next one is read, so that the hashing
            # thread checksums its last blocks meanwhile; on any error the items read
            # before it are verified first (the first damaged one is the one named).
            # A streamed file (object stores) is read in order: verified at once, as a
            # verification may read the unread bytes of a block it touched.
            # An item whose parse fails (damaged bytes in its zip framing or pickle) is
            # verified before that error is raised: a checksum mismatch is the cause.
            defer = not self.fs.sequential_reads
            previous: ItemBytes | LargeCheck | None = None
            current: ItemBytes | None = None
            direct = None  # items whose layout is known: read without a window
            if file.fd is not None and self.fast_path and not self.fs.sequential_reads:
                lookup = self.location.context.item_checksum
                of_file = None if lookup is None else functools.partial(lookup, relative_path)
                block_bytes = self.location.context.block_bytes
                direct = direct_runs(file, planner, lock, of_file, block_bytes, self._part_bytes)

            def verify_previous() -> None:
                nonlocal previous
                if previous is not None:
                    done, previous = previous, None
                    done.verify()

            def hand_over(check: LargeCheck) -> None:  # a large item read directly
                nonlocal previous
                verify_previous()
                if defer:
                    previous = check
                else:
                    check.verify()

            i = 0
            try:
                while i < len(items):
                    most = None
                    if direct is not None:
                        j = direct(items, i, verify_previous, hand_over)
                        if j > i:
                            i = j
                            continue
                        most = window_after_miss(items[i][0], items[i][1].length)
                    j = file.load_window(items, i, most)
                    for read_item, info in items[i:j]:
                        item = current = ItemBytes(file, info.offset, info.length, read_item)
                        item.verifier = self._verifier(relative_path, info.offset, info.length)
                        item.part_bytes = self._part_bytes
                        self._read_item(item, read_item, planner, lock)
                        current = None
                        if previous is not None:
                            done, previous = previous, None
                            done.verify()
                        if defer:
                            previous = item
                        else:
                            item.verify()
                    i = j
            except BaseException:
                for pending in (previous, current):
                    if pending is not None:
                        pending.verify()
                raise
            if previous is not None:
                previous.verify()

    def _verifier(self, relative_path: str, offset: int, length: int) -> BlockVerifier | None:
        """Checks the item's blocks as it is read (None: no checksums recorded)."""
        lookup = self.location.context.item_checksum
        if lookup is None:
            return None
        checksum = lookup(relative_path, offset)
        if checksum is None or checksum.length != length:
            raise ChecksumMismatchError(
                f"{self.fs.join(self.path, relative_path)}: no recorded checksum for the item "
                f"at offset {offset} (length {length}): the .metadata does not belong to the "
                f"save in the commit record",
                file=relative_path,
                offset=offset,
            )
        return BlockVerifier(checksum, self.location.context.block_bytes)

    def _read_item(
        self,
        item: ItemBytes,
        read_item: ReadItem,
        planner: LoadPlanner,
        lock: AbstractContextManager[Any],
    ) -> None:
        if read_item.type == LoadItemType.BYTE_IO:
            data = io.BytesIO(bytes(item.read_at(0, item.length)))
            with lock:
                planner.load_bytes(read_item, data)
            return
        with lock:
            target = planner.resolve_tensor(read_item)
        if target.requires_grad:
            target = target.detach()
        record = None
        if self.fast_path:
            try:
                record = parse_tensor_item(item.read_at, item.length, self.fs.sequential_reads)
            except NotFastPath as exc:
                logger.debug("%s: torch.load fallback (%s)", item.describe(), exc)
        if record is not None:
            region_copy.copy_region(item, record, read_item, target)
            if record.tail_check is not None and not record.tail_check():
                logger.debug("%s: torch.load fallback (unexpected zip directory)", item.describe())
                record = None
        if record is None:
            region_copy.copy_region_torch_load(item, read_item, target)
        with lock:
            planner.commit_tensor(read_item, target)


def read_object_bytes(
    checkpoint_dir: str | os.PathLike[str] | CheckpointDir, key: str
) -> tuple[bytes | None, str]:
    """The stored bytes of the bytes item ``key`` (e.g. a ShardedObject's DCP key).

    Returns ``(data, source)``, where ``source`` names the file and offset (for error
    messages); ``data`` is None when the checkpoint has no such item.

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError: as ``read_metadata``.
        CorruptCheckpointError: the data file is missing or too short.
    """
    reader = FileSystemReader(checkpoint_dir)
    metadata = reader.read_metadata_of((key,))
    storage = metadata.storage_data
    info = None if storage is None else storage.get(MetadataIndex(key))
    if info is None:
        return None, f"{reader.path}: no item {key!r}"
    name = reader.location.entry(info.relative_path, source=reader._metadata_path())
    path = reader.location.path(name)
    read_item = ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=MetadataIndex(key),
        dest_offsets=torch.Size(),
        storage_index=MetadataIndex(key),
        storage_offsets=torch.Size(),
        lengths=torch.Size(),
    )
    stream, size = reader.location.open_data_file(name, [key], [(info.offset, info.length)])
    with stream:
        file = DataFile(stream, path, size, reader.fs.read_limits())
        file.check_range(info.offset, info.length, read_item)
        item = ItemBytes(file, info.offset, info.length, read_item)
        item.verifier = reader._verifier(name, info.offset, info.length)
        data = bytes(item.read_at(0, info.length))
        item.verify()
    return data, f"{path} (item {key!r} at offset {info.offset})"


__all__ = ["FileSystemReader", "read_object_bytes"]
