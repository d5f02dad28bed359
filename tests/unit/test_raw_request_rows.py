"""Narrowing a ``raw_bytes`` index to what one load can use (``engine/raw/request_rows``).

Indexes are built from real save plans of several simulated ranks (:func:`plan_rank`,
:func:`merge_pieces`): grid blocks, distributed-optimizer flat ranges cut at random
places, replicas, objects. Property: the load plan made over the narrowed index reads
exactly the bytes (file, offset, length) the plan over the whole index reads; and where
every rank stored a flat range of every block, an exact request keeps a few entries per
key, not one per rank.
"""

from __future__ import annotations

import pickle
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.engine.raw.index import RawIndex, parse_index
from dist_checkpointing.engine.raw.load import (
    key_heads,
    narrowed,
    objects_metadata,
    tensors_metadata,
)
from dist_checkpointing.engine.raw.load_plan import LoadPlanner
from dist_checkpointing.engine.raw.pieces import merge_pieces, merged_encoding
from dist_checkpointing.engine.raw.request_rows import key_table, rows_for, subset
from dist_checkpointing.engine.raw.writer import plan_rank
from dist_checkpointing.errors import CorruptCheckpointError

SHAPE = (12, 10)
NUMEL = SHAPE[0] * SHAPE[1]


def _cuts(ranks: int, seed: int) -> list[int]:
    gen = np.random.default_rng(seed)
    inner = sorted(gen.choice(np.arange(1, NUMEL), ranks - 1, replace=False).tolist())
    return [0, *inner, NUMEL]


def _box(key: str, data: torch.Tensor, offset: tuple[int, int]) -> ShardedTensor:
    """A block of a global tensor of ``SHAPE`` at ``offset`` (any size)."""
    return ShardedTensor(key, data, data.dtype, tuple(data.shape), SHAPE, offset, None)


def _saved(rank: int, ranks: int, tensors: int, seed: int) -> list:
    """What simulated rank ``rank`` saves: a row block and a column block of each
    tensor, a flat range of each tensor's optimizer state, a replica (rank 0), an object."""
    out: list = []
    for i in range(tensors):
        full = torch.arange(NUMEL, dtype=torch.float32).reshape(SHAPE) + 1000 * i
        rows = full.chunk(ranks, 0)
        if rank < len(rows):
            at = (sum(len(r) for r in rows[:rank]), 0)
            out.append(_box(f"row{i}", rows[rank].clone(), at))
        cols = full.chunk(ranks, 1)
        if rank < len(cols):
            at = (0, sum(c.shape[1] for c in cols[:rank]))
            out.append(_box(f"col{i}", cols[rank].clone(), at))
        cuts = _cuts(ranks, seed + i)
        a, b = cuts[rank], cuts[rank + 1]
        out.append(
            ShardedTensor.from_rank_offsets_flat(
                f"opt{i}", full.reshape(-1)[a:b].clone(), SHAPE, flattened_range=slice(a, b)
            )
        )
        rep = ShardedTensor.from_rank_offsets(f"rep{i}", full[0].clone(), replica_id=rank)
        out.append(rep)
    out.append(ShardedObject("obj", {"rank": rank}, (ranks,), (rank,)))
    return out


def _index(ranks: int, tensors: int, seed: int) -> RawIndex:
    pieces = []
    for r in range(ranks):
        _, piece = plan_rank(_saved(r, ranks, tensors, seed), "/ckpt", r, 2, 64, 256)
        pieces.append(piece)
    index = merge_pieces(pieces, 64, 256)
    return parse_index(index.to_bytes(), "idx")


