"""Megatron-Core's ``strategies.async_utils`` module path: async save requests and queues.

The machinery lives in :mod:`dist_checkpointing.engine.async_save`; this module
is the import path Megatron-Core users already write.
"""

from __future__ import annotations

import logging

from ..engine.async_save import (
    AsyncCaller,
    AsyncCallsQueue,
    AsyncRequest,
    PersistentAsyncCaller,
    TemporalAsyncCaller,
)

logger = logging.getLogger(__name__)

__all__ = [
    "AsyncCaller",
    "AsyncCallsQueue",
    "AsyncRequest",
    "PersistentAsyncCaller",
    "TemporalAsyncCaller",
]
