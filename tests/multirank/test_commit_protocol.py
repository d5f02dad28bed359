"""The commit protocol, checksums and save identity (issue: trustworthy checkpoints).

Real gloo process groups; faults are injected through the writer's hook
(``FileSystemWriterAsync.write_preloaded_data``), by killing a rank's process, or by
editing files between save and load. Every test checks that nothing committed is
lost and that errors name what failed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dcp
from dist_checkpointing import ShardedTensor
from dist_checkpointing.engine.checkpoint import integrity
from dist_checkpointing.engine.checkpoint.lock import LOCK_NAME
from dist_checkpointing.errors import (
    CheckpointingException,
    ConcurrentSaveError,
    IncompleteCheckpointError,
    RankFailureError,
    UnsafeCheckpointError,
)
from dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from tests.support.faults import save_interrupted_after_record
from tests.support.harness import DistributedTestError, run_distributed

ROWS, COLS = 8, 6


def _full(key: str, version: int) -> torch.Tensor:
    seed = sum(map(ord, key)) + 1000 * version
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 0.5 + seed


def _state(version: int, keys: tuple[str, ...] = ("w", "v")) -> dict[str, Any]:
    """Each rank holds its row block of every key (TP-like), plus common state."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = ROWS // world
    sd: dict[str, Any] = {
        k: ShardedTensor.from_rank_offsets(
            k, _full(k, version)[rank * rows : (rank + 1) * rows].clone(), (0, rank, world)
        )
        for k in keys
    }
    sd["step"] = version
    return sd


def _request(keys: tuple[str, ...] = ("w", "v")) -> dict[str, Any]:
    return {
        k: ShardedTensor.from_rank_offsets(k, torch.zeros(ROWS, COLS), replica_id=dist.get_rank())
        for k in keys
    }


def _load_all(ckpt: Path, **kwargs: Any) -> dict[str, Any]:
    out = dcp.load(_request(), ckpt, validate_access_integrity=False, **kwargs)
    assert isinstance(out, dict)
    return out


def _check_version(ckpt: Path, version: int) -> None:
    out = _load_all(ckpt)
    assert out["step"] == version
    for key in ("w", "v"):
        assert torch.equal(out[key], _full(key, version)), key


# ----------------------------------------------------------------------------- failed saves


def _failing_overwrite(ckpt: Path) -> str:
    dcp.save(_state(1), ckpt)

    def fail_on_rank1(bucket: Any, fs: Any, sync: bool) -> Any:
        if dist.get_rank() == 1:
            raise OSError(28, "No space left on device (injected)")
        from dist_checkpointing.engine.storage.write_workers import write_bucket_file

        return write_bucket_file(bucket, fs, sync)

    original = FileSystemWriterAsync.write_preloaded_data
    FileSystemWriterAsync.write_preloaded_data = staticmethod(fail_on_rank1)  # type: ignore[method-assign]
    try:
        with pytest.raises(CheckpointingException) as info:
            dcp.save(_state(2), ckpt)
    finally:
        FileSystemWriterAsync.write_preloaded_data = original  # type: ignore[method-assign]
    _check_version(ckpt, 1)  # the old checkpoint still loads bit-exactly
    dcp.save(_state(3), ckpt)  # the next save cleans up and commits
    _check_version(ckpt, 3)
    return str(info.value)


def test_failed_save_over_a_checkpoint_keeps_it(tmp_path: Path) -> None:
    messages = run_distributed(_failing_overwrite, 2, tmp_path, timeout=120.0)
    assert all("No space left" in m for m in messages), messages
    names = set(os.listdir(tmp_path))
    # Exactly the last checkpoint: no leftovers of the failed save or of version 1.
    record = json.loads((tmp_path / "commit.json").read_text())
    assert names == set(record["files"]) | set(record["data_files"]) | {"commit.json"}, names
    assert not any(n.endswith(".pending") for n in names)


def _save_then_die(ckpt: Path) -> None:
    dcp.save(_state(1), ckpt)

    def die(bucket: Any, fs: Any, sync: bool) -> Any:
        if dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # the whole rank, mid-write
        time.sleep(30)  # rank 1 is killed by the harness with it

    FileSystemWriterAsync.write_preloaded_data = staticmethod(die)  # type: ignore[method-assign]
    dcp.save(_state(2), ckpt)


def _load_and_resave(ckpt: Path) -> None:
    _check_version(ckpt, 1)
    dcp.save(_state(4), ckpt)
    _check_version(ckpt, 4)


