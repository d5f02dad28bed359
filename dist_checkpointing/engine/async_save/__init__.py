"""Async saves: requests, the callers that run them in the background, the queue.

A save is split into a short blocking part (staging: copy tensors off the
accelerator) and a long part (writing files) that runs in another process while
training goes on. :class:`AsyncRequest` (:mod:`.request`) describes one such
save; :class:`AsyncCallsQueue` (:mod:`.queue`) runs requests through a caller
(:mod:`.temporal`: a fresh process per request; :mod:`.persistent`: one
long-lived worker per rank) and finalizes them once *every* rank has finished
writing, as the ranks agree in :mod:`.agreement`.
"""

from __future__ import annotations

from .caller import AsyncCaller
from .persistent import PersistentAsyncCaller
from .queue import AsyncCallsQueue
from .request import AsyncRequest
from .temporal import TemporalAsyncCaller

__all__ = [
    "AsyncCaller",
    "AsyncCallsQueue",
    "AsyncRequest",
    "PersistentAsyncCaller",
    "TemporalAsyncCaller",
]
