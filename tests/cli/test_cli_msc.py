"""Every CLI command on ``msc://`` checkpoints (moto's S3 server and a posix MSC profile),
and an ``msc://`` path without multi-storage-client installed (a fresh interpreter in which
the import fails)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dist_checkpointing
from dist_checkpointing import ShardedTensor
from dist_checkpointing.cli import main
from dist_checkpointing.engine.storage.location import CheckpointDir
from tests.support.msc_server import PROFILES, MscStore

TENSORS = {
    "model.w": torch.randn(6, 4),
    "opt.m": torch.tensor([float("nan"), 1.0, float("inf"), -2.0]),
}


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _save(url: str, scale: float = 1.0) -> None:
    sd = {k: ShardedTensor.from_rank_offsets(k, v * scale) for k, v in TENSORS.items()}
    dist_checkpointing.save(sd, url, verify_integrity=True)


@pytest.mark.parametrize("profile", PROFILES)
def test_every_command_on_msc(
    msc_store: MscStore, profile: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("multistorageclient")
    url = msc_store.url(profile)
    _save(url)
    code, out, _ = run(capsys, "inspect", url, "--json")
    info = json.loads(out)
    assert code == 0 and info["path"] == url and info["files"] >= 4
    assert {t["key"] for t in info["tensors"]} == set(TENSORS)
    code, out, _ = run(capsys, "show", url, "opt.m", "--json")
    stats = json.loads(out)
    assert code == 0 and (stats["nan"], stats["inf"], stats["min"]) == (1, 1, -2.0)
    code, out, _ = run(capsys, "verify", url)
    assert code == 0 and "sha256" in out, out
    other = msc_store.url(profile, "other")
    _save(other, scale=2.0)
    code, out, _ = run(capsys, "diff", url, other, "--values")
    assert code == 1 and "values: model.w" in out
    code, out, _ = run(capsys, "convert", url, tmp_path / "model.pt", "--to", "torch")
    assert code == 0
    assert torch.equal(torch.load(tmp_path / "model.pt")["model.w"], TENSORS["model.w"])
    back = msc_store.url(profile, "back")
    code, out, err = run(capsys, "convert", tmp_path / "model.pt", back, "--to", "dist")
    assert code == 0, err
    code, out, _ = run(capsys, "diff", url, back, "--values")
    assert code == 0 and "no differences" in out
    code, out, _ = run(capsys, "rm", url, "--prefix", "opt.")
    assert code == 0 and "removed 1 tensor(s)" in out
    code, out, _ = run(capsys, "inspect", url, "--json")
    assert {t["key"] for t in json.loads(out)["tensors"]} == {"model.w"}


def test_cli_errors_on_msc_name_the_url(
    msc_store: MscStore, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("multistorageclient")
    missing = msc_store.url("s3", "never-saved")
    code, _, err = run(capsys, "inspect", missing)
    assert code == 2 and missing in err and "not a directory" in err
    url = msc_store.url("local")
    _save(url)
    CheckpointDir.of(url).remove("__0_0.distcp")
    code, out, err = run(capsys, "verify", url)
    assert code != 0 and "__0_0.distcp" in out + err
    code, _, err = run(capsys, "convert", url, "msc://s3/x/model.pt", "--to", "torch")
    assert code == 2 and "local file" in err


_NO_MSC = """
import sys
sys.modules["multistorageclient"] = None  # as if the package were not installed
{body}
"""


def _without_msc(body: str) -> subprocess.CompletedProcess[str]:
    code = _NO_MSC.format(body=textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_without_the_package_the_api_says_what_to_install() -> None:
    done = _without_msc(
        """
        import dist_checkpointing
        from dist_checkpointing.errors import MissingDependencyError
        for call in (dist_checkpointing.load_common_state_dict, dist_checkpointing.verify):
            try:
                call("msc://s3/ckpt")
            except MissingDependencyError as exc:
                print("refused:", exc)
        """
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stdout
    assert all("pip install dist_checkpointing[msc]" in line for line in lines)


def test_without_the_package_the_cli_says_what_to_install() -> None:
    done = _without_msc(
        """
        from dist_checkpointing.cli import main
        sys.exit(main(["inspect", "msc://s3/ckpt"]))
        """
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "pip install dist_checkpointing[msc]" in done.stderr
