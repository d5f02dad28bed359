"""End-to-end tests of asynchronous saves: ``dist_checkpointing.save(..., async_sharded_save=True)``
scheduled on an :class:`AsyncCallsQueue` and finalized on every rank, as Megatron-Core does::

    request = dist_checkpointing.save(sharded_sd, ckpt_dir, async_sharded_save=True)
    queue.schedule_async_request(request)
    ...  # training goes on
    queue.maybe_finalize_async_calls(blocking=True)

Every ``_rank_*`` function runs on every rank of a real gloo process group (tests.support.harness).
Both caller kinds are covered (``persistent`` False: one forked process per save; True: one
long-lived spawned worker per rank). Failures are injected into the real writer: a removed
directory, a data file path taken by a directory (works as root, unlike chmod), a writer
killed with SIGKILL mid-write, and a file size limit (RLIMIT_FSIZE).
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import os
import resource
import shutil
import signal
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.engine.storage import write_workers
from dist_checkpointing.errors import (
    CheckpointWriteError,
    IncompleteCheckpointError,
    UnsupportedFeatureError,
)
from dist_checkpointing.strategies.async_utils import (
    AsyncCallsQueue,
    AsyncRequest,
    PersistentAsyncCaller,
)
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from tests.support.harness import run_distributed, world_sizes

pytestmark = pytest.mark.timeout(120)

BOTH_KINDS = pytest.mark.parametrize("persistent", [False, True], ids=["temporal", "persistent"])
WAIT_S = 30.0  # bound of every wait for a background write
KILL_DEADLINE_S = 60.0  # a killed writer must turn into an error within this time
COMMIT_FILES = (".metadata", ".metadata_index.json", "metadata.json", "commit.json")
SHARDED_KEYS = ("layer.weight", "layer.bias", "embedding")
REPLICATED_KEYS = ("replicated.scale",)


# ----------------------------------------------------------------------------- reference state


def _global_tensors(world: int, version: int, wide: bool = False) -> dict[str, torch.Tensor]:
    """The global tensors of checkpoint ``version``, built independently of any checkpoint."""
    gen = torch.Generator().manual_seed(1000 * version + world)
    cols = 512 if wide else 32
    return {
        "layer.weight": torch.randn(8 * world, cols, generator=gen),
        "layer.bias": torch.randn(4 * world, generator=gen).to(torch.bfloat16),
        "embedding": torch.randint(-(2**40), 2**40, (2 * world, 3, 5), generator=gen),
        "replicated.scale": torch.randn(7, generator=gen, dtype=torch.float64),
    }


def _rng_object(rank: int, version: int) -> dict[str, Any]:
    return {"rank": rank, "version": version, "seeds": [rank * 7 + version, 11]}


def _local_shard(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return full.chunk(world, dim=0)[rank].clone()


def _save_sd(rank: int, world: int, version: int, wide: bool = False) -> dict[str, Any]:
    """This rank's sharded state dict: TP-style shards, a replicated tensor, one object per
    rank and some common (non-sharded) state."""
    full = _global_tensors(world, version, wide)
    sd: dict[str, Any] = {
        key: ShardedTensor.from_rank_offsets(
            key, _local_shard(full[key], rank, world), (0, rank, world)
        )
        for key in SHARDED_KEYS
    }
    for key in REPLICATED_KEYS:
        sd[key] = ShardedTensor.from_rank_offsets(key, full[key].clone(), replica_id=rank)
    sd["rng"] = ShardedObject("rng", _rng_object(rank, version), (world,), (rank,))
    sd["iteration"] = 100 + version
    sd["args"] = {"lr": 0.5, "version": version}
    return sd


def _load_request(rank: int, world: int, saved_world: int, version: int) -> dict[str, Any]:
    """A load request of this rank (``world`` ranks now, ``saved_world`` when saved); the data
    buffers hold a sentinel so that an unfilled element is visible."""
    full = _global_tensors(saved_world, version)
    sd: dict[str, Any] = {}
    for key in SHARDED_KEYS:
        buf = torch.full_like(_local_shard(full[key], rank, world), 3)
        sd[key] = ShardedTensor.from_rank_offsets(key, buf, (0, rank, world))
    for key in REPLICATED_KEYS:
        sd[key] = ShardedTensor.from_rank_offsets(
            key, torch.full_like(full[key], 3), replica_id=rank
        )
    # Each rank asks for the objects it covers; on fewer ranks, for several.
    for i in range(rank, saved_world, world):
        sd[f"rng.{i}"] = ShardedObject("rng", None, (saved_world,), (i,))
    return sd


def _mismatches(
    loaded: dict[str, Any], rank: int, world: int, saved_world: int, version: int
) -> list[str]:
    """Every difference between ``loaded`` and the reference (bitwise for tensors)."""
    full = _global_tensors(saved_world, version)
    expected: dict[str, Any] = {key: _local_shard(full[key], rank, world) for key in SHARDED_KEYS}
    expected.update({key: full[key] for key in REPLICATED_KEYS})
    expected.update({f"rng.{i}": _rng_object(i, version) for i in range(rank, saved_world, world)})
    expected.update({"iteration": 100 + version, "args": {"lr": 0.5, "version": version}})
    problems = [f"{key}: missing" for key in expected if key not in loaded]
    for key, want in expected.items():
        got = loaded.get(key)
        if isinstance(want, torch.Tensor):
            if not isinstance(got, torch.Tensor) or got.dtype != want.dtype:
                problems.append(f"{key}: expected a {want.dtype} tensor, got {got!r}")
            elif got.shape != want.shape or not torch.equal(
                got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
            ):
                problems.append(f"rank {rank}: {key}: bytes differ")
        elif key in loaded and got != want:
            problems.append(f"rank {rank}: {key}: expected {want!r}, got {got!r}")
    return problems


def _load_and_compare(ckpt: Path, saved_world: int, version: int) -> list[str]:
    """Load ``ckpt`` on the current ranks (collective) and compare with the reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    loaded = dc.load(_load_request(rank, world, saved_world, version), ckpt)
    assert isinstance(loaded, dict)
    return _mismatches(loaded, rank, world, saved_world, version)


