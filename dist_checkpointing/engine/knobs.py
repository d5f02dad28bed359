"""Tunables: one table, each with a documented default and an environment override.

Precedence, highest first: an explicit argument of the API call, the
environment variable ``DIST_CKPT_<NAME>``, the default below. Environment
values are read when the knob is used (not at import), so a launcher can set
them per job. A malformed value raises :class:`~dist_checkpointing.errors.InvalidArgumentError`
naming the variable.

============================== ========== ===================================================
Knob (env ``DIST_CKPT_...``)   Default    What it controls
============================== ========== ===================================================
SAVE_THREAD_COUNT              2          data files (and writer workers) per rank per save
WRITE_BUFFER_BYTES             262144     buffer of local files opened for writing (data
                                          files of both layouts bypass it: their writes are
                                          gathered into positional calls)
WRITEBACK_BYTES                16777216   a synced local data file asks the kernel to start
                                          writing its bytes to disk after each this many
                                          (the final fsync then waits for less; 0: off)
WRITE_CALL_BYTES               1048576    most bytes one write system call of a data file
                                          carries: larger writes are split (on the
                                          development VM, a write of 2 MiB or more from one
                                          buffer cost 2-5x the kernel time, erratically)
RESULTS_TIMEOUT_S              10.0       wait for a finished writer's results at finalize
READ_WINDOW_BYTES              16777216   largest read that serves several small items
READ_SMALL_ITEM_BYTES          262144     items below this are read through a window
READ_MAX_GAP_BYTES             262144     largest gap between items merged into one read
READ_THREADS                   0          threads a rank reads local data files with, the
                                          files' reads shared out by bytes (0: the rank's
                                          share of the host's cores, at most 8, at most 4
                                          where reads average under 1 MiB; torch_dist only
                                          where items average 1 MiB or more)
READ_SPAN_BYTES                8388608    least bytes of one file's consecutive reads that
                                          one reading thread takes (a read of 1.5 times a
                                          thread's share or more is cut into parts)
INTEGRITY_CHUNK_BYTES          8388608    read size when digesting a file
ASYNC_POLL_INTERVAL_S          0.05       how often a blocking finalize polls its caller
ASYNC_WORKER_IDLE_CHECK_S      1.0        how often the persistent worker checks its parent
ASYNC_WORKER_JOIN_TIMEOUT_S    300.0      wait for a writer process to stop at close
CHECKSUM_BLOCK_BYTES           1048576    CRC32C block size of new saves (and most a read verifies extra)
VERIFY_CHECKSUMS               1          verify the checksums of what a load reads (0: off)
SAVE_LOCK_STALE_S              3600.0     age after which another host's save lock counts as stale
WRITE_CHECKSUMS                1          checksum data items as they are written (0: off)
CHECKSUM_THREAD                2          a large read's blocks are checksummed on a helper
                                          thread while the next block is read (0: inline;
                                          1: always; 2: when this host has a CPU core
                                          more than it has ranks)
ASYNC_WORKER_START_TIMEOUT_S   120.0      wait for the persistent worker to be ready
EXCHANGE_BUCKET_BYTES          67108864   most bytes of shards one broadcast of a fully parallel
                                          load carries
ASYNC_WORKER_FORK              1          fork the persistent worker (0: a fresh interpreter)
WIPE_TENSORS_ON_FORK           1          a fork that never reads the trainer's tensors (the
                                          persistent worker, the metadata parse guard) gets
                                          zero pages for the large CPU ones instead of
                                          copy-on-write shares
MSC_READ_THREADS               4          msc:// data files a rank reads at once
MSC_READ_CHUNK_BYTES           67108864   most bytes one GET of an msc:// data file fetches
MSC_READ_AHEAD                 1          GETs of one msc:// file in flight ahead of the reader
MSC_PREFETCH_WHOLE_FILES       0          1: download whole msc:// data files, read locally
MSC_WRITE_SPOOL_BYTES          268435456  msc:// upload kept in memory (one PUT; then on disk)
MSC_PRESIGNED                  1          msc:// data files: GETs streamed into the tensors and
                                          PUTs sent from memory through presigned URLs where
                                          the profile can presign them (0: through MSC)
MSC_ATTEMPTS                   3          tries of an msc:// request that failed to connect
MSC_RETRY_DELAY_S              0.5        wait before the first retry (doubles each time)
COPY_AHEAD_BYTES               268435456  host memory for staged copies of accelerator tensors
                                          while they are written or read (0: no bound)
STAGING_BUFFER_BYTES           33554432   size of one buffer of the staging pool; also the
                                          most a ``raw_bytes`` reading thread stages for the
                                          parts of stored chunks a resharding load copies
LOAD_PRELOAD                   1          small files of a load read once, by one rank, for
                                          all: 0 never, 1 object stores, 2 every backend
LOAD_PRELOAD_BYTES             268435456  most bytes of small files that one rank preloads
METADATA_PARSE_GUARD           1          parse a ``.metadata`` of 16 KiB or more in a forked,
                                          CPU-limited child first (0: off, trusted files only)
METADATA_PARSE_CPU_S           5.0        that child's CPU-seconds: this, plus
METADATA_PARSE_CPU_S_PER_MIB   1.0        this per MiB of the file (four times as much when
                                          the fast unpickler cannot be used)
METADATA_INDEX                 1          ``torch_dist`` saves write a JSON index of
                                          ``.metadata`` and loads build it from that (no
                                          pickle, no guard); 0: neither
RAW_NARROW_ENTRIES             65536      a ``raw_bytes`` load whose index has at least this
                                          many entries, and eight times as many as the leaves
                                          it requests, plans over the entries the request can
                                          meet only (0: every load)
METADATA_PLAIN_PICKLE_ENTRIES  65536      a ``.metadata`` of at most this many stored chunks
                                          is pickled by ``pickle.dumps`` (up to twice as
                                          fast; it holds some 0.5 KiB per chunk while it
                                          runs), a larger one by the library's own pickle
                                          writer (0: always the writer)
============================== ========== ===================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..errors import InvalidArgumentError

ENV_PREFIX = "DIST_CKPT_"

N = TypeVar("N", int, float)


@dataclass(frozen=True)
class Knob(Generic[N]):
    """One tunable: its name (the environment variable is ``DIST_CKPT_<name>``),
    its default and the smallest value that makes sense."""

    name: str
    default: N
    minimum: N
    doc: str

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.name

    def get(self, explicit: N | None = None) -> N:
        """``explicit`` if given, else the environment's value, else the default."""
        if explicit is not None:
            return explicit
        raw = os.environ.get(self.env_var)
        if raw is None or raw.strip() == "":
            return self.default
        kind = type(self.default)
        try:
            value = kind(raw)
        except ValueError:
            raise InvalidArgumentError(
                f"{self.env_var}={raw!r} is not a valid {kind.__name__} ({self.doc})"
            ) from None
        if value < self.minimum:
            raise InvalidArgumentError(
                f"{self.env_var}={raw!r} is below the minimum {self.minimum} ({self.doc})"
            )
        return value


