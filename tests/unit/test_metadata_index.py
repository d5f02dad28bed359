"""The JSON index of a torch_dist ``.metadata``: exact round trips, the fallback to the
pickle, and crafted indexes refused with an error naming the file (never a bare
TypeError, never a quadratic check)."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

import dist_checkpointing as dcp
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing._torch_compat import StorageInfo
from dist_checkpointing.engine.safety import metadata as parse_module
from dist_checkpointing.engine.safety.metadata_check import (
    CheckTooCostly,
    check_metadata,
    first_overlap,
)
from dist_checkpointing.engine.storage import metadata_index as index_module
from dist_checkpointing.engine.storage.metadata_blob import metadata_bytes
from dist_checkpointing.engine.storage.metadata_index import (
    INDEX_NAME,
    decode_index,
    encode_index,
)
from dist_checkpointing.engine.storage.metadata_index_reader import MAX_SHARED_SHAPES
from dist_checkpointing.engine.storage.reader import FileSystemReader
from dist_checkpointing.errors import CorruptCheckpointError, UnsafeCheckpointError
from tests.support import crafted_pickles as cp

pytestmark = pytest.mark.timeout(120)

BLOB = b"the pickled metadata"
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e4m3fn]


@st.composite
def _tensor(draw: Any, key: str) -> tuple[TensorStorageMetadata, list[MetadataIndex]]:
    ndim = draw(st.integers(0, 3))
    size = [draw(st.integers(0, 9)) for _ in range(ndim)]
    chunks = []
    for _ in range(draw(st.integers(0 if ndim else 1, 3))):
        off = [draw(st.integers(0, s)) for s in size]
        ext = [draw(st.integers(0, s - o)) for s, o in zip(size, off)]
        chunks.append(ChunkStorageMetadata(torch.Size(off), torch.Size(ext)))
    props = TensorProperties(dtype=draw(st.sampled_from(DTYPES)))
    md = TensorStorageMetadata(props, torch.Size(size), chunks)
    return md, [MetadataIndex(key, c.offsets) for c in chunks]


@st.composite
def _metadata(draw: Any) -> Metadata:
    entries: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    for i in range(draw(st.integers(0, 6))):
        key = draw(st.sampled_from(["w", "layer.0/ü", "opt/shard_0_1", ""])) + str(i)
        if draw(st.booleans()):
            entries[key] = BytesStorageMetadata()
            indexes = [MetadataIndex(key, index=draw(st.none() | st.integers(0, 3)))]
        else:
            entries[key], indexes = draw(_tensor(key))
        for index in indexes:
            name = draw(st.sampled_from(["__0_0.distcp", "__1_0.distcp", "a b.distcp"]))
            storage[index] = StorageInfo(name, draw(st.integers(0, 2**40)), draw(st.integers(0)))
    meta = draw(
        st.none()
        | st.builds(
            StorageMeta,
            checkpoint_id=st.none() | st.text(max_size=5),
            save_id=st.text(max_size=5),
            load_id=st.none() | st.text(max_size=5),
            modules=st.lists(st.text(max_size=3), max_size=2),
        )
    )
    md = Metadata(
        entries, storage_data=storage, storage_meta=meta, version=draw(st.none() | st.just("1.0.0"))
    )
    mcore = draw(st.sampled_from(["absent", "none", "empty", "reshaped"]))
    if mcore != "absent":
        md.mcore_data = None if mcore == "none" else {k: {} for k in entries}  # type: ignore[attr-defined]
        if mcore == "reshaped" and entries:
            md.mcore_data[next(iter(entries))] = {"nd_reformulated_orig_global_shape": (4, 6)}  # type: ignore[attr-defined]
    return md


def _same(a: Metadata, b: Metadata) -> None:
    assert a == b
    assert list(a.state_dict_metadata) == list(b.state_dict_metadata)
    assert list(a.storage_data or {}) == list(b.storage_data or {})
    assert vars(a).keys() - {"mcore_data"} == vars(b).keys() - {"mcore_data"}
    assert getattr(a, "mcore_data", None) == getattr(b, "mcore_data", None)
    # The same Python types all the way down (check_metadata and the planners rely on it).
    assert _types(a) == _types(b)


def _types(obj: object) -> object:
    if isinstance(obj, dict):
        return ("dict", [(_types(k), _types(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [_types(v) for v in obj])
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        # A pickled _StorageInfo may lack transform_descriptors (the class default, None).
        fields = {k: v for k, v in vars(obj).items() if k != "transform_descriptors" or v}
        return (type(obj).__name__, {k: _types(v) for k, v in fields.items()})
    return type(obj).__name__


@settings(max_examples=150, deadline=None)
@given(_metadata())
def test_round_trip_is_exact(md: Metadata) -> None:
    if getattr(md, "mcore_data", 0) is None:  # None is not a dict: no index
        assert encode_index(md, BLOB) is None
        return
    data = encode_index(md, BLOB)
    assert data is not None
    _same(decode_index(data, BLOB, "idx") or Metadata({}), md)


def _plain() -> Metadata:
    props = TensorProperties(dtype=torch.float32)
    chunk = ChunkStorageMetadata(torch.Size((0,)), torch.Size((4,)))
    return Metadata(
        {"v": TensorStorageMetadata(props, torch.Size((4,)), [chunk])},
        storage_data={MetadataIndex("v", (0,)): StorageInfo("__0_0.distcp", 0, 16)},
    )


def _with(change: Callable[[Metadata], None]) -> Metadata:
    md = _plain()
    change(md)
    return md


@pytest.mark.parametrize(
    "change",
    [
        lambda md: setattr(md.state_dict_metadata["v"].properties, "requires_grad", True),
        lambda md: setattr(md, "planner_data", {"x": 1}),
        lambda md: setattr(md, "all_local_plans", []),
        lambda md: setattr(md, "version", 2),
        lambda md: setattr(md, "mcore_data", {"v": {"other": 1}}),
        lambda md: setattr(md, "mcore_data", {"v": {"nd_reformulated_orig_global_shape": [4]}}),
        lambda md: setattr(md, "storage_meta", StorageMeta(checkpoint_id=Path("/x"))),
        lambda md: setattr(
            md.storage_data[MetadataIndex("v", (0,))], "transform_descriptors", ["zstd"]
        ),
    ],
    ids=["props", "planner", "extra", "version", "mcore", "mcore_list", "path_id", "transform"],
)
def test_inexpressible_metadata_gets_no_index(change: Callable[[Metadata], None]) -> None:
    assert encode_index(_with(change), BLOB) is None


def test_an_index_of_other_bytes_is_ignored() -> None:
    data = encode_index(_plain(), BLOB)
    assert data is not None
    assert decode_index(data, BLOB + b"x", "idx") is None
    assert decode_index(data, b"X" + BLOB[1:], "idx") is None  # same size, other CRC


def _doc(**fields: Any) -> bytes:
    data = encode_index(_plain(), BLOB)
    assert data is not None
    doc = json.loads(data)
    doc.update(fields)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    "data, message",
    [
        (b"{not json", "not a JSON index"),
        (b"[" * 100_000 + b"]" * 100_000, "not a JSON index"),
        (b"[]", "is not a torch_dist metadata index"),
        (_doc(format="other"), "is not a torch_dist metadata index"),
        (_doc(version=2), "has version 2"),
        (_doc(version=True), "has version True"),
        (_doc(entries={}), "must be lists"),
        (_doc(files=[1]), "a file name is not a string"),
        (_doc(dcp_version=1), "dcp_version is not a string"),
        (_doc(entries=[["v", "float99", [4], [[0, 4]]]]), "malformed entry.*KeyError"),
        (_doc(entries=[["v", "float32", "abcd", [[0, 4]]]]), "malformed entry"),
        (_doc(entries=[["v", "float32", [4], [["a", 4]]]]), "malformed entry"),
        (_doc(entries=[["v", "float32", [4], [[0, 4.5]]]]), "malformed entry"),
        # A shape equal to one already read (4.0 == 4) is still refused, not shared.
        (
            _doc(entries=[["u", "float32", [4], [[0, 4]]], ["v", "float32", [4.0], [[0, 4]]]]),
            "malformed entry",
        ),
        (_doc(entries=[["v", "float32", [4]]]), "malformed entry"),
        (_doc(entries=[5]), "malformed entry"),
        (_doc(entries=[[7]]), "a key is int, not a string"),
        (_doc(entries=[[7, "float32", [4], [[0, 4]]]]), "a key is int, not a string"),
        (_doc(items=[[7, [0], None, 0, 0, 16]]), "an item's key is int, not a string"),
        (_doc(entries=[["v", "float32", [1] * 65, []]]), "malformed size or chunks"),
        (_doc(items=[["v", [0], None, 1, 0, 16]]), "malformed entry.*IndexError"),
        (_doc(items=[["v", [0], None, -1, 0, 16]]), "malformed file or index"),
        (_doc(items=[["v", [0], "0", 0, 0, 16]]), "malformed file or index"),
        (_doc(items=[["v", [0], None, 0, 0]]), "malformed entry"),
        (_doc(storage_meta=[]), "storage_meta is not an object"),
        (_doc(storage_meta={"save_id": 1, "modules": []}), "other than strings"),
        (_doc(mcore_data=[]), "mcore_data is not an object"),
        (_doc(mcore_data={"v": {"nd_reformulated_orig_global_shape": ["4"]}}), "malformed"),
    ],
)
def test_malformed_indexes_name_the_file(data: bytes, message: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=f"^/ck/idx: .*{message}"):
        decode_index(data, BLOB, "/ck/idx")


# --------------------------------------------------------------------------- in a checkpoint


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    dcp.save(_state(1.0), d)
    return d


def _state(fill: float) -> dict[str, Any]:
    return {
        "v": ShardedTensor.from_rank_offsets("v", torch.arange(4.0) * fill),
        "w": ShardedTensor.from_rank_offsets("w", torch.full((4, 6), fill)),
        "o": ShardedObject("obj", {"fill": fill}, (1,), (0,), replica_id=0),
    }


def _request() -> dict[str, Any]:
    return {
        "v": ShardedTensor.from_rank_offsets("v", torch.full((4,), -7.0)),
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6)),
        "o": ShardedObject("obj", None, (1,), (0,), replica_id=0),
    }


def _no_pickle_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(".metadata was unpickled")

    monkeypatch.setattr("dist_checkpointing.engine.storage.reader.load_metadata", refuse)


def test_a_save_writes_the_index_and_a_load_reads_only_it(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert (ckpt / INDEX_NAME).exists()
    record = json.loads((ckpt / "commit.json").read_text())
    assert INDEX_NAME in record["files"]  # committed and checksummed with the save
    with open(ckpt / ".metadata", "rb") as f:
        parsed = parse_module.load_metadata(f)
    _no_pickle_parse(monkeypatch)
    indexed = FileSystemReader(str(ckpt)).read_metadata()
    indexed.storage_meta.load_id = parsed.storage_meta.load_id  # type: ignore[union-attr]
    _same(indexed, parsed)  # type: ignore[arg-type]
    out = dcp.load(_request(), ckpt)
    assert torch.equal(out["v"], torch.arange(4.0)) and torch.equal(out["w"], torch.ones(4, 6))
    assert out["o"] == {"fill": 1.0}


def test_knob_off_writes_no_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIST_CKPT_METADATA_INDEX", "0")
    dcp.save(_state(2.0), tmp_path)
    assert not (tmp_path / INDEX_NAME).exists()
    assert torch.equal(dcp.load(_request(), tmp_path)["v"], torch.arange(4.0) * 2)


def test_a_stale_index_is_ignored(ckpt: Path) -> None:
    # A tool rewrites .metadata (and drops our commit record) but leaves the index.
    metadata = FileSystemReader(str(ckpt)).read_metadata()
    metadata.state_dict_metadata["v"].properties.requires_grad = True  # type: ignore[union-attr]
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    (ckpt / "commit.json").unlink()
    assert dcp.load_tensors_metadata(ckpt)["v"].dtype == torch.float32
    assert torch.equal(dcp.load(_request(), ckpt)["v"], torch.arange(4.0))


def _craft(ckpt: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite the index (matching the .metadata present, as an attacker can)."""
    doc = json.loads((ckpt / INDEX_NAME).read_bytes())
    change(doc)
    (ckpt / INDEX_NAME).write_text(json.dumps(doc))
    (ckpt / "commit.json").unlink()  # it would refuse the changed file first


