"""``inspect``, ``show``, ``diff`` and ``rm``: each returns its exit code."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from fnmatch import fnmatchcase
from typing import Any

import torch

from .. import serialization
from ..errors import CheckpointingException
from .source import (
    Checkpoint,
    file_sizes,
    incomplete_reason,
    is_checkpoint_dir,
    one_line,
    open_checkpoint,
)
from .ui import CliError, human_bytes, table

_RANK_FILE = re.compile(r"__(\d+)_\d+(\.[0-9a-f]+)?\.(distcp|dcpraw)$")


def _summary(ckpt: Checkpoint, pattern: str | None) -> dict[str, Any]:
    files = ckpt.files()
    ranks = {int(m.group(1)) for n in files if (m := _RANK_FILE.match(n))}
    keys = ckpt.select(pattern)
    return {
        "path": ckpt.path,
        "backend": ckpt.backend,
        "complete": True,
        "ranks": len(ranks),
        "files": len(files),
        "total_bytes": sum(files.values()),
        "tensors": [
            {
                "key": k,
                "shape": list(ckpt.tensors[k].shape),
                "dtype": str(ckpt.tensors[k].dtype).removeprefix("torch."),
                "shards": ckpt.tensors[k].shards,
                "bytes": ckpt.tensors[k].nbytes,
            }
            for k in keys
        ],
        "objects": [o for o in ckpt.objects if pattern is None or fnmatchcase(o, pattern)],
    }


def _incomplete(path: str, as_json: bool) -> int:
    if not is_checkpoint_dir(path):
        raise CliError(f"{path}: not a directory")
    reason = incomplete_reason(path)
    if not reason or reason.startswith("not a checkpoint"):
        raise CliError(f"{path}: {reason or 'unreadable checkpoint'}")
    files = file_sizes(path)
    info = {"path": path, "complete": False, "reason": reason, "files": len(files)}
    info["total_bytes"] = sum(files.values())
    print(json.dumps(info, indent=1) if as_json else f"{path}: {reason}")
    return 1


def cmd_inspect(args: argparse.Namespace) -> int:
    path = os.fspath(args.dir)
    if is_checkpoint_dir(path) and incomplete_reason(path):
        return _incomplete(path, args.json)
    info = _summary(open_checkpoint(path), args.key)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"checkpoint  {info['path']}")
    print(f"backend     {info['backend']}")
    print("complete    yes")
    print(f"ranks       {info['ranks']}    files {info['files']}")
    print(f"total       {human_bytes(info['total_bytes'])} ({info['total_bytes']} bytes)")
    rows = [
        (t["key"], tuple(t["shape"]), t["dtype"], t["shards"], human_bytes(t["bytes"]))
        for t in info["tensors"]
    ]
    print()
    print(table(("key", "global shape", "dtype", "shards", "bytes"), rows))
    if info["objects"]:
        print()
        print(table(("sharded object",), [(o,) for o in info["objects"]]))
    return 0


# --------------------------------------------------------------------------- show


def parse_slice(text: str, shape: tuple[int, ...]) -> tuple[list[range], list[int]]:
    """``"0:2, :, 3"`` -> one range per axis and the axes an integer index drops."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > len(shape):
        raise CliError(f"slice {text!r} has {len(parts)} axes; the tensor has {len(shape)}")
    ranges, dropped = [], []
    for axis, size in enumerate(shape):
        part = parts[axis] if axis < len(parts) else ":"
        try:
            if ":" in part:
                bits = [int(b) if b.strip() else None for b in part.split(":")]
                if len(bits) > 3 or (len(bits) == 3 and bits[2] is not None and bits[2] <= 0):
                    raise ValueError
                r = range(size)[slice(*bits)]
            else:
                i = int(part)
                r = range(size)[i : i + 1 if i != -1 else None]
                if not -size <= i < size:
                    raise IndexError
                dropped.append(axis)
        except (ValueError, IndexError):
            raise CliError(
                f"bad slice {text!r} for shape {tuple(shape)} (axis {axis}: {part!r})"
            ) from None
        if len(r) == 0:
            raise CliError(f"slice {text!r} selects nothing on axis {axis}")
        ranges.append(r)
    return ranges, dropped