SAVE_THREAD_COUNT = Knob("SAVE_THREAD_COUNT", 2, 1, "data files per rank per save")
WRITE_BUFFER_BYTES = Knob(
    "WRITE_BUFFER_BYTES", 256 << 10, 0, "buffer of local files opened for writing"
)
WRITE_CALL_BYTES = Knob(
    "WRITE_CALL_BYTES",
    1 << 20,
    4096,
    "most bytes one write system call of a data file carries (larger writes are split)",
)
WRITEBACK_BYTES = Knob(
    "WRITEBACK_BYTES",
    16 << 20,
    0,
    "bytes of a synced local data file after which its write-back to disk is started",
)
RESULTS_TIMEOUT_S = Knob(
    "RESULTS_TIMEOUT_S", 10.0, 0.0, "seconds to wait for a finished writer's results"
)
READ_WINDOW_BYTES = Knob(
    "READ_WINDOW_BYTES", 16 << 20, 1, "largest read that serves several small items"
)
READ_SMALL_ITEM_BYTES = Knob(
    "READ_SMALL_ITEM_BYTES", 256 << 10, 0, "items below this size are read through a window"
)
READ_MAX_GAP_BYTES = Knob(
    "READ_MAX_GAP_BYTES", 256 << 10, 0, "largest gap between items merged into one read"
)
READ_THREADS = Knob(
    "READ_THREADS",
    0,
    0,
    "threads a rank reads local data files with (0: its share of the cores, at most 8)",
)
READ_SPAN_BYTES = Knob(
    "READ_SPAN_BYTES", 8 << 20, 1, "least bytes of a file's reads that one reading thread takes"
)
INTEGRITY_CHUNK_BYTES = Knob("INTEGRITY_CHUNK_BYTES", 8 << 20, 1, "read size when digesting")
ASYNC_POLL_INTERVAL_S = Knob(
    "ASYNC_POLL_INTERVAL_S", 0.05, 0.001, "how often a blocking finalize polls its caller"
)
ASYNC_WORKER_IDLE_CHECK_S = Knob(
    "ASYNC_WORKER_IDLE_CHECK_S", 1.0, 0.01, "how often the persistent worker checks its parent"
)
ASYNC_WORKER_JOIN_TIMEOUT_S = Knob(
    "ASYNC_WORKER_JOIN_TIMEOUT_S", 300.0, 0.0, "seconds to wait for a writer process to stop"
)
CHECKSUM_BLOCK_BYTES = Knob("CHECKSUM_BLOCK_BYTES", 1 << 20, 4096, "CRC32C block size of new saves")
VERIFY_CHECKSUMS = Knob(
    "VERIFY_CHECKSUMS", 1, 0, "verify the checksums of the bytes a load reads (0: off)"
)
SAVE_LOCK_STALE_S = Knob(
    "SAVE_LOCK_STALE_S", 3600.0, 0.0, "age after which another host's save lock is stale"
)
WRITE_CHECKSUMS = Knob(
    "WRITE_CHECKSUMS", 1, 0, "checksum data items as they are written (0: off, unverifiable)"
)
CHECKSUM_THREAD = Knob(
    "CHECKSUM_THREAD",
    2,
    0,
    "checksum blocks of large reads on a helper thread (0: inline, 1: always, 2: when a "
    "core is spare)",
)
ASYNC_WORKER_START_TIMEOUT_S = Knob(
    "ASYNC_WORKER_START_TIMEOUT_S",
    120.0,
    0.0,
    "seconds a new persistent worker may take to be ready",
)
EXCHANGE_BUCKET_BYTES = Knob(
    "EXCHANGE_BUCKET_BYTES", 64 << 20, 1, "most bytes of shards one exchange broadcast carries"
)
ASYNC_WORKER_FORK = Knob(
    "ASYNC_WORKER_FORK",
    1,
    0,
    "1: fork the persistent worker from the trainer (milliseconds); 0: start a fresh "
    "interpreter that imports torch (seconds)",
)
WIPE_TENSORS_ON_FORK = Knob(
    "WIPE_TENSORS_ON_FORK",
    1,
    0,
    "forks that never read the trainer's tensors do not share its large CPU tensors",
)
MSC_READ_THREADS = Knob("MSC_READ_THREADS", 4, 1, "msc:// data files a rank reads at once")
MSC_READ_CHUNK_BYTES = Knob(
    "MSC_READ_CHUNK_BYTES", 64 << 20, 1, "most bytes one GET of an msc:// data file fetches"
)
MSC_READ_AHEAD = Knob(
    "MSC_READ_AHEAD", 1, 0, "GETs of one msc:// data file in flight ahead of the reader"
)
MSC_PREFETCH_WHOLE_FILES = Knob(
    "MSC_PREFETCH_WHOLE_FILES", 0, 0, "1: download whole msc:// data files before reading"
)
MSC_WRITE_SPOOL_BYTES = Knob(
    "MSC_WRITE_SPOOL_BYTES", 256 << 20, 0, "msc:// upload kept in memory (one PUT)"
)
MSC_PRESIGNED = Knob(
    "MSC_PRESIGNED",
    1,
    0,
    "msc:// data-file GETs and PUTs through presigned URLs (0: through MSC's read and write)",
)
MSC_ATTEMPTS = Knob("MSC_ATTEMPTS", 3, 1, "tries of an msc:// request that failed to connect")
MSC_RETRY_DELAY_S = Knob("MSC_RETRY_DELAY_S", 0.5, 0.0, "seconds before the first msc:// retry")

