"""Multi-rank demo: save a small GPT-like model with TP=2, reload it with TP=4 and TP=1.

Run ``python examples/demo.py`` (``make demo`` does): it launches three
``torchrun`` jobs on this machine (gloo, CPU):

1. 2 ranks, tensor parallel 2: build the sharded state dict and save it;
2. 4 ranks, tensor parallel 4: load it and check every value;
3. 1 rank, no parallelism: load it and check every value.

Every value is checked against a reference global tensor that each rank
builds independently from the key (a seeded generator), so resharding errors
cannot cancel out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import LocalNonpersistentObject, ShardedObject, ShardedTensor

VOCAB, HIDDEN, FFN, LAYERS = 512, 256, 1024, 4


def reference(key: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The global value of ``key``: deterministic, different per key."""
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=gen).to(dtype)


def tp_split(key: str, shape: tuple[int, ...], axis: int, tp: int, rank: int) -> ShardedTensor:
    """This rank's TP slice of ``key`` along ``axis``."""
    local = reference(key, shape).chunk(tp, dim=axis)[rank].contiguous()
    return ShardedTensor.from_rank_offsets(key, local, (axis, rank, tp))


def layer_tensors(tp: int, rank: int) -> dict[str, ShardedTensor]:
    """Per-layer weights (prepended layer axis), TP-split along different axes."""
    out: dict[str, ShardedTensor] = {}
    specs = {
        "qkv.weight": ((3 * HIDDEN, HIDDEN), 1),
        "proj.weight": ((HIDDEN, HIDDEN), 2),
        "fc1.weight": ((FFN, HIDDEN), 1),
        "fc2.weight": ((HIDDEN, FFN), 2),
    }
    for name, (shape, axis) in specs.items():
        key = f"decoder.layers.{name}"
        full = reference(key, (LAYERS, *shape), torch.bfloat16)
        for layer in range(LAYERS):
            local = full[layer].chunk(tp, dim=axis - 1)[rank].contiguous()
            out[f"layer{layer}.{name}"] = ShardedTensor.from_rank_offsets(
                key, local, (0, layer, LAYERS), (axis, rank, tp), prepend_axis_num=1
            )
    return out


def flat_slice(key: str, shape: tuple[int, ...], rank: int, world: int) -> ShardedTensor:
    """A distributed-optimizer slice: this rank's (uneven) range of the flattened tensor."""
    full = reference(key, shape).flatten()
    n = full.numel()
    bounds = [0] + [i * n // world + i % 2 for i in range(1, world)] + [n]
    rng = slice(bounds[rank], bounds[rank + 1])
    return ShardedTensor.from_rank_offsets_flat(key, full[rng].clone(), shape, flattened_range=rng)


def build_state_dict(tp: int, rank: int) -> dict:
    """The sharded state dict of a TP=``tp`` rank."""
    return {
        "embedding": tp_split("embedding.weight", (VOCAB, HIDDEN), 0, tp, rank),
        "layers": layer_tensors(tp, rank),
        "final_norm": ShardedTensor.from_rank_offsets(
            "final_norm.weight", reference("final_norm.weight", (HIDDEN,)), replica_id=rank
        ),
        "optimizer": {
            "exp_avg.final_norm": flat_slice("optimizer.exp_avg.final_norm", (HIDDEN,), rank, tp),
            "exp_avg.embedding": flat_slice(
                "optimizer.exp_avg.embedding", (VOCAB, HIDDEN), rank, tp
            ),
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95)}],
        },
        "rng_state": ShardedObject("rng_state", {"seed": 1234 + rank}, (tp,), (rank,)),
        "iteration": 1000,
        "cuda_graphs": LocalNonpersistentObject(f"not saved, rank {rank}"),
    }


