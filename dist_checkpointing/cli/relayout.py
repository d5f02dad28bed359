"""``convert --to torch_dist`` / ``--to raw_bytes``: a sharded checkpoint in the other layout.

One process reads every stored tensor whole (into file-backed memory next to the
destination, so the kernel can page it out), every ShardedObject and the common
state, through the public API, and saves them with the target layout's default
strategy. Tensors stored as distributed-optimizer flat ranges stay flat (one
range covering the whole tensor); the output loads into any layout.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from .. import serialization
from ..mapping import ShardedObject, ShardedTensor
from .ui import CliError

LAYOUTS = ("torch_dist", "raw_bytes")

#: ``alloc(where, shape, dtype)``: memory for one whole tensor (``convert.file_backed``).
Alloc = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]


def _request(src: str, where: str, file_backed: Alloc) -> dict[str, Any]:
    """Every stored tensor (whole, in file-backed memory) and object, by key."""
    request: dict[str, Any] = {}
    for key, sh in serialization.load_sharded_metadata(src).items():
        if isinstance(sh, ShardedTensor):
            if sh.flattened_range is None:
                data = file_backed(where, tuple(sh.global_shape), sh.dtype)
                request[key] = ShardedTensor.from_rank_offsets(key, data)
            else:
                numel = int(sh.flattened_range.stop)
                data = file_backed(where, (numel,), sh.dtype)
                request[key] = ShardedTensor.from_rank_offsets_flat(
                    key, data, tuple(sh.global_shape), flattened_range=slice(0, numel)
                )
        elif isinstance(sh, ShardedObject):
            request[key] = ShardedObject(sh.key, None, sh.global_shape, sh.global_offset)
    return request


def relayout(src: str, dst: str, layout: str, file_backed: Alloc) -> int:
    """Write the checkpoint ``src`` to the empty directory ``dst`` in ``layout``, each
    tensor read into ``file_backed`` memory; returns the number of tensors."""
    if layout not in LAYOUTS:
        raise CliError(f"unknown layout {layout!r}; one of {', '.join(LAYOUTS)}")
    where = os.path.dirname(os.path.abspath(dst))
    request = _request(src, where, file_backed)
    loaded = serialization.load(dict(request), src, validate_access_integrity=False)
    assert isinstance(loaded, dict)
    common = serialization.load_common_state_dict(src)
    state: dict[str, Any] = dict(common)
    for key, leaf in request.items():
        if key in common:
            raise CliError(f"{src}: stored key {key!r} collides with a common-state key")
        if isinstance(leaf, ShardedObject):
            leaf.data = loaded[key]
        state[key] = leaf
    strategy = serialization.get_default_save_sharded_strategy(layout, 1)
    serialization.save(state, dst, strategy, validate_access_integrity=False)
    return sum(isinstance(v, ShardedTensor) for v in request.values())


__all__ = ["LAYOUTS", "relayout"]