def _rank_load(ckpt: Path, saved_world: int, version: int) -> list[str]:
    return _load_and_compare(ckpt, saved_world, version)


# ----------------------------------------------------------------------------- helpers


def _load_error(ckpt: Path) -> tuple[str, str]:
    """(exception class, message) of loading ``ckpt``; ("", "") if it loaded. Loading an
    incomplete checkpoint fails before any collective, so ranks may call this freely."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        dc.load(_load_request(rank, world, world, 1), ckpt)
    except Exception as exc:  # noqa: BLE001 - the caller checks the type
        return type(exc).__name__, str(exc)
    return "", ""


def _names(directory: Path) -> list[str]:
    return sorted(os.listdir(directory)) if directory.is_dir() else []


def _fingerprint(directory: Path) -> dict[str, str]:
    return {
        name: hashlib.sha256((directory / name).read_bytes()).hexdigest()
        for name in _names(directory)
    }


def _wait_for_local_write(request: AsyncRequest) -> None:
    """Wait until this rank's background write reported its outcome.

    The write function's arguments are ``[rank, buckets, results_queue, sync_files]``
    (FileSystemWriterAsync.get_save_function_and_args); the default results queue is a
    file that appears once the write finished.
    """
    results_file = Path(request.async_fn_args[2].path)
    deadline = time.monotonic() + WAIT_S
    while not results_file.exists():
        assert time.monotonic() < deadline, f"the background write never reported ({results_file})"
        time.sleep(0.01)


def _async_save(
    queue: AsyncCallsQueue, ckpt: Path, version: int, **save_kwargs: Any
) -> AsyncRequest:
    rank, world = dist.get_rank(), dist.get_world_size()
    request = dc.save(_save_sd(rank, world, version), ckpt, async_sharded_save=True, **save_kwargs)
    assert isinstance(request, AsyncRequest)
    queue.schedule_async_request(request)
    return request


def _finalize_error(queue: AsyncCallsQueue) -> tuple[str, float]:
    """(message of the CheckpointWriteError raised by a blocking finalize, seconds it took)."""
    start = time.monotonic()
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except CheckpointWriteError as exc:
        return str(exc), time.monotonic() - start
    return "", time.monotonic() - start


def _worker_pid(queue: AsyncCallsQueue) -> int | None:
    caller = queue.persistent_caller
    return caller.worker_pid if isinstance(caller, PersistentAsyncCaller) else None


# ----------------------------------------------------------------------------- happy path


def _rank_happy_path(ckpt: Path, persistent: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    queue = AsyncCallsQueue(persistent=persistent)
    request = dc.save(_save_sd(rank, world, 1), ckpt, async_sharded_save=True)
    assert isinstance(request, AsyncRequest)
    out: dict[str, Any] = {"after_save": (_names(ckpt), _load_error(ckpt))}
    queue.schedule_async_request(request)
    _wait_for_local_write(request)
    dist.barrier()  # every rank's data files are written, none finalized
    out["after_write"] = (_names(ckpt), _load_error(ckpt))
    dist.barrier()  # nobody finalizes while another rank still probes
    out["finalized"] = queue.maybe_finalize_async_calls(blocking=True)
    out["after_finalize"] = _names(ckpt)
    out["mismatches"] = _load_and_compare(ckpt, world, 1)
    queue.close()
    return out


@world_sizes(1, 2)
@BOTH_KINDS
def test_async_save_is_loadable_only_after_finalize(
    tmp_path: Path, world_size: int, persistent: bool
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    results = run_distributed(_rank_happy_path, world_size, ckpt, persistent, timeout=90.0)
    data_files = {f"__{r}_{n}.distcp" for r in range(world_size) for n in range(2)}
    for rank, res in enumerate(results):
        for phase in ("after_save", "after_write"):
            names, (error_type, message) = res[phase]
            assert not set(COMMIT_FILES) & set(names), (rank, phase, names)
            # Some file exists (the common state, staged), and still nothing loads.
            assert any(n.startswith("common.pt") for n in names), names
            assert error_type == IncompleteCheckpointError.__name__, (rank, phase, message)
            assert "incomplete" in message and str(ckpt) in message
        assert data_files <= set(res["after_write"][0]), res["after_write"][0]
        assert res["finalized"] == [0]
        assert set(COMMIT_FILES) | data_files | {"common.pt"} == set(res["after_finalize"])
        assert res["mismatches"] == []
    if world_size == 2:  # the 2-rank checkpoint also loads whole on one rank
        assert run_distributed(_rank_load, 1, ckpt, 2, 1, timeout=60.0) == [[]]


def _rank_mcore_vs_default(root: Path) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    queue = AsyncCallsQueue()
    _async_save(queue, root / "default", 1)
    _async_save(queue, root / "mcore", 1, async_strategy="mcore")
    finalized = queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    return {
        "finalized": finalized,
        "default": _load_and_compare(root / "default", world, 1),
        "mcore": _load_and_compare(root / "mcore", world, 1),
        "rank": rank,
    }


def test_async_strategy_mcore_writes_what_the_default_writes(tmp_path: Path) -> None:
    for name in ("default", "mcore"):
        (tmp_path / name).mkdir()
    for res in run_distributed(_rank_mcore_vs_default, 2, tmp_path, timeout=60.0):
        assert res["finalized"] == [0, 1]
        assert res["default"] == res["mcore"] == []
    default, mcore = _fingerprint(tmp_path / "default"), _fingerprint(tmp_path / "mcore")
    assert sorted(default) == sorted(mcore)
    # Data files and common state are byte-identical (.metadata holds a per-save id).
    for name in default:
        if name.endswith(".distcp") or name == "common.pt":
            assert default[name] == mcore[name], name


@pytest.mark.parametrize("async_strategy", ["nvrx", "torch"])
def test_unsupported_async_strategy_is_refused_with_guidance(
    tmp_path: Path, async_strategy: str
) -> None:
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}
    with pytest.raises(UnsupportedFeatureError) as info:
        dc.save(sd, tmp_path, async_sharded_save=True, async_strategy=async_strategy)
    message = str(info.value)
    assert repr(async_strategy) in message or async_strategy in message
    assert "'mcore'" in message  # what to use instead
    assert isinstance(info.value, NotImplementedError)
    assert _names(tmp_path) == []  # refused before touching the directory


# ----------------------------------------------------------------------------- failures


def _rank_write_failure(root: Path, persistent: bool, how: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    good, bad, after = root / "good", root / "bad", root / "after"
    queue = AsyncCallsQueue(persistent=persistent)
    _async_save(queue, good, 1)
    queue.maybe_finalize_async_calls(blocking=True)
    pid_before = _worker_pid(queue)
    dist.barrier()
    good_before = _fingerprint(good)

    request = dc.save(_save_sd(rank, world, 2), bad, async_sharded_save=True)
    assert isinstance(request, AsyncRequest)
    dist.barrier()  # every rank planned its files
    if how == "dir_removed" and rank == 0:
        shutil.rmtree(bad)
    if how == "file_is_dir" and rank == 1:
        (bad / "__1_0.distcp").mkdir()  # rank 1 cannot create its first data file
    dist.barrier()
    queue.schedule_async_request(request)
    error, elapsed = _finalize_error(queue)
    out: dict[str, Any] = {"error": error, "elapsed": elapsed, "bad_names": _names(bad)}
    out["bad_load_error"] = _load_error(bad)
    dist.barrier()
    out["good_unchanged"] = _fingerprint(good) == good_before
    out["good"] = _load_and_compare(good, world, 1)
    # The queue (and a persistent worker) stays usable.
    _async_save(queue, after, 3)
    out["finalized_after"] = queue.maybe_finalize_async_calls(blocking=True)
    out["after"] = _load_and_compare(after, world, 3)
    out["pids"] = (pid_before, _worker_pid(queue))
    queue.close()
    return out


@BOTH_KINDS
@pytest.mark.parametrize("how", ["file_is_dir", "dir_removed"])
def test_write_failure_raises_on_every_rank_and_commits_nothing(
    tmp_path: Path, persistent: bool, how: str
) -> None:
    for name in ("good", "bad", "after"):
        (tmp_path / name).mkdir()
    results = run_distributed(_rank_write_failure, 2, tmp_path, persistent, how, timeout=90.0)
    for res in results:
        error = res["error"]
        assert error, "finalize did not raise CheckpointWriteError"
        assert "rank 1" in error and "__1_0.distcp" in error, error
        if how == "file_is_dir":
            assert "IsADirectoryError" in error, error
            assert res["bad_load_error"][0] == IncompleteCheckpointError.__name__
        else:
            assert "rank 0" in error and "__0_0.distcp" in error, error
            assert "FileNotFoundError" in error and "removed during the save" in error, error
            assert res["bad_load_error"][0] == "CheckpointNotFoundError"
        assert not set(COMMIT_FILES) & set(res["bad_names"]), res["bad_names"]
        assert res["elapsed"] < WAIT_S
        assert res["good_unchanged"] and res["good"] == []
        assert res["finalized_after"] == [2] and res["after"] == []
        if persistent:  # a write error does not cost the worker
            assert res["pids"][0] == res["pids"][1] is not None


def _write_some_then_die(bucket: write_workers.WriteBucket, fs: Any, sync_files: bool) -> Any:
    """Replaces write_bucket_file in a background writer: start the file, then SIGKILL."""
    with open(bucket.path, "wb") as f:
        f.write(b"\0" * 4096)
        f.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _sigkill_mid_write(
    rank: int, buckets: list[Any], results_queue: Any, sync_files: bool = True
) -> None:
    """The library's write function, but the process writing each file dies mid-write.

    Runs in the background process (module level, so the persistent worker can unpickle
    it); with one bucket that process itself dies, with several the per-bucket workers
    forked from it do.
    """
    original = write_workers.write_bucket_file
    write_workers.write_bucket_file = _write_some_then_die  # type: ignore[assignment]
    try:
        write_workers.write_buckets_multiproc(rank, buckets, results_queue, sync_files)
    finally:
        write_workers.write_bucket_file = original  # a persistent worker lives on


def _rank_sigkill(root: Path, persistent: bool, thread_count: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    queue = AsyncCallsQueue(persistent=persistent)
    strategy = TorchDistSaveShardedStrategy(thread_count=thread_count)
    request = dc.save(_save_sd(rank, world, 1), root / "bad", strategy, async_sharded_save=True)
    assert isinstance(request, AsyncRequest)
    if rank == 1:
        request = dataclasses.replace(request, async_fn=_sigkill_mid_write)
    queue.schedule_async_request(request)
    error, elapsed = _finalize_error(queue)
    # Nobody cleans up after a dead writer (see test_failed_save_leaves_no_results_directory).
    shutil.rmtree(request.async_fn_args[2].directory, ignore_errors=True)
    out = {"error": error, "elapsed": elapsed, "bad_names": _names(root / "bad")}
    dist.barrier()
    _async_save(queue, root / "after", 2, sharded_strategy=strategy)
    out["finalized_after"] = queue.maybe_finalize_async_calls(blocking=True)
    out["after"] = _load_and_compare(root / "after", world, 2)
    queue.close()
    return out


@BOTH_KINDS
@pytest.mark.parametrize("thread_count", [1, 2], ids=["caller_process_dies", "bucket_worker_dies"])
def test_writer_killed_mid_write_raises_on_every_rank(
    tmp_path: Path, persistent: bool, thread_count: int
) -> None:
    for name in ("bad", "after"):
        (tmp_path / name).mkdir()
    start = time.monotonic()
    results = run_distributed(
        _rank_sigkill, 2, tmp_path, persistent, thread_count, timeout=KILL_DEADLINE_S + 30
    )
    assert time.monotonic() - start < KILL_DEADLINE_S + 30
    for res in results:
        error = res["error"]
        assert error, "finalize did not raise CheckpointWriteError"
        assert "SIGKILL" in error and "rank 1" in error, error
        if thread_count == 2:  # the dead bucket workers' files are named
            assert "__1_0.distcp" in error and "__1_1.distcp" in error, error
        assert res["elapsed"] < KILL_DEADLINE_S
        assert not set(COMMIT_FILES) & set(res["bad_names"]), res["bad_names"]
        assert res["finalized_after"] == [1] and res["after"] == []


FILE_SIZE_LIMIT = 8 << 10  # below one data file of the wide state (16 KiB of weights per rank)


def _noop() -> None:
    return None


def _rank_file_size_limit(root: Path, persistent: bool, thread_count: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    strategy = TorchDistSaveShardedStrategy(thread_count=thread_count)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not death
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)

    def limited(fn: Any) -> Any:
        """Run ``fn`` with the limit on rank 1: the background process started meanwhile
        (forked, or the persistent worker) inherits it, this process does not keep it."""
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, old_limit[1]))
        try:
            return fn()
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)

    # The persistent queue starts its worker when created: under the limit. The
    # request itself is pickled without it (its CPU tensors go to shared memory,
    # which the limit applies to as well).
    queue = limited(partial(AsyncCallsQueue, persistent=persistent))
    try:
        if persistent:
            queue.schedule_async_request(AsyncRequest(_noop, (), []))
            queue.maybe_finalize_async_calls(blocking=True)
        sd = _save_sd(rank, world, 1, wide=True)
        request = dc.save(sd, root / "ckpt", strategy, async_sharded_save=True)
        assert isinstance(request, AsyncRequest)
        if persistent:
            queue.schedule_async_request(request)
        else:
            limited(partial(queue.schedule_async_request, request))
        error, _ = _finalize_error(queue)
    finally:
        queue.close()
        signal.signal(signal.SIGXFSZ, old_handler)
    return {"error": error, "names": _names(root / "ckpt")}


@BOTH_KINDS
@pytest.mark.parametrize("thread_count", [1, 2])
def test_file_size_limit_names_the_file(
    tmp_path: Path, persistent: bool, thread_count: int
) -> None:
    (tmp_path / "ckpt").mkdir()
    results = run_distributed(
        _rank_file_size_limit, 2, tmp_path, persistent, thread_count, timeout=90.0
    )
    for res in results:
        error = res["error"]
        assert "rank 1" in error and "__1_0.distcp" in error, error
        assert "File too large" in error and "RLIMIT_FSIZE" in error, error
        assert "__0_0.distcp" not in error  # rank 0 wrote fine
        assert not set(COMMIT_FILES) & set(res["names"]), res["names"]


# ----------------------------------------------------------------------------- several saves


def _record_commit(log: list[tuple[int, bool]], version: int, ckpt: Path) -> None:
    """A finalize function appended after save()'s own: metadata.json must be there."""
    log.append((version, (ckpt / "metadata.json").exists()))


