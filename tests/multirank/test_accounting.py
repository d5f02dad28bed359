"""One INFO line per save and load (bytes, files, seconds, GB/s, blocked time for async)
and DEBUG lines per phase, from the ``dist_checkpointing.serialization`` logger."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from tests.support.harness import run_distributed

LOGGER = "dist_checkpointing.serialization"
LINE = re.compile(
    r"(save|load) .*: rank \d+ (wrote|read) (\d+) bytes (in|from) (\d+) file\(s\), [\d.]+s, [\d.]+ GB/s"
)


def _sd(fill: float = 1.0) -> dict[str, Any]:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((256, 256), fill)), "it": 3}


def test_one_info_line_per_save_and_load(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        dc.save(_sd(), tmp_path)
        dc.load(_sd(0.0), tmp_path)
    info = [
        r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name == LOGGER
    ]
    assert len(info) == 2, info
    save_line, load_line = (LINE.search(m) for m in info)
    assert save_line and save_line.group(1) == "save" and int(save_line.group(5)) >= 1
    assert load_line and load_line.group(1) == "load"
    assert int(load_line.group(3)) == 256 * 256 * 4
    debug = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
    for phase in ("validate", "common", "plan+stage+write", "finalize", "plan+read"):
        assert phase in debug, phase


def test_nothing_is_measured_when_info_is_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        dc.save(_sd(), tmp_path)
    assert not [r for r in caplog.records if r.name == LOGGER and r.levelno < logging.WARNING]


def _async_save(path: str) -> list[str]:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger(LOGGER)
    logger.setLevel(logging.INFO)
    logger.addHandler(Keep())
    rank, world = dist.get_rank(), dist.get_world_size()
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4, 8), (0, rank, world))}
    queue = AsyncCallsQueue()
    request = dc.save(sd, path, async_sharded_save=True)
    assert request is not None
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    return records


def test_async_save_reports_blocked_time(tmp_path: Path) -> None:
    for records in run_distributed(_async_save, 2, str(tmp_path), timeout=120):
        lines = [m for m in records if m.startswith("save ")]
        assert len(lines) == 1 and LINE.search(lines[0]) and "blocked" in lines[0], records