def test_rank_killed_mid_save_loses_nothing(tmp_path: Path) -> None:
    with pytest.raises(DistributedTestError):
        run_distributed(_save_then_die, 2, tmp_path, timeout=60.0)
    names = os.listdir(tmp_path)
    assert LOCK_NAME in names  # left by the dead coordinator: stale
    run_distributed(_load_and_resave, 2, tmp_path, timeout=120.0)
    assert LOCK_NAME not in os.listdir(tmp_path)


def _interrupted_install(ckpt: Path) -> None:
    dcp.save(_state(1), ckpt)
    save_interrupted_after_record(lambda: dcp.save(_state(2), ckpt))
    dist.barrier()
    # The record committed version 2; its staged files are read in place ...
    _check_version(ckpt, 2)
    # ... and the next save finishes the renames before its own.
    dcp.save(_state(3), ckpt)
    _check_version(ckpt, 3)


def test_commit_interrupted_after_the_record_rolls_forward(tmp_path: Path) -> None:
    run_distributed(_interrupted_install, 2, tmp_path, timeout=120.0)
    assert not any(n.endswith(".pending") for n in os.listdir(tmp_path))


# ----------------------------------------------------------------------------- concurrency


def _slow_save(ckpt: Path, version: int, started: str | None) -> str:
    def slow(bucket: Any, fs: Any, sync: bool) -> Any:
        if started:
            Path(started).touch()
        time.sleep(4)
        from dist_checkpointing.engine.storage.write_workers import write_bucket_file

        return write_bucket_file(bucket, fs, sync)

    if started:
        FileSystemWriterAsync.write_preloaded_data = staticmethod(slow)  # type: ignore[method-assign]
    try:
        dcp.save(_state(version), ckpt)
    except ConcurrentSaveError as exc:
        return f"ConcurrentSaveError: {exc}"
    except RankFailureError as exc:
        return f"RankFailureError: {exc}"
    return "saved"