COPY_AHEAD_BYTES = Knob(
    "COPY_AHEAD_BYTES",
    256 << 20,
    0,
    "host memory for staged copies of accelerator tensors being written or read (0: no bound)",
)
STAGING_BUFFER_BYTES = Knob(
    "STAGING_BUFFER_BYTES",
    32 << 20,
    4096,
    "size of one buffer of the staging pool; also the most a raw_bytes reading thread "
    "stages for the parts of stored chunks a resharding load copies",
)
LOAD_PRELOAD = Knob(
    "LOAD_PRELOAD",
    1,
    0,
    "a load's small files read by one rank for all: 0 never, 1 object stores, 2 always",
)
LOAD_PRELOAD_BYTES = Knob(
    "LOAD_PRELOAD_BYTES", 256 << 20, 0, "most bytes of small files one rank preloads for all"
)

METADATA_PARSE_GUARD = Knob(
    "METADATA_PARSE_GUARD",
    1,
    0,
    "1: parse a large .metadata in a forked child under a CPU-time limit first; 0: off",
)
METADATA_PARSE_CPU_S = Knob(
    "METADATA_PARSE_CPU_S", 5.0, 1.0, "CPU-seconds a .metadata parse may take (plus per MiB)"
)
METADATA_PARSE_CPU_S_PER_MIB = Knob(
    "METADATA_PARSE_CPU_S_PER_MIB", 1.0, 0.0, "CPU-seconds a .metadata parse may add per MiB"
)
METADATA_INDEX = Knob(
    "METADATA_INDEX",
    1,
    0,
    "1: torch_dist saves write a JSON index of .metadata and loads read it; 0: neither",
)
RAW_NARROW_ENTRIES = Knob(
    "RAW_NARROW_ENTRIES",
    65_536,
    0,
    "a raw_bytes load over an index of at least this many entries (and eight per leaf "
    "requested) plans over the entries its request can meet only; 0: every load",
)

