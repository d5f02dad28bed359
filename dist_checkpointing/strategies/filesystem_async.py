"""DCP storage writer for local filesystems that can write in background processes.

The files are exactly PyTorch DCP's: ``__<rank>_<n>.distcp`` data files (one per
bucket, a concatenation of items: a tensor item is a complete ``torch.save`` zip of
the chunk, a bytes item its raw bytes) and a pickled torch ``Metadata`` in
``.metadata``, written last and atomically. Megatron-Core and plain
``torch.distributed.checkpoint`` read them.

Tensor items are serialized by :mod:`.torch_save_zip`-style code in this module
(``_write_tensor_item``), which produces byte for byte what ``torch.save`` produces,
without its per-item overhead; anything it does not handle goes through ``torch.save``.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import heapq
import logging
import os
import pickle
import queue
import shutil
import signal
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .._torch_compat import (
    DATA_FILE_SUFFIX,
    DCP_VERSION,
    METADATA_FILE_NAME,
    StorageInfo,
    StoragePrefix,
)
from ..errors import CheckpointingException, CheckpointWriteError, UnsupportedFeatureError
from . import torch_save_zip
from .fs_io import FileSystemIO, filesystem_for

logger = logging.getLogger(__name__)

# How long retrieve_write_results waits for the write function's outcome by default.
# The outcome is normally there already: finalization runs after the write finished.
DEFAULT_RESULTS_TIMEOUT_S = 60.0
# Accepted for parity with torch's FileSystemWriter (bytes staged ahead per thread).
DEFAULT_PER_THREAD_COPY_AHEAD = 10_000_000


class ResultsQueue(Protocol):
    """What the write function needs to hand its outcome back (a queue-like object)."""

    def put(self, obj: Any) -> None: ...

    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...


@dataclass
class WriteBucket:
    """The items of one data file, resolved and ready to write.

    ``tensors`` hold CPU tensors after staging (accelerator tensors before it).
    Instances are plain picklable data, so a bucket can travel to a worker process.
    """

    path: str  # where to write the file
    relative_path: str  # the file name recorded in the metadata
    byte_items: list[tuple[WriteItem, Any]] = field(default_factory=list)  # (item, BytesIO)
    tensor_items: list[tuple[WriteItem, torch.Tensor]] = field(default_factory=list)

    def nbytes(self) -> int:
        """Payload bytes of the tensors (without zip overhead and bytes items)."""
        return sum(t.numel() * t.element_size() for _, t in self.tensor_items)


@dataclass
class WriteOutcome:
    """What the write function reports for one rank: per-bucket results or errors."""

    rank: int
    results: dict[int, list[WriteResult]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)


# --------------------------------------------------------------------------- bucketing


def item_size(item: WriteItem) -> int:
    """Bytes of the tensor chunk of ``item`` (0 for bytes items)."""
    if item.tensor_data is None:
        return 0
    numel = 1
    for s in item.tensor_data.chunk.sizes:  # the chunk, not the global tensor
        numel *= s
    return numel * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()


def split_by_size(items: Sequence[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Split ``items`` into ``bins`` lists of similar total size.

    Bytes items go round-robin; tensor items largest-first onto the least-filled
    bin. Bins may be empty.
    """
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    byte_items = [it for it in items if it.type == WriteItemType.BYTE_IO]
    tensor_items = [it for it in items if it.type != WriteItemType.BYTE_IO]
    for i, it in enumerate(byte_items):
        buckets[i % bins].append(it)
    sized = sorted(((item_size(it), i) for i, it in enumerate(tensor_items)), reverse=True)
    heap = [(0, b) for b in range(bins)]
    for size, i in sized:
        total, b = heapq.heappop(heap)
        buckets[b].append(tensor_items[i])
        heapq.heappush(heap, (total + size, b))
    return buckets


