"""The persistent async worker: started without re-running the user's script, bounded
start-up, and a dead worker noticed on every rank.

- A training script without an ``if __name__ == "__main__":`` guard (the README's
  async example, ``tests/support/scripts/readme_async_no_main_guard.py``) runs under
  ``torchrun`` on 2 ranks: it finishes, the checkpoint loads byte-exactly, and the
  script was imported exactly once per rank (the worker never ran it).
- Both ways of starting the worker (forked from the trainer, the default, and a fresh
  interpreter, ``DIST_CKPT_ASYNC_WORKER_FORK=0``) pass the tests below that do not
  depend on how it starts.
- A worker that is not ready within ``DIST_CKPT_ASYNC_WORKER_START_TIMEOUT_S`` fails
  its calls with an error naming the knob; the next request starts a fresh worker.
- A worker SIGKILLed while a call is in flight fails that call on every rank at the
  next non-blocking ``maybe_finalize_async_calls`` (the other rank is still writing),
  and the next save, with a fresh worker, commits.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist

import dist_checkpointing
from dist_checkpointing import ShardedTensor
from dist_checkpointing.engine.async_save import persistent as persistent_module
from dist_checkpointing.engine.async_save import worker as worker_module
from dist_checkpointing.engine.async_save.worker import FrameReader, write_frame
from dist_checkpointing.errors import CheckpointWriteError
from dist_checkpointing.strategies.async_utils import (
    AsyncCallsQueue,
    AsyncRequest,
    PersistentAsyncCaller,
    TemporalAsyncCaller,
)
from tests.support.harness import run_distributed

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "support" / "scripts" / "readme_async_no_main_guard.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
FLAG_WAIT_S = 60.0


def _wait_then_write(started: str, flag: str, path: str) -> None:
    """An in-flight call: say it started, block until ``flag`` exists (bounded), then
    write ``path``."""
    Path(started).touch()
    deadline = time.monotonic() + FLAG_WAIT_S
    while not os.path.exists(flag):
        if time.monotonic() > deadline:
            raise TimeoutError(f"flag {flag} never appeared")
        time.sleep(0.01)
    Path(path).write_text("done")


def _write_text(path: str, content: str) -> None:
    Path(path).write_text(content)


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + FLAG_WAIT_S
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def _caller(queue: AsyncCallsQueue) -> PersistentAsyncCaller:
    assert isinstance(queue.persistent_caller, PersistentAsyncCaller)
    return queue.persistent_caller


START_METHODS = {"fork": "1", "interpreter": "0"}  # DIST_CKPT_ASYNC_WORKER_FORK


def _start_worker_as(
    monkeypatch: pytest.MonkeyPatch, method: str, child_code: str, exit_code: int = 0
) -> None:
    """Make the next worker start ``method``'s way but run ``child_code`` (Python) instead
    of the worker's loop, then exit with ``exit_code``."""
    monkeypatch.setenv("DIST_CKPT_ASYNC_WORKER_FORK", START_METHODS[method])
    if method == "interpreter":

        def command(requests_fd: int, results_fd: int) -> list[str]:
            return [sys.executable, "-c", f"{child_code}; import sys; sys.exit({exit_code})"]

        monkeypatch.setattr(persistent_module, "worker_command", command)
    else:

        def forked_main(requests_fd: int, results_fd: int, parent_ends: tuple[int, ...]) -> None:
            exec(child_code)  # test code, in the forked child
            os._exit(exit_code)

        monkeypatch.setattr(worker_module, "_forked_main", forked_main)


