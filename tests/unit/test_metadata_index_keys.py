"""The metadata index read for some keys only (a pipeline stage's load).

A read for ``keys`` gives exactly the entries, items and ``mcore_data`` of those keys
that a whole read gives, for any metadata and any spelling of the JSON (compact as
written, indented, escaped keys); text that ``json.loads`` refuses is refused however
few keys are wanted; the reader keeps one part per checkpoint handle and reads the
whole metadata for keys outside it.
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

import dist_checkpointing as dcp
from dist_checkpointing import ShardedTensor
from dist_checkpointing.engine.storage.json_stream import JsonCursor
from dist_checkpointing.engine.storage.location import CheckpointDir
from dist_checkpointing.engine.storage.metadata_index import INDEX_NAME, decode_index, encode_index
from dist_checkpointing.engine.storage.metadata_index_items import SELECTIVE, PendingItems
from dist_checkpointing.engine.storage.reader import FileSystemReader, metadata_source
from dist_checkpointing.errors import CorruptCheckpointError
from tests.unit.test_metadata_index import (
    BLOB,
    _metadata,
    _request,
    _same,
    _state,
    _two_tensor_metadata,
)

pytestmark = pytest.mark.timeout(120)


def _part(md: Metadata, keys: Collection[str]) -> Metadata:
    """``md`` with only the entries, items and mcore_data of ``keys`` (built directly)."""
    out = Metadata(
        {k: v for k, v in md.state_dict_metadata.items() if k in keys},
        storage_data={i: v for i, v in (md.storage_data or {}).items() if i.fqn in keys},
        storage_meta=md.storage_meta,
        version=md.version,
    )
    if "mcore_data" in vars(md):
        mcore = md.mcore_data  # type: ignore[attr-defined]
        out.mcore_data = {k: v for k, v in mcore.items() if k in keys}  # type: ignore[attr-defined]
    return out


_SPELLINGS = {
    "as written": lambda data: data,
    "indented": lambda data: json.dumps(json.loads(data), indent=1).encode(),
    "spaced": lambda data: json.dumps(json.loads(data), separators=(", ", ": ")).encode(),
    "raw unicode": lambda data: json.dumps(
        json.loads(data), ensure_ascii=False, separators=(",", ":")
    ).encode(),
}


@settings(max_examples=200, deadline=None)
@given(_metadata(), st.data(), st.sampled_from(sorted(_SPELLINGS)))
def test_the_part_of_some_keys_is_exactly_theirs(md: Metadata, data: Any, spelling: str) -> None:
    if getattr(md, "mcore_data", 0) is None:
        return  # no index for mcore_data None
    encoded = encode_index(md, BLOB)
    assert encoded is not None
    keys = set(data.draw(st.lists(st.sampled_from([*md.state_dict_metadata, "absent", ""]))))
    got = decode_index(_SPELLINGS[spelling](encoded), BLOB, "idx", keys)
    assert got is not None
    expected = _part(md, keys)
    _built(got, list(expected.storage_data or {})[:: data.draw(st.integers(1, 3))])
    _same(got, expected)
    # Every key wanted: the whole metadata, as without keys.
    whole = decode_index(encoded, BLOB, "idx", set(md.state_dict_metadata)) or Metadata({})
    _built(whole, list(md.storage_data or {}))
    _same(whole, md)


def _built(md: Metadata, some: list[MetadataIndex]) -> None:
    """Where the items are pending (the index as written): ``prepare(some)`` builds
    exactly those (all, where they are most), ``len`` builds them all; then a dict,
    for comparing."""
    storage = md.storage_data
    if isinstance(storage, PendingItems):
        storage.prepare(some)
        if len(some) > SELECTIVE * storage._count:  # most of them: all built at once
            assert storage._text is None
        else:
            assert list(storage._built) == some  # in file order, as asked here
        len(storage)  # every item, now
        md.storage_data = dict(storage)
    assert type(md.storage_data) is dict


def _mutations(text: str) -> st.SearchStrategy[str]:
    """``text`` with one character replaced, deleted or inserted (JSON syntax chars,
    digits, letters: what turns one element into another or into no JSON at all)."""
    chars = st.sampled_from(list('[]{},:"0123456789-.e \\nulx'))
    at = st.integers(0, len(text) - 1)
    return st.one_of(
        st.builds(lambda i, c: text[:i] + c + text[i + 1 :], at, chars),
        st.builds(lambda i: text[:i] + text[i + 1 :], at),
        st.builds(lambda i, c: text[:i] + c + text[i:], at, chars),
    )


def _big_index() -> str:
    md = _two_tensor_metadata()
    data = encode_index(md, BLOB)
    assert data is not None
    return data.decode()


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_what_json_refuses_is_refused_whatever_is_wanted(data: Any) -> None:
    text = data.draw(_mutations(_big_index()))
    keys = data.draw(st.sampled_from([set(), {"v"}, {"w"}, {"o/shard_0_1"}, {"v", "w"}]))
    try:
        json.loads(text)
    except ValueError:  # refused by the read, or (the items array) when its items are used
        with pytest.raises(CorruptCheckpointError, match="idx"):
            _read_and_use(text, keys)
        return
    try:  # JSON: a part, or our error about a malformed wanted element
        _read_and_use(text, keys)
    except CorruptCheckpointError as exc:
        assert "/ck/idx" in str(exc)


def _read_and_use(text: str, keys: set[str]) -> None:
    md = decode_index(text.encode(), BLOB, "/ck/idx", keys)
    if md is not None and md.storage_data is not None:
        len(md.storage_data)  # pending items: built (and their array checked) now


_TAIL = re.compile(r",(?:0|[1-9][0-9]*)\]")  # what follows the key: one int


@pytest.mark.parametrize(
    "text",
    [
        '{"a": [["k",1],]}',  # a trailing comma after a skipped element
        '{"a": [["k",1],,["k",2]]}',
        '{"a": [["k",01]]}',  # a number json refuses
        '{"a": [["k",1]["k",2]]}',  # no comma
        '{"a": [["k\\x",1]]}',  # an escape json refuses, in a key
        '{"a": [["k",1],["k',  # cut
    ],
)
def test_a_selected_walk_refuses_what_json_refuses(text: str) -> None:
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    cursor = JsonCursor(text)
    with pytest.raises(json.JSONDecodeError):
        for _ in cursor.members():
            list(cursor.elements((_TAIL, {"x"})))


def test_a_selected_walk_yields_the_wanted_and_what_has_no_key() -> None:
    text = '[["a",1],["b",2], ["c",3] ,["d",4],["e", 5],["\\u00fc",6],7,[],[8],["a",9]]'
    cursor = JsonCursor(text)
    got = list(cursor.elements((_TAIL, {"a", "d", "ü"})))
    # Wanted (an escaped key too), and what has no first item: the caller refuses it.
    assert got == [["a", 1], ["d", 4], ["ü", 6], 7, [], ["a", 9]]
    cursor.end()
    assert list(JsonCursor(text).elements((_TAIL, set()))) == [7, []]
    assert list(JsonCursor(text).elements((_TAIL, {8}))) == [7, [], [8]]
    assert list(JsonCursor(text).elements()) == json.loads(text)


# ------------------------------------------------------------------ the reader


def test_the_reader_keeps_one_part_and_reads_the_whole_for_other_keys(tmp_path: Path) -> None:
    dcp.save(_state(1.0), tmp_path)
    ckpt = CheckpointDir.of(str(tmp_path))
    reader = FileSystemReader(ckpt)
    part = reader.read_metadata_of({"v", "obj/shard_0_1"})
    assert set(part.state_dict_metadata) == {"v", "obj/shard_0_1"}
    assert {i.fqn for i in part.storage_data} == {"v", "obj/shard_0_1"}
    assert metadata_source(ckpt).endswith(INDEX_NAME)
    assert FileSystemReader(ckpt).read_metadata_of({"v"}) is part  # inside the part: kept
    whole = FileSystemReader(ckpt).read_metadata_of({"w"})  # outside: the whole
    assert set(whole.state_dict_metadata) == {"v", "w", "obj/shard_0_1"}
    assert FileSystemReader(ckpt).read_metadata_of({"v"}) is whole
    assert FileSystemReader(ckpt).read_metadata() is whole


def test_a_rewritten_metadata_drops_the_part(tmp_path: Path) -> None:
    dcp.save(_state(1.0), tmp_path)
    ckpt = CheckpointDir.of(str(tmp_path))
    part = FileSystemReader(ckpt).read_metadata_of({"v"})
    ckpt.atomic_write(".metadata", pickle.dumps(FileSystemReader(str(tmp_path)).read_metadata()))
    assert ckpt.memoized(".metadata#part") is None
    assert FileSystemReader(ckpt).read_metadata_of({"v"}) is not part


def test_a_load_of_some_keys_builds_only_theirs(tmp_path: Path) -> None:
    dcp.save(_state(3.0), tmp_path, verify_integrity=True)
    ckpt = CheckpointDir.of(str(tmp_path))
    request = {"v": ShardedTensor.from_rank_offsets("v", torch.zeros(4))}
    out = dcp.load(request, ckpt, verify_integrity=True)
    assert torch.equal(out["v"], torch.arange(4.0) * 3)
    assert ckpt.memoized(".metadata") is None  # never the whole
    part = ckpt.memoized(".metadata#part").metadata
    assert set(part.state_dict_metadata) == {"v"}
    assert [i.fqn for i in part.storage_data] == ["v"]  # one chunk per key: built at once
    assert FileSystemReader(ckpt).files_of({"v"}) == FileSystemReader(str(tmp_path)).files_of({"v"})
    whole = FileSystemReader(str(tmp_path))
    whole.read_metadata()
    assert whole.files_of({"v", "w"}) == FileSystemReader(ckpt).files_of({"v", "w"})
    # Objects too (read through read_object_bytes), and a whole request.
    out = dcp.load(_request(), CheckpointDir.of(str(tmp_path)))
    assert out["o"] == {"fill": 3.0} and torch.equal(out["w"], torch.full((4, 6), 3.0))


# ------------------------------------------------------------------ items built on demand


def _row_blocks(keys: list[str], blocks: int = 8) -> Metadata:
    """Tensors of ``blocks`` row blocks each (tensor parallelism), a file per block."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from dist_checkpointing._torch_compat import StorageInfo

    chunks = [ChunkStorageMetadata(torch.Size([b, 0]), torch.Size([1, 4])) for b in range(blocks)]
    entries: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    for n, key in enumerate(keys):
        props = TensorProperties(dtype=torch.float32)
        entries[key] = TensorStorageMetadata(props, torch.Size([blocks, 4]), chunks)
        for b, c in enumerate(chunks):
            storage[MetadataIndex(key, c.offsets)] = StorageInfo(f"__{b}_0.distcp", 64 * n, 64)
    md = Metadata(entries, storage_data=storage)
    md.mcore_data = {k: {} for k in keys}  # type: ignore[attr-defined]
    return md


