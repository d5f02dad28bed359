"""How one load's reads are cut into runs for the reading threads (``read_spans``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_checkpointing.engine.storage.read_spans import reading_threads, span_bytes, split_spans

files_st = st.lists(
    st.lists(st.integers(min_value=0, max_value=5000), max_size=30), min_size=1, max_size=5
)


@settings(max_examples=300, deadline=None)
@given(files_st, st.integers(min_value=1, max_value=20000))
def test_runs_keep_every_item_in_order_and_reach_the_target(
    sizes: list[list[int]], target: int
) -> None:
    files = [(f, [(f, i, n) for i, n in enumerate(items)]) for f, items in enumerate(sizes)]
    runs = split_spans(files, lambda item: item[2], target)
    # Every item once, in file order then offset order, each run within one file.
    assert [item for _, run in runs for item in run] == [x for _, items in files for x in items]
    assert all(run and all(item[0] == f for item in run) for f, run in runs)
    for k, (f, run) in enumerate(runs):
        size = sum(item[2] for item in run)
        last_of_file = k + 1 == len(runs) or runs[k + 1][0] != f
        if not last_of_file:
            assert size >= target  # a run is cut only once it holds its share
        assert size - run[-1][2] < target  # and as soon as it does


def test_the_share_is_even_above_the_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIST_CKPT_READ_SPAN_BYTES", str(8 << 20))
    assert span_bytes(1 << 30, 8) == 128 << 20
    assert span_bytes((1 << 30) + 1, 8) == (128 << 20) + 1  # rounded up: no ninth run
    assert span_bytes(10 << 20, 8) == 8 << 20  # a small load: few threads
    assert span_bytes(0, 0) == 8 << 20


def test_small_reads_take_at_most_four_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    mib = 1 << 20
    monkeypatch.delenv("DIST_CKPT_READ_THREADS", raising=False)
    assert reading_threads(8, 10_000, 10_000 * 24 * 1024) == 4  # 4-64 KiB items
    assert reading_threads(2, 10_000, 10_000 * 24 * 1024) == 2
    assert reading_threads(8, 200, 200 * 5 * mib) == 8  # 5 MiB items
    assert reading_threads(8, 3, 3 * mib) == 8  # 1 MiB on average is large
    assert reading_threads(0, 0, 0) == 1
    monkeypatch.setenv("DIST_CKPT_READ_THREADS", "8")  # set explicitly: taken as it is
    assert reading_threads(8, 10_000, 10_000 * 24 * 1024) == 8
