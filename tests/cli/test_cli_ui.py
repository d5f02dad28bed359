"""Sizes, tables, progress bars, and the packaging of the CLI (extra and console script)."""

from __future__ import annotations

import ast
import io
import re
from pathlib import Path

import pytest

from dist_checkpointing.cli import ui

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("text", "size"), [("5GB", 5 * 10**9), ("512MiB", 512 * 2**20), ("1000", 1000), ("1.5kb", 1500)]
)
def test_parse_size(text: str, size: int) -> None:
    assert ui.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GB", "5XB", "0", "-1GB"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ui.CliError):
        ui.parse_size(text)


def test_table_aligns() -> None:
    assert ui.table(("a", "bb"), [("xxx", 1)]).splitlines() == ["a    bb", "---  --", "xxx  1"]


def test_progress_uses_tqdm_only_when_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tqdm")
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    with ui.progress(100, "verify", enabled=True) as bar:
        bar.update(100)
    assert "verify" in err.getvalue()
    err.truncate(0)
    with ui.progress(100, "verify") as bar:  # not a terminal: silent
        bar.update(100)
    assert err.getvalue().strip("\x00") == ""


def _setup_call() -> ast.Call:
    tree = ast.parse((ROOT / "setup.py").read_text())
    return next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"
    )


def test_cli_extra_and_console_script_are_declared() -> None:
    source = (ROOT / "setup.py").read_text()
    assert "dist-checkpointing = dist_checkpointing.cli:main_exit" in source
    assert '"cli": CLI_REQUIRES' in source and "safetensors" in source and "tqdm" in source
    extras = re.search(r'install -e "\.\[([^\]]*)\]"', (ROOT / "Makefile").read_text())
    assert extras is not None and "cli" in extras.group(1).split(",")
    assert _setup_call() is not None
    from dist_checkpointing.cli import main_exit

    with pytest.raises(SystemExit) as info:
        import sys

        old = sys.argv
        sys.argv = ["dist-checkpointing", "--help"]
        try:
            main_exit()
        finally:
            sys.argv = old
    assert info.value.code == 0
