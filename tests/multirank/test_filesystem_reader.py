"""Tests of the storage reader (strategies/filesystem_reader.py) and its zip parser.

* round trips through our writer, and reads of torch's own DCP files, bit-exact for
  every dtype we use (bf16, fp8 and bool included), views and bytes items;
* every golden Megatron-Core checkpoint: tensors against the value formula, objects
  and the common state against the manifest (1 and 2 ranks);
* the fast path reads only the requested region (sub-rows, columns, 3-D blocks,
  non-contiguous and other-dtype destinations) and falls back to torch.load for
  items it does not handle;
* missing, truncated and garbled files raise errors naming file, offset and key.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from dist_checkpointing.engine.storage import item_reader as tsz
from dist_checkpointing.engine.storage import local as fs_io
from dist_checkpointing.engine.storage import reader as fr
from dist_checkpointing.engine.storage import region_copy
from dist_checkpointing.engine.storage.item_reader import parse_tensor_item
from dist_checkpointing.engine.storage.reader import FileSystemReader, read_object_bytes
from dist_checkpointing.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from tests.support.golden_utils import GOLDEN_DIR
from tests.support.harness import run_distributed

GOLDEN = GOLDEN_DIR
GOLDEN_CASES = sorted(p.parent for p in GOLDEN.glob("*/*/manifest.json"))

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.float8_e4m3fn,
    torch.bool,
    torch.uint8,
    torch.float64,
]


def _sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def _raw(t: torch.Tensor) -> bytes:
    return _bits(t).numpy().tobytes() if t.numel() else b""


def _assert_bit_equal(a: torch.Tensor, b: torch.Tensor, key: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (key, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(_bits(a), _bits(b)), key


def _state_dict() -> dict[str, Any]:
    big = _sample((10, 20), torch.float32, seed=1)
    sd: dict[str, Any] = {f"t{i}": _sample((5, 7), dt, seed=i) for i, dt in enumerate(DTYPES)}
    sd["view"] = big[2:5, 3:9]
    sd["scalar"] = torch.tensor(3.5)
    sd["empty"] = torch.empty(0, 4)
    sd["large"] = _sample((600, 1000), torch.bfloat16, seed=7)  # > 1 MiB: read directly
    sd["obj"] = {"text": "héllo", "n": [1, 2.5, None]}
    return sd


def _zeros_like(sd: dict[str, Any]) -> dict[str, Any]:
    out = {k: torch.zeros_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    out["obj"] = {"text": "", "n": [0, 0.0, 0]}
    return out


def _check_loaded(expected: dict[str, Any], got: dict[str, Any]) -> None:
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            _assert_bit_equal(got[key], value.contiguous(), key)
    assert got["obj"] == expected["obj"]


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("thread_count", [1, 2])
def test_round_trip_with_our_writer(tmp_path: Path, thread_count: int) -> None:
    sd = _state_dict()
    dcp.save(sd, storage_writer=FileSystemWriterAsync(tmp_path, thread_count=3), no_dist=True)
    out = _zeros_like(sd)
    reader = FileSystemReader(tmp_path, thread_count=thread_count)
    dcp.load(out, storage_reader=reader, no_dist=True)
    _check_loaded(sd, out)


@pytest.mark.parametrize("fast_path", [True, False])
def test_reads_torch_dcp_files(tmp_path: Path, fast_path: bool) -> None:
    sd = _state_dict()
    sd["transposed"] = _sample((6, 4), torch.float16, seed=5).t()  # torch keeps the strides
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=2), no_dist=True)
    out = _zeros_like(sd)
    dcp.load(out, storage_reader=FileSystemReader(tmp_path, fast_path=fast_path), no_dist=True)
    _check_loaded(sd, out)


def test_read_metadata_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match=str(tmp_path / "nope")):
        FileSystemReader(tmp_path / "nope").read_metadata()
    (tmp_path / "__0_0.distcp").write_bytes(b"data")
    with pytest.raises(IncompleteCheckpointError) as info:
        FileSystemReader(tmp_path).read_metadata()
    assert str(tmp_path / ".metadata") in str(info.value)
    assert isinstance(info.value, FileNotFoundError)


# --------------------------------------------------------------------------- golden checkpoints


def _golden_values(manifest: dict[str, Any], key: str) -> torch.Tensor:
    scope: dict[str, Any] = {}
    exec(manifest["value_formula"]["python"], scope)  # the manifest's own formula
    spec = manifest["tensors"][key]
    return scope["golden_values"](
        spec["key_index"], spec["global_shape"], getattr(torch, spec["dtype"])
    )


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"__tensor__"}:
        t = value["__tensor__"]
        return torch.tensor(t["values"], dtype=getattr(torch, t["dtype"])).reshape(t["shape"])
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        _assert_bit_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def _nd_reformulated(logical: torch.Tensor, stored: tuple[int, ...]) -> torch.Tensor:
    """Megatron-Core 0.13's storage of flattened keys: [c0, c1, .., j] = element j of the
    C-order flattening of block (c0, c1, ..) of the logical tensor."""
    grid = stored[:-1]
    block = [g // n for g, n in zip(logical.shape, grid)]
    out = torch.empty(stored, dtype=logical.dtype)
    for index in torch.cartesian_prod(*[torch.arange(n) for n in grid]).reshape(-1, len(grid)):
        c = [int(i) for i in index]
        sl = tuple(slice(ci * b, (ci + 1) * b) for ci, b in zip(c, block))
        out[tuple(c)] = logical[sl].reshape(-1)
    return out


def _load_golden_tensors(case: Path, thread_count: int) -> tuple[dict[str, Any], dict[str, Any]]:
    manifest = json.loads((case / "manifest.json").read_text())
    ckpt = case / "checkpoint"
    metadata = FileSystemReader(ckpt).read_metadata()
    sd: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            sd[key] = torch.full(md.size, 7, dtype=md.properties.dtype)
    dcp.load(sd, storage_reader=FileSystemReader(ckpt, thread_count=thread_count), no_dist=True)
    return manifest, sd


@pytest.mark.parametrize("case", GOLDEN_CASES, ids=lambda p: f"{p.parent.name}-{p.name}")
def test_golden_tensors_and_objects(case: Path) -> None:
    manifest, sd = _load_golden_tensors(case, thread_count=1)
    assert sorted(sd) == sorted(manifest["tensors"])
    for key, tensor in sd.items():
        expected = _golden_values(manifest, key)
        if tuple(expected.shape) != tuple(tensor.shape):
            expected = _nd_reformulated(expected, tuple(tensor.shape))
        _assert_bit_equal(tensor, expected, key)
    for obj in manifest["sharded_objects"].values():
        for shard in obj["shards"]:
            if not shard["is_main_replica"]:
                continue
            data, source = read_object_bytes(case / "checkpoint", shard["unique_key"])
            assert data is not None and str(case / "checkpoint") in source
            payload = torch.load(io.BytesIO(data), weights_only=True)
            _assert_same(payload, [_decode(shard["payload"])])
    if manifest["megatron_core_version"].startswith("0.19"):
        data, _ = read_object_bytes(case / "checkpoint", "common_state/shard_0_1")
        assert data is not None
        common = torch.load(io.BytesIO(data), weights_only=True)[0]
        _assert_same(common, _decode(manifest["common_state"]))
    assert read_object_bytes(case / "checkpoint", "no/such/key")[0] is None


def _golden_on_two_ranks(case: str) -> dict[str, float]:
    manifest, sd = _load_golden_tensors(Path(case), thread_count=2)
    for key, tensor in sd.items():
        _assert_bit_equal(tensor, _golden_values(manifest, key), key)
    return {k: float(v.double().sum()) for k, v in sd.items()}


def test_golden_on_two_ranks() -> None:
    case = GOLDEN / "mcore-0.19.2" / "tp2_basic"
    sums = run_distributed(_golden_on_two_ranks, 2, str(case), timeout=90.0)
    assert sums[0] == sums[1] and len(sums[0]) == 10


# --------------------------------------------------------------------------- fast path


class _TargetPlanner(LoadPlanner):
    """Resolves each read item to a given destination tensor; records commits and bytes."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets
        self.committed: list[str] = []
        self.blobs: dict[str, bytes] = {}

    def set_up_planner(
        self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.blobs[read_item.dest_index.fqn] = value.read()

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.targets[read_item.dest_index.fqn]

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        assert tensor is self.targets[read_item.dest_index.fqn] or tensor.data_ptr() == (
            self.targets[read_item.dest_index.fqn].data_ptr()
        )
        self.committed.append(read_item.dest_index.fqn)


def _read_item(name: str, fqn: str, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> ReadItem:
    zero = torch.Size([0] * len(offsets))
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(name),
        dest_offsets=zero,
        storage_index=MetadataIndex(fqn, zero),
        storage_offsets=torch.Size(offsets),
        lengths=torch.Size(lengths),
    )


def _read(
    ckpt: Path, requests: list[tuple[str, str, tuple, tuple, torch.Tensor]], fast_path: bool = True
) -> _TargetPlanner:
    reader = FileSystemReader(ckpt, fast_path=fast_path)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    planner = _TargetPlanner({name: target for name, _, _, _, target in requests})
    items = [_read_item(name, fqn, o, n) for name, fqn, o, n, _ in requests]
    reader.read_data(LoadPlan(items), planner).wait()
    return planner


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = {
        "w": _sample((8, 12), torch.float32, seed=1),
        "h": _sample((8, 12), torch.bfloat16, seed=2),
        "q": _sample((8, 12), torch.float8_e4m3fn, seed=3),
        "cube": _sample((4, 5, 6), torch.int64, seed=4),
        "large": _sample((512, 1024), torch.float32, seed=5),  # 2 MiB: not windowed
    }
    dcp.save(tensors, storage_writer=FileSystemWriterAsync(tmp_path), no_dist=True)
    return tmp_path, tensors


@pytest.mark.parametrize("key", ["w", "h", "q", "large"])
@pytest.mark.parametrize(
    ("offsets", "lengths"),
    [
        ((2, 0), (3, 12)),  # whole rows: one byte range, read into the destination
        ((5, 3), (1, 6)),  # part of one row: one byte range
        ((1, 4), (5, 3)),  # columns: a strided region
        ((0, 0), (8, 12)),  # everything
        ((7, 11), (1, 1)),  # the last element
        ((3, 0), (0, 12)),  # nothing
    ],
)
def test_fast_path_sub_regions(
    saved: tuple[Path, dict[str, torch.Tensor]], key: str, offsets: tuple, lengths: tuple
) -> None:
    ckpt, tensors = saved
    source = tensors[key]
    target = torch.zeros(lengths, dtype=source.dtype)
    planner = _read(ckpt, [("dst", key, offsets, lengths, target)])
    expected = source[offsets[0] : offsets[0] + lengths[0], offsets[1] : offsets[1] + lengths[1]]
    _assert_bit_equal(target, expected, key)
    assert planner.committed == ["dst"]


def test_fast_path_3d_block_into_non_contiguous_destination(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    ckpt, tensors = saved
    canvas = torch.zeros(6, 9, 4, dtype=torch.int64)
    target = canvas[1:3, 2:5, 0:4].transpose(1, 2).transpose(1, 2)  # a non-contiguous view
    assert not target.is_contiguous()
    _read(ckpt, [("dst", "cube", (1, 2, 1), (2, 3, 4), target)])
    _assert_bit_equal(canvas[1:3, 2:5, 0:4], tensors["cube"][1:3, 2:5, 1:5])
    assert canvas.sum() == tensors["cube"][1:3, 2:5, 1:5].sum()  # nothing else touched


def test_fast_path_casts_to_the_destination_dtype(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    ckpt, tensors = saved
    target = torch.zeros(4, 12, dtype=torch.float64)
    _read(ckpt, [("dst", "w", (4, 0), (4, 12), target)])
    torch.testing.assert_close(target, tensors["w"][4:8].double(), rtol=0, atol=0, equal_nan=True)


def _count_file_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of every read of checkpoint files, from now on (appended to): each
    ``readinto`` of the stream, and each ``os.preadv`` on its descriptor (items of a
    known layout are read straight into their destinations)."""
    counted: list[int] = []
    files: set[int] = set()
    preadv = os.preadv

    class Counting(io.FileIO):
        def readinto(self, buf: Any) -> int:  # type: ignore[override]
            n = super().readinto(buf) or 0
            counted.append(n)
            return n

        def close(self) -> None:
            if not self.closed:
                files.discard(self.fileno())
            super().close()

    def counting_preadv(fd: int, buffers: Any, offset: int, *flags: int) -> int:
        n = preadv(fd, buffers, offset, *flags)
        if fd in files:
            counted.append(n)
        return n

    def open_read(self: Any, path: str) -> Counting:
        stream = Counting(path, "r")
        files.add(stream.fileno())
        return stream

    monkeypatch.setattr(fs_io.LocalFileSystem, "open_read", open_read)
    monkeypatch.setattr(os, "preadv", counting_preadv)
    return counted


def test_fast_path_reads_only_the_needed_bytes(
    saved: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, tensors = saved
    counted = _count_file_reads(monkeypatch)
    monkeypatch.setattr(region_copy, "copy_region_torch_load", _no_fallback)
    target = torch.zeros(2, 1024)
    _read(ckpt, [("dst", "large", (100, 0), (2, 1024), target)])
    _assert_bit_equal(target, tensors["large"][100:102])
    assert sum(counted) <= 2 * 1024 * 4 + 2 * 4096  # the rows plus the zip headers


def _no_fallback(*args: Any) -> None:
    raise AssertionError("the fast path should have handled this item")


def test_fallback_to_torch_load_for_strided_items(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _sample((6, 4), torch.float16, seed=5).t()
    dcp.save({"t": source}, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    calls: list[str] = []
    original = region_copy.copy_region_torch_load

    def counting(item: Any, read_item: ReadItem, target: torch.Tensor) -> None:
        calls.append(read_item.dest_index.fqn)
        original(item, read_item, target)

    monkeypatch.setattr(region_copy, "copy_region_torch_load", counting)
    target = torch.zeros(2, 3, dtype=torch.float16)
    _read(tmp_path, [("dst", "t", (1, 2), (2, 3), target)])
    _assert_bit_equal(target, source[1:3, 2:5])
    assert calls == ["dst"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parser_template_and_zip_walk_agree(dtype: torch.dtype) -> None:
    for shape in [(), (0,), (3, 5), (2, 1, 4)]:
        t = _sample(shape, dtype)
        buf = io.BytesIO()
        torch.save(t, buf)
        data = buf.getvalue()

        def read_at(o: int, n: int, data: bytes = data) -> bytes:
            return data[o : o + n]

        record = parse_tensor_item(read_at, len(data))
        assert tsz._match_template(read_at, len(data)) == record  # the quick path matched
        assert tsz._parse_zip(read_at, len(data)) == record
        assert (record.dtype, record.shape, record.storage_offset) == (dtype, shape, 0)
        stored = data[record.data_offset : record.data_offset + record.data_length]
        assert stored == _raw(t)


def test_parser_handles_other_zip_layouts() -> None:
    """An archive torch.load accepts but laid out differently (Python's zipfile, no
    alignment, other archive name) is parsed by walking its directory."""
    t = _sample((4, 3), torch.float32, seed=9)
    buf = io.BytesIO()
    torch.save(t, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src:
        records = {i.filename.replace("archive/", "other/"): src.read(i) for i in src.infolist()}
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for name, payload in records.items():
            dst.writestr(name, payload)
    data = out.getvalue()

    def read_at(o: int, n: int) -> bytes:
        return data[o : o + n]

    assert tsz._match_template(read_at, len(data)) is None
    record = parse_tensor_item(read_at, len(data))
    stored = data[record.data_offset : record.data_offset + record.data_length]
    assert stored == _raw(t)
    _assert_bit_equal(torch.load(io.BytesIO(data), weights_only=True), t)


def test_parser_rejects_non_tensor_archives() -> None:
    buf = io.BytesIO()
    torch.save({"a": torch.ones(2)}, buf)
    data = buf.getvalue()
    with pytest.raises(fr.NotFastPath, match="dict|global"):
        parse_tensor_item(lambda o, n: data[o : o + n], len(data))
    with pytest.raises(fr.NotFastPath):
        parse_tensor_item(lambda o, n: b"\0" * n, 100)


# --------------------------------------------------------------------------- corruption


def _item_location(ckpt: Path, fqn: str) -> Any:
    metadata: Metadata = FileSystemReader(ckpt).read_metadata()
    return next(info for idx, info in metadata.storage_data.items() if idx.fqn == fqn)


def _load_all(ckpt: Path, tensors: dict[str, torch.Tensor]) -> None:
    out = {k: torch.zeros_like(v) for k, v in tensors.items()}
    reader = FileSystemReader(ckpt)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    planner = DefaultLoadPlanner()
    planner.set_up_planner(out, reader.read_metadata(), True)
    reader.read_data(planner.create_local_plan(), planner).wait()


def test_truncated_file_names_file_offset_and_key(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    ckpt, tensors = saved
    info = _item_location(ckpt, "large")
    path = ckpt / info.relative_path
    os.truncate(path, info.offset + info.length - 100)
    with pytest.raises(CorruptCheckpointError) as err:
        _load_all(ckpt, tensors)
    msg = str(err.value)
    assert str(path) in msg and "'large'" in msg and f"offset {info.offset}" in msg


def test_garbled_item_names_file_offset_and_key(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    ckpt, tensors = saved
    info = _item_location(ckpt, "h")
    path = ckpt / info.relative_path
    with open(path, "r+b") as f:  # destroy the item's zip directory and headers
        f.seek(info.offset)
        f.write(b"\xff" * info.length)
    with pytest.raises(CorruptCheckpointError) as err:
        _load_all(ckpt, tensors)
    msg = str(err.value)
    assert str(path) in msg and "'h'" in msg and f"offset {info.offset}" in msg


def test_missing_data_file(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    ckpt, tensors = saved
    os.remove(ckpt / "__0_0.distcp")
    with pytest.raises(CorruptCheckpointError, match=r"data file .*__0_0\.distcp is missing"):
        _load_all(ckpt, tensors)


def test_metadata_is_read_with_the_restricted_unpickler(tmp_path: Path) -> None:
    dcp.save({"a": torch.ones(2)}, storage_writer=FileSystemWriterAsync(tmp_path), no_dist=True)

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, ("echo pwned",))

    metadata = pickle.loads((tmp_path / ".metadata").read_bytes())
    metadata.planner_data = Evil()
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(Exception, match="posix.system|os.system") as info:
        FileSystemReader(tmp_path).read_metadata()
    assert type(info.value).__name__ == "UnsafeCheckpointError"


def _count_reads_of_small_items(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_item_bytes: str
) -> tuple[int, dict[str, torch.Tensor]]:
    """Save 20 small tensors into one file, read them all back; count the reads."""
    tensors = {f"t{i}": _sample((64,), torch.float32, seed=i) for i in range(20)}
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    counted = _count_file_reads(monkeypatch)
    monkeypatch.setenv("DIST_CKPT_READ_SMALL_ITEM_BYTES", small_item_bytes)
    targets = {k: torch.zeros(64) for k in tensors}
    _read(tmp_path, [(k, k, (0,), (64,), targets[k]) for k in tensors])
    for k, t in tensors.items():
        _assert_bit_equal(targets[k], t, k)
    return len(counted), tensors


def test_read_window_knob_changes_how_small_items_are_fetched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batched, _ = _count_reads_of_small_items(tmp_path / "a", monkeypatch, str(1 << 20))
    one_by_one, _ = _count_reads_of_small_items(tmp_path / "b", monkeypatch, "0")
    # With the default, neighbouring small items share one read; with a zero
    # threshold every item is read on its own.
    assert batched < one_by_one
    assert one_by_one >= 20
