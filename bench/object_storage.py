"""Save/load throughput to an S3 endpoint through ``msc://``, against local disk and raw boto3.

    torchrun --standalone --nproc_per_node=2 bench/object_storage.py [--size-mib 256] \
        [--repeat 3] [--endpoint http://host:port --bucket NAME]

Without ``--endpoint`` rank 0 starts moto's S3 server (``python -m moto.server``) on a free
port of 127.0.0.1 in its own process, and stops it at the end. Every rank uses an MSC profile
(a config file written by rank 0, named by ``MSC_CONFIG``) at that endpoint.

The state: ``--size-mib`` MiB in total, 16 float32 tensors sharded over the ranks on axis 0.
Methods, each timed barrier to barrier (slowest rank); the median of ``--repeat`` runs,
interleaved (raw, msc, raw, msc, ...) so that both see the same server and machine load:

- ``msc``: ``dist_checkpointing.save`` / ``load`` to ``msc://bench/<prefix>`` (default knobs);
- ``raw``: the same bytes by the same ranks with boto3, the same work as ``msc``'s data
  files: ``put_object`` of this rank's bytes in as many objects as we write data files
  (one thread each, as our writer threads), and a ranged ``get_object`` of each object
  (``bytes=0-<size-1>``, one thread each) into a preallocated buffer;
- ``raw-whole``: the same download as plain ``get_object`` (no ``Range``), to show what a
  ranged GET costs the server;
- ``msc-read``: the same download through MSC's ``read`` (one GET of each whole object into
  memory, then copied into the buffer): the transfer as MSC's public API gives it;
- ``local``: the same checkpoint on local disk (a temporary directory).

Printed: the times, the ratios msc/raw (target: at least 80% for save and load) and
msc/local, and the requests each method sent (summed over ranks, by S3 operation; counted
by wrapping botocore's API call method in each rank).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from common import (
    Measurement,
    fmt_mib,
    log,
    log_table,
    measured,
    rank,
    raw_blob,
    row_sharded,
    world,
)

import dist_checkpointing as dc
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

THREAD_COUNT = 2  # data files per rank, for us and for the raw baseline
REGION = "us-east-1"
KEYS = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench"}


def make_state(size_mib: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank())
    count, cols = 16, 1024
    rows = max(size_mib * 2**20 // 4 // count // world() // cols, 1)
    return {f"t.{i}": torch.randn(rows, cols, generator=gen) for i in range(count)}


# ----------------------------------------------------------------------------- requests


class RequestCounter:
    """Counts this rank's S3 requests by operation (every botocore client of the process)."""

    def __init__(self) -> None:
        import botocore.client

        from dist_checkpointing.engine.storage import msc_stream

        self.counts: collections.Counter[str] = collections.Counter()
        self.trace: list[tuple[float, float, str, str]] | None = None
        self.start = time.perf_counter()
        self._lock = threading.Lock()

        def s3_call(client: Any, operation: str, params: Any) -> tuple[str, str]:
            what = str(params.get("Key", params.get("Prefix", "")))
            rng = params.get("Range")
            return operation, what + (f" {rng}" if rng else "")

        self._wrap(botocore.client.BaseClient, "_make_api_call", s3_call)
        # Our data-file GETs and PUTs go over http.client with presigned URLs, not botocore.
        self._wrap(
            msc_stream,
            "_send",
            lambda key, target, headers: (
                "GetObject (streamed)",
                target.split("?", 1)[0] + " " + headers.get("Range", ""),
            ),
        )
        self._wrap(msc_stream, "_put", lambda c, path, url, data: ("PutObject (presigned)", path))

    def _wrap(self, owner: Any, name: str, describe: Callable[..., tuple[str, str]]) -> None:
        """Count (and with a trace, time) every call of ``owner.name``; ``describe(*args)``
        gives the operation and what it touched."""
        original = getattr(owner, name)

        def counting(*args: Any) -> Any:
            operation, what = describe(*args)
            with self._lock:
                self.counts[operation] += 1
            began = time.perf_counter()
            try:
                return original(*args)
            finally:
                if self.trace is not None:
                    self.trace.append((began, time.perf_counter(), operation, what))

        setattr(owner, name, counting)

    @contextmanager
    def phase(self, into: dict[str, collections.Counter[str]], op: str) -> Iterator[None]:
        """Count the requests of one timed phase (all ranks), into ``into[op]``."""
        self.counts.clear()
        self.start = time.perf_counter()
        if self.trace is not None:
            self.trace.clear()
        yield
        if self.trace is not None:
            for began, ended, operation, what in sorted(self.trace):
                print(
                    f"[rank {rank()}] {op} +{began - self.start:7.3f}s "
                    f"{1000 * (ended - began):7.1f} ms  {operation} {what}",
                    flush=True,
                )
        gathered: list[Any] = [None] * world()
        dist.all_gather_object(gathered, dict(self.counts))
        into[op] = sum((collections.Counter(g) for g in gathered), collections.Counter())


