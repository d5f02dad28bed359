"""One rank's write results as columns (engine/storage/result_table): what the
coordinator reads back is every field of every result, in order; the data files'
checksums built from the columns equal those built from the results one by one; the
digest ignores checksums only; and a table costs the coordinator a fraction of the
memory of one tuple per result."""

from __future__ import annotations

import pickle
import tracemalloc
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from dist_checkpointing._torch_compat import StorageInfo
from dist_checkpointing.engine.storage.item_checksums import DataFileEntry, ItemChecksum
from dist_checkpointing.engine.storage.result_table import ResultTable, data_files_from_tables

FILES = ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp"]


def _result(
    fqn: str,
    offset: tuple[int, ...] | None,
    path: str,
    start: int,
    length: int,
    blocks: list[int] | None,
    transforms: Any = None,
) -> WriteResult:
    info = StorageInfo(path, start, length)
    if transforms is not None:
        info.transform_descriptors = transforms
    result = WriteResult(
        MetadataIndex(fqn, None if offset is None else torch.Size(offset)), length + 3, info
    )
    checksum = None if blocks is None else ItemChecksum(start, length, list(blocks))
    object.__setattr__(result, "checksum", checksum)
    return result


def _fields(r: WriteResult) -> tuple[Any, ...]:
    offset = r.index.offset
    return (
        r.index.fqn,
        None if offset is None else tuple(offset),
        r.size_in_bytes,
        r.storage_data.relative_path,
        r.storage_data.offset,
        r.storage_data.length,
        getattr(r.storage_data, "transform_descriptors", None),
        getattr(r, "checksum", None),
    )


def _reference_files(results: list[WriteResult]) -> dict[str, DataFileEntry]:
    """The data files of ``results`` built one result at a time."""
    sizes: dict[str, int] = {}
    items: dict[str, list[ItemChecksum]] = {}
    for r in results:
        info = r.storage_data
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
        checksum = getattr(r, "checksum", None)
        if checksum is not None:
            items.setdefault(info.relative_path, []).append(checksum)
    return {p: DataFileEntry(n, items.get(p, ())) for p, n in sizes.items()}


RESULTS = st.lists(
    st.tuples(
        st.sampled_from([None, (0,), (0, 0), (4, 0), (8, 16)]),
        st.sampled_from(FILES),
        st.integers(0, 2**40),
        st.integers(0, 2**30),
        st.one_of(st.none(), st.lists(st.integers(0, 2**32 - 1), max_size=4)),
        st.sampled_from([None, None, ["zstd"]]),
    ),
    max_size=30,
    unique_by=lambda t: (t[1], t[2]),  # one item per place in a file
)


@settings(max_examples=200, deadline=None)
@given(rows=RESULTS, split=st.integers(0, 30))
def test_rows_and_data_files_equal_the_results_one_by_one(rows: list[Any], split: int) -> None:
    results = [_result(f"k{i}", *row) for i, row in enumerate(rows)]
    table = ResultTable.of(results)
    assert len(table) == len(results)
    assert list(table.rows()) == [_fields(r) for r in results]
    again = pickle.loads(pickle.dumps(table, protocol=4))
    assert list(again.rows()) == list(table.rows())
    # Per file, whichever table a result comes in (files split between ranks' tables).
    per_file = [
        ResultTable.of([r for r in results if r.storage_data.relative_path in names])
        for names in (FILES[:1], FILES[1:])
    ]
    assert data_files_from_tables(per_file) == _reference_files(results)
    assert data_files_from_tables([table.locations()]) == _reference_files(results)
    # A file's items in several tables (not how our ranks name files, but allowed).
    shared = [ResultTable.of(results[:split]), ResultTable.of(results[split:])]
    assert data_files_from_tables(shared) == _reference_files(results)
    # The digest ignores the checksums, nothing else.
    other = [_result(f"k{i}", *row[:4], [7], row[5]) for i, row in enumerate(rows)]
    assert ResultTable.of(other).digest() == table.digest()
    if split < len(rows):
        moved = list(rows[split])
        moved[2] += 1
        changed = rows[:split] + [tuple(moved)] + rows[split + 1 :]
        changed_results = [_result(f"k{i}", *row) for i, row in enumerate(changed)]
        assert ResultTable.of(changed_results).digest() != table.digest()


def test_equal_offsets_are_one_tuple_and_a_cleared_table_is_empty() -> None:
    results = [_result(f"k{i}", (0, 0), FILES[i % 2], 100 * i, 90, [i]) for i in range(6)]
    table = ResultTable.of(results)
    assert len({id(o) for o in table.offsets}) == 1
    assert table.files == FILES[:2] and table.file_rows.tolist() == [0, 1] * 3
    assert list(table.rows())[3][7] == ItemChecksum(300, 90, [3])
    table.clear()
    assert len(table) == 0 and list(table.rows()) == [] and data_files_from_tables([table]) == {}


def test_a_rank_that_wrote_nothing_sends_an_empty_table() -> None:
    empty = ResultTable.of([])
    blob = pickle.dumps(empty, protocol=4)
    assert len(blob) < 100
    again = pickle.loads(blob)
    assert len(again) == 0 and list(again.rows()) == [] and again.files == []
    assert again.digest() == empty.digest() == ResultTable.of([]).digest()
    one = ResultTable.of([_result("k", None, FILES[0], 0, 5, [1])])
    assert data_files_from_tables([again, one, empty.locations()]) == data_files_from_tables([one])


