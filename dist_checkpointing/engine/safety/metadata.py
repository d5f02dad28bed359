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
import threading
from collections.abc import Callable
from typing import Any, BinaryIO, TypeVar, cast

from torch.distributed.checkpoint.metadata import (
    Metadata,
)

from dist_checkpointing.engine.process import gc_paused
from dist_checkpointing.errors import CorruptCheckpointError

from .fast_unpickler import _load_fast
from .metadata_check import check_metadata, check_plain
from .restricted_unpickler import _describe, _load_checked

logger = logging.getLogger(__name__)

T = TypeVar("T")


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
    result = _with_stack_for(data, lambda: _unpickle(data, source))
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


# The opcode scan of torch.save payloads (:func:`.pickle_scan.check_pickle`) costs
# ten times the fast unpickler: .metadata is instead unpickled on a thread whose stack
# holds the deepest nesting its opcodes allow (:func:`_with_stack_for`), and the result
# is refused if it nests deeper than MAX_NESTING (adoption and :func:`check_plain`).
# Not bounded here: dict keys with colliding hashes (quadratic time).

# C stack one nesting level may need while CPython hashes or compares it (measured:
# under 100 bytes), with margin; and opcodes that can add a level.
_STACK_PER_LEVEL = 256
_NESTING_OPCODES = (
    b"\x85",
    b"\x86",
    b"\x87",
    b"t",
    b"\x91",
    b"b",
    b"R",
    b"\x81",
    b"\x92",
    b"o",
    b"i",
)
_MAIN_THREAD_LEVELS = 4096


def _unpickle(data: bytes, source: str) -> object:
    with gc_paused():
        result, declined = _load_fast(data, source)
        if declined is not None:
            logger.debug("%s: checked unpickling of .metadata (%s)", source, declined)
            result = _load_checked(data, source)
            check_plain(result, source)
    return result


def _with_stack_for(data: bytes, fn: Callable[[], T]) -> T:
    """``fn()``, on a thread with a stack deep enough for any nesting ``data`` can
    express: CPython hashes a nested tuple used as a dict key recursively in C,
    without a recursion limit, and a deep enough one would crash the process."""
    levels = sum(map(data.count, _NESTING_OPCODES))
    if levels <= _MAIN_THREAD_LEVELS:
        return fn()
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            outcome.append((False, exc))

    with _STACK_LOCK:
        old = threading.stack_size((levels * _STACK_PER_LEVEL + (16 << 20)) // 4096 * 4096)
        try:
            worker = threading.Thread(target=run, name="dcp-metadata-unpickle")
            worker.start()
        finally:
            threading.stack_size(old)
    worker.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return cast(T, value)


_STACK_LOCK = threading.Lock()
