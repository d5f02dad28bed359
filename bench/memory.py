"""Host memory of a save and a load beyond the state itself: peak PSS above the state.

    torchrun --standalone --nproc_per_node=2 bench/memory.py [--size-mib 512] \
        [--device cpu|cuda] [--budget-mib N] [--no-touch]

Each rank holds ``--size-mib / world`` MiB of state (16 float32 tensors, sharded over the
ranks on axis 0). For every operation the script measures, on every rank, the physical
memory of the rank and its children (writer processes, the persistent worker): the sum of
their PSS (``/proc/<pid>/smaps_rollup``), so that pages a forked writer shares with its
rank count once. It prints the peak above the memory held before the operation (the state,
already in memory), the largest over the ranks:

- ``sync save``: ``save()`` written by threads of the rank;
- ``async temporal``: an async save through a fresh forked process per save;
- ``async persistent``: three async saves through one long-lived worker per rank (what
  stays mapped between saves counts: the baseline is taken before the first save, and
  the worker's own interpreter counts too);
- ``load``: a load into preallocated (and already touched) tensors.

With ``--touch`` (the default) every tensor is modified in place right after an async save
returns, as the next training step would: the snapshot the save must keep is then real
memory for every caller (a forked writer's copy-on-write pages included).

For the async saves it also prints how long each save blocked the caller (``save()`` and
``schedule_async_request``, slowest rank). Each operation runs twice: with the copy-ahead budget (``--budget-mib``, default: the
``COPY_AHEAD_BYTES`` knob's default) and with it off (``DIST_CKPT_COPY_AHEAD_BYTES=0``).
Run with torchrun; ``--device cuda`` puts the state on the GPU (one per rank).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator

import psutil
import torch
import torch.distributed as dist
from async_save import make_state
from common import PeakSampler, fmt_mib, log, rank, row_sharded, world

import dist_checkpointing as dc
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

MIB = 1 << 20
BUDGET_ENV = "DIST_CKPT_COPY_AHEAD_BYTES"
BLOCKED: list[float] = []  # seconds each async save blocked this rank, in order


def _pss(pid: int) -> int:
    """PSS of one process in bytes (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_pss(proc: psutil.Process) -> int:
    """PSS of this process and all its descendants."""
    total = _pss(proc.pid)
    with contextlib.suppress(psutil.Error):
        for child in proc.children(recursive=True):
            total += _pss(child.pid)
    return total


class PeakAbove(PeakSampler):
    """Samples the process tree's PSS in a thread; ``peak`` is above the value on entry."""

    def __init__(self, interval_s: float = 0.01) -> None:
        proc = psutil.Process()
        super().__init__(lambda: (tree_pss(proc),), interval_s, on_exit=True)

    @property
    def peak(self) -> int:
        return self.top[0] - self.first[0]


def touch(local: dict[str, torch.Tensor]) -> None:
    """What the next training step does to the state: modify every tensor in place."""
    for t in local.values():
        t.add_(1.0)


def max_over_ranks(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


@contextlib.contextmanager
def checkpoint_dir(root: str, name: str) -> Iterator[str]:
    path = os.path.join(root, name)
    if rank() == 0:
        os.makedirs(path)
    dist.barrier()
    try:
        yield path
    finally:
        dist.barrier()
        if rank() == 0:
            shutil.rmtree(path, ignore_errors=True)


def sync_save(local: dict[str, torch.Tensor], root: str) -> int:
    with checkpoint_dir(root, "sync") as path, PeakAbove() as m:
        dc.save(row_sharded(local), path)
    return m.peak


def async_save(
    local: dict[str, torch.Tensor], root: str, persistent: bool, saves: int, do_touch: bool
) -> int:
    queue = AsyncCallsQueue(persistent=persistent)
    try:
        with PeakAbove() as m:
            for i in range(saves):
                with checkpoint_dir(root, f"async{i}") as path:
                    start = time.perf_counter()
                    request = dc.save(row_sharded(local), path, async_sharded_save=True)
                    queue.schedule_async_request(request)
                    BLOCKED.append(time.perf_counter() - start)
                    if do_touch:
                        touch(local)
                    queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    return m.peak


def load(local: dict[str, torch.Tensor], root: str) -> int:
    with checkpoint_dir(root, "load") as path:
        dc.save(row_sharded(local), path)
        targets = {k: torch.zeros_like(t) for k, t in local.items()}  # touched: resident
        with PeakAbove() as m:
            loaded = dc.load(row_sharded(targets), path)
        bad = [k for k, t in local.items() if not torch.equal(loaded[k], t)]
        if bad:
            raise RuntimeError(f"rank {rank()}: loaded values differ for {bad[:3]}")
        del targets, loaded
    return m.peak


def run_all(args: argparse.Namespace, root: str, label: str) -> dict[str, int]:
    device = torch.device(args.device, rank() if args.device == "cuda" else None)
    local = make_state(args.size_mib, device)
    ops: dict[str, Callable[[], int]] = {
        "sync save": lambda: sync_save(local, root),
        "async temporal": lambda: async_save(local, root, False, 1, args.touch),
        "async persistent": lambda: async_save(local, root, True, 3, args.touch),
        "load": lambda: load(local, root),
    }
    out = {}
    for name, op in ops.items():
        BLOCKED.clear()
        out[name] = max_over_ranks(op())
        if BLOCKED:
            blocked = torch.tensor(BLOCKED, dtype=torch.float64)
            dist.all_reduce(blocked, op=dist.ReduceOp.MAX)
            times = ", ".join(f"{x:.3f}" for x in blocked.tolist())
            log(f"  budget {label}, {name}: blocked per save (slowest rank, s): {times}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=512, help="state over all ranks")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--budget-mib", type=int, default=None, help="copy-ahead budget")
    parser.add_argument("--no-touch", dest="touch", action="store_false")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # The benchmark's own reductions are of CPU tensors: gloo for those, NCCL for CUDA.
    dist.init_process_group("cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo")
    root = tempfile.mkdtemp(prefix="bench_memory_", dir=args.dir) if rank() == 0 else ""
    holder = [root]
    dist.broadcast_object_list(holder)
    root = holder[0]
    per_rank = args.size_mib * MIB // world()
    budgets: list[tuple[str, str | None]] = [
        ("on", None if args.budget_mib is None else str(args.budget_mib * MIB)),
        ("off", "0"),
    ]
    results: dict[str, dict[str, int]] = {}
    saved_env = os.environ.get(BUDGET_ENV)
    try:
        for label, value in budgets:
            if value is None:
                os.environ.pop(BUDGET_ENV, None)
            else:
                os.environ[BUDGET_ENV] = value
            results[label] = run_all(args, root, label)
    finally:
        if saved_env is None:
            os.environ.pop(BUDGET_ENV, None)
        else:
            os.environ[BUDGET_ENV] = saved_env
        dist.barrier()
        if rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
    log(
        f"peak memory above the state, largest rank ({world()} ranks, {args.device}, "
        f"state {fmt_mib(per_rank)}/rank, touch={args.touch}):"
    )
    log(f"{'operation':18} {'budget on':>12} {'budget off':>12} {'x state':>8}")
    for name in results["on"]:
        on, off = results["on"][name], results["off"][name]
        log(f"{name:18} {fmt_mib(on):>12} {fmt_mib(off):>12} {on / per_rank:8.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