COUNTER: RequestCounter | None = None
Counts = dict[str, dict[str, collections.Counter[str]]]  # method -> op -> operation counts


def timed(method: str, op: str, counts: Counts, fn: Callable[[], None]) -> Measurement:
    assert COUNTER is not None
    with COUNTER.phase(counts.setdefault(method, {}), op), measured() as m:
        fn()
    return m[0]


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


def msc_config(endpoint: str, bucket: str, rust_client: bool = False) -> dict[str, Any]:
    options: dict[str, Any] = {"base_path": bucket, "endpoint_url": endpoint, "region_name": REGION}
    if rust_client:  # MSC's Rust HTTP client (plain http is allowed for the local server)
        options["rust_client"] = {"allow_http": True}
    creds = {"access_key": KEYS["aws_access_key_id"], "secret_key": KEYS["aws_secret_access_key"]}
    return {
        "profiles": {
            "bench": {
                "storage_provider": {"type": "s3", "options": options},
                "credentials_provider": {"type": "S3Credentials", "options": creds},
            }
        }
    }


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
            json.dump(msc_config(endpoint, bucket, args.rust_client), f)
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


def measure_raw(
    client: Any, bucket: str, blob: bytearray, prefix: str, counts: Counts
) -> dict[str, dict[str, Measurement]]:
    """``raw`` (put, ranged get) and ``raw-whole`` (plain get) of this rank's bytes."""
    # One bytearray per object, built outside the timed region (boto3 takes no memoryview).
    per = -(-len(blob) // THREAD_COUNT)
    parts = [bytearray(blob[i * per : (i + 1) * per]) for i in range(THREAD_COUNT)]
    views = [memoryview(p) for p in parts]

    def key(part: int) -> str:
        return f"{prefix}/{rank()}_{part}.bin"

    def put() -> None:
        _in_threads(
            lambda p: client.put_object(Bucket=bucket, Key=key(p), Body=parts[p]), THREAD_COUNT
        )

    def get(ranged: bool) -> None:
        def one(p: int) -> None:
            n = len(parts[p])
            extra = {"Range": f"bytes=0-{n - 1}"} if ranged else {}
            body, done = client.get_object(Bucket=bucket, Key=key(p), **extra)["Body"], 0
            while done < n:
                chunk = body.read(min(8 << 20, n - done))
                if not chunk:
                    raise RuntimeError("short get")
                views[p][done : done + len(chunk)] = chunk
                done += len(chunk)

        _in_threads(one, THREAD_COUNT)

    def msc_get() -> None:
        import multistorageclient

        def one(p: int) -> None:
            client, path = multistorageclient.resolve_storage_client(f"msc://bench/{key(p)}")
            data = client.read(path)
            views[p][: len(data)] = data

        _in_threads(one, THREAD_COUNT)

    return {
        "raw": {
            "save": timed("raw", "save", counts, put),
            "load": timed("raw", "load", counts, lambda: get(True)),
        },
        "raw-whole": {"load": timed("raw-whole", "load", counts, lambda: get(False))},
        "msc-read": {"load": timed("msc-read", "load", counts, msc_get)},
    }


def measure_ours(
    method: str, local: dict[str, torch.Tensor], path: str, counts: Counts
) -> dict[str, Measurement]:
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=THREAD_COUNT)
    save = timed(
        method, "save", counts, lambda: dc.save(row_sharded(local), path, sharded_strategy=strategy)
    )
    # Targets already in memory (as a model's parameters are, and as the raw baseline's buffer is).
    request = row_sharded({k: torch.zeros_like(t) for k, t in local.items()})
    loaded: list[Any] = []
    load = timed(method, "load", counts, lambda: loaded.append(dc.load(request, path)))
    bad = [k for k, t in local.items() if not torch.equal(loaded[0][k], t)]
    if bad:
        raise RuntimeError(f"rank {rank()}: loaded values differ for {bad[:5]}")
    return {"save": save, "load": load}


