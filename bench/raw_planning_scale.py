"""The ``raw_bytes`` layout's planning at scale, simulated in one process.

    python bench/raw_planning_scale.py [--ranks 64 256 1024 4096] [--tensors 1000]
                                       [--optimizer [every-rank|buffer]] [--no-memory]
                                       [--skip-old]

The layout of ``planning_scale.py`` (TP=8, data parallel over the rest; with
``--optimizer`` or ``--optimizer every-rank`` every rank holds two distributed-optimizer
flat ranges of each row block, so the checkpoint has ``W x 1,500`` flat entries; with
``--optimizer buffer``, Megatron-Core's distributed optimizer, a rank holds those of the
blocks its part of the buffer meets). Each simulated rank's index piece is what
``plan_rank`` makes of its sharded state dict: the pieces of the first two data-parallel
ranks of every tensor-parallel rank are planned for real; of the others, with
``every-rank``, those of the second with each flat range moved to the rank's own (its
bounds, lengths and file offsets recomputed as ``plan_rank`` computes them), with
``buffer`` a plan of the rank's optimizer state alone (its model tensors are replicas
the rank does not write); each way checked against a real plan of a whole state dict.
Steps (``*``: the coordinator; CPU seconds of the rank that does the most work and,
unless ``--no-memory``, the peak allocation of a second pass under tracemalloc):

- ``plan (rank)``: ``plan_rank`` of data-parallel rank 0's leaves (the most of any rank);
- ``plan cached (rank)``: the same through the strategy's ``LayoutCache`` (an unchanged
  structure);
- ``unpickle pieces*``: the coordinator unpickles every rank's piece as the save's
  ``gather_object`` delivers it (the gather itself is not simulated);
- ``merge+encode*``: the coordinator merges every rank's piece into the bytes of
  ``.raw_index`` (``merged_encoding``; every save, first or cached);
- ``parse (load)``: what every loading rank spends parsing and checking ``.raw_index``;
- ``plan load (rank)``: one rank's load plan of its own state (the same layout): the
  index narrowed to what its request can meet (``request_rows``, with the key table),
  then planned;
- ``plan load, whole index (rank)``: the same request planned over the whole index, as
  every load did before the narrowing (skipped by ``--skip-old``).

Under torchrun (``make bench``) only rank 0 runs it, with the same arguments.
"""

from __future__ import annotations

import pickle
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planning_scale import (  # noqa: E402
    TP,
    flat_ranges,
    measure,
    param_keys,
    real_state_dict,
    row,
    scale_args,
)

from dist_checkpointing.engine.raw.index import KIND_FLAT, parse_index  # noqa: E402
from dist_checkpointing.engine.raw.load_plan import LoadPlanner  # noqa: E402
from dist_checkpointing.engine.raw.pieces import IndexPiece, merged_encoding  # noqa: E402
from dist_checkpointing.engine.raw.plan_reuse import LayoutCache  # noqa: E402
from dist_checkpointing.engine.raw.request_rows import key_table, rows_for, subset  # noqa: E402
from dist_checkpointing.engine.raw.writer import plan_rank  # noqa: E402
from dist_checkpointing.mapping import ShardedTensor  # noqa: E402

FILES, ALIGN, BLOCK = 2, 64, 1 << 20
ITEMSIZE = 4  # float32


def _plan(
    rank: int, world: int, keys: list[str], optimizer: str | None, model: bool = True
) -> IndexPiece:
    leaves = list(real_state_dict(rank, world, keys, optimizer, model).values())
    return plan_rank(leaves, "/ckpt", rank, FILES, ALIGN, BLOCK)[1]


