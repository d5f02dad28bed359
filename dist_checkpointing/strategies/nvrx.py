"""Megatron-Core 0.19's ``strategies.nvrx``: detecting nvidia-resiliency-ext (NVRx).

Megatron-Core can hand async saves to NVRx's writer (``async_strategy="nvrx"``).
This library saves with its own writer and does not use NVRx's; these helpers
only report whether a suitable NVRx is installed and build a request object of a
class the caller passes (NVRx's ``AsyncRequest`` or ours).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

NVRX_MIN_VERSION = "0.6.0"

_NVRX_ASYNC_SYMBOLS = {
    "core": ("AsyncCallsQueue", "AsyncRequest"),
    "cached_metadata_filesystem_reader": ("CachedMetadataFileSystemReader",),
    "filesystem_async": ("FileSystemWriterAsync", "get_write_results_queue", "_results_queue"),
    "state_dict_saver": (
        "CheckpointMetadataCache",
        "save_state_dict_async_finalize",
        "save_state_dict_async_plan",
    ),
}


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit()) if piece else ""
        if not digits:
            break
        parts.append(int(digits))
        if not piece.isdigit():
            break
    return tuple(parts)


def is_nvrx_min_version(version: str = NVRX_MIN_VERSION) -> bool:
    """Whether the installed nvidia-resiliency-ext is at least ``version`` (False when
    it is not installed)."""
    try:
        installed = importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        return False
    return _version_tuple(installed) >= _version_tuple(version)


def has_nvrx_async_support() -> bool:
    """Whether NVRx's async checkpointing modules, with the names Megatron-Core uses,
    are importable (and NVRx is recent enough)."""
    if not is_nvrx_min_version():
        return False
    prefix = "nvidia_resiliency_ext.checkpointing.async_ckpt."
    for module, names in _NVRX_ASYNC_SYMBOLS.items():
        try:
            mod = importlib.import_module(prefix + module)
        except ImportError:
            return False
        if not all(hasattr(mod, name) for name in names):
            return False
    return True


def make_nvrx_async_request(
    async_request_cls: type,
    async_fn: Callable[..., Any],
    async_fn_args: Any,
    finalize_fns: list[Callable[..., Any]],
    async_fn_kwargs: dict[str, Any] | None = None,
    preload_fn: Callable[..., Any] | None = None,
) -> Any:
    """``async_request_cls(async_fn, async_fn_args, finalize_fns, async_fn_kwargs=...,
    preload_fn=...)``: the request in the form NVRx's (and our) ``AsyncRequest`` takes."""
    return async_request_cls(
        async_fn,
        async_fn_args,
        finalize_fns,
        async_fn_kwargs=async_fn_kwargs or {},
        preload_fn=preload_fn,
    )


__all__ = [
    "NVRX_MIN_VERSION",
    "has_nvrx_async_support",
    "is_nvrx_min_version",
    "make_nvrx_async_request",
]
