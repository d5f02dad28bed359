"""Bounded text for values read from a checkpoint (for error messages).

``f"{value!r:.200}"`` computes the whole ``repr`` before cutting it: a small pickle
whose lists share each other through the memo has a repr of 2^64 items, and formatting
one error message would never end. :func:`short_repr` never visits more than a few
dozen objects, and never calls an object's own ``__repr__``.
"""

from __future__ import annotations

import reprlib
from typing import Any


class _ShortRepr(reprlib.Repr):
    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxtuple = self.maxlist = self.maxarray = self.maxdict = 6
        self.maxset = self.maxfrozenset = self.maxdeque = 6
        self.maxstring = 80
        self.maxlong = 40
        self.maxother = 60

    def repr_bytes(self, x: bytes, level: int) -> str:
        return repr(x[:40]) + ("..." if len(x) > 40 else "")

    def repr_dtype(self, x: Any, level: int) -> str:
        return str(x) if type(x).__module__ == "torch" else self.repr_instance(x, level)

    def repr_instance(self, x: Any, level: int) -> str:
        # Never the object's own __repr__ (it may be huge, slow or not ours).
        return f"<{type(x).__module__}.{type(x).__qualname__}>"


_SHORT = _ShortRepr()


def short_repr(value: object, limit: int = 200) -> str:
    """A repr of ``value`` of at most ``limit`` characters, in bounded time."""
    try:
        text = _SHORT.repr(value)
    except Exception:  # noqa: BLE001 - a message must never fail
        text = f"<{type(value).__qualname__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = ["short_repr"]
