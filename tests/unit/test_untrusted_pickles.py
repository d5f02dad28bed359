"""Crafted pickles and archives in a checkpoint someone else made: bounded before they
allocate, crash or run for minutes; nothing handed out that a pickle could change."""

from __future__ import annotations

import io
import pickle
import re
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

import dist_checkpointing as dcp
from dist_checkpointing import ShardedTensor
from dist_checkpointing.engine.safety import load_metadata, safe_torch_load
from dist_checkpointing.engine.safety.bounded import short_repr
from dist_checkpointing.engine.safety.pickle_scan import MAX_DEPTH, check_pickle
from dist_checkpointing.engine.storage import item_reader
from dist_checkpointing.engine.storage.item_template import NotFastPath
from dist_checkpointing.errors import CorruptCheckpointError, UnsafeCheckpointError

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def _deep_key(levels: int) -> bytes:
    """``{((((),),)...): 1}``: hashing the key recurses ``levels`` deep in C."""
    return b"\x80\x04}" + b")" + b"\x85" * levels + b"K\x01s."


def _with_pickle(archive: bytes, pickled: bytes, method: int = zipfile.ZIP_STORED) -> bytes:
    """``archive`` (a torch.save zip) with its data.pkl replaced by ``pickled``."""
    src = zipfile.ZipFile(io.BytesIO(archive))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data.pkl"):
                data = pickled
            info.compress_type = method
            dst.writestr(info, data)
    return out.getvalue()


def _saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# ----------------------------------------------------------------------------- nesting