def object_offsets(tp: int, rank: int, saved_tp: int) -> list[tuple[int, int]]:
    """(offset, replica_id) of the ``rng_state`` shards a loading rank requests: every
    shard is requested once as main replica, extra loading ranks get replicas."""
    if tp <= saved_tp:
        return [(o, 0) for o in range(saved_tp) if o % tp == rank]
    return [(rank % saved_tp, rank // saved_tp)]


def load_request(tp: int, rank: int, saved_tp: int) -> dict:
    """What a TP=``tp`` rank asks for: its layout (zeroed), objects of the saving ranks."""
    request = build_state_dict(tp, rank)
    for sh in dc.dict_utils.nested_values(request):
        if isinstance(sh, ShardedTensor) and sh.data is not None:
            sh.data = torch.zeros_like(sh.data)
    request["rng_state"] = [
        ShardedObject("rng_state", None, (saved_tp,), (o,), replica_id=r)
        for o, r in object_offsets(tp, rank, saved_tp)
    ]
    return request


def check(loaded: dict, tp: int, rank: int, saved_tp: int) -> int:
    """Compare every loaded value with the reference; returns the number checked."""
    expected = build_state_dict(tp, rank)
    expected["rng_state"] = [{"seed": 1234 + o} for o, _ in object_offsets(tp, rank, saved_tp)]
    count = 0

    def walk(got: object, exp: object, path: str) -> None:
        nonlocal count
        if path == ".rng_state":
            assert got == exp, (path, got, exp)
            count += len(exp)  # type: ignore[arg-type]
        elif isinstance(exp, dict):
            assert isinstance(got, dict), path
            for k, v in exp.items():
                walk(got[k], v, f"{path}.{k}")
        elif isinstance(exp, ShardedTensor):
            assert isinstance(got, torch.Tensor) and got.dtype == exp.dtype, path
            assert torch.equal(got, exp.data), f"{path}: value mismatch"
            count += 1
        elif isinstance(exp, LocalNonpersistentObject):
            assert got == exp.unwrap(), path
        else:
            assert got == exp, (path, got, exp)
            count += 1

    walk(loaded, expected, "")
    return count


def worker(phase: str, ckpt: str, tp: int, saved_tp: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == tp, "the demo runs one rank per tensor-parallel slice"
    dist.barrier()
    start = time.perf_counter()
    if phase == "save":
        sd = build_state_dict(tp, rank)
        dc.save(sd, ckpt)
    else:
        loaded = dc.load(load_request(tp, rank, saved_tp), ckpt)
        checked = check(loaded, tp, rank, saved_tp)
    dist.barrier()
    seconds = time.perf_counter() - start
    if rank == 0:
        size = sum(p.stat().st_size for p in Path(ckpt).iterdir())
        keys = len(dc.load_tensors_metadata(ckpt))
        what = "saved" if phase == "save" else f"loaded and checked {checked} values per rank"
        print(
            f"[{phase} tp={tp}] {what}: {keys} tensors, {size / 1e6:.1f} MB on disk, "
            f"{seconds:.2f} s, {size / seconds / 1e6:.1f} MB/s (at this size mostly one-time imports)",
            flush=True,
        )
    dist.destroy_process_group()


def launch(nproc: int, *args: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        __file__,
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--phase", choices=["save", "load"])
    parser.add_argument("--ckpt")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--saved-tp", type=int, default=2)
    args = parser.parse_args()
    if args.phase:
        worker(args.phase, args.ckpt, args.tp, args.saved_tp)
        return
    root = tempfile.mkdtemp(prefix="dist_ckpt_demo_")
    try:
        ckpt = os.path.join(root, "ckpt")
        os.makedirs(ckpt)
        launch(2, "--phase", "save", "--ckpt", ckpt, "--tp", "2")
        launch(4, "--phase", "load", "--ckpt", ckpt, "--tp", "4", "--saved-tp", "2")
        launch(1, "--phase", "load", "--ckpt", ckpt, "--tp", "1", "--saved-tp", "2")
        print("demo OK: saved with TP=2, reloaded bit-exactly with TP=4 and TP=1")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
