"""The ``raw_bytes`` layout end to end: files, damage, the metadata API, the CLI.

(Round trips, resharding, strict keys and async saves are in
``test_strategy_conformance.py``, shared with ``torch_dist``.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.cli import main as cli_main
from dist_checkpointing.engine.raw.index import INDEX_NAME
from dist_checkpointing.engine.raw.load import read_index
from dist_checkpointing.engine.storage.location import CheckpointDir
from dist_checkpointing.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    RankFailureError,
)
from dist_checkpointing.serialization import get_default_save_sharded_strategy
from dist_checkpointing.strategies.raw_bytes import RawBytesSaveShardedStrategy
from tests.support.harness import run_distributed
from tests.support.layouts import pack, same_bits, unpack

pytestmark = pytest.mark.timeout(120)

RAW = ("raw_bytes", 1)


def _full(key: str, shape: tuple[int, ...] = (8, 6), dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(len(key) * 7919 + sum(map(ord, key)))
    return (torch.randn(shape, generator=gen) * 10).to(dtype)


def _state(rank: int, world: int) -> dict[str, Any]:
    """Rank ``rank``'s rows of a few tensors (axis 0), a flat range and an object."""
    sd: dict[str, Any] = {"common": {"lr": 0.5}}
    for key in ("model.w", "model.b", "opt.m"):
        full = _full(key)
        rows = full.shape[0] // world
        local = full[rank * rows : (rank + 1) * rows].clone()
        sd[key] = ShardedTensor.from_rank_offsets(key, local, (0, rank, world))
    flat = _full("opt.flat").reshape(-1)
    per = flat.numel() // world
    sd["opt.flat"] = ShardedTensor.from_rank_offsets_flat(
        "opt.flat",
        flat[rank * per : (rank + 1) * per].clone(),
        (8, 6),
        flattened_range=slice(rank * per, (rank + 1) * per),
    )
    sd["rng"] = ShardedObject("rng", {"rank": rank}, (world,), (rank,))
    return sd