def test_deep_nesting_never_kills_the_interpreter(tmp_path: Path) -> None:
    """In a child process: a crash there (SIGSEGV) fails this test instead of pytest."""
    script = textwrap.dedent(
        f"""
        import io, os, sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.unit.test_untrusted_pickles import _deep_key, _saved, _with_pickle
        from dist_checkpointing.engine.safety import load_metadata, safe_torch_load
        from dist_checkpointing.errors import CorruptCheckpointError
        # Main-thread and big-stack paths, in this process (guard off: the larger file
        # would otherwise be stopped by the CPU limit first) and in the forked check.
        for levels, guard in ((300_000, "0"), (3_000_000, "0"), (300_000, "1")):
            os.environ["DIST_CKPT_METADATA_PARSE_GUARD"] = guard
            try:
                load_metadata(io.BytesIO(_deep_key(levels)), source="ckpt/.metadata")
            except CorruptCheckpointError as exc:
                assert "ckpt/.metadata" in str(exc) and "nests deeper" in str(exc), exc
            else:
                raise AssertionError("loaded")
        payload = _with_pickle(_saved((1,)), _deep_key(300_000))
        try:
            safe_torch_load(payload, source="ckpt/common.pt")
        except CorruptCheckpointError as exc:
            assert "ckpt/common.pt" in str(exc) and "nests deeper" in str(exc), exc
        else:
            raise AssertionError("loaded")
        print("survived")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=100, check=False
    )
    assert done.returncode == 0 and "survived" in done.stdout, done.stderr[-2000:]


def test_scan_bounds() -> None:
    check_pickle(pickle.dumps([[[1]]] * 1000), "x")  # shallow and wide: fine
    deep: object = ()
    for _ in range(MAX_DEPTH + 5):
        deep = (deep,)
    with pytest.raises(CorruptCheckpointError, match="x: refusing to unpickle: it nests"):
        check_pickle(pickle.dumps(deep), "x")
    check_pickle(pickle.dumps({str(i): (i, i) for i in range(20_000)}), "x")
    check_pickle(pickle.dumps({i: 0 for i in range(20_000)}), "x")  # small ints


def test_colliding_dict_keys_are_refused_quickly() -> None:
    colliding = {i * (2**61 - 1): 0 for i in range(1, 20_000)}  # all hash to 0
    minus = {tuple((-1, -2)[(j >> b) & 1] for b in range(14)): 0 for j in range(2**14)}
    for keys in (colliding, minus):
        start = time.perf_counter()
        with pytest.raises(CorruptCheckpointError, match="ckpt/common.pt: .*collide"):
            safe_torch_load(_saved(keys), source="ckpt/common.pt")
        assert time.perf_counter() - start < 10


# ----------------------------------------------------------------------------- archives


def test_compressed_record_is_refused_before_inflating() -> None:
    payload = _with_pickle(_saved(torch.zeros(1000)), pickle.dumps(1), zipfile.ZIP_DEFLATED)
    with pytest.raises(CorruptCheckpointError, match=r"ckpt/common.pt: .*is compressed"):
        safe_torch_load(payload, source="ckpt/common.pt")


def test_record_larger_than_the_archive_is_refused() -> None:
    payload = bytearray(_saved({"a": 1}))
    directory = payload.rfind(b"PK\x01\x02")
    payload[directory + 24 : directory + 28] = (1 << 31).to_bytes(4, "little")  # size
    with pytest.raises(CorruptCheckpointError, match="declares 2147483648 bytes"):
        safe_torch_load(bytes(payload), source="ckpt/common.pt")


def test_sparse_tensor_with_out_of_range_indices_is_refused() -> None:
    bad = torch.sparse_coo_tensor(
        torch.tensor([[0, 99]]), torch.ones(2), (4,), check_invariants=False
    )
    with pytest.raises(CorruptCheckpointError, match="ckpt/common.pt"):
        safe_torch_load(_saved({"s": bad}), source="ckpt/common.pt")
    good = torch.sparse_coo_tensor(torch.tensor([[0, 3]]), torch.ones(2), (4,))
    loaded = safe_torch_load(_saved({"s": good}), source="ckpt/common.pt")
    assert torch.equal(loaded["s"].to_dense(), good.to_dense())


def test_a_damaged_record_crc_is_a_corrupt_checkpoint_error() -> None:
    """zipfile checks a record's CRC-32 when the bounds check reads data.pkl: a damaged
    one is reported as damage, naming the source (not as zipfile.BadZipFile)."""
    payload = bytearray(_saved({"a": 1}))
    record = zipfile.ZipFile(io.BytesIO(bytes(payload))).getinfo("archive/data.pkl")
    local = record.header_offset  # its local header: name and extra field lengths
    name_len, extra_len = (
        int.from_bytes(payload[local + i : local + i + 2], "little") for i in (26, 28)
    )
    at = local + 30 + name_len + extra_len
    assert payload[at] == 0x80  # data.pkl's PROTO opcode
    payload[at + 2] ^= 0x10  # the opcode after it
    with pytest.raises(CorruptCheckpointError, match=r"ckpt/obj: archive record .*damaged"):
        safe_torch_load(bytes(payload), source="ckpt/obj")


@pytest.mark.parametrize("opcode", [b"\x96", b"\x97", b"\x98"], ids=["bytearray8", "next", "ro"])
def test_buffer_opcodes_in_a_tensor_pickle_never_reach_the_c_unpickler(
    opcode: bytes, capfd: pytest.CaptureFixture[str]
) -> None:
    """A damaged byte that turns into BYTEARRAY8 with a huge length made CPython's
    unpickler print "deallocated bytearray object has exported buffers"; such opcodes
    (never in torch.save's data.pkl) send the item to torch.load instead."""
    archive = _saved(torch.arange(4.0))
    pickled = zipfile.ZipFile(io.BytesIO(archive)).read("archive/data.pkl")
    at = pickled.index(b"X\x07\x00\x00\x00storage")  # BINUNICODE 'storage'
    extra = (1 << 40).to_bytes(8, "little") if opcode == b"\x96" else b""  # its length
    crafted = pickled[:at] + opcode + extra + pickled[at:]
    with pytest.raises(NotFastPath, match="data.pkl"):
        item_reader._tensor_spec(crafted)
    assert "SystemError" not in capfd.readouterr().err


# ----------------------------------------------------------------------------- handed out


def _build_on_rebuild_function(archive: bytes) -> bytes:
    pickled = zipfile.ZipFile(io.BytesIO(archive)).read("archive/data.pkl")
    found = re.search(rb"_rebuild_tensor_v2\n(q.|r....|\x94)", pickled, re.DOTALL)
    assert found is not None
    state = b"}\x8c\x05pwnedK\x01sb"  # BUILD {"pwned": 1} on the function
    return pickled[: found.end()] + state + pickled[found.end() :]


def test_tensor_item_pickle_cannot_set_attributes_on_reader_functions() -> None:
    archive = _saved(torch.arange(4.0))
    crafted = _with_pickle(archive, _build_on_rebuild_function(archive))

    def read_at(offset: int, n: int) -> memoryview:
        return memoryview(crafted)[offset : offset + n]

    with pytest.raises(NotFastPath):
        item_reader.parse_tensor_item(read_at, len(crafted))
    assert not hasattr(item_reader._spec_v2, "pwned")
    assert item_reader._spec_v2.__defaults__ == (None,)


@pytest.mark.parametrize("where", ["planner_data", "storage_meta"])
def test_metadata_never_hands_out_a_class(where: str) -> None:
    metadata = Metadata({})
    setattr(metadata, where, SavePlan)
    with pytest.raises(UnsafeCheckpointError, match="ckpt/.metadata: .*'SavePlan' as data"):
        load_metadata(io.BytesIO(pickle.dumps(metadata)), source="ckpt/.metadata")
    assert "load_id" not in vars(SavePlan)


def test_storage_meta_of_another_type_is_refused(tmp_path: Path) -> None:
    dcp.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, tmp_path)
    raw = (tmp_path / ".metadata").read_bytes()
    metadata = load_metadata(io.BytesIO(raw), source="x")
    metadata.storage_meta = {"load_id": 1}  # type: ignore[assignment]
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    # A crafted file comes with the commit record deleted (it would refuse the file first).
    (tmp_path / "commit.json").unlink(missing_ok=True)
    with pytest.raises(CorruptCheckpointError, match="storage_meta: expected a StorageMeta"):
        dcp.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, tmp_path)


