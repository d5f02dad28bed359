"""``torch.save`` payloads (``common.pt``, ShardedObject bytes) loaded with
``weights_only`` semantics: :func:`safe_torch_load`.

A payload naming a type outside the safe set fails with an error that names the
type and says how to allow it, unless the caller trusts the file.
"""

from __future__ import annotations

import io
import pickle
import re
import zipfile
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

import torch

from dist_checkpointing.errors import CorruptCheckpointError, UnsafeCheckpointError

from .allowlist import _py3_name
from .bounded import short_repr
from .pickle_scan import check_pickle

_WO_UNSAFE_GLOBAL = re.compile(r"GLOBAL (\S+) was not an allowed global")


_WO_BLOCKED_GLOBAL = re.compile(r"GLOBAL (\S+) whose module (\S+) is blocked")


_WO_REFUSALS = (
    "Trying to call reduce for unrecognized function",
    "Can only ",
    "must be imported to load",
)


def _global_name(reported: str) -> str:
    # torch drops the "builtins." prefix from the names it reports, and torch.save's
    # protocol 2 writes some stdlib globals under Python 2 names (subprocess -> commands).
    module, _, name = reported.rpartition(".")
    return ".".join(_py3_name(module or "builtins", name))


def _unsafe_load_error(message: str, source: str) -> UnsafeCheckpointError | None:
    """The error for a weights_only refusal, or None if ``message`` is not one."""
    blocked = _WO_BLOCKED_GLOBAL.search(message)
    if blocked:
        name = _global_name(blocked.group(1))
        return UnsafeCheckpointError(
            f"{source}: refusing to load: the pickle references '{name}', from module "
            f"'{blocked.group(2)}', which weights_only loading never allows (unpickling it "
            "could execute code). Only trusted=True loads it; pass it only if you trust "
            "the file."
        )
    unsafe = _WO_UNSAFE_GLOBAL.search(message)
    if unsafe and not unsafe.group(1).rsplit(".", 1)[-1][:1].isupper():
        # Not named like a class (e.g. builtins.exec): never suggest allowing it.
        name = _global_name(unsafe.group(1))
        return UnsafeCheckpointError(
            f"{source}: refusing to load: the pickle references '{name}', a function that "
            "weights_only loading does not allow (unpickling it could execute code). Only "
            "trusted=True loads it; pass it only if you trust the file."
        )
    if unsafe:
        name = _global_name(unsafe.group(1))
        return UnsafeCheckpointError(
            f"{source}: refusing to load: the pickle references '{name}', which is not "
            "allowed with weights_only loading (unpickling arbitrary types can execute "
            "code). If you trust this file, allow just that type: "
            f"dist_checkpointing.load(..., allowed_types=[{name}]) (load_common_state_dict "
            "takes it too); or, to load without restrictions, pass "
            "common_strategy=TorchCommonLoadStrategy(trusted=True) (ShardedObjects: "
            "sharded_strategy=TorchDistLoadShardedStrategy(trusted=True))."
        )
    reason = next(
        (line for line in message.splitlines() if any(p in line for p in _WO_REFUSALS)), None
    )
    if reason is not None:
        return UnsafeCheckpointError(
            f"{source}: refusing to load with weights_only: {reason.strip()}. If you trust "
            "this file, pass the types it needs as dist_checkpointing.load(..., "
            "allowed_types=[...]), or build the load strategy with trusted=True."
        )
    return None


# Plain data containers Megatron-Core stores in ShardedObjects and common state: an
# ``io.BytesIO`` is rebuilt from its bytes and position (``__setstate__``); nothing
# it holds is executed.
ALWAYS_ALLOWED_TYPES: tuple[type, ...] = (io.BytesIO,)


def _new_safe_globals(
    allowed_types: Sequence[type],
) -> list[Callable[..., Any] | tuple[Callable[..., Any], str]]:
    """:data:`ALWAYS_ALLOWED_TYPES` and ``allowed_types`` that torch does not allow yet.

    Leaving out those already registered keeps ``safe_globals.__exit__`` from
    removing what the user registered.
    """
    for allowed in allowed_types:
        if not isinstance(allowed, type):
            raise TypeError(f"allowed_types must hold classes, found {allowed!r}")
    registered = torch.serialization.get_safe_globals()
    candidates = dict.fromkeys((*ALWAYS_ALLOWED_TYPES, *allowed_types))
    return [t for t in candidates if t not in registered]