def plan_buckets(
    items: Sequence[WriteItem], thread_count: int, separation_hint: str | None
) -> list[list[WriteItem]]:
    """Group ``items`` into the non-empty buckets (one file each) of one rank.

    Without ``separation_hint`` there are up to ``thread_count`` buckets. With it,
    items whose fqn starts with the hint get their own buckets: up to
    ``max(1, thread_count // 2)`` for the other items, then as many for the hinted ones.
    """
    if separation_hint is None:
        groups = [list(items)]
        bins = thread_count
    else:
        groups = [
            [it for it in items if not it.index.fqn.startswith(separation_hint)],
            [it for it in items if it.index.fqn.startswith(separation_hint)],
        ]
        bins = max(1, thread_count // 2)
    return [b for group in groups for b in split_by_size(group, bins) if b]


# --------------------------------------------------------------------------- staging


def _is_whole_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is contiguous and covers exactly its storage (torch.save saves all of it)."""
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def _prepare_tensor(t: torch.Tensor) -> torch.Tensor:
    """Detach; copy CPU views so that only the chunk's bytes are saved."""
    t = t.detach()
    if t.device.type == "cpu" and not _is_whole_storage(t):
        return t.clone(memory_format=torch.contiguous_format)
    return t


def stage_buckets_to_host(buckets: list[WriteBucket]) -> list[WriteBucket]:
    """Copy accelerator tensors of ``buckets`` to host memory, in place.

    Copies go to pinned memory with ``non_blocking`` and each device is synchronized
    once at the end. Returns ``buckets`` itself (the same list, now holding host
    tensors), so a caller may either use the return value or ignore it.
    """
    devices: set[torch.device] = set()
    for bucket in buckets:
        for i, (item, t) in enumerate(bucket.tensor_items):
            if t.device.type == "cpu":
                continue
            host = torch.empty(t.size(), dtype=t.dtype, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
            bucket.tensor_items[i] = (item, host)
            devices.add(t.device)
    for device in devices:
        torch.accelerator.synchronize(device)
    return buckets


# --------------------------------------------------------------------------- writing


def write_bucket_file(bucket: WriteBucket, fs: FileSystemIO, sync_files: bool) -> list[WriteResult]:
    """Write one bucket's items to its file; return one WriteResult per item.

    Bytes items come first, then tensors. Raises ``OSError`` on I/O failure.
    """
    results: list[WriteResult] = []
    with fs.open_write(bucket.path) as stream:
        offset = 0
        for item, data in bucket.byte_items:
            length = stream.write(data.getbuffer())
            results.append(_result(item, bucket.relative_path, offset, length))
            offset += length
        for item, tensor in bucket.tensor_items:
            if tensor.device.type != "cpu":
                raise CheckpointingException(
                    f"tensor {item.index.fqn!r} for {bucket.path} is on {tensor.device}: "
                    f"buckets must be staged to host memory (stage_buckets_to_host) first"
                )
            length = torch_save_zip.write_tensor(stream, tensor)
            results.append(_result(item, bucket.relative_path, offset, length))
            offset += length
        if sync_files:
            fs.fsync(stream)
    return results


def _result(item: WriteItem, relative_path: str, offset: int, length: int) -> WriteResult:
    return WriteResult(
        index=item.index,
        size_in_bytes=length,
        storage_data=StorageInfo(relative_path, offset, length),
    )


_ERRNO_HINTS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: "the file size limit (RLIMIT_FSIZE) or the filesystem's maximum file size "
    "was reached",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOENT: "the checkpoint directory does not exist (removed during the save?)",
    errno.EROFS: "the filesystem is read-only",
}


def _failure_text(exc: BaseException) -> str:
    """A one-line cause for an error message, with a hint for common OS errors."""
    text = f"{type(exc).__name__}: {exc}"
    hint = _ERRNO_HINTS.get(getattr(exc, "errno", None) or -1)
    return f"{text} ({hint})" if hint else text


def _traceback_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()


def _write_error(rank: int, bucket: WriteBucket, cause: str) -> str:
    return f"rank {rank}: writing checkpoint file {bucket.path} failed: {cause}"


def _record_failure(
    outcome: WriteOutcome, idx: int, bucket: WriteBucket, cause: str, tb: str | None
) -> None:
    outcome.errors[idx] = _write_error(outcome.rank, bucket, cause)
    if tb:
        logger.error("%s\n%s", outcome.errors[idx], tb)


def write_buckets_threaded(
    rank: int, buckets: list[WriteBucket], fs: FileSystemIO, sync_files: bool
) -> WriteOutcome:
    """Write each bucket in its own thread of this process (the first in this thread)."""
    outcome = WriteOutcome(rank)

    def run(idx: int) -> None:
        try:
            outcome.results[idx] = write_bucket_file(buckets[idx], fs, sync_files)
        except Exception as exc:  # noqa: BLE001 - reported through the outcome
            _record_failure(outcome, idx, buckets[idx], _failure_text(exc), _traceback_text(exc))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(1, len(buckets))]
    for t in threads:
        t.start()
    if buckets:
        run(0)
    for t in threads:
        t.join()
    return outcome