def _save(ckpt: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dc.save(_state(rank, world), ckpt, get_default_save_sharded_strategy(*RAW))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = tmp_path_factory.mktemp("raw") / "ckpt"
    ckpt.mkdir()
    run_distributed(_save, 2, ckpt)
    return ckpt


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for name in os.listdir(src):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def _request(world: int = 1, rank: int = 0) -> dict[str, Any]:
    sd = _state(rank, world)
    for leaf in sd.values():
        if isinstance(leaf, ShardedTensor):
            leaf.data = torch.full_like(leaf.data, -1)
    if world == 1:  # both of the saved object's shards (the 2-rank checkpoint's)
        sd["rng"] = [ShardedObject("rng", None, (2,), (r,)) for r in range(2)]
    else:
        sd["rng"] = ShardedObject("rng", None, (2,), (rank,))
    return sd


def test_files_of_a_raw_bytes_checkpoint(saved: Path) -> None:
    names = set(os.listdir(saved))
    assert {INDEX_NAME, "metadata.json", "commit.json", "common.pt"} <= names
    assert {"__0_0.dcpraw", "__1_0.dcpraw"} <= names
    assert not any(n.endswith(".distcp") or n == ".metadata" for n in names)


def test_plain_tensors_and_metadata(saved: Path) -> None:
    plain = dc.load_plain_tensors(saved)
    for key in ("model.w", "model.b", "opt.m"):
        assert same_bits(plain[key], _full(key))
    assert same_bits(plain["opt.flat"], _full("opt.flat").reshape(-1))
    meta = dc.load_tensors_metadata(saved)
    assert meta["model.w"].global_shape == (8, 6) and meta["model.w"].dtype == torch.float32
    assert meta["opt.flat"].flattened_range == slice(0, 48)
    sharded = dc.load_sharded_metadata(saved)
    assert {"rng/shard_0_2", "rng/shard_1_2"} <= set(sharded)
    assert dc.load_common_state_dict(saved)["common"] == {"lr": 0.5}


def test_one_rank_loads_the_two_rank_checkpoint(saved: Path) -> None:
    request = {k: ShardedTensor.from_rank_offsets(k, torch.zeros(8, 6)) for k in ("model.w",)}
    request["obj"] = ShardedObject("rng", None, (2,), (1,))
    out = dc.load(request, saved, validate_access_integrity=False)
    assert same_bits(out["model.w"], _full("model.w"))
    assert out["obj"] == {"rank": 1}


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("thread", ["1", "0"], ids=["hashing-thread", "inline"])
def test_flipped_bit_names_key_file_and_offset(
    saved: Path, tmp_path: Path, thread: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DIST_CKPT_CHECKSUM_THREAD", thread)
    ckpt = _copy(saved, tmp_path / "c")
    index = read_index(CheckpointDir.of(ckpt))
    row = index.rows_by_key["model.b"][0]
    name = index.files[index.columns["file"][row]]
    offset = index.columns["offset"][row]
    _flip(ckpt / name, offset + 5)
    with pytest.raises(ChecksumMismatchError) as info:
        dc.load(_request(), ckpt)
    err = info.value
    assert err.key == "model.b" and err.file.endswith(name) and err.offset == offset
    assert "model.b" in str(err) and name in str(err)
    report = dc.verify(ckpt, raise_on_error=False)
    assert any(name in p and "checksum mismatch" in p for p in report.problems)
    # Without verification the load goes through (the damage is in the values).
    dc.load(_request(), ckpt, verify_checksums=False)


def test_truncated_data_file_names_key_and_file(saved: Path, tmp_path: Path) -> None:
    ckpt = _copy(saved, tmp_path / "c")
    data = (ckpt / "__1_0.dcpraw").read_bytes()
    (ckpt / "__1_0.dcpraw").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match=r"__1_0\.dcpraw.*truncated|truncated") as info:
        dc.load(_request(), ckpt, verify_checksums=False)
    assert "__1_0.dcpraw" in str(info.value)
    with pytest.raises(CorruptCheckpointError, match="__1_0.dcpraw"):
        dc.verify(ckpt)


def test_missing_data_file_names_it(saved: Path, tmp_path: Path) -> None:
    ckpt = _copy(saved, tmp_path / "c")
    (ckpt / "__0_0.dcpraw").unlink()
    with pytest.raises(CorruptCheckpointError, match="__0_0.dcpraw"):
        dc.load(_request(), ckpt, verify_checksums=False)


def test_tampered_index_is_refused(saved: Path, tmp_path: Path) -> None:
    ckpt = _copy(saved, tmp_path / "c")
    _flip(ckpt / INDEX_NAME, os.path.getsize(ckpt / INDEX_NAME) - 3)
    with pytest.raises(CorruptCheckpointError, match="raw_index"):
        dc.load(_request(), ckpt)


def test_remove_sharded_tensors(saved: Path, tmp_path: Path) -> None:
    ckpt = _copy(saved, tmp_path / "c")
    dc.remove_sharded_tensors(ckpt, "opt.")
    assert set(dc.load_tensors_metadata(ckpt)) == {"model.w", "model.b"}
    plain = dc.load_plain_tensors(ckpt)
    assert same_bits(plain["model.w"], _full("model.w"))
    assert dc.verify(ckpt).ok


def test_cli_converts_both_ways(saved: Path, tmp_path: Path, capsys: Any) -> None:
    to_dist, back = tmp_path / "td", tmp_path / "rb"
    assert cli_main(["convert", str(saved), str(to_dist), "--to", "torch_dist"]) == 0
    assert (to_dist / ".metadata").exists() and not (to_dist / INDEX_NAME).exists()
    assert cli_main(["convert", str(to_dist), str(back), "--to", "raw_bytes"]) == 0
    assert (back / INDEX_NAME).exists()
    for ckpt in (to_dist, back):
        plain = dc.load_plain_tensors(ckpt)
        for key in ("model.w", "model.b", "opt.m"):
            assert same_bits(plain[key], _full(key)), (ckpt, key)
        assert same_bits(plain["opt.flat"], _full("opt.flat").reshape(-1))
        assert dc.load_common_state_dict(ckpt)["common"] == {"lr": 0.5}
        objects = dc.load({"rng": [ShardedObject("rng", None, (2,), (r,)) for r in (0, 1)]}, ckpt)
        assert objects["rng"] == [{"rank": 0}, {"rank": 1}]
    capsys.readouterr()
    assert cli_main(["inspect", str(back)]) == 0
    out = capsys.readouterr().out
    assert "raw_bytes v1" in out and "model.w" in out and "rng/shard_0_2" in out
    assert cli_main(["verify", str(back)]) == 0
    assert cli_main(["diff", str(saved), str(to_dist), "--values"]) == 0


def _failing_load(ckpt: Path) -> tuple[str, str]:
    rank = dist.get_rank()
    request = _request(2, rank)
    del request["rng"]
    try:
        dc.load(request, ckpt)
    except Exception as exc:  # noqa: BLE001 - returned for the assertion
        return type(exc).__name__, str(exc)
    return "", ""


def test_damage_seen_by_one_rank_raises_on_both(saved: Path, tmp_path: Path) -> None:
    ckpt = _copy(saved, tmp_path / "c")
    index = read_index(CheckpointDir.of(ckpt))
    row = index.rows_by_key["opt.m"][1]  # rank 1's rows: only rank 1 reads them
    name = index.files[index.columns["file"][row]]
    _flip(ckpt / name, index.columns["offset"][row])
    results = run_distributed(_failing_load, 2, ckpt)
    assert results[1][0] == ChecksumMismatchError.__name__
    assert results[0][0] == RankFailureError.__name__ and "opt.m" in results[0][1]


def _load_packed(ckpt: Path) -> bytes:
    return pack(dc.load(_request(2, dist.get_rank()), ckpt))


def test_two_ranks_load_their_own_rows(saved: Path) -> None:
    for rank, packed in enumerate(run_distributed(_load_packed, 2, saved)):
        loaded = unpack(packed)
        expected = _state(rank, 2)
        for key in ("model.w", "model.b", "opt.m", "opt.flat"):
            assert same_bits(loaded[key], expected[key].data), (rank, key)


def _one_rank_state(scale: float) -> dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets("w", _full("w") * scale),
        "o": ShardedObject("o", {"scale": scale}, (1,), (0,)),
    }


