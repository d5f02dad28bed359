"""Read destinations whose memory overlaps: :func:`overlapping`.

A load verifies each read where it landed. Where two reads land in the same memory (one
tensor requested under two keys, or two overlapping views), the later one can change the
bytes the earlier one's checksums are computed on, on another reading thread or before
the earlier read is verified: a valid checkpoint would fail with a checksum error. The
planners give such destinations a buffer of their own, copied over once every read is
verified; a run of direct reads stops before one. What is left in the shared memory is
one of the values stored.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def overlapping(starts: Sequence[int], lengths: Sequence[int]) -> list[int]:
    """The positions (in input order) of the spans ``[starts[i], starts[i] + lengths[i])``
    that need a buffer of their own so that the others are pairwise disjoint: taken in
    address order (ties in input order), each span that overlaps one kept before it.
    The common case, no overlap at all, is found at numpy speed (no Python per span).

    The spans before the first position returned are pairwise disjoint.
    """
    if len(starts) < 2:
        return []
    at = np.asarray(starts, dtype=np.int64)
    end = at + np.asarray(lengths, dtype=np.int64)
    order = np.argsort(at, kind="stable")
    if bool((end[order[:-1]] <= at[order[1:]]).all()):
        return []
    flagged = []
    reach = 0
    for i in order.tolist():
        if lengths[i] == 0:
            continue  # no memory: overlaps nothing
        if starts[i] >= reach:
            reach = max(reach, starts[i] + lengths[i])
        else:
            flagged.append(i)
    return sorted(flagged)


__all__ = ["overlapping"]