@contextmanager
def _gc_disabled() -> Iterator[None]:
    # A collection in a forked process may free objects inherited from the parent
    # (e.g. CUDA tensors) whose teardown is only valid in the parent.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _bucket_worker(
    rank: int, bucket: WriteBucket, fs: FileSystemIO, sync_files: bool, conn: Any
) -> None:
    """Entry point of a per-bucket worker process: write, then send results or error text."""
    gc.disable()
    # Exceeding RLIMIT_FSIZE then fails the write with EFBIG (a clear error)
    # instead of killing this process with SIGXFSZ.
    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        message: tuple[Any, ...] = ("ok", write_bucket_file(bucket, fs, sync_files))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        message = ("error", _failure_text(exc), _traceback_text(exc))
    conn.send(message)
    conn.close()


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "did not exit"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = str(-exitcode)
        hint = " (file size limit exceeded)" if name == "SIGXFSZ" else ""
        return f"was killed by signal {name}{hint}"
    return f"exited with code {exitcode}"


def _worker_context() -> Any:
    import multiprocessing

    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def _run_bucket_workers(
    rank: int, buckets: list[WriteBucket], fs: FileSystemIO, sync_files: bool
) -> WriteOutcome:
    """Fork one worker per bucket; collect each one's results, error or death."""
    from multiprocessing.connection import wait

    ctx = _worker_context()
    outcome = WriteOutcome(rank)
    pending: dict[Any, tuple[int, Any, Any]] = {}  # sentinel -> (idx, process, reader)
    for idx, bucket in enumerate(buckets):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_bucket_worker,
            args=(rank, bucket, fs, sync_files, writer),
            name=f"dist-ckpt-writer-r{rank}-b{idx}",
            daemon=True,
        )
        try:
            proc.start()
        except Exception as exc:  # noqa: BLE001 - reported through the outcome
            _record_failure(outcome, idx, bucket, f"cannot start worker: {exc}", None)
            reader.close()
            continue
        finally:
            writer.close()
        pending[proc.sentinel] = (idx, proc, reader)
    while pending:
        # Results arrive on the readers; a sentinel fires when a worker exits. A
        # worker killed before sending leaves only its sentinel: no hang.
        ready = set(wait(list(pending) + [r for _, _, r in pending.values()]))
        for sentinel, (idx, proc, reader) in list(pending.items()):
            if reader not in ready and sentinel not in ready:
                continue
            message = None
            try:
                if reader.poll():
                    message = reader.recv()
            except (EOFError, OSError):
                message = None
            if message is None and sentinel not in ready:
                continue  # EOF without data while the process is still exiting
            proc.join()
            reader.close()
            del pending[sentinel]
            if message is not None and message[0] == "ok":
                outcome.results[idx] = message[1]
            elif message is not None:
                _record_failure(outcome, idx, buckets[idx], message[1], message[2])
            else:
                cause = (
                    f"worker process {proc.pid} {_describe_exit(proc.exitcode)} "
                    f"without reporting a result"
                )
                _record_failure(outcome, idx, buckets[idx], cause, None)
    return outcome