def test_layouts_replace_each_other_in_one_directory(tmp_path: Path) -> None:
    """A save in one layout over a checkpoint of the other commits, then deletes the
    other layout's files; each load finds its layout in metadata.json."""
    dc.save(_one_rank_state(1.0), tmp_path)
    assert (tmp_path / ".metadata").exists()
    dc.save(_one_rank_state(2.0), tmp_path, get_default_save_sharded_strategy(*RAW))
    names = set(os.listdir(tmp_path))
    assert INDEX_NAME in names and ".metadata" not in names
    assert not any(n.endswith(".distcp") for n in names), names
    loaded = dc.load(_one_rank_state(0.0), tmp_path)
    assert same_bits(loaded["w"], _full("w") * 2.0) and loaded["o"] == {"scale": 2.0}
    dc.save(_one_rank_state(3.0), tmp_path)
    names = set(os.listdir(tmp_path))
    assert ".metadata" in names and INDEX_NAME not in names
    assert not any(n.endswith(".dcpraw") for n in names), names
    assert same_bits(dc.load(_one_rank_state(0.0), tmp_path)["w"], _full("w") * 3.0)


def test_integrity_manifest_covers_raw_files(tmp_path: Path) -> None:
    dc.save(
        _one_rank_state(1.0),
        tmp_path,
        get_default_save_sharded_strategy(*RAW),
        verify_integrity=True,
    )
    manifest = (tmp_path / "integrity.json").read_text()
    assert INDEX_NAME in manifest and "__0_0.dcpraw" in manifest
    assert dc.load(_one_rank_state(0.0), tmp_path, verify_integrity=True)["o"] == {"scale": 1.0}


