"""From all ranks' write results to what the coordinator records: DCP's
``Metadata.storage_data`` and the data files' item checksums."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.storage import WriteResult

from ...errors import CheckpointWriteError
from .checksums import DataFileEntry
from .result_table import ResultTable, data_files_from_tables
from .write_workers import WriteOutcome


def results_in_order(outcome: WriteOutcome, bucket_paths: Sequence[str]) -> list[WriteResult]:
    """Every bucket's WriteResults in bucket order, or :class:`CheckpointWriteError`
    naming each bucket that failed or reported nothing (its file) and the rank."""
    problems = [outcome.errors[i] for i in sorted(outcome.errors)]
    missing = [
        path
        for i, path in enumerate(bucket_paths)
        if i not in outcome.results and i not in outcome.errors
    ]
    if missing:
        problems.append(f"rank {outcome.rank}: no result reported for {', '.join(missing)}")
    if problems:
        raise CheckpointWriteError("Worker failure: " + "\n".join(problems))
    return [wr for i in range(len(bucket_paths)) for wr in outcome.results[i]]


def data_file_checksums(results: Sequence[Sequence[WriteResult]]) -> dict[str, DataFileEntry]:
    """Every data file written, with its size and its items' checksums (carried by the
    write results; none when the save wrote no checksums)."""
    return data_files_from_tables(ResultTable.of(rank_results) for rank_results in results)


def storage_data_from_results(results: Sequence[Sequence[WriteResult]]) -> dict[Any, Any]:
    """``Metadata.storage_data`` (MetadataIndex -> StorageInfo) from all ranks' results."""
    return {wr.index: wr.storage_data for rank_results in results for wr in rank_results}


__all__ = [
    "data_file_checksums",
    "storage_data_from_results",
]