def write_buckets_multiproc(
    rank: int, buckets: list[WriteBucket], results_queue: ResultsQueue, sync_files: bool = True
) -> None:
    """Write ``buckets`` (staged to host) and put a :class:`WriteOutcome` into ``results_queue``.

    The write function of :meth:`FileSystemWriterAsync.get_save_function_and_args`;
    module-level and taking plain arguments, so it runs in a worker process. One
    bucket is written in this process; several are written by one forked process
    each (``fork`` where available: this function usually runs in a process that
    was itself forked from the trainer, and forking avoids re-importing it; the
    buckets need not be pickled). A worker that raises reports its traceback; one
    that dies is detected from its exit code. Never raises for write failures:
    they go into the outcome, and :meth:`FileSystemWriterAsync.retrieve_write_results`
    raises them.
    """
    import multiprocessing

    fs = filesystem_for(os.path.dirname(buckets[0].path) if buckets else ".")
    with _gc_disabled():
        if multiprocessing.current_process().daemon and len(buckets) > 1:
            # A daemonic process may not start children: write with threads instead.
            outcome = write_buckets_threaded(rank, buckets, fs, sync_files)
        elif len(buckets) == 1:
            try:
                outcome = WriteOutcome(rank, {0: write_bucket_file(buckets[0], fs, sync_files)})
            except Exception as exc:  # noqa: BLE001 - reported through the outcome
                outcome = WriteOutcome(rank)
                _record_failure(outcome, 0, buckets[0], _failure_text(exc), _traceback_text(exc))
        else:
            outcome = _run_bucket_workers(rank, buckets, fs, sync_files)
    results_queue.put(outcome)


# --------------------------------------------------------------------------- results channel


class FileResultsQueue:
    """A one-shot results channel backed by a private temporary file.

    ``put`` (any process, once) writes the pickled object atomically; ``get`` (the
    creating process) reads and deletes it. Unlike a ``multiprocessing.Queue`` it
    never blocks the producer (a process holding unread queue data cannot exit),
    needs no manager process, and pickles as its path, so it reaches forked and
    spawned workers alike. :meth:`close` removes the directory.
    """

    def __init__(self, rank: int) -> None:
        self.directory = tempfile.mkdtemp(prefix=f"dist_ckpt_results_r{rank}_")
        self.path = os.path.join(self.directory, "outcome.pkl")

    def put(self, obj: Any) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, self.path)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """Return the object put, waiting up to ``timeout`` seconds; ``queue.Empty`` if none."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while not os.path.exists(self.path):
            if not block or (deadline is not None and time.monotonic() >= deadline):
                raise queue.Empty
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        with open(self.path, "rb") as f:
            obj = pickle.load(f)  # our own file in a private (0700) directory
        os.remove(self.path)
        return obj

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


# --------------------------------------------------------------------------- metadata


def storage_data_from_results(results: Sequence[Sequence[WriteResult]]) -> dict[Any, Any]:
    """``Metadata.storage_data`` (MetadataIndex -> StorageInfo) from all ranks' results."""
    return {wr.index: wr.storage_data for rank_results in results for wr in rank_results}


# --------------------------------------------------------------------------- the writer