def moved(template: IndexPiece, rank: int, world: int, keys: list[str]) -> IndexPiece:
    """``template`` (a data-parallel rank's piece, not rank 0's, of the ``every-rank``
    layout) with every flat range moved to data-parallel rank ``rank // TP``'s, offsets
    and sizes recomputed."""
    e = template.entries.copy()
    flat = e["kind"] == KIND_FLAT
    a, b = next(iter(flat_ranges(rank // TP, world // TP, keys, "every-rank").values()))
    e["flat_start"][flat], e["flat_stop"][flat] = a, b
    e["length"][flat] = (b - a) * ITEMSIZE
    padded = (e["length"].astype(np.int64) + ALIGN - 1) // ALIGN * ALIGN
    sizes = []
    for f in range(len(template.file_sizes)):
        at = np.flatnonzero(e["file"] == f)
        ends = np.cumsum(padded[at])
        e["offset"][at] = ends - padded[at]
        sizes.append(int(ends[-1] - padded[at][-1] + e["length"][at][-1]) if len(at) else 0)
    names = [f"__{rank}_{f}.dcpraw" for f in range(len(sizes))]
    return IndexPiece(
        names,
        sizes,
        e,
        template.dims,
        template.crcs,
        template.keys,
        template.dtypes,
        template.key_runs,
    )


def pieces(world: int, keys: list[str], optimizer: str | None) -> list[IndexPiece]:
    """Every simulated rank's index piece (see the module docstring)."""
    real = {r: _plan(r, world, keys, optimizer) for r in range(min(world, 2 * TP))}
    out = []
    for r in range(world):
        if r in real:
            out.append(real[r])
        elif optimizer == "buffer":
            out.append(_plan(r, world, keys, optimizer, model=False))
        else:
            out.append(moved(real[TP + r % TP], r, world, keys))
    probe = min(world - 1, 3 * TP + 1)
    if probe >= 2 * TP:  # the derived piece is the real one
        mine, derived = _plan(probe, world, keys, optimizer), out[probe]
        assert mine.entries.tobytes() == derived.entries.tobytes(), probe
        assert mine.file_sizes == derived.file_sizes and mine.keys == derived.keys
    return out


def run(world: int, keys: list[str], optimizer: str | None, memory: bool, old: bool) -> None:
    sd = real_state_dict(0, world, keys, optimizer)
    leaves = list(sd.values())
    row(
        world,
        "plan (rank)",
        *measure(lambda: plan_rank(leaves, "/c", 0, FILES, ALIGN, BLOCK), memory)[:2],
    )
    cache = LayoutCache()
    cache.plan(leaves, "/c", 0, FILES, ALIGN, BLOCK)
    row(
        world,
        "plan cached (rank)",
        *measure(lambda: cache.plan(leaves, "/c", 0, FILES, ALIGN, BLOCK), memory)[:2],
    )
    parts = pieces(world, keys, optimizer)
    sent = [pickle.dumps(p, protocol=4) for p in parts]  # as gather_object sends them
    seconds, peak, _ = measure(lambda: [pickle.loads(b) for b in sent], memory)
    row(world, f"unpickle pieces* ({sum(map(len, sent)) >> 20} MiB)", seconds, peak)
    sent = []
    seconds, peak, encoded = measure(lambda: merged_encoding(parts, ALIGN, BLOCK)[1], memory)
    row(world, f"merge+encode* ({len(encoded) >> 20} MiB)", seconds, peak)
    data = bytes(encoded)  # as a load reads it
    del encoded
    parts = []
    seconds, peak, index = measure(lambda: parse_index(data, "index"), memory)
    row(world, "parse (load)", seconds, peak)
    rank = world // 2 + 1  # a rank of data-parallel rank > 0
    request = list(real_state_dict(rank, world, keys, optimizer).values())

    def narrowed() -> Any:
        part = subset(index, rows_for(index, key_table(index), request))
        return _planned(part, request), len(part.entries)

    seconds, peak, (reads, kept) = measure(narrowed, memory)
    row(world, f"plan load ({kept} kept)", seconds, peak)
    if old:
        # a fresh RawIndex of the same sections: its per-entry lists are built again
        seconds, peak, whole = measure(lambda: _planned(replace(index), request), memory)
        assert whole == reads
        row(world, "plan load, whole index", seconds, peak)


def _planned(index: Any, request: list[Any]) -> list[tuple[str, int, int]]:
    planner = LoadPlanner(index)
    for sh in request:
        assert isinstance(sh, ShardedTensor)
        planner.add_tensor(sh)
    files = index.columns["file"]
    return [(index.files[files[r.row]], r.at, r.length) for r in planner.finish().reads]


def main() -> None:
    args = scale_args(__doc__ or "", "planning the load over the whole index")
    if args is None:
        return
    keys = param_keys(args.tensors)
    for world in args.ranks:
        run(world, keys, args.optimizer, not args.no_memory, not args.skip_old)


if __name__ == "__main__":
    main()
