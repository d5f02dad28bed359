"""From all ranks' write results to what the coordinator records: DCP's
``Metadata.storage_data`` and the data files' item checksums."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.storage import WriteResult

from .checksums import DataFileEntry


def data_file_checksums(results: Sequence[Sequence[WriteResult]]) -> dict[str, DataFileEntry]:
    """Each data file's item checksums (carried by the write results) and size."""
    files: dict[str, DataFileEntry] = {}
    for rank_results in results:
        for r in rank_results:
            checksum = getattr(r, "checksum", None)
            if checksum is None:
                continue
            entry = files.setdefault(r.storage_data.relative_path, DataFileEntry(0))
            entry.items.append(checksum)
            entry.size = max(entry.size, checksum.offset + checksum.length)
    for entry in files.values():
        entry.items.sort(key=lambda it: it.offset)
    return files


def storage_data_from_results(results: Sequence[Sequence[WriteResult]]) -> dict[Any, Any]:
    """``Metadata.storage_data`` (MetadataIndex -> StorageInfo) from all ranks' results."""
    return {wr.index: wr.storage_data for rank_results in results for wr in rank_results}


__all__ = ["data_file_checksums", "storage_data_from_results"]