class FileSystemWriterAsync(StorageWriter):
    """Writes a DCP checkpoint to a local directory, synchronously or in the background.

    Synchronous use (``torch.distributed.checkpoint.save``), the calls on each rank:

    1. (all ranks) ``reset(checkpoint_id)``, then ``set_up_storage_writer(is_coordinator,
       rank=..., use_collectives=...)``.
    2. (all ranks) ``prepare_local_plan(plan)``: creates the directory, and on the
       coordinator removes a stale ``.metadata``; sets the file prefix ``__<rank>_``.
    3. (coordinator) ``prepare_global_plan(plans)``: fills prefixes still missing.
    4. (all ranks) ``write_data(plan, planner)``: ``prepare_write_data``, staging, and
       one thread per bucket file in this process; returns a completed Future.
    5. (coordinator) ``finish(metadata, results)``: ``.metadata``, last and atomically.

    Asynchronous use (Megatron-Core style, e.g. with an ``AsyncRequest``):

    1-3. as above (or ``prepare_decentralized_global_plan`` instead of 3).
    4. (all ranks) ``prepare_write_data(plan, planner)``: resolves items into buckets.
    5. (all ranks) ``fn, stage_fn, args = get_save_function_and_args()``; all ``None``
       (and ``[]``) when the rank has nothing to write. ``stage_fn()`` copies
       accelerator tensors to host memory (the only blocking part; it updates
       ``args[1]`` in place and also returns it, the Megatron convention). Then
       ``fn(*args)`` runs, usually in a background process: it writes the files
       (one forked process per bucket) and puts a :class:`WriteOutcome` into the
       results queue held in ``args``.
    6. (all ranks, in the calling process, after ``fn`` finished)
       ``retrieve_write_results()``: reads the outcome; raises
       :class:`CheckpointWriteError` naming rank, file and cause if any bucket failed
       or none reported (e.g. the process was killed).
    7. (coordinator, after gathering every rank's results) ``finish(metadata, results)``.

    One writer serves one checkpoint save (it keeps state between the steps).

    Args:
        path: the checkpoint directory.
        single_file_per_rank: must be True (one file per bucket, not per item).
        sync_files: fsync every file written (without it a crash can lose data).
        thread_count: buckets (files, and writer threads or processes) per rank.
        per_thread_copy_ahead: accepted for parity with torch's ``FileSystemWriter``;
            unused, since staging copies all accelerator tensors in one batch.
        overwrite: allow saving into a directory that holds a checkpoint already.
        separation_hint: items whose key starts with this prefix go to separate files.
        results_queue: where the async write function reports (anything with
            ``put``/``get``, e.g. a ``multiprocessing.Manager().Queue()`` kept by the
            caller); by default a private :class:`FileResultsQueue`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = DEFAULT_PER_THREAD_COPY_AHEAD,
        overwrite: bool = True,
        separation_hint: str | None = None,
        results_queue: ResultsQueue | None = None,
    ) -> None:
        super().__init__()
        if not single_file_per_rank:
            raise UnsupportedFeatureError(
                f"FileSystemWriterAsync({os.fspath(path)!r}): single_file_per_rank=False "
                f"(one file per item) is not supported; use thread_count for more files"
            )
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        self.path = os.fspath(path)
        self.fs = filesystem_for(self.path)
        self.sync_files = sync_files
        self.thread_count = thread_count
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.overwrite = overwrite
        self.separation_hint = separation_hint
        self.save_id = _new_uuid()
        self.is_coordinator = False
        self.rank: int | None = None
        self.can_run_decentralized_global_plan = True
        self._external_queue = results_queue
        self._results_queue: ResultsQueue | None = None
        self._buckets: list[WriteBucket] | None = None
        self._write_results: list[WriteResult] | None = None

    # ----------------------------------------------------------------- DCP protocol

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save (optionally into another directory)."""
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
            self.fs = filesystem_for(self.path)
        self.save_id = _new_uuid()
        self._buckets = None
        self._write_results = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Record the role. DCP passes ``rank`` and ``use_collectives`` by keyword (it
        looks for a parameter named ``kwargs`` before passing them)."""
        if args:
            raise TypeError(f"set_up_storage_writer takes no extra positional args: {args}")
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        self.rank = None if rank is None else int(rank)
        if not kwargs.get("use_collectives", True):
            raise UnsupportedFeatureError(
                f"{self.path}: saving without collectives (rank-local metadata files) "
                f"is not supported"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Create the directory, guard an existing checkpoint, set this rank's file prefix."""
        try:
            self.fs.makedirs(self.path)
        except OSError as exc:
            raise CheckpointWriteError(
                f"rank {self._rank_or_default()}: cannot create checkpoint directory "
                f"{self.path}: {exc}"
            ) from exc
        metadata_path = self.fs.join(self.path, METADATA_FILE_NAME)
        if self.fs.exists(metadata_path):
            if not self.overwrite:
                raise CheckpointWriteError(
                    f"{self.path} already holds a checkpoint ({METADATA_FILE_NAME} exists) "
                    f"and overwrite=False"
                )
            if self.is_coordinator:
                # Until the new save finishes, the directory must not look complete.
                logger.info("overwriting the checkpoint in %s", self.path)
                self.fs.remove(metadata_path)
        if self.rank is not None:
            plan = dataclasses.replace(plan, storage_data=StoragePrefix(f"__{self.rank}_"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Give each plan without a file prefix the prefix ``__<plan index>_``."""
        return [
            plan
            if plan.storage_data is not None
            else dataclasses.replace(plan, storage_data=StoragePrefix(f"__{i}_"))
            for i, plan in enumerate(plans)
        ]

    def prepare_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        """The global plan of this rank without talking to other ranks (prefix by rank)."""
        rank = self._rank_or_default()
        return dataclasses.replace(local_plan, storage_data=StoragePrefix(f"__{rank}_"))

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write all items of ``plan`` in this process; a completed Future of the results."""
        self.prepare_write_data(plan, planner)
        assert self._buckets is not None  # set by prepare_write_data
        stage_buckets_to_host(self._buckets)
        outcome = write_buckets_threaded(
            self._rank_or_default(), self._buckets, self.fs, self.sync_files
        )
        self._write_results = self._check_outcome(outcome)
        future: Future[list[WriteResult]] = Future()
        future.set_result(self._write_results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """(Coordinator) Complete ``metadata`` and write ``.metadata`` atomically."""
        self.build_metadata(metadata, results)
        path = self.fs.join(self.path, METADATA_FILE_NAME)
        try:
            data = pickle.dumps(metadata, protocol=4)
            self.fs.atomic_write(path, data, sync=self.sync_files)
        except OSError as exc:
            raise CheckpointWriteError(
                f"rank {self._rank_or_default()}: writing checkpoint metadata {path} failed: {exc}"
            ) from exc

    def build_metadata(
        self, metadata: Metadata, results: Sequence[Sequence[WriteResult]]
    ) -> Metadata:
        """Fill ``storage_data``, ``storage_meta`` and ``version`` of ``metadata`` (in place,
        also returned) from all ranks' results, without writing anything."""
        metadata.storage_data = storage_data_from_results(results)
        metadata.storage_meta = self.storage_meta()
        metadata.version = DCP_VERSION
        return metadata

    def storage_meta(self) -> StorageMeta | None:
        """The checkpoint path as given (a str) and this save's id."""
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint directory."""
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a local path under a writable existing directory."""
        text = os.fspath(checkpoint_id)
        if "://" in text:
            return False
        parent = os.path.abspath(text)
        while True:
            if os.path.exists(parent):
                return os.path.isdir(parent) and os.access(parent, os.W_OK)
            up = os.path.dirname(parent)
            if up == parent:
                return False
            parent = up

    # ----------------------------------------------------------------- async steps

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Resolve every item of ``plan`` and group them into size-balanced buckets.

        CPU tensors are kept as they are (views of larger storages are copied);
        accelerator tensors are staged later (:func:`stage_buckets_to_host`).
        """
        prefix = self._file_prefix(plan)
        self._buckets = []
        for n, items in enumerate(
            plan_buckets(plan.items, self.thread_count, self.separation_hint)
        ):
            name = f"{prefix}{n}{DATA_FILE_SUFFIX}"
            bucket = WriteBucket(self.fs.join(self.path, name), name)
            for item in items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    bucket.byte_items.append((item, data))
                elif isinstance(data, torch.Tensor):
                    bucket.tensor_items.append((item, _prepare_tensor(data)))
                else:
                    raise CheckpointingException(
                        f"the planner resolved tensor item {item.index.fqn!r} to a "
                        f"{type(data).__name__}, expected a torch.Tensor"
                    )
            self._buckets.append(bucket)
        self._write_results = None
        logger.debug(
            "rank %d: %d items in %d buckets",
            self._rank_or_default(),
            len(plan.items),
            len(self._buckets),
        )

    def get_save_function_and_args(
        self,
    ) -> (
        tuple[Callable[..., None], Callable[[], list[WriteBucket]], list[Any]]
        | tuple[None, None, list[Any]]
    ):
        """``(write_fn, stage_fn, args)`` for the async caller, or ``(None, None, [])``.

        ``write_fn(*args)`` is :func:`write_buckets_multiproc` with ``args = [rank,
        buckets, results_queue, sync_files]``; ``stage_fn()`` stages ``args[1]`` to host
        memory in place and returns it.
        """
        if self._buckets is None:
            raise CheckpointingException(
                f"{self.path}: get_save_function_and_args called before prepare_write_data"
            )
        if not self._buckets:
            return None, None, []
        if self._results_queue is None:
            self._results_queue = self._external_queue or FileResultsQueue(self._rank_or_default())
        buckets = self._buckets
        args: list[Any] = [self._rank_or_default(), buckets, self._results_queue, self.sync_files]
        return write_buckets_multiproc, _StageFn(buckets), args

    def retrieve_write_results(
        self, timeout: float = DEFAULT_RESULTS_TIMEOUT_S
    ) -> list[WriteResult]:
        """This rank's WriteResults once the write function finished.

        Raises:
            CheckpointWriteError: a bucket failed or its worker died, or no outcome
                arrived within ``timeout`` seconds; names the rank, files and cause.
        """
        if self._write_results is not None:
            return self._write_results
        if self._buckets is None:
            raise CheckpointingException(
                f"{self.path}: retrieve_write_results called before prepare_write_data"
            )
        if not self._buckets:
            self._write_results = []
            return self._write_results
        rank = self._rank_or_default()
        if self._results_queue is None:
            raise CheckpointingException(
                f"{self.path}: retrieve_write_results called before get_save_function_and_args"
            )
        try:
            outcome = self._results_queue.get(timeout=timeout)
        except queue.Empty:
            files = ", ".join(b.path for b in self._buckets)
            raise CheckpointWriteError(
                f"rank {rank}: no write results within {timeout:.0f}s for {files}: the write "
                f"function did not run or its process died before reporting"
            ) from None
        finally:
            if isinstance(self._results_queue, FileResultsQueue):
                self._results_queue.close()
            self._results_queue = None
        self._write_results = self._check_outcome(outcome)
        return self._write_results

    # ----------------------------------------------------------------- helpers

    def _check_outcome(self, outcome: WriteOutcome) -> list[WriteResult]:
        assert self._buckets is not None
        problems = [outcome.errors[i] for i in sorted(outcome.errors)]
        missing = [
            b.path
            for i, b in enumerate(self._buckets)
            if i not in outcome.results and i not in outcome.errors
        ]
        if missing:
            problems.append(f"rank {outcome.rank}: no result reported for {', '.join(missing)}")
        if problems:
            raise CheckpointWriteError("\n".join(problems))
        return [wr for i in range(len(self._buckets)) for wr in outcome.results[i]]

    def _file_prefix(self, plan: SavePlan) -> str:
        storage = plan.storage_data
        if isinstance(storage, StoragePrefix):
            return storage.prefix
        return f"__{self._rank_or_default()}_"

    def _rank_or_default(self) -> int:
        if self.rank is not None:
            return self.rank
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank()
        return 0


@dataclass(frozen=True)
class _StageFn:
    """``stage_fn`` of get_save_function_and_args (picklable, unlike a closure)."""

    buckets: list[WriteBucket]

    def __call__(self) -> list[WriteBucket]:
        return stage_buckets_to_host(self.buckets)


def _new_uuid() -> str:
    import uuid

    return str(uuid.uuid4())


__all__ = [
    "FileResultsQueue",
    "FileSystemWriterAsync",
    "ResultsQueue",
    "WriteBucket",
    "WriteOutcome",
    "item_size",
    "plan_buckets",
    "split_by_size",
    "stage_buckets_to_host",
    "storage_data_from_results",
    "write_bucket_file",
    "write_buckets_multiproc",
    "write_buckets_threaded",
]
