"""Error paths of save/load (torch_dist backend): what is raised, on which ranks, and
that each message names the key / file / rank and what was expected vs found.

Single-process where ranks do not matter (torch.distributed not initialized); real gloo
ranks (tests.support.harness) for errors that must be raised on every rank.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dcp
from dist_checkpointing import ShardedObject, ShardedTensor, StrictHandling
from dist_checkpointing import errors as E
from dist_checkpointing.engine.storage.reader import FileSystemReader
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from tests.support.faults import BAD_INPUTS, bad_input
from tests.support.harness import run_distributed

pytestmark = pytest.mark.timeout(120)

SHAPE = (8, 4)


def _ref(
    key: str, shape: tuple[int, ...] = SHAPE, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A deterministic reference tensor, different for every key."""
    numel = 1
    for s in shape:
        numel *= s
    base = sum(ord(c) for c in key) * 1000
    return (torch.arange(numel, dtype=torch.int64) + base).reshape(shape).to(dtype)


def _whole(key: str, data: torch.Tensor, replica_id: int = 0) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets(key, data, replica_id=replica_id)


def _save_single(ckpt_dir: Path, thread_count: int = 2) -> None:
    """Tensors 'a', 'b', object 'obj', common value 'c' (collective: with several ranks,
    every rank holds everything and rank r is replica r)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    sd = {
        "a": _whole("a", _ref("a"), replica_id=rank),
        "b": _whole("b", _ref("b"), replica_id=rank),
        "o": ShardedObject("obj", {"payload": 1}, (1,), (0,), replica_id=rank),
        "c": 5,
    }
    dcp.save(sd, ckpt_dir, TorchDistSaveShardedStrategy(thread_count=thread_count))


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    _save_single(d)
    return d


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------------------- error classes


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (E.ShardingError, ValueError),
        (E.MappingError, ValueError),
        (E.CheckpointNotFoundError, FileNotFoundError),
        (E.IncompleteCheckpointError, FileNotFoundError),
        (E.StrategyNotFoundError, KeyError),
        (E.IncompatibleStrategyError, ValueError),
        (E.KeyMismatchError, KeyError),
        (E.ShapeMismatchError, ValueError),
        (E.CorruptCheckpointError, OSError),
        (E.UnsafeCheckpointError, ValueError),
        (E.CheckpointWriteError, OSError),
        (E.UnsupportedFeatureError, NotImplementedError),
    ],
)
def test_error_classes_are_also_the_matching_builtins(cls: type, builtin: type) -> None:
    assert issubclass(cls, E.CheckpointingException)
    assert issubclass(cls, builtin)
    err = cls("message naming 'key'")
    assert isinstance(err, builtin)
    # KeyError subclasses must not quote their message.
    assert str(err) == "message naming 'key'"
    assert cls.__name__ in E.__all__


def test_checkpointing_exception_is_package_level() -> None:
    assert dcp.CheckpointingException is E.CheckpointingException


# ----------------------------------------------------------------------------- shape mismatch


def test_shape_mismatch_names_key_and_shapes_before_reading(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[int] = []
    original = FileSystemReader.read_data

    def spy(self: FileSystemReader, plan: Any, planner: Any) -> Any:
        reads.append(len(plan.items))
        return original(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", spy)
    request = {
        "a": _whole("a", torch.zeros(10, 4)),
        "b": _whole("b", torch.zeros(SHAPE)),
    }
    with pytest.raises(E.ShapeMismatchError) as info:
        dcp.load(request, ckpt)
    msg = str(info.value)
    assert "'a'" in msg and "(10, 4)" in msg and "(8, 4)" in msg
    assert "'b'" not in msg  # only the mismatched key is reported
    assert isinstance(info.value, ValueError)
    assert reads == [], "data was read before the shape check failed"

    # The spy does see reads of a valid request (so the check above is meaningful).
    out = dcp.load({"a": _whole("a", torch.zeros(SHAPE))}, ckpt)
    assert isinstance(out, dict)
    assert reads and torch.equal(out["a"], _ref("a"))


def test_shape_mismatch_of_flat_tensor_reports_logical_shapes(tmp_path: Path) -> None:
    g = _ref("f", (4, 6))
    dcp.save(
        {
            "f": ShardedTensor.from_rank_offsets_flat(
                "f", g.reshape(-1), (4, 6), flattened_range=slice(0, 24)
            )
        },
        tmp_path,
    )
    request = {
        "f": ShardedTensor.from_rank_offsets_flat(
            "f", torch.zeros(32), (4, 8), flattened_range=slice(0, 32)
        )
    }
    with pytest.raises(E.ShapeMismatchError) as info:
        dcp.load(request, tmp_path)
    msg = str(info.value)
    assert "'f'" in msg and "(4, 8)" in msg and "(4, 6)" in msg


# ----------------------------------------------------------------------------- strict handling

EXTRA = "not_in_ckpt"
S = StrictHandling


def _strict_request() -> dict[str, ShardedTensor]:
    """Requests 'a' (stored) and EXTRA (not stored); 'b' and 'obj' are stored, not requested."""
    return {
        "a": _whole("a", torch.zeros(SHAPE)),
        "x": _whole(EXTRA, torch.zeros(3)),
    }


def _check_loaded_rest(sd: dict[str, Any]) -> None:
    assert torch.equal(sd["a"], _ref("a"))
    assert sd["c"] == 5  # the common state is merged in
    assert "x" not in sd  # the unexpected request is dropped
    assert "b" not in sd


@pytest.mark.parametrize("as_string", [False, True], ids=["enum", "string"])
@pytest.mark.parametrize("mode", list(StrictHandling), ids=[m.value for m in StrictHandling])
def test_strict_modes_end_to_end(
    ckpt: Path, mode: StrictHandling, as_string: bool, caplog: pytest.LogCaptureFixture
) -> None:
    strict: StrictHandling | str = mode.value if as_string else mode
    caplog.set_level(logging.WARNING, logger="dist_checkpointing")
    if mode in (S.ASSUME_OK_UNEXPECTED, S.RAISE_UNEXPECTED, S.RAISE_ALL):
        with pytest.raises(E.KeyMismatchError) as info:
            dcp.load(_strict_request(), ckpt, strict=strict)
        msg = str(info.value)
        assert EXTRA in msg
        if mode == S.RAISE_ALL:
            assert "'b'" in msg and "'obj'" in msg  # missing: stored, requested by no rank
        else:
            assert "'b'" not in msg  # missing keys are not computed for these modes
        return

    out = dcp.load(_strict_request(), ckpt, strict=strict)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if mode in (S.RETURN_UNEXPECTED, S.RETURN_ALL):
        assert isinstance(out, tuple) and len(out) == 3
        sd, missing, unexpected = out
        assert unexpected == {EXTRA}
        assert missing == ({"b", "obj"} if mode == S.RETURN_ALL else set())
        _check_loaded_rest(sd)
        return
    assert isinstance(out, dict)
    _check_loaded_rest(out)
    if mode == S.LOG_UNEXPECTED:
        assert any(EXTRA in w for w in warnings), warnings
        assert not any("'b'" in w for w in warnings)
    elif mode == S.LOG_ALL:
        assert any(EXTRA in w and "'b'" in w and "'obj'" in w for w in warnings), warnings
    else:
        assert mode == S.IGNORE_ALL
        assert not any(EXTRA in w for w in warnings), warnings


def test_assume_ok_unexpected_error_says_what_to_do(ckpt: Path) -> None:
    with pytest.raises(E.KeyMismatchError) as info:
        dcp.load(_strict_request(), ckpt)  # the default mode
    msg = str(info.value)
    assert EXTRA in msg and "strict" in msg
    assert isinstance(info.value, KeyError)


def test_invalid_strict_flag_lists_the_options(ckpt: Path) -> None:
    with pytest.raises(E.CheckpointingException) as info:
        dcp.load(_strict_request(), ckpt, strict="raise_sometimes")
    msg = str(info.value)
    assert "raise_sometimes" in msg
    for mode in StrictHandling:
        assert repr(mode.value) in msg


def _rank_strict_all_modes(ckpt_dir: str) -> dict[str, Any]:
    """Rank r requests only its own stored key (rank 0: 'a', rank 1: 'b') plus EXTRA."""
    rank = dist.get_rank()
    _save_single(Path(ckpt_dir))
    key = "ab"[rank]

    def request() -> dict[str, ShardedTensor]:
        return {
            key: _whole(key, torch.zeros(SHAPE)),
            "x": _whole(EXTRA, torch.zeros(3), replica_id=rank),
        }

    out: dict[str, Any] = {}
    for name, strict in (("return_all", "return_all"), ("return_unexpected", S.RETURN_UNEXPECTED)):
        result = dcp.load(request(), ckpt_dir, strict=strict)
        assert isinstance(result, tuple)
        sd, missing, unexpected = result
        out[name] = (missing, unexpected, torch.equal(sd[key], _ref(key)))
    try:
        dcp.load(request(), ckpt_dir, strict=StrictHandling.RAISE_ALL)
        out["raise_all"] = None
    except E.KeyMismatchError as e:
        out["raise_all"] = str(e)
    return out


def test_strict_all_modes_count_requests_of_every_rank(tmp_path: Path) -> None:
    """'a' is requested only by rank 0 and 'b' only by rank 1: neither is missing."""
    results = run_distributed(_rank_strict_all_modes, 2, str(tmp_path), timeout=60)
    for rank, res in enumerate(results):
        assert res["return_all"] == ({"obj"}, {EXTRA}, True), rank
        assert res["return_unexpected"] == (set(), {EXTRA}, True), rank
        msg = res["raise_all"]
        assert msg is not None and "'obj'" in msg and EXTRA in msg, rank
        assert "'a'" not in msg and "'b'" not in msg, rank


def _rank_unexpected_on_one_rank(ckpt_dir: str) -> tuple[str, str]:
    rank = dist.get_rank()
    _save_single(Path(ckpt_dir))
    request: dict[str, ShardedTensor] = {"a": _whole("a", torch.zeros(SHAPE), replica_id=rank)}
    if rank == 1:
        request["x"] = _whole(EXTRA, torch.zeros(3))
    try:
        dcp.load(request, ckpt_dir, strict=StrictHandling.RAISE_UNEXPECTED)
    except Exception as e:  # noqa: BLE001 - returned to the test for inspection
        return type(e).__name__, str(e)
    return "ok", ""


def test_unexpected_key_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    results = run_distributed(_rank_unexpected_on_one_rank, 2, str(tmp_path), timeout=60)
    assert results[1][0] == "KeyMismatchError" and EXTRA in results[1][1]
    name, msg = results[0]
    # The rank without the error raises the one cross-rank failure type.
    assert name in {"KeyMismatchError", "RankFailureError"}, results[0]
    assert EXTRA in msg and "rank 1" in msg


# ----------------------------------------------------------------------------- metadata.json


def _rewrite_config(ckpt_dir: Path, **fields: Any) -> None:
    # Edited by hand, as another tool would: without the commit record (which would
    # refuse the edited file as not belonging to the save).
    (ckpt_dir / "commit.json").unlink(missing_ok=True)
    path = ckpt_dir / "metadata.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"sharded_backend": "no_such_backend"}, ["'no_such_backend'", "torch_dist v1"]),
        ({"sharded_backend_version": 7}, ["'torch_dist'", "version 7", "torch_dist v1"]),
        ({"common_backend": "no_such_common"}, ["'no_such_common'", "torch v1"]),
    ],
    ids=["backend", "version", "common_backend"],
)
def test_unknown_backend_lists_registered_strategies(
    ckpt: Path, fields: dict[str, Any], expected: list[str]
) -> None:
    _rewrite_config(ckpt, **fields)
    with pytest.raises(E.StrategyNotFoundError) as info:
        dcp.load({"a": _whole("a", torch.zeros(SHAPE))}, ckpt)
    msg = str(info.value)
    for part in expected:
        assert part in msg, msg
    assert isinstance(info.value, KeyError)


def test_zarr_backend_says_how_to_get_it(ckpt: Path) -> None:
    _rewrite_config(ckpt, sharded_backend="zarr")
    with pytest.raises(E.StrategyNotFoundError) as info:
        dcp.load_tensors_metadata(ckpt)
    msg = str(info.value)
    assert "zarr" in msg and "pip install" in msg and "torch_dist" in msg


def test_corrupt_metadata_json_is_reported(ckpt: Path) -> None:
    (ckpt / "metadata.json").write_text("{not json")
    with pytest.raises(E.CorruptCheckpointError) as info:
        dcp.load_tensors_metadata(ckpt)
    assert "metadata.json" in str(info.value)


# ----------------------------------------------------------------------------- missing / incomplete

ENTRY_POINTS = {
    "load": lambda d: dcp.load({"a": _whole("a", torch.zeros(SHAPE))}, d),
    "load_common_state_dict": dcp.load_common_state_dict,
    "load_tensors_metadata": dcp.load_tensors_metadata,
    "load_sharded_metadata": dcp.load_sharded_metadata,
    "load_plain_tensors": dcp.load_plain_tensors,
    "remove_sharded_tensors": lambda d: dcp.remove_sharded_tensors(d, "a"),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_not_a_checkpoint(tmp_path: Path, entry: str) -> None:
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(E.CheckpointNotFoundError) as info:
        ENTRY_POINTS[entry](tmp_path)
    msg = str(info.value)
    assert str(tmp_path) in msg and "metadata.json" in msg
    assert isinstance(info.value, FileNotFoundError)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_missing_directory(tmp_path: Path, entry: str) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as info:
        ENTRY_POINTS[entry](missing)
    assert isinstance(info.value, E.CheckpointNotFoundError)
    assert str(missing) in str(info.value) and "does not exist" in str(info.value)


def test_save_into_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(E.CheckpointNotFoundError) as info:
        dcp.save({"a": _whole("a", _ref("a"))}, missing)
    assert str(missing) in str(info.value)
    assert not missing.exists()


@pytest.mark.parametrize("also_remove", [(), (".metadata",)], ids=["no_config", "data_only"])
@pytest.mark.parametrize("entry", ["load", "load_tensors_metadata", "load_common_state_dict"])
def test_incomplete_checkpoint(
    ckpt: Path, tmp_path: Path, entry: str, also_remove: tuple[str, ...]
) -> None:
    broken = _copy(ckpt, tmp_path / "broken")
    for name in ("metadata.json", *also_remove):
        (broken / name).unlink()
    assert any(n.endswith(".distcp") for n in os.listdir(broken))
    with pytest.raises(E.IncompleteCheckpointError) as info:
        ENTRY_POINTS[entry](broken)
    msg = str(info.value)
    assert str(broken) in msg and "metadata.json" in msg
    assert isinstance(info.value, FileNotFoundError)


# ----------------------------------------------------------------------------- overlapping shards


def _rank_overlapping_save(fresh_dir: str, reused_dir: str) -> dict[str, Any]:
    """Both ranks claim block 0 of 2 of 'a' (rows 0:4); nobody holds rows 4:8."""
    rank, world = dist.get_rank(), dist.get_world_size()
    good = {
        "a": ShardedTensor.from_rank_offsets(
            "a", _ref("a").chunk(world)[rank].clone(), (0, rank, world)
        )
    }
    dcp.save(good, reused_dir)  # a complete checkpoint that the bad save overwrites
    dist.barrier()
    out: dict[str, Any] = {}
    for name, ckpt_dir in (("fresh", fresh_dir), ("reused", reused_dir)):
        bad = {"a": ShardedTensor.from_rank_offsets("a", _ref("a")[:4].clone(), (0, 0, world))}
        try:
            dcp.save(bad, ckpt_dir)
            out[name] = None
        except Exception as e:  # noqa: BLE001 - returned to the test for inspection
            out[name] = (type(e).__name__, str(e))
        dist.barrier()
    return out


def test_overlapping_shards_raise_on_every_rank_and_commit_nothing(tmp_path: Path) -> None:
    fresh, reused = tmp_path / "fresh", tmp_path / "reused"
    fresh.mkdir()
    reused.mkdir()
    results = run_distributed(_rank_overlapping_save, 2, str(fresh), str(reused), timeout=60)
    for rank, res in enumerate(results):
        for name in ("fresh", "reused"):
            assert res[name] is not None, f"rank {rank} did not raise ({name})"
            err_type, msg = res[name]
            assert err_type == "ShardingError", (rank, res[name])
            assert "'a'" in msg and "overlap" in msg and "rank 0" in msg and "rank 1" in msg
    # Nothing was written, and the rejected save left the previous checkpoint intact
    # (validation runs before anything in the directory is touched).
    assert os.listdir(fresh) == []
    assert (reused / "metadata.json").exists()
    assert (reused / ".metadata").exists()
    assert torch.equal(dcp.load_plain_tensors(reused)["a"], _ref("a"))


# ----------------------------------------------------------------------------- corrupt data files


def test_truncated_data_file(tmp_path: Path) -> None:
    _save_single(tmp_path, thread_count=1)
    data_files = [n for n in os.listdir(tmp_path) if n.endswith(".distcp")]
    assert data_files == ["__0_0.distcp"]
    path = tmp_path / data_files[0]
    os.truncate(path, path.stat().st_size // 3)
    request = {"a": _whole("a", torch.zeros(SHAPE)), "b": _whole("b", torch.zeros(SHAPE))}
    with pytest.raises(E.CorruptCheckpointError) as info:
        dcp.load(request, tmp_path)
    assert "__0_0.distcp" in str(info.value)
    assert isinstance(info.value, OSError)


def test_truncated_object_item(tmp_path: Path) -> None:
    _save_single(tmp_path, thread_count=1)
    path = tmp_path / "__0_0.distcp"
    os.truncate(path, 10)
    with pytest.raises(E.CorruptCheckpointError) as info:
        dcp.load({"o": ShardedObject("obj", None, (1,), (0,))}, tmp_path)
    assert "__0_0.distcp" in str(info.value)


def test_missing_data_file(tmp_path: Path) -> None:
    _save_single(tmp_path, thread_count=1)
    (tmp_path / "__0_0.distcp").unlink()
    with pytest.raises(E.CorruptCheckpointError) as info:
        dcp.load({"a": _whole("a", torch.zeros(SHAPE))}, tmp_path)
    msg = str(info.value)
    assert "__0_0.distcp" in msg and "missing" in msg
    assert re.search(r"\ba\b", msg.split("__0_0.distcp", 1)[1]), msg  # names the key it holds


# ----------------------------------------------------------------------------- async_strategy


def test_nvrx_async_strategy_is_unsupported_with_guidance(tmp_path: Path) -> None:
    with pytest.raises(E.UnsupportedFeatureError) as info:
        dcp.save({"a": _whole("a", _ref("a"))}, tmp_path, async_strategy="nvrx")
    msg = str(info.value)
    assert "nvrx" in msg and "'mcore'" in msg
    assert isinstance(info.value, NotImplementedError)
    assert os.listdir(tmp_path) == []  # refused before anything was written


def test_unknown_async_strategy(tmp_path: Path) -> None:
    with pytest.raises(E.UnsupportedFeatureError) as info:
        dcp.save({"a": _whole("a", _ref("a"))}, tmp_path, async_strategy="warp")
    assert "'warp'" in str(info.value) and "'mcore'" in str(info.value)


def test_mcore_async_strategy_is_accepted(tmp_path: Path) -> None:
    dcp.save({"a": _whole("a", _ref("a"))}, tmp_path, async_strategy="mcore")
    out = dcp.load({"a": _whole("a", torch.zeros(SHAPE))}, tmp_path)
    assert isinstance(out, dict) and torch.equal(out["a"], _ref("a"))


def _rank_fails_before_the_first_collective(root: str, how: str, validate: bool) -> str:
    """Rank 1 gets bad input that fails before any collective of ``save``; rank 0 gets
    a good state dict. Both must raise (never wait for each other); what each raised."""
    rank = dist.get_rank()
    ckpt = Path(root) / "ckpt"
    state: Any = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 4), (0, rank, 2))}
    target = ckpt
    if rank == 1:
        state, target = bad_input(how, state, "w", ckpt, Path(root))
    if rank == 0:
        ckpt.mkdir(exist_ok=True)
    dist.barrier()
    try:
        dcp.save(state, target, validate_access_integrity=validate)
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(exc).__name__}: {exc}"
    return "saved"


@pytest.mark.parametrize("validate", [True, False], ids=["validated", "unvalidated"])
@pytest.mark.parametrize("how", ["list", "factory", "missing dir"])
def test_a_save_failing_on_one_rank_before_any_collective_raises_on_every_rank(
    tmp_path: Path, how: str, validate: bool
) -> None:
    results = run_distributed(
        _rank_fails_before_the_first_collective, 2, str(tmp_path), how, validate, timeout=60
    )
    assert results[1] != "saved" and results[0].startswith("RankFailureError"), results
    assert "rank 1" in results[0], results
    assert BAD_INPUTS[how] in results[0] and BAD_INPUTS[how] in results[1], results
    assert not (tmp_path / "ckpt" / "metadata.json").exists()  # nothing committed


def _unstorable(kind: str) -> torch.Tensor:
    if kind == "sparse":
        return torch.eye(3).to_sparse()
    dtype = getattr(torch, kind, None)
    if not isinstance(dtype, torch.dtype):
        pytest.skip(f"torch {torch.__version__} has no {kind}")
    if kind == "quint8":
        with warnings.catch_warnings():  # quantized tensors are deprecated
            warnings.simplefilter("ignore")
            return torch.quantize_per_tensor(torch.ones(4), 0.5, 1, dtype)
    return torch.empty(4, dtype=dtype)


@pytest.mark.parametrize("layout", ["torch_dist", "raw_bytes"])
@pytest.mark.parametrize("kind", ["sparse", "quint8", "uint3", "int4"])
def test_tensors_no_layout_stores_are_refused_by_key_before_anything_is_written(
    tmp_path: Path, layout: str, kind: str
) -> None:
    dcp.save({"good": ShardedTensor.from_rank_offsets("good", torch.arange(4.0))}, tmp_path)
    bad = {"odd": ShardedTensor.from_rank_offsets("odd", _unstorable(kind))}
    strategy = dcp.get_default_save_sharded_strategy(layout, 1)
    with pytest.raises(E.UnsupportedFeatureError, match="'odd'"):
        dcp.save(bad, tmp_path, strategy)
    out = dcp.load({"good": ShardedTensor.from_rank_offsets("good", torch.empty(4))}, tmp_path)
    assert torch.equal(out["good"], torch.arange(4.0))  # the checkpoint there is intact


def _rank_plan_fails(root: str, mode: str) -> str:
    """raw_bytes: rank 1 holds a dtype the layout cannot store (planning fails on rank 1
    only, where no collective runs); every rank must raise, none wait."""
    rank = dist.get_rank()
    dtype = torch.complex32 if rank == 1 else torch.float32
    state = {
        f"w{rank}": ShardedTensor.from_rank_offsets(f"w{rank}", torch.zeros(2, 2, dtype=dtype))
    }
    strategy = dcp.get_default_save_sharded_strategy("raw_bytes", 1)
    queue = AsyncCallsQueue() if mode == "async" else None
    try:
        request = dcp.save(state, root, strategy, async_sharded_save=queue is not None)
        if queue is not None:
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(exc).__name__}: {exc}"
    finally:
        if queue is not None:
            queue.close()
    return "saved"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_raw_bytes_plan_failing_on_one_rank_raises_on_every_rank(
    tmp_path: Path, mode: str
) -> None:
    results = run_distributed(_rank_plan_fails, 2, str(tmp_path), mode, timeout=90)
    for text in results:
        assert text.startswith("CheckpointWriteError"), results
        assert "rank(s) [1]" in text and "'w1'" in text and "complex32" in text, results
    assert not (tmp_path / "metadata.json").exists()
