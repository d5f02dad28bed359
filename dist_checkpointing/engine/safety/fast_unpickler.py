"""The fast unpickler: pickle's C unpickler over per-load shadow copies of the
allowlisted classes.

Why the fast unpickler is safe. Its opcodes can only call, build or fill objects the
file can reach: literals, what ``find_class`` returns, and what calling those returns.

* Allowlisted dataclasses are handed out as private subclasses ("shadows") made for
  this load: BUILD on a class object (``Metadata.__repr__ = ...``) changes only the
  shadow, which is discarded; shadows refuse ``setattr`` (no BUILD slot state, so no
  ``__class__``/``__dict__`` swaps), and all but ``SavePlan`` take no constructor
  arguments. After the load every shadow instance is switched to its real class.
* Every other allowlisted callable is a sealed wrapper (no ``__dict__``, no settable
  attribute) that validates its arguments; shared singletons it would return (enum
  members, paths) come back as sealed tokens, replaced after the load.
  ``torch.Size``, ``OrderedDict``, ``set``, ``frozenset`` and dtypes are immutable
  built-in types and values, handed out as they are.
* So everything a file can call is allowlisted code that only builds data, and
  everything it can reach and mutate was created by this load. Persistent ids are
  refused; copyreg extension codes would bypass ``find_class`` through pickle's
  process-wide extension cache, so the fast path is skipped while any is registered.
* The result is then walked: only plain data, containers and allowlisted instances
  whose attribute names are plain (no dunder) strings are accepted; a shadow that was
  changed during the load makes the checked unpickler decide instead.
"""

from __future__ import annotations

import copyreg
import functools
import io
import pickle
from collections.abc import Mapping
from typing import Any, BinaryIO

from dist_checkpointing.errors import UnsafeCheckpointError

from .adoption import _Adoption
from .allowlist import (
    _RECONSTRUCTOR_GLOBAL,
    _allowlist,
    _Call,
    _find_allowed,
    _py3_name,
)
from .shadows import _reconstruct_shadow, _Shadows


class _FastUnpickler(pickle.Unpickler):
    """pickle's C unpickler, resolving globals in this load's table only."""

    def __init__(
        self, fileobj: BinaryIO, *, source: str, table: Mapping[str, object], py2_names: bool
    ) -> None:
        super().__init__(fileobj)
        self._source = source
        self._table = table
        self._py2_names = py2_names

    def find_class(self, module: str, name: str) -> Any:
        if self._py2_names:  # protocols 0-2; the C default does this renaming too
            module, name = _py3_name(module, name)
        return _find_allowed(self._table, self._source, module, name)

    def persistent_load(self, pid: Any) -> Any:
        # Declined rather than refused here: the checked unpickler builds the message.
        raise pickle.UnpicklingError("persistent ids are not allowed")


def _extensions_registered() -> bool:
    """Whether copyreg extension codes exist in this process. The C unpickler resolves
    a cached code without ``find_class``, so the fast path must not run then."""
    registry = getattr(copyreg, "_inverted_registry", None)
    cache = getattr(copyreg, "_extension_cache", None)
    return registry is None or cache is None or bool(registry) or bool(cache)


def _load_fast(data: bytes, source: str) -> tuple[object, str | None]:
    """``(result, None)``, or ``(None, why)`` when the checked unpickler must decide.

    Raises:
        UnsafeCheckpointError: the pickle names a global that is not allowed.
    """
    if _extensions_registered():
        return None, "copyreg extension codes are registered in this process"
    allow = _allowlist()
    shadows = _Shadows.create(allow)
    table = {**allow.fast_globals, **shadows.by_name}
    allowed = frozenset(id(shadow) for shadow in shadows.real_of)
    table[_RECONSTRUCTOR_GLOBAL] = _Call(functools.partial(_reconstruct_shadow, allowed))
    py2_names = not (data[:1] == pickle.PROTO and len(data) > 1 and data[1] >= 3)
    unpickler = _FastUnpickler(io.BytesIO(data), source=source, table=table, py2_names=py2_names)
    try:
        result = unpickler.load()
    except (UnsafeCheckpointError, MemoryError):
        raise
    except Exception as exc:  # the checked unpickler says precisely what is wrong
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        changed = shadows.repair()
    if changed is not None:
        return None, f"the pickle changed class {changed}"
    reason = _Adoption(shadows, budget=len(data)).run(result)
    if reason is not None:
        return None, f"the result holds {reason}"
    return result, None
