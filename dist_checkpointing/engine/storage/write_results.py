"""From all ranks' write results to what the coordinator records: DCP's
``Metadata.storage_data`` and the data files' item checksums."""

from __future__ import annotations

import logging
import multiprocessing
import queue
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.storage import WriteResult

from ...errors import CheckpointWriteError
from .item_checksums import DataFileEntry
from .result_table import ResultTable, data_files_from_tables

logger = logging.getLogger(__name__)


class FileResults(list[WriteResult]):
    """The WriteResults of one data file, in item order, and the file's sha256 (hex)
    where its writer computed one (a save recording an integrity manifest)."""

    def __init__(self, results: list[WriteResult], sha256: str | None = None) -> None:
        super().__init__(results)
        self.sha256 = sha256


@dataclass
class WriteOutcome:
    """What the write function reports for one rank: per-bucket results or errors.

    Pickled (from a writer process to the trainer), each bucket's results travel as a
    :class:`~.result_table.ResultTable` in ``tables``, made in the writer's process:
    the trainer unpickles a few byte strings instead of 100,000 ``WriteResult``
    objects (0.3 s at 100,000 items on the development VM). ``digests``: the sha256
    of the files whose writer computed one (see :class:`FileResults`)."""

    rank: int
    results: dict[int, list[WriteResult]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    tables: dict[int, ResultTable] = field(default_factory=dict)
    digests: dict[int, str] = field(default_factory=dict)  # bucket -> its file's sha256

    def add(self, idx: int, results: list[WriteResult]) -> None:
        """Bucket ``idx``'s results (and its file's sha256, if they carry one)."""
        self.results[idx] = results
        sha256 = getattr(results, "sha256", None)
        if sha256 is not None:
            self.digests[idx] = sha256

    def __getstate__(self) -> dict[str, Any]:
        state = dict(vars(self))
        try:
            tables = {i: ResultTable.of(r) for i, r in self.results.items()}
        except Exception as exc:  # noqa: BLE001 - results of an unexpected form: as they are
            logger.debug("write results sent as objects: %s", exc)
            return state
        state["tables"], state["results"] = {**self.tables, **tables}, {}
        return state


def _check_outcome(outcome: WriteOutcome, bucket_paths: Sequence[str]) -> None:
    """Raise :class:`CheckpointWriteError` naming each bucket that failed or reported
    nothing (its file) and the rank."""
    problems = [outcome.errors[i] for i in sorted(outcome.errors)]
    missing = [
        path
        for i, path in enumerate(bucket_paths)
        if i not in outcome.results and i not in outcome.tables and i not in outcome.errors
    ]
    if missing:
        problems.append(f"rank {outcome.rank}: no result reported for {', '.join(missing)}")
    if problems:
        raise CheckpointWriteError("Worker failure: " + "\n".join(problems))


def results_in_order(outcome: WriteOutcome, bucket_paths: Sequence[str]) -> list[WriteResult]:
    """Every bucket's WriteResults in bucket order, or :class:`CheckpointWriteError`
    naming each bucket that failed or reported nothing (its file) and the rank."""
    _check_outcome(outcome, bucket_paths)
    out: list[WriteResult] = []
    for i in range(len(bucket_paths)):
        table = outcome.tables.get(i)
        out += outcome.results[i] if table is None else table.write_results()
    return out


def result_table(outcome: WriteOutcome, bucket_paths: Sequence[str]) -> ResultTable:
    """:func:`results_in_order` as one :class:`~.result_table.ResultTable` (without
    making ``WriteResult`` objects where the outcome brought tables)."""
    _check_outcome(outcome, bucket_paths)
    return ResultTable.concat(
        [
            outcome.tables[i] if i in outcome.tables else ResultTable.of(outcome.results[i])
            for i in range(len(bucket_paths))
        ]
    )


def wait_for_outcome(
    results_queue: Any, rank: int, bucket_paths: Sequence[str], timeout: float
) -> WriteOutcome:
    """The outcome the write function put into ``results_queue``, or
    :class:`CheckpointWriteError` naming the rank and files after ``timeout`` seconds."""
    try:
        outcome: WriteOutcome = results_queue.get(timeout=timeout)
    except queue.Empty:
        raise CheckpointWriteError(
            f"rank {rank}: no write results within {timeout:.0f}s for {', '.join(bucket_paths)}: "
            "the write function did not run or its process died before reporting"
        ) from None
    return outcome


# The queue get_write_results_queue hands out (created on first use).
_results_queue: Any = None


def get_write_results_queue(mp_mode: str = "spawn") -> Any:
    """A queue that write workers of other processes can report to, shared by every
    caller of this process: a ``multiprocessing`` manager's queue in the ``mp_mode``
    start-method context, created on the first call. Pass it to
    ``FileSystemWriterAsync`` as ``results_queue``."""
    global _results_queue
    if _results_queue is None:
        _results_queue = multiprocessing.get_context(mp_mode).Manager().Queue()
    return _results_queue


def data_file_checksums(results: Sequence[Sequence[WriteResult]]) -> dict[str, DataFileEntry]:
    """Every data file written, with its size and its items' checksums (carried by the
    write results; none when the save wrote no checksums)."""
    return data_files_from_tables(ResultTable.of(rank_results) for rank_results in results)


def storage_data_from_results(results: Sequence[Sequence[WriteResult]]) -> dict[Any, Any]:
    """``Metadata.storage_data`` (MetadataIndex -> StorageInfo) from all ranks' results."""
    return {wr.index: wr.storage_data for rank_results in results for wr in rank_results}


__all__ = [
    "FileResults",
    "WriteOutcome",
    "data_file_checksums",
    "get_write_results_queue",
    "result_table",
    "results_in_order",
    "storage_data_from_results",
    "wait_for_outcome",
]
