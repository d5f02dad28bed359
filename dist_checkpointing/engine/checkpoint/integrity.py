"""File digests for ``verify_integrity`` (Megatron-Core 0.19's save/load parameter).

At save, the data file writers compute each file's sha256 from the bytes they write
(no second read; in the background process of an async save), every rank digests the
other files it wrote (the common state, the metadata), and the coordinator writes
``integrity.json`` (staged, committed with the save). At load, every rank re-digests
the metadata files and ``common.pt`` before it unpickles them, and each data file read
is re-digested by one of the ranks that read it (:func:`verify_files_read`), so a load
digests the checkpoint's bytes once, not once per rank that reads them.

Our manifest: ``{"version": 1, "algorithm": "sha256", "files": {name: hexdigest}}``.
Manifests written by other tools are read tolerantly: ``files`` (or the top
level) may map names to a hex digest or to ``{"sha256": hexdigest}``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import zlib
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist

from ...errors import CheckpointingException, CorruptCheckpointError
from .. import knobs
from ..collectives import RankGroup, all_equal, equal_ballot
from ..process import cores_per_rank
from ..storage.location import CheckpointDir
from . import commit

logger = logging.getLogger(__name__)

INTEGRITY_FNAME = "integrity.json"


def file_digest(ckpt: CheckpointDir, name: str) -> str:
    """The sha256 hex digest of file ``name`` of the checkpoint."""
    h = hashlib.sha256()
    buf = bytearray(knobs.INTEGRITY_CHUNK_BYTES.get())
    view = memoryview(buf)
    with ckpt.open_read(name) as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def digest_files(ckpt: CheckpointDir, names: Iterable[str]) -> dict[str, str]:
    """``{name: sha256}`` for the given files of the checkpoint: on as many threads as
    this rank has cores (hashing and reading release the GIL), one file each."""
    ordered = sorted(set(names))
    threads = min(len(ordered), cores_per_rank())
    if threads <= 1:
        return {n: file_digest(ckpt, n) for n in ordered}
    with ThreadPoolExecutor(threads, thread_name_prefix="dist-ckpt-digest") as pool:
        digests = list(pool.map(lambda n: file_digest(ckpt, n), ordered))
    return dict(zip(ordered, digests))


def _manifest_bytes(digests: dict[str, str]) -> bytes:
    body = {"version": 1, "algorithm": "sha256", "files": dict(sorted(digests.items()))}
    return json.dumps(body).encode()


def write_manifest(ckpt: CheckpointDir, digests: dict[str, str]) -> None:
    """Write ``integrity.json`` durably and atomically (staged during a save)."""
    ckpt.atomic_write(INTEGRITY_FNAME, _manifest_bytes(digests))


def record(
    ckpt: CheckpointDir,
    group: RankGroup,
    names: Iterable[str],
    known: Mapping[str, str] | None = None,
) -> None:
    """Every rank digests ``names`` (the files it wrote) but those in ``known`` (the
    digests its writers computed from the bytes they wrote); the coordinator writes
    the manifest of all of them (collective)."""
    digests: dict[str, str] = {}
    error: BaseException | None = None
    known = known or {}
    try:
        listed = set(names)
        digests = {n: known[n] for n in listed if n in known}
        digests.update(digest_files(ckpt, listed.difference(digests)))
    except Exception as exc:  # noqa: BLE001 - raised on every rank by fail_together
        error = exc
    group.fail_together(error, f"Digesting the files of {ckpt}")
    gathered = group.gather(digests)
    if gathered is None:
        return
    merged: dict[str, str] = {}
    for digests in gathered:
        merged.update(digests)
    write_manifest(ckpt, merged)


def read_manifest(ckpt: CheckpointDir) -> dict[str, str] | None:
    """``{name: sha256}`` from ``integrity.json``, or None if there is none (read once per
    handle: a load checks the metadata files and then the data files against it; a
    write of the file through the handle forgets it)."""
    manifest: dict[str, str] | None = ckpt.memo(
        INTEGRITY_FNAME + "#manifest", lambda: _read_manifest(ckpt)
    )
    return manifest


def _read_manifest(ckpt: CheckpointDir) -> dict[str, str] | None:
    if not ckpt.has(INTEGRITY_FNAME):
        return None
    path = ckpt.path(INTEGRITY_FNAME)
    try:
        raw = json.loads(ckpt.read_bytes(INTEGRITY_FNAME))
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


def refresh_manifest(ckpt: CheckpointDir, changed: Iterable[str]) -> None:
    """After a maintenance step rewrote ``changed`` files (e.g. ``.metadata`` in
    ``remove_sharded_tensors``): re-digest them and drop entries of deleted files.
    A checkpoint without a manifest is left without one."""
    manifest = read_manifest(ckpt)
    if manifest is None:
        return
    kept = {name: digest for name, digest in manifest.items() if ckpt.has(name)}
    kept.update(digest_files(ckpt, [name for name in changed if ckpt.has(name)]))
    # Committed like any rewrite of a checkpoint file (the record names its checksums).
    commit.replace_files(ckpt, {INTEGRITY_FNAME: _manifest_bytes(kept)}, ())


def verify_files(ckpt: CheckpointDir, names: Iterable[str]) -> None:
    """Check the given files against ``integrity.json``.

    Raises:
        CheckpointingException: the checkpoint has no manifest (saved without
            ``verify_integrity=True``).
        CorruptCheckpointError: a file is missing from the manifest or its digest
            differs; the message names every such file.
    """
    manifest = read_manifest(ckpt)
    if manifest is None:
        raise _no_manifest(ckpt)
    _compare(ckpt, manifest, names)


def _no_manifest(ckpt: CheckpointDir) -> CheckpointingException:
    return CheckpointingException(
        f"{ckpt}: verify_integrity=True but the checkpoint has no "
        f"{INTEGRITY_FNAME} (it was saved without verify_integrity)"
    )


def _compare(ckpt: CheckpointDir, manifest: dict[str, str], names: Iterable[str]) -> None:
    bad = []
    for name, digest in digest_files(ckpt, names).items():
        expected = manifest.get(name)
        if expected is None:
            bad.append(f"{name}: not listed in {INTEGRITY_FNAME}")
        elif expected != digest:
            bad.append(f"{name}: sha256 {digest} differs from the recorded {expected}")
    if bad:
        raise CorruptCheckpointError(
            f"{ckpt}: integrity check failed for {len(bad)} file(s):\n  " + "\n  ".join(bad)
        )


def verify_files_read(
    ckpt: CheckpointDir, files_read: Callable[[], Iterable[str]], group: RankGroup
) -> None:
    """(Collective) Check the files the ranks of ``group`` read against ``integrity.json``,
    each file digested once: by one of the ranks that read it.

    ``files_read()`` names this rank's files. A tensor-parallel load reads a block of
    every key from nearly every file, so checking per rank would digest the
    checkpoint's bytes once per rank. Instead:

    1. every rank reads the manifest; one all-reduce checks that every rank has the
       same list of files (count and CRC of the names);
    2. where they agree, one all-reduce of a number per listed file picks, for each
       file read, the first of its readers at or after rank ``i mod world`` (file
       ``i`` in the manifest's order), which spreads the files of a shared read over
       the ranks; files a rank reads that the manifest does not list are reported by
       that rank. Where they do not agree (a rank could not read the manifest or
       name its files), each rank checks its own files, as :func:`verify_files`;
    3. one verdict (:meth:`RankGroup.fail_together`): a damaged file raises
       ``CorruptCheckpointError`` naming it on the rank that digested it and
       ``RankFailureError`` naming that rank and the file on the others.

    Every rank makes the same collectives whatever fails, so nothing waits.
    """
    listed: list[str] = []
    manifest: dict[str, str] | None = None
    mine: set[str] = set()
    error: BaseException | None = None
    try:
        mine = set(files_read())
        manifest = read_manifest(ckpt)
        listed = sorted(manifest or ())
    except Exception as exc:  # noqa: BLE001 - raised on every rank by fail_together
        error = exc
    # What every rank must share: no error, a manifest, the same names (-1: an error).
    stamp = [-1, -1]
    if error is None:
        stamp = [
            -2 if manifest is None else len(listed),
            zlib.crc32("\0".join(listed).encode()),
        ]
    top = group.all_reduce_ints(equal_ballot(stamp), dist.ReduceOp.MAX)
    if error is None:
        try:
            if manifest is None:
                raise _no_manifest(ckpt)
            if all_equal(top) and top[:2] == stamp:
                mine = _my_share(listed, mine, group)
            _compare(ckpt, manifest, mine)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by fail_together
            error = exc
    group.fail_together(error, f"Verifying {ckpt}")


def _my_share(listed: list[str], mine: set[str], group: RankGroup) -> set[str]:
    """(Collective) The files of ``mine`` this rank digests (see :func:`verify_files_read`,
    step 2): the unlisted ones, and the listed ones it was picked for."""
    world, rank = group.world, group.rank
    # For file i, the distance from rank i mod world to this rank, counted onwards;
    # the minimum over the ranks names the first reader from there (world: no reader).
    steps = [(rank - i) % world if name in mine else world for i, name in enumerate(listed)]
    nearest = group.all_reduce_ints(steps, dist.ReduceOp.MIN)
    share = mine - set(listed)
    share.update(name for name, step, near in zip(listed, steps, nearest) if step == near < world)
    return share


__all__ = [
    "INTEGRITY_FNAME",
    "digest_files",
    "file_digest",
    "read_manifest",
    "record",
    "refresh_manifest",
    "verify_files",
    "write_manifest",
]
