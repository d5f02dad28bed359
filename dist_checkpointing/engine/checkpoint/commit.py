"""The commit protocol of a save, as it stands today.

A checkpoint is complete when its commit marker (``metadata.json``) exists; it
is written last, atomically, by the coordinator, after every rank's data and
the sharded format's own metadata are durable. Call sequence of one save:

1. :func:`begin` (every rank; the coordinator acts), after the save was
   validated (a rejected save leaves the directory as it was) and before any
   data is written: the coordinator removes the commit marker first, then the
   other commit files named by the strategies, so a crash mid-save leaves a
   directory that does not load as complete;
2. the strategies write their data and the format's metadata;
3. :func:`commit` (every rank): the coordinator writes the marker; a barrier
   tells every rank that the checkpoint is complete.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..collectives import RankGroup
from ..storage.location import CheckpointDir

logger = logging.getLogger(__name__)

COMMIT_MARKER = "metadata.json"


def begin(ckpt: CheckpointDir, group: RankGroup, commit_files: Sequence[str]) -> None:
    """Make an overwritten directory stop looking complete (the coordinator acts).

    ``commit_files`` are the files that mark parts of the checkpoint complete
    (the format's metadata, the integrity manifest); the marker goes first.
    """
    if not group.is_coordinator:
        return
    names = set(ckpt.listdir())
    if names:
        logger.warning("Overwriting the existing content of %s", ckpt)
    for name in (COMMIT_MARKER, *commit_files):
        if name in names:
            ckpt.remove(name)


def commit(ckpt: CheckpointDir, group: RankGroup, marker: bytes) -> None:
    """Write the commit marker (coordinator), then wait until every rank knows."""
    if group.is_coordinator:
        ckpt.atomic_write(COMMIT_MARKER, marker)
    group.barrier()


__all__ = ["COMMIT_MARKER", "begin", "commit"]
