"""Where the time of a save or load goes: one INFO line per call, DEBUG per phase.

:class:`OpAccount` is created at the start of :func:`~dist_checkpointing.save` or
:func:`~dist_checkpointing.load`; each phase runs under :meth:`OpAccount.phase`
(a DEBUG line with its seconds), and :meth:`OpAccount.report` logs the INFO line::

    save /ckpt/iter_0000100: rank 0 wrote 1200000000 bytes in 2 file(s), 0.80s, 1.50 GB/s
    save /ckpt/iter_0000100: rank 0 wrote 1200000000 bytes in 2 file(s), 3.10s, 0.39 GB/s, blocked 0.21s (async)
    load /ckpt/iter_0000100: rank 0 read 600000000 bytes from 2 file(s), 0.40s, 1.50 GB/s

Byte counts are this rank's: for a save, the sizes of the files it wrote; for a
load, the bytes of the tensors it received. Nothing is computed when INFO is off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .dict_utils import nested_values

__all__ = ["OpAccount", "tensor_bytes"]


def tensor_bytes(state: Any) -> int:
    """Bytes of every tensor in a nested state dict (dicts and lists)."""
    return sum(
        t.numel() * t.element_size() for t in nested_values(state) if isinstance(t, torch.Tensor)
    )


class OpAccount:
    """The clock of one save or load on this rank."""

    def __init__(self, logger: logging.Logger, op: str, where: object, rank: int) -> None:
        self.logger = logger
        self.op = op
        self.where = where
        self.rank = rank
        self.start = time.perf_counter()
        self.blocked: float | None = None
        self.phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self.phases[name] = self.phases.get(name, 0.0) + seconds
            self.logger.debug(
                "%s %s: rank %d %s %.3fs", self.op, self.where, self.rank, name, seconds
            )

    def mark_blocked(self) -> None:
        """The caller got control back (an async save returns its request)."""
        self.blocked = time.perf_counter() - self.start

    def report(self, measure: Callable[[], tuple[int, Iterable[str]]]) -> None:
        """Log the INFO line; ``measure()`` gives ``(bytes, file names)`` (only if logged)."""
        if not self.logger.isEnabledFor(logging.INFO):
            return
        try:
            nbytes, files = measure()
        except Exception as e:  # accounting must never fail a save or load
            self.logger.debug("%s %s: could not measure bytes (%s)", self.op, self.where, e)
            return
        seconds = max(time.perf_counter() - self.start, 1e-9)
        verb = "wrote" if self.op == "save" else "read"
        prep = "in" if self.op == "save" else "from"
        blocked = "" if self.blocked is None else f", blocked {self.blocked:.3f}s (async)"
        self.logger.info(
            "%s %s: rank %d %s %d bytes %s %d file(s), %.3fs, %.3f GB/s%s",
            self.op,
            self.where,
            self.rank,
            verb,
            nbytes,
            prep,
            len(set(files)),
            seconds,
            nbytes / 1e9 / seconds,
            blocked,
        )
