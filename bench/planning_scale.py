"""Planning and validation at scale, simulated in one process.

    python bench/planning_scale.py [--ranks 64 256 1024 4096] [--tensors 1000]
                                   [--optimizer [every-rank|buffer]] [--no-memory]

No process group is needed: the script builds every simulated rank's shard records
and plan records (a TP=8 layout, data parallel over the rest: three quarters of the
tensors are row blocks of a TP group, written by data-parallel rank 0; a quarter are
replicated, written by rank 0; with ``--optimizer`` distributed-optimizer state, see
below) and calls the library's own planning and validation functions on them, step by
step, as each rank would. For
each step it prints the CPU time of the rank that does the most work and (unless
``--no-memory``) the peak memory that step allocates (tracemalloc, a second pass).
What a collective itself costs on a network is not simulated.

Steps (``*``: the coordinator; ``owner``: the busiest key owner):

- ``gather/check (old)``: the sharding check as it was: every rank's records are
  all-gathered, the coordinator unpickles them all and checks every key
  (``sharding_integrity_problems``);
- ``records+bin (rank)``: one rank's records from its sharded state dict, grouped by
  owner and pickled for the all-to-all (``local_shard_records``, ``records_by_owner``);
- ``check (owner)``: the busiest owner unpickles what it receives and checks its keys
  (``owned_key_problems``);
- ``digest (rank)``: a cached save's only work: the digest of one rank's records
  (``structure_digest``), a flag in the save's opening all-reduce;
- ``common gather/diff (old)*``: the common-state check as it was at every save (and
  is in Megatron-Core): the coordinator unpickles every rank's common state (a
  Megatron-LM-like one: an argparse ``Namespace`` of 600 options, the iteration, the
  optimizer's parameter groups and the scheduler's state; about 10 KB pickled) and
  compares it with its own (``dict_utils.diff``);
- ``common digest (rank)``: what every rank does instead: pickles and digests its common
  state (``pickled_common_state``, ``common_state_digest``), a digest in the opening
  all-reduce (the states are gathered only where the digests differ);
- ``metadata*``: the coordinator unpickles every rank's plan records and write
  results, builds ``Metadata`` (``metadata_from_records``, then ``_finish``: the storage
  data and the data files' checksums from the result tables), pickles it (a save that
  caches its structure: the pickle is made with markers where the directory and save
  id go, and kept as a template; ``metadata_bytes``);
- ``cached metadata*``: the same save with an unchanged structure and unchanged
  write results: the coordinator unpickles every rank's item locations and checksums
  (``ResultTable.locations``, ``data_files_from_tables``) and writes the previous save's
  metadata object again, the new directory and save id spliced into the template;
- ``cached metadata, later*``: the save after that one, the same way;
- ``unpickle (load)``: what every rank of a load spends reading ``.metadata``
  (``load_metadata``, the restricted unpickler) where the save wrote no index;
- ``index (load)``: what every rank of a ``torch_dist`` load spends instead, building the
  ``Metadata`` from the JSON index the coordinator wrote (``metadata*`` and ``cached
  metadata*`` include encoding it: only the header again for a cached save);
- ``= first save*``, ``= cached save*`` and ``= later cached saves*``: the
  coordinator's CPU time of a save, the sum of its steps above (the old check not
  included).

Distributed-optimizer state (``--optimizer [every-rank|buffer]``, two states per row
block, as flat ranges of it): ``every-rank`` (the default) gives every rank a
``1 / DP`` range of every row block, the worst case (``W x T`` chunks); ``buffer`` is
Megatron-Core's distributed optimizer: a tensor-parallel rank's row blocks lie one after
another in one buffer, cut into ``DP`` equal parts, and a rank holds the ranges of the
blocks its part meets (about ``T x TP + W`` chunks per state: a block is cut only where
a part ends).

Under torchrun (``make bench``) only rank 0 runs it, with the same arguments.
"""

from __future__ import annotations

import argparse
import functools
import gc
import io
import os
import pickle
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult

from dist_checkpointing._torch_compat import StorageInfo
from dist_checkpointing.dict_utils import diff
from dist_checkpointing.engine.safety.metadata import load_metadata
from dist_checkpointing.engine.safety.metadata_check import check_metadata
from dist_checkpointing.engine.sharding_check import ShardRecord, sharding_integrity_problems
from dist_checkpointing.engine.sharding_split import (
    key_owner,
    owned_key_problems,
    records_by_owner,
    structure_digest,
)
from dist_checkpointing.engine.storage.item_checksums import ItemChecksum
from dist_checkpointing.engine.storage.metadata_blob import metadata_bytes
from dist_checkpointing.engine.storage.metadata_index import (
    CHECK_BUDGET,
    decode_index,
    encode_index,
)
from dist_checkpointing.engine.storage.result_table import ResultTable, data_files_from_tables
from dist_checkpointing.mapping import ShardedTensor
from dist_checkpointing.strategies.state_dict_saver import _finish
from dist_checkpointing.strategies.torch.layout import reformulated_global_shape
from dist_checkpointing.strategies.torch.planners import MCoreSavePlanner
from dist_checkpointing.validation import (
    common_state_digest,
    local_shard_records,
    pickled_common_state,
)

TP = 8
ROWS, COLS = 32, 64  # a TP rank's row block of each sharded tensor
NUMEL = ROWS * COLS
DTYPE = torch.float32
OPT_STATES = ("exp_avg", "exp_avg_sq")


# ------------------------------------------------------------------ the simulated layout


def param_keys(tensors: int) -> list[str]:
    return [
        f"decoder.layers.{i // 4}.{('qkv', 'proj', 'fc1', 'norm')[i % 4]}" for i in range(tensors)
    ]


def flat_ranges(
    dp: int, dp_size: int, keys: list[str], optimizer: str | None
) -> dict[str, tuple[int, int]]:
    """The flat range of each row block whose optimizer state data-parallel rank ``dp``
    holds (see the module docstring): ``every-rank``, a ``dp_size``-th of every block;
    ``buffer``, Megatron-Core's distributed optimizer (the blocks one after another in
    one buffer, cut into ``dp_size`` equal parts: a rank holds the blocks its part meets)."""
    if not optimizer:
        return {}
    return dict(_flat_ranges(dp, dp_size, tuple(keys), optimizer))


