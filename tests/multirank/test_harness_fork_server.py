"""The harness's ranks survive a test module that computes a sizable tensor at import.

The fork server imports the collected test modules; this one's tensor below is large
enough for torch to run a parallel region on its OpenMP pool. Without the fork server
running torch on one thread (``tests/support/fork_server.py``), every rank forked
afterwards hangs in its first parallel operation, until the harness's timeout.
"""

from __future__ import annotations

import torch

from tests.support.harness import run_distributed

_AT_IMPORT = torch.arange(1 << 18) % 7  # a parallel region wherever this module is imported


def _parallel_op() -> int:
    torch.set_num_threads(2)  # a pool in the rank, whatever its share of the cores
    return int((torch.arange(3 << 20) % 5).sum())


def test_ranks_run_parallel_ops_after_an_import_time_tensor() -> None:
    expected = int((torch.arange(3 << 20) % 5).sum())
    assert run_distributed(_parallel_op, 2, timeout=60.0) == [expected, expected]
