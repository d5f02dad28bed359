"""Reading ``.metadata`` without executing code: :func:`load_metadata`.

torch's own reader unpickles ``.metadata`` with plain :mod:`pickle`, which runs any
callable the file names. :func:`load_metadata` admits only the allowlist of plain data
types (:mod:`.allowlist`), first with the fast unpickler (:mod:`.fast_unpickler`),
and hands every file it declines to the checked one (:mod:`.restricted_unpickler`).

Example:
    >>> import io, pickle
    >>> from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
    >>> raw = pickle.dumps(Metadata({"obj": BytesStorageMetadata()}))
    >>> load_metadata(io.BytesIO(raw), source="ckpt/.metadata").state_dict_metadata
    {'obj': BytesStorageMetadata()}
"""

from __future__ import annotations

import logging
from typing import BinaryIO

from torch.distributed.checkpoint.metadata import (
    Metadata,
)

from dist_checkpointing.engine.process import gc_paused
from dist_checkpointing.errors import CorruptCheckpointError

from .fast_unpickler import _load_fast
from .metadata_check import check_metadata
from .restricted_unpickler import _describe, _load_checked

logger = logging.getLogger(__name__)


def load_metadata(fileobj: BinaryIO, *, source: str = "<.metadata>") -> Metadata:
    """Read a DCP ``.metadata`` pickle without executing anything from it.

    1. Every global the pickle names must be on the allowlist
       (:func:`allowed_metadata_globals`); Megatron-Core 0.13's ``MCoreSavePlan``
       becomes :class:`LegacyMCoreSavePlan`. Nothing is imported.
    2. Only allowlisted constructors are called, only objects created by this load
       get their state set, and only with plain (non-dunder) attribute names. The fast
       C unpickler reads the file; any file it declines is decided by the checked
       pure-Python one (see the module docstring).
    3. The result must be a ``Metadata``; extra attributes Megatron pickles on it
       (``mcore_data``, ``all_local_plans``) are kept.

    Raises:
        UnsafeCheckpointError: the pickle references or calls something not allowed;
            the message names the global and ``source``.
        CorruptCheckpointError: the bytes are truncated or are not a ``Metadata`` pickle,
            or its fields have the wrong types or are inconsistent (overlapping chunks,
            see :func:`.metadata_check.check_metadata`).
    """
    try:
        data = fileobj.read()
    except OSError as exc:
        raise CorruptCheckpointError(f"{source}: cannot read checkpoint metadata ({exc})") from exc
    with gc_paused():
        result, declined = _load_fast(data, source)
        if declined is not None:
            logger.debug("%s: checked unpickling of .metadata (%s)", source, declined)
            result = _load_checked(data, source)
    if not isinstance(result, Metadata):
        raise CorruptCheckpointError(
            f"{source}: expected a pickled torch.distributed.checkpoint Metadata, "
            f"found {_describe(result)}"
        )
    entries = vars(result).get("state_dict_metadata")
    if not isinstance(entries, dict):
        raise CorruptCheckpointError(
            f"{source}: the pickled Metadata has no state_dict_metadata dict, found "
            f"{_describe(entries)}"
        )
    check_metadata(result, source)
    return result