@pytest.mark.slow
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to python")
@pytest.mark.parametrize("method", sorted(START_METHODS))
def test_readme_async_example_without_main_guard_finishes(tmp_path: Path, method: str) -> None:
    env = {**os.environ, "ASYNC_DEMO_DIR": str(tmp_path), "ASYNC_DEMO_STEPS": "4"}
    env["DIST_CKPT_ASYNC_WORKER_FORK"] = START_METHODS[method]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(SCRIPT)]
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240
        )
    except subprocess.TimeoutExpired as err:  # the old failure mode: a hang in close()
        pytest.fail(f"the script hung:\n{err.stdout!r}\n{err.stderr!r}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(2):
        result = json.loads((tmp_path / f"result.{rank}.json").read_text())
        assert result["exact"], result
        # Imported once: by torchrun's rank process, never by the writer worker.
        lines = (tmp_path / f"imported.{rank}").read_text().splitlines()
        assert len(lines) == 1, lines
        print(
            f"{method}, rank {rank}: schedule blocked {result['first_schedule_s']:.3f}s, worker ready "
            f"after {result['worker_ready_s']:.2f}s, first save done after "
            f"{result['first_done_s']:.2f}s"
        )
        assert result["first_schedule_s"] < 5.0  # loose: start-up never blocks scheduling


def test_worker_start_timeout_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh interpreter: never ready within a millisecond (a forked one might be).
    monkeypatch.setenv("DIST_CKPT_ASYNC_WORKER_FORK", "0")
    monkeypatch.setenv("DIST_CKPT_ASYNC_WORKER_START_TIMEOUT_S", "0.001")
    queue = AsyncCallsQueue(persistent=True)
    try:
        queue.schedule_async_request(AsyncRequest(_write_text, (str(tmp_path / "a"), "x"), []))
        with pytest.raises(CheckpointWriteError) as info:
            queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        message = str(info.value)
        assert "did not start within 0.001s" in message
        assert "DIST_CKPT_ASYNC_WORKER_START_TIMEOUT_S" in message
        assert _caller(queue).worker_pid is None  # the slow worker was killed
        monkeypatch.delenv("DIST_CKPT_ASYNC_WORKER_START_TIMEOUT_S")
        queue.schedule_async_request(AsyncRequest(_write_text, (str(tmp_path / "b"), "y"), []))
        assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == [1]
        assert (tmp_path / "b").read_text() == "y"
    finally:
        queue.close()
    assert not (tmp_path / "a").exists()


def test_async_fn_from_main_is_refused_with_guidance(tmp_path: Path) -> None:
    def main_fn(path: str) -> None:  # stands for a function defined in a script
        Path(path).write_text("x")

    main_fn.__module__ = "__main__"
    queue = AsyncCallsQueue(persistent=True)
    try:
        queue.schedule_async_request(AsyncRequest(main_fn, (str(tmp_path / "a"),), []))
        with pytest.raises(CheckpointWriteError, match="importable module"):
            queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    finally:
        queue.close()


def _sharded_sd(rank: int, world: int, version: float) -> dict[str, Any]:
    data = torch.arange(8, dtype=torch.float32).reshape(world, -1)[rank] + version
    return {"w": ShardedTensor.from_rank_offsets("w", data.clone(), (0, rank, world))}


def _rank_worker_killed(root: Path) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    queue = AsyncCallsQueue(persistent=True)
    out: dict[str, Any] = {}
    try:
        flag, started = root / f"release.{rank}", root / f"started.{rank}"
        args = (str(started), str(flag), str(root / f"first.{rank}"))
        queue.schedule_async_request(AsyncRequest(_wait_then_write, args, []))
        caller = _caller(queue)
        assert caller.process is not None
        out["first_pid"] = caller.process.pid
        _wait_for(started)  # the worker is running the call
        if rank == 0:
            os.kill(caller.process.pid, signal.SIGKILL)
            while caller.process.poll() is None:
                time.sleep(0.01)
        dist.barrier()  # rank 0's worker is dead; rank 1's is still in the call
        start = time.monotonic()
        try:
            queue.maybe_finalize_async_calls(blocking=False)
            out["error"] = None
        except CheckpointWriteError as err:
            out["error"] = str(err)
        out["noticed_s"] = time.monotonic() - start
        flag.touch()  # let rank 1's worker finish the abandoned call
        ckpt = root / "ckpt"
        if rank == 0:
            ckpt.mkdir()
        dist.barrier()
        request = dist_checkpointing.save(
            _sharded_sd(rank, world, 1.0), ckpt, async_sharded_save=True
        )
        queue.schedule_async_request(request)
        out["finalized"] = queue.maybe_finalize_async_calls(blocking=True)
        out["second_pid"] = _caller(queue).worker_pid
    finally:
        queue.close()
    template = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4), (0, rank, world))}
    loaded = dist_checkpointing.load(template, ckpt)
    expected = _sharded_sd(rank, world, 1.0)["w"].data
    out["exact"] = loaded["w"].numpy().tobytes() == expected.numpy().tobytes()
    return out