# ----------------------------------------------------------------------------- messages


def _shared_list_pid(levels: int = 64) -> bytes:
    """A persistent id whose repr has 2**levels items (each list holds the previous twice)."""
    out = b"\x80\x04]\x94"
    for i in range(levels):
        out += b"(h" + bytes([i]) + b"h" + bytes([i]) + b"l\x94"
    return out + b"Q."


def test_error_message_of_a_memo_shared_structure_is_bounded() -> None:
    start = time.perf_counter()
    with pytest.raises(UnsafeCheckpointError, match="persistent id"):
        load_metadata(io.BytesIO(_shared_list_pid()), source="ckpt/.metadata")
    assert time.perf_counter() - start < 10
    nested: list[object] = []
    for _ in range(64):
        nested = [nested, nested]
    assert len(short_repr(nested)) <= 200


def test_large_metadata_loads_unchanged_on_the_big_stack_thread() -> None:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from dist_checkpointing.engine.safety import metadata as metadata_module

    entries = {
        f"layer.{i}": TensorStorageMetadata(
            TensorProperties(torch.float32),
            torch.Size((4, 4)),
            [ChunkStorageMetadata(torch.Size((0, 0)), torch.Size((4, 4)))],
        )
        for i in range(3000)
    }
    raw = pickle.dumps(Metadata(entries))
    nesting = sum(map(raw.count, metadata_module._NESTING_OPCODES))
    assert nesting > metadata_module._MAIN_THREAD_LEVELS  # takes the thread
    loaded = load_metadata(io.BytesIO(raw), source="ckpt/.metadata")
    assert loaded.state_dict_metadata == entries