_KEYS = [f"layer.{i}" for i in range(10)] + ["ü.weight", 'quote".w']


@pytest.mark.parametrize("spelling", sorted(_SPELLINGS))
def test_a_tensor_parallel_rank_builds_the_items_it_reads(spelling: str) -> None:
    md = _row_blocks(_KEYS)
    data = _SPELLINGS[spelling](encode_index(md, BLOB) or b"")
    wanted = set(_KEYS[::2]) | {"ü.weight", 'quote".w'}
    got = decode_index(data, BLOB, "/ck/idx", wanted)
    assert got is not None
    storage = got.storage_data
    reads = [MetadataIndex(k, torch.Size([3, 0])) for k in sorted(wanted)]  # block 3 each
    expected = _part(md, wanted).storage_data
    assert expected is not None
    if spelling in ("indented", "spaced"):  # another layout: read at once, as before
        assert type(storage) is dict and storage == expected
        return
    assert isinstance(storage, PendingItems)
    storage.prepare(reads)
    assert storage._text is not None
    assert {i.fqn for i in storage._built} == wanted  # "ü" found however it is spelled
    assert all(tuple(i.offset) == (3, 0) for i in storage._built)
    assert [storage[r] for r in reads if r in storage._built] == [
        expected[r] for r in reads if r in storage._built
    ]
    # The files of some keys without building anything more; a lookup of an item not
    # prepared builds them all, in the order of the file.
    built = len(storage._built)
    assert storage.files_of({"layer.0"}) == {f"__{b}_0.distcp" for b in range(8)}
    assert len(storage._built) == built
    assert (
        storage[MetadataIndex("layer.2", torch.Size([5, 0]))]
        == expected[MetadataIndex("layer.2", torch.Size([5, 0]))]
    )
    assert storage._text is None and list(storage.items()) == list(expected.items())


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.replace(",0,0,64]", ",9,0,64]", 1), "malformed entry"),  # no file 9
        (lambda t: t.replace('"items":[[', '"items":[7,[', 1), "idx"),  # not an item
        (lambda t: t.replace('"items":[[', '"items":[ [', 1), "idx"),  # spaced: scanned
        (lambda t: t.replace(']],"mcore_data"', ']]],"mcore_data"', 1), "idx"),  # unbalanced
    ],
)
def test_a_damaged_items_array_is_refused_when_used(change: Any, message: str) -> None:
    md = _row_blocks(_KEYS[:3], blocks=2)
    text = change((encode_index(md, BLOB) or b"").decode())
    try:
        got = decode_index(text.encode(), BLOB, "/ck/idx", {"layer.0"})
    except CorruptCheckpointError as exc:  # refused by the read itself
        assert "/ck/idx" in str(exc) and message in ("idx", "malformed entry")
        return
    assert got is not None and got.storage_data is not None
    storage = got.storage_data
    with pytest.raises(CorruptCheckpointError, match=message):
        if isinstance(storage, PendingItems):
            storage.prepare([MetadataIndex("layer.0", torch.Size([0, 0]))])
        len(storage)
        raise CorruptCheckpointError("/ck/idx: not refused")  # (a dict: json took it)