def _entry(doc: dict[str, Any], key: str) -> list[Any]:
    return next(e for e in doc["entries"] if e[0] == key)


def test_crafted_index_overlapping_chunks(ckpt: Path) -> None:
    def overlap(doc: dict[str, Any]) -> None:
        _entry(doc, "v")[3] = [[0, 2], [1, 2]]

    _craft(ckpt, overlap)
    with pytest.raises(
        CorruptCheckpointError, match=rf"{INDEX_NAME}: tensor 'v': stored chunks overlap"
    ):
        dcp.load(_request(), ckpt)


@pytest.mark.parametrize("name", ["../outside.distcp", "/etc/passwd", "sub/../../x"])
def test_crafted_index_paths_stay_inside(ckpt: Path, name: str) -> None:
    def escape(doc: dict[str, Any]) -> None:
        doc["files"] = [name] * len(doc["files"])

    _craft(ckpt, escape)
    with pytest.raises(UnsafeCheckpointError, match=rf"{INDEX_NAME}: refusing file name '{name}'"):
        dcp.load(_request(), ckpt)


def test_crafted_index_negative_offset(ckpt: Path) -> None:
    def negative(doc: dict[str, Any]) -> None:
        doc["items"][0][4] = -5

    _craft(ckpt, negative)
    with pytest.raises(CorruptCheckpointError, match=rf"{INDEX_NAME}: storage of .*offset"):
        dcp.load(_request(), ckpt)