@pytest.mark.parametrize("thread", ["1", "0"], ids=["hashing-thread", "inline"])
def test_large_items_are_written_and_verified_in_pieces(
    tmp_path: Path, thread: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Items above the piece sizes (8 MiB written, 16 MiB read) between small ones in one
    file: byte-exact, and a flipped bit deep inside names the offset of its block; with
    damage in several items, the first one in the file is named."""
    monkeypatch.setenv("DIST_CKPT_CHECKSUM_THREAD", thread)
    big = torch.arange(5 << 20, dtype=torch.float32)  # 20 MiB
    small = torch.arange(3, dtype=torch.float32)
    sd = {
        "a": ShardedTensor.from_rank_offsets("a", small.clone()),
        "big": ShardedTensor.from_rank_offsets("big", big),
        "z": ShardedTensor.from_rank_offsets("z", small + 1),
    }
    # One data file: a strategy of its own (the registered default is shared by every test).
    dc.save(sd, tmp_path, RawBytesSaveShardedStrategy(thread_count=1))
    request = {
        k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v.data)) for k, v in sd.items()
    }
    out = dc.load(request, tmp_path)
    assert all(same_bits(out[k], sd[k].data) for k in sd)
    index = read_index(CheckpointDir.of(tmp_path))
    row = index.rows_by_key["big"][0]
    start = index.columns["offset"][row]
    _flip(tmp_path / "__0_0.dcpraw", start + (17 << 20) + 3)
    request = {
        k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v.data)) for k, v in sd.items()
    }
    with pytest.raises(ChecksumMismatchError) as info:
        dc.load(request, tmp_path)
    assert info.value.key == "big" and info.value.offset == start + (17 << 20)

    def offset(key: str) -> int:
        return int(index.columns["offset"][index.rows_by_key[key][0]])

    damaged = ["big"]
    for key in ("z", "a"):  # the small items, read in batches around the large one
        _flip(tmp_path / "__0_0.dcpraw", offset(key) + 1)
        damaged.append(key)
        with pytest.raises(ChecksumMismatchError) as info:
            dc.load(request, tmp_path)
        assert info.value.key == min(damaged, key=offset)


def _mixed_state() -> dict[str, Any]:
    """Items of one 4 KiB checksum block or less, some of several blocks between them, and
    one over 1 MiB (read piece by piece, checked on the hashing thread if there is one)."""
    sizes = {"s0": 64, "L0": 300_000, "s1": 1000, "m0": 3000}
    sizes |= {"L1": 300_000, "s2": 10, "m1": 5000, "s3": 1024}
    return {
        k: ShardedTensor.from_rank_offsets(k, _full(k, (n,)), (0, 0, 1)) for k, n in sizes.items()
    }


@pytest.mark.parametrize("thread", ["1", "0"], ids=["hashing-thread", "inline"])
def test_a_batch_of_small_and_large_items_names_its_first_damaged_one(
    tmp_path: Path, thread: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small items are checked together; the error still names the first damaged item
    of the file, whether small or of several blocks, and each damage alone is found."""
    monkeypatch.setenv("DIST_CKPT_CHECKSUM_BLOCK_BYTES", "4096")
    monkeypatch.setenv("DIST_CKPT_CHECKSUM_THREAD", thread)
    saved = tmp_path / "saved"
    saved.mkdir()
    dc.save(_mixed_state(), saved, get_default_save_sharded_strategy(*RAW))
    index = read_index(CheckpointDir.of(saved))
    assert index.block_bytes == 4096
    where = {}
    for key in _mixed_state():
        row = index.rows_by_key[key][0]
        where[key] = (index.files[index.columns["file"][row]], index.columns["offset"][row])

    def request() -> dict[str, Any]:
        return {
            k: ShardedTensor.from_rank_offsets(k, torch.full_like(v.data, -1), (0, 0, 1))
            for k, v in _mixed_state().items()
        }

    loaded = dc.load(request(), saved)
    assert all(same_bits(loaded[k], v.data) for k, v in _mixed_state().items())
    cases = (["s2"], ["m1"], ["L1"], ["L0", "s1"], ["L0", "m0"], ["s0", "L0"], ["m1", "s3"])
    for n, damaged in enumerate(cases + (["s3", "L1"], ["s1", "m0"])):
        ckpt = _copy(saved, tmp_path / f"c{n}")
        for key in damaged:
            name, offset = where[key]
            _flip(ckpt / name, offset if key.startswith("s") else offset + 4097)
        first = min(damaged, key=lambda k: where[k])  # by file, then offset
        with pytest.raises(ChecksumMismatchError) as info:
            dc.load(request(), ckpt)
        assert info.value.key == first, (damaged, info.value)
        assert info.value.file.endswith(where[first][0])