def _rank_two_in_flight(root: Path, persistent: bool) -> dict[str, Any]:
    world = dist.get_world_size()
    queue = AsyncCallsQueue(persistent=persistent)
    log: list[tuple[int, bool]] = []
    for version, name in ((1, "first"), (2, "second")):
        rank = dist.get_rank()
        request = dc.save(_save_sd(rank, world, version), root / name, async_sharded_save=True)
        assert isinstance(request, AsyncRequest)
        request.add_finalize_fn(partial(_record_commit, log, version, root / name))
        queue.schedule_async_request(request)
    in_flight = queue.get_num_unfinalized_calls()
    early = queue.maybe_finalize_async_calls(blocking=False)  # whatever is done, in order
    queue.close()  # waits for (and finalizes) the rest
    return {
        "in_flight": in_flight,
        "early": early,
        "log": log,
        "left": queue.get_num_unfinalized_calls(),
        "first": _load_and_compare(root / "first", world, 1),
        "second": _load_and_compare(root / "second", world, 2),
    }


@BOTH_KINDS
def test_two_saves_in_flight_finalize_in_order(tmp_path: Path, persistent: bool) -> None:
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
    for res in run_distributed(_rank_two_in_flight, 2, tmp_path, persistent, timeout=90.0):
        assert res["in_flight"] == 2 and res["left"] == 0
        assert res["early"] in ([], [0], [0, 1])
        assert res["log"] == [(1, True), (2, True)]
        assert res["first"] == [] and res["second"] == []