def _median(runs: list[dict[str, dict[str, Measurement]]]) -> dict[str, dict[str, Measurement]]:
    out: dict[str, dict[str, Measurement]] = {}
    for method in runs[0]:
        out[method] = {}
        for op in runs[0][method]:
            ms = sorted((r[method][op] for r in runs), key=lambda m: m.seconds)
            mid = statistics.median_low([m.seconds for m in ms])
            out[method][op] = next(m for m in ms if m.seconds == mid)
    return out


def report(nbytes: int, r: dict[str, dict[str, Measurement]], counts: Counts, repeat: int) -> None:
    log(
        f"\n== object storage: {fmt_mib(nbytes).strip()} in total, {world()} ranks, "
        f"{THREAD_COUNT} files per rank, median of {repeat} =="
    )
    log_table(nbytes, r, width=9)
    for op in ("save", "load"):
        msc, raw, disk = r["msc"][op], r["raw"][op], r["local"][op]
        log(
            f"{op}: msc at {100 * raw.seconds / msc.seconds:5.1f}% of raw boto3 throughput; "
            f"{100 * disk.seconds / msc.seconds:5.1f}% of the local-disk checkpoint's"
        )
    log(
        f"load: raw ranged GET at {100 * r['raw-whole']['load'].seconds / r['raw']['load'].seconds:5.1f}% "
        "of raw whole-object GET throughput"
    )
    log("requests (all ranks, one run):")
    for method, ops in counts.items():
        for op, c in ops.items():
            detail = ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1]))
            log(f"  {method:9} {op:5} {sum(c.values()):4}  {detail}")


def main() -> None:
    global COUNTER
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--endpoint", default=None, help="use this S3 endpoint (no moto)")
    parser.add_argument("--bucket", default=None, help="an existing bucket at --endpoint")
    parser.add_argument("--trace", action="store_true", help="print every S3 request, timed")
    parser.add_argument(
        "--rust-client", action="store_true", help="the MSC profile uses MSC's Rust client"
    )
    args = parser.parse_args()
    dist.init_process_group("gloo")
    COUNTER = RequestCounter()
    if args.trace:
        COUNTER.trace = []
    workdir = tempfile.mkdtemp(prefix="dist_ckpt_bench_os_") if rank() == 0 else ""
    holder = [workdir]
    dist.broadcast_object_list(holder, src=0)
    workdir = holder[0]
    proc, endpoint, bucket = setup_endpoint(args, workdir)
    try:
        local = make_state(args.size_mib)
        total = torch.tensor([sum(t.nbytes for t in local.values())], dtype=torch.int64)
        dist.all_reduce(total)
        client, blob = s3_client(endpoint), raw_blob(list(local.values()))
        disk = os.path.join(workdir, "disk")
        if rank() == 0:
            for i in range(args.repeat):
                os.makedirs(f"{disk}_{i}")
        dist.barrier()
        runs, counts = [], {}
        for i in range(args.repeat):
            counts = {}
            run = measure_raw(client, bucket, blob, f"raw{i}", counts)
            run["msc"] = measure_ours("msc", local, f"msc://bench/ckpt_{i}", counts)
            run["local"] = measure_ours("local", local, f"{disk}_{i}", counts)
            runs.append(run)
        counts.pop("local", None)
        report(int(total), _median(runs), counts, args.repeat)
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