def test_costly_chunks_go_the_guarded_way(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A staircase of disjoint chunks that all stay open in the sweep: quadratic to
    # check. Over the budget, the index is set aside and .metadata parsed (guarded).
    n = 3000
    parsed: list[str] = []
    real = parse_module.load_metadata

    def spy(*args: Any, **kwargs: Any) -> Any:
        parsed.append("pickle")
        return real(*args, **kwargs)

    monkeypatch.setattr("dist_checkpointing.engine.storage.reader.load_metadata", spy)

    def staircase(doc: dict[str, Any]) -> None:
        entry = _entry(doc, "w")
        entry[2] = [2 * n, n]
        entry[3] = [[i, i, n, 1] for i in range(n)]

    _craft(ckpt, staircase)
    assert dcp.load_tensors_metadata(ckpt)["w"].global_shape == (4, 6)  # from .metadata
    assert parsed == ["pickle"]


class _Unhashable(tuple):  # type: ignore[type-arg]
    def __hash__(self) -> int:
        raise AssertionError("hashed")


def test_the_overlap_check_never_hashes_boxes() -> None:
    # Tuples of ints from a file can be made to collide: a set of them is quadratic.
    pairs = cp.colliding_pairs(64)
    boxes = [_Unhashable((_Unhashable(p), _Unhashable((1, 1)))) for p in pairs]
    assert first_overlap(boxes) is None
    with pytest.raises(CheckTooCostly):
        first_overlap([((i, i), (1000, 1)) for i in range(100)], budget=10)


def test_colliding_int_keys_are_refused_before_any_dict() -> None:
    # Keys whose hashes collide would make building the dict quadratic: refused first.
    keys = cp.colliding_ints(20_000)
    data = _doc(entries=[[k] for k in keys], items=[[k, None, None, 0, 0, 1] for k in keys])
    with pytest.raises(CorruptCheckpointError, match="not a string"):
        decode_index(data, BLOB, "/ck/idx")


def test_corrupt_object_item_is_a_checksum_mismatch(ckpt: Path) -> None:
    # Damage inside an object item's zip framing: the checksum names it before torch.load
    # (or zipfile) fails on it.
    metadata = FileSystemReader(str(ckpt)).read_metadata()
    info = next(v for k, v in (metadata.storage_data or {}).items() if k.fqn.startswith("obj"))
    path = ckpt / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + 110] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(
        CorruptCheckpointError, match=rf"obj.*{info.relative_path}|{info.relative_path}.*obj"
    ):
        dcp.load(_request(), ckpt)


