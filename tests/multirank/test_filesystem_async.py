"""Tests of the storage writer (strategies/filesystem_async.py, write_workers.py) and its
torch.save serializer (item_writer.py).

* the fast tensor serializer produces exactly torch.save's bytes (every dtype we use,
  empty and 0-d tensors, the golden Megatron-Core items) and falls back to torch.save;
* checkpoints written by FileSystemWriterAsync load bit-exactly through torch's own
  FileSystemReader and format_utils.dcp_to_torch_save;
* bucketing: size-balanced files, separation_hint, no empty files;
* commit protocol: .metadata only in finish, atomically; stale metadata removed;
* the async path (prepare, stage, write function, retrieve, finish), on 1 and 2 ranks;
* failures: removed directory, a worker that raises, one killed by SIGKILL, and
  RLIMIT_FSIZE all raise CheckpointWriteError naming rank and file, without hanging.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import pickle
import queue
import resource
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import format_utils
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from dist_checkpointing._torch_compat import StorageInfo
from dist_checkpointing.engine.safety import load_metadata
from dist_checkpointing.engine.storage import item_reader, item_writer, resolve
from dist_checkpointing.engine.storage import write_workers as ww
from dist_checkpointing.engine.storage.bucketing import item_size, plan_buckets, split_by_size
from dist_checkpointing.engine.storage.result_table import ResultTable
from dist_checkpointing.engine.storage.results_channel import FileResultsQueue
from dist_checkpointing.errors import (
    CheckpointingException,
    CheckpointWriteError,
    UnsupportedFeatureError,
)
from dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from tests.support.golden_utils import GOLDEN_DIR
from tests.support.harness import run_distributed

GOLDEN = GOLDEN_DIR

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
    torch.float8_e5m2,
    torch.bool,
    torch.uint8,
    torch.int32,
    torch.float64,
    torch.complex64,
    torch.uint16,
]


def _sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Deterministic tensor with every bit pattern kind (built from raw bytes)."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def _assert_bit_equal(a: torch.Tensor, b: torch.Tensor, key: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (key, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(_bits(a), _bits(b)), key


# --------------------------------------------------------------------------- serializer


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 5), (2, 0, 3), (7, 1, 9), (4097,)])
def test_serializer_is_byte_identical_to_torch_save(dtype: torch.dtype, shape: tuple) -> None:
    t = _sample(shape, dtype)
    expected = io.BytesIO()
    torch.save(t, expected)
    assert item_writer.fast_path_supported(dtype)
    ours = item_writer.serialize_tensor(t)
    assert ours == expected.getvalue()
    loaded = torch.load(io.BytesIO(ours), weights_only=True)
    _assert_bit_equal(loaded, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_serializer_without_crc_matches_torch_save(dtype: torch.dtype) -> None:
    """With torch's crc32 option off, both write zero checksums (and skip computing them)."""
    torch.serialization.set_crc32_options(False)
    try:
        for shape in [(0,), (3, 4)]:
            t = _sample(shape, dtype)
            expected = io.BytesIO()
            torch.save(t, expected)
            ours = item_writer.serialize_tensor(t)
            assert ours == expected.getvalue()
            assert item_writer.fast_path_supported(dtype, False)
            _assert_bit_equal(torch.load(io.BytesIO(ours), weights_only=True), t)
            rec = item_reader.parse_tensor_item(lambda o, n, b=ours: b[o : o + n], len(ours))
            assert ours[rec.data_offset : rec.data_offset + rec.data_length] == bytes(
                _bits(t).numpy() if t.numel() else b""
            )
    finally:
        torch.serialization.set_crc32_options(True)


@pytest.mark.parametrize("parallel_crc", [True, False])
def test_serializer_large_tensor_spanning_chunks(
    monkeypatch: pytest.MonkeyPatch, parallel_crc: bool
) -> None:
    monkeypatch.setattr(item_writer, "_CHUNK_BYTES", 1000)  # many write pieces
    monkeypatch.setattr(item_writer, "_CACHE_CHUNK_BYTES", 1000)
    monkeypatch.setattr(item_writer, "_PARALLEL_CRC_BYTES", 4096)
    monkeypatch.setattr(item_writer, "_spare_cores", lambda: parallel_crc)
    t = _sample((3001,), torch.float32, seed=3)
    expected = io.BytesIO()
    torch.save(t, expected)
    assert item_writer.serialize_tensor(t) == expected.getvalue()


