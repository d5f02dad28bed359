"""Loading the golden checkpoints written by Megatron-Core 0.13.1 and 0.19.2.

For every case under ``tests/data/golden/`` (see the README there): load it under
the saved layout and under other layouts (1, 2 and 4 ranks; other split axes,
per-layer requests, flat ranges), compare every block bitwise with the value
formula, every ShardedObject with its manifest payload (types included), the
common state, ``load_common_state_dict``, ``load_tensors_metadata`` and
``load_sharded_metadata``.

Layouts of one world size run in one :func:`run_distributed` call per case (the
result is cached per module and checked per layout); 1-rank layouts run in the test
process without a process group.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing.errors import CheckpointingException
from tests.support.golden_utils import (
    GOLDEN_DIR,
    GoldenCase,
    Layout,
    assert_same_value,
    assert_tensor_bitwise,
    build_state_dict,
    checkpoint_path,
    get_path,
    golden_cases,
    layouts_for,
    leaf_paths,
    sha256_of,
    whole_layout,
)
from tests.support.harness import run_distributed

pytestmark = pytest.mark.timeout(240)

CASES = golden_cases()
CASE_IDS = [c.id for c in CASES]
LAYOUTS = [(case, layout) for case in CASES for layout in layouts_for(case)]
LAYOUT_IDS = [f"{case.id}-{layout.name}" for case, layout in LAYOUTS]

Outcome = tuple[str, Any]  # ("ok", loaded state dict) or ("error", traceback text)


def test_all_cases_present() -> None:
    """The 9 golden cases are checked in (no silent 'no tests collected')."""
    assert sorted(CASE_IDS) == sorted(
        [f"0.19.2-{n}" for n in ("tp2_basic", "grid2x2", "prepend_axis", "async_tp2")]
        + [f"0.13.1-{n}" for n in ("tp2_basic", "grid2x2", "prepend_axis", "flat_dp2", "async_tp2")]
    )


# --------------------------------------------------------------------------------------------
# Running layouts
# --------------------------------------------------------------------------------------------


def _load_layout(case_dir: Path, layout: Layout, rank: int) -> Outcome:
    cwd, ckpt = checkpoint_path(case_dir, layout.path_mode)
    old_cwd = os.getcwd()
    os.chdir(cwd)
    try:
        return "ok", dc.load(build_state_dict(layout.ranks[rank]), ckpt)
    except Exception:  # reported per layout by the test process
        return "error", traceback.format_exc()
    finally:
        os.chdir(old_cwd)


def _rank_load_layouts(case_dir: str, layouts: list[Layout]) -> dict[str, Outcome]:
    rank = dist.get_rank()
    return {layout.name: _load_layout(Path(case_dir), layout, rank) for layout in layouts}


class _GroupRuns:
    """One run_distributed call per (case, world size), run on first use."""

    def __init__(self) -> None:
        self._results: dict[tuple[str, int], list[dict[str, Outcome]] | BaseException] = {}

    def outcomes(self, case: GoldenCase, world_size: int) -> list[dict[str, Outcome]]:
        key = (case.id, world_size)
        if key not in self._results:
            layouts = [lay for lay in layouts_for(case) if lay.world_size == world_size]
            try:
                self._results[key] = run_distributed(
                    _rank_load_layouts, world_size, str(case.case_dir), layouts, timeout=120.0
                )
            except AssertionError as e:  # a rank died or hung: every layout of the run fails
                self._results[key] = e
        result = self._results[key]
        if isinstance(result, BaseException):
            raise result
        return result


@pytest.fixture(scope="module")
def group_runs() -> _GroupRuns:
    return _GroupRuns()


@functools.cache
def _global(case: GoldenCase, key: str) -> torch.Tensor:
    return case.global_tensor(key)


def _check_outcome(case: GoldenCase, layout: Layout, rank: int, outcome: Outcome) -> None:
    where = f"{case.id} layout {layout.name} rank {rank}"
    status, result = outcome
    if status != "ok":
        pytest.fail(f"{where}: load raised\n{result}")
    request = layout.ranks[rank]
    for t in request.tensors:
        got = get_path(result, t.path, where)
        assert_tensor_bitwise(got, t.expected(_global(case, t.key)), f"{where} {t}")
    payloads = case.main_payloads()
    for o in request.objects:
        got = get_path(result, o.path, where)
        assert_same_value(got, payloads[o.unique_key], f"{where} object {o.unique_key}")
    for path, value in request.nonpersistent:
        got = get_path(result, path, where)
        assert_same_value(got, value, f"{where} nonpersistent {path}")
    common = case.common_state()
    for path in leaf_paths(common):
        got = get_path(result, path, where)
        assert_same_value(got, get_path(common, path), f"{where} common {path}")
    expected_leaves = set(leaf_paths(common)) | request.paths()
    actual_leaves = set(leaf_paths(result, frozenset(request.paths())))
    assert actual_leaves == expected_leaves, (
        f"{where}: unexpected entries {sorted(actual_leaves - expected_leaves)}, "
        f"missing {sorted(expected_leaves - actual_leaves)}"
    )
    if not case.is_legacy:
        assert "common_state" not in result, f"{where}: the 0.19 common_state object leaked"


@pytest.mark.parametrize(("case", "layout"), LAYOUTS, ids=LAYOUT_IDS)
def test_load_layout(case: GoldenCase, layout: Layout, group_runs: _GroupRuns) -> None:
    if layout.world_size == 1:  # in this process, without a process group
        assert not dist.is_initialized()
        outcomes = [{layout.name: _load_layout(case.case_dir, layout, 0)}]
    else:
        outcomes = group_runs.outcomes(case, layout.world_size)
    for rank in range(layout.world_size):
        _check_outcome(case, layout, rank, outcomes[rank][layout.name])


def _rank_whole(case_dir: str) -> dict[str, Outcome]:
    case = next(c for c in CASES if str(c.case_dir) == case_dir)
    layout = whole_layout(case, 1, flat_keys_flat=True, path_mode="relative")
    return {layout.name: _load_layout(case.case_dir, layout, dist.get_rank())}


@pytest.mark.parametrize("case", [c for c in CASES if c.name == "tp2_basic"], ids=lambda c: c.id)
def test_load_in_single_rank_process_group(case: GoldenCase) -> None:
    """The 1-rank layout also loads inside an initialized 1-rank gloo group."""
    layout = whole_layout(case, 1, flat_keys_flat=True, path_mode="relative")
    (outcomes,) = run_distributed(_rank_whole, 1, str(case.case_dir), timeout=60.0)
    _check_outcome(case, layout, 0, outcomes[layout.name])


# --------------------------------------------------------------------------------------------
# Common state and metadata
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("path_mode", ["absolute", "relative", "relative_elsewhere"])
def test_load_common_state_dict(
    case: GoldenCase, path_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd, ckpt = checkpoint_path(case.case_dir, path_mode)
    monkeypatch.chdir(cwd)
    common = dc.load_common_state_dict(ckpt)
    assert_same_value(common, case.common_state(), f"{case.id} load_common_state_dict")
    if not case.is_legacy:
        assert "common_state" not in common


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_load_tensors_metadata(case: GoldenCase) -> None:
    metadata = dc.load_tensors_metadata(case.ckpt_dir)
    assert set(metadata) == set(case.tensors)
    for key in case.tensors:
        sh = metadata[key]
        assert isinstance(sh, dc.ShardedTensor), key
        assert sh.key == key
        assert tuple(sh.global_shape) == case.global_shape(key), (
            f"{key}: reported {sh.global_shape}, logical shape {case.global_shape(key)}"
        )
        assert sh.dtype == case.dtype(key), key
        assert sh.data is None, key


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_load_sharded_metadata(case: GoldenCase) -> None:
    metadata = dc.load_sharded_metadata(case.ckpt_dir)
    object_keys = {s["unique_key"] for info in case.objects.values() for s in info["shards"]}
    assert set(metadata) == set(case.tensors) | object_keys
    for unique_key in object_keys:
        obj = metadata[unique_key]
        assert isinstance(obj, dc.ShardedObject)
        assert obj.unique_key == unique_key
        assert obj.data is None
    for key in case.tensors:
        assert tuple(metadata[key].global_shape) == case.global_shape(key)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_load_plain_tensors(case: GoldenCase) -> None:
    """Every tensor whole; flat keys come back flat (1-D), as with Megatron-Core 0.13,
    since load_tensors_metadata describes them as one whole flat range."""
    loaded = dc.load_plain_tensors(case.ckpt_dir)
    for key in case.tensors:
        expected = _global(case, key)
        if key in case.flat_keys:
            expected = expected.reshape(-1)
        assert_tensor_bitwise(loaded[key], expected, f"{case.id} load_plain_tensors {key}")
    for path in leaf_paths(case.common_state()):
        got = get_path(loaded, path, f"{case.id} load_plain_tensors")
        assert_same_value(got, get_path(case.common_state(), path), f"common {path}")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_strict_return_all_reports_keys(case: GoldenCase) -> None:
    """Missing = stored keys not requested (tensors and objects, never the 0.19
    ``common_state`` object); unexpected = requested keys the checkpoint lacks."""
    first = next(iter(case.tensors))
    info = case.tensors[first]
    request = {
        "a": dc.ShardedTensor.from_rank_offsets(
            first, torch.empty(info["global_shape"], dtype=case.dtype(first))
        ),
        "b": dc.ShardedTensor.from_rank_offsets("not.in.checkpoint", torch.zeros(2)),
    }
    result = dc.load(request, case.ckpt_dir, strict=dc.StrictHandling.RETURN_ALL)
    assert isinstance(result, tuple)
    loaded, missing, unexpected = result
    assert set(missing) == (set(case.tensors) - {first}) | set(case.objects)
    assert set(unexpected) == {"not.in.checkpoint"}
    assert_tensor_bitwise(loaded["a"], _global(case, first), f"{case.id} {first}")
    assert "b" not in loaded


def test_loading_legacy_checkpoints_registers_no_megatron_module() -> None:
    """0.13.1's .metadata names a Megatron class; loading must not fake a ``megatron``
    package in sys.modules (it would shadow a real Megatron-Core install)."""

    def megatron_modules() -> set[str]:
        return {m for m in sys.modules if m == "megatron" or m.startswith("megatron.")}

    before = megatron_modules()
    for case in CASES:
        if case.is_legacy:
            dc.load_tensors_metadata(case.ckpt_dir)
            dc.load_sharded_metadata(case.ckpt_dir)
            dc.load(
                build_state_dict(whole_layout(case, 1, flat_keys_flat=True).ranks[0]), case.ckpt_dir
            )
    assert megatron_modules() == before


def test_wrong_global_shape_names_the_key() -> None:
    case = next(c for c in CASES if c.id == "0.13.1-grid2x2")
    request = {"w": dc.ShardedTensor.from_rank_offsets("grid.w", torch.zeros(8, 7))}
    with pytest.raises(CheckpointingException) as info:
        dc.load(request, case.ckpt_dir)
    assert "grid.w" in str(info.value)
    assert "(8, 6)" in str(info.value) or "[8, 6]" in str(info.value)


# --------------------------------------------------------------------------------------------
# The fixtures themselves
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_checkpoint_files_match_manifest(case: GoldenCase) -> None:
    """The copies are byte-identical to what Megatron wrote, and nothing (our loads
    included) added or changed a file."""
    files = {f["name"]: f for f in case.manifest["files"]}
    assert sorted(os.listdir(case.ckpt_dir)) == sorted(files)
    for name, info in files.items():
        path = case.ckpt_dir / name
        assert path.stat().st_size == info["size"], name
        assert sha256_of(path) == info["sha256"], name


def test_golden_readme_present() -> None:
    assert (GOLDEN_DIR / "README.md").is_file()