def test_two_jobs_saving_at_once_one_wins(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    started = tmp_path / "a_started"
    results: dict[str, Any] = {}

    def job_a() -> None:
        results["a"] = run_distributed(_slow_save, 2, ckpt, 1, str(started), timeout=120.0)

    thread = threading.Thread(target=job_a)
    thread.start()
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    results["b"] = run_distributed(_slow_save, 2, ckpt, 2, None, timeout=120.0)
    thread.join()
    assert results["a"] == ["saved", "saved"]
    assert all(r.startswith(("ConcurrentSaveError", "RankFailureError")) for r in results["b"])
    assert "another save is writing" in results["b"][0]
    run_distributed(_check_version, 2, ckpt, 1, timeout=60.0)  # exactly the winner's


# ----------------------------------------------------------------------------- checksums


def _save_v1(ckpt: Path) -> None:
    dcp.save(_state(1), ckpt)


def _save_version(ckpt: Path, version: int) -> None:
    dcp.save(_state(version), ckpt)


def _load_expect(ckpt: Path, verify: bool | None) -> str:
    try:
        _load_all(ckpt, verify_checksums=verify)
    except CheckpointingException as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def _item_location(ckpt: Path, key: str) -> tuple[str, int, int]:
    from dist_checkpointing.engine.storage.reader import FileSystemReader

    md = FileSystemReader(str(ckpt)).read_metadata()
    for index, info in md.storage_data.items():
        if index.fqn == key and (index.offset is None or index.offset[0] == 0):
            return info.relative_path, info.offset, info.length
    raise AssertionError(key)


def test_flipped_bit_fails_the_load_on_every_rank(tmp_path: Path) -> None:
    run_distributed(_save_v1, 2, tmp_path, timeout=60.0)
    name, offset, length = _item_location(tmp_path, "v")
    path = tmp_path / name
    data = bytearray(path.read_bytes())
    data[offset + length - 200] ^= 0x10
    path.write_bytes(bytes(data))
    results = run_distributed(_load_expect, 2, tmp_path, None, timeout=60.0)
    for r in results:
        assert r.startswith(("ChecksumMismatchError", "RankFailureError")), r
        assert name in r and "'v'" in r, r
    assert any(r.startswith("ChecksumMismatchError") for r in results)
    # Turned off, the damage goes through (as with Megatron-Core or plain DCP).
    assert run_distributed(_load_expect, 2, tmp_path, False, timeout=60.0) == ["loaded"] * 2
    report = run_distributed(dcp.verify, 2, tmp_path, None, raise_on_error=False, timeout=60.0)
    assert report[0].problems == report[1].problems and len(report[0].problems) == 1
    assert name in report[0].problems[0]


def test_metadata_from_another_save_is_refused(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    run_distributed(_save_v1, 2, first, timeout=60.0)
    run_distributed(_save_version, 2, second, 2, timeout=60.0)  # same structure, another save
    # (metadata.json of either save is byte-identical: nothing to tell apart, nothing wrong.)
    for name in (".metadata", "common.pt"):
        victim = tmp_path / f"victim-{name}"
        shutil.copytree(first, victim)
        shutil.copy(second / name, victim / name)
        results = run_distributed(_load_expect, 2, victim, None, timeout=60.0)
        for r in results:
            assert "ForeignFileError" in r or "RankFailureError" in r, (name, r)
            assert name in r and "another save" in r, (name, r)


def test_truncated_and_missing_files(tmp_path: Path) -> None:
    run_distributed(_save_v1, 2, tmp_path, timeout=60.0)
    name, _, _ = _item_location(tmp_path, "w")
    path = tmp_path / name
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointingException, match="truncated"):
        dcp.verify(tmp_path)
    path.unlink()
    with pytest.raises(IncompleteCheckpointError, match=name):
        dcp.verify(tmp_path)
    (tmp_path / "common.pt").unlink()
    results = run_distributed(_load_expect, 2, tmp_path, None, timeout=60.0)
    assert all("common.pt" in r and "missing" in r for r in results), results


def test_megatron_checkpoint_verifies_as_unavailable(tmp_path: Path) -> None:
    golden = Path(__file__).parents[1] / "data" / "golden" / "mcore-0.19.2" / "tp2_basic"
    report = dcp.verify(golden / "checkpoint")
    assert report.ok and report.checksums == "unavailable" and report.save_id is None


def test_verify_splits_the_work_over_ranks(tmp_path: Path) -> None:
    run_distributed(_save_v1, 2, tmp_path, timeout=60.0)
    reports = run_distributed(dcp.verify, 2, tmp_path, timeout=60.0)
    single = dcp.verify(tmp_path)
    assert reports[0] == reports[1]
    assert reports[0].files_checked == single.files_checked == len(os.listdir(tmp_path)) - 1
    assert reports[0].bytes_checked == single.bytes_checked > 0


def _verify_where_one_rank_cannot_see_it(ckpt: Path) -> str:
    """Rank 1 is given a directory it cannot find (a node without the shared mount):
    every rank must raise, none wait in the gather of the shares."""
    path = ckpt if dist.get_rank() == 0 else ckpt.parent / "not-mounted"
    try:
        dcp.verify(path)
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(exc).__name__}: {exc}"
    return "verified"


def test_verify_failing_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    run_distributed(_save_v1, 2, tmp_path, timeout=60.0)
    results = run_distributed(_verify_where_one_rank_cannot_see_it, 2, tmp_path, timeout=60.0)
    assert results[0].startswith("RankFailureError") and "rank 1" in results[0], results
    assert "not-mounted" in results[0] and "not-mounted" in results[1], results


def _corrupt_and_load(ckpt: Path) -> str:
    try:
        out = _load_all(ckpt)
    except CheckpointingException as exc:
        return f"error: {type(exc).__name__}"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"FOREIGN {type(exc).__name__}: {exc}"
    same = all(torch.equal(out[k], _full(k, 1)) for k in ("w", "v")) and out["step"] == 1
    return "exact" if same else "WRONG VALUES"


def test_random_corruption_never_loads_wrong_values(tmp_path: Path) -> None:
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    pristine = tmp_path / "pristine"
    pristine.mkdir()
    run_distributed(_save_v1, 1, pristine, timeout=60.0)
    files = sorted(n for n in os.listdir(pristine) if n != LOCK_NAME)
    counter = [0]

    @hypothesis.settings(max_examples=20, deadline=None, derandomize=True)
    @hypothesis.given(
        st.sampled_from(files), st.floats(0, 1), st.integers(1, 64), st.integers(0, 255)
    )
    def check(name: str, where: float, n: int, value: int) -> None:
        counter[0] += 1
        victim = tmp_path / f"v{counter[0]}"
        shutil.copytree(pristine, victim)
        data = bytearray((victim / name).read_bytes())
        at = int(where * max(len(data) - 1, 0))
        data[at : at + n] = bytes([value]) * len(data[at : at + n])
        (victim / name).write_bytes(bytes(data))
        (result,) = run_distributed(_corrupt_and_load, 1, victim, timeout=60.0)
        assert result == "exact" or result.startswith("error: "), (name, at, n, result)
        shutil.rmtree(victim)

    check()


