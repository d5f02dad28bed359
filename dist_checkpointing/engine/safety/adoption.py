"""After a fast load: walk the result, accept only plain data and allowlisted
instances, switch shadow instances to their real classes and resolve tokens.

Anything else (an unknown type, a dunder attribute name, a shadow changed during the
load) sends the file to the checked unpickler.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from itertools import chain, repeat
from typing import Any

import torch

from .allowlist import _is_dunder, _Token
from .bounded import short_repr
from .shadows import _Shadows

# Leaves of a metadata pickle: values that hold no object references to check.
_ATOMIC: frozenset[type] = frozenset(
    {type(None), bool, int, float, complex, str, bytes, bytearray}
    | {torch.dtype, torch.layout, torch.memory_format, torch.Size}
)


_CONTAINERS: frozenset[type] = frozenset({dict, OrderedDict, list, tuple, set, frozenset})


_BATCH = 4096

_MAX_LEVELS = 512  # deeper results go to the checked unpickler, which refuses them  # objects handled together; small enough to stay in the CPU caches


def _bad_names(attrs: Mapping[Any, object]) -> list[object]:
    return [key for key in attrs if type(key) is not str or _is_dunder(key)]


def _without_tokens(values: list[Any]) -> list[Any]:
    # Token values are the process's own objects (enum members, fresh paths): not walked.
    return [value for value in values if type(value) is not _Token]


def _resolve_tokens(mapping: dict[Any, Any]) -> None:
    mapping.update({key: value.value for key, value in mapping.items() if type(value) is _Token})


class _Adoption:
    """Turns the fast unpickler's result into plain allowed data, or says why not.

    Every shadow instance is switched to its real class, and every token is replaced by
    its value where it sits in a list, a dict value or an attribute. The walk is
    breadth-first and handles a level's objects of one type in batches with C-level
    map()s: a large Metadata has ~10 objects per tensor, and per-object Python code
    would cost as much as the unpickling itself.
    """

    def __init__(self, shadows: _Shadows, budget: int) -> None:
        self._shadows = shadows
        # Objects are queued once per reference. A legitimate pickle spends at least a
        # byte per reference; one that shares objects beyond that is left to the checked
        # unpickler rather than walked (sharing could make the walk exponential).
        self._budget = budget
        self._seen: set[int] = set()  # ids of containers walked (instances change type)
        self._queued: dict[type, list[Any]] = {}

    def run(self, root: object) -> str | None:
        """Adopt everything reachable from ``root``; None, or why it is not plain data."""
        reason = self._queue([root])
        levels = 0
        while reason is None and self._queued:
            levels += 1
            if levels > _MAX_LEVELS:
                return f"nesting deeper than {_MAX_LEVELS} levels"
            level, self._queued = self._queued, {}
            for kind, objs in level.items():
                reason = self._adopt(kind, objs)
                if reason is not None:
                    break
        return reason

    def _adopt(self, kind: type, objs: list[Any]) -> str | None:
        real = self._shadows.real_of.get(kind)
        if real is not None:
            batches = (objs[i : i + _BATCH] for i in range(0, len(objs), _BATCH))
            return next(filter(None, (self._instances(real, batch) for batch in batches)), None)
        if kind in _CONTAINERS:
            unique = dict(zip(map(id, objs), objs))
            fresh = [obj for key, obj in unique.items() if key not in self._seen]
            self._seen.update(unique)
            batches = (fresh[i : i + _BATCH] for i in range(0, len(fresh), _BATCH))
            return next(filter(None, (self._containers(kind, batch) for batch in batches)), None)
        if kind in self._shadows.adopted:  # reached again after its adoption
            return None
        return f"an object of type {kind.__qualname__}"

    def _queue(self, values: list[Any]) -> str | None:
        """Queue the non-atomic ``values``; ``"token"`` (nothing queued) if one is a token."""
        self._budget -= len(values)
        if self._budget < 0:
            return "objects shared more often than the file has bytes"
        present = set(map(type, values))
        kinds = present - _ATOMIC
        if not kinds:
            return None
        if _Token in kinds:
            return "token"
        if len(kinds) > 1:
            for value in values:
                if type(value) not in _ATOMIC:
                    self._queued.setdefault(type(value), []).append(value)
            return None
        (kind,) = kinds
        if len(present) > 1:
            values = [value for value in values if type(value) is kind]
        self._queued.setdefault(kind, []).extend(values)
        return None

    def _instances(self, real: type, objs: list[Any]) -> str | None:
        attrs: list[dict[str, Any]] = list(map(vars, objs))
        fields = self._shadows.field_names[real]
        if all(map(fields.issuperset, attrs)):
            names: Iterable[str] = fields
        else:  # extra attributes (Megatron's on Metadata): names must be plain, as in BUILD
            bad = [name for names in map(_bad_names, attrs) for name in names]
            if bad:
                return f"attribute names {short_repr(bad)} on {real.__qualname__}"
            names = {name for instance_attrs in attrs for name in instance_attrs}
        for name in names:
            values = list(map(dict.get, attrs, repeat(name)))
            reason = self._queue(values)
            if reason == "token":
                for instance_attrs, value in zip(attrs, values):
                    if type(value) is _Token:
                        instance_attrs[name] = value.value
                reason = self._queue(_without_tokens(values))
            if reason is not None:
                return reason
        deque(map(object.__setattr__, objs, repeat("__class__"), repeat(real)), maxlen=0)
        return None

    def _containers(self, kind: type, objs: list[Any]) -> str | None:
        if kind is dict or kind is OrderedDict:
            reason = self._queue(list(chain.from_iterable(map(dict.keys, objs))))
            if reason == "token":
                return "a dict key that is an enum member or a path"
            values = list(chain.from_iterable(map(dict.values, objs)))
            if reason is None:
                reason = self._queue(values)
            if reason == "token":
                deque(map(_resolve_tokens, objs), maxlen=0)
                reason = self._queue(_without_tokens(values))
            attrs = [vars(obj) for obj in objs if kind is OrderedDict and vars(obj)]
            if reason is None and attrs:  # BUILD set attributes on an OrderedDict
                bad = [name for names in map(_bad_names, attrs) for name in names]
                reason = (
                    f"attribute names {short_repr(bad)}" if bad else self._containers(dict, attrs)
                )
            return reason
        items = list(chain.from_iterable(objs))
        reason = self._queue(items)
        if reason == "token" and kind is list:
            for obj in objs:
                obj[:] = [item.value if type(item) is _Token else item for item in obj]
            reason = self._queue(_without_tokens(items))
        return "an enum member or a path inside a tuple or set" if reason == "token" else reason