def test_a_data_file_from_sorted_columns() -> None:
    def arr(*values: int) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    # CRC positions may start anywhere (a file's part of all of them).
    entry = DataFileEntry.from_sorted(
        40, arr(0, 10, 30), arr(10, 20, 10), arr(4, 6, 6, 7), arr(6, 7, 5)
    )
    assert entry.items == [
        ItemChecksum(0, 10, [6, 7]),
        ItemChecksum(10, 20, []),
        ItemChecksum(30, 10, [5]),
    ]
    assert entry.size == 40 and entry.item_at(30) == ItemChecksum(30, 10, [5])
    with pytest.raises(ValueError, match="not in order"):
        DataFileEntry.from_sorted(40, arr(10, 0), arr(1, 1), arr(0, 1, 2), arr(1, 2))
    with pytest.raises(ValueError, match="differ in number"):
        DataFileEntry.from_sorted(40, arr(0, 10), arr(1, 1), arr(0, 1, 2), arr(1))


def test_data_files_split_from_sorted_columns_at_once() -> None:
    def arr(*values: int) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    # Three files: two items, none, one; offsets start again in each file.
    a, empty, b = DataFileEntry.split_sorted(
        [30, 0, 8], [0, 2, 2, 3], arr(0, 10, 0), arr(10, 20, 8), arr(3, 4, 6, 7), arr(1, 2, 3, 4)
    )
    assert a.items == [ItemChecksum(0, 10, [1]), ItemChecksum(10, 20, [2, 3])]
    assert (a.size, empty.size, b.size) == (30, 0, 8) and len(empty) == 0
    assert b.items == [ItemChecksum(0, 8, [4])] and b.item_at(0) == ItemChecksum(0, 8, [4])
    with pytest.raises(ValueError, match="not in order"):  # within a file
        DataFileEntry.split_sorted(
            [30, 8], [0, 2, 3], arr(10, 0, 0), arr(1, 1, 1), arr(0, 1, 2, 3), arr(1, 2, 3)
        )
    with pytest.raises(ValueError, match="differ in number"):  # cuts past the items
        DataFileEntry.split_sorted([30], [0, 3], arr(0, 10), arr(1, 1), arr(0, 1, 2), arr(1, 2))


def test_the_coordinator_holds_a_fraction_of_the_memory_of_tuples() -> None:
    n = 20_000
    results = [
        _result(f"layer.{i}.weight", (0,), FILES[i % 2], 2600 * i, 2600, [i]) for i in range(n)
    ]
    tuples = pickle.dumps([_fields(r) for r in results], protocol=4)
    table = pickle.dumps(ResultTable.of(results), protocol=4)

    def held(blob: bytes) -> int:
        tracemalloc.start()
        try:
            obj = pickle.loads(blob)
            size = tracemalloc.get_traced_memory()[0]
            del obj
            return size
        finally:
            tracemalloc.stop()

    as_tuples, as_table = held(tuples), held(table)
    assert as_table * 3 < as_tuples, (as_table // n, as_tuples // n)
    assert len(table) * 3 < len(tuples) * 2  # the keys are most of what is left


def test_tables_join_in_order_and_give_back_write_results() -> None:
    a = [_result(f"a{i}", (i, 0), FILES[i % 2], 64 * i, 60, [i, i + 1]) for i in range(5)]
    b = [_result(f"b{i}", None, FILES[2], 64 * i, 60, None, ["zstd"]) for i in range(3)]
    b.append(_result("b3", (0,), FILES[0], 1000, 2**33, [9]))  # a wider column, a known file
    joined = ResultTable.concat([ResultTable.of(a), ResultTable.of([]), ResultTable.of(b)])
    assert list(joined.rows()) == [_fields(r) for r in a + b]
    assert joined.files == FILES[:2] + [FILES[2]] and joined.transforms.keys() == {5, 6, 7}
    assert data_files_from_tables([joined]) == _reference_files(a + b)
    again = joined.write_results()
    assert [_fields(r) for r in again] == [_fields(r) for r in a + b]
    assert ResultTable.of(again).digest() == joined.digest()


def test_a_pickled_outcome_carries_its_results_as_tables() -> None:
    from dist_checkpointing.engine.storage.write_results import (
        WriteOutcome,
        result_table,
        results_in_order,
    )

    buckets = [
        [_result(f"k{b}.{i}", (0,), FILES[b], 64 * i, 60, [b, i]) for i in range(4)]
        for b in range(2)
    ]
    outcome = WriteOutcome(3, {0: buckets[0], 1: buckets[1]})
    sent = pickle.loads(pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL))
    assert sent.results == {} and sorted(sent.tables) == [0, 1] and sent.rank == 3
    expected = [_fields(r) for r in buckets[0] + buckets[1]]
    assert [_fields(r) for r in results_in_order(sent, FILES[:2])] == expected
    assert list(result_table(sent, FILES[:2]).rows()) == expected
    assert list(result_table(outcome, FILES[:2]).rows()) == expected  # not pickled: objects
    # Results of another form travel as they are.
    odd = WriteOutcome(0, {0: ["not a write result"]})  # type: ignore[list-item]
    assert pickle.loads(pickle.dumps(odd)).results == {0: ["not a write result"]}
