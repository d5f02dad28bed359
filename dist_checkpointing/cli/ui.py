"""Output helpers of the CLI: sizes, tables and progress bars.

Progress bars come from ``tqdm`` (the ``[cli]`` extra) when it is installed and
stderr is a terminal; otherwise :func:`progress` is silent. Tables are plain text.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


class CliError(Exception):
    """A bad input: printed as one line, exit code 2 (1 for a failed verification)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5e9, ``"512MiB"`` -> 512 * 2**20, ``"1000"`` -> 1000."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS:
        raise CliError(f"invalid size {text!r} (examples: 5GB, 500MB, 512MiB)")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise CliError(f"invalid size {text!r}: must be positive")
    return size


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"  # pragma: no cover


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A left-aligned plain-text table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class Progress(Protocol):
    def update(self, n: int) -> object: ...


class _Silent:
    def update(self, n: int) -> None:
        return None


@contextmanager
def progress(total: int, desc: str, enabled: bool | None = None) -> Iterator[Progress]:
    """A byte progress bar on stderr (only on a terminal, only with tqdm installed)."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    bar: Any = None
    if enabled:
        try:
            from tqdm import tqdm
        except ImportError:
            bar = None
        else:
            bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False)
    if bar is None:
        yield _Silent()
        return
    try:
        yield bar
    finally:
        bar.close()


__all__ = ["CliError", "Progress", "human_bytes", "parse_size", "progress", "table"]