@pytest.mark.parametrize(
    "make",
    [
        lambda: _sample((4, 6), torch.float32).t(),  # non-contiguous: torch.save keeps strides
        lambda: _sample((10,), torch.float32)[2:5],  # a view of a larger storage
        lambda: torch.nn.Parameter(_sample((3,), torch.float32)),  # a subclass
        lambda: _sample((3,), torch.float32).requires_grad_(),
    ],
    ids=["transposed", "view", "parameter", "requires_grad"],
)
def test_serializer_falls_back_to_torch_save(make: Any) -> None:
    t = make()
    expected = io.BytesIO()
    torch.save(t, expected)
    assert item_writer.serialize_tensor(t) == expected.getvalue()


def test_serializer_reproduces_golden_megatron_items() -> None:
    count = 0
    for md_path in sorted(GOLDEN.glob("*/*/checkpoint/.metadata")):
        with open(md_path, "rb") as f:
            metadata = load_metadata(f, source=str(md_path))  # 0.13.1 pickles Megatron classes
        for index, info in metadata.storage_data.items():
            if type(metadata.state_dict_metadata[index.fqn]).__name__ != "TensorStorageMetadata":
                continue
            with open(md_path.parent / info.relative_path, "rb") as f:
                f.seek(info.offset)
                stored = f.read(info.length)
            tensor = torch.load(io.BytesIO(stored), weights_only=True)
            assert item_writer.serialize_tensor(tensor) == stored, (md_path, index.fqn)
            count += 1
    assert count >= 100  # both Megatron-Core versions, every case


# --------------------------------------------------------------------------- bucketing


def _tensor_item(fqn: str, sizes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(sizes)), sizes=torch.Size(sizes))
    data = TensorWriteData(chunk, TensorProperties(dtype=dtype), torch.Size([s * 4 for s in sizes]))
    return WriteItem(MetadataIndex(fqn, [0] * len(sizes)), WriteItemType.SHARD, tensor_data=data)


def _bytes_item(fqn: str) -> WriteItem:
    return WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO)


def test_item_size_uses_the_chunk_not_the_global_tensor() -> None:
    assert item_size(_tensor_item("a", (3, 5))) == 60
    assert item_size(_tensor_item("b", (3, 5), torch.bfloat16)) == 30
    assert item_size(_bytes_item("c")) == 0


def test_split_by_size_balances_largest_first() -> None:
    sizes = [100, 90, 50, 40, 30, 20, 10, 5]
    items = [_tensor_item(f"t{i}", (s,)) for i, s in enumerate(sizes)]
    items += [_bytes_item(f"b{i}") for i in range(4)]
    buckets = split_by_size(items, 3)
    totals = sorted(sum(item_size(it) for it in b) for b in buckets)
    assert totals == [4 * 110, 4 * 115, 4 * 120]  # largest-first onto the least-filled bin
    assert [sum(it.type == WriteItemType.BYTE_IO for it in b) for b in buckets] == [2, 1, 1]
    assert sorted(it.index.fqn for b in buckets for it in b) == sorted(it.index.fqn for it in items)


def test_plan_buckets_drops_empty_and_separates_hint() -> None:
    items = [_tensor_item("model.w", (10,)), _tensor_item("optimizer.m", (10,))]
    assert len(plan_buckets(items, 4, None)) == 2  # 4 bins, 2 items: no empty files
    groups = plan_buckets(items + [_tensor_item("optimizer.v", (5,))], 4, "optimizer.")
    assert [[it.index.fqn for it in b] for b in groups] == [
        ["model.w"],
        ["optimizer.m"],
        ["optimizer.v"],
    ]
    # A hint with one thread still gives the hinted items their own file.
    assert len(plan_buckets(items, 1, "optimizer.")) == 2


