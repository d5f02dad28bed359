"""Loading from a ``raw_bytes`` checkpoint: the index, the request, the metadata.

Call sequence of one load (every rank, no collective here; the strategy raises a
failure on every rank):

1. :func:`read_index`: ``.raw_index`` read through the checkpoint handle (checked
   against the commit record), parsed once per handle;
2. :func:`load_leaves`: narrow a large index to the entries the request can use
   (:mod:`.request_rows`), plan every requested leaf (:mod:`.load_plan`), read
   (:mod:`.reader`), run the copies, stream the whole entries that go to
   accelerator tensors through the staging pool (:func:`fill_devices`), unpickle
   the objects with the caller's restricted loader.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ...mapping import ShardedBase, ShardedObject, ShardedStateDict, ShardedTensor
from .. import knobs
from ..storage.location import CheckpointDir
from ..storage.staging_pool import callers_stream, fill_from_host
from ..storage.tensor_bytes import buffer_of
from .index import INDEX_NAME, KIND_FLAT, KIND_OBJECT, RawIndex, parse_index
from .load_plan import LoadPlanner, finish_objects
from .reader import RawReader, Read
from .request_rows import KeyTable, key_table, rows_for, subset
from .reshard_plan import LoadPlan


def read_index(ckpt: CheckpointDir) -> RawIndex:
    """The checkpoint's parsed index (parsed once per handle)."""
    return ckpt.memo(
        INDEX_NAME, lambda: parse_index(ckpt.read_bytes(INDEX_NAME), ckpt.path(INDEX_NAME))
    )


def verifying(ckpt: CheckpointDir) -> bool:
    """Whether this load verifies checksums (the commit protocol set it up to)."""
    return ckpt.context.on_read is not None


def load_leaves(
    leaves: Iterable[ShardedBase],
    ckpt: CheckpointDir,
    load_object: Callable[[bytes, str], Any],
) -> None:
    """Fill every leaf: tensors in place (``data`` allocated on the CPU if None),
    objects' ``data`` set to the unpickled payload."""
    leaves = list(leaves)
    index = narrowed(ckpt, read_index(ckpt), leaves)
    planner = LoadPlanner(index)
    for sh in leaves:
        if isinstance(sh, ShardedTensor):
            if sh.data is None:
                sh.init_data("cpu", torch.zeros if sh.allow_shape_mismatch else torch.empty)
            fr = sh.flattened_range
            if fr is not None and fr.stop <= fr.start:
                continue
            planner.add_tensor(sh)
        elif isinstance(sh, ShardedObject):
            planner.add_object(sh)
    plan = planner.finish()
    reader = RawReader(ckpt, index, verifying(ckpt))
    reader.run(plan.reads)
    for copy in plan.copies:
        copy()
    fill_devices(reader, plan)
    finish_objects(plan, load_object)


def narrowed(ckpt: CheckpointDir, index: RawIndex, leaves: list[ShardedBase]) -> RawIndex:
    """``index``, or where it is large against the request (``RAW_NARROW_ENTRIES``:
    below it, planning over the whole index costs less than narrowing it), the part of
    it that ``leaves`` can use (:mod:`.request_rows`; the key numbers are kept once per
    handle)."""
    least, n = knobs.RAW_NARROW_ENTRIES.get(), len(index.entries)
    if least and (n < least or n < 8 * len(leaves)):
        return index
    return subset(index, rows_for(index, _key_table(ckpt, index), leaves))


