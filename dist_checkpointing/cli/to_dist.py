"""A ``torch.save`` or safetensors checkpoint into a sharded checkpoint for N ranks.

Rank ``r`` of ``N`` stores rows ``[r*G0/N, (r+1)*G0/N)`` of every tensor whose first
axis divides by N, and a replica of the others (rank 0 writes it). With N > 1 the
ranks are N worker processes in a gloo group (a FileStore in a temporary
directory, loopback only); each reads only its rows (memory-mapped torch files,
lazy safetensors slices).
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from datetime import timedelta
from fnmatch import fnmatchcase
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from .. import serialization
from ..mapping import ShardedTensor
from . import safetensors_io
from .source import one_line
from .ui import CliError

_TIMEOUT_S = 3600.0


def _shard(key: str, shape: tuple[int, ...], read: Any, rank: int, world: int) -> ShardedTensor:
    """This rank's part of one tensor; ``read(rows)`` returns the given rows of axis 0."""
    if len(shape) >= 1 and shape[0] >= world and shape[0] % world == 0:
        rows = shape[0] // world
        local = read(slice(rank * rows, (rank + 1) * rows)).clone()
        return ShardedTensor.from_rank_offsets(key, local, (0, rank, world))
    return ShardedTensor.from_rank_offsets(key, read(None).clone(), replica_id=rank)


def _wanted(key: str, pattern: str | None) -> bool:
    return pattern is None or fnmatchcase(key, pattern)


def _from_torch(
    node: dict[str, Any], prefix: str, rank: int, world: int, pattern: str | None
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in node.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            out[name] = _from_torch(value, key + ".", rank, world, pattern)
        elif isinstance(value, torch.Tensor):
            if _wanted(key, pattern):

                def read(rows: slice | None, _t: torch.Tensor = value) -> torch.Tensor:
                    return _t if rows is None else _t[rows]

                out[name] = _shard(key, tuple(value.shape), read, rank, world)
        else:
            out[name] = value
    return out


def rank_state_dict(
    kind: str, src: str, rank: int, world: int, pattern: str | None
) -> dict[str, Any]:
    """The sharded state dict rank ``rank`` of ``world`` saves."""
    if kind == "torch":
        state = torch.load(src, map_location="cpu", weights_only=True, mmap=True)
        return _from_torch(state, "", rank, world, pattern)
    return {
        key: _shard(key, shape, read, rank, world)
        for key, read, shape, _ in safetensors_io.iter_tensors(src)
        if _wanted(key, pattern)
    }


def _save(kind: str, src: str, dst: str, rank: int, world: int, pattern: str | None) -> None:
    sharded = rank_state_dict(kind, src, rank, world, pattern)
    serialization.save(sharded, dst)


def _worker(
    rank: int, world: int, store: str, args: tuple[str, str, str, str | None], conn: Connection
) -> None:
    kind, src, dst, pattern = args
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=_TIMEOUT_S),
        )
        _save(kind, src, dst, rank, world, pattern)
        conn.send(None)
    except BaseException as e:  # reported to the parent as one line
        conn.send(f"rank {rank}: {one_line(e)}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def convert_to_dist(kind: str, src: str, dst: str, world: int, pattern: str | None) -> None:
    """Write the sharded checkpoint (N worker processes when ``world > 1``)."""
    if world == 1 or dist.is_initialized():
        if dist.is_initialized() and dist.get_world_size() != world:
            raise CliError(
                "convert --to dist runs its own ranks: call it outside torch.distributed"
            )
        _save(kind, src, dst, 0, 1, pattern)
        return
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        pipes, procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker, args=(rank, world, store, (kind, src, dst, pattern), child)
            )
            p.start()
            child.close()
            pipes.append(parent)
            procs.append(p)
        errors = []
        for rank, conn in enumerate(pipes):
            msg: str | None = f"rank {rank}: no answer"
            try:
                if conn.poll(_TIMEOUT_S):
                    msg = conn.recv()
            except EOFError:
                msg = f"rank {rank}: worker process died"
            if msg is not None:
                errors.append(msg)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise CliError(errors[0])


__all__ = ["convert_to_dist", "rank_state_dict"]
