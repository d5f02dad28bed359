"""The README's async example as a training script *without* a ``__main__`` guard.

Run by ``tests/multirank/test_async_worker_start.py`` under ``torchrun`` (or plain
``python`` for one rank: it then makes its own gloo group on 127.0.0.1). Every
statement is at module level on purpose: a writer worker that re-ran this
module would append a second line to the marker file and block inside ``save``.

Environment: ``ASYNC_DEMO_DIR`` (where checkpoints, markers and results go),
``ASYNC_DEMO_STEPS`` (default 4).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import dist_checkpointing
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

out = Path(os.environ["ASYNC_DEMO_DIR"])
rank_env = os.environ.get("RANK", "0")
with open(out / f"imported.{rank_env}", "a") as marker:  # one line per import of this file
    marker.write(f"{os.getpid()}\n")

if "MASTER_ADDR" not in os.environ:  # plain `python`: a one-rank group of our own
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
else:
    dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

full = torch.arange(64, dtype=torch.float32).reshape(8, 8)
rows = 8 // world
weight = full[rank * rows : (rank + 1) * rows].clone()
sharded_sd = {
    "weight": ShardedTensor.from_rank_offsets("weight", weight, (0, rank, world)),
    "bias": ShardedTensor.from_rank_offsets("bias", torch.ones(8), replica_id=rank),
    "iteration": 100,
}

num_steps, save_every = int(os.environ.get("ASYNC_DEMO_STEPS", "4")), 2
timings: dict[str, float] = {}
queue = AsyncCallsQueue(persistent=True)  # one long-lived writer process per rank
for step in range(num_steps):
    weight.add_(1.0)  # train_step()
    if step % save_every == 0:
        ckpt = out / "ckpt" / str(step)
        ckpt.mkdir(parents=True, exist_ok=True)
        request = dist_checkpointing.save(sharded_sd, str(ckpt), async_sharded_save=True)
        start = time.monotonic()
        queue.schedule_async_request(request)
        timings.setdefault("first_schedule_s", time.monotonic() - start)
        if "first_done_s" not in timings:  # measure the worker's start-up
            queue.maybe_finalize_async_calls(blocking=True)
            timings["first_done_s"] = time.monotonic() - start
            worker = getattr(queue.persistent_caller, "process", None)
            timings["worker_ready_s"] = getattr(worker, "ready_after_s", None) or -1.0
    queue.maybe_finalize_async_calls(blocking=False)  # commits finished saves
queue.close()  # waits for the saves still in flight

last = (num_steps - 1) // save_every * save_every
cols = 8 // world
template = {
    "weight": ShardedTensor.from_rank_offsets("weight", torch.empty(8, cols), (1, rank, world)),
    "bias": ShardedTensor.from_rank_offsets("bias", torch.empty(8), replica_id=rank),
}
loaded = dist_checkpointing.load(template, str(out / "ckpt" / str(last)))
expected = full[:, rank * cols : (rank + 1) * cols] + (last + 1)
result = {
    "rank": rank,
    "world": world,
    "exact": bool(
        loaded["weight"].numpy().tobytes() == expected.numpy().tobytes()
        and loaded["bias"].numpy().tobytes() == torch.ones(8).numpy().tobytes()
        and loaded["iteration"] == 100
    ),
    **timings,
}
(out / f"result.{rank}.json").write_text(json.dumps(result))
print(json.dumps(result), flush=True)
dist.destroy_process_group()
