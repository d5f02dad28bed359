"""The CLI on the golden checkpoints written by Megatron-Core 0.13 and 0.19.

Commands run in-process through :func:`dist_checkpointing.cli.main` (fast); one
test runs ``python -m dist_checkpointing`` as a subprocess.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_checkpointing.cli import main
from tests.support.golden_utils import GoldenCase, assert_tensor_bitwise, golden_cases

CASES = golden_cases()
ROOT = Path(__file__).resolve().parents[2]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_inspect_json_lists_every_key(case: GoldenCase, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "inspect", case.ckpt_dir, "--json")
    assert code == 0
    info = json.loads(out)
    assert info["complete"] is True
    assert info["ranks"] == case.world_size
    tensors = {t["key"]: t for t in info["tensors"]}
    assert set(tensors) == set(case.tensors)
    for key in case.tensors:
        assert tuple(tensors[key]["shape"]) == case.global_shape(key)
        assert tensors[key]["dtype"] == str(case.dtype(key)).removeprefix("torch.")
    expected_objects = {s["unique_key"] for o in case.objects.values() for s in o["shards"]}
    assert set(info["objects"]) == expected_objects


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_verify_passes(case: GoldenCase, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "verify", case.ckpt_dir)
    assert code == 0, out
    assert out.startswith("OK ")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_show_whole_and_slice(case: GoldenCase, capsys: pytest.CaptureFixture[str]) -> None:
    key = next(k for k in case.tensors if len(case.global_shape(k)) >= 2)
    full = case.global_tensor(key).to(torch.float64)
    code, out, _ = run(capsys, "show", case.ckpt_dir, key, "--json")
    assert code == 0
    stats = json.loads(out)
    assert stats["min"] == full.min().item() and stats["max"] == full.max().item()
    assert stats["nan"] == 0 and stats["numel"] == full.numel()
    code, out, _ = run(capsys, "show", case.ckpt_dir, key, "--slice", "1:3, ::2", "--json")
    assert code == 0
    part = full[1:3, ::2]
    stats = json.loads(out)
    assert stats["shape"] == list(part.shape)
    assert stats["max"] == part.max().item()
    assert stats["mean"] == pytest.approx(part.mean().item())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_convert_to_torch_keeps_common_state(
    case: GoldenCase, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "model.pt"
    code, _, err = run(capsys, "convert", case.ckpt_dir, out_file, "--to", "torch")
    assert code == 0, err
    state = torch.load(out_file, weights_only=True)
    for key in case.tensors:
        assert_tensor_bitwise(state[key], case.global_tensor(key), key)
    common = case.common_state()
    for name in common:
        assert name in state, f"common state {name!r} dropped"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_convert_to_safetensors_loads_with_the_package(
    case: GoldenCase, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    dst = tmp_path / "hf"
    code, _, err = run(
        capsys, "convert", case.ckpt_dir, dst, "--to", "safetensors", "--max-shard-size", "300B"
    )
    assert code == 0, err
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(case.tensors)
    loaded: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        loaded.update(safetensors_torch.load_file(str(dst / name)))
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in loaded.values()
    )
    for key in case.tensors:
        assert_tensor_bitwise(loaded[key], case.global_tensor(key), key)


def test_rm_dry_run_then_remove(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    case = next(c for c in CASES if c.name == "tp2_basic")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(case.ckpt_dir, ckpt)
    code, out, _ = run(capsys, "rm", ckpt, "--prefix", "tp_row.", "--dry-run")
    assert code == 0 and out.count("would remove") == 4
    code, out, _ = run(capsys, "inspect", ckpt, "--json")
    assert len(json.loads(out)["tensors"]) == len(case.tensors)
    code, out, _ = run(capsys, "rm", ckpt, "--prefix", "tp_row.")
    assert code == 0 and "removed 4" in out
    code, out, _ = run(capsys, "inspect", ckpt, "--json")
    assert {t["key"] for t in json.loads(out)["tensors"]} == {
        k for k in case.tensors if not k.startswith("tp_row.")
    }
    assert run(capsys, "verify", ckpt)[0] == 0


def test_diff_of_two_releases(capsys: pytest.CaptureFixture[str]) -> None:
    a = next(c for c in CASES if c.name == "tp2_basic" and c.is_legacy)
    b = next(c for c in CASES if c.name == "tp2_basic" and not c.is_legacy)
    code, out, _ = run(capsys, "diff", a.ckpt_dir, b.ckpt_dir, "--values")
    assert (code, out.strip()) == (0, "no differences")
    grid = next(c for c in CASES if c.name == "grid2x2")
    code, out, _ = run(capsys, "diff", a.ckpt_dir, grid.ckpt_dir)
    assert code == 1 and "only in B: grid.w" in out


def test_python_dash_m_runs(tmp_path: Path) -> None:
    case = CASES[0]
    env_path = {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "dist_checkpointing", "inspect", str(case.ckpt_dir)],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, **env_path},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "global shape" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "dist_checkpointing", "show", str(tmp_path), "x"],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, **env_path},
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
