"""DCP storage writer for local filesystems that can write in background processes.

The files are exactly PyTorch DCP's: ``__<rank>_<n>.distcp`` data files (one per
bucket, a concatenation of items: a tensor item is a complete ``torch.save`` zip of
the chunk, a bytes item its raw bytes) and a pickled torch ``Metadata`` in ``.metadata``
(and its JSON index), written last and atomically. Megatron-Core and DCP read them.

This module holds the DCP protocol (:class:`FileSystemWriterAsync`, Megatron-Core's
class at Megatron-Core's path); the engine does the work:
:mod:`~dist_checkpointing.engine.storage.bucketing` groups items into files,
:mod:`~dist_checkpointing.engine.storage.write_workers` writes them, and
:mod:`~dist_checkpointing.engine.storage.item_writer` serializes tensor items (byte
for byte what ``torch.save`` writes, without its per-item overhead).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import queue
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .._torch_compat import DCP_VERSION, METADATA_FILE_NAME, StoragePrefix
from ..engine import knobs
from ..engine.storage import write_workers
from ..engine.storage.base import FileSystemIO
from ..engine.storage.bucketing import BucketLayout, build_buckets, data_file_prefix
from ..engine.storage.item_checksums import DataFileEntry
from ..engine.storage.location import CheckpointDir
from ..engine.storage.metadata_blob import metadata_bytes
from ..engine.storage.metadata_index import INDEX_NAME, encode_index
from ..engine.storage.resolve import is_url
from ..engine.storage.result_table import ResultTable
from ..engine.storage.results_channel import FileResultsQueue, ResultsQueue
from ..engine.storage.write_results import (
    WriteOutcome,
    data_file_checksums,
    get_write_results_queue,
    result_table,
    results_in_order,
    storage_data_from_results,
    wait_for_outcome,
)
from ..engine.storage.write_workers import (
    StageBuckets,
    WriteBucket,
    write_buckets_in_process,
    write_buckets_multiproc,
    write_buckets_threaded,
)
from ..errors import CheckpointingException, CheckpointWriteError, UnsupportedFeatureError

logger = logging.getLogger(__name__)

# Accepted for parity with torch's FileSystemWriter (bytes staged ahead per thread).
DEFAULT_PER_THREAD_COPY_AHEAD = 10_000_000


# --------------------------------------------------------------------------- the writer


class FileSystemWriterAsync(StorageWriter):
    """Writes a DCP checkpoint to a local directory, synchronously or in the background.

    Synchronous use (``torch.distributed.checkpoint.save``), the calls on each rank:

    1. (all ranks) ``reset(checkpoint_id)``, then ``set_up_storage_writer(is_coordinator,
       rank=..., use_collectives=...)``.
    2. (all ranks) ``prepare_local_plan(plan)``: creates the directory, and on the
       coordinator removes a stale ``.metadata``; sets the file prefix ``__<rank>_``.
    3. (coordinator) ``prepare_global_plan(plans)``: fills prefixes still missing.
    4. (all ranks) ``write_data(plan, planner)``: ``prepare_write_data``, then one
       thread per bucket file in this process (accelerator tensors stream through the
       staging pool, at most ``COPY_AHEAD_BYTES`` of host memory); returns a completed
       Future.
    5. (coordinator) ``finish(metadata, results)``: ``.metadata``, last and atomically.

    Asynchronous use (Megatron-Core style, e.g. with an ``AsyncRequest``):

    Steps 1 to 3 as above (or ``prepare_decentralized_global_plan`` instead of 3), then:

    4. (all ranks) ``prepare_write_data(plan, planner)``: resolves items into buckets.
    5. (all ranks) ``fn, stage_fn, args = get_save_function_and_args()``; all ``None``
       (and ``[]``) when the rank has nothing to write. ``stage_fn()`` copies
       accelerator tensors to host memory (the only blocking part; it updates
       ``args[1]`` in place and also returns it, the Megatron convention). Then
       ``fn(*args)`` runs, usually in a background process: it writes the files
       (one forked process per bucket) and puts a :class:`WriteOutcome` into the
       results queue held in ``args``.
    6. (all ranks, in the calling process, after ``fn`` finished)
       ``retrieve_write_results()`` (or ``retrieve_result_table()``, the same results
       as columns): reads the outcome; raises :class:`CheckpointWriteError` naming
       rank, file and cause if any bucket failed or none reported (e.g. the process
       was killed).
    7. (coordinator, after gathering every rank's results) ``finish(metadata, results)``.

    One writer serves one checkpoint save (it keeps state between the steps).

    Args:
        path: the checkpoint directory.
        single_file_per_rank: must be True (one file per bucket, not per item).
        sync_files: fsync every file written (without it a crash can lose data).
        thread_count: buckets (files, and writer threads or processes) per rank.
        per_thread_copy_ahead: accepted for parity with torch's ``FileSystemWriter``;
            unused: the ``COPY_AHEAD_BYTES`` knob bounds the staging of a synchronous
            write, and an async save stages everything before returning.
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
        self._set_location(path)
        self.sync_files = sync_files
        self.thread_count = thread_count
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.overwrite = overwrite
        self.separation_hint = separation_hint
        self.save_id = str(uuid.uuid4())
        self.is_coordinator = False
        self.rank: int | None = None
        self.can_run_decentralized_global_plan = True
        self._external_queue = results_queue
        self._results_queue: ResultsQueue | None = None
        self._buckets: list[WriteBucket] | None = None
        self._write_results: list[WriteResult] | None = None
        self._table: ResultTable | None = None
        self.bucket_layout: BucketLayout | None = None  # see prepare_write_data

    # ----------------------------------------------------------------- DCP protocol

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save (optionally into another directory)."""
        if checkpoint_id:
            self._set_location(checkpoint_id)
        self.save_id = str(uuid.uuid4())
        self.close()
        self._buckets = None
        self._write_results = self._table = None

    def _set_location(self, path: str | os.PathLike[str]) -> None:
        self.location = CheckpointDir.of(path)
        self.path = self.location.root
        self.fs = self.location.fs

    def close(self) -> None:
        """Release the default results channel (its temporary directory), if any.

        ``retrieve_write_results`` does this too; call it when a save is abandoned.
        """
        if isinstance(self._results_queue, FileResultsQueue):
            self._results_queue.close()
        self._results_queue = None

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
        if not self.overwrite and self.fs.exists(metadata_path):
            raise CheckpointWriteError(
                f"{self.path} already holds a checkpoint ({METADATA_FILE_NAME} exists) "
                f"and overwrite=False"
            )
        # Through the commit protocol (a save session on the handle) an existing
        # checkpoint is left as it is: this save writes new file names and replaces
        # .metadata only once committed. Used alone, the writer overwrites data files
        # in place, so the old .metadata goes first (a crash leaves an incomplete
        # directory, never a mix that loads).
        session_less = self.location.context.stage is None
        if session_less and self.is_coordinator and self.fs.exists(metadata_path):
            logger.info("overwriting the checkpoint in %s", self.path)
            self.fs.remove(metadata_path)
        if self.rank is not None:
            plan = dataclasses.replace(
                plan, storage_data=StoragePrefix(data_file_prefix(self.rank))
            )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Give each plan without a file prefix the prefix ``__<plan index>_``."""
        return [
            plan
            if plan.storage_data is not None
            else dataclasses.replace(plan, storage_data=StoragePrefix(data_file_prefix(i)))
            for i, plan in enumerate(plans)
        ]

    def prepare_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        """The global plan of this rank without talking to other ranks (prefix by rank)."""
        rank = self._rank_or_default()
        return dataclasses.replace(local_plan, storage_data=StoragePrefix(data_file_prefix(rank)))

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write all items of ``plan`` in this process; a completed Future of the results."""
        self.prepare_write_data(plan, planner)
        assert self._buckets is not None  # set by prepare_write_data
        # No bulk staging here: the writer threads stream accelerator tensors through
        # the staging pool, so host memory stays within COPY_AHEAD_BYTES.
        outcome = write_buckets_threaded(
            self._rank_or_default(),
            self._buckets,
            self.fs,
            self.sync_files,
            type(self).write_preloaded_data,
        )
        self._write_results = results_in_order(outcome, [b.path for b in self._buckets])
        self._keep_digests(outcome)
        future: Future[list[WriteResult]] = Future()
        future.set_result(self._write_results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """(Coordinator) Complete ``metadata`` and write ``.metadata`` atomically."""
        self.build_metadata(metadata, results)
        self.finish_assembled(metadata, data_file_checksums(results))

    def finish_assembled(self, metadata: Metadata, data_files: dict[str, DataFileEntry]) -> None:
        """(Coordinator) Write ``.metadata`` whose ``storage_data`` is complete; set
        ``storage_meta`` and ``version``; ``data_files``: the items' checksums."""
        self.build_metadata(metadata, None)
        path = self.fs.join(self.path, METADATA_FILE_NAME)
        context = self.location.context
        if context.on_data_files is not None:
            context.on_data_files(data_files)
        try:
            data = metadata_bytes(metadata)  # fast when only storage_meta changed
            # Staged under a save-specific name while the commit protocol runs.
            self.location.atomic_write(METADATA_FILE_NAME, data, sync=self.sync_files)
            index = encode_index(metadata, data)
            if index is not None:  # the same facts without a pickle, for our loads
                self.location.atomic_write(INDEX_NAME, index, sync=self.sync_files)
        except OSError as exc:
            raise CheckpointWriteError(
                f"rank {self._rank_or_default()}: writing checkpoint metadata {path} failed: {exc}"
            ) from exc

    def build_metadata(
        self, metadata: Metadata, results: Sequence[Sequence[WriteResult]] | None
    ) -> Metadata:
        """Fill ``storage_data`` (unless ``results`` is None), ``storage_meta`` and
        ``version`` of ``metadata`` (in place, also returned) from all ranks' results,
        without writing anything."""
        if results is not None:
            metadata.storage_data = storage_data_from_results(results)
        metadata.storage_meta = self.storage_meta()
        save_id = self.location.context.attachments.get("save_id")
        if save_id and metadata.storage_meta is not None:
            metadata.storage_meta.save_id = save_id  # the commit protocol's id
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
        if is_url(text):
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
        """Resolve every item of ``plan`` and group them into size-balanced buckets
        (as ``bucket_layout`` groups them, where it was made for ``plan.items``).

        CPU tensors are kept as they are (views of larger storages are copied);
        accelerator tensors are staged later (by the request's staging step,
        :class:`StageBuckets`).
        """
        self._buckets, self.bucket_layout = build_buckets(
            plan.items,
            planner.resolve_data,
            self.location.path,
            self._file_prefix(plan),
            self.thread_count,
            self.separation_hint,
            save_tag=self.location.context.save_tag,
            checksum_block_bytes=self.location.context.block_bytes,
            layout=self.bucket_layout,
            digest=self.location.context.digest_data_files,  # the manifest's sha256
        )
        self._write_results = self._table = None
        logger.debug(
            "rank %d: %d items in %d buckets",
            self._rank_or_default(),
            len(plan.items),
            len(self._buckets),
        )

    def get_save_function_and_args(
        self, in_process: bool = False
    ) -> (
        tuple[Callable[..., None], Callable[[], list[WriteBucket]], list[Any]]
        | tuple[None, None, list[Any]]
    ):
        """``(write_fn, stage_fn, args)`` for the async caller, or ``(None, None, [])``.

        ``write_fn(*args)`` is :func:`write_buckets_multiproc` with ``args = [rank,
        buckets, results_queue, sync_files]``; ``stage_fn()`` stages ``args[1]`` to host
        memory in place and returns it (a :class:`StageBuckets`; the persistent async
        caller stages its buckets into its snapshot arena instead). With ``in_process``
        (synchronous saves) it is :func:`write_buckets_in_process` (threads, no worker
        processes) reporting through an in-memory queue, and ``stage_fn()`` stages
        nothing unless ``COPY_AHEAD_BYTES`` is 0: the threads stream accelerator tensors
        through the staging pool.
        """
        if self._buckets is None:
            raise CheckpointingException(
                f"{self.path}: get_save_function_and_args called before prepare_write_data"
            )
        if not self._buckets:
            return None, None, []
        if self._results_queue is None:
            if self._external_queue is not None:
                self._results_queue = self._external_queue
            elif in_process:
                self._results_queue = queue.SimpleQueue()
            else:
                self._results_queue = FileResultsQueue(self._rank_or_default())
        buckets = self._buckets
        # Looked up now, so that a patched write_preloaded_data (fault injection) is
        # what the workers run; a module-level replacement also reaches spawned ones.
        write_fn: Callable[..., None] = (
            write_buckets_in_process if in_process else write_buckets_multiproc
        )
        hook = type(self).write_preloaded_data
        if hook is not _DEFAULT_WRITE_PRELOADED_DATA:
            write_fn = functools.partial(write_fn, write_bucket=hook)
        args: list[Any] = [self._rank_or_default(), buckets, self._results_queue, self.sync_files]
        # A synchronous save with a copy-ahead budget stages nothing up front: its
        # writer threads stream accelerator tensors through the staging pool.
        deferred = in_process and knobs.COPY_AHEAD_BYTES.get() > 0
        return write_fn, StageBuckets(buckets, deferred), args

    def retrieve_write_results(self, timeout: float | None = None) -> list[WriteResult]:
        """This rank's WriteResults once the write function finished; the buckets let go
        of their items and data.

        ``timeout`` (default: the ``RESULTS_TIMEOUT_S`` knob, 10 s) bounds the wait for
        the write function's outcome (normally there: finalization runs after it).

        Raises:
            CheckpointWriteError: a bucket failed or its worker died, or no outcome
                arrived within ``timeout`` seconds; names the rank, files and cause.
        """
        if self._write_results is None:
            self._write_results = self.retrieve_result_table(timeout).write_results()
        return self._write_results

    def retrieve_result_table(self, timeout: float | None = None) -> ResultTable:
        """:meth:`retrieve_write_results` as one :class:`ResultTable` (what the saver
        sends), without a ``WriteResult`` per item where a writer process sent it."""
        if self._table is None and self._write_results is not None:
            self._table = ResultTable.of(self._write_results)
        if self._table is not None:
            return self._table
        if self._buckets is None or (self._buckets and self._results_queue is None):
            raise CheckpointingException(
                f"{self.path}: write results retrieved before get_save_function_and_args "
                "or after release_write_results"
            )
        paths = [b.path for b in self._buckets]
        if not paths:
            self._table = ResultTable.of([])
            return self._table
        rank, timeout = self._rank_or_default(), knobs.RESULTS_TIMEOUT_S.get(timeout)
        try:
            outcome = wait_for_outcome(self._results_queue, rank, paths, timeout)
        finally:
            self.close()
        self._table = result_table(outcome, paths)
        self._keep_digests(outcome)
        for bucket in self._buckets:  # written: only the results are needed from here on
            bucket.release()
        self.bucket_layout = None  # the saver keeps it where it caches the plan
        return self._table

    def _keep_digests(self, outcome: WriteOutcome) -> None:
        """Hand the files' sha256 the writers computed to the save (its manifest)."""
        assert self._buckets is not None
        digests = self.location.context.file_digests
        for idx, sha256 in outcome.digests.items():
            digests[self._buckets[idx].relative_path] = sha256

    def release_write_results(self) -> None:
        """Let go of the results :meth:`retrieve_write_results` and
        :meth:`retrieve_result_table` returned (the saver calls this once it has sent
        them: about 27 MiB per 100,000 ``WriteResult`` objects)."""
        if self._write_results is not None or self._table is not None:
            self._write_results = self._table = None
            self._buckets = None  # a later retrieve raises

    @staticmethod
    def write_preloaded_data(
        bucket: WriteBucket, fs: FileSystemIO, sync_files: bool
    ) -> list[WriteResult]:
        """Write one staged bucket file and return its WriteResults (a
        :class:`~..engine.storage.write_results.FileResults`, with the file's sha256
        when the save records an integrity manifest; a plain list makes the save digest
        the file by reading it back).

        What every writer thread and worker process runs, looked up on the class
        when the save is prepared: replace it (e.g. ``monkeypatch.setattr(
        FileSystemWriterAsync, "write_preloaded_data", fn)``) to inject faults.
        Whatever it raises fails the save on every rank with a ``RuntimeError``
        (:class:`CheckpointWriteError`) whose message starts with "Worker failure".
        """
        return write_workers.write_bucket_file(bucket, fs, sync_files)

    # ----------------------------------------------------------------- helpers

    def _file_prefix(self, plan: SavePlan) -> str:
        storage = plan.storage_data
        if isinstance(storage, StoragePrefix):
            return storage.prefix
        return data_file_prefix(self._rank_or_default())

    def _rank_or_default(self) -> int:
        if self.rank is not None:
            return self.rank
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank()
        return 0


_DEFAULT_WRITE_PRELOADED_DATA = FileSystemWriterAsync.write_preloaded_data

__all__ = [
    "get_write_results_queue",
    "FileSystemWriterAsync",
    "storage_data_from_results",
]
