"""Checking a whole checkpoint: complete, every file present with its size, every checksum.

:func:`verify` is collective over the ranks that call it: the files named by the
commit record are split over the ranks by size (each byte is read by one rank),
each rank checks its share, and every rank gets the same :class:`VerifyReport`
(and, with ``raise_on_error``, the same exception). A checkpoint without a
commit record (written by Megatron-Core or plain DCP) is checked for
completeness and file sizes only, and the report says that checksums are
unavailable.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from ...errors import CheckpointingException, CorruptCheckpointError, IncompleteCheckpointError
from ..collectives import ProcessGroup, RankGroup
from ..raw.index import INDEX_NAME as RAW_INDEX
from ..raw.index import parse_index, raw_items_by_file
from ..storage.base import ReadStream
from ..storage.checksums import FileEntry, crc
from ..storage.item_checksums import DataFileEntry, ItemChecksum
from ..storage.location import CheckpointDir
from .commit import COMMIT_MARKER
from .reading import open_for_read
from .record import CommitRecord

logger = logging.getLogger(__name__)


@dataclass
class VerifyReport:
    """What :func:`verify` found (the same on every rank)."""

    checkpoint: str
    save_id: str | None
    checksums: str  # "verified" or "unavailable" (no commit record)
    files_checked: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _share(sizes: dict[str, int], world: int, rank: int) -> list[str]:
    """This rank's files: largest first onto the least-loaded rank (deterministic)."""
    loads = [0] * world
    mine = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        target = min(range(world), key=lambda r: (loads[r], r))
        loads[target] += max(sizes[name], 1)
        if target == rank:
            mine.append(name)
    return mine


def _check_whole(ckpt: CheckpointDir, name: str, entry: FileEntry, block: int) -> list[str]:
    """A whole file (its size was checked already) against its entry."""
    with ckpt.open_read(name) as stream:
        data = stream.read()
    if FileEntry.of(data, block) != entry:
        return [f"{ckpt.path(name)}: checksum mismatch (modified, or from another save)"]
    return []


def _check_item(stream: ReadStream, path: str, item: ItemChecksum, block: int) -> str | None:
    pos = item.offset
    for b, expected in enumerate(item.blocks):
        n = min(block, item.offset + item.length - pos)
        data = stream.read(n) if n > 0 else b""
        if len(data) != max(n, 0):
            return f"{path}: short read at byte {pos}"
        if crc(data) != expected:
            return (
                f"{path}: checksum mismatch at byte {pos} (item at offset {item.offset}, block {b})"
            )
        pos += len(data)
    return None


def _check_data_file(
    ckpt: CheckpointDir, name: str, entry: DataFileEntry, block: int, layout: _LayoutItems
) -> list[str]:
    path = ckpt.path(name)
    problems = []
    items = entry.items
    if not items:  # a layout that keeps its item checksums in its own index
        items, block, problem = layout(name)
        if problem:
            return [problem]
    with ckpt.open_read(name) as stream:
        for item in items:
            stream.seek(item.offset)
            problem = _check_item(stream, path, item, block)
            if problem:
                problems.append(problem)
    return problems


_LayoutItems = Callable[[str], tuple[list[ItemChecksum], int, str | None]]


def _raw_index_items(ckpt: CheckpointDir, record: CommitRecord) -> _LayoutItems:
    """The item checksums of each data file from the ``raw_bytes`` index, when the
    commit record names one (parsed once, on first use)."""
    parsed: dict[str, dict[str, list[ItemChecksum]] | str] = {}

    def items_of(name: str) -> tuple[list[ItemChecksum], int, str | None]:
        if RAW_INDEX not in record.files:
            return [], record.block_bytes, None
        if "index" not in parsed:
            try:
                with ckpt.open_read(RAW_INDEX) as stream:
                    index = parse_index(stream.read(), ckpt.path(RAW_INDEX))
                parsed["index"] = raw_items_by_file(index)
                parsed["block"] = str(index.block_bytes)
            except CheckpointingException as exc:
                parsed["index"] = f"{ckpt.path(RAW_INDEX)}: unreadable ({exc})"
        by_file = parsed["index"]
        if isinstance(by_file, str):
            return [], 0, by_file
        return by_file.get(name, []), int(str(parsed["block"])), None

    return items_of