def _requested(kinds: list[tuple[int, str, int, int]], tensors: int, ranks: int) -> list:
    """Requests: per ``(tensor, kind, a, b)`` a box of rows ``[a, b)`` of ``row``/``col``/
    ``rep`` or a flat range ``[a, b)`` of ``opt`` state; plus the last rank's object."""
    out: list = [ShardedObject("obj", None, (ranks,), (ranks - 1,))]
    for i, kind, a, b in kinds:
        i %= tensors
        a, b = min(a, b), max(a, b) + 1
        if kind == "opt":
            out.append(
                ShardedTensor.from_rank_offsets_flat(
                    f"opt{i}", torch.empty(b - a), SHAPE, flattened_range=slice(a, b)
                )
            )
            continue
        a, b = a % SHAPE[0], min(b % SHAPE[0] + 1, SHAPE[0])
        a, b = min(a, b - 1), b
        if kind == "rep":
            out.append(ShardedTensor.from_rank_offsets(f"rep{i}", torch.empty(SHAPE[1])))
            continue
        out.append(_box(f"{kind}{i}", torch.empty(b - a, SHAPE[1]), (a, 0)))
    return out


def _reads(index: RawIndex, leaves: list) -> list[tuple[str, int, int, bool]]:
    planner = LoadPlanner(index)
    for sh in leaves:
        if isinstance(sh, ShardedObject):
            planner.add_object(sh)
        else:
            planner.add_tensor(sh)
    plan = planner.finish()
    files = index.columns["file"]
    return sorted((index.files[files[r.row]], r.at, r.length, r.stage is None) for r in plan.reads)


