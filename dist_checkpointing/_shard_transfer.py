"""Shards as bytes: what the fully parallel exchange (:mod:`..exchange_utils`) sends and
how a received shard lands in the request's tensor.

Collectives move bytes (``as_bytes``), so every dtype travels (gloo refuses FP8).
A received shard is copied into its destination tensor as soon as its bytes arrive
(``deliver``), so a load holds at most the buffer it is receiving beyond its state;
only a shard whose request has no usable tensor becomes a new CPU tensor
(``_from_bytes``).
"""

from __future__ import annotations

import torch

from .mapping import ShardedTensor
from .utils import _ShardId


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor. Collectives move bytes, so every dtype
    travels (gloo refuses FP8, for one)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return (
        flat.view(torch.uint8)
        if flat.numel()
        else torch.empty(0, dtype=torch.uint8, device=flat.device)
    )


def shard_shape(sh: ShardedTensor) -> tuple[int, ...]:
    """The shape of a shard's data: its local shape, or its flat range's length."""
    if sh.flattened_range is not None:
        return (sh.flattened_range.stop - sh.flattened_range.start,)
    return tuple(sh.local_shape)


def _from_bytes(data: torch.Tensor, sh: ShardedTensor) -> torch.Tensor:
    """The shard described by ``sh`` from its bytes (on the CPU)."""
    data = data.cpu()
    if data.numel() == 0:
        return torch.empty(shard_shape(sh), dtype=sh.dtype)
    return data.view(sh.dtype).reshape(shard_shape(sh))


def direct_target(sh: ShardedTensor | None, size: int, device: torch.device) -> torch.Tensor | None:
    """The destination tensor of ``sh`` if a broadcast can land in it as is: contiguous,
    on the group's device, exactly ``size`` bytes."""
    data = None if sh is None else sh.data
    if (
        type(data) is torch.Tensor
        and data.device == device
        and data.is_contiguous()
        and data.numel() * data.element_size() == size
        and size > 0
    ):
        return data
    return None


def deliver(
    bucket: torch.Tensor,
    entries: list[tuple[_ShardId, int, int]],
    unloaded_shards: dict[_ShardId, ShardedTensor],
    result: dict[_ShardId, torch.Tensor],
) -> None:
    """The shards this rank wanted from a received bucket, into ``result``: each copied
    into its destination tensor where the request has one (so the bucket is free once
    its broadcast is delivered: a load holds at most one bucket beyond its state), else
    a CPU tensor over the bucket's bytes (a view when every shard of the bucket is
    wanted, else a copy, not to keep the rest alive)."""
    spare: list[tuple[_ShardId, int, int]] = []
    for entry in entries:
        shard_id, offset, size = entry
        sh = unloaded_shards.get(shard_id)
        if sh is None:
            continue
        target = _copy_target(sh, size)
        if target is None:
            spare.append(entry)
            continue
        if size:
            target.copy_(bucket[offset : offset + size].view(target.dtype).view(target.shape))
        result[shard_id] = target
    if not spare:
        return
    bucket = bucket.cpu()
    whole = len(spare) == len(entries)
    for shard_id, offset, size in spare:
        data = bucket[offset : offset + size]
        result[shard_id] = _from_bytes(data if whole else data.clone(), unloaded_shards[shard_id])


def _copy_target(sh: ShardedTensor, size: int) -> torch.Tensor | None:
    """The destination tensor of ``sh`` if a received shard of ``size`` bytes can be
    copied into it as is (any device and strides; its dtype and shape)."""
    data = sh.data
    if (
        type(data) is torch.Tensor
        and data.dtype == sh.dtype
        and tuple(data.shape) == shard_shape(sh)
        and data.numel() * data.element_size() == size
    ):
        return data
    return None


__all__ = ["as_bytes", "deliver", "direct_target", "shard_shape"]
