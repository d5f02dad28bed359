"""One ``raw_bytes`` save of a process group, as an :class:`AsyncRequest`.

Call sequence (every rank; "C" is the coordinator):

1. :func:`save_request` (in ``save``): plan the rank's files and index piece
   (:func:`.writer.plan_rank`, or the strategy's :class:`.plan_reuse.LayoutCache`,
   which reuses the last layout for an unchanged structure; no collective) and
   return the request;
2. its ``preload_fn`` (a :class:`.writer.StageRankWrite`) stages accelerator
   tensors to host memory (the blocking part of an async save; the persistent
   caller stages into its snapshot arena; a synchronous save stages nothing up
   front and streams them through the staging pool while writing);
3. its ``async_fn`` (:func:`write_and_report`) writes the rank's data files,
   in this process (sync save) or a background one (async save), and reports the
   item checksums and, for a save that records an integrity manifest, each file's
   sha256 (or the failure) through a results queue;
4. its finalize function (:func:`finalize`): every rank collects its outcome,
   C gathers the index pieces (a rank whose outcome failed sends none), writes
   ``.raw_index`` (staged by the commit protocol, recorded in ``commit.json``)
   and hands the data files to the commit record; one all-reduce then raises
   any rank's failure on every rank. The commit itself follows
   (``metadata.json``, ``commit.json``).
"""

from __future__ import annotations

import functools
import logging
import queue
from typing import Any

import numpy as np

from ...errors import CheckpointWriteError
from ...mapping import ShardedBase
from .. import knobs
from ..async_save.request import AsyncRequest
from ..collectives import RankGroup
from ..process import format_current_exception
from ..storage.item_checksums import DataFileEntry
from ..storage.location import CheckpointDir
from ..storage.results_channel import FileResultsQueue
from .data_files import FileWritten, write_rank
from .index import INDEX_NAME
from .pieces import IndexPiece, merged_encoding
from .plan_reuse import LayoutCache
from .writer import RankWrite, StageRankWrite, plan_rank

logger = logging.getLogger(__name__)

#: Byte alignment of every item in a data file (a multiple of every element size
#: and of a cache line).
ALIGNMENT = 64


def write_and_report(wr: RankWrite, results: Any) -> None:
    """Write ``wr`` and put ``("ok", checksums)`` or ``("error", text)`` into ``results``
    (module-level: the async callers run it in another process)."""
    try:
        outcome: tuple[str, Any] = ("ok", write_rank(wr))
    except Exception:
        results.put(("error", format_current_exception(f"rank writing {', '.join(wr.names)}")))
        raise  # the async machinery fails the save on every rank
    results.put(outcome)


def _outcome(results: Any, names: list[str], rank: int) -> list[FileWritten]:
    timeout = knobs.RESULTS_TIMEOUT_S.get()
    try:
        status, value = results.get(timeout=timeout)
    except queue.Empty:
        raise CheckpointWriteError(
            f"rank {rank}: no write results within {timeout:.0f}s for {', '.join(names)}"
        ) from None
    finally:
        close = getattr(results, "close", None)
        if close is not None:
            close()
    if status != "ok":
        raise CheckpointWriteError(
            f"Worker failure: rank {rank} writing {', '.join(names)}: {value}"
        )
    return list(value)


def finalize(
    ckpt: CheckpointDir, group: RankGroup, wr: RankWrite, piece: IndexPiece, results: Any
) -> None:
    """Step 4 of the module docstring (every rank)."""
    error: BaseException | None = None
    try:
        files = _outcome(results, wr.names, group.rank) if wr.names else []
        if files:
            piece.crcs = np.concatenate([f.crcs for f in files]).astype("<u4", copy=False)
        digests = {n: f.sha256 for n, f in zip(wr.names, files) if f.sha256 is not None}
        ckpt.context.file_digests.update(digests)  # for the integrity manifest
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = exc
    # One verdict for the writes and the index: a rank whose results failed sends no
    # piece, and the coordinator then writes no index.
    pieces = group.gather(None if error is not None else piece)
    if pieces is not None and error is None:
        try:
            failed = [rank for rank, p in enumerate(pieces) if p is None]
            if failed:
                raise CheckpointWriteError(f"{ckpt}: no write results from rank(s) {failed}")
            _write_index(ckpt, pieces, wr.block_bytes)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
    group.fail_together(error, f"Writing {ckpt} and its index")


def _write_index(ckpt: CheckpointDir, pieces: list[IndexPiece], block_bytes: int) -> None:
    index, data = merged_encoding(pieces, ALIGNMENT, block_bytes)
    ckpt.atomic_write(INDEX_NAME, data)
    on_data_files = ckpt.context.on_data_files
    if on_data_files is not None:  # the checksums live in the index, not the record
        on_data_files({n: DataFileEntry(s) for p in pieces for n, s in zip(p.files, p.file_sizes)})
    logger.debug("%s: index of %d entries in %d files", ckpt, len(index.entries), len(index.files))


def _refuse(cause: str) -> None:
    """The ``async_fn`` of a rank whose plan failed (module-level: picklable)."""
    raise CheckpointWriteError(cause)


def save_request(
    leaves: list[ShardedBase],
    ckpt: CheckpointDir,
    group: RankGroup,
    file_count: int,
    in_process: bool,
    cache: LayoutCache | None = None,
) -> AsyncRequest:
    """Steps 1-4 as one request (see the module docstring). Planning has no collective:
    a rank whose plan fails returns a request that fails when run, so that every rank
    learns of it where the others wait (the request's agreement), none hangs."""
    block_bytes = ckpt.context.block_bytes  # 0: the WRITE_CHECKSUMS knob is off
    plan = plan_rank if cache is None else cache.plan
    try:
        wr, piece = plan(
            leaves, ckpt.root, group.rank, file_count, ALIGNMENT, block_bytes, ckpt.context.save_tag
        )
    except Exception:  # noqa: BLE001 - reported on every rank by the request
        cause = format_current_exception(f"rank {group.rank} planning its data files")
        return AsyncRequest(_refuse, (cause,), [])
    wr.digest = ckpt.context.digest_data_files
    results: Any = queue.SimpleQueue() if in_process else FileResultsQueue(group.rank)
    fin = functools.partial(finalize, ckpt, group, wr, piece, results)
    # A synchronous save with a copy-ahead budget stages nothing up front: the writer
    # streams accelerator tensors through the staging pool.
    stage = StageRankWrite(wr, deferred=in_process and knobs.COPY_AHEAD_BYTES.get() > 0)
    return AsyncRequest(write_and_report, (wr, results), [fin], preload_fn=stage)


__all__ = ["ALIGNMENT", "finalize", "save_request", "write_and_report"]
