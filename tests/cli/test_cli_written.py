"""The CLI on checkpoints the tests write, conversions both ways, and bad inputs."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dist_checkpointing
from dist_checkpointing import ShardedTensor
from dist_checkpointing.cli import main
from tests.support.golden_utils import assert_tensor_bitwise

TENSORS = {
    "model.w": torch.randn(6, 4),
    "model.b": torch.arange(5, dtype=torch.int64),
    "model.h": torch.randn(4, 2).to(torch.bfloat16),
    "opt.m": torch.tensor([float("nan"), 1.0, float("inf"), -2.0]),
}


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A one-rank checkpoint (no process group) with an integrity manifest."""
    path = tmp_path / "ckpt"
    path.mkdir()
    sd = {k: ShardedTensor.from_rank_offsets(k, v.clone()) for k, v in TENSORS.items()}
    sd["iteration"] = 7  # type: ignore[assignment]
    dist_checkpointing.save(sd, path, verify_integrity=True)
    return path


def test_inspect_show_verify(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "inspect", ckpt, "--key", "model.*", "--json")
    assert code == 0
    assert {t["key"] for t in json.loads(out)["tensors"]} == {"model.w", "model.b", "model.h"}
    code, out, _ = run(capsys, "show", ckpt, "opt.m", "--json")
    stats = json.loads(out)
    assert (stats["nan"], stats["inf"], stats["min"], stats["max"]) == (1, 1, -2.0, 1.0)
    code, out, _ = run(capsys, "show", ckpt, "model.w", "--slice", "2", "--json")
    assert json.loads(out)["shape"] == [4]
    assert json.loads(out)["max"] == TENSORS["model.w"][2].max().item()
    code, out, _ = run(capsys, "verify", ckpt)
    assert code == 0 and "sha256" in out