def object_loader(
    checkpoint_dir: object, *, trusted: bool, allowed_types: Sequence[type]
) -> Callable[[bytes, str], Any]:
    """``load(data, key)``: :func:`safe_torch_load` of ShardedObject ``key``'s payload
    from ``checkpoint_dir`` (named in errors), what every load strategy hands its reader."""

    def load(data: bytes, key: str) -> Any:
        return safe_torch_load(
            data,
            source=f"{checkpoint_dir}: object '{key}'",
            trusted=trusted,
            allowed_types=allowed_types,
        )

    return load


def safe_torch_load(
    data: bytes | bytearray | memoryview | BinaryIO,
    *,
    source: str,
    trusted: bool = False,
    allowed_types: Sequence[type] = (),
) -> Any:
    """Load a ``torch.save`` payload (``common.pt``, ShardedObject bytes) onto the CPU.

    1. Unless ``trusted``, load with ``weights_only=True``: tensors, containers,
       primitives and ``io.BytesIO`` only, plus the classes in ``allowed_types`` for
       this call (torch's ``safe_globals`` context, which removes them afterwards;
       note that torch keeps that list process-wide while
       the call runs).
    2. With ``trusted=True``, load with plain pickle: only for files you wrote.

    Raises:
        UnsafeCheckpointError: the payload needs a type that is not allowed; the
            message names it, names ``source`` and says how to allow it.
        CorruptCheckpointError: the payload is truncated or not a ``torch.save`` file.
    """
    if trusted:
        stream: BinaryIO = (
            io.BytesIO(data) if isinstance(data, bytes | bytearray | memoryview) else data
        )
        return _torch_load(stream, source, weights_only=False)
    raw = bytes(data) if isinstance(data, bytes | bytearray | memoryview) else data.read()
    check_payload(raw, source)
    with (
        torch.serialization.safe_globals(_new_safe_globals(allowed_types)),
        torch.sparse.check_sparse_tensor_invariants(),
    ):
        return _torch_load(io.BytesIO(raw), source, weights_only=True)


# More records than any torch.save archive has (one per storage, plus a few).
MAX_ARCHIVE_RECORDS = 1 << 20


def check_payload(raw: bytes, source: str) -> None:
    """Bounds checked on a ``torch.save`` payload before ``torch.load`` sees it.

    Its records must be stored (``torch.save`` never compresses: a DEFLATE record of
    1.5 MB would inflate to gigabytes before any check) and fit in the archive, and its
    ``data.pkl`` records must pass :func:`.pickle_scan.check_pickle` (nesting, dict keys).

    Raises:
        CorruptCheckpointError: naming ``source`` and the record.
    """
    if raw[:4] != b"PK\x03\x04":  # not a zip: a legacy payload or a bare pickle
        check_pickle(raw, source)
        return
    try:
        archive = zipfile.ZipFile(io.BytesIO(raw))
        records = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError):
        return  # torch.load reports it
    if len(records) > MAX_ARCHIVE_RECORDS:
        raise CorruptCheckpointError(f"{source}: the archive lists {len(records)} records")
    for record in records:
        name = short_repr(record.filename)
        if record.compress_type != zipfile.ZIP_STORED:
            raise CorruptCheckpointError(
                f"{source}: archive record {name} is compressed (method "
                f"{record.compress_type}); torch.save never compresses, refusing to inflate it"
            )
        if max(record.file_size, record.compress_size, record.header_offset) > len(raw):
            raise CorruptCheckpointError(
                f"{source}: archive record {name} declares {record.file_size} bytes, more "
                f"than the archive's {len(raw)}"
            )
    # Every one: a crafted archive may list data.pkl twice, and which copy torch reads
    # is up to its zip reader.
    for record in records:
        if record.filename.rpartition("/")[2] == "data.pkl":
            try:
                pickled = archive.read(record)
            except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
                raise CorruptCheckpointError(
                    f"{source}: archive record {short_repr(record.filename)} is damaged ({exc})"
                ) from None
            check_pickle(pickled, source)


def _torch_load(stream: BinaryIO, source: str, *, weights_only: bool) -> Any:
    try:
        return torch.load(stream, map_location="cpu", weights_only=weights_only)
    except MemoryError:
        raise
    except pickle.UnpicklingError as exc:
        unsafe = _unsafe_load_error(str(exc), source) if weights_only else None
        if unsafe is not None:
            raise unsafe from None
        raise _corrupt(source, exc) from exc
    except Exception as exc:  # torch raises RuntimeError, EOFError, ... for bad bytes
        raise _corrupt(source, exc) from exc


def _corrupt(source: str, exc: BaseException) -> CorruptCheckpointError:
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return CorruptCheckpointError(
        f"{source}: cannot load torch.save payload, it is truncated or corrupt "
        f"({type(exc).__name__}: {detail})"
    )