_LEAF = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=4)
_LIST = st.lists(_LEAF, max_size=4)
_JSON = (
    _LEAF
    | _LIST
    | st.lists(_LIST, max_size=3)
    | st.dictionaries(st.text(max_size=3), _LEAF | _LIST, max_size=3)
)


def _paths(doc: object, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON document (for replacing what is there)."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _two_tensor_index() -> dict[str, Any]:
    data = encode_index(_two_tensor_metadata(), BLOB)
    assert data is not None
    doc: dict[str, Any] = json.loads(data)
    return doc


def _two_tensor_metadata() -> Metadata:
    md = _plain()
    props = TensorProperties(dtype=torch.bfloat16)
    chunks = [ChunkStorageMetadata(torch.Size((i, 0)), torch.Size((2, 3))) for i in (0, 2)]
    md.state_dict_metadata["w"] = TensorStorageMetadata(props, torch.Size((4, 3)), chunks)
    md.state_dict_metadata["o/shard_0_1"] = BytesStorageMetadata()
    assert md.storage_data is not None
    for i, c in enumerate(chunks):
        md.storage_data[MetadataIndex("w", c.offsets)] = StorageInfo("__1_0.distcp", 64 * i, 64)
    md.storage_data[MetadataIndex("o/shard_0_1")] = StorageInfo("__0_0.distcp", 16, 9)
    md.mcore_data = {"v": {}, "w": {}}  # type: ignore[attr-defined]
    return md


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_damage_to_an_index_is_our_error(data: Any) -> None:
    doc = _two_tensor_index()
    places = [p for p in _paths(doc) if p and p[0] not in ("format", "version", "metadata")]
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(places))
        value = data.draw(_JSON)
        parent: Any = doc
        try:
            for step in where[:-1]:
                parent = parent[step]
            parent[where[-1]] = value
        except (IndexError, KeyError, TypeError):
            continue  # the place went away with an earlier change
    try:
        md = decode_index(json.dumps(doc).encode(), BLOB, "/ck/idx")
        if md is not None:
            check_metadata(md, "/ck/idx", budget=64)
    except (CorruptCheckpointError, CheckTooCostly):
        pass  # refused with our error (or set aside for the guarded parse)


