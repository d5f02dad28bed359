"""What a fork that shares the trainer's tensors costs the trainer, and what it costs
when the tensors are wiped on fork (the default), in one process.

    python bench/fork_sharing.py [--size-mib 1024]

For each setting of ``DIST_CKPT_WIPE_TENSORS_ON_FORK`` (0, then 1), in a fresh child
process each: ``--size-mib`` MiB of CPU tensors (16 float32 tensors) are written in place
once (warm), the persistent async worker is started (``AsyncCallsQueue(persistent=True)``,
a fork), the tensors are written in place twice more, as two optimizer steps would, then
one async save runs through the worker and is loaded back (checked bit-exact). It prints
the time of each in-place pass, the worker's resident memory (RSS) and its own memory
(USS: pages no other process maps) after the trainer wrote its tensors, and the time to
start the worker.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = "--child"


def child(size_mib: int) -> dict[str, object]:
    import psutil
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29583")
    dist.init_process_group("gloo", rank=0, world_size=1)
    import dist_checkpointing as dc
    from dist_checkpointing import ShardedTensor
    from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    state = {f"t{i}": torch.randn((size_mib << 20) // 16 // 4) for i in range(16)}

    def write_all() -> float:
        start = time.perf_counter()
        for t in state.values():
            t.add_(1)
        return time.perf_counter() - start

    out: dict[str, object] = {"before_fork_s": write_all()}
    start = time.perf_counter()
    queue = AsyncCallsQueue(persistent=True)
    out["worker_start_s"] = time.perf_counter() - start
    time.sleep(1.0)  # the worker is up
    worker = psutil.Process().children()[0]
    out["first_write_after_fork_s"] = write_all()
    out["second_write_after_fork_s"] = write_all()
    info = worker.memory_full_info()
    out["worker_rss_mib"] = info.rss >> 20
    out["worker_uss_mib"] = info.uss >> 20
    with tempfile.TemporaryDirectory() as ckpt:
        sharded = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in state.items()}
        request = dc.save(sharded, ckpt, async_sharded_save=True)
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        target = {
            k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in state.items()
        }
        loaded = dc.load(target, ckpt)
        out["exact"] = all(torch.equal(loaded[k], v) for k, v in state.items())
    queue.close()
    dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument(CHILD, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.size_mib)))
        return
    print(f"{args.size_mib} MiB of CPU tensors, persistent async worker forked from the trainer")
    for wipe in ("0", "1"):
        env = {**os.environ, "DIST_CKPT_WIPE_TENSORS_ON_FORK": wipe}
        cmd = [sys.executable, __file__, CHILD, "--size-mib", str(args.size_mib)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"WIPE_TENSORS_ON_FORK={wipe}:")
        for name, value in result.items():
            shown = f"{value:.3f}" if isinstance(value, float) else value
            print(f"  {name:28s} {shown}")


if __name__ == "__main__":
    main()