def test_verify_finds_corruption_and_truncation(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = next(p for p in ckpt.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    code, out, _ = run(capsys, "verify", ckpt)
    assert code == 1 and "sha256 differs" in out
    data.write_bytes(bytes(raw[:10]))
    code, out, _ = run(capsys, "verify", ckpt)
    assert code == 1 and "truncated" in out
    data.unlink()
    code, out, _ = run(capsys, "verify", ckpt)
    assert code == 1 and "missing" in out


def test_incomplete_checkpoint(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (ckpt / "metadata.json").unlink()
    (ckpt / ".metadata").unlink()
    code, out, _ = run(capsys, "inspect", ckpt, "--json")
    assert code == 1 and json.loads(out)["complete"] is False
    code, out, err = run(capsys, "show", ckpt, "model.w")
    assert code == 2 and "incomplete" in err and err.count("\n") == 1
    assert run(capsys, "verify", ckpt)[0] == 1


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_round_trip_through_dist(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str, ranks: int
) -> None:
    single = tmp_path / ("model.pt" if fmt == "torch" else "hf")
    assert run(capsys, "convert", ckpt, single, "--to", fmt)[0] == 0
    back = tmp_path / "back"
    code, _, err = run(capsys, "convert", single, back, "--to", "dist", "--ranks", ranks)
    assert code == 0, err
    loaded = dist_checkpointing.load_plain_tensors(back)
    for key, value in TENSORS.items():
        assert_tensor_bitwise(loaded[key], value, key)
    if fmt == "torch":
        assert dist_checkpointing.load_common_state_dict(back)["iteration"] == 7
    code, out, _ = run(capsys, "inspect", back, "--json")
    shards = {t["key"]: t["shards"] for t in json.loads(out)["tensors"]}
    assert shards["model.w"] == ranks  # 6 rows split over the ranks
    assert run(capsys, "diff", ckpt, back, "--values")[0] == 0


def test_diff_values(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other"
    other.mkdir()
    changed = dict(TENSORS, **{"model.b": TENSORS["model.b"] + 3})
    sd = {k: ShardedTensor.from_rank_offsets(k, v.clone()) for k, v in changed.items()}
    dist_checkpointing.save(sd, other)
    code, out, _ = run(capsys, "diff", ckpt, other, "--values")
    assert code == 1 and out.strip() == "values: model.b: max abs diff 3.0"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_plain_dcp_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dcp.save({"x": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=str(tmp_path), no_dist=True)
    code, out, _ = run(capsys, "inspect", tmp_path)
    assert code == 0 and "plain DCP" in out
    code, out, _ = run(capsys, "show", tmp_path, "x", "--json")
    assert json.loads(out)["max"] == 5.0


BAD = [
    (["inspect", "{tmp}/nope"], "not a directory"),
    (["inspect", "{tmp}"], "not a checkpoint"),
    (["show", "{ckpt}", "no.such.key"], "no tensor"),
    (["show", "{ckpt}", "model.w", "--slice", "0:2,9"], "bad slice"),
    (["show", "{ckpt}", "model.w", "--slice", "a:b"], "bad slice"),
    (["show", "{ckpt}", "model.w", "--slice", "1,1,1"], "axes"),
    (["convert", "{ckpt}", "/proc/nope/model.pt", "--to", "torch"], "does not exist"),
    (["convert", "{ckpt}", "{ro}/model.pt", "--to", "torch"], "not writable"),
    (["convert", "{ckpt}", "{tmp}", "--to", "torch"], "is a directory"),
    (
        ["convert", "{ckpt}", "{tmp}/x", "--to", "safetensors", "--max-shard-size", "5XB"],
        "invalid size",
    ),
    (["convert", "{ckpt}", "{tmp}/x", "--to", "torch", "--keys", "zzz*"], "no tensor matches"),
    (["convert", "{tmp}/garbage.pt", "{tmp}/x", "--to", "dist"], "neither"),
    (["convert", "{tmp}/bad.pt", "{tmp}/x", "--to", "dist"], "not a loadable"),
    (["convert", "{ckpt}", "{tmp}/x", "--to", "dist"], "already a sharded checkpoint"),
    (["convert", "{ckpt}", "{ckpt}/metadata.json", "--to", "torch"], "inside the source"),
    (["convert", "{ckpt}", "{ckpt}/common.pt", "--to", "torch"], "inside the source"),
    (["convert", "{ckpt}", "{ckpt}/sub", "--to", "safetensors"], "inside the source"),
    (["convert", "{ckpt}", "{ckpt}", "--to", "raw_bytes"], "inside the source"),
    (["convert", "{ckpt}", "{tmp}/garbage.pt", "--to", "torch"], "already exists"),
    (["rm", "{ckpt}", "--prefix", "zzz"], "no tensor key starts with"),
    (["diff", "{ckpt}", "{tmp}"], "not a checkpoint"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a[:2]) + m for a, m in BAD])
def test_bad_input_is_one_line(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    (work / "garbage.pt").write_bytes(b"hello world")
    (work / "bad.pt").write_bytes(b"PK\x03\x04 truncated zip")
    fill = {"tmp": work, "ckpt": ckpt, "ro": ro}
    try:
        code, _, err = run(capsys, *[a.format(**fill) for a in argv])
    finally:
        ro.chmod(0o700)
    if os.geteuid() == 0 and "{ro}" in " ".join(argv):
        pytest.skip("root can write anywhere")
    assert code != 0
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert message in err, err
    assert "Traceback" not in err


def test_unsafe_common_state_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A torch.save file whose pickle names a class is not unpickled."""
    src = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "obj": Path("/etc")}, src)
    code, _, err = run(capsys, "convert", src, tmp_path / "out", "--to", "dist")
    assert code == 2 and "not a loadable" in err
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")
    shutil.rmtree(tmp_path / "out", ignore_errors=True)


@pytest.mark.parametrize(
    "argv", [[], ["show", "x"], ["convert", "a", "b", "--to", "xx"], ["inspect", "--bogus", "d"]]
)
def test_usage_errors_are_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.count("\n") == 1 and err.startswith("error: "), err


def test_a_refused_conversion_leaves_the_source_as_it_was(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: ``convert SRC SRC/metadata.json --to torch`` replaced a file of the
    checkpoint it read (exit 0), which then no longer loaded."""
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    for dst, to in [(ckpt / "metadata.json", "torch"), (ckpt / "sub", "safetensors")]:
        code, _, err = run(capsys, "convert", ckpt, dst, "--to", to)
        assert code == 2 and "inside the source" in err, err
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    sd = {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in TENSORS.items()}
    out = dist_checkpointing.load(sd, ckpt)
    for k, v in TENSORS.items():
        assert_tensor_bitwise(out[k], v, k)


def test_a_scalar_converts_from_safetensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: a 0-d tensor in a safetensors file failed ``--to dist`` ("slice()
    cannot be applied to a 0-dim tensor")."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    src = tmp_path / "model.safetensors"
    tensors = {"scale": torch.tensor(1.5), "w": torch.arange(6.0).reshape(3, 2)}
    safetensors_torch.save_file(tensors, str(src))
    code, _, err = run(capsys, "convert", src, tmp_path / "out", "--to", "dist")
    assert code == 0, err
    request = {
        k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in tensors.items()
    }
    out = dist_checkpointing.load(request, tmp_path / "out")
    for k, v in tensors.items():
        assert_tensor_bitwise(out[k], v, k)
