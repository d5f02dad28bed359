"""One run of the benchmark table on the ranks of this torchrun; ``bench/table.py``
launches it at each rank count and merges the JSON it writes (``--out``, rank 0).

    torchrun --standalone --nproc_per_node=2 bench/table_run.py --out r2.json [--quick]

The cases are global: a case's tensors are spread over the ranks whole (rank r holds
tensors r, r + ranks, ...), except for ``fully_parallel``, where every rank holds every
tensor (a replicated layout) and the fully parallel wrappers spread the work. Every
method saves the same bytes. Timings are barrier to barrier, the slowest rank, the
median of ``--repeat`` runs (``--rounds``: in rounds over the methods, each round running
every method once); loads read from the page cache right after the saves
(``--cold``: from the disk). Peak RSS is the largest rank's (with its child processes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from common import drop_dir, evict, fresh_dir, measured, rank, world
from table_methods import Method, Raw, by_name

KIB = 1024
MID_SIZES_KIB = (4, 8, 16, 32, 64)  # the 4-64 KiB case cycles through these

# name -> (tensors, bytes of each tensor by index), full mode and --quick.
FULL = {"big": (200, 1024), "mid": (10_000, 0), "small": (100_000, 0)}
QUICK = {"big": (50, 64), "mid": (1_000, 0), "small": (5_000, 0)}


def case_sizes(name: str, count: int, big_mib: int) -> list[int]:
    """Bytes of each tensor of a case (multiples of 4: float32)."""
    if name == "big":
        return [(big_mib << 20) // count // 4 * 4] * count
    if name == "mid":
        return [MID_SIZES_KIB[i % len(MID_SIZES_KIB)] * KIB for i in range(count)]
    return [KIB] * count


def make_tensors(sizes: list[int], replicated: bool) -> dict[str, torch.Tensor]:
    """This rank's tensors; tensor i is filled with ``i % 1000 + 1`` (checked on load)."""
    mine = range(len(sizes)) if replicated else range(rank(), len(sizes), world())
    return {f"t{i:06d}": torch.full((sizes[i] // 4,), float(i % 1000 + 1)) for i in mine}


def zero(local: dict[str, torch.Tensor]) -> None:
    for t in local.values():
        t.zero_()


def check(local: dict[str, torch.Tensor], method: str) -> None:
    bad = [k for k, t in local.items() if t.numel() and (t[0] != int(k[1:]) % 1000 + 1)]
    bad += [k for k, t in local.items() if t.numel() and (t[-1] != t[0])]
    if bad:
        raise RuntimeError(f"{method}: rank {rank()} loaded wrong values for {bad[:5]}")


def count_files(path: str) -> int:
    return sum(len(names) for _, _, names in os.walk(path))


CACHED_PLANS = 3  # saves of the same structure after the first (their median is printed)


def time_plans(method: Method, local: dict[str, torch.Tensor], root: str) -> list[float]:
    """Seconds of the planning step (validation and plan, the part of an async save that
    blocks before staging) of a first save, and the median of ``CACHED_PLANS`` saves of
    the same structure after it, with the strategy's cached-structure option."""
    strategy = method.cached_strategy()
    out = []
    for i in range(1 + CACHED_PLANS):
        path = fresh_dir(root, f"plan{i}")
        with measured() as m:
            request = method.plan_save(local, path, strategy)
        request.execute_sync()
        out.append(m[0].seconds)
        drop_dir(path)
    return [out[0], statistics.median(out[1:])]


def run_methods(
    methods: list[Method],
    sizes: list[int],
    args: argparse.Namespace,
    done: Callable[[str, dict[str, Any]], None],
) -> None:
    """Save and load ``--repeat`` times with every method of ``methods``, calling
    ``done(name, results)`` for each: all of one method's runs, then the next method's,
    each method with tensors of its own (freed before the next); with ``--rounds``,
    round ``i`` runs each method once, in turn, and the methods share one set of tensors
    (one per layout: replicated or not)."""
    if not args.rounds:
        for m in methods:
            done(m.name, run_method(m, make_tensors(sizes, m.replicated), args))
        return
    states = {r: make_tensors(sizes, r) for r in sorted({m.replicated for m in methods})}
    runs: dict[str, list[dict[str, Any]]] = {m.name: [] for m in methods}
    for method in methods:
        method.setup(states[method.replicated], args.root)
    for i in range(args.repeat):
        for method in methods:
            runs[method.name].append(run_once(method, states[method.replicated], i, args))
    for m in methods:
        done(m.name, summary(m, runs[m.name], states[m.replicated], args))


def run_method(method: Method, local: dict[str, torch.Tensor], args: argparse.Namespace) -> dict:
    """Every run of one method, then its planning timings."""
    method.setup(local, args.root)
    runs = [run_once(method, local, i, args) for i in range(args.repeat)]
    return summary(method, runs, local, args)


def summary(
    method: Method,
    runs: list[dict[str, Any]],
    local: dict[str, torch.Tensor],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The medians (times) and maxima (memory) of a method's runs, the largest rank's
    state, and the method's planning."""
    state = torch.tensor([sum(t.nbytes for t in local.values())], dtype=torch.int64)
    dist.all_reduce(state, op=dist.ReduceOp.MAX)
    out: dict[str, Any] = {
        "save_s": statistics.median(r["save_s"] for r in runs),
        "load_s": statistics.median(r["load_s"] for r in runs),
        "save_runs": [r["save_s"] for r in runs],  # every run, in order (the spread)
        "load_runs": [r["load_s"] for r in runs],
        "peak_rss": max(r["peak_rss"] for r in runs),
        "rss_growth": max(r["rss_growth"] for r in runs),
        "state_bytes": int(state),
        "files": runs[0]["files"],
    }
    if method.plans and not args.no_plan:
        out["plan_first_s"], out["plan_cached_s"] = time_plans(method, local, args.root)
    return out


def run_once(
    method: Method, local: dict[str, torch.Tensor], i: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One save and load of ``method`` (round ``i``); the loaded values are checked."""
    path = fresh_dir(args.root, f"{method.name}{i}")
    with measured() as saved:
        method.save(local, path)
    files = count_files(path) if rank() == 0 else 0
    baseline = isinstance(method, Raw)  # reads into its own buffer, not into ``local``
    if not baseline:
        zero(local)
    if args.cold:
        evict(path)
    with measured() as loaded:
        method.load(local, path)
    if not baseline:
        check(local, method.name)
    drop_dir(path)
    return {
        "save_s": saved[0].seconds,
        "load_s": loaded[0].seconds,
        "peak_rss": max(saved[0].peak_rss, loaded[0].peak_rss),
        "rss_growth": max(saved[0].rss_growth, loaded[0].rss_growth),
        "files": files,
    }


def over_budget(
    result: dict[str, Any], method: str, tensors: int, nbytes: int, args: argparse.Namespace
) -> str:
    """Why ``method`` is skipped on a case of ``tensors`` tensors and ``nbytes`` bytes: its
    estimated time is over ``--method-budget-s``; "" to run it. The estimate (the same on
    every rank) comes from the cases it ran before: with two, a fit of seconds per tensor
    plus seconds per byte; with one, the smaller of its per-tensor and per-byte
    extrapolations (a lower bound: a method is skipped only when it surely is too slow).
    So that one ``make bench`` finishes (plain DCP takes over ten minutes per operation
    on 100,000 tensors on a 2-core VM)."""
    budget = args.method_budget_s
    runs = [
        (c["tensors"], c["bytes"], c["methods"][method]["save_s"] + c["methods"][method]["load_s"])
        for c in result["cases"].values()
        if c["methods"].get(method, {}).get("status") == "ok"
    ]
    if budget <= 0 or not runs:
        return ""
    estimate = _estimate(runs, tensors, nbytes) * args.repeat
    if estimate <= budget:
        return ""
    return f"n/a (skipped: ~{estimate:.0f} s estimated, over --method-budget-s {budget:.0f})"


def _estimate(runs: list[tuple[int, int, float]], tensors: int, nbytes: int) -> float:
    """Seconds for ``tensors`` tensors of ``nbytes`` bytes from ``(tensors, bytes, s)`` runs."""
    if len(runs) >= 2:
        (t1, b1, s1), (t2, b2, s2) = runs[-2:]
        det = t1 * b2 - t2 * b1
        if det:
            per_tensor = (s1 * b2 - s2 * b1) / det
            per_byte = (t1 * s2 - t2 * s1) / det
            if per_tensor >= 0 and per_byte >= 0:
                return per_tensor * tensors + per_byte * nbytes
    t, b, s = runs[-1]
    return min(s / t * tensors, s / b * nbytes if b else s / t * tensors)


def save_json(result: dict[str, Any], out: str) -> None:
    """Rank 0 writes the results so far (a run cut short by a timeout keeps them)."""
    if rank() == 0:
        with open(out + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(out + ".tmp", out)


def run(args: argparse.Namespace) -> dict[str, Any]:
    presets = QUICK if args.quick else FULL
    counts = {
        "big": args.big_count or presets["big"][0],
        "mid": args.mid_count or presets["mid"][0],
        "small": args.small_count or presets["small"][0],
    }
    big_mib = args.big_mib or presets["big"][1]
    result: dict[str, Any] = {"ranks": world(), "cases": {}}
    for name in args.cases.split(","):
        sizes = case_sizes(name, counts[name], big_mib)
        case: dict[str, Any] = {"tensors": len(sizes), "bytes": sum(sizes), "methods": {}}
        result["cases"][name] = case
        runnable = []
        for method in by_name(args.methods.split(",") if args.methods else None):
            reason = method.unavailable() or over_budget(
                result, method.name, len(sizes), sum(sizes), args
            )
            if reason:
                case["methods"][method.name] = {"status": reason}
            else:
                runnable.append(method)
        save_json(result, args.out)

        def done(name: str, measured: dict[str, Any], case: dict[str, Any] = case) -> None:
            case["methods"][name] = {"status": "ok", **measured}
            save_json(result, args.out)  # a run cut short keeps the methods it finished

        run_methods(runnable, sizes, args, done)
    result["complete"] = True
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file written by rank 0")
    p.add_argument("--quick", action="store_true", help="smaller cases (a smoke run)")
    p.add_argument("--cases", default="big,mid,small")
    p.add_argument("--methods", default="", help="comma-separated subset (default: all)")
    p.add_argument("--big-mib", type=int, default=0, help="MiB of the big case")
    p.add_argument("--big-count", type=int, default=0, help="tensors of the big case")
    p.add_argument("--mid-count", type=int, default=0, help="tensors of the 4-64 KiB case")
    p.add_argument("--small-count", type=int, default=0, help="tensors of the 1 KiB case")
    p.add_argument("--repeat", type=int, default=1, help="median of N runs")
    p.add_argument("--cold", action="store_true", help="drop files from the page cache")
    p.add_argument("--rounds", action="store_true", help="run the methods in turn, per repeat")
    p.add_argument("--no-plan", action="store_true", help="skip the planning timings")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument(
        "--method-budget-s",
        type=float,
        default=900.0,
        help="skip a method whose estimated time on a case is above this (0: never)",
    )
    return p.parse_args(argv)


def main() -> None:
    args = parse()
    dist.init_process_group("gloo")
    args.root = os.path.join(args.dir or tempfile.gettempdir(), f"dist_ckpt_table_{world()}")
    try:
        save_json(run(args), args.out)
    finally:
        dist.barrier()
        if rank() == 0:
            shutil.rmtree(args.root, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
