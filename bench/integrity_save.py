"""What ``save(..., verify_integrity=True)`` adds to a save: the sha256 of each data file
for ``integrity.json``, computed by the writers from the bytes they write.

    torchrun --standalone --nproc_per_node=2 bench/integrity_save.py [--size-mib 512] \
        [--layout torch_dist|raw_bytes] [--repeat 3]

The ranks hold ``--size-mib`` MiB in 16 float32 tensors (row blocks over the ranks) and
save them, without and with ``verify_integrity``, alternately, ``--repeat`` times each
(after one untimed round), each into an empty directory (the last one removed):

- ``sync``: a synchronous save, seconds (slowest rank, barrier to barrier);
- ``finalize``: an async save (the temporal caller: a forked writer) whose background
  write is given time to finish (a sleep of three sync saves), then the seconds of the
  trainer's blocking ``maybe_finalize_async_calls``: what the training loop waits for
  at the end of an async save.
"""

from __future__ import annotations

import argparse
import time

import torch
from common import (
    bench_root,
    drop_dir,
    fresh_dir,
    init_gloo,
    log,
    measured,
    rank,
    row_sharded,
    world,
)

import dist_checkpointing as dc
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

MIB = 1 << 20
TENSORS = 16


def _sync(local: dict[str, torch.Tensor], path: str, layout: tuple[str, int], v: bool) -> float:
    with measured() as m:
        dc.save(row_sharded(local), path, layout, verify_integrity=v)
    return m[0].seconds


def _finalize(
    local: dict[str, torch.Tensor], path: str, layout: tuple[str, int], v: bool, wait_s: float
) -> float:
    queue = AsyncCallsQueue()
    request = dc.save(row_sharded(local), path, layout, verify_integrity=v, async_sharded_save=True)
    queue.schedule_async_request(request)
    time.sleep(wait_s)  # the background write is done by now
    with measured() as m:
        queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    return m[0].seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--layout", default="torch_dist", choices=["torch_dist", "raw_bytes"])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    init_gloo(29573)
    layout = (args.layout, 1)
    cols = 1024
    rows = max(1, args.size_mib * MIB // 4 // TENSORS // cols // world())
    gen = torch.Generator().manual_seed(rank())
    local = {f"t{i}": torch.randn(rows, cols, generator=gen) for i in range(TENSORS)}
    times: dict[tuple[str, bool], list[float]] = {}
    with bench_root("integrity_save") as root:
        wait_s = 0.0
        for i in range(args.repeat + 1):  # the first round warms up, untimed
            for v in (False, True):
                path = fresh_dir(root, "ckpt")
                t = _sync(local, path, layout, v)
                drop_dir(path)  # each save writes into an empty directory on a quiet disk
                wait_s = max(wait_s, 3 * t)
                path = fresh_dir(root, "ckpt")
                f = _finalize(local, path, layout, v, wait_s)
                drop_dir(path)
                if i:
                    times.setdefault(("sync", v), []).append(t)
                    times.setdefault(("finalize", v), []).append(f)
        total = TENSORS * rows * cols * 4 * world() / MIB
        log(f"{world()} rank(s), {args.layout}, {total:.0f} MiB: seconds (slowest rank)")
        for (what, v), values in times.items():
            label = f"{what} {'verify_integrity' if v else 'plain'}"
            log(f"  {label:26s} " + "  ".join(f"{t:6.3f}" for t in values))


if __name__ == "__main__":
    main()
