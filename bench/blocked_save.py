"""How long ``save()`` of an async save of many tensors blocks, for a first save and the
saves of the same structure after it, without and with ``cached_metadata``; and how long
scheduling the request blocks (``schedule_async_request``: with ``--persistent``, the copy
of the tensors into the persistent worker's snapshot and the request's pickle).

    python bench/blocked_save.py [--layout torch_dist] [--tensors 10000] [--saves 4] [--persistent]
    torchrun --standalone --nproc_per_node=2 bench/blocked_save.py ...

Each rank holds ``--tensors`` float32 tensors of 4-64 KiB (each its shard, on axis 0, of a
global tensor over the ranks). Each save builds the sharded state dict afresh (a training
loop does) and calls ``dist_checkpointing.save(..., async_sharded_save=True)``, timed (the
slowest rank, ``common.measured``: a full garbage collection first, outside the time);
then it schedules the request, timed the same way, and waits for it to finish, untimed
(the temporal caller by default: a process forked per save). One strategy object
serves all the saves of a row, so that with ``cached_metadata`` the second and later saves
may reuse the plan.
"""

from __future__ import annotations

import argparse

import torch
from common import bench_root, drop_dir, fresh_dir, init_gloo, log, measured, row_sharded, world

import dist_checkpointing as dc
from dist_checkpointing.serialization import get_default_save_sharded_strategy
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

KIB = (4, 8, 16, 32, 64)


def strategy_for(layout: str, cached: bool) -> object:
    """The layout's default save strategy, with ``cached_metadata`` where it takes it."""
    default = get_default_save_sharded_strategy(layout, 1)
    try:
        return type(default)(layout, 1, cached_metadata=cached)  # type: ignore[call-arg]
    except TypeError:
        return default


def blocked_times(
    local: dict[str, torch.Tensor], root: str, strategy: object, saves: int, persistent: bool
) -> tuple[list[float], list[float]]:
    """Seconds blocked in ``save()`` and in ``schedule_async_request``, per save."""
    queue = AsyncCallsQueue(persistent=persistent)
    saved, scheduled = [], []
    try:
        for i in range(saves):
            path = fresh_dir(root, f"s{i}")
            with measured() as m:
                state = row_sharded(local)
                request = dc.save(state, path, strategy, async_sharded_save=True)
            saved.append(m[0].seconds)
            with measured() as m:
                queue.schedule_async_request(request)
            scheduled.append(m[0].seconds)
            del request, state
            queue.maybe_finalize_async_calls(blocking=True)
            drop_dir(path)
    finally:
        queue.close()
    return saved, scheduled


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layout", default="torch_dist")
    parser.add_argument("--tensors", type=int, default=10_000, help="per rank")
    parser.add_argument("--saves", type=int, default=4, help="per row")
    parser.add_argument("--persistent", action="store_true", help="the persistent worker")
    args = parser.parse_args()
    init_gloo(29563)
    local = {f"t{i}": torch.randn(KIB[i % 5] * 256) for i in range(args.tensors)}
    with bench_root("blocked_save") as root:
        rows = {
            cached: blocked_times(
                local, root, strategy_for(args.layout, cached), args.saves, args.persistent
            )
            for cached in (False, True)
        }
        caller = "persistent worker" if args.persistent else "temporal caller"
        log(
            f"{args.layout}, {args.tensors} tensors per rank, {world()} rank(s), {caller}: "
            "blocked in save(), then in schedule_async_request, ms (slowest rank), "
            "first save then the later ones"
        )
        for step in (0, 1):
            for cached, times in rows.items():
                label = "cached_metadata" if cached else "no cache"
                label = label if step == 0 else f"schedule, {label}"
                log(f"  {label:26s} " + "  ".join(f"{1e3 * t:7.1f}" for t in times[step]))


if __name__ == "__main__":
    main()
