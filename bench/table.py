"""The benchmark table: every method, every case, on 1, 2 and 4 ranks, in one run.

    python bench/table.py [--quick] [--ranks 1,2,4] [--repeat N] [--json results.json]

(``make bench`` runs it; ``make bench BENCH_ARGS="--quick"`` for a smoke run.) For each
rank count it launches ``torchrun`` on ``bench/table_run.py``, which writes its results
as JSON; then it prints one table from all of them, and how the targets stand.

Cases (full mode; ``--quick`` has 64 MiB in 50 tensors, 1,000 and 5,000 tensors):

- ``big``: 1 GiB in 200 float32 tensors;
- ``mid``: 10,000 tensors of 4, 8, 16, 32 and 64 KiB (in turn);
- ``small``: 100,000 tensors of 1 KiB.

Columns: save and load throughput (checkpoint bytes / seconds of the slowest rank);
microseconds per tensor per rank (seconds x ranks / tensors); the planning step of a
first save and (the median of three) of the saves of the same structure after it
(cached); the largest rank's peak RSS, how far above its RSS at the start of the save or
load that peak went (``RSS +``: what the method needs beyond the state), and the bytes
of state it holds; the files in the checkpoint. With ``--rounds`` the methods run in rounds (each round runs every method
once) and share the state's tensors, so a peak RSS includes the state of every method of
the case. Methods are described in ``bench/table_methods.py``; a method that cannot run
here shows "n/a (why)".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Any

from dist_checkpointing.engine import knobs

HERE = os.path.dirname(os.path.abspath(__file__))
METHOD_ORDER = ("ours", "raw_bytes", "fully_parallel", "dcp", "megatron", "raw")
COLUMNS = (
    ("case", 6),
    ("ranks", 5),
    ("method", 15),
    ("save GB/s", 9),
    ("load GB/s", 9),
    ("save us/t", 9),
    ("load us/t", 9),
    ("plan 1st s", 10),
    ("plan cached s", 13),
    ("peak RSS MiB", 12),
    ("RSS +MiB", 8),
    ("state MiB", 9),
    ("files", 6),
)
# Targets of the issue: fraction of the raw baseline's throughput on the big case.
RAW_TARGETS = {"raw_bytes": 0.95, "ours": 0.85}
DCP_TARGET = 20.0  # times plain DCP's speed on the mid case


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop torchrun and its ranks: SIGTERM (torchrun stops its ranks), then SIGKILL."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def launch(nproc: int, args: argparse.Namespace, passthrough: list[str]) -> dict[str, Any]:
    """Run table_run.py on ``nproc`` ranks; its JSON results (or the failure)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"ranks{nproc}.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            os.path.join(HERE, "table_run.py"),
            "--out",
            out,
            *passthrough,
        ]
        print(f"== {nproc} rank(s): {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            failure = f"torchrun exited with {proc.wait(timeout=args.timeout)}"
        except subprocess.TimeoutExpired:
            stop(proc)
            failure = f"timed out after {args.timeout:.0f} s"
        if not os.path.exists(out):
            return {"ranks": nproc, "error": failure}
        with open(out) as f:
            result: dict[str, Any] = json.load(f)
        if not result.get("complete"):
            result["error"] = failure  # the rows measured before it stopped are kept
        return result


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def row(case: str, nranks: int, method: str, info: dict[str, Any], c: dict[str, Any]) -> list[str]:
    """The cells of one line of the table."""
    head = [case, str(nranks), method]
    if info.get("status") != "ok":
        return head + [str(info.get("status", "missing"))]
    per_tensor = 1e6 * nranks / c["tensors"]
    return head + [
        _num(c["bytes"] / info["save_s"] / 1e9, ".3f"),
        _num(c["bytes"] / info["load_s"] / 1e9, ".3f"),
        _num(info["save_s"] * per_tensor, ".1f"),
        _num(info["load_s"] * per_tensor, ".1f"),
        _num(info.get("plan_first_s"), ".3f"),
        _num(info.get("plan_cached_s"), ".3f"),
        _num(info["peak_rss"] / 2**20, ".0f"),
        _num(info.get("rss_growth", 0) / 2**20, ".0f"),
        _num(info["state_bytes"] / 2**20, ".0f"),
        str(info["files"]),
    ]


def rows(results: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    cases = [c for r in results for c in r.get("cases", {})]
    for case in dict.fromkeys(cases or ["-"]):
        for r in results:
            c = r.get("cases", {}).get(case)
            if c is not None:
                for method in METHOD_ORDER:
                    if method in c["methods"]:
                        out.append(row(case, r["ranks"], method, c["methods"][method], c))
            last = list(r.get("cases", {}))[-1:]
            if "error" in r and (c is None or [case] == last):  # where this rank count stopped
                out.append([case, str(r["ranks"]), "(rest)", f"not measured: {r['error']}"])
    return out


def format_table(results: list[dict[str, Any]]) -> str:
    lines = [" ".join(f"{name:>{w}}" for name, w in COLUMNS)]
    for cells in rows(results):
        if len(cells) == len(COLUMNS):
            lines.append(" ".join(f"{cell:>{w}}" for cell, (_, w) in zip(cells, COLUMNS)))
        else:  # a method that did not run: its reason spans the remaining columns
            lead = " ".join(f"{cell:>{w}}" for cell, (_, w) in zip(cells[:3], COLUMNS))
            lines.append(f"{lead} {cells[3]}")
    return "\n".join(lines)


def _ratio(c: dict[str, Any], a: str, b: str, op: str) -> float | None:
    x, y = c["methods"].get(a, {}), c["methods"].get(b, {})
    if x.get("status") != "ok" or y.get("status") != "ok":
        return None
    return float(y[f"{op}_s"] / x[f"{op}_s"])  # a's speed relative to b's


def targets(results: list[dict[str, Any]]) -> list[str]:
    """One line per target and rank count: measured against the target."""
    lines = []
    for r in results:
        cases = r.get("cases", {})
        n = r["ranks"]
        if "big" in cases:
            for method, goal in RAW_TARGETS.items():
                for op in ("save", "load"):
                    got = _ratio(cases["big"], method, "raw", op)
                    if got is not None:
                        verdict = "met" if got >= goal else "not met"
                        lines.append(
                            f"big, {n} rank(s): {method} {op} at {100 * got:.0f}% of raw "
                            f"(target {100 * goal:.0f}%: {verdict})"
                        )
        if "mid" in cases:
            lines += _dcp_lines(cases["mid"], n)
        lines += _megatron_lines(cases, n)
        lines += _memory_lines(cases, n)
    return lines


def _memory_lines(cases: dict[str, Any], n: int) -> list[str]:
    """Each layout's peak RSS above the state (``RSS +``) against the copy-ahead budget,
    the fully parallel wrappers' too (above their replicated state)."""
    budget = knobs.COPY_AHEAD_BYTES.get()  # as the ranks see it: environment or default
    if budget <= 0:
        return [f"{n} rank(s): no copy-ahead budget set (COPY_AHEAD_BYTES=0)"]
    lines = []
    for name, case in cases.items():
        for method in ("ours", "raw_bytes", "fully_parallel"):
            info = case["methods"].get(method, {})
            if info.get("status") == "ok" and "rss_growth" in info:
                got = info["rss_growth"]
                verdict = "met" if got <= budget else "not met"
                lines.append(
                    f"{name}, {n} rank(s): {method} peak RSS {got / 2**20:.0f} MiB above the "
                    f"state (copy-ahead budget {budget / 2**20:.0f} MiB: {verdict})"
                )
    return lines


def _megatron_lines(cases: dict[str, Any], n: int) -> list[str]:
    """How many times Megatron-Core's speed each layout reaches, on every case it ran."""
    lines = []
    for name, case in cases.items():
        for method in ("ours", "raw_bytes"):
            got = [_ratio(case, method, "megatron", op) for op in ("save", "load")]
            if None not in got:
                lines.append(
                    f"{name}, {n} rank(s): {method} save {got[0]:.1f}x, load {got[1]:.1f}x "
                    "Megatron-Core"
                )
    return lines


def _dcp_lines(mid: dict[str, Any], n: int) -> list[str]:
    """Each layout's speed-up over plain DCP on the mid case, and the raw baseline's
    (the most any checkpointer can reach on this machine)."""
    lines = []
    for method in ("ours", "raw_bytes", "raw"):
        for op in ("save", "load"):
            got = _ratio(mid, method, "dcp", op)
            if got is None:
                continue
            if method == "raw":
                lines.append(f"mid, {n} rank(s): the raw baseline {op}s {got:.1f}x plain DCP")
                continue
            verdict = "met" if got >= DCP_TARGET else "not met"
            lines.append(
                f"mid, {n} rank(s): {method} {op} {got:.1f}x plain DCP "
                f"(target {DCP_TARGET:.0f}x: {verdict})"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", default="1,2,4", help="rank counts, comma-separated")
    parser.add_argument("--json", default=None, help="also write the merged results here")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per rank count")
    args, passthrough = parser.parse_known_args()
    results = [launch(int(n), args, passthrough) for n in args.ranks.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(format_table(results))
    print()
    for line in targets(results):
        print(line)


if __name__ == "__main__":
    main()
