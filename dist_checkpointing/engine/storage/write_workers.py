"""Writing buckets of checkpoint items to files: in threads, or in worker processes.

The write side of :class:`~.filesystem_async.FileSystemWriterAsync`, kept apart from
the DCP protocol: a :class:`WriteBucket` is the resolved content of one data file;
:func:`write_bucket_file` writes one (the single implementation of the item format,
shared by every path); :func:`write_buckets_threaded` writes several in threads of
this process, :func:`write_buckets_multiproc` in one forked process each, reporting a
:class:`WriteOutcome` through a results queue.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ..._torch_compat import StorageInfo
from ..process import child_context, describe_exit, gc_paused, in_caller, traceback_text
from .base import FileSystemIO
from .host_staging import StagingStep, TensorSlot
from .item_checksums import ItemChecksum
from .item_codec import decode_tensor_items, encode_tensor_items
from .item_stream import ChecksumStream
from .item_writer import item_padding
from .resolve import filesystem_for
from .results_channel import ResultsQueue
from .staging_pool import TensorItemWriter
from .write_results import FileResults, WriteOutcome

logger = logging.getLogger(__name__)


@dataclass
class WriteBucket:
    """The items of one data file, resolved and ready to write.

    ``tensor_items`` hold CPU tensors after staging (accelerator tensors before it).
    Instances are plain picklable data, so a bucket can travel to a worker process.
    """

    path: str  # where to write the file
    relative_path: str  # the file name recorded in the metadata
    byte_items: list[tuple[WriteItem, Any]] = field(default_factory=list)  # (item, BytesIO)
    tensor_items: list[tuple[WriteItem, torch.Tensor]] = field(default_factory=list)
    checksum_block_bytes: int = 0  # 0: no checksums (a save outside the commit protocol)
    digest: bool = False  # also compute the file's sha256 (for the integrity manifest)

    def release(self) -> None:
        """Drop the items and their data once the file is written and its results are
        in (the paths stay, for messages): the metadata is then built without them."""
        self.byte_items = []
        self.tensor_items = []

    def __reduce__(self) -> tuple[Any, ...]:
        # Tensor items as plain tuples where they can be (engine/storage/item_codec).
        records = encode_tensor_items([item for item, _ in self.tensor_items])
        fields = (self.path, self.relative_path, self.byte_items)
        if records is None:
            return WriteBucket, (*fields, self.tensor_items, self.checksum_block_bytes, self.digest)
        data = [t for _, t in self.tensor_items]
        return _rebuild_bucket, (*fields, self.checksum_block_bytes, self.digest, records, data)


def _rebuild_bucket(
    path: str,
    relative: str,
    byte_items: list[Any],
    block: int,
    digest: bool,
    records: list[Any],
    data: list[Any],
) -> WriteBucket:
    items = decode_tensor_items(records)
    return WriteBucket(path, relative, byte_items, list(zip(items, data)), block, digest)


# --------------------------------------------------------------------------- staging


@dataclass(frozen=True)
class StageBuckets(StagingStep):
    """The staging step of a ``torch_dist`` save (an ``AsyncRequest``'s ``preload_fn``;
    picklable): its slots are the tensor items of ``buckets``, its result ``buckets``.

    With ``deferred`` (a synchronous save with a copy-ahead budget) it copies nothing:
    the writer threads stream accelerator tensors through the staging pool instead.
    """

    buckets: list[WriteBucket]
    deferred: bool = False

    def slots(self) -> list[TensorSlot]:
        # Every tensor item: the writer takes host tensors as they are.
        return [
            TensorSlot(bucket.tensor_items, i, 1)
            for bucket in self.buckets
            for i in range(len(bucket.tensor_items))
        ]

    def result(self) -> list[WriteBucket]:
        return self.buckets


# --------------------------------------------------------------------------- writing


def write_bucket_file(bucket: WriteBucket, fs: FileSystemIO, sync_files: bool) -> FileResults:
    """Write one bucket's items to its file; return one WriteResult per item (and the
    file's sha256, where ``bucket.digest`` asks for it).

    Bytes items come first, then tensors. Accelerator tensors still on their device
    (a synchronous save) stream through this process's staging pool
    (:mod:`.staging_pool`): at most ``COPY_AHEAD_BYTES`` of host memory, the copy of
    the next chunk overlapping the write of this one. Raises ``OSError`` on I/O failure.
    """
    results: list[WriteResult] = []
    with fs.open_write(bucket.path) as raw:
        # Every item is checksummed (CRC32C blocks) as its bytes go to the file.
        # The file's write-back starts as its bytes go out (for a file that is synced).
        wb = fs.writeback(raw) if sync_files else None
        stream = ChecksumStream(raw, bucket.checksum_block_bytes, wb, bucket.digest)
        offset = 0
        compute_crc = torch.serialization.get_crc32_options()  # once per file, not per item
        for item, data in bucket.byte_items:
            stream.begin_item()
            length = stream.write(data.getbuffer())
            results.append(_result(item, bucket.relative_path, offset, length, stream.end_item()))
            offset += length
        staged = TensorItemWriter(bucket.tensor_items, compute_crc)
        try:
            for i, (item, tensor) in enumerate(bucket.tensor_items):
                pad = item_padding(offset, tensor.nbytes)
                if pad:  # zero bytes between items (see item_padding)
                    offset += stream.write(bytes(pad))
                stream.begin_item()
                length = staged.write(stream, i, tensor)
                results.append(
                    _result(item, bucket.relative_path, offset, length, stream.end_item())
                )
                offset += length
        finally:
            staged.close()
        stream.flush()  # the gathered bytes too
        if sync_files:
            fs.fsync(raw)
    return FileResults(results, stream.file_digest())


# Writes one staged bucket file and returns its WriteResults.
BucketWriter = Callable[[WriteBucket, FileSystemIO, bool], list[WriteResult]]


def _result(
    item: WriteItem, relative_path: str, offset: int, length: int, checksum: ItemChecksum | None
) -> WriteResult:
    result = WriteResult(
        index=item.index,
        size_in_bytes=length,
        storage_data=StorageInfo(relative_path, offset, length),
    )
    # Travels with the result to the coordinator (not part of DCP's .metadata).
    object.__setattr__(result, "checksum", checksum)  # WriteResult is frozen
    return result


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


def _write_error(rank: int, bucket: WriteBucket, cause: str) -> str:
    return f"rank {rank}: writing checkpoint file {bucket.path} failed: {cause}"


def _record_failure(
    outcome: WriteOutcome, idx: int, bucket: WriteBucket, cause: str, tb: str | None
) -> None:
    outcome.errors[idx] = _write_error(outcome.rank, bucket, cause)
    if tb:
        logger.error("%s\n%s", outcome.errors[idx], tb)


# Buckets whose items are this small on average are written one after another by one
# thread: such an item's time is Python (its framing, checksum calls and result: 10-30
# microseconds), at which threads of one process only take turns. Measured on the 2-core
# VM, one rank, 10,000 items of 256 bytes: 67-71 against 82 microseconds per tensor with
# a thread per bucket; items of 4-64 KiB, whose copies and fsyncs overlap across
# threads, were no faster on one. (Reads follow the same reasoning: storage/reader.py.)
_SMALL_ITEM_BYTES = 4 << 10


def _python_bound(buckets: list[WriteBucket]) -> bool:
    """Whether the buckets' items average under ``_SMALL_ITEM_BYTES`` (byte items, the
    pickled objects, count as items without bytes)."""
    items = nbytes = 0
    for bucket in buckets:
        items += len(bucket.tensor_items) + len(bucket.byte_items)
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket.tensor_items)
    return nbytes < items * _SMALL_ITEM_BYTES


def write_buckets_threaded(
    rank: int,
    buckets: list[WriteBucket],
    fs: FileSystemIO,
    sync_files: bool,
    write_bucket: BucketWriter | None = None,
) -> WriteOutcome:
    """Write each bucket in its own thread of this process (the first in this thread),
    or, where the items are small (Python-bound), every bucket in this thread in turn.
    Every bucket is attempted either way; failures are reported per bucket."""
    outcome = WriteOutcome(rank)
    write = write_bucket or write_bucket_file  # looked up per call: tests may patch it

    def run(idx: int) -> None:
        try:
            outcome.add(idx, write(buckets[idx], fs, sync_files))
        except Exception as exc:  # noqa: BLE001 - reported through the outcome
            _record_failure(outcome, idx, buckets[idx], _failure_text(exc), traceback_text(exc))

    if _python_bound(buckets):
        for idx in range(len(buckets)):
            run(idx)
        return outcome
    threads = [threading.Thread(target=run, args=(i,)) for i in range(1, len(buckets))]
    for t in threads:
        t.start()
    if buckets:
        run(0)
    for t in threads:
        t.join()
    return outcome


def _bucket_worker(
    bucket: WriteBucket,
    fs: FileSystemIO,
    sync_files: bool,
    write_bucket: BucketWriter,
    conn: Any,
) -> None:
    """Entry point of a per-bucket worker process: write, then send results or error text."""
    gc.disable()
    # Exceeding RLIMIT_FSIZE then fails the write with EFBIG (a clear error)
    # instead of killing this process with SIGXFSZ.
    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        message: tuple[Any, ...] = ("ok", write_bucket(bucket, fs, sync_files))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        message = ("error", _failure_text(exc), traceback_text(exc))
    conn.send(message)
    conn.close()


def _run_bucket_workers(
    rank: int,
    buckets: list[WriteBucket],
    fs: FileSystemIO,
    sync_files: bool,
    write_bucket: BucketWriter,
) -> WriteOutcome:
    """Fork one worker per bucket; collect each one's results, error or death."""
    from multiprocessing.connection import wait

    ctx = child_context()
    outcome = WriteOutcome(rank)
    pending: dict[Any, tuple[int, Any, Any]] = {}  # sentinel -> (idx, process, reader)
    for idx, bucket in enumerate(buckets):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_bucket_worker,
            args=(bucket, fs, sync_files, write_bucket, writer),
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
    messages: dict[int, Any] = {}
    while pending:
        # Results arrive on the readers; a sentinel fires when a worker exits. A
        # worker killed before sending leaves only its sentinel: no hang.
        readers = [r for i, _, r in pending.values() if i not in messages and not r.closed]
        ready = set(wait(list(pending) + readers))
        for sentinel, (idx, proc, reader) in list(pending.items()):
            if reader in ready:
                try:
                    messages[idx] = reader.recv()
                except (EOFError, OSError):  # closed without a message: it is dying
                    reader.close()
            if sentinel in ready:
                if idx not in messages and not reader.closed and reader.poll():
                    with contextlib.suppress(EOFError, OSError):
                        messages[idx] = reader.recv()  # sent just before exiting
                proc.join()
                reader.close()
                del pending[sentinel]
                _record_message(outcome, idx, buckets[idx], proc, messages.get(idx))
    return outcome