def test_a_reused_structure_reencodes_only_the_header(monkeypatch: pytest.MonkeyPatch) -> None:
    md = _two_tensor_metadata()
    md.storage_meta = StorageMeta(checkpoint_id="/first", save_id="s1")
    encode_index(md, metadata_bytes(md))  # as the writer does: pickle, then index
    md.storage_meta = StorageMeta(checkpoint_id="/second", save_id="s2")  # the next save
    # The second pickle of the object makes the template the encoded entries go with.
    first = encode_index(md, metadata_bytes(md))
    md.storage_meta = StorageMeta(checkpoint_id="/next", save_id="s3")
    metadata_bytes(md)

    def refuse(*args: Any) -> Any:
        raise AssertionError("the entries were encoded again")

    monkeypatch.setattr(index_module, "_entry", refuse)
    second = encode_index(md, BLOB + b"2")
    assert first is not None and second is not None and first != second
    decoded = decode_index(second, BLOB + b"2", "idx")
    assert decoded is not None
    _same(decoded, md)
    md.storage_data = dict(md.storage_data or {})  # a new structure: encoded afresh
    with pytest.raises(AssertionError, match="encoded again"):
        encode_index(md, BLOB)


@settings(max_examples=60, deadline=None)
@given(_metadata(), st.integers(1, 4))
def test_the_body_encoded_in_batches_is_one_json_dumps(md: Metadata, batch: int) -> None:
    """``_json_list`` encodes a batch of elements at a time (bounded memory): the text
    is exactly that of one ``json.dumps`` of the whole body, batch boundaries anywhere."""
    try:
        expected = index_module._body(md)  # the real batch size: one batch here
    except index_module._Inexpressible:
        return
    original = index_module._JSON_BATCH
    index_module._JSON_BATCH = batch
    try:
        assert index_module._body(md) == expected
    finally:
        index_module._JSON_BATCH = original
    files: dict[str, int] = {}
    items = [index_module._item(i, s, files) for i, s in (md.storage_data or {}).items()]
    attrs = vars(md)
    whole = {
        "entries": [index_module._entry(k, v) for k, v in md.state_dict_metadata.items()],
        "files": list(files),
        "items": items,
        "mcore_data": index_module._mcore(attrs.get("mcore_data"), "mcore_data" in attrs),
    }
    assert expected == json.dumps(whole, separators=(",", ":"))[1:-1]