def _rank_worker_reuse(root: Path) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    queue = AsyncCallsQueue(persistent=True)
    pids, errors = [], []
    for version in (1, 2, 3):
        request = dc.save(
            _save_sd(rank, world, version), root / f"v{version}", async_sharded_save=True
        )
        assert isinstance(request, AsyncRequest)
        if version == 2 and rank == 1:
            (root / "v2" / "__1_1.distcp").mkdir()  # this save fails
        dist.barrier()
        queue.schedule_async_request(request)
        errors.append(_finalize_error(queue)[0])
        pids.append(_worker_pid(queue))
    out = {"pids": pids, "errors": errors}
    out["v1"] = _load_and_compare(root / "v1", world, 1)
    out["v3"] = _load_and_compare(root / "v3", world, 3)
    queue.close()
    return out


def test_persistent_worker_is_reused_and_survives_a_failed_save(tmp_path: Path) -> None:
    for version in (1, 2, 3):
        (tmp_path / f"v{version}").mkdir()
    results = run_distributed(_rank_worker_reuse, 2, tmp_path, timeout=90.0)
    for res in results:
        first, second, third = res["pids"]
        assert first is not None and first == second == third
        assert res["errors"][0] == res["errors"][2] == ""
        assert "__1_1.distcp" in res["errors"][1] and "IsADirectoryError" in res["errors"][1]
        assert res["v1"] == res["v3"] == []
    assert results[0]["pids"][0] != results[1]["pids"][0]  # one worker per rank
    assert not set(COMMIT_FILES) & set(_names(tmp_path / "v2"))