def _record_message(
    outcome: WriteOutcome, idx: int, bucket: WriteBucket, proc: Any, message: Any
) -> None:
    if message is not None and message[0] == "ok":
        outcome.add(idx, message[1])
    elif message is not None:
        _record_failure(outcome, idx, bucket, message[1], message[2])
    else:
        cause = f"worker process {proc.pid} {describe_exit(proc.exitcode)} without reporting"
        _record_failure(outcome, idx, bucket, cause, None)


def write_buckets_multiproc(
    rank: int,
    buckets: list[WriteBucket],
    results_queue: ResultsQueue,
    sync_files: bool = True,
    write_bucket: BucketWriter | None = None,
) -> None:
    """Write ``buckets`` (staged to host) and put a :class:`WriteOutcome` into ``results_queue``.

    The write function of :meth:`FileSystemWriterAsync.get_save_function_and_args`;
    module-level and taking plain arguments, so it runs in a worker process. One
    bucket is written in this process; several are written by one forked process
    each (``fork`` where available: this function usually runs in a process that
    was itself forked from the trainer, and forking avoids re-importing it; the
    buckets need not be pickled), or by threads where a fork is not wanted: in a
    daemonic process, or in the trainer itself (``AsyncRequest.execute_sync``). A
    worker that raises reports its traceback; one that dies is detected from its exit
    code. Never raises for write failures:
    they go into the outcome, and :meth:`FileSystemWriterAsync.retrieve_write_results`
    raises them. ``write_bucket`` writes one bucket file (the writer passes its
    ``write_preloaded_data``, which users may patch).
    """
    _write_buckets(rank, buckets, results_queue, sync_files, write_bucket, in_process=False)


