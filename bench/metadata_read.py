"""What one rank of a load spends reading a ``torch_dist`` checkpoint's metadata files.

    python bench/metadata_read.py [--tensors 100000] [--chunks 1] [--stages 1 2 4 8]
                                  [--repeat 6]

Builds, in one process, the JSON metadata index (``.metadata_index.json``) and the
commit record (``commit.json``) of a checkpoint of ``--tensors`` tensors, each in
``--chunks`` row blocks (tensor parallelism), saved by ``max(--stages)`` ranks (one data
file each), then times what a loading rank does with them:

- ``index, whole``: ``decode_index`` of every key, every item built (``read_metadata``);
- ``index, 1/S``: ``decode_index`` of the keys of one of ``S`` pipeline stages (a
  contiguous quarter of the layers for ``S = 4``), as ``read_metadata_of`` does, then
  the items of the first row block of each of them built (``PendingItems.prepare``, as
  the reader does for the reads a load planned): with ``S = 1``, a tensor-parallel rank
  that requests every key;
- ``record``: ``CommitRecord.from_bytes``, then the first use of one data file's
  checksums (the files a rank reads are parsed when first used).

Each figure is the minimum and the median of ``--repeat`` runs (garbage collection
off, as in a load).
"""

from __future__ import annotations

import argparse
import gc
import pickle
import random
import statistics
import time
from collections.abc import Callable

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dist_checkpointing._torch_compat import StorageInfo
from dist_checkpointing.engine.checkpoint.record import CommitRecord
from dist_checkpointing.engine.storage.item_checksums import DataFileEntry
from dist_checkpointing.engine.storage.metadata_index import decode_index, encode_index


def _checkpoint(tensors: int, files: int, blocks: int) -> tuple[Metadata, bytes, bytes, list[str]]:
    """Metadata, its pickle, its index and the keys in order, of ``tensors`` tensors of
    ``blocks`` x 256 floats in ``blocks`` row blocks, written to ``files`` data files."""
    entries, storage = {}, {}
    props = TensorProperties(dtype=torch.float32)
    size, block = torch.Size([blocks, 256]), torch.Size([1, 256])
    chunks = [ChunkStorageMetadata(torch.Size([b, 0]), block) for b in range(blocks)]
    keys = [f"decoder.layers.{i // 8}.mlp.linear_fc{i % 8}.weight" for i in range(tensors)]
    per_file = -(-tensors * blocks // files)
    for i, key in enumerate(keys):
        entries[key] = TensorStorageMetadata(props, size, chunks)
        for b, chunk in enumerate(chunks):
            n = i * blocks + b
            name = f"__{n // per_file}_0.distcp"
            storage[MetadataIndex(key, chunk.offsets)] = StorageInfo(
                name, (n % per_file) * 1536, 1536
            )
    md = Metadata(entries, storage_data=storage)
    md.mcore_data = {k: {} for k in keys}  # type: ignore[attr-defined]
    blob = pickle.dumps(md)
    index = encode_index(md, blob)
    assert index is not None
    return md, blob, index, keys


def _record(tensors: int, files: int) -> bytes:
    record = CommitRecord(save_id="0" * 32, world_size=files, block_bytes=1 << 20)
    per_file = -(-tensors // files)
    rng = random.Random(0)
    for f in range(files):
        n = min(per_file, tensors - f * per_file)
        record.data_files[f"__{f}_0.distcp"] = DataFileEntry.from_columns(
            n * 1536,
            [i * 1536 for i in range(n)],
            [1536] * n,
            [[rng.getrandbits(32)] for _ in range(n)],
        )
    return record.to_bytes()


def _stage(index: bytes, blob: bytes, keys: set[str], reads: list[MetadataIndex]) -> Metadata:
    """The metadata of ``keys`` with the items of ``reads`` built."""
    md = decode_index(index, blob, "idx", keys)
    assert md is not None
    prepare = getattr(md.storage_data, "prepare", None)
    if prepare is not None:
        prepare(reads)
    return md


def _times(fn: Callable[[], object], repeat: int) -> str:
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        out.append(time.perf_counter() - start)
        del result
        gc.collect()
    return f"{min(out) * 1e3:9.2f} {statistics.median(out) * 1e3:9.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tensors", type=int, default=100_000)
    parser.add_argument("--chunks", type=int, default=1, help="row blocks per tensor")
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeat", type=int, default=6)
    args = parser.parse_args()
    files = max(args.stages)
    _, blob, index, keys = _checkpoint(args.tensors, files, args.chunks)
    record = _record(args.tensors * args.chunks, files)
    print(
        f"{args.tensors} tensors of {args.chunks} chunk(s), {files} data files; "
        f"index {len(index) / 1e6:.1f} MB, record {len(record) / 1e6:.1f} MB"
    )
    print(f"{'step':<22} {'min ms':>9} {'median ms':>9}")
    gc.disable()
    try:
        whole = _times(lambda: decode_index(index, blob, "idx"), args.repeat)
        print(f"{'index, whole':<22} {whole}")
        for stages in args.stages:
            part = set(keys[: -(-len(keys) // stages)])
            reads = [MetadataIndex(k, torch.Size([0, 0])) for k in part]
            timed = _times(lambda p=part, r=reads: _stage(index, blob, p, r), args.repeat)
            print(f"{'index, 1/' + str(stages):<22} {timed}")

        def first_use() -> None:
            parsed = CommitRecord.from_bytes(record, "rec")
            parsed.data_files["__0_0.distcp"].item_at(0)

        parse = _times(lambda: CommitRecord.from_bytes(record, "rec"), args.repeat)
        print(f"{'record':<22} {parse}")
        print(f"{'record + one file':<22} {_times(first_use, args.repeat)}")
    finally:
        gc.enable()


if __name__ == "__main__":
    main()
