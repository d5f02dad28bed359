"""Which files ``integrity.file_digest`` reads, recorded in the calling process (the
tests of ``verify_integrity``; collectives and writers stay real)."""

from __future__ import annotations

from dist_checkpointing.engine.checkpoint import integrity
from dist_checkpointing.engine.storage.location import CheckpointDir


def recording_digests() -> list[str]:
    """Wrap ``integrity.file_digest`` in this process: the names it digests, in order."""
    seen: list[str] = []
    digest = integrity.file_digest

    def recorded(ckpt: CheckpointDir, name: str) -> str:
        seen.append(name)
        return digest(ckpt, name)

    integrity.file_digest = recorded  # type: ignore[assignment]
    return seen
