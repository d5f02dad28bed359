"""Suite-wide pytest configuration.

- Tests marked ``gpu`` are skipped when no CUDA device is available.
- Every test gets a fresh strategy registry (changes made by a test are undone).
- Multi-rank tests use :func:`tests.support.harness.run_distributed`; parametrize their world size with
  :func:`tests.support.harness.world_sizes` (``@world_sizes(1, 2, 4)``) or take the ``world_size``
  fixture below, which runs the test with 1, 2 and 4 ranks.
- ``msc_store`` (session): a moto S3 server on 127.0.0.1 and MSC profiles for ``msc://`` tests
  (:mod:`tests.support.msc_server`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.harness import cuda_device_count
from tests.support.msc_server import msc_store  # noqa: F401 - the session's S3 server fixture

DEFAULT_WORLD_SIZES = (1, 2, 4)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_device_count() > 0:
        return
    skip_gpu = pytest.mark.skip(reason="marked gpu and no CUDA device is available")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


@pytest.fixture(params=DEFAULT_WORLD_SIZES, ids=[f"ws{size}" for size in DEFAULT_WORLD_SIZES])
def world_size(request: pytest.FixtureRequest) -> int:
    """World size of a multi-rank test: 1, 2 and 4 (override with ``@world_sizes(...)``)."""
    return int(request.param)


@pytest.fixture(autouse=True)
def fresh_registry() -> Iterator[None]:
    """Registrations a test makes in the default-strategy registry are undone after it."""
    from dist_checkpointing.strategies.base import isolated_registry

    with isolated_registry():
        yield
