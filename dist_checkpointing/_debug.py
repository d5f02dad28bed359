"""Debug helpers Megatron-Core keeps in ``dist_checkpointing.utils`` (re-exported there).

``logger_stack`` nests scope names (kept in a context variable, so threads and
tasks do not see each other's scopes), ``debug_time`` logs how long a block or a
decorated function took, ``debug_msg`` logs under the current scope.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

_fallback_logger = logging.getLogger("dist_checkpointing.utils")
_scope: contextvars.ContextVar[tuple[tuple[str, ...], logging.Logger | None]] = (
    contextvars.ContextVar("dist_checkpointing_logger_stack", default=((), None))
)


@contextmanager
def logger_stack(
    name: str | None = None, current_logger: logging.Logger | None = None
) -> Iterator[tuple[str, logging.Logger]]:
    """Enter a scope: yields ``(dotted scope names, logger)``; the logger is
    ``current_logger``, else the enclosing scope's, else this package's."""
    names, outer = _scope.get()
    names = (*names, name) if name else names
    logger = current_logger or outer or _fallback_logger
    token = _scope.set((names, current_logger or outer))
    try:
        yield ".".join(names), logger
    finally:
        _scope.reset(token)


@contextmanager
def debug_time(
    name: str,
    logger: logging.Logger | None = None,
    threshold: float = float("-inf"),
    level: int | None = None,
) -> Iterator[None]:
    """Log how long the block (or a function it decorates) took, when over ``threshold``
    seconds; at DEBUG unless ``level`` says otherwise."""
    with logger_stack(name, logger) as (scope, log):
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            if elapsed > threshold:
                log.log(
                    level if level is not None else logging.DEBUG, "%s took %.4fs", scope, elapsed
                )


def debug_msg(msg: str) -> None:
    """Log ``msg`` at DEBUG, prefixed with the current scope."""
    with logger_stack(None, None) as (scope, log):
        log.debug("%s %s", scope, msg)


def zip_strict(*args: Iterable[Any]) -> Iterator[tuple[Any, ...]]:
    """``zip`` that refuses iterables of different lengths (and says the lengths)."""
    lists = [list(a) for a in args]
    lengths = [len(a) for a in lists]
    if len(set(lengths)) > 1:
        raise ValueError(f"Tried to zip iterables of unequal lengths: {lengths}")
    return zip(*lists)


__all__ = ["debug_msg", "debug_time", "logger_stack", "zip_strict"]