# --------------------------------------------------------------------------- sync save


def _state_dict() -> dict[str, Any]:
    big = _sample((10, 20), torch.float32, seed=1)
    sd: dict[str, Any] = {
        f"t.{dt}".replace("torch.", ""): _sample((5, 7), dt, seed=i) for i, dt in enumerate(DTYPES)
    }
    sd["view"] = big[2:5, 3:9]  # a view of a larger storage: only the chunk is saved
    sd["scalar"] = torch.tensor(3.5)
    sd["empty"] = torch.empty(0, 4)
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


def test_files_read_back_by_torch_dcp_and_dcp_to_torch_save(tmp_path: Path) -> None:
    sd = _state_dict()
    dcp.save(sd, storage_writer=FileSystemWriterAsync(tmp_path, thread_count=3), no_dist=True)
    names = sorted(os.listdir(tmp_path))
    assert names == [".metadata", "__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]

    out = _zeros_like(sd)
    dcp.load(out, storage_reader=dcp.FileSystemReader(tmp_path), no_dist=True)
    _check_loaded(sd, out)

    format_utils.dcp_to_torch_save(tmp_path, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    _check_loaded(sd, full)

    # The view was saved as its own 6x3 chunk, not with the 200-element storage.
    md = pickle.loads((tmp_path / ".metadata").read_bytes())
    info = md.storage_data[MetadataIndex("view", [0, 0])]
    with open(tmp_path / info.relative_path, "rb") as f:
        f.seek(info.offset)
        item = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
    assert item.untyped_storage().nbytes() == 18 * 4


def test_metadata_pickle_references_torch_classes_only(tmp_path: Path) -> None:
    dcp.save(_state_dict(), storage_writer=FileSystemWriterAsync(tmp_path), no_dist=True)
    data = (tmp_path / ".metadata").read_bytes()
    assert b"dist_checkpointing" not in data and b"pathlib" not in data
    md = pickle.loads(data)
    assert md.version == "1.0.0"
    assert md.storage_meta.checkpoint_id == str(tmp_path)
    assert all(type(v) is StorageInfo for v in md.storage_data.values())


def test_buckets_have_balanced_sizes(tmp_path: Path) -> None:
    sd = {f"w{i}": _sample((1000 * (i % 4 + 1),), torch.float32, seed=i) for i in range(12)}
    dcp.save(sd, storage_writer=FileSystemWriterAsync(tmp_path, thread_count=3), no_dist=True)
    sizes = [os.path.getsize(tmp_path / f"__0_{n}.distcp") for n in range(3)]
    payload = sum(v.numel() * 4 for v in sd.values())
    assert sum(sizes) > payload
    assert max(sizes) - min(sizes) < 0.1 * payload / 3  # 10000 elements each, + zip overhead


def test_separation_hint_puts_hinted_keys_in_their_own_files(tmp_path: Path) -> None:
    sd = {"model.a": _sample((64,), torch.float32), "optim.b": _sample((64,), torch.float32)}
    writer = FileSystemWriterAsync(tmp_path, thread_count=2, separation_hint="optim.")
    dcp.save(sd, storage_writer=writer, no_dist=True)
    md = pickle.loads((tmp_path / ".metadata").read_bytes())
    files = {idx.fqn: info.relative_path for idx, info in md.storage_data.items()}
    # Megatron-Core's names: hinted files start with the hint.
    assert files == {"model.a": "__0_0.distcp", "optim.b": "optim.__0_1.distcp"}


def _local_steps(writer: FileSystemWriterAsync, sd: dict[str, Any]) -> tuple[Any, Any, Metadata]:
    """DCP's single-rank planning steps, by hand (what dcp.save does before write_data)."""
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    planner = DefaultSavePlanner()
    planner.set_up_planner(sd, writer.storage_meta(), True)
    local = writer.prepare_local_plan(planner.create_local_plan())
    plans, metadata = planner.create_global_plan([local])
    final = planner.finish_plan(writer.prepare_global_plan(plans)[0])
    return final, planner, metadata


def test_metadata_only_written_by_finish_atomically(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(b"stale checkpoint")
    writer = FileSystemWriterAsync(tmp_path, thread_count=2)
    plan, planner, metadata = _local_steps(writer, _state_dict())
    # The coordinator removed the stale metadata before any data was written.
    assert not (tmp_path / ".metadata").exists()
    results = writer.write_data(plan, planner).value()
    assert sorted(os.listdir(tmp_path)) == ["__0_0.distcp", "__0_1.distcp"]
    writer.finish(metadata, [results])
    assert sorted(os.listdir(tmp_path)) == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    assert pickle.loads((tmp_path / ".metadata").read_bytes()).storage_data


def test_overwrite_false_refuses_existing_checkpoint(tmp_path: Path) -> None:
    dcp.save({"a": torch.ones(2)}, storage_writer=FileSystemWriterAsync(tmp_path), no_dist=True)
    writer = FileSystemWriterAsync(tmp_path, overwrite=False)
    writer.set_up_storage_writer(True, rank=0)
    planner = DefaultSavePlanner()
    planner.set_up_planner({"a": torch.ones(2)}, None, True)
    with pytest.raises(CheckpointWriteError, match="overwrite=False") as info:
        writer.prepare_local_plan(planner.create_local_plan())
    assert str(tmp_path) in str(info.value)


def test_build_metadata_without_writing(tmp_path: Path) -> None:
    writer = FileSystemWriterAsync(tmp_path)
    plan, planner, metadata = _local_steps(writer, {"a": torch.ones(3)})
    results = writer.write_data(plan, planner).value()
    built = writer.build_metadata(metadata, [results])
    assert built.storage_data[MetadataIndex("a", [0])].relative_path == "__0_0.distcp"
    assert not (tmp_path / ".metadata").exists()


def test_unsupported_options() -> None:
    with pytest.raises(UnsupportedFeatureError, match="single_file_per_rank"):
        FileSystemWriterAsync("/tmp/x", single_file_per_rank=False)
    writer = FileSystemWriterAsync("/tmp/x")
    with pytest.raises(UnsupportedFeatureError, match="without collectives"):
        writer.set_up_storage_writer(True, rank=0, use_collectives=False)
    with pytest.raises(UnsupportedFeatureError, match="msc://"):  # the scheme that works
        FileSystemWriterAsync("s3://bucket/ckpt")


# --------------------------------------------------------------------------- async path


def _prepared(tmp_path: Path, sd: dict[str, Any], thread_count: int) -> tuple[Any, Metadata]:
    writer = FileSystemWriterAsync(tmp_path, thread_count=thread_count)
    plan, planner, metadata = _local_steps(writer, sd)
    writer.prepare_write_data(plan, planner)
    return writer, metadata


@pytest.mark.parametrize("thread_count", [1, 3])
def test_async_path_round_trip(tmp_path: Path, thread_count: int) -> None:
    sd = _state_dict()
    writer, metadata = _prepared(tmp_path, sd, thread_count)
    fn, stage_fn, args = writer.get_save_function_and_args()
    assert fn is ww.write_buckets_multiproc and stage_fn is not None
    assert stage_fn() is args[1]  # stages in place; also returns the buckets (Megatron style)
    pickle.dumps(args)  # the args can travel to a spawned worker
    assert not list(tmp_path.iterdir())
    fn(*args)
    results = writer.retrieve_write_results()
    tensor_keys = {k for k, v in sd.items() if isinstance(v, torch.Tensor)}
    assert tensor_keys < {r.index.fqn for r in results}
    writer.finish(metadata, [results])
    assert len(list(tmp_path.glob("*.distcp"))) == thread_count
    out = _zeros_like(sd)
    dcp.load(out, storage_reader=dcp.FileSystemReader(tmp_path), no_dist=True)
    _check_loaded(sd, out)


def test_async_write_in_a_forked_process(tmp_path: Path) -> None:
    """The write function runs in another process; results come back through the queue."""
    sd = {f"w{i}": _sample((100,), torch.float32, seed=i) for i in range(4)}
    writer, metadata = _prepared(tmp_path, sd, 2)
    fn, stage_fn, args = writer.get_save_function_and_args()
    assert fn is not None and stage_fn is not None
    stage_fn()
    proc = multiprocessing.get_context("fork").Process(target=fn, args=args)
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    table = writer.retrieve_result_table()  # as the worker sent it: columns
    results = writer.retrieve_write_results()
    assert sorted(r.index.fqn for r in results) == sorted(sd)
    assert list(ResultTable.of(results).rows()) == list(table.rows())
    assert all(hasattr(r, "checksum") for r in results)  # as the writer makes them
    assert not os.path.exists(args[2].directory)  # the results channel cleaned up
    assert writer.retrieve_write_results() is results  # kept until released
    assert writer.retrieve_result_table() is table
    writer.release_write_results()
    with pytest.raises(CheckpointingException, match="after release_write_results"):
        writer.retrieve_write_results()  # never an empty list that would lose items


def test_rank_with_nothing_to_write(tmp_path: Path) -> None:
    writer = FileSystemWriterAsync(tmp_path)
    writer.set_up_storage_writer(False, rank=1)
    planner = DefaultSavePlanner()
    planner.set_up_planner({}, None, False)
    writer.prepare_write_data(writer.prepare_local_plan(planner.create_local_plan()), planner)
    assert writer.get_save_function_and_args() == (None, None, [])
    assert writer.retrieve_write_results() == []


def test_file_results_queue_times_out_then_delivers(tmp_path: Path) -> None:
    q = FileResultsQueue(rank=0)
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    q.put({"x": 1})
    assert q.get(timeout=1) == {"x": 1}
    q.close()
    assert not os.path.exists(q.directory)


# --------------------------------------------------------------------------- failures


def test_removed_directory_sync(tmp_path: Path) -> None:
    writer = FileSystemWriterAsync(tmp_path / "ckpt", thread_count=2)
    plan, planner, _ = _local_steps(writer, _state_dict())
    shutil.rmtree(tmp_path / "ckpt")
    with pytest.raises(CheckpointWriteError) as info:
        writer.write_data(plan, planner)
    msg = str(info.value)
    assert "rank 0" in msg and str(tmp_path / "ckpt" / "__0_0.distcp") in msg
    assert "does not exist" in msg and str(tmp_path / "ckpt" / "__0_1.distcp") in msg


def test_removed_directory_async(tmp_path: Path) -> None:
    writer, _ = _prepared(tmp_path / "ckpt", _state_dict(), 2)
    fn, _, args = writer.get_save_function_and_args()
    shutil.rmtree(tmp_path / "ckpt")
    assert fn is not None
    fn(*args)  # never raises: failures travel in the outcome
    with pytest.raises(CheckpointWriteError, match=r"rank 0: writing checkpoint file .*__0_1"):
        writer.retrieve_write_results()


def test_worker_exception_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = ww.write_bucket_file

    def failing(bucket: Any, fs: Any, sync_files: bool) -> Any:
        if bucket.relative_path == "__0_1.distcp":
            raise RuntimeError("injected failure")
        return original(bucket, fs, sync_files)

    monkeypatch.setattr(ww, "write_bucket_file", failing)  # forked workers inherit it
    writer, _ = _prepared(tmp_path, _state_dict(), 3)
    fn, _, args = writer.get_save_function_and_args()
    assert fn is not None
    fn(*args)
    with pytest.raises(CheckpointWriteError) as info:
        writer.retrieve_write_results()
    msg = str(info.value)
    assert "RuntimeError: injected failure" in msg and "__0_1.distcp" in msg
    assert "__0_0.distcp" not in msg and "__0_2.distcp" not in msg


def test_killed_worker_is_detected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = ww.write_bucket_file

    def dying(bucket: Any, fs: Any, sync_files: bool) -> Any:
        if bucket.relative_path == "__0_0.distcp":
            os.kill(os.getpid(), signal.SIGKILL)
        return original(bucket, fs, sync_files)

    monkeypatch.setattr(ww, "write_bucket_file", dying)
    writer, _ = _prepared(tmp_path, _state_dict(), 2)
    fn, _, args = writer.get_save_function_and_args()
    assert fn is not None
    fn(*args)
    with pytest.raises(CheckpointWriteError) as info:
        writer.retrieve_write_results()
    msg = str(info.value)
    assert "rank 0" in msg and str(tmp_path / "__0_0.distcp") in msg
    assert "killed by signal SIGKILL" in msg and "__0_1.distcp" not in msg


def test_write_process_that_never_reports(tmp_path: Path) -> None:
    writer, _ = _prepared(tmp_path, _state_dict(), 1)
    writer.get_save_function_and_args()  # the write function is never run
    with pytest.raises(CheckpointWriteError, match=r"rank 0: no write results within 0s"):
        writer.retrieve_write_results(timeout=0.1)


def _write_with_file_size_limit(fn: Any, args: list[Any], limit: int) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    fn(*args)


@pytest.mark.parametrize("thread_count", [1, 2])
def test_file_size_limit_names_the_file(tmp_path: Path, thread_count: int) -> None:
    sd = {"a": _sample((1 << 18,), torch.float32), "b": _sample((1 << 18,), torch.float32)}
    writer, _ = _prepared(tmp_path, sd, thread_count)
    fn, _, args = writer.get_save_function_and_args()
    # Run where the limit cannot hurt the test process. The single-bucket case writes
    # in that process itself, which then must not die of SIGXFSZ either.
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_ignore_sigxfsz_and_write, args=(fn, args, 1 << 19))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    with pytest.raises(CheckpointWriteError) as info:
        writer.retrieve_write_results()
    msg = str(info.value)
    assert str(tmp_path / "__0_0.distcp") in msg and "RLIMIT_FSIZE" in msg


def _ignore_sigxfsz_and_write(fn: Any, args: list[Any], limit: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _write_with_file_size_limit(fn, args, limit)


# --------------------------------------------------------------------------- two ranks


def _two_rank_save(ckpt_dir: str, use_async: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    sd = {
        f"rank{rank}.w": _sample((6, 5), torch.bfloat16, seed=rank),
        "shared.bias": _sample((4,), torch.float32, seed=99),  # replicated: written once
        f"rank{rank}.obj": {"rank": rank},
    }
    writer = FileSystemWriterAsync(ckpt_dir, thread_count=2)
    if not use_async:
        dcp.save(sd, storage_writer=writer)
    else:
        writer.set_up_storage_writer(rank == 0, rank=rank)
        planner = DefaultSavePlanner()
        planner.set_up_planner(sd, writer.storage_meta(), rank == 0)
        local = writer.prepare_local_plan(planner.create_local_plan())
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, local)
        plans, metadata = planner.create_global_plan(gathered)
        plans = writer.prepare_global_plan(plans)
        writer.prepare_write_data(planner.finish_plan(plans[rank]), planner)
        fn, stage_fn, args = writer.get_save_function_and_args()
        assert fn is not None and stage_fn is not None
        stage_fn()
        fn(*args)
        results: list[Any] = [None, None]
        dist.all_gather_object(results, writer.retrieve_write_results())
        if rank == 0:
            writer.finish(metadata, results)
        dist.barrier()
    files = sorted(os.listdir(ckpt_dir))
    out = {k: torch.zeros_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    out[f"rank{rank}.obj"] = {"rank": -1}
    dcp.load(out, storage_reader=dcp.FileSystemReader(ckpt_dir))
    for key, value in sd.items():
        if isinstance(value, torch.Tensor):
            _assert_bit_equal(out[key], value, key)
    assert out[f"rank{rank}.obj"] == {"rank": rank}
    return {"files": files}


@pytest.mark.parametrize("use_async", [False, True], ids=["dcp_save", "async_path"])
def test_two_ranks(tmp_path: Path, use_async: bool) -> None:
    results = run_distributed(_two_rank_save, 2, str(tmp_path), use_async, timeout=90.0)
    files = results[0]["files"]
    assert ".metadata" in files and "__0_0.distcp" in files and "__1_0.distcp" in files
    md = pickle.loads((tmp_path / ".metadata").read_bytes())
    paths = {idx.fqn: info.relative_path for idx, info in md.storage_data.items()}
    assert paths["rank1.w"].startswith("__1_") and paths["rank0.w"].startswith("__0_")
    assert json.dumps(sorted(paths))  # every key has one location


# --------------------------------------------------------------------------- fs_io, GPU


def test_atomic_write_replaces_and_leaves_no_temporary(tmp_path: Path) -> None:
    fs = resolve.filesystem_for(tmp_path)
    target = str(tmp_path / "file")
    fs.atomic_write(target, b"old")
    fs.atomic_write(target, b"new contents")
    assert (tmp_path / "file").read_bytes() == b"new contents"
    assert sorted(os.listdir(tmp_path)) == ["file"]
    with pytest.raises(FileNotFoundError):
        fs.atomic_write(str(tmp_path / "missing" / "file"), b"x")
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_validate_checkpoint_id(tmp_path: Path) -> None:
    assert FileSystemWriterAsync.validate_checkpoint_id(tmp_path / "new" / "dir")
    assert not FileSystemWriterAsync.validate_checkpoint_id("msc://bucket/ckpt")


@pytest.mark.gpu
def test_stage_buckets_copies_accelerator_tensors(tmp_path: Path) -> None:
    sd = {"gpu": _sample((64, 3), torch.bfloat16).cuda(), "cpu": _sample((5,), torch.float32)}
    writer, metadata = _prepared(tmp_path, sd, 2)
    fn, stage_fn, args = writer.get_save_function_and_args()
    assert fn is not None and stage_fn is not None
    staged = stage_fn()
    tensors = [t for b in staged for _, t in b.tensor_items]
    assert all(t.is_cpu for t in tensors) and any(t.is_pinned() for t in tensors)
    fn(*args)
    writer.finish(metadata, [writer.retrieve_write_results()])
    out = {"gpu": torch.zeros(64, 3, dtype=torch.bfloat16), "cpu": torch.zeros(5)}
    dcp.load(out, storage_reader=dcp.FileSystemReader(tmp_path), no_dist=True)
    _assert_bit_equal(out["gpu"], sd["gpu"].cpu())
    _assert_bit_equal(out["cpu"], sd["cpu"])


@pytest.mark.parametrize("elements", [16, 4096])  # 64-byte items; 16 KiB items
def test_small_items_are_written_by_one_thread_large_by_several(
    tmp_path: Path, elements: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Buckets of small items (Python-bound) are written in turn by the caller's thread,
    larger ones a thread each; the files and results are the same either way."""
    import threading

    sd = {f"w{i}": _sample((elements,), torch.float32, seed=i) for i in range(40)}
    writers: dict[str, int] = {}
    original = ww.write_bucket_file

    def recording(bucket: Any, fs: Any, sync_files: bool) -> Any:
        writers[bucket.relative_path] = threading.get_ident()
        return original(bucket, fs, sync_files)

    monkeypatch.setattr(ww, "write_bucket_file", recording)
    writer, metadata = _prepared(tmp_path, sd, 3)
    fn, stage_fn, args = writer.get_save_function_and_args(in_process=True)
    assert stage_fn is not None
    stage_fn()
    fn(*args)
    results = writer.retrieve_write_results()
    writer.finish(metadata, [results])
    assert len(writers) == 3  # three buckets, three files, either way
    one_thread = elements * 4 < ww._SMALL_ITEM_BYTES
    assert (set(writers.values()) == {threading.get_ident()}) == one_thread
    assert len(set(writers.values())) == (1 if one_thread else 3)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=dcp.FileSystemReader(tmp_path), no_dist=True)
    for key, value in sd.items():
        _assert_bit_equal(out[key], value, key)