def write_buckets_in_process(
    rank: int,
    buckets: list[WriteBucket],
    results_queue: ResultsQueue,
    sync_files: bool = True,
    write_bucket: BucketWriter | None = None,
) -> None:
    """Like :func:`write_buckets_multiproc`, with one thread per bucket in this process.

    The write function of synchronous saves: no process is started, so nothing
    is forked from the trainer and no memory is duplicated.
    """
    _write_buckets(rank, buckets, results_queue, sync_files, write_bucket, in_process=True)


def _write_buckets(
    rank: int,
    buckets: list[WriteBucket],
    results_queue: ResultsQueue,
    sync_files: bool,
    write_bucket: BucketWriter | None,
    in_process: bool,
) -> None:
    import multiprocessing

    write_bucket = write_bucket or write_bucket_file  # looked up per call: tests may patch it

    fs = filesystem_for(os.path.dirname(buckets[0].path) if buckets else ".")
    with gc_paused():
        threads = in_process or in_caller() or multiprocessing.current_process().daemon
        if threads and len(buckets) > 1:
            # A daemonic process may not start children, and a fork of the trainer
            # (a request run in it: execute_sync) would make all its pages
            # copy-on-write: write with threads instead.
            outcome = write_buckets_threaded(rank, buckets, fs, sync_files, write_bucket)
        elif len(buckets) == 1:
            try:
                outcome = WriteOutcome(rank)
                outcome.add(0, write_bucket(buckets[0], fs, sync_files))
            except Exception as exc:  # noqa: BLE001 - reported through the outcome
                outcome = WriteOutcome(rank)
                _record_failure(outcome, 0, buckets[0], _failure_text(exc), traceback_text(exc))
        else:
            outcome = _run_bucket_workers(rank, buckets, fs, sync_files, write_bucket)
    results_queue.put(outcome)


__all__ = [
    "StageBuckets",
    "WriteBucket",
    "WriteOutcome",
    "write_bucket_file",
    "write_buckets_multiproc",
    "write_buckets_threaded",
]
