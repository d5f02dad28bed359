"""Faults injected into a save or into saved files, shared by the tests; and the
hypothesis settings of the property tests that damage files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

import dist_checkpointing as dcp
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


def flip_byte(path: Path, at: int, mask: int = 0x10) -> None:
    """Damage byte ``at`` of ``path`` in place (xor with ``mask``)."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ mask]))


def file_property(max_examples: int) -> settings:
    """Settings of a property test whose examples read (and damage copies of) a
    checkpoint saved once per module: no deadline (each example does file I/O)."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


# What bad_input() does to rank 1's input, and the words its error names.
BAD_INPUTS = {"list": "must be a dict", "factory": "factory of rank 1", "missing dir": "missing"}


def bad_input(how: str, state: dict[str, Any], key: str, target: Path, root: Path) -> Any:
    """``(state, target)`` spoilt as ``how`` says (a key of :data:`BAD_INPUTS`), for a
    rank that must fail before any collective of ``save`` or ``load``: the state as a
    list, the tensor at ``key`` behind a factory that raises, or a directory under
    ``root`` that does not exist instead of ``target``."""
    if how == "list":
        return list(state.values()), target
    if how == "factory":
        sh = state[key]

        def boom(key: str, t: torch.Tensor, replica_id: Any, flattened_range: Any) -> Any:
            raise ValueError("the factory of rank 1 fails")

        return {**state, key: dcp.ShardedTensorFactory(key, sh.data, boom, lambda x: x)}, target
    assert how == "missing dir", how
    return state, root / "missing"
