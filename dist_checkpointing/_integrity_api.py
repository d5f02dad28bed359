"""Megatron-Core 0.19's checkpoint-level integrity helpers (re-exported by ``validation``).

``save(..., verify_integrity=True)`` records a sha256 of the files each rank wrote
in ``integrity.json``; these functions do the same for a whole, already written
checkpoint directory, and check one. The manifest format is the engine's
(:mod:`dist_checkpointing.engine.checkpoint.integrity`), which reads Megatron-Core's.
"""

from __future__ import annotations

import logging
import os

from .core import check_is_distributed_checkpoint
from .engine.checkpoint.integrity import (
    INTEGRITY_FNAME,
    digest_files,
    read_manifest,
    verify_files,
    write_manifest,
)
from .engine.collectives import RankGroup
from .engine.storage.location import CheckpointDir
from .errors import CheckpointingException

logger = logging.getLogger(__name__)


def verify_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> None:
    """Raise :class:`CheckpointingException` unless ``checkpoint_dir`` is an existing
    directory holding a distributed checkpoint (``metadata.json``)."""
    ckpt = CheckpointDir.of(checkpoint_dir)
    if not ckpt.is_dir():
        raise CheckpointingException(f"Checkpoint directory {ckpt} does not exist")
    if not check_is_distributed_checkpoint(ckpt):
        raise CheckpointingException(f"{ckpt} is not a distributed checkpoint")


def save_integrity_manifest(checkpoint_dir: str | os.PathLike[str]) -> None:
    """Digest every file directly in ``checkpoint_dir`` (the manifest itself aside) and
    write ``integrity.json``, replacing any earlier manifest. Not collective: call it
    on one rank once every rank's files are written."""
    ckpt = CheckpointDir.of(checkpoint_dir)
    names = [n for n in ckpt.listdir() if n != INTEGRITY_FNAME and os.path.isfile(ckpt.path(n))]
    write_manifest(ckpt, digest_files(ckpt, names))
    logger.info("Saved integrity manifest with %d file(s) to %s", len(names), ckpt)


def _verify_all(ckpt: CheckpointDir) -> None:
    manifest = read_manifest(ckpt)
    if manifest is None:
        raise CheckpointingException(
            f"Integrity manifest not found at {ckpt.path(INTEGRITY_FNAME)}: save the "
            "checkpoint with verify_integrity=True (or call save_integrity_manifest)"
        )
    verify_files(ckpt, manifest)


def verify_integrity_manifest(checkpoint_dir: str | os.PathLike[str]) -> None:
    """Check every file listed in ``integrity.json`` against its recorded sha256.

    With ``torch.distributed`` initialized this is collective over the world: the
    first rank reads the files and every rank raises the same error.

    Raises:
        CheckpointingException: no manifest, or (:class:`CorruptCheckpointError`)
            a file is missing or its digest differs.
    """
    ckpt = CheckpointDir.of(checkpoint_dir)
    group = RankGroup()
    if not group.distributed:
        _verify_all(ckpt)
        return
    error: BaseException | None = None
    if group.is_coordinator:
        try:
            _verify_all(ckpt)
        except Exception as e:  # noqa: BLE001 - every rank learns of it below
            error = e
    message = group.broadcast(None if error is None else str(error))
    if error is not None:
        raise error
    if message is not None:
        raise CheckpointingException(f"integrity check failed on rank 0: {message}")


__all__ = [
    "INTEGRITY_FNAME",
    "save_integrity_manifest",
    "verify_checkpoint",
    "verify_integrity_manifest",
]