@functools.lru_cache(maxsize=64)
def _flat_ranges(
    dp: int, dp_size: int, keys: tuple[str, ...], optimizer: str
) -> tuple[tuple[str, tuple[int, int]], ...]:
    blocks = [k for k in keys if not k.endswith("norm")]
    if optimizer == "every-rank":
        part = (NUMEL * dp // dp_size, NUMEL * (dp + 1) // dp_size)
        return tuple((k, part) for k in blocks)
    if optimizer != "buffer":
        raise ValueError(f"unknown optimizer layout {optimizer!r}")
    total = len(blocks) * NUMEL
    lo, hi = total * dp // dp_size, total * (dp + 1) // dp_size
    out = []
    for j in range(lo // NUMEL, min(len(blocks), -(-hi // NUMEL))):
        a, b = max(lo, j * NUMEL) - j * NUMEL, min(hi, (j + 1) * NUMEL) - j * NUMEL
        if a < b:
            out.append((blocks[j], (a, b)))
    return tuple(out)


def rank_records(
    rank: int, world: int, keys: list[str], optimizer: str | None
) -> list[ShardRecord]:
    """What ``local_shard_records`` returns on simulated rank ``rank``."""
    tp, dp = rank % TP, rank // TP
    ranges = flat_ranges(dp, world // TP, keys, optimizer)
    out = []
    for key in keys:
        if key.endswith("norm"):
            out.append(ShardRecord(key, True, str(DTYPE), (COLS,), (0,), (COLS,), None, rank == 0))
            continue
        gshape, off = (TP * ROWS, COLS), (tp * ROWS, 0)
        out.append(ShardRecord(key, True, str(DTYPE), gshape, off, (ROWS, COLS), None, dp == 0))
        flat = ranges.get(key)
        if flat is not None:
            for state in OPT_STATES:
                out.append(
                    ShardRecord(
                        f"optimizer.{state}.{key}",
                        True,
                        str(DTYPE),
                        gshape,
                        off,
                        (ROWS, COLS),
                        flat,
                        True,
                    )
                )
    return out


def real_state_dict(
    rank: int, world: int, keys: list[str], optimizer: str | None, model: bool = True
) -> dict[str, Any]:
    """Rank ``rank``'s sharded state dict with data (for the steps that need real
    objects); without the model's tensors unless ``model``."""
    tp, dp = rank % TP, rank // TP
    ranges = flat_ranges(dp, world // TP, keys, optimizer)
    sd: dict[str, Any] = {}
    for key in keys:
        if key.endswith("norm"):
            if model:
                sd[key] = ShardedTensor.from_rank_offsets(
                    key, torch.zeros(COLS), replica_id=(tp, dp)
                )
            continue
        if model:
            sd[key] = ShardedTensor.from_rank_offsets(
                key, torch.zeros(ROWS, COLS), (0, tp, TP), replica_id=dp
            )
        if key in ranges:
            start, stop = ranges[key]
            for state in OPT_STATES:
                k = f"optimizer.{state}.{key}"
                sd[k] = ShardedTensor.from_rank_offsets_flat(
                    k,
                    torch.zeros(stop - start),
                    (ROWS, COLS),
                    (0, tp, TP),
                    flattened_range=slice(start, stop),
                )
    return sd


def plan_records(records: list[ShardRecord]) -> list[tuple[Any, ...]]:
    """``MCoreSavePlanner.plan_records`` of a rank's plan (main replicas only)."""
    out: list[tuple[Any, ...]] = []
    for r in records:
        if not r.is_main:
            continue
        if r.flat is None:
            out.append((r.key, r.global_offset, r.chunk_shape, r.global_shape, DTYPE))
            continue
        grid = tuple(o // b for o, b in zip(r.global_offset, r.chunk_shape))
        stored = reformulated_global_shape(r.global_shape, r.chunk_shape)
        out.append(
            (r.key, grid + (r.flat[0],), (1,) * len(grid) + (r.flat[1] - r.flat[0],), stored, DTYPE)
        )
    return out


def write_results(rank: int, plan: list[tuple[Any, ...]]) -> ResultTable:
    """A rank's write results (as ``ResultTable``), two files per rank."""
    out, offsets = [], [0, 0]
    for i, (fqn, chunk_offsets, sizes, _size, _dtype) in enumerate(plan):
        nbytes = 4 * int(torch.Size(sizes).numel())
        f = i % 2
        result = WriteResult(
            MetadataIndex(fqn, torch.Size(chunk_offsets)),
            nbytes,
            StorageInfo(f"__{rank}_{f}.distcp", offsets[f], nbytes + 64),
        )
        object.__setattr__(result, "checksum", ItemChecksum(offsets[f], nbytes + 64, [i]))
        out.append(result)
        offsets[f] += nbytes + 64
    return ResultTable.of(out)


def planner_data(plan: list[tuple[Any, ...]], records: list[ShardRecord]) -> dict[str, Any]:
    """The ``mcore_data`` entries ``plan_records`` sends: only those that are not empty."""
    flat = {r.key: r.global_shape for r in records if r.flat is not None and r.is_main}
    return {
        fqn: {"nd_reformulated_orig_global_shape": flat[fqn]} for fqn, *_ in plan if fqn in flat
    }


def check_simulation(world: int, keys: list[str], optimizer: str | None) -> None:
    """The simulated records are what the library computes for real ShardedTensors, and
    the data-parallel ranks' flat ranges of each row block cover it once."""
    covered: dict[str, list[tuple[int, int]]] = {}
    for dp in range(world // TP):
        for key, part in flat_ranges(dp, world // TP, keys, optimizer).items():
            covered.setdefault(key, []).append(part)
    for key, parts in covered.items():
        ends = [b for _, b in sorted(parts)]
        assert [a for a, _ in sorted(parts)] == [0] + ends[:-1] and ends[-1] == NUMEL, key
    for rank in (0, min(world - 1, TP + 1)):
        sd = real_state_dict(rank, world, keys, optimizer)
        assert local_shard_records(sd) == rank_records(rank, world, keys, optimizer), rank
        planner = MCoreSavePlanner()
        planner.set_up_planner({k: [v] for k, v in sd.items() if v.replica_id in (0, (0, 0))})
        real, data = MCoreSavePlanner.plan_records(planner.create_local_plan())
        records = rank_records(rank, world, keys, optimizer)
        assert real == plan_records(records), rank
        assert data == planner_data(real, records), rank


# ------------------------------------------------------------------ measuring


def measure(fn: Callable[[], Any], memory: bool) -> tuple[float, int | None, Any]:
    """CPU seconds of ``fn`` and (second pass, under tracemalloc) its peak allocation,
    with the garbage collector paused (as ``save`` and ``load`` pause it)."""
    gc.collect()
    gc.disable()
    try:
        start = time.process_time()
        result = fn()
        seconds = time.process_time() - start
    finally:
        gc.enable()
    peak = None
    if memory:
        del result
        gc.collect()
        tracemalloc.start()
        result = fn()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return seconds, peak, result


def row(world: int, step: str, seconds: float, peak: int | None) -> None:
    mem = "" if peak is None else f"{peak / 2**20:10.1f}"
    print(f"{world:6d} {step:30} {seconds:9.3f} {mem:>10}", flush=True)


def run_validation(
    world: int, keys: list[str], optimizer: str | None, memory: bool, old: bool
) -> dict[str, float]:
    if old:
        payloads = [
            pickle.dumps([tuple(r) for r in rank_records(r, world, keys, optimizer)], protocol=4)
            for r in range(world)
        ]

        def centralized() -> list[str]:
            gathered = [[ShardRecord(*t) for t in pickle.loads(p)] for p in payloads]
            return sharding_integrity_problems(gathered)

        seconds, peak, problems = measure(centralized, memory)
        assert problems == [], problems[:3]
        row(world, "gather/check (old)*", seconds, peak)
        del payloads
    sd = real_state_dict(0, world, keys, optimizer)

    def per_rank() -> list[bytes]:
        return [
            pickle.dumps(part, protocol=5)
            for part in records_by_owner(local_shard_records(sd), world)
        ]

    seconds, peak, _ = measure(per_rank, memory)
    row(world, "records+bin (rank)", seconds, peak)
    times = {"bin": seconds}
    all_keys = sorted({r.key for r in rank_records(0, world, keys, optimizer)})
    load: dict[int, int] = {}
    for key in all_keys:
        load[key_owner(key, world)] = load.get(key_owner(key, world), 0) + 1
    busiest = max(load, key=lambda o: load[o])
    received = [
        pickle.dumps(
            records_by_owner(rank_records(r, world, keys, optimizer), world)[busiest], protocol=5
        )
        for r in range(world)
    ]

    def owner() -> Any:
        return owned_key_problems([pickle.loads(p) for p in received])

    seconds, peak, problems = measure(owner, memory)
    assert problems == [], problems[:3]
    row(world, f"check (owner, {load[busiest]} keys)", seconds, peak)
    times["check"] = seconds
    records = local_shard_records(sd)
    seconds, peak, _ = measure(lambda: structure_digest(records, 0, world), memory)
    row(world, "digest (rank)", seconds, peak)
    times["digest"] = seconds
    common = megatron_common_state()
    if old:
        blobs = [pickled_common_state(megatron_common_state()) for _ in range(world)]

        def compare() -> int:
            first, *others = [pickle.loads(b) for b in blobs]
            return sum(1 for other in others if any(diff(first, other)))

        seconds, peak, differing = measure(compare, memory)
        assert differing == 0
        row(world, "common gather/diff (old)*", seconds, peak)
        del blobs
    seconds, peak, _ = measure(lambda: common_state_digest(pickled_common_state(common)), memory)
    row(world, "common digest (rank)", seconds, peak)
    times["digest"] += seconds
    return times


def megatron_common_state() -> dict[str, Any]:
    """A common state like Megatron-LM's (``args``, iteration, the optimizer's and the
    scheduler's common parts), the same on every simulated rank."""
    kinds: list[Any] = [1024, 0.01, "cosine", True, None, [1, 2, 4], "bf16", 3e-4]
    options = {f"option_{i}": kinds[i % len(kinds)] for i in range(600)}
    group = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    return {
        "args": argparse.Namespace(**options),
        "checkpoint_version": 3.0,
        "iteration": 1000,
        "num_floating_point_operations_so_far": 1.2e18,
        "optimizer": {"param_groups": [dict(group, params=list(range(64))) for _ in range(2)]},
        "opt_param_scheduler": {"max_lr": 3e-4, "num_steps": 1000, "decay_style": "cosine"},
    }


class PickleWriter:
    """The coordinator's writer, minus the file: ``finish_assembled`` sets a new
    ``storage_meta`` and pickles (``metadata_bytes``, as the writer does)."""

    blob = b""
    index: bytes | None = None
    saves = 0

    def finish_assembled(self, metadata: Any, data_files: Any) -> None:
        self.saves += 1
        metadata.storage_meta = StorageMeta(f"/ckpt/iter_{self.saves:07d}", os.urandom(16).hex())
        self.blob = metadata_bytes(metadata)
        self.index = encode_index(metadata, self.blob)


def run_metadata(
    world: int, keys: list[str], optimizer: str | None, memory: bool
) -> dict[str, float]:
    payloads, locations = [], []
    for r in range(world):
        records = rank_records(r, world, keys, optimizer)
        plan = plan_records(records)
        results = write_results(r, plan)
        payloads.append(
            pickle.dumps(("ok", (results, (plan, planner_data(plan, records)))), protocol=4)
        )
        locations.append(pickle.dumps(results.locations(), protocol=4))

    writer = PickleWriter()
    built: list[Any] = []

    def assemble() -> bytes:
        gathered = [pickle.loads(p) for p in payloads]
        metadata = MCoreSavePlanner.metadata_from_records([v[1] for _, v in gathered])
        # kept: a save that caches its structure (the cached saves below reuse it)
        _finish(writer, metadata, [v[0] for _, v in gathered], kept=True)  # type: ignore[arg-type]
        built[:] = [metadata]  # the coordinator keeps it for the next save
        return writer.blob

    seconds, peak, blob = measure(assemble, memory)
    row(world, f"metadata* ({len(blob) >> 10} KiB)", seconds, peak)
    times = {"metadata": seconds}
    cached = built[0]

    def reuse() -> bytes:
        data_files = data_files_from_tables(pickle.loads(p) for p in locations)
        writer.finish_assembled(cached, data_files)
        return writer.blob

    seconds, peak, _ = measure(reuse, memory)
    row(world, "cached metadata*", seconds, peak)
    times["cached"] = seconds
    # A third save: the same splice into the template the first save made.
    seconds, peak, _ = measure(reuse, memory)
    row(world, "cached metadata, later*", seconds, peak)
    times["later"] = seconds
    row(world, "unpickle (load)", *measure(lambda: load_metadata(io.BytesIO(blob)), memory)[:2])
    index, metadata_blob = writer.index, writer.blob
    assert index is not None

    def from_index() -> Any:
        metadata = decode_index(index, metadata_blob, "index")
        assert metadata is not None
        check_metadata(metadata, "index", budget=CHECK_BUDGET)
        return metadata

    row(world, f"index (load, {len(index) >> 10} KiB)", *measure(from_index, memory)[:2])
    table = pickle.loads(payloads[0])[1][0]
    assert list(ResultTable.of(table.write_results()).rows()) == list(table.rows())
    return times


def scale_args(doc: str, old: str) -> argparse.Namespace | None:
    """The arguments of a simulation at scale (``old``: what ``--skip-old`` skips), its
    header printed; None under torchrun but on rank 0 (which simulates every rank)."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--tensors", type=int, default=1000, help="model tensors per rank")
    parser.add_argument(
        "--optimizer",
        nargs="?",
        const="every-rank",
        choices=["every-rank", "buffer"],
        help="add distributed-optimizer state: a flat range of every row block on every "
        "rank (every-rank, the default, the worst case) or Megatron-Core's layout (buffer)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the tracemalloc pass")
    parser.add_argument("--skip-old", action="store_true", help=f"skip {old}")
    args = parser.parse_args()
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    print(f"TP={TP}, {args.tensors} model tensors per rank, optimizer state: {args.optimizer}")
    print(f"{'ranks':>6} {'step':30} {'cpu s':>9} {'peak MiB':>10}")
    return args


def main() -> None:
    args = scale_args(__doc__ or "", "the centralized check")
    if args is None:
        return
    keys = param_keys(args.tensors)
    for world in args.ranks:
        if world % TP:
            raise SystemExit(f"--ranks must be multiples of {TP}")
        check_simulation(world, keys, args.optimizer)
        v = run_validation(world, keys, args.optimizer, not args.no_memory, not args.skip_old)
        m = run_metadata(world, keys, args.optimizer, not args.no_memory)
        # The coordinator also bins its own records and owns keys like any rank.
        row(world, "= first save*", v["bin"] + v["check"] + m["metadata"], None)
        row(world, "= cached save*", v["digest"] + m["cached"], None)
        row(world, "= later cached saves*", v["digest"] + m["later"], None)


if __name__ == "__main__":
    main()
