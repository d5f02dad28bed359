"""Code examples in the docs run as tests.

Every ``.. code-block:: python`` in ``docs/*.rst`` with the option ``:class: runnable`` is
extracted and run as a script in a fresh interpreter, as one rank: ``sys.argv[1]`` is an
empty temporary directory (the working directory too), and the environment has what
``torchrun`` would set for a world of one (``RANK=0``, ``WORLD_SIZE=1``, ``MASTER_ADDR``,
``MASTER_PORT``), so ``dist.init_process_group("gloo")`` works unchanged. Blocks without
the option (fragments, multi-rank launch lines) are only built by Sphinx.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BLOCK = re.compile(
    r"^\.\. code-block:: python\n((?:[ \t]+:[\w-]+:.*\n)*)\n((?:(?:[ \t]+.*)?\n)+)", re.M
)


def runnable_blocks() -> list[tuple[str, str]]:
    found = []
    for page in sorted(DOCS.glob("*.rst")):
        text = page.read_text(encoding="utf-8")
        for n, match in enumerate(BLOCK.finditer(text)):
            if ":class: runnable" in match.group(1):
                found.append((f"{page.stem}-{n}", textwrap.dedent(match.group(2))))
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_docs_have_runnable_examples() -> None:
    pages = {name.rsplit("-", 1)[0] for name, _ in runnable_blocks()}
    assert {"quickstart", "concepts", "async", "cli"} <= pages, pages


@pytest.mark.parametrize(("name", "code"), runnable_blocks(), ids=[n for n, _ in runnable_blocks()])
def test_docs_example_runs(name: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / f"{name}.py"
    script.write_text(code, encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ)
    env.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, str(script), str(work)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"{name} failed:\n{code}\n--- stderr:\n{proc.stderr[-3000:]}"
