"""DCP storage reader for local filesystems that reads only the bytes it needs.

Reads any DCP checkpoint in torch's filesystem layout (ours, Megatron-Core's, plain
DCP's). Each data file is opened once and its items are read in offset order. Small
neighbouring items are fetched with one large read. For a tensor item, the
``torch.save`` archive is parsed (:mod:`.torch_save_zip`) and only the requested
region is read, straight into the destination tensor when its layout allows;
anything unexpected falls back to ``torch.load(weights_only=True)`` of the item.
"""

from __future__ import annotations

import io
import logging
import os
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .._torch_compat import METADATA_FILE_NAME
from ..errors import (
    CheckpointingException,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from ..safe_load import load_metadata, safe_torch_load
from .fs_io import ReadStream, filesystem_for
from .torch_save_zip import NotFastPath, TensorRecord, parse_tensor_item

logger = logging.getLogger(__name__)

# Items up to this size are fetched together with their neighbours ...
SMALL_ITEM_BYTES = 1 << 20
# ... in reads of up to this many bytes, skipping gaps of at most MAX_GAP_BYTES.
WINDOW_BYTES = 16 << 20
MAX_GAP_BYTES = 256 << 10


class FileSystemReader(StorageReader):
    """Reads a DCP checkpoint from a local directory.

    Call sequence (``torch.distributed.checkpoint.load`` or our load strategy):

    1. (all ranks) ``reset(checkpoint_id)`` (optional), ``read_metadata()``.
    2. (all ranks) ``set_up_storage_reader(metadata, is_coordinator)``.
    3. (all ranks) ``prepare_local_plan``; (coordinator) ``prepare_global_plan``: unchanged.
    4. (all ranks) ``read_data(plan, planner)``: fills the planner's tensors and bytes.

    Args:
        path: the checkpoint directory.
        thread_count: data files read in parallel (planner calls stay serialized).
        fast_path: parse tensor items and read only the needed bytes; with False
            every tensor item is loaded with ``torch.load`` (as torch's reader does).
    """

    def __init__(
        self, path: str | os.PathLike[str], thread_count: int = 1, fast_path: bool = True
    ) -> None:
        super().__init__()
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        self.path = os.fspath(path)
        self.fs = filesystem_for(self.path)
        self.thread_count = thread_count
        self.fast_path = fast_path
        self.storage_data: dict[Any, Any] = {}
        self.load_id = str(uuid.uuid4())

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load (optionally from another directory)."""
        self.storage_data = {}
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
            self.fs = filesystem_for(self.path)
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Read ``.metadata`` with a restricted unpickler.

        Raises:
            CheckpointNotFoundError: the directory does not exist.
            IncompleteCheckpointError: it has no ``.metadata`` (the save never finished).
            UnsupportedFeatureError: rank-local metadata was requested (``rank=``).
        """
        if args or kwargs:
            # DCP asks for rank-local metadata (``rank=``) only after the global read failed.
            raise IncompleteCheckpointError(
                f"{self.path}: rank-local metadata files are not supported "
                f"(requested with {args or ''}{kwargs or ''})"
            )
        path = self.fs.join(self.path, METADATA_FILE_NAME)
        if not self.fs.is_dir(self.path):
            raise CheckpointNotFoundError(f"checkpoint directory {self.path} does not exist")
        if not self.fs.exists(path):
            raise IncompleteCheckpointError(
                f"{path} does not exist: {self.path} is not a finished DCP checkpoint "
                f"(its save did not complete, or it holds another format)"
            )
        with self.fs.open_read(path) as stream:
            data = stream.read()
        metadata = load_metadata(io.BytesIO(data), source=path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

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

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` into the planner; a completed Future."""
        per_file: dict[str, list[tuple[ReadItem, Any]]] = {}
        for read_item in plan.items:
            try:
                info = self.storage_data[read_item.storage_index]
            except KeyError:
                raise CorruptCheckpointError(
                    f"{self.path}: the metadata has no location for {read_item.storage_index}"
                ) from None
            per_file.setdefault(info.relative_path, []).append((read_item, info))
        lock: AbstractContextManager[Any] = nullcontext()
        if self.thread_count > 1 and len(per_file) > 1:
            lock = threading.Lock()
            with ThreadPoolExecutor(min(self.thread_count, len(per_file))) as pool:
                jobs = [
                    pool.submit(self._read_file, rel, items, planner, lock)
                    for rel, items in per_file.items()
                ]
                for job in jobs:
                    job.result()
        else:
            for rel, items in per_file.items():
                self._read_file(rel, items, planner, lock)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint directory."""
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a local directory path."""
        text = os.fspath(checkpoint_id)
        return "://" not in text and os.path.isdir(text)

    # ----------------------------------------------------------------- per file

    def _read_file(
        self,
        relative_path: str,
        items: list[tuple[ReadItem, Any]],
        planner: LoadPlanner,
        lock: AbstractContextManager[Any],
    ) -> None:
        path = self.fs.join(self.path, relative_path)
        items = sorted(items, key=lambda pair: pair[1].offset)
        try:
            stream = self.fs.open_read(path)
        except FileNotFoundError:
            keys = sorted({str(ri.storage_index.fqn) for ri, _ in items})
            raise CorruptCheckpointError(
                f"data file {path} is missing; it holds {', '.join(keys[:10])}"
                f"{' ...' if len(keys) > 10 else ''}"
            ) from None
        with stream:
            file = _File(stream, path, self.fs.file_size(path))
            for read_item, info in items:
                file.check_range(info.offset, info.length, read_item)
            i = 0
            while i < len(items):
                j = file.load_window(items, i)
                for read_item, info in items[i:j]:
                    item = _Item(file, info.offset, info.length, read_item)
                    self._read_item(item, read_item, planner, lock)
                i = j

    def _read_item(
        self,
        item: _Item,
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
            target = planner.resolve_tensor(read_item).detach()
        record = None
        if self.fast_path:
            try:
                record = parse_tensor_item(item.read_at, item.length)
            except NotFastPath as exc:
                logger.debug("%s: torch.load fallback (%s)", item.describe(), exc)
        if record is not None:
            _copy_region(item, record, read_item, target)
        else:
            _copy_region_torch_load(item, read_item, target)
        with lock:
            planner.commit_tensor(read_item, target)


# --------------------------------------------------------------------------- file access


class _File:
    """One open data file; serves small items from a window of bytes read at once."""

    def __init__(self, stream: ReadStream, path: str, size: int) -> None:
        self.stream = stream
        self.path = path
        self.size = size
        self.window_start = 0
        self.window = memoryview(b"")

    def check_range(self, offset: int, length: int, read_item: ReadItem) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise CorruptCheckpointError(
                f"{self.path} is truncated: item {read_item.storage_index.fqn!r} "
                f"(offset {offset}, length {length}) ends at byte {offset + length}, "
                f"but the file has {self.size} bytes"
            )

    def load_window(self, items: Sequence[tuple[ReadItem, Any]], i: int) -> int:
        """Fetch items[i:j] of small neighbours with one read (if worth it); return j."""
        start = items[i][1].offset
        end = start + items[i][1].length
        j = i + 1
        if items[i][1].length > SMALL_ITEM_BYTES:
            return j
        while j < len(items):
            info = items[j][1]
            if (
                info.length > SMALL_ITEM_BYTES
                or info.offset - end > MAX_GAP_BYTES
                or max(end, info.offset + info.length) - start > WINDOW_BYTES
            ):
                break
            end = max(end, info.offset + info.length)
            j += 1
        buf = bytearray(end - start)
        self.readinto(start, memoryview(buf), items[i][0])
        self.window_start = start
        self.window = memoryview(buf)
        return j

    def readinto(self, offset: int, buf: memoryview, read_item: ReadItem) -> None:
        self.stream.seek(offset)
        done = 0
        while done < len(buf):
            n = self.stream.readinto(buf[done:])
            if not n:
                raise CorruptCheckpointError(
                    f"{self.path}: short read at byte {offset + done} while reading item "
                    f"{read_item.storage_index.fqn!r} (the file may have been truncated)"
                )
            done += n


# Bytes read at once from each end of a large item: its zip headers and directory.
_EDGE_BYTES = 4096


@dataclass
class _Item:
    """The bytes of one item: from the file's window, or read from the file."""

    file: _File
    offset: int
    length: int
    read_item: ReadItem
    _edges: tuple[int, memoryview, int, memoryview] | None = None  # head and tail bytes

    def _in_window(self, start: int, n: int) -> bool:
        w = self.file
        return w.window_start <= start and start + n <= w.window_start + len(w.window)

    def read_at(self, offset: int, n: int) -> memoryview:
        """``n`` bytes at ``offset`` of the item (small reads near its ends are cached)."""
        start = self.offset + offset
        if self._in_window(start, n):
            pos = start - self.file.window_start
            return self.file.window[pos : pos + n]
        if n <= _EDGE_BYTES and self.length > 2 * _EDGE_BYTES:
            if self._edges is None:
                head = self._read(0, _EDGE_BYTES)
                tail_at = self.length - _EDGE_BYTES
                self._edges = (0, head, tail_at, self._read(tail_at, _EDGE_BYTES))
            for at, edge in (self._edges[:2], self._edges[2:]):
                if at <= offset and offset + n <= at + len(edge):
                    return edge[offset - at : offset - at + n]
        return self._read(offset, n)

    def _read(self, offset: int, n: int) -> memoryview:
        buf = memoryview(bytearray(n))
        self.file.readinto(self.offset + offset, buf, self.read_item)
        return buf

    def readinto(self, offset: int, buf: memoryview) -> None:
        start = self.offset + offset
        if self._in_window(start, len(buf)):
            pos = start - self.file.window_start
            buf[:] = self.file.window[pos : pos + len(buf)]
        else:
            self.file.readinto(start, buf, self.read_item)

    def describe(self) -> str:
        return (
            f"{self.file.path}: item {self.read_item.storage_index.fqn!r} "
            f"(offset {self.offset}, length {self.length})"
        )


# --------------------------------------------------------------------------- tensor copies


def _byte_view(t: torch.Tensor) -> memoryview:
    return t.reshape(-1).view(torch.uint8).numpy().data


def _check_request(
    item: _Item, shape: Sequence[int], read_item: ReadItem, target: torch.Tensor
) -> None:
    offsets, lengths = tuple(read_item.storage_offsets), tuple(read_item.lengths)
    if len(offsets) != len(shape) or any(
        o < 0 or o + n > s for o, n, s in zip(offsets, lengths, shape)
    ):
        raise CorruptCheckpointError(
            f"{item.describe()} holds a tensor of shape {tuple(shape)}, but the metadata "
            f"places the requested region at offsets {offsets} with lengths {lengths}"
        )
    if tuple(target.shape) != lengths:
        raise CheckpointingException(
            f"{item.describe()}: the destination tensor for {read_item.dest_index.fqn!r} "
            f"has shape {tuple(target.shape)}, expected {lengths}"
        )


def _copy_region(item: _Item, rec: TensorRecord, read_item: ReadItem, target: torch.Tensor) -> None:
    """Copy the requested region of the stored tensor into ``target``, reading only its span."""
    _check_request(item, rec.shape, read_item, target)
    lengths = tuple(read_item.lengths)
    numel = 1
    for n in lengths:
        numel *= n
    if numel == 0:
        return
    itemsize = torch.empty((), dtype=rec.dtype).element_size()
    strides = _contiguous_strides(rec.shape)
    first = rec.storage_offset + sum(o * s for o, s in zip(read_item.storage_offsets, strides))
    last = first + sum((n - 1) * s for n, s in zip(lengths, strides))
    start = rec.data_offset + first * itemsize
    span = last - first + 1
    if span == numel:  # the region is one contiguous byte range
        direct = (
            target.device.type == "cpu" and target.dtype == rec.dtype and target.is_contiguous()
        )
        if direct:
            item.readinto(start, _byte_view(target))
            return
        staging = torch.empty(lengths, dtype=rec.dtype)
        item.readinto(start, _byte_view(staging))
        target.copy_(staging)
        return
    staging = torch.empty(span, dtype=rec.dtype)
    item.readinto(start, _byte_view(staging))
    target.copy_(staging.as_strided(lengths, strides))


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def _copy_region_torch_load(item: _Item, read_item: ReadItem, target: torch.Tensor) -> None:
    # weights_only: tensors and plain containers only; errors name the item.
    tensor = safe_torch_load(item.read_at(0, item.length), source=item.describe())
    if not isinstance(tensor, torch.Tensor):
        raise CorruptCheckpointError(
            f"{item.describe()} holds a {type(tensor).__name__}, expected a tensor"
        )
    _check_request(item, tuple(tensor.shape), read_item, target)
    for dim, (o, n) in enumerate(zip(read_item.storage_offsets, read_item.lengths)):
        tensor = tensor.narrow(dim, o, n)
    target.copy_(tensor)


__all__ = ["FileSystemReader"]