def _many(count: int, distinct: bool) -> Metadata:
    """``count`` one-chunk entries, of equal shapes or of ``count`` distinct ones."""
    entries: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    for i in range(count):
        n = 3 + i if distinct else 8
        chunk = ChunkStorageMetadata(torch.Size([n, 0]), torch.Size([n, 4]))
        props = TensorProperties(dtype=torch.bfloat16 if i % 2 else torch.float32)
        entries[f"w{i}"] = TensorStorageMetadata(props, torch.Size([2 * n, 4]), [chunk])
        storage[MetadataIndex(f"w{i}", chunk.offsets)] = StorageInfo("__0_0.distcp", 64 * i, 64)
    return Metadata(entries, storage_data=storage)


def test_decoded_metadata_shares_equal_shapes_dtypes_and_keys() -> None:
    md = _many(100, distinct=False)
    got = decode_index(encode_index(md, BLOB) or b"", BLOB, "idx")
    assert got is not None
    _same(got, md)
    a, b, c = (got.state_dict_metadata[k] for k in ("w0", "w1", "w2"))
    assert a.size is b.size and a.chunks[0].sizes is b.chunks[0].sizes
    assert a.chunks[0] is b.chunks[0]  # equal chunks: one object
    assert a.properties is c.properties and a.properties is not b.properties  # per dtype
    for index in got.storage_data:
        assert index.offset is a.chunks[0].offsets  # one object for (8, 0), items included
        assert next(k for k in got.state_dict_metadata if k == index.fqn) is index.fqn


def test_decoded_mcore_data_shares_one_empty_dict() -> None:
    md = _many(4, distinct=True)
    md.mcore_data = {f"w{i}": {} for i in range(4)}  # type: ignore[attr-defined]
    md.mcore_data["w2"] = {"nd_reformulated_orig_global_shape": (6, 4)}  # type: ignore[attr-defined]
    got = decode_index(encode_index(md, BLOB) or b"", BLOB, "idx")
    assert got is not None
    mcore = got.mcore_data  # type: ignore[attr-defined]
    assert mcore == md.mcore_data and list(mcore) == list(md.mcore_data)  # type: ignore[attr-defined]
    assert mcore["w0"] is mcore["w3"] and mcore["w2"] is not mcore["w0"]


def test_more_distinct_shapes_than_are_shared_decode_exactly() -> None:
    md = _many(3 * MAX_SHARED_SHAPES, distinct=True)
    got = decode_index(encode_index(md, BLOB) or b"", BLOB, "idx")
    assert got is not None
    _same(got, md)
