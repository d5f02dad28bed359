"""File digests for ``verify_integrity`` (Megatron-Core 0.19's save/load parameter).

At save, every rank digests the data files it wrote; the coordinator writes
``integrity.json`` (before ``metadata.json``, the commit point). At load,
each rank re-digests the files it reads and compares.

Our manifest: ``{"version": 1, "algorithm": "sha256", "files": {name: hexdigest}}``.
Manifests written by other tools are read tolerantly: ``files`` (or the top
level) may map names to a hex digest or to ``{"sha256": hexdigest}``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from pathlib import Path

from ...errors import CheckpointingException, CorruptCheckpointError
from ..storage.resolve import filesystem_for

logger = logging.getLogger(__name__)

INTEGRITY_FNAME = "integrity.json"
_CHUNK = 8 << 20


def file_digest(path: str | Path) -> str:
    """The sha256 hex digest of a file."""
    fs = filesystem_for(path)
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with fs.open_read(str(path)) as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def digest_files(checkpoint_dir: str | Path, names: Iterable[str]) -> dict[str, str]:
    """``{name: sha256}`` for the given files of the checkpoint."""
    fs = filesystem_for(checkpoint_dir)
    return {n: file_digest(fs.join(str(checkpoint_dir), n)) for n in sorted(set(names))}


def write_manifest(checkpoint_dir: str | Path, digests: dict[str, str]) -> None:
    """Write ``integrity.json`` durably and atomically."""
    fs = filesystem_for(checkpoint_dir)
    body = {"version": 1, "algorithm": "sha256", "files": dict(sorted(digests.items()))}
    fs.atomic_write(fs.join(str(checkpoint_dir), INTEGRITY_FNAME), json.dumps(body).encode())


def read_manifest(checkpoint_dir: str | Path) -> dict[str, str] | None:
    """``{name: sha256}`` from ``integrity.json``, or None if there is none."""
    fs = filesystem_for(checkpoint_dir)
    path = fs.join(str(checkpoint_dir), INTEGRITY_FNAME)
    if not fs.exists(path):
        return None
    try:
        with fs.open_read(path) as f:
            raw = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{path}: unreadable integrity manifest ({e})") from e
    algorithm = raw.get("algorithm", "sha256") if isinstance(raw, dict) else None
    if algorithm != "sha256":
        raise CorruptCheckpointError(f"{path}: unsupported digest algorithm {algorithm!r}")
    files = raw.get("files", raw)
    out: dict[str, str] = {}
    for name, value in files.items():
        if isinstance(value, dict):
            value = value.get("sha256")
        if isinstance(value, str):
            out[name] = value
    return out


def verify_files(checkpoint_dir: str | Path, names: Iterable[str]) -> None:
    """Check the given files against ``integrity.json``.

    Raises:
        CheckpointingException: the checkpoint has no manifest (saved without
            ``verify_integrity=True``).
        CorruptCheckpointError: a file is missing from the manifest or its digest
            differs; the message names every such file.
    """
    manifest = read_manifest(checkpoint_dir)
    if manifest is None:
        raise CheckpointingException(
            f"{checkpoint_dir}: verify_integrity=True but the checkpoint has no "
            f"{INTEGRITY_FNAME} (it was saved without verify_integrity)"
        )
    bad = []
    for name, digest in digest_files(checkpoint_dir, names).items():
        expected = manifest.get(name)
        if expected is None:
            bad.append(f"{name}: not listed in {INTEGRITY_FNAME}")
        elif expected != digest:
            bad.append(f"{name}: sha256 {digest} differs from the recorded {expected}")
    if bad:
        raise CorruptCheckpointError(
            f"{checkpoint_dir}: integrity check failed for {len(bad)} file(s):\n  "
            + "\n  ".join(bad)
        )
