"""``verify``: is a checkpoint complete and intact, without loading it.

:func:`verify_checkpoint` is the one function the CLI calls; it checks what the
format records today:

1. completeness: the commit marker ``metadata.json`` and the format's
   metadata (``.metadata``, restricted unpickler; ``.raw_index`` for ``raw_bytes``)
   exist and parse;
2. every data file named by that metadata exists and is at least as long as the
   last item stored in it;
3. the common state exists (``common.pt`` or a ``common_state`` item);
4. when ``integrity.json`` exists, every file it lists is re-digested (sha256)
   and every data file is listed.

It is meant to be replaced by a library-level ``dist_checkpointing.verify``
when the commit protocol records more (a save identity, per-item digests).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

from .._torch_compat import METADATA_FILE_NAME
from ..core import maybe_load_config
from ..engine.checkpoint import integrity
from ..engine.checkpoint.verify import verify
from ..engine.raw.index import INDEX_NAME as RAW_INDEX
from ..engine.raw.load import read_index as read_raw_index
from ..engine.storage.location import CheckpointDir
from ..engine.storage.reader import FileSystemReader
from ..errors import CheckpointingException
from ..strategies.common import COMMON_STATE_OBJECT_KEY
from .source import CONFIG_FNAME, RAW_BACKEND, file_sizes, is_checkpoint_dir, one_line
from .ui import Progress

_CHUNK = 8 << 20


@dataclass
class VerifyReport:
    """The verdict: ``ok`` when ``problems`` is empty."""

    path: str
    checked_files: int = 0
    checked_bytes: int = 0
    digests_checked: int = 0
    checksums: str = "unavailable"  # "verified": every CRC32C of the commit record checked
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _digest(ckpt: CheckpointDir, name: str, bar: Progress | None) -> str:
    h = hashlib.sha256()
    with ckpt.open_read(name) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
    return h.hexdigest()


def _check_sizes(metadata: object, sizes: dict[str, int], report: VerifyReport) -> set[str]:
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    return _compare_sizes(needed, sizes, report)


def _compare_sizes(needed: dict[str, int], sizes: dict[str, int], report: VerifyReport) -> set[str]:
    for name, end in sorted(needed.items()):
        if name not in sizes:
            report.problems.append(f"{name}: data file missing")
        elif sizes[name] < end:
            report.problems.append(f"{name}: truncated ({sizes[name]} bytes, needs {end})")
        else:
            report.checked_files += 1
            report.checked_bytes += sizes[name]
    return set(needed)


def _check_raw_sizes(ckpt: CheckpointDir, sizes: dict[str, int], report: VerifyReport) -> set[str]:
    """Data files of a ``raw_bytes`` checkpoint: present and as long as their last item."""
    if RAW_INDEX not in sizes:
        report.problems.append(f"{RAW_INDEX} missing")
        return set()
    index = read_raw_index(ckpt)
    c = index.columns
    needed = dict.fromkeys(index.files, 0)
    for row in range(len(index.entries)):
        name = index.files[c["file"][row]]
        needed[name] = max(needed[name], c["offset"][row] + c["length"][row])
    return _compare_sizes(needed, sizes, report)


def digest_bytes(path: str) -> int:
    """How many bytes :func:`verify_checkpoint` will digest (for a progress bar)."""
    try:
        manifest = integrity.read_manifest(CheckpointDir.of(path)) or {}
    except CheckpointingException:
        return 0
    sizes = file_sizes(path)
    return sum(sizes.get(n, 0) for n in manifest)


def _check_digests(
    ckpt: CheckpointDir,
    data_files: set[str],
    sizes: dict[str, int],
    report: VerifyReport,
    bar: Progress | None,
) -> None:
    manifest = integrity.read_manifest(ckpt)
    if manifest is None:
        return
    for name in sorted(data_files - set(manifest)):
        report.problems.append(f"{name}: not listed in {integrity.INTEGRITY_FNAME}")
    for name, expected in sorted(manifest.items()):
        if name not in sizes:
            report.problems.append(f"{name}: listed in {integrity.INTEGRITY_FNAME} but missing")
            continue
        if _digest(ckpt, name, bar) != expected:
            report.problems.append(f"{name}: sha256 differs from {integrity.INTEGRITY_FNAME}")
        report.digests_checked += 1


def _check_record(path: str, report: VerifyReport) -> None:
    """The commit record's files, sizes and checksums (:func:`dist_checkpointing.verify`)."""
    found = verify(path, raise_on_error=False)
    report.checksums = found.checksums
    report.problems += [p for p in found.problems if p not in report.problems]


def verify_checkpoint(path: str | os.PathLike[str], bar: Progress | None = None) -> VerifyReport:
    """Check the checkpoint at ``path``; never raises for a bad checkpoint."""
    path = os.fspath(path)
    report = VerifyReport(path)
    if not is_checkpoint_dir(path):
        report.problems.append("not a directory")
        return report
    ckpt = CheckpointDir.of(path)
    sizes = file_sizes(path)
    try:
        config = maybe_load_config(path)
        if config is None:
            report.problems.append(
                f"{CONFIG_FNAME} missing (the save did not finish, or plain DCP)"
            )
        if config is not None and config.sharded_backend == RAW_BACKEND:
            data_files = _check_raw_sizes(ckpt, sizes, report)
            has_common = "common.pt" in sizes
        else:
            if METADATA_FILE_NAME not in sizes:
                report.problems.append(f"{METADATA_FILE_NAME} missing")
                return report
            metadata = FileSystemReader(ckpt).read_metadata()
            data_files = _check_sizes(metadata, sizes, report)
            has_common = (
                COMMON_STATE_OBJECT_KEY in metadata.state_dict_metadata or "common.pt" in sizes
            )
        if config is not None and not has_common:
            report.problems.append("common state missing (no common.pt, no common_state item)")
        _check_digests(ckpt, data_files, sizes, report, bar)
        _check_record(path, report)
    except (CheckpointingException, OSError, ValueError) as e:
        report.problems.append(one_line(e))
    return report


__all__ = ["VerifyReport", "digest_bytes", "verify_checkpoint"]