METADATA_PLAIN_PICKLE_ENTRIES = Knob(
    "METADATA_PLAIN_PICKLE_ENTRIES",
    65_536,
    0,
    "a .metadata of at most this many stored chunks is pickled by pickle.dumps, a larger "
    "one by the library's pickle writer (less memory); 0: always the writer",
)

ALL_KNOBS: tuple[Knob[int] | Knob[float], ...] = (
    SAVE_THREAD_COUNT,
    WRITE_BUFFER_BYTES,
    WRITEBACK_BYTES,
    WRITE_CALL_BYTES,
    RESULTS_TIMEOUT_S,
    READ_WINDOW_BYTES,
    READ_SMALL_ITEM_BYTES,
    READ_MAX_GAP_BYTES,
    READ_THREADS,
    READ_SPAN_BYTES,
    INTEGRITY_CHUNK_BYTES,
    ASYNC_POLL_INTERVAL_S,
    ASYNC_WORKER_IDLE_CHECK_S,
    ASYNC_WORKER_JOIN_TIMEOUT_S,
    CHECKSUM_BLOCK_BYTES,
    VERIFY_CHECKSUMS,
    SAVE_LOCK_STALE_S,
    WRITE_CHECKSUMS,
    ASYNC_WORKER_START_TIMEOUT_S,
    EXCHANGE_BUCKET_BYTES,
    ASYNC_WORKER_FORK,
    WIPE_TENSORS_ON_FORK,
    MSC_READ_THREADS,
    MSC_READ_CHUNK_BYTES,
    MSC_READ_AHEAD,
    MSC_PREFETCH_WHOLE_FILES,
    MSC_WRITE_SPOOL_BYTES,
    MSC_PRESIGNED,
    MSC_ATTEMPTS,
    MSC_RETRY_DELAY_S,
    COPY_AHEAD_BYTES,
    STAGING_BUFFER_BYTES,
    LOAD_PRELOAD,
    LOAD_PRELOAD_BYTES,
    METADATA_PARSE_GUARD,
    METADATA_PARSE_CPU_S,
    METADATA_PARSE_CPU_S_PER_MIB,
    METADATA_INDEX,
    RAW_NARROW_ENTRIES,
    METADATA_PLAIN_PICKLE_ENTRIES,
)

__all__ = [
    "ALL_KNOBS",
    "ENV_PREFIX",
    "Knob",
    "SAVE_THREAD_COUNT",
    "WRITE_BUFFER_BYTES",
    "WRITEBACK_BYTES",
    "WRITE_CALL_BYTES",
    "RESULTS_TIMEOUT_S",
    "READ_WINDOW_BYTES",
    "READ_SMALL_ITEM_BYTES",
    "READ_MAX_GAP_BYTES",
    "READ_THREADS",
    "INTEGRITY_CHUNK_BYTES",
    "ASYNC_POLL_INTERVAL_S",
    "ASYNC_WORKER_IDLE_CHECK_S",
    "ASYNC_WORKER_JOIN_TIMEOUT_S",
    "CHECKSUM_BLOCK_BYTES",
    "VERIFY_CHECKSUMS",
    "SAVE_LOCK_STALE_S",
    "WRITE_CHECKSUMS",
    "ASYNC_WORKER_START_TIMEOUT_S",
    "EXCHANGE_BUCKET_BYTES",
    "ASYNC_WORKER_FORK",
    "WIPE_TENSORS_ON_FORK",
    "MSC_READ_THREADS",
    "MSC_READ_CHUNK_BYTES",
    "MSC_READ_AHEAD",
    "MSC_PREFETCH_WHOLE_FILES",
    "MSC_WRITE_SPOOL_BYTES",
    "MSC_PRESIGNED",
    "MSC_ATTEMPTS",
    "MSC_RETRY_DELAY_S",
    "COPY_AHEAD_BYTES",
    "STAGING_BUFFER_BYTES",
    "LOAD_PRELOAD",
    "LOAD_PRELOAD_BYTES",
    "METADATA_PARSE_GUARD",
    "METADATA_PARSE_CPU_S",
    "METADATA_PARSE_CPU_S_PER_MIB",
    "METADATA_INDEX",
]
