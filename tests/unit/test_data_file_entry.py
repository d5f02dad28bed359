"""A data file's item checksums held as columns (engine/storage/checksums.DataFileEntry)
and parsed from a commit record (engine/checkpoint/record).

Whatever order the items come in, every item is found at its offset with its length
and block CRCs, nothing is found elsewhere, and a record that round-trips through its
JSON gives the same entries; values that do not fit are refused as a corrupt record
naming the file.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_checkpointing.engine.checkpoint.record import CommitRecord
from dist_checkpointing.engine.storage.item_checksums import DataFileEntry, ItemChecksum
from dist_checkpointing.errors import CorruptCheckpointError

ITEMS = st.lists(
    st.tuples(
        st.integers(0, 2**62),
        st.integers(0, 2**40),
        st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=4),
    ),
    max_size=40,
    unique_by=lambda t: t[0],
)


@settings(max_examples=200, deadline=None)
@given(items=ITEMS, probe=st.integers(0, 2**62))
def test_every_item_is_found_at_its_offset_in_any_order(
    items: list[tuple[int, int, list[int]]], probe: int
) -> None:
    objects = [ItemChecksum(o, n, list(b)) for o, n, b in items]
    entry = DataFileEntry(7, objects)
    by_offset = {it.offset: it for it in objects}
    assert entry.items == sorted(objects, key=lambda it: it.offset)
    for it in objects:
        assert entry.item_at(it.offset) == it
    assert entry.item_at(probe) == by_offset.get(probe)
    columns = DataFileEntry.from_columns(7, *map(list, zip(*items))) if items else entry
    assert columns == entry and len(columns) == len(objects)
    assert DataFileEntry(8, objects) != entry


def _record(items: Any) -> bytes:
    record = CommitRecord(save_id="a" * 32, world_size=1, block_bytes=1 << 20)
    record.data_files["__0_0.distcp"] = DataFileEntry(100, [ItemChecksum(0, 10, [5])])
    body = json.loads(record.to_bytes())
    body["data_files"]["__0_0.distcp"]["items"] = items
    return json.dumps(body).encode()


@pytest.mark.parametrize("indent", [None, 2], ids=["compact", "indented"])
def test_a_record_round_trips_its_item_checksums(indent: int | None) -> None:
    """The items are read one at a time into columns (whatever the whitespace)."""
    items = [[300, 12, [1, 2]], [0, 100, [2**32 - 1]], [100, 200, [7]]]  # out of order
    data = json.dumps(json.loads(_record(items)), indent=indent).encode()
    record = CommitRecord.from_bytes(data, "rec")
    entry = record.data_files["__0_0.distcp"]
    assert entry.items == [ItemChecksum(o, n, b) for o, n, b in sorted(items)]
    again = CommitRecord.from_bytes(record.to_bytes(), "rec")
    assert again.data_files == record.data_files
    assert again == CommitRecord.from_bytes(json.dumps(json.loads(data)).encode(), "rec")


@pytest.mark.parametrize(
    "items",
    [
        [[0, 10, [2**64]]],
        [[2**63, 10, [1]]],
        [[0, 10, ["x"]]],
        [[0, 10, []]],
        [[-1, 10, [1]]],
        [[0, 10]],
        {"0": [0, 10, [1]]},
    ],
    ids=[
        "checksum over 64 bits",
        "offset over 63 bits",
        "checksum text",
        "none",
        "negative",
        "no checksums",
        "an object, not a list",
    ],
)
def test_item_values_that_do_not_fit_are_a_corrupt_record(items: Any) -> None:
    with pytest.raises(CorruptCheckpointError, match="rec"):
        CommitRecord.from_bytes(_record(items), "rec")


def _record_as_json_dumps(record: CommitRecord) -> bytes:
    """The record as ``json.dumps`` of one dict (how it was written before)."""
    body = json.loads(record.to_bytes())
    body["data_files"] = {
        n: {"size": e.size, "items": [[i.offset, i.length, i.blocks] for i in e.items]}
        for n, e in record.data_files.items()
    }
    return json.dumps(body, separators=(",", ":")).encode()


@settings(max_examples=100, deadline=None)
@given(
    files=st.dictionaries(st.text(min_size=1, max_size=8), ITEMS, max_size=3),
    install=st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
)
def test_a_record_is_written_as_json_dumps_writes_it(
    files: dict[str, list[tuple[int, int, list[int]]]], install: dict[str, str]
) -> None:
    record = CommitRecord(save_id="a" * 32, world_size=2, block_bytes=1 << 20)
    record.install = install  # any text: escaped as json.dumps escapes it
    entries = [
        DataFileEntry(9, [ItemChecksum(o, n, list(b)) for o, n, b in v]) for v in files.values()
    ]
    record.data_files = dict(zip(files, entries))
    data = record.to_bytes()
    assert data == _record_as_json_dumps(record)
    assert list(json.loads(data)) == [
        "format", "version", "save_id", "world_size", "created_unix", "checksum", "files",
        "data_files", "install",
    ]  # fmt: skip
    record.install, record.data_files = {}, {f"__0_{i}.distcp": e for i, e in enumerate(entries)}
    assert CommitRecord.from_bytes(record.to_bytes(), "rec").data_files == record.data_files


@settings(max_examples=100, deadline=None)
@given(files=st.lists(ITEMS, max_size=3), big=st.integers(10**18, 2**63 - 1))
def test_items_as_written_are_parsed_on_first_use_to_the_same_entry(
    files: list[list[tuple[int, int, list[int]]]], big: int
) -> None:
    """Compact items are kept as text until used; they give what the item-by-item read
    of the same record with whitespace gives, values of 19 digits included."""
    record = CommitRecord(save_id="a" * 32, world_size=1, block_bytes=1 << 20)
    for i, items in enumerate(files):
        record.data_files[f"__0_{i}.distcp"] = DataFileEntry(
            9, [ItemChecksum(o, n, list(b)) for o, n, b in items]
        )
    record.data_files["big.distcp"] = DataFileEntry(9, [ItemChecksum(big, big, [big])])
    data = record.to_bytes()
    lazy = CommitRecord.from_bytes(data, "rec")
    spaced = CommitRecord.from_bytes(json.dumps(json.loads(data)).encode(), "rec")
    assert type(lazy.data_files.pop("big.distcp")) is DataFileEntry  # read item by item
    for i, items in enumerate(files):  # lazy where every value has at most 18 digits
        short = all(max(o, n, *b) < 10**18 for o, n, b in items)
        assert (type(lazy.data_files[f"__0_{i}.distcp"]).__name__ == "_LazyEntry") == short
    assert all(type(e) is DataFileEntry for e in spaced.data_files.values() if len(e))
    spaced.data_files.pop("big.distcp")
    record.data_files.pop("big.distcp")
    assert lazy.data_files == spaced.data_files == record.data_files
    assert lazy.to_bytes() == record.to_bytes()


def test_a_lazy_entry_is_parsed_once_for_threads_that_ask_together() -> None:
    import threading

    items = [ItemChecksum(100 * i, 50, [i, i + 1]) for i in range(3000)]
    record = CommitRecord(save_id="a" * 32, world_size=1, block_bytes=1 << 20)
    record.data_files["__0_0.distcp"] = DataFileEntry(9, items)
    for _ in range(5):
        entry = CommitRecord.from_bytes(record.to_bytes(), "rec").data_files["__0_0.distcp"]
        found: list[Any] = []
        start = threading.Barrier(8)

        def look(
            row: int, entry: Any = entry, start: Any = start, found: list[Any] = found
        ) -> None:
            start.wait()
            found.append(entry.item_at(100 * row) == items[row] and len(entry) == 3000)

        threads = [threading.Thread(target=look, args=(r * 300,)) for r in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert found == [True] * 8