@pytest.mark.slow
def test_killed_worker_fails_the_call_on_every_rank_then_a_fresh_one_saves(
    tmp_path: Path,
) -> None:
    results = run_distributed(_rank_worker_killed, 2, tmp_path, timeout=240.0)
    for rank, result in enumerate(results):
        error = result["error"]
        assert error is not None, f"rank {rank} did not notice the dead worker"
        assert "rank(s) [0]" in error and "SIGKILL" in error, error
        assert "before it was ready" not in error, error  # killed mid-call
        assert result["finalized"] == [1] and result["exact"], result
    assert results[0]["second_pid"] != results[0]["first_pid"]  # a fresh worker
    assert results[1]["second_pid"] == results[1]["first_pid"]  # kept its worker


@pytest.mark.parametrize("method", sorted(START_METHODS))
def test_worker_that_exits_during_start_up_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    _start_worker_as(monkeypatch, method, "pass", exit_code=3)
    queue = AsyncCallsQueue(persistent=True)
    try:
        queue.schedule_async_request(AsyncRequest(_write_text, (str(tmp_path / "a"), "x"), []))
        with pytest.raises(CheckpointWriteError, match="exited with code 3 before it was ready"):
            queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()


def test_frame_reader_never_returns_a_frame_cut_short() -> None:
    read_fd, write_fd = os.pipe()
    reader = FrameReader(read_fd)
    try:
        write_frame(write_fd, ("result", 0, None))
        whole = pickle.dumps(("result", 1, "x" * 100_000), protocol=pickle.HIGHEST_PROTOCOL)
        header = struct.pack("!Q", len(whole))
        os.write(write_fd, header + whole[:1000])  # a writer killed mid-frame
        assert reader.read_available() == [("result", 0, None)]
        os.close(write_fd)
        assert reader.read_available() == [] and reader.eof  # no wait, no partial frame
    finally:
        os.close(read_fd)


def _rank_temporal_straggler(root: Path) -> dict[str, Any]:
    """Rank 0's call fails at once, rank 1's is still running: both raise at the next
    non-blocking check and rank 1's process is killed."""
    rank = dist.get_rank()
    queue = AsyncCallsQueue(persistent=False)
    started, flag = root / f"started.{rank}", root / "never"
    if rank == 0:
        request = AsyncRequest(_raise_value_error, ("rank 0 failed",), [])
    else:
        request = AsyncRequest(_wait_then_write, (str(started), str(flag), str(root / "x")), [])
    queue.schedule_async_request(request)
    caller = queue.async_calls[0].async_caller
    assert isinstance(caller, TemporalAsyncCaller) and caller.process is not None
    pid = caller.process.pid
    if rank == 1:
        _wait_for(started)
    else:
        caller.process.join()  # rank 0's call has failed
    dist.barrier()
    start = time.monotonic()
    try:
        queue.maybe_finalize_async_calls(blocking=False)
        error = None
    except CheckpointWriteError as err:
        error = str(err)
    out = {"error": error, "s": time.monotonic() - start, "alive": psutil.pid_exists(pid)}
    queue.close()
    return out


def _raise_value_error(message: str) -> None:
    raise ValueError(message)


@pytest.mark.slow
def test_failure_on_one_rank_settles_while_another_still_writes(tmp_path: Path) -> None:
    results = run_distributed(_rank_temporal_straggler, 2, tmp_path, timeout=120.0)
    for result in results:
        assert result["error"] is not None and "rank 0 failed" in result["error"], result
        assert result["s"] < FLAG_WAIT_S  # not after rank 1's write gave up
    assert not results[1]["alive"]  # rank 1's straggling writer was killed


@pytest.mark.parametrize("method", sorted(START_METHODS))
def test_worker_that_never_starts_blocks_neither_scheduling_nor_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """A request larger than a pipe's buffer, for a worker that never reads it."""
    _start_worker_as(monkeypatch, method, "import time; time.sleep(120)")
    monkeypatch.setenv("DIST_CKPT_ASYNC_WORKER_START_TIMEOUT_S", "1.0")
    queue = AsyncCallsQueue(persistent=True)
    try:
        start = time.monotonic()
        big = "x" * (4 << 20)
        queue.schedule_async_request(AsyncRequest(_write_text, (str(tmp_path / "a"), big), []))
        scheduled_s = time.monotonic() - start
        with pytest.raises(CheckpointWriteError, match="did not start within 1s"):
            queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    assert scheduled_s < 5.0, scheduled_s  # the send did not wait for the worker
    assert time.monotonic() - start < 60.0
