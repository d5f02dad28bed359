"""What the parse-time bound of ``.metadata`` costs, and what it stops.

    python bench/metadata_guard.py [--layouts 64 40+opt 184+opt] [--repeat 3]
                                   [--attack-mib 0.5] [--rss-gib 0]

1. Legitimate files: the ``.metadata`` of a simulated TP=8 job of N ranks with 1000
   model tensors per rank (``planning_scale.py``'s layout; ``+opt``: with
   distributed-optimizer state), built by the library's own save path: about 0.9, 11
   and 50 MiB for the default layouts.
   For each, ``load_metadata`` with the guard off and on (the default budget): wall
   seconds and this process's CPU seconds, the median of ``--repeat`` runs. The guard
   forks and parses twice, so it adds about one parse plus the fork.
2. Crafted files of about ``--attack-mib`` MiB (colliding int keys, tuple keys,
   ``MetadataIndex`` keys, a frozenset built from a list): the time until the guard
   refuses each (default budget), and the time a parse without the guard would take,
   extrapolated from a small file (the cost grows with the square of the keys).
3. The worst crafted file below the fork threshold (16 KiB: compact ``MetadataIndex``
   keys, parsed by both unpicklers): its parse time, which the threshold keeps small.

``--rss-gib N`` first allocates and touches N GiB, to see what a fork of a large
process costs (the page tables are copied).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import planning_scale as ps  # noqa: E402

from dist_checkpointing.engine.safety import load_metadata  # noqa: E402
from dist_checkpointing.engine.safety.metadata import FORK_MIN_BYTES  # noqa: E402
from dist_checkpointing.strategies.state_dict_saver import _finish  # noqa: E402
from dist_checkpointing.strategies.torch.planners import MCoreSavePlanner  # noqa: E402
from tests.support import crafted_pickles as cp  # noqa: E402

GUARD = "DIST_CKPT_METADATA_PARSE_GUARD"


def legit_metadata(world: int, optimizer: str | None, tensors: int = 1000) -> bytes:
    """The pickled ``.metadata`` of a simulated save of ``world`` ranks (``optimizer``:
    see ``planning_scale.py``)."""
    keys = ps.param_keys(tensors)
    gathered = []
    for r in range(world):
        records = ps.rank_records(r, world, keys, optimizer)
        plan = ps.plan_records(records)
        gathered.append((ps.write_results(r, plan), (plan, ps.planner_data(plan, records))))
    metadata = MCoreSavePlanner.metadata_from_records([v[1] for v in gathered])
    writer = ps.PickleWriter()
    _finish(writer, metadata, [v[0] for v in gathered])  # type: ignore[arg-type]
    return writer.blob


def timed(fn: Callable[[], object]) -> tuple[float, float, str]:
    """(wall s, this process's CPU s, outcome) of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        fn()
        outcome = "loaded"
    except Exception as exc:  # noqa: BLE001 - reported
        text = str(exc)
        outcome = "refused: CPU limit" if "CPU-second" in text else text.partition(": ")[2][:60]
    return time.perf_counter() - wall, time.process_time() - cpu, outcome


def load(raw: bytes, guard: str) -> tuple[float, float, str]:
    os.environ[GUARD] = guard
    return timed(lambda: load_metadata(io.BytesIO(raw), source="bench/.metadata"))


def legit(layouts: list[str], repeat: int) -> None:
    print(
        f"{'layout':>8} {'MiB':>7} {'off wall':>9} {'on wall':>9} {'added':>7} "
        f"{'off cpu':>8} {'on cpu':>8}"
    )
    for layout in layouts:
        world = int(layout.removesuffix("+opt"))
        raw = legit_metadata(world, "every-rank" if layout.endswith("+opt") else None)
        runs = {g: [load(raw, g) for _ in range(repeat)] for g in ("0", "1")}
        off_w, on_w = (statistics.median(r[0] for r in runs[g]) for g in ("0", "1"))
        off_c, on_c = (statistics.median(r[1] for r in runs[g]) for g in ("0", "1"))
        print(
            f"{layout:>8} {len(raw) / 2**20:7.2f} {off_w:9.3f} {on_w:9.3f} "
            f"{on_w - off_w:7.3f} {off_c:8.3f} {on_c:8.3f}",
            flush=True,
        )


def attacks(mib: float) -> None:
    kinds: dict[str, tuple[Callable[[int], bytes], int]] = {
        "int keys": (
            lambda n: cp.metadata_with(
                {"planner_data": cp.dict_op([cp.int_op(k) for k in cp.colliding_ints(n)])}
            ),
            13,
        ),
        "tuple keys": (
            lambda n: cp.metadata_with(
                {"planner_data": cp.dict_op([cp.tuple_op(p) for p in cp.colliding_pairs(n)])}
            ),
            17,
        ),
        "MetadataIndex keys": (
            lambda n: cp.metadata_with(
                {"storage_data": cp.compact_index_dict_op("w", cp.colliding_pairs(n))}
            ),
            30,
        ),
        "frozenset(list)": (
            lambda n: cp.metadata_with(
                {
                    "planner_data": cp.reduce_op(
                        "builtins", "frozenset", [cp.int_op(k) for k in cp.colliding_ints(n)]
                    )
                }
            ),
            12,
        ),
    }
    print(f"{'attack':20} {'MiB':>6} {'keys':>7} {'guarded':>10} {'unguarded (est.)':>17}")
    for name, (make, per_key) in kinds.items():
        keys = int(mib * 2**20 / per_key)
        small = 3000
        seconds = load(make(small), "0")[1]
        estimate = seconds * (keys / small) ** 2
        raw = make(keys)
        wall, _, outcome = load(raw, "1")
        print(
            f"{name:20} {len(raw) / 2**20:6.2f} {keys:7d} {wall:11.2f} s {estimate:14.0f} s"
            f"  ({outcome})",
            flush=True,
        )


def below_threshold() -> None:
    """Compact MetadataIndex keys filling FORK_MIN_BYTES, and a last field that the fast
    unpickler declines: both unpicklers insert every key."""
    keys = (FORK_MIN_BYTES - 400) // 30
    decline = b"cbuiltins\nfrozenset\nK\x01\x85R"
    raw = cp.metadata_with(
        {
            "storage_data": cp.compact_index_dict_op("w", cp.colliding_pairs(keys)),
            "storage_meta": decline,
        }
    )
    assert len(raw) < FORK_MIN_BYTES
    wall, cpu, outcome = load(raw, "1")
    print(
        f"below the fork threshold: {len(raw)} bytes, {keys} colliding MetadataIndex keys, "
        f"both unpicklers: {cpu:.3f} CPU s ({outcome})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layouts", nargs="+", default=["64", "40+opt", "184+opt"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--attack-mib", type=float, default=0.5)
    parser.add_argument("--rss-gib", type=float, default=0.0)
    args = parser.parse_args()
    ballast = torch.ones(int(args.rss_gib * 2**28)) if args.rss_gib else None
    print(f"parent RSS ballast: {args.rss_gib} GiB ({ballast is not None})")
    legit(args.layouts, args.repeat)
    attacks(args.attack_mib)
    below_threshold()


if __name__ == "__main__":
    main()
