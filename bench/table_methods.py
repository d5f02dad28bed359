"""The methods compared by the benchmark table (``bench/table.py``), one class each.

A method saves this rank's tensors (``dict[key, tensor]``) into a directory and loads
them back into the same tensors, in place. Each is run by every rank of the group, in
the same order. ``unavailable()`` says why a method cannot run here (the row then reads
"n/a (...)"); it must give the same answer on every rank.

- ``ours``: dist_checkpointing's default layout (``torch_dist`` v1), checksums on;
- ``raw_bytes``: dist_checkpointing's raw-bytes layout (``("raw_bytes", 1)``), when
  registered;
- ``fully_parallel``: every rank holds every tensor (a replicated layout); saved and
  loaded through the fully parallel wrappers around the default strategies;
- ``dcp``: plain ``torch.distributed.checkpoint`` with its default writer and reader;
- ``megatron``: Megatron-Core's ``dist_checkpointing`` (its default ``torch_dist``
  strategy with ``thread_count=2``, as ours), when ``megatron.core`` imports
  (``make bench`` installs 0.16.1 into ``.mcore-site/0.16.1``, see the Makefile). While
  it saves and loads, ``bench/mcore_compat.py`` gives its two CUDA calls CPU stand-ins on
  a machine without CUDA, and ``numpy.product`` under NumPy 2; nothing else is changed;
- ``raw``: the baseline: this rank's bytes in as many files as ``ours`` writes per
  rank, one sequential pass of 1 MiB writes + fsync each, read back into a preallocated buffer.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from common import drop_dir, fresh_dir, rank, raw_blob, raw_read, raw_write, world
from mcore_compat import stand_ins

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)

FILES_PER_RANK = 2  # data files per rank for our layouts, and for the raw baseline

Tensors = dict[str, torch.Tensor]


def sharded(local: Tensors, replicated: bool = False) -> dict[str, ShardedTensor]:
    """Each tensor as a whole global tensor (replica ``rank`` of it when replicated)."""
    replica = rank() if replicated else 0
    return {k: ShardedTensor.from_rank_offsets(k, t, replica_id=replica) for k, t in local.items()}


def fill_from(local: Tensors, loaded: dict[str, Any]) -> None:
    """Copy loaded values into ``local`` where a load returned new tensors."""
    for k, t in local.items():
        got = loaded[k]
        if got is not t and got.data_ptr() != t.data_ptr():
            t.copy_(got)


class Method:
    """One way of saving and loading; see the module docstring."""

    name = ""
    replicated = False  # every rank holds every tensor of the case
    plans = False  # has a planning step worth timing (first and cached)

    def unavailable(self) -> str | None:
        return None

    def setup(self, local: Tensors, root: str) -> None:
        """Before the timed runs of a case (outside them)."""

    def save(self, local: Tensors, path: str) -> None:
        raise NotImplementedError

    def load(self, local: Tensors, path: str) -> None:
        raise NotImplementedError

    def plan_save(self, local: Tensors, path: str, strategy: Any) -> Any:
        """The planning part of a save (validation and plan; no data written yet):
        returns what :meth:`finish_save` completes."""
        raise NotImplementedError

    def cached_strategy(self) -> Any:
        """A save strategy that reuses its plan for an unchanged structure."""
        raise NotImplementedError


class Ours(Method):
    name = "ours"
    plans = True
    backend, version = "torch_dist", 1

    def strategy(self, cached: bool = False) -> Any:
        return TorchDistSaveShardedStrategy(
            self.backend, self.version, thread_count=FILES_PER_RANK, cached_metadata=cached
        )

    def save(self, local: Tensors, path: str) -> None:
        dc.save(sharded(local, self.replicated), path, sharded_strategy=self.strategy())

    def load(self, local: Tensors, path: str) -> None:
        fill_from(local, dc.load(sharded(local, self.replicated), path))

    def cached_strategy(self) -> Any:
        return self.strategy(cached=True)

    def plan_save(self, local: Tensors, path: str, strategy: Any) -> Any:
        return dc.save(
            sharded(local, self.replicated),
            path,
            sharded_strategy=strategy,
            async_sharded_save=True,
        )


class RawBytes(Ours):
    name = "raw_bytes"
    backend, version = "raw_bytes", 1

    def unavailable(self) -> str | None:
        try:
            dc.get_default_save_sharded_strategy(self.backend, self.version)
        except Exception:
            return "n/a (not registered)"
        return None

    def strategy(self, cached: bool = False) -> Any:
        default = dc.get_default_save_sharded_strategy(self.backend, self.version)
        for kwargs in (
            {"thread_count": FILES_PER_RANK, "cached_metadata": cached},
            {"thread_count": FILES_PER_RANK},
            {},
        ):
            try:
                return type(default)(self.backend, self.version, **kwargs)
            except TypeError:
                continue
        return default


class FullyParallel(Method):
    name = "fully_parallel"
    replicated = True

    def save(self, local: Tensors, path: str) -> None:
        strategy = FullyParallelSaveStrategyWrapper(
            TorchDistSaveShardedStrategy(thread_count=FILES_PER_RANK)
        )
        dc.save(sharded(local, True), path, sharded_strategy=strategy)

    def load(self, local: Tensors, path: str) -> None:
        strategy = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy())
        fill_from(local, dc.load(sharded(local, True), path, sharded_strategy=strategy))


class PlainDCP(Method):
    name = "dcp"

    def save(self, local: Tensors, path: str) -> None:
        dcp.save(dict(local), checkpoint_id=path)

    def load(self, local: Tensors, path: str) -> None:
        dcp.load(dict(local), checkpoint_id=path)


class Megatron(Method):
    name = "megatron"

    def unavailable(self) -> str | None:
        try:
            found = importlib.util.find_spec("megatron.core") is not None
        except ModuleNotFoundError:
            found = False
        return None if found else "n/a (megatron.core not installed)"

    def _mc(self) -> Any:
        return importlib.import_module("megatron.core.dist_checkpointing")

    def _sharded(self, local: Tensors) -> dict[str, Any]:
        mc = self._mc()
        return {k: mc.ShardedTensor.from_rank_offsets(k, t) for k, t in local.items()}

    def setup(self, local: Tensors, root: str) -> None:
        """Save one small tensor once: Megatron-Core starts a multiprocessing manager (by
        ``spawn``, about 3 s here) at its first save in a process, a one-time cost that
        would land on the first timed run."""
        path = fresh_dir(root, "megatron_warm_up")  # one directory: the save is collective
        mc = self._mc()
        with stand_ins():
            mc.save(
                {f"w{rank()}": mc.ShardedTensor.from_rank_offsets(f"w{rank()}", torch.ones(4))},
                path,
            )
        drop_dir(path)

    def save(self, local: Tensors, path: str) -> None:
        torch_strategies = importlib.import_module(
            "megatron.core.dist_checkpointing.strategies.torch"
        )
        strategy = torch_strategies.TorchDistSaveShardedStrategy(
            "torch_dist", 1, thread_count=FILES_PER_RANK
        )
        with stand_ins():
            self._mc().save(self._sharded(local), path, sharded_strategy=strategy)

    def load(self, local: Tensors, path: str) -> None:
        with stand_ins():
            fill_from(local, self._mc().load(self._sharded(local), path))


class Raw(Method):
    """The baseline. The buffers are built outside the timed regions (see ``setup``)."""

    name = "raw"

    def setup(self, local: Tensors, root: str) -> None:
        self.blob = raw_blob(list(local.values()))

    def save(self, local: Tensors, path: str) -> None:
        raw_write(path, self.blob, FILES_PER_RANK)

    def load(self, local: Tensors, path: str) -> None:
        raw_read(path, self.blob, FILES_PER_RANK)


METHODS: tuple[type[Method], ...] = (Ours, RawBytes, FullyParallel, PlainDCP, Megatron, Raw)


def by_name(names: list[str] | None = None) -> list[Method]:
    chosen = [m() for m in METHODS]
    if names:
        unknown = set(names) - {m.name for m in chosen}
        if unknown:
            raise SystemExit(
                f"unknown method(s) {sorted(unknown)}; known: {[m.name for m in chosen]}"
            )
        chosen = [m for m in chosen if m.name in names]
    return chosen


__all__ = ["FILES_PER_RANK", "METHODS", "Method", "by_name", "world"]