_requests = st.lists(
    st.tuples(
        st.integers(0, 5),
        st.sampled_from(["row", "col", "rep", "opt"]),
        st.integers(0, NUMEL - 1),
        st.integers(0, NUMEL - 1),
    ),
    min_size=1,
    max_size=8,
    unique_by=lambda t: (t[0], t[1]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(ranks=st.integers(1, 6), tensors=st.integers(1, 3), seed=st.integers(0, 99), req=_requests)
def test_the_narrowed_plan_reads_what_the_whole_plan_reads(
    ranks: int, tensors: int, seed: int, req: list
) -> None:
    index = _index(ranks, tensors, seed)
    leaves = _requested(req, tensors, ranks)
    rows = rows_for(index, key_table(index), leaves)
    assert _reads(subset(index, rows), leaves) == _reads(index, leaves)


def test_an_exact_flat_request_keeps_few_entries_not_one_per_rank() -> None:
    ranks = 24
    index = _index(ranks, 2, 5)
    cuts = _cuts(ranks, 5)
    leaves = [
        ShardedTensor.from_rank_offsets_flat(
            "opt0", torch.empty(cuts[8] - cuts[7]), SHAPE, flattened_range=slice(cuts[7], cuts[8])
        )
    ]
    rows = rows_for(index, key_table(index), leaves)
    keys = [index.key_list[r] for r in rows.tolist()]
    assert set(keys) == {"opt0"}
    assert sum(index.key_list[r] == "opt0" for r in range(len(index.entries))) == ranks
    # the range widened to whole rows of the block (10 elements) meets a few stored ranges
    per_row = SHAPE[1]
    a, b = cuts[7] // per_row * per_row, -(-cuts[8] // per_row) * per_row
    meeting = [r for r in range(ranks) if cuts[r] < b and a < cuts[r + 1]]
    kept = {(int(index.entries["flat_start"][r]), int(index.entries["flat_stop"][r])) for r in rows}
    assert {(cuts[r], cuts[r + 1]) for r in meeting} <= kept
    assert (cuts[0], cuts[1]) in kept  # the key's first entry stays (see rows_for)
    assert len(rows) <= len(meeting) + 1 < ranks


def test_a_grid_request_keeps_the_blocks_it_meets() -> None:
    index = _index(6, 1, 0)
    leaves = [_box("row0", torch.empty(2, SHAPE[1]), (3, 0))]
    rows = rows_for(index, key_table(index), leaves)
    boxes = [index.box(r)[1:] for r in rows.tolist()]
    # rows 2-3 and 4-5 of 12 meet rows 3-4; rows 0-1 are the key's first entry
    assert boxes == [((0, 0), (2, 10)), ((2, 0), (2, 10)), ((4, 0), (2, 10))]


def test_keys_shared_by_ranks_are_stored_once_and_read_back_per_entry() -> None:
    index = _index(4, 2, 1)
    # every rank stores the flat ranges of opt0 and opt1: their keys are written once;
    # ranks 1-3 store the same grid blocks (rank 0 also the replicas): two copies; each
    # rank's object has its own key
    assert index.keys.count(b"opt0") == index.keys.count(b"opt1") == 1
    assert index.keys.count(b"row0col0rep0row1col1rep1") == 1
    assert index.keys.count(b"row0col0row1col1") == 1
    assert index.keys.count(b"obj/shard_") == 4
    table = key_table(index)
    assert [table.names[i] for i in table.ids.tolist()] == index.key_list
    expected = []
    for r in range(4):
        expected += [
            sh.unique_key if isinstance(sh, ShardedObject) else sh.key
            for sh in _saved(r, 4, 2, 1)
            if not isinstance(sh, ShardedTensor) or sh.replica_id == 0 or sh.key[:3] != "rep"
        ]
    assert sorted(index.key_list) == sorted(expected)


def test_pieces_sent_as_the_gather_pickles_them_merge_to_the_same_bytes() -> None:
    pieces = [plan_rank(_saved(r, 4, 3, 5), "/ckpt", r, 2, 64, 256)[1] for r in range(4)]
    sent = [pickle.loads(pickle.dumps(p, protocol=4)) for p in pieces]
    for mine, got in zip(pieces, sent):
        assert got.entries.dtype == mine.entries.dtype
        for name in ("entries", "dims", "crcs"):
            assert getattr(got, name).tobytes() == getattr(mine, name).tobytes(), name
        for name in ("files", "file_sizes", "keys", "dtypes", "key_runs"):
            assert getattr(got, name) == getattr(mine, name), name
    assert merged_encoding(sent, 64, 256)[1] == merged_encoding(pieces, 64, 256)[1]
    # keys in runs or not, shared or not: each entry's key is read back as it was written
    one_run = [replace(p, key_runs=[]) for p in pieces]
    for merged in (merge_pieces(sent, 64, 256), merge_pieces(one_run, 64, 256)):
        assert sorted(merged.key_list) == sorted(k for p in pieces for k in _keys_of(p))


def _keys_of(piece: Any) -> list[str]:
    e = piece.entries
    return [
        piece.keys[s : s + n].decode()
        for s, n in zip(e["key_start"].tolist(), e["key_len"].tolist())
    ]


def test_keys_written_once_per_entry_and_crafted_places_are_read_alike() -> None:
    index = _index(3, 2, 2)
    # the layout of before (every entry's key bytes of its own)
    names = index.key_list
    blob = "".join(names).encode()
    lens = np.array([len(n.encode()) for n in names], dtype=np.uint64)
    entries = index.entries.copy()
    entries["key_start"] = np.cumsum(lens) - lens
    entries["key_len"] = lens
    plain = RawIndex(
        index.alignment,
        index.block_bytes,
        index.dtypes,
        index.files,
        entries,
        index.dims,
        index.crcs,
        blob,
    )
    table = key_table(parse_index(plain.to_bytes(), "idx"))
    assert [table.names[i] for i in table.ids.tolist()] == names
    # one start with two lengths ("opt0" and "opt") must give two keys
    crafted = RawIndex(
        index.alignment,
        index.block_bytes,
        index.dtypes,
        index.files,
        entries.copy(),
        index.dims,
        index.crcs,
        blob,
    )
    row = names.index("opt0")
    crafted.entries["key_len"][row + 1] = 3
    crafted.entries["key_start"][row + 1] = crafted.entries["key_start"][row]
    table = key_table(crafted)
    got = [table.names[i] for i in table.ids.tolist()]
    assert got[row] == "opt0" and got[row + 1] == "opt"


def test_a_key_cut_inside_a_character_is_refused() -> None:
    _, piece = plan_rank(
        [
            ShardedTensor.from_rank_offsets("ké", torch.ones(2)),
            ShardedTensor.from_rank_offsets("x", torch.ones(2)),
        ],
        "/ckpt",
        0,
        1,
        64,
        256,
    )
    index = merge_pieces([piece], 64, 256)
    index.entries["key_len"][0] = 2  # "k" and the first byte of "é"
    with pytest.raises(CorruptCheckpointError, match="not UTF-8"):
        key_table(index)


def test_subset_keeps_each_entrys_box_and_checksums() -> None:
    index = _index(5, 2, 3)
    rows = np.array([1, 4, 7, len(index.entries) - 1])
    part = subset(index, rows)
    for new, old in enumerate(rows.tolist()):
        assert part.box(new) == index.box(old)
        assert part.crcs_of(new) == index.crcs_of(old)
        assert part.key_list[new] == index.key_list[old]
        assert part.files[part.columns["file"][new]] == index.files[index.columns["file"][old]]
    assert len(part.dims) == sum(3 * len(index.box(r)[0]) for r in rows.tolist())


class _Handle:
    """What ``narrowed`` uses of a checkpoint handle: its memo."""

    def __init__(self) -> None:
        self.memos: dict[str, object] = {}

    def memo(self, key: str, compute: Any) -> Any:
        if key not in self.memos:
            self.memos[key] = compute()
        return self.memos[key]


def test_a_load_narrows_an_index_large_against_its_request(monkeypatch: Any) -> None:
    index = _index(24, 2, 5)
    n = len(index.entries)
    cuts = _cuts(24, 5)
    leaves = [
        ShardedTensor.from_rank_offsets_flat(
            "opt1", torch.empty(cuts[3] - cuts[2]), SHAPE, flattened_range=slice(cuts[2], cuts[3])
        )
    ]
    handle = _Handle()
    monkeypatch.setenv("DIST_CKPT_RAW_NARROW_ENTRIES", str(n + 1))
    assert narrowed(handle, index, leaves) is index  # below the knob: the whole index
    monkeypatch.setenv("DIST_CKPT_RAW_NARROW_ENTRIES", str(n))
    assert narrowed(handle, index, leaves * (n // 8 + 1)) is index  # under 8 per leaf
    part = narrowed(handle, index, leaves)
    assert set(part.key_list) == {"opt1"} and len(part.entries) < 24
    assert list(handle.memos) == [".raw_index#keys"]  # the key table, kept per handle
    assert _reads(part, leaves) == _reads(index, leaves)


def test_metadata_from_the_first_entry_of_each_key_equals_the_whole_index() -> None:
    index = _index(6, 3, 4)
    handle = _Handle()
    handle.memos[".raw_index"] = index  # what read_index would have parsed
    heads = key_heads(handle)
    assert len(heads.entries) == len(set(index.key_list)) < len(index.entries)
    assert heads.key_list == list(dict.fromkeys(index.key_list))
    whole, part = tensors_metadata(index), tensors_metadata(heads)
    assert list(whole) == list(part) and repr(whole) == repr(part)
    assert repr(objects_metadata(index)) == repr(objects_metadata(heads))


def test_the_merged_encoding_is_the_index_file_and_its_sections_view_it() -> None:
    pieces = [plan_rank(_saved(r, 5, 2, 6), "/ckpt", r, 2, 64, 256)[1] for r in range(5)]
    index, data = merged_encoding(pieces, 64, 256)
    assert bytes(data) == index.to_bytes()
    parsed = parse_index(bytes(data), "idx")
    assert parsed.key_list == index.key_list and parsed.files == index.files
    assert np.array_equal(parsed.entries, index.entries)
    assert np.shares_memory(index.entries, np.frombuffer(data, np.uint8))  # no second copy
    empty, blob = merged_encoding([], 64, 256)
    assert bytes(blob) == empty.to_bytes() and len(parse_index(bytes(blob), "e").entries) == 0