def fill_devices(reader: RawReader, plan: LoadPlan) -> None:
    """Read the plan's whole entries for accelerator tensors through its staging pool:
    a chunk (a pool buffer, whole checksum blocks) is read and verified, then copied to
    the device while the next chunk is read. Host memory: the pool's budget.

    Several tensors are filled at once, one per reading thread (at most one per pool
    buffer), each thread on the caller's CUDA stream, as the ``torch_dist`` reader fills
    them; a lone tensor's chunks are read by all the threads instead. Every fill is
    finished, then the first failure in plan order is raised."""
    pool = plan.pool
    fills = plan.device_fills
    if pool is None or not fills:  # the planner streams only through a pool
        return
    offsets = reader.index.columns["offset"]
    nbytes = sum(int(t.nbytes) for _, t in fills)
    threads = min(len(fills), pool.capacity, reader.threads_for(len(fills), nbytes))
    alongside = threads if threads > 1 else 0

    def fill(row: int, target: torch.Tensor) -> None:
        def read(at: int, host: torch.Tensor) -> None:
            n = host.numel()
            reader.run([Read(row, at, n, buffer_of(host), offsets[row] + at)], alongside)

        fill_from_host(target, read, pool)

    if threads <= 1:
        for row, target in fills:
            fill(row, target)
        return
    on_callers_stream = callers_stream()

    def fill_on_stream(row: int, target: torch.Tensor) -> None:
        with on_callers_stream():
            fill(row, target)

    with ThreadPoolExecutor(threads, thread_name_prefix="dist-ckpt-fill") as workers:
        jobs = [workers.submit(fill_on_stream, row, target) for row, target in fills]
    for job in jobs:
        job.result()


def key_heads(ckpt: CheckpointDir) -> RawIndex:
    """The first entry of every key of the checkpoint's index, in index order: what
    :func:`tensors_metadata` and :func:`objects_metadata` describe a key by (one entry
    per key, not one per rank's chunk)."""
    index = read_index(ckpt)
    ids = _key_table(ckpt, index).ids
    return subset(index, np.sort(np.unique(ids, return_index=True)[1]))


def tensors_metadata(index: RawIndex) -> ShardedStateDict:
    """Data-less ShardedTensors (global shape and dtype) of every stored tensor (described
    by the first entry of each key: ``index`` may be :func:`key_heads`)."""
    out: ShardedStateDict = {}
    kinds = index.columns["kind"]
    for key, rows in index.rows_by_key.items():
        row = rows[0]
        if kinds[row] == KIND_OBJECT:
            continue
        shape, _, _ = index.box(row)
        dtype = index.dtype_of(row)
        if kinds[row] == KIND_FLAT:
            numel = int(torch.Size(shape).numel())
            flat = torch.empty(numel, dtype=dtype, device="meta")
            out[key] = ShardedTensor.from_rank_offsets_flat(
                key, flat, shape, flattened_range=slice(0, numel)
            ).without_data()
        else:
            meta = torch.empty(shape, dtype=dtype, device="meta")
            out[key] = ShardedTensor.from_rank_offsets(key, meta).without_data()
    return out


def objects_metadata(index: RawIndex) -> ShardedStateDict:
    """Data-less ShardedObjects of every stored object, by unique key."""
    kinds = index.columns["kind"]
    out: ShardedStateDict = {}
    for key, rows in index.rows_by_key.items():
        if kinds[rows[0]] == KIND_OBJECT:
            obj = ShardedObject.empty_from_unique_key(key)
            out[obj.unique_key] = obj
    return out


def files_holding(ckpt: CheckpointDir, keys: set[str]) -> set[str]:
    """Names of the data files holding entries of ``keys`` (vectorized over the entries,
    with the key table kept per handle)."""
    index = read_index(ckpt)
    table = _key_table(ckpt, index)
    wanted = np.zeros(len(table.names) + 1, dtype=bool)
    wanted[[table.by_name[k] for k in keys if k in table.by_name]] = True
    rows = wanted[table.ids] if len(table.ids) else np.zeros(0, dtype=bool)
    return {index.files[f] for f in np.unique(index.entries["file"][rows]).tolist()}


def _key_table(ckpt: CheckpointDir, index: RawIndex) -> KeyTable:
    return ckpt.memo(INDEX_NAME + "#keys", lambda: key_table(index))


__all__ = [
    "files_holding",
    "key_heads",
    "load_leaves",
    "narrowed",
    "objects_metadata",
    "read_index",
    "tensors_metadata",
]