def _check_file(
    ckpt: CheckpointDir, record: CommitRecord, name: str, layout: _LayoutItems
) -> list[str]:
    if not ckpt.has(name):
        return [f"{ckpt.path(name)}: missing"]
    expected = record.files[name].size if name in record.files else record.data_files[name].size
    size = ckpt.size(name)
    if size != expected:
        return [f"{ckpt.path(name)}: {size} bytes, recorded {expected} (truncated or replaced)"]
    if name in record.files:
        return _check_whole(ckpt, name, record.files[name], record.block_bytes)
    return _check_data_file(ckpt, name, record.data_files[name], record.block_bytes, layout)


def _check_legacy(ckpt: CheckpointDir) -> list[str]:
    """Completeness of a checkpoint without a record: the config and ``.metadata``."""
    problems = [f"{ckpt.path(n)}: missing" for n in (COMMIT_MARKER, ".metadata") if not ckpt.has(n)]
    return problems


def _verify_share(
    ckpt: CheckpointDir, group: RankGroup
) -> tuple[VerifyReport, list[str], list[int]]:
    """This rank's share of :func:`verify` (no communication): the report to fill, the
    problems found and ``[files, bytes]`` checked."""
    ckpt.require_dir()
    record = open_for_read(ckpt, verify=False)
    report = VerifyReport(
        str(ckpt), record.save_id if record else None, "verified" if record else "unavailable"
    )
    problems: list[str] = []
    checked = [0, 0]
    if record is None:
        problems = _check_legacy(ckpt) if group.is_coordinator else []
    else:
        sizes = {n: e.size for n, e in record.files.items()}
        sizes.update({n: e.size for n, e in record.data_files.items()})
        layout = _raw_index_items(ckpt, record)
        for name in _share(sizes, group.world, group.rank):
            problems += _check_file(ckpt, record, name, layout)
            checked[0] += 1
            checked[1] += sizes[name]
    return report, problems, checked


def verify(
    checkpoint_dir: str | os.PathLike[str],
    process_group: ProcessGroup = None,
    *,
    raise_on_error: bool = True,
) -> VerifyReport:
    """Check the whole checkpoint in ``checkpoint_dir`` (collective over the callers).

    Raises (with ``raise_on_error``, on every rank):
        IncompleteCheckpointError: a file of the checkpoint is missing.
        CorruptCheckpointError: a file has the wrong size or fails its checksums.
    """
    group = RankGroup(process_group)
    error: BaseException | None = None
    try:
        report, problems, checked = _verify_share(CheckpointDir.of(checkpoint_dir), group)
    except Exception as exc:  # noqa: BLE001 - one verdict: raised on every rank below
        error = exc
    group.fail_together(error, f"Verifying {checkpoint_dir}")
    gathered = group.all_gather((problems, checked))
    for rank_problems, (files, nbytes) in gathered:
        report.problems += rank_problems
        report.files_checked += files
        report.bytes_checked += nbytes
    if report.problems and raise_on_error:
        text = f"{report.checkpoint}: verification failed:\n  " + "\n  ".join(report.problems)
        if any(p.endswith(": missing") for p in report.problems):
            raise IncompleteCheckpointError(text)
        raise CorruptCheckpointError(text)
    logger.info(
        "%s: verified %d files (%d bytes), checksums %s, %d problem(s)",
        report.checkpoint,
        report.files_checked,
        report.bytes_checked,
        report.checksums,
        len(report.problems),
    )
    return report


__all__ = ["VerifyReport", "verify"]
