"""Reading ``.metadata`` without executing code: :func:`load_metadata`.

torch's own reader unpickles ``.metadata`` with plain :mod:`pickle`, which runs any
callable the file names. :func:`load_metadata` admits only the allowlist of plain data
types (:mod:`.allowlist`), first with the fast unpickler (:mod:`.fast_unpickler`),
and hands every file it declines to the checked one (:mod:`.restricted_unpickler`).
A large file is parsed first in a forked child under a CPU-time limit
(:mod:`.cpu_bounded`), so that a crafted one cannot keep the loader busy for minutes.

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
from contextlib import AbstractContextManager
from typing import Any, BinaryIO, TypeVar, cast

from torch.distributed.checkpoint.metadata import (
    Metadata,
)

from dist_checkpointing.engine import knobs
from dist_checkpointing.engine.process import gc_paused
from dist_checkpointing.errors import CorruptCheckpointError

from .cpu_bounded import run_cpu_bounded
from .fast_unpickler import _extensions_registered, _load_fast
from .metadata_check import check_metadata, check_plain
from .pickle_scan import check_pickle
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
    4. The parse takes bounded CPU time (crafted dict keys whose hashes collide make
       unpickling quadratic): a file of 16 KiB or more is parsed first in a forked
       child under ``RLIMIT_CPU`` (knobs ``METADATA_PARSE_CPU_S`` + ``..._PER_MIB`` per
       MiB, ``METADATA_PARSE_GUARD=0`` turns it off), a smaller one passes the opcode
       scan of :func:`.pickle_scan.check_pickle` first.

    Raises:
        UnsafeCheckpointError: the pickle references or calls something not allowed;
            the message names the global and ``source``.
        CorruptCheckpointError: the bytes are truncated or are not a ``Metadata`` pickle,
            or its fields have the wrong types or are inconsistent (overlapping chunks,
            see :func:`.metadata_check.check_metadata`), or its parse would take too long.
    """
    try:
        data = fileobj.read()
    except OSError as exc:
        raise CorruptCheckpointError(f"{source}: cannot read checkpoint metadata ({exc})") from exc
    _bound_parse_cost(data, source)
    return _parse(data, source, _STACK_LOCK)


def _parse(data: bytes, source: str, lock: AbstractContextManager[object]) -> Metadata:
    result = _with_stack_for(data, lambda: _unpickle(data, source), lock)
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


# The parse time. Dict keys whose hashes collide make unpickling quadratic, inside one
# opcode (see :mod:`.cpu_bounded`): a .metadata of FORK_MIN_BYTES or more is parsed first
# in a forked child under a CPU-time limit (base + per MiB, knobs METADATA_PARSE_*).
# Legitimate files parse at 0.13-0.21 s/MiB with the fast unpickler (0.85 with only the
# checked one), so the default 1 s/MiB (4 s without the fast one) leaves a factor of 5.
# A smaller file gets the opcode scan of torch.save payloads instead (pickle_scan, about
# 1 s/MiB: at most 20 ms here): the worst collisions fit in it take about 0.2 s
# (measured: bench/metadata_guard.py), and the scan bounds what size does not (a key whose
# hash walks a structure shared through the memo, exponentially).
FORK_MIN_BYTES = 16 << 10
# The per-MiB allowance is multiplied by this where only the checked unpickler can run.
_CHECKED_ONLY_FACTOR = 4
_HINT = (
    " (a file you trust: raise DIST_CKPT_METADATA_PARSE_CPU_S(_PER_MIB), or set "
    "DIST_CKPT_METADATA_PARSE_GUARD=0)"
)


def _bound_parse_cost(data: bytes, source: str) -> None:
    """Refuse a .metadata whose parse would take too long (see the comment above).

    Raises:
        CorruptCheckpointError: naming ``source`` and the bound exceeded.
    """
    if not knobs.METADATA_PARSE_GUARD.get():
        return
    if len(data) < FORK_MIN_BYTES:
        check_pickle(data, source)
        return
    per_mib = knobs.METADATA_PARSE_CPU_S_PER_MIB.get()
    if _extensions_registered():
        per_mib *= _CHECKED_ONLY_FACTOR
    budget = knobs.METADATA_PARSE_CPU_S.get() + per_mib * len(data) / (1 << 20)
    # The child is the only thread of its process: a fresh lock, never one that another
    # thread of this process held at the fork.
    run_cpu_bounded(
        lambda: _parse(data, source, threading.Lock()), cpu_s=budget, source=source, hint=_HINT
    )


# The nesting. The opcode scan of torch.save payloads (:func:`.pickle_scan.check_pickle`)
# costs ten times the fast unpickler: a large .metadata is instead unpickled on a thread
# whose stack holds the deepest nesting its opcodes allow (:func:`_with_stack_for`), and
# the result is refused if it nests deeper than MAX_NESTING (adoption and
# :func:`check_plain`).

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


def _with_stack_for(data: bytes, fn: Callable[[], T], lock: AbstractContextManager[object]) -> T:
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

    with lock:  # threading.stack_size is process-wide
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
