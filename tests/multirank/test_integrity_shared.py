"""``load(..., verify_integrity=True)`` digests each data file once, on one of the ranks
that read it (``integrity.verify_files_read``), and gives one verdict.

Four ranks save row blocks of three tensors (two data files per rank), then every rank
loads every tensor whole, so every rank reads every data file. Each rank records the
files it digests (``integrity.file_digest`` wrapped in its own process; the collectives
are real). Checked: every data file is digested exactly once over the ranks, file ``i``
of the manifest by rank ``i mod 4``; the values are bit-exact; a damaged file read by
every rank raises on every rank (the digesting rank names the file); a rank that cannot
name its files makes every rank fall back to checking its own and raise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dcp
from dist_checkpointing import ShardedTensor
from dist_checkpointing.engine.checkpoint import integrity
from dist_checkpointing.engine.checkpoint.integrity import INTEGRITY_FNAME
from dist_checkpointing.engine.collectives import RankGroup
from dist_checkpointing.engine.storage.location import CheckpointDir
from dist_checkpointing.errors import CheckpointingException
from dist_checkpointing.serialization import verify_checkpoint_and_load_strategy
from tests.support.digests import recording_digests
from tests.support.harness import run_distributed
from tests.support.layouts import same_bits

pytestmark = pytest.mark.timeout(180)

KEYS = ("a", "b", "c")
LAYOUTS = [("torch_dist", 1), ("raw_bytes", 1)]


def _full(key: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(16, 5, generator=gen)


def _save(ckpt: str, layout: tuple[str, int]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    sd = {
        k: ShardedTensor.from_rank_offsets(k, _full(k).chunk(world)[rank].clone(), (0, rank, world))
        for k in KEYS
    }
    dcp.save(sd, ckpt, layout, verify_integrity=True)


def _whole() -> dict[str, ShardedTensor]:
    """Every tensor whole, on every rank (replicas of one another)."""
    rank = dist.get_rank()
    return {
        k: ShardedTensor.from_rank_offsets(k, torch.zeros(16, 5), replica_id=rank) for k in KEYS
    }


def _data_files(ckpt: str) -> set[str]:
    sharded, _ = verify_checkpoint_and_load_strategy(ckpt)
    return set(sharded.files_holding(ckpt, set(KEYS)))


def _load_whole(ckpt: str, layout: tuple[str, int]) -> dict[str, Any]:
    _save(ckpt, layout)
    seen = recording_digests()
    out = dcp.load(_whole(), ckpt, validate_access_integrity=False, verify_integrity=True)
    assert isinstance(out, dict)
    data = _data_files(ckpt)
    return {
        "digested": [n for n in seen if n in data],
        "others": sorted({n for n in seen if n not in data}),
        "data": sorted(data),
        "exact": all(same_bits(out[k], _full(k)) for k in KEYS),
    }


@pytest.mark.parametrize("layout", LAYOUTS, ids=[b for b, _ in LAYOUTS])
def test_each_data_file_is_digested_once_by_one_of_its_readers(
    tmp_path: Path, layout: tuple[str, int]
) -> None:
    out = run_distributed(_load_whole, 4, str(tmp_path), layout, timeout=150)
    assert all(r["exact"] for r in out)
    data = out[0]["data"]
    assert len(data) >= 8, data  # at least two files per rank, every one read by every rank
    digested = [name for r in out for name in r["digested"]]
    assert sorted(digested) == data  # each exactly once
    listed = sorted(json.loads((tmp_path / INTEGRITY_FNAME).read_text())["files"])
    for rank, r in enumerate(out):  # file i of the manifest by rank i mod world
        assert sorted(r["digested"]) == [n for n in data if listed.index(n) % 4 == rank]
        # The metadata and the common state: every rank, before it unpickles them.
        assert r["others"] == out[0]["others"] and "common.pt" in r["others"]


def _damaged_read_by_all(ckpt: str, layout: tuple[str, int]) -> str:
    _save(ckpt, layout)
    dist.barrier()
    data = sorted(_data_files(ckpt))
    victim = data[len(data) // 2]
    if dist.get_rank() == 0:
        path = Path(ckpt) / victim
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        path.write_bytes(bytes(raw))
    dist.barrier()
    try:
        dcp.load(_whole(), ckpt, validate_access_integrity=False, verify_integrity=True)
    except Exception as exc:  # noqa: BLE001 - compared below
        return f"{victim}|{type(exc).__name__}: {exc}"
    return f"{victim}|loaded"


@pytest.mark.parametrize("layout", LAYOUTS, ids=[b for b, _ in LAYOUTS])
def test_a_damaged_file_read_by_every_rank_raises_on_every_rank(
    tmp_path: Path, layout: tuple[str, int]
) -> None:
    out = run_distributed(_damaged_read_by_all, 4, str(tmp_path), layout, timeout=150)
    victim = out[0].split("|")[0]
    errors = [o.split("|", 1)[1] for o in out]
    corrupt = [i for i, e in enumerate(errors) if e.startswith("CorruptCheckpointError")]
    assert len(corrupt) == 1, errors  # digested once: one rank found it
    assert victim in errors[corrupt[0]] and "sha256" in errors[corrupt[0]]
    for i, e in enumerate(errors):
        if i != corrupt[0]:
            assert e.startswith("RankFailureError"), errors
            assert f"rank {corrupt[0]}" in e and victim in e, e


def _one_rank_cannot_name_files(ckpt: str) -> str:
    _save(ckpt, LAYOUTS[0])
    group = RankGroup()

    def files_read() -> list[str]:
        if group.rank == 2:
            raise OSError("cannot list the files of rank 2's keys")
        return sorted(_data_files(ckpt))

    seen = recording_digests()
    try:
        integrity.verify_files_read(CheckpointDir.of(ckpt), files_read, group)
    except Exception as exc:  # noqa: BLE001 - compared below
        return f"{type(exc).__name__}: {exc}|{len(seen)}"
    return "passed"


def test_a_rank_that_cannot_name_its_files_fails_every_rank(tmp_path: Path) -> None:
    """No shared plan without every rank's list: the others check their own files (all
    of them here) and every rank raises, none waits."""
    out = run_distributed(_one_rank_cannot_name_files, 4, str(tmp_path), timeout=150)
    assert out[2].startswith("OSError") and out[2].endswith("|0"), out
    for i in (0, 1, 3):
        message, digested = out[i].rsplit("|", 1)
        assert message.startswith("RankFailureError") and "rank 2" in message, out
        assert int(digested) >= 8  # fell back to its own files: every data file


def test_one_process_checks_every_file_it_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd = {k: ShardedTensor.from_rank_offsets(k, _full(k)) for k in KEYS}
    dcp.save(sd, tmp_path, verify_integrity=True)
    seen: list[str] = []
    digest = integrity.file_digest
    monkeypatch.setattr(integrity, "file_digest", lambda c, n: seen.append(n) or digest(c, n))
    names = sorted(_data_files(str(tmp_path)))
    integrity.verify_files_read(CheckpointDir.of(tmp_path), lambda: names, RankGroup())
    assert sorted(seen) == names
    (tmp_path / INTEGRITY_FNAME).unlink()
    with pytest.raises(CheckpointingException, match=INTEGRITY_FNAME):
        integrity.verify_files_read(CheckpointDir.of(tmp_path), lambda: names, RankGroup())
