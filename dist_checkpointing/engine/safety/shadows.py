"""Shadows: private subclasses of the allowlisted dataclasses, made for one load.

BUILD on a class object changes only the shadow, which is discarded; shadows refuse
``setattr`` and, but for ``SavePlan``, constructor arguments. After the load every
shadow instance is switched to its real class (see :mod:`.adoption`).
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Mapping
from typing import Any, cast

from .allowlist import (
    _NOT_FOUND,
    _OBJECT_BASE,
    _Allowlist,
    _Token,
)


def _refuse_setattr(self: object, name: str, value: object) -> None:
    raise AttributeError(f"cannot set {name!r} while unpickling {type(self).__qualname__}")


def _refuse_delattr(self: object, name: str) -> None:
    raise AttributeError(f"cannot delete {name!r} while unpickling {type(self).__qualname__}")


def _setstate_via_real(real: type, setstate: Callable[[Any, Any], None]) -> Callable[..., None]:
    """A shadow's ``__setstate__``: tokens resolved, the real ``__setstate__`` run on a
    scratch instance of the real class (shadows refuse setattr), its fields copied over."""

    def __setstate__(self: object, state: object) -> None:
        if type(state) is tuple:
            state = tuple([v.value if type(v) is _Token else v for v in state])
        scratch: Any = object.__new__(real)
        setstate(scratch, state)
        vars(self).update(vars(scratch))

    return __setstate__


def _make_shadow(real: type, constructible: bool) -> type:
    """A private subclass of ``real`` for one load; see the module docstring."""
    namespace: dict[str, object] = {
        "__slots__": (),
        "__module__": real.__module__,
        "__qualname__": real.__qualname__,
        "__setattr__": _refuse_setattr,
        "__delattr__": _refuse_delattr,
    }
    if not constructible:
        # object's own __init__ makes object.__new__ refuse arguments: NEWOBJ and REDUCE
        # with arguments fail, as the checked unpickler requires.
        namespace["__init__"] = object.__init__
    setstate = getattr(real, "__setstate__", None)
    if setstate is not None and setstate is not getattr(object, "__setstate__", None):
        namespace["__setstate__"] = _setstate_via_real(real, setstate)
    return type(real)(real.__name__, (real,), namespace)


@dataclasses.dataclass(frozen=True)
class _Shadows:
    """This load's shadow classes, and what they looked like when made."""

    real_of: Mapping[type, type]  # shadow -> real class
    by_name: Mapping[str, type]  # pickle name -> shadow
    made: Mapping[type, tuple[dict[str, object], tuple[type, ...], str, str]]
    field_names: Mapping[type, frozenset[str]]  # real class -> dataclass field names
    adopted: frozenset[type]  # the real classes

    @classmethod
    def create(cls, allow: _Allowlist) -> _Shadows:
        by_real = {
            real: _make_shadow(real, constructible=id(real) in allow.callables)
            for real in set(allow.shadowed.values())
        }
        return cls(
            real_of={shadow: real for real, shadow in by_real.items()},
            by_name={name: by_real[real] for name, real in allow.shadowed.items()},
            made={
                s: (dict(vars(s)), s.__bases__, s.__name__, s.__qualname__)
                for s in by_real.values()
            },
            field_names={
                real: frozenset(f.name for f in dataclasses.fields(real)) for real in by_real
            },
            adopted=frozenset(by_real),
        )

    def repair(self) -> str | None:
        """Undo what the pickle changed on a shadow (BUILD on a class object), so that
        nothing it set (``__del__``, ...) outlives the load; the class's name, if any."""
        changed = None
        for shadow, (attrs, bases, name, qualname) in self.made.items():
            now = vars(shadow)
            if (
                shadow.__bases__ is bases
                and shadow.__name__ == name
                and shadow.__qualname__ == qualname
                and len(now) == len(attrs)
                and all(now.get(key, _NOT_FOUND) is value for key, value in attrs.items())
            ):
                continue
            changed = qualname
            shadow.__bases__, shadow.__name__, shadow.__qualname__ = bases, name, qualname
            for key in [key for key in now if key not in attrs]:
                delattr(shadow, key)
            for key, value in attrs.items():
                if now.get(key, _NOT_FOUND) is not value:
                    setattr(shadow, key, value)
        return changed


def _reconstruct_shadow(
    allowed: frozenset[int], cls: object, base: object, state: object
) -> object:
    """The fast unpickler's ``copyreg._reconstructor``: an empty instance of a shadow."""
    if id(cls) not in allowed or base is not _OBJECT_BASE or state is not None:
        raise pickle.UnpicklingError("copyreg._reconstructor outside (shadow, object, None)")
    return object.__new__(cast(type, cls))
