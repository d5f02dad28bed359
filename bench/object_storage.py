"""Save/load throughput to an S3 endpoint through ``msc://``, against local disk and raw boto3.

    torchrun --standalone --nproc_per_node=2 bench/object_storage.py [--size-mib 256] \
        [--repeat 3] [--endpoint http://host:port --bucket NAME]

Without ``--endpoint`` rank 0 starts moto's S3 server (``python -m moto.server``) on a free
port of 127.0.0.1 in its own process, and stops it at the end. Every rank uses an MSC profile
(a config file written by rank 0, named by ``MSC_CONFIG``) at that endpoint.

The state: ``--size-mib`` MiB in total, 16 float32 tensors sharded over the ranks on axis 0.
Methods, each timed barrier to barrier (slowest rank), best of ``--repeat``:

- ``msc``: ``dist_checkpointing.save`` / ``load`` to ``msc://bench/<prefix>``;
- ``local``: the same checkpoint on local disk (a temporary directory);
- ``raw``: the same bytes by the same ranks with boto3: ``put_object`` of this rank's bytes in
  as many objects as we write data files (one thread each), and ranged ``get_object`` of them
  back into a preallocated buffer.

Printed: the throughputs and the ratios msc/raw (target: at least 80% for save and load) and
msc/local.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from common import Measurement, fmt_mib, log, log_table, measured, rank, raw_blob, world

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

THREAD_COUNT = 2  # data files per rank, for us and for the raw baseline
REGION = "us-east-1"
KEYS = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench"}


def make_state(size_mib: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank())
    count, cols = 16, 1024
    rows = max(size_mib * 2**20 // 4 // count // world() // cols, 1)
    return {f"t.{i}": torch.randn(rows, cols, generator=gen) for i in range(count)}


def sharded(local: dict[str, torch.Tensor]) -> dict[str, ShardedTensor]:
    return {
        k: ShardedTensor.from_rank_offsets(k, t, (0, rank(), world())) for k, t in local.items()
    }


def best_of(repeat: int, phase: Callable[[int], None]) -> Measurement:
    runs = []
    for i in range(repeat):
        with measured() as m:
            phase(i)
        runs.append(m[0])
    return min(runs, key=lambda m: m.seconds)


# ----------------------------------------------------------------------------- endpoint


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, endpoint
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"moto server did not start on {endpoint}") from None
            time.sleep(0.1)


def s3_client(endpoint: str) -> Any:
    import boto3
    from botocore.config import Config

    config = Config(max_pool_connections=32)
    return boto3.client("s3", endpoint_url=endpoint, region_name=REGION, config=config, **KEYS)


def msc_config(endpoint: str, bucket: str) -> dict[str, Any]:
    options = {"base_path": bucket, "endpoint_url": endpoint, "region_name": REGION}
    creds = {"access_key": KEYS["aws_access_key_id"], "secret_key": KEYS["aws_secret_access_key"]}
    # "bench-whole": single-PUT uploads up to 1 GiB (the raw baseline's request pattern).
    whole = {**options, "multipart_threshold": 1 << 30}
    return {
        "profiles": {
            name: {
                "storage_provider": {"type": "s3", "options": opts},
                "credentials_provider": {"type": "S3Credentials", "options": creds},
            }
            for name, opts in (("bench", options), ("bench-whole", whole))
        }
    }


# The "msc-whole" run: one request per data file, as the raw baseline (knobs read at use).
WHOLE_FILE_KNOBS = {
    "DIST_CKPT_MSC_WRITE_SPOOL_BYTES": str(1 << 30),
    "DIST_CKPT_MSC_READ_WINDOW_BYTES": str(1 << 30),
    "DIST_CKPT_MSC_READ_CHUNK_BYTES": str(1 << 30),
}


def measure_whole(local: dict[str, torch.Tensor], i: int) -> dict[str, Measurement]:
    saved = {k: os.environ.get(k) for k in WHOLE_FILE_KNOBS}
    os.environ.update(WHOLE_FILE_KNOBS)
    try:
        return measure_ours(local, 1, lambda _: f"msc://bench-whole/whole_{i}")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def setup_endpoint(args: argparse.Namespace, workdir: str) -> tuple[Any, str, str]:
    """(moto process or None, endpoint, bucket); rank 0 starts and configures, all agree."""
    proc = None
    info: list[Any] = [None]
    if rank() == 0:
        endpoint = args.endpoint
        if endpoint is None:
            proc, endpoint = start_moto()
        bucket = args.bucket or f"bench-{uuid.uuid4().hex[:8]}"
        if args.bucket is None:
            s3_client(endpoint).create_bucket(Bucket=bucket)
        config_path = os.path.join(workdir, "msc_config.json")
        with open(config_path, "w") as f:
            json.dump(msc_config(endpoint, bucket), f)
        info = [(endpoint, bucket, config_path)]
    dist.broadcast_object_list(info, src=0)
    endpoint, bucket, config_path = info[0]
    os.environ["MSC_CONFIG"] = config_path
    return proc, endpoint, bucket


# ----------------------------------------------------------------------------- methods


def _in_threads(fn: Callable[[int], None], n: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(fn, range(n)))


def _best(runs: list[dict[str, Measurement]]) -> dict[str, Measurement]:
    return {op: min((r[op] for r in runs), key=lambda m: m.seconds) for op in runs[0]}


def measure_raw(
    client: Any, bucket: str, blob: bytearray, repeat: int, prefix: str = "raw"
) -> dict[str, Measurement]:
    # One bytearray per object, built outside the timed region (boto3 takes no memoryview).
    per = -(-len(blob) // THREAD_COUNT)
    parts = [bytearray(blob[i * per : (i + 1) * per]) for i in range(THREAD_COUNT)]
    views = [memoryview(p) for p in parts]

    def key(i: int, part: int) -> str:
        return f"{prefix}/{i}/{rank()}_{part}.bin"

    def put(i: int) -> None:
        _in_threads(
            lambda p: client.put_object(Bucket=bucket, Key=key(i, p), Body=parts[p]),
            THREAD_COUNT,
        )

    def get(i: int) -> None:
        def one(p: int) -> None:
            n = len(parts[p])
            resp = client.get_object(Bucket=bucket, Key=key(i, p), Range=f"bytes=0-{n - 1}")
            body, done = resp["Body"], 0
            while done < n:
                chunk = body.read(min(8 << 20, n - done))
                if not chunk:
                    raise RuntimeError("short ranged get")
                views[p][done : done + len(chunk)] = chunk
                done += len(chunk)

        _in_threads(one, THREAD_COUNT)

    return {"save": best_of(repeat, put), "load": best_of(repeat, get)}


def measure_ours(
    local: dict[str, torch.Tensor], repeat: int, path: Callable[[int], str]
) -> dict[str, Measurement]:
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=THREAD_COUNT)
    save = best_of(repeat, lambda i: dc.save(sharded(local), path(i), sharded_strategy=strategy))
    request = sharded({k: torch.empty_like(t) for k, t in local.items()})
    load = best_of(repeat, lambda i: dc.load(request, path(i)))
    loaded = dc.load(request, path(0))
    bad = [k for k, t in local.items() if not torch.equal(loaded[k], t)]
    if bad:
        raise RuntimeError(f"rank {rank()}: loaded values differ for {bad[:5]}")
    return {"save": save, "load": load}


def report(nbytes: int, r: dict[str, dict[str, Measurement]], repeat: int) -> None:
    log(
        f"\n== object storage: {fmt_mib(nbytes).strip()} in total, {world()} ranks, "
        f"{THREAD_COUNT} files per rank, best of {repeat} =="
    )
    log_table(nbytes, r, width=9)
    for method in ("msc", "msc-whole"):
        for op in ("save", "load"):
            msc, raw, disk = r[method][op], r["raw"][op], r["local"][op]
            log(
                f"{op}: {method} at {100 * raw.seconds / msc.seconds:5.1f}% of raw boto3 "
                f"throughput; {100 * disk.seconds / msc.seconds:5.1f}% of the local-disk "
                f"checkpoint's"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--endpoint", default=None, help="use this S3 endpoint (no moto)")
    parser.add_argument("--bucket", default=None, help="an existing bucket at --endpoint")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    workdir = tempfile.mkdtemp(prefix="dist_ckpt_bench_os_") if rank() == 0 else ""
    holder = [workdir]
    dist.broadcast_object_list(holder, src=0)
    workdir = holder[0]
    proc, endpoint, bucket = setup_endpoint(args, workdir)
    try:
        local = make_state(args.size_mib)
        total = torch.tensor([sum(t.nbytes for t in local.values())], dtype=torch.int64)
        dist.all_reduce(total)
        # Interleaved (raw, msc, raw, msc, ...) so that both see the same server state
        # and load on a shared machine; the best of each is reported.
        client, blob = s3_client(endpoint), raw_blob(list(local.values()))
        runs: dict[str, list[dict[str, Measurement]]] = {"raw": [], "msc": [], "msc-whole": []}
        for i in range(args.repeat):
            runs["raw"].append(measure_raw(client, bucket, blob, 1, f"raw{i}"))
            runs["msc"].append(measure_ours(local, 1, lambda _, i=i: f"msc://bench/ckpt_{i}"))
            runs["msc-whole"].append(measure_whole(local, i))
        results = {m: _best(r) for m, r in runs.items()}
        disk = os.path.join(workdir, "disk")
        if rank() == 0:
            for i in range(args.repeat):
                os.makedirs(f"{disk}_{i}")
        dist.barrier()
        results["local"] = measure_ours(local, args.repeat, lambda i: f"{disk}_{i}")
        report(int(total), results, args.repeat)
    finally:
        dist.barrier()
        if rank() == 0:
            shutil.rmtree(workdir, ignore_errors=True)
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