# ----------------------------------------------------------------------------- snapshot


def _wait_for_flag(flag: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(flag):
        if time.monotonic() > deadline:
            raise TimeoutError(f"flag {flag} never appeared")
        time.sleep(0.01)


def _rank_snapshot(root: Path, persistent: bool) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    queue = AsyncCallsQueue(persistent=persistent)
    flag = root / f"flag{rank}"
    # Keep the background busy, so that the save below is written only after the change.
    queue.schedule_async_request(AsyncRequest(_wait_for_flag, (str(flag),), []))
    sd = _save_sd(rank, world, 1)
    request = dc.save(sd, root / "ckpt", async_sharded_save=True)
    assert isinstance(request, AsyncRequest)
    queue.schedule_async_request(request)
    for key in (*SHARDED_KEYS, *REPLICATED_KEYS):
        sd[key].data.add_(1)  # training goes on: an in-place update after the save call
    flag.touch()
    queue.close()
    return _load_and_compare(root / "ckpt", world, 1)


@pytest.mark.parametrize(
    "persistent",
    [
        False,
        True,
    ],
    ids=["temporal", "persistent"],
)
def test_checkpoint_holds_the_state_at_save_time(tmp_path: Path, persistent: bool) -> None:
    (tmp_path / "ckpt").mkdir()
    for mismatches in run_distributed(_rank_snapshot, 2, tmp_path, persistent, timeout=90.0):
        assert mismatches == []


# ----------------------------------------------------------------------------- known issues


def _rank_results_dir_after_failure(root: Path) -> bool:
    """Whether the private results directory of a failed async save is still there."""
    rank, world = dist.get_rank(), dist.get_world_size()
    queue = AsyncCallsQueue()
    strategy = TorchDistSaveShardedStrategy(thread_count=1)  # the caller process writes
    request = dc.save(_save_sd(rank, world, 1), root / "ckpt", strategy, async_sharded_save=True)
    assert isinstance(request, AsyncRequest)
    results_dir = Path(request.async_fn_args[2].directory)
    if rank == 1:  # rank 1's writer process dies: no rank runs its finalize functions
        request = dataclasses.replace(request, async_fn=_sigkill_mid_write)
    queue.schedule_async_request(request)
    error, _ = _finalize_error(queue)
    assert error
    queue.close()
    # The writer's results channel goes away with the last reference to the failed
    # request (no finalize function runs for a failed call).
    del request
    gc.collect()
    leaked = results_dir.exists()
    shutil.rmtree(results_dir, ignore_errors=True)  # do not leave it behind in /tmp
    return leaked


def test_failed_save_leaves_no_results_directory(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    assert run_distributed(_rank_results_dir_after_failure, 2, tmp_path, timeout=60.0) == [
        False,
        False,
    ]