def read_slice(ckpt: Checkpoint, key: str, text: str) -> torch.Tensor:
    """The slice of ``key``, reading only the bytes between its first and last element."""
    shape = ckpt.info(key).shape
    ranges, dropped = parse_slice(text, shape)
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    start = sum(r[0] * s for r, s in zip(ranges, strides))
    stop = sum(r[-1] * s for r, s in zip(ranges, strides)) + 1
    flat = ckpt.read_flat(key, start, stop)
    sizes = [len(r) for r in ranges]
    out = torch.as_strided(flat, sizes, [r.step * s for r, s in zip(ranges, strides)])
    for axis in reversed(dropped):
        out = out.squeeze(axis)
    return out


def tensor_stats(t: torch.Tensor) -> dict[str, Any]:
    x = t.detach().to(torch.float64) if t.dtype != torch.float64 else t
    finite = x[torch.isfinite(x)]
    out: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    out["numel"] = t.numel()
    out["nan"] = int(torch.isnan(x).sum())
    out["inf"] = int(torch.isinf(x).sum())
    empty = finite.numel() == 0
    out["min"] = None if empty else finite.min().item()
    out["max"] = None if empty else finite.max().item()
    out["mean"] = None if empty else finite.mean().item()
    out["norm"] = None if empty else finite.norm().item()
    return out


def cmd_show(args: argparse.Namespace) -> int:
    ckpt = open_checkpoint(args.dir)
    ckpt.info(args.key)
    t = read_slice(ckpt, args.key, args.slice) if args.slice else ckpt.read(args.key)
    stats = tensor_stats(t)
    if args.json:
        print(json.dumps({"key": args.key, "slice": args.slice, **stats}, indent=1))
    else:
        title = args.key + (f"[{args.slice}]" if args.slice else "")
        print(title)
        for name, value in stats.items():
            print(f"  {name:<6} {value}")
    return 0


# --------------------------------------------------------------------------- diff and rm


def cmd_diff(args: argparse.Namespace) -> int:
    a, b = open_checkpoint(args.a), open_checkpoint(args.b)
    lines = [f"only in A: {k}" for k in sorted(set(a.tensors) - set(b.tensors))]
    lines += [f"only in B: {k}" for k in sorted(set(b.tensors) - set(a.tensors))]
    for key in sorted(set(a.tensors) & set(b.tensors)):
        ta, tb = a.tensors[key], b.tensors[key]
        if ta.shape != tb.shape or ta.dtype != tb.dtype:
            lines.append(f"differs: {key}: {ta.shape} {ta.dtype} vs {tb.shape} {tb.dtype}")
        elif args.values:
            va, vb = a.read(key).to(torch.float64), b.read(key).to(torch.float64)
            same_nan = torch.equal(torch.isnan(va), torch.isnan(vb))
            both = ~(torch.isnan(va) | torch.isnan(vb))
            va, vb = va[both], vb[both]
            diff = torch.where(va == vb, 0.0, (va - vb).abs())  # inf == inf
            worst = diff.max().item() if diff.numel() else 0.0
            if worst != 0 or not same_nan:
                lines.append(
                    f"values: {key}: max abs diff {worst}" + ("" if same_nan else ", NaNs differ")
                )
    print("\n".join(lines) if lines else "no differences")
    return 1 if lines else 0


def cmd_rm(args: argparse.Namespace) -> int:
    ckpt = open_checkpoint(args.dir)
    keys = [k for k in sorted(ckpt.tensors) if k.startswith(args.prefix)]
    if not keys:
        raise CliError(f"{ckpt.path}: no tensor key starts with {args.prefix!r}")
    verb = "would remove" if args.dry_run else "removing"
    for key in keys:
        print(f"{verb} {key} {ckpt.tensors[key].shape} {human_bytes(ckpt.tensors[key].nbytes)}")
    if not args.dry_run:
        try:
            serialization.remove_sharded_tensors(ckpt.path, args.prefix)
        except (CheckpointingException, OSError) as e:
            raise CliError(f"{ckpt.path}: {one_line(e)}") from e
        print(f"removed {len(keys)} tensor(s)")
    return 0


__all__ = ["cmd_diff", "cmd_inspect", "cmd_rm", "cmd_show", "parse_slice", "read_slice"]
