"""Faults injected into a save, shared by the tests of the commit protocol."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dist_checkpointing.engine.checkpoint import commit


def save_interrupted_after_record(save: Callable[[], object]) -> None:
    """Run ``save()`` so that it stops right after writing its commit record (before
    installing the staged files); the error it raises is expected."""
    real_install = commit._install

    def crash(ckpt: object, record: object) -> None:
        raise OSError("crash after record")

    commit._install = crash  # type: ignore[assignment]
    try:
        with pytest.raises(OSError, match="crash after record"):
            save()
    finally:
        commit._install = real_install  # type: ignore[assignment]