# ----------------------------------------------------------------------------- more faults


def _disk_full_overwrite(ckpt: Path) -> str:
    import resource

    dcp.save(_state(1), ckpt)
    big = {"w": _state(2)["w"], "v": _state(2)["v"]}
    big["big"] = ShardedTensor.from_rank_offsets(
        "big", torch.ones(64 * 1024), replica_id=dist.get_rank()
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        with pytest.raises(CheckpointingException) as info:
            dcp.save(big, ckpt)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    _check_version(ckpt, 1)
    return str(info.value)


def test_disk_full_during_overwrite_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    messages = run_distributed(_disk_full_overwrite, 2, tmp_path, timeout=120.0)
    assert any("file size limit" in m or "File too large" in m for m in messages), messages


def _async_failure_then_save(ckpt: Path) -> str:
    from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    dcp.save(_state(1), ckpt)

    def fail(bucket: Any, fs: Any, sync: bool) -> Any:
        raise OSError("injected async write failure")

    original = FileSystemWriterAsync.write_preloaded_data
    FileSystemWriterAsync.write_preloaded_data = staticmethod(fail)  # type: ignore[method-assign]
    queue = AsyncCallsQueue()
    try:
        request = dcp.save(_state(2), ckpt, async_sharded_save=True)
        assert request is not None
        queue.schedule_async_request(request)
        with pytest.raises(CheckpointingException) as info:
            queue.maybe_finalize_async_calls(blocking=True)
    finally:
        FileSystemWriterAsync.write_preloaded_data = original  # type: ignore[method-assign]
        queue.close()
    del request
    _check_version(ckpt, 1)
    dcp.save(_state(3), ckpt)  # the failed save's lock is stale: taken over
    _check_version(ckpt, 3)
    return str(info.value)


def test_failed_async_save_then_a_new_save(tmp_path: Path) -> None:
    messages = run_distributed(_async_failure_then_save, 2, tmp_path, timeout=120.0)
    assert all("injected async write failure" in m for m in messages), messages


STEPS = ["atomic_write", "rename", "remove"]


@pytest.mark.parametrize("fail_at", range(6))
def test_remove_sharded_tensors_interrupted_at_any_step(
    tmp_path: Path, fail_at: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dist_checkpointing.engine.storage.local import LocalFileSystem

    sd = {k: ShardedTensor.from_rank_offsets(k, _full(k, 1)) for k in ("model.w", "opt.m", "opt.v")}
    dcp.save(sd, tmp_path, sharded_strategy=_hinted_strategy())  # opt.* in files of their own
    calls: list[str] = []

    def counting(name: str) -> Any:
        real = getattr(LocalFileSystem, name)

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(f"{name} {os.path.basename(str(args[0]))}")
            if len(calls) - 1 == fail_at:
                raise OSError(f"injected crash at step {fail_at} ({calls[-1]})")
            return real(self, *args, **kwargs)

        return wrapper

    for name in STEPS:
        monkeypatch.setattr(LocalFileSystem, name, counting(name))
    try:
        dcp.remove_sharded_tensors(tmp_path, "opt.")
        crashed = False
    except OSError:
        crashed = True
    monkeypatch.undo()
    # Whatever step it stopped at, the checkpoint loads, verified, as one of the two states.
    meta = dcp.load_tensors_metadata(tmp_path)
    assert set(meta) in ({"model.w"}, {"model.w", "opt.m", "opt.v"}), (calls, set(meta))
    plain = dcp.load_plain_tensors(tmp_path)
    for key in meta:
        assert torch.equal(plain[key], _full(key, 1)), key
    assert dcp.verify(tmp_path).ok
    if not crashed:
        assert set(meta) == {"model.w"}
    # The next save into the directory leaves exactly its own files.
    dcp.save({"model.w": ShardedTensor.from_rank_offsets("model.w", _full("model.w", 2))}, tmp_path)
    record = json.loads((tmp_path / "commit.json").read_text())
    expected = set(record["files"]) | set(record["data_files"]) | {"commit.json"}
    assert set(os.listdir(tmp_path)) == expected


def _hinted_strategy() -> Any:
    from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return TorchDistSaveShardedStrategy(separation_hint="opt.")


def test_saves_without_checksums_commit_every_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WRITE_CHECKSUMS=0: nothing to verify per item, but the record still names (and
    keeps) every data file, also when the save overwrites a checkpoint."""
    monkeypatch.setenv("DIST_CKPT_WRITE_CHECKSUMS", "0")
    sd = {k: ShardedTensor.from_rank_offsets(k, _full(k, 1)) for k in ("w", "v")}
    for _ in range(2):
        dcp.save(sd, tmp_path)
        record = json.loads((tmp_path / "commit.json").read_text())
        assert record["checksum"]["data_items"] is False
        assert all(not e["items"] for e in record["data_files"].values())
        plain = dcp.load_plain_tensors(tmp_path)
        assert all(torch.equal(plain[k], _full(k, 1)) for k in ("w", "v"))
        assert dcp.verify(tmp_path).ok


@pytest.mark.parametrize("where", ["install_from", "install_to", "files", "data_files"])
def test_commit_record_names_stay_inside_the_directory(tmp_path: Path, where: str) -> None:
    """A crafted commit.json cannot make a load or the next save rename, read or delete
    a file outside the checkpoint directory."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    sd = {k: ShardedTensor.from_rank_offsets(k, _full(k, 1)) for k in ("w", "v")}
    dcp.save(sd, ckpt)
    record = json.loads((ckpt / "commit.json").read_text())
    if where == "install_from":
        record["install"] = {".metadata": "../victim"}
    elif where == "install_to":
        record["install"] = {"../victim": ".metadata"}
    elif where == "files":
        record["files"]["../victim"] = {"size": 8, "blocks": [0]}
    else:
        record["data_files"]["../victim"] = {"size": 8, "items": []}
    (ckpt / "commit.json").write_text(json.dumps(record))
    for attempt in (lambda: dcp.load_plain_tensors(ckpt), lambda: dcp.save(sd, ckpt)):
        with pytest.raises(UnsafeCheckpointError, match="commit.json"):
            attempt()
    assert victim.read_bytes() == b"precious"


def _save_failing_on_one_rank(ckpt: Path, where: str) -> str:
    """Over a committed version 1, save version 2 with one step failing on one rank
    only: a common state rank 0 (which writes common.pt) cannot pickle, a value only
    rank 1 cannot pickle (compared, not saved: the save goes on), or a file digest that
    fails on rank 1 (``verify_integrity``, a writer that reports no digest, so the
    file is read back). Every rank must raise or every rank save."""
    rank = dist.get_rank()
    state = _state(2)
    if where == "common on rank 0" and rank == 0:
        state["hook"] = lambda: None
    if where == "common on rank 1" and rank == 1:
        state["hook"] = lambda: None
    if where == "digest on rank 1" and rank == 1:
        # Its writers report no digest, so the save reads its data files back: and fails.
        write = FileSystemWriterAsync.write_preloaded_data

        def without_digest(bucket: Any, fs: Any, sync_files: bool) -> Any:
            return list(write(bucket, fs, sync_files))

        def unreadable(ckpt: Any, name: str) -> str:
            raise OSError(f"cannot read {name}")

        FileSystemWriterAsync.write_preloaded_data = staticmethod(without_digest)  # type: ignore[method-assign]
        integrity.file_digest = unreadable  # type: ignore[assignment]
    try:
        dcp.save(state, ckpt, verify_integrity=where.startswith("digest"))
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(exc).__name__}: {exc}"
    return "saved"


@pytest.mark.parametrize("where", ["common on rank 0", "common on rank 1", "digest on rank 1"])
def test_a_save_step_failing_on_one_rank_raises_on_every_rank(tmp_path: Path, where: str) -> None:
    run_distributed(_save_v1, 2, tmp_path, timeout=60.0)
    results = run_distributed(_save_failing_on_one_rank, 2, tmp_path, where, timeout=60.0)
    if where == "common on rank 1":  # rank 0's common state is the one saved
        assert results == ["saved", "saved"], results
        run_distributed(_check_version, 2, tmp_path, 2, timeout=60.0)
        return
    failing = 0 if where.endswith("rank 0") else 1
    assert results[1 - failing].startswith("RankFailureError"), results
    assert f"rank {failing}" in results[1 - failing], results
    assert results[failing] != "saved", results
    run_distributed(_check_version, 2, tmp_path, 1, timeout=60.0)  # untouched
