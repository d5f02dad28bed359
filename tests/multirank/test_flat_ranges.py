"""``raw_bytes``: flat ranges loaded from flat ranges of the same block cut elsewhere (a
distributed optimizer's state saved with one data-parallel size, loaded with another).

Each stored range's overlap with a request is read into it (whole checksum blocks straight
in, the partial blocks at its ends staged and copied), not the whole block assembled
first. Property (hypothesis, run inside one rank process so that an example costs a save
and a load, not a process group): for any cuts of a block's flattening at save and at
load, checksum blocks of 4 KiB to 1 MiB, verified or not, destinations of the stored dtype
or another, contiguous or strided, planned over the whole index or over the entries the
request can meet (``RAW_NARROW_ENTRIES``), every request loads bit-exact. Plus: how much of the
block a request reads, and one memory under two keys.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.engine.raw import reader as raw_reader
from tests.support.harness import run_distributed

SHAPE = (96, 250)  # 24,000 elements: 96,000 bytes of float32, 23 blocks of 4 KiB
NUMEL = SHAPE[0] * SHAPE[1]


def _reference(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(SHAPE, generator=gen) * 1000).to(dtype)


def _pieces(
    key: str,
    data: torch.Tensor | None,
    cuts: list[int],
    dtype: torch.dtype,
    shape: tuple[int, ...] = SHAPE,
) -> list[Any]:
    """A ShardedTensor per flat range between ``cuts`` (its data a slice of ``data``, or
    a fresh destination of ``dtype``: a strided one for every other piece)."""
    out = []
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        if data is not None:
            piece = data.reshape(-1)[a:b].clone()
        elif i % 2:
            piece = torch.full((2 * (b - a),), -1, dtype=dtype)[::2]  # not contiguous
        else:
            piece = torch.full((b - a,), -1, dtype=dtype)
        sh = ShardedTensor.from_rank_offsets_flat(key, piece, shape, flattened_range=slice(a, b))
        out.append(sh)
    return out


_cuts = st.lists(st.integers(1, NUMEL - 1), max_size=6, unique=True).map(
    lambda xs: [0, *sorted(xs), NUMEL]
)


def _check_examples(examples: int) -> None:
    """Rank function (one rank): the property of the module docstring."""

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        saved=_cuts,
        loaded=_cuts,
        block=st.sampled_from([4096, 12288, 1 << 20]),
        verify=st.booleans(),
        stored=st.sampled_from([torch.float32, torch.bfloat16, torch.int16]),
        other_dtype=st.booleans(),
        narrow=st.booleans(),
    )
    def check(
        saved: list[int],
        loaded: list[int],
        block: int,
        verify: bool,
        stored: torch.dtype,
        other_dtype: bool,
        narrow: bool,
    ) -> None:
        os.environ["DIST_CKPT_CHECKSUM_BLOCK_BYTES"] = str(block)
        # narrow: the load plans over the index entries its request can meet only
        os.environ["DIST_CKPT_RAW_NARROW_ENTRIES"] = "0" if narrow else "65536"
        ref = _reference(stored)
        with tempfile.TemporaryDirectory() as root:
            dc.save({"w": _pieces("w", ref, saved, stored)}, root, ("raw_bytes", 1))
            want = torch.float64 if other_dtype else stored
            request = _pieces("w", None, loaded, want)
            dc.load({"w": request}, root, verify_checksums=verify)
        for sh in request:
            expected = ref.reshape(-1)[sh.flattened_range].to(want)
            assert torch.equal(sh.data, expected), (saved, loaded, sh.flattened_range)

    check()


def test_flat_ranges_cut_anywhere_load_bit_exact() -> None:
    run_distributed(_check_examples, 1, 150, timeout=600.0)


def _bytes_read(block: int) -> dict[str, Any]:
    """Rank function (one rank): a block saved in 8 flat ranges, a request of 1/8 cut
    elsewhere: the bytes read, and the request's values."""
    os.environ["DIST_CKPT_CHECKSUM_BLOCK_BYTES"] = str(block)
    ref = torch.randn(1024, 1024)
    n = ref.numel()
    read: list[int] = []
    run = raw_reader.RawReader.run

    def counting(self: Any, reads: Any, alongside: int = 0) -> None:
        read.append(sum(r.length for r in reads))
        run(self, reads, alongside)

    with tempfile.TemporaryDirectory() as root:
        saved = [n * i // 8 for i in range(9)]
        state = {"w": _pieces("w", ref, saved, torch.float32, (1024, 1024))}
        dc.save(state, root, ("raw_bytes", 1))
        a, b = n // 16 + 1000, n // 16 + 1000 + n // 8  # across two stored ranges
        dest = torch.empty(b - a)
        sh = ShardedTensor.from_rank_offsets_flat(
            "w", dest, (1024, 1024), flattened_range=slice(a, b)
        )
        raw_reader.RawReader.run = counting  # type: ignore[method-assign]
        try:
            dc.load({"w": sh}, root, validate_access_integrity=False)  # a part only
        finally:
            raw_reader.RawReader.run = run  # type: ignore[method-assign]
    return {"read": sum(read), "exact": torch.equal(dest, ref.reshape(-1)[a:b])}


def test_a_flat_request_reads_its_own_bytes_not_the_block() -> None:
    block = 64 << 10
    (res,) = run_distributed(_bytes_read, 1, block, timeout=120.0)
    assert res["exact"]
    request = 4 * (1024 * 1024 // 8)  # 512 KiB of the block's 4 MiB
    # It starts inside one stored range and ends inside the next: one checksum block more
    # at each end at most; the whole block (4 MiB) was read before.
    assert request <= res["read"] <= request + 2 * block, res["read"]


def _shared(block: int) -> list[str]:
    """Rank function (one rank): one memory requested under two keys whose stored flat
    ranges (cut elsewhere than the request) hold different values."""
    os.environ["DIST_CKPT_CHECKSUM_BLOCK_BYTES"] = str(block)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    n = a.numel()
    problems = []
    with tempfile.TemporaryDirectory() as root:
        saved = [0, n // 3, n // 2 + 5, n]
        state = {k: _pieces(k, v, saved, torch.float32, (1024, 1024)) for k, v in zip("ab", (a, b))}
        dc.save(state, root, ("raw_bytes", 1))
        for _ in range(3):
            memory = torch.zeros(n)
            cuts = [0, n // 4 + 3, n]
            request = {}
            for key in "ab":
                request[key] = [
                    ShardedTensor.from_rank_offsets_flat(
                        key, memory[x:y], (1024, 1024), flattened_range=slice(x, y)
                    )
                    for x, y in zip(cuts[:-1], cuts[1:])
                ]
            dc.load(request, root)
            if not (torch.equal(memory, a.reshape(-1)) or torch.equal(memory, b.reshape(-1))):
                problems.append("neither value")
    return problems


def test_one_memory_under_two_flat_keys_loads_one_of_the_values() -> None:
    (problems,) = run_distributed(_shared, 1, 64 << 10, timeout=120.0)
    assert problems == []


def _rows_read(block: int) -> dict[str, Any]:
    """Rank function (one rank): a (1024, 1024) tensor saved as two row blocks (TP=2),
    each cut into 4 flat ranges (DP=4); a request of one flat quarter of a row block of
    the tensor cut in 4 (TP=4): the bytes read, and the request's values."""
    os.environ["DIST_CKPT_CHECKSUM_BLOCK_BYTES"] = str(block)
    ref = torch.randn(1024, 1024)
    half = 512 * 1024
    state = []
    for tp in range(2):
        part = ref[512 * tp : 512 * (tp + 1)].reshape(-1)
        for dp in range(4):
            a, b = half * dp // 4, half * (dp + 1) // 4
            state.append(
                ShardedTensor.from_rank_offsets_flat(
                    "w", part[a:b].clone(), (512, 1024), (0, tp, 2), flattened_range=slice(a, b)
                )
            )
    read: list[int] = []
    run = raw_reader.RawReader.run

    def counting(self: Any, reads: Any, alongside: int = 0) -> None:
        read.append(sum(r.length for r in reads))
        run(self, reads, alongside)

    quarter = 256 * 1024  # the TP=4 block's elements
    a, b = quarter // 4 + 100, quarter // 2 + 100  # a DP rank's range of TP block 1
    dest = torch.empty(b - a)
    sh = ShardedTensor.from_rank_offsets_flat(
        "w", dest, (256, 1024), (0, 1, 4), flattened_range=slice(a, b)
    )
    with tempfile.TemporaryDirectory() as root:
        dc.save({"w": state}, root, ("raw_bytes", 1))
        raw_reader.RawReader.run = counting  # type: ignore[method-assign]
        try:
            dc.load({"w": sh}, root, validate_access_integrity=False)  # a part only
        finally:
            raw_reader.RawReader.run = run  # type: ignore[method-assign]
    expected = ref[256:512].reshape(-1)[a:b]
    return {"read": sum(read), "exact": torch.equal(dest, expected), "request": 4 * (b - a)}


def test_a_flat_request_of_another_block_reads_the_rows_it_needs() -> None:
    block = 64 << 10
    (res,) = run_distributed(_rows_read, 1, block, timeout=120.0)
    assert res["exact"]
    # The rows it meets (two partial ones: one more row, 4 KiB, at each end) and a
    # checksum block more at each end of each stored range they meet; the stored block
    # (2 MiB) was read whole before.
    assert res["request"] <= res["read"] <= res["request"] + 2 * 4096 + 4 * block, res
