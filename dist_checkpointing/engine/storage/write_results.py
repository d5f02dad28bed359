"""From all ranks' write results to what the coordinator records: DCP's
``Metadata.storage_data`` and the data files' item checksums."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.storage import WriteResult

from .checksums import DataFileEntry


def data_file_checksums(results: Sequence[Sequence[WriteResult]]) -> dict[str, DataFileEntry]:
    """Every data file written, with its size and its items' checksums (carried by the
    write results; none when the save wrote no checksums)."""
    files: dict[str, DataFileEntry] = {}
    for rank_results in results:
        for r in rank_results:
            info = r.storage_data
            entry = files.setdefault(info.relative_path, DataFileEntry(0))
            entry.size = max(entry.size, info.offset + info.length)
            checksum = getattr(r, "checksum", None)
            if checksum is not None:
                entry.items.append(checksum)
    for entry in files.values():
        entry.items.sort(key=lambda it: it.offset)
    return files


def storage_data_from_results(results: Sequence[Sequence[WriteResult]]) -> dict[Any, Any]:
    """``Metadata.storage_data`` (MetadataIndex -> StorageInfo) from all ranks' results."""
    return {wr.index: wr.storage_data for rank_results in results for wr in rank_results}


__all__ = ["data_file_checksums", "storage_data_from_results"]
