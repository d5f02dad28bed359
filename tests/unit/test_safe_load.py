"""Tests of dist_checkpointing.engine.safety: nothing from a checkpoint file is executed.

* every golden ``.metadata`` (Megatron-Core 0.13.1 and 0.19.2) loads with the restricted
  unpickler and matches its manifest exactly;
* torch-written metadata round-trips (all pickle protocols, and torch's real DCP writer);
* malicious pickles are refused, name the global and the file, and execute nothing;
* ``common.pt`` and ShardedObject payloads load with weights_only and match the manifests;
* truncated files raise CorruptCheckpointError naming the file.
"""

from __future__ import annotations

import argparse
import contextlib
import copyreg
import dataclasses
import enum
import gc
import importlib
import io
import json
import logging
import os
import pickle
import struct
import subprocess
import sys
import time
import types
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from dist_checkpointing._torch_compat import StorageInfo
from dist_checkpointing.engine.safety import (
    MCORE_SAVE_PLAN_GLOBAL,
    LegacyMCoreSavePlan,
    allowed_metadata_globals,
    is_allowed_metadata_global,
    load_metadata,
    safe_torch_load,
)
from dist_checkpointing.errors import CorruptCheckpointError, UnsafeCheckpointError

pytestmark = pytest.mark.timeout(120)

GOLDEN_CASES = [
    "mcore-0.13.1/tp2_basic",
    "mcore-0.13.1/grid2x2",
    "mcore-0.13.1/prepend_axis",
    "mcore-0.13.1/flat_dp2",
    "mcore-0.13.1/async_tp2",
    "mcore-0.19.2/tp2_basic",
    "mcore-0.19.2/grid2x2",
    "mcore-0.19.2/prepend_axis",
    "mcore-0.19.2/async_tp2",
]
CASES_WITH_COMMON_PT = [c for c in GOLDEN_CASES if c.startswith("mcore-0.13.1/")]


def _golden_root() -> Path:
    root = Path(__file__).resolve().parents[1] / "data" / "golden"
    if not (root / GOLDEN_CASES[0] / "manifest.json").is_file():
        pytest.fail(f"golden checkpoints not found ({root})")
    return root


def _case(case: str) -> tuple[Path, dict[str, Any]]:
    case_dir = _golden_root() / case
    manifest = json.loads((case_dir / "manifest.json").read_text())
    return case_dir / manifest["checkpoint_dir"], manifest


def _load_golden_metadata(case: str) -> tuple[Any, dict[str, Any]]:
    ckpt, manifest = _case(case)
    with open(ckpt / ".metadata", "rb") as f:
        return load_metadata(f, source=str(ckpt / ".metadata")), manifest


# --------------------------------------------------------------------------- value helpers


def _decode(value: Any) -> Any:
    """Manifest payload encoding -> Python objects (tensors from {"__tensor__": ...})."""
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            spec = value["__tensor__"]
            dtype = getattr(torch, spec["dtype"])
            return torch.tensor(spec["values"], dtype=dtype).reshape(spec["shape"])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _assert_same(actual: Any, expected: Any, path: str = "") -> None:
    """Exact comparison: types too (int vs float vs bool), tensors by dtype, shape and bits."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert torch.equal(actual, expected), path
        return
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, dict):
        assert sorted(actual) == sorted(expected), path  # dict equality ignores order
        for key in expected:
            _assert_same(actual[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_same(a, e, f"{path}[{i}]")
    else:
        assert actual == expected, path


def _describe_state_dict_metadata(md: Metadata) -> dict[str, Any]:
    """Metadata.state_dict_metadata in the manifest's JSON form."""
    out: dict[str, Any] = {}
    for key, item in md.state_dict_metadata.items():
        if type(item) is BytesStorageMetadata:
            out[key] = {"type": "bytes"}
            continue
        assert type(item) is TensorStorageMetadata, key
        assert type(item.size) is torch.Size
        out[key] = {
            "type": "tensor",
            "size": list(item.size),
            "dtype": str(item.properties.dtype).removeprefix("torch."),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in item.chunks],
        }
    return out


def _describe_storage_data(md: Metadata) -> list[dict[str, Any]]:
    out = []
    for index, info in md.storage_data.items():
        assert type(index) is MetadataIndex and type(info) is StorageInfo
        assert info.transform_descriptors is None
        out.append(
            {
                "fqn": index.fqn,
                "offset": None if index.offset is None else list(index.offset),
                "index": index.index,
                "relative_path": info.relative_path,
                "file_offset": info.offset,
                "length": info.length,
            }
        )
    return out


def _storage_key(entry: dict[str, Any]) -> tuple[str, list[int]]:
    return (entry["fqn"], entry["offset"] or [])


def _item_bytes(ckpt: Path, manifest: dict[str, Any], fqn: str) -> bytes:
    (entry,) = [e for e in manifest["format"]["storage_data"] if e["fqn"] == fqn]
    with open(ckpt / entry["relative_path"], "rb") as f:
        f.seek(entry["file_offset"])
        data = f.read(entry["length"])
    assert len(data) == entry["length"]
    return data


# --------------------------------------------------------------------------- golden metadata


@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_golden_metadata_matches_manifest(case: str) -> None:
    md, manifest = _load_golden_metadata(case)
    fmt = manifest["format"]
    assert type(md) is Metadata
    # Compared as ordered item lists: same keys, same order, same values.
    assert list(_describe_state_dict_metadata(md).items()) == list(
        fmt["state_dict_metadata"].items()
    )
    # The manifest lists storage_data sorted by (fqn, offset); the pickle keeps write order.
    assert sorted(_describe_storage_data(md), key=_storage_key) == sorted(
        fmt["storage_data"], key=_storage_key
    )
    assert len(md.storage_data) == len(fmt["storage_data"])
    assert md.version == fmt["metadata_version"]
    assert md.planner_data == fmt["planner_data"]
    assert type(md.storage_meta) is StorageMeta
    assert dataclasses.asdict(md.storage_meta) == fmt["storage_meta"]
    assert sorted(vars(md)) == fmt["metadata_attributes"]
    for key, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            props = item.properties
            assert props.layout is torch.strided and props.memory_format is torch.contiguous_format
            assert props.requires_grad is False and props.pin_memory is False, key


@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_golden_metadata_plans(case: str) -> None:
    md, manifest = _load_golden_metadata(case)
    expected_plans = manifest["format"]["metadata_extra_attributes"]["all_local_plans"]
    assert len(md.all_local_plans) == len(expected_plans)
    for plan, expected in zip(md.all_local_plans, expected_plans, strict=True):
        if expected["class"] == MCORE_SAVE_PLAN_GLOBAL:
            assert type(plan) is LegacyMCoreSavePlan
            assert plan.mcore_data == _tuples_from_json(expected["mcore_data"])
        else:
            assert expected["class"] == "torch.distributed.checkpoint.planner.SavePlan"
            assert type(plan) is SavePlan
        assert isinstance(plan, SavePlan)
        assert sorted(vars(plan)) == expected["attributes"]
        assert len(plan.items) == expected["items"]
        assert [item.index.fqn for item in plan.items] == expected["item_fqns"]
        assert all(type(item) is WriteItem for item in plan.items)
        assert plan.usable is True


def _tuples_from_json(mcore_data: dict[str, Any]) -> dict[str, Any]:
    """Megatron pickles nd_reformulated_orig_global_shape as a tuple; JSON made it a list."""
    return {
        key: {k: tuple(v) if isinstance(v, list) else v for k, v in entry.items()}
        for key, entry in mcore_data.items()
    }


@pytest.mark.parametrize("case", CASES_WITH_COMMON_PT)
def test_golden_013_metadata_exposes_mcore_data(case: str) -> None:
    md, manifest = _load_golden_metadata(case)
    expected = manifest["format"]["metadata_extra_attributes"]["mcore_data"]
    assert type(md.mcore_data) is dict
    assert md.mcore_data == _tuples_from_json(expected)
    assert set(md.mcore_data) == set(md.state_dict_metadata) - {
        k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)
    }


def test_golden_flat_dp2_reformulated_shapes() -> None:
    md, _ = _load_golden_metadata("mcore-0.13.1/flat_dp2")
    shapes = {k: v.get("nd_reformulated_orig_global_shape") for k, v in md.mcore_data.items()}
    assert shapes == {
        "optimizer.state.exp_avg.w": (8, 12),
        "optimizer.state.exp_avg.b": (12,),
        "optimizer.state.exp_avg_sq.w3d": (2, 8, 6),
        "param.w": None,
    }
    assert md.state_dict_metadata["optimizer.state.exp_avg.w"].size == torch.Size([2, 1, 48])


@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_golden_metadata_globals_all_allowed(case: str) -> None:
    _, manifest = _case(case)
    for name in manifest["format"]["metadata_pickle_globals"]:
        assert is_allowed_metadata_global(name), name


# --------------------------------------------------------------------------- round trips


def _sample_metadata() -> Any:
    props = TensorProperties(
        dtype=torch.bfloat16, layout=torch.sparse_coo, memory_format=torch.channels_last
    )
    chunk = ChunkStorageMetadata(offsets=torch.Size([0, 4]), sizes=torch.Size([2, 4]))
    items = [
        WriteItem(
            index=MetadataIndex("w", [0, 4]),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=chunk, properties=props, size=torch.Size([2, 8])),
        ),
        WriteItem(
            index=MetadataIndex("obj"),
            type=WriteItemType.BYTE_IO,
            bytes_io_data=BytesIOWriteData(nbytes=17),
        ),
    ]
    md: Any = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(props, torch.Size([2, 8]), [chunk]),
            "obj": BytesStorageMetadata(),
        },
        planner_data={"w": ("model", "w"), "tags": {"a", "b"}, "frozen": frozenset({1, 2})},
        storage_data={
            MetadataIndex("w", [0, 4]): StorageInfo("__0_0.distcp", 0, 100, ["zstd"]),
            MetadataIndex("obj"): StorageInfo("__0_0.distcp", 100, 17),
        },
        storage_meta=StorageMeta(checkpoint_id="ckpt", save_id="abc", modules=["m"]),
        version="1.0.0",
    )
    md.all_local_plans = [SavePlan(items, planner_data=OrderedDict(a=1))]
    return md


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_torch_pickled_metadata_round_trips(protocol: int) -> None:
    md = _sample_metadata()
    loaded: Any = load_metadata(io.BytesIO(pickle.dumps(md, protocol=protocol)), source="x")
    assert loaded == md
    assert loaded.storage_data == md.storage_data
    assert loaded.all_local_plans == md.all_local_plans
    props = loaded.state_dict_metadata["w"].properties
    assert props.memory_format is torch.channels_last and props.layout is torch.sparse_coo
    assert type(loaded.all_local_plans[0].planner_data) is OrderedDict
    assert loaded.planner_data["tags"] == {"a", "b"}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("as_path", [False, True])
def test_metadata_written_by_torch_dcp(tmp_path: Path, as_path: bool) -> None:
    state = {"w": torch.arange(12.0).reshape(3, 4), "blob": io.BytesIO(b"payload")}
    dcp.save(state, checkpoint_id=tmp_path if as_path else str(tmp_path), no_dist=True)
    with open(tmp_path / ".metadata", "rb") as f:
        loaded: Any = load_metadata(f, source=".metadata")
    with open(tmp_path / ".metadata", "rb") as f:
        expected = pickle.load(f)  # our own file: plain pickle is fine here
    assert loaded == expected
    assert loaded.storage_data == expected.storage_data
    assert type(loaded.state_dict_metadata["blob"]) is BytesStorageMetadata
    # torch's writer stores a PosixPath even for a str checkpoint_id.
    assert loaded.storage_meta.checkpoint_id == tmp_path
    assert type(loaded.storage_meta.checkpoint_id) is type(tmp_path)


def _install_fake_megatron(monkeypatch: pytest.MonkeyPatch) -> type:
    """A module tree holding a class pickled as Megatron-Core 0.13's MCoreSavePlan."""
    module_name, _, class_name = MCORE_SAVE_PLAN_GLOBAL.rpartition(".")

    @dataclasses.dataclass(frozen=True)
    class MCoreSavePlan(SavePlan):
        mcore_data: dict[str, dict[str, Any]] | None = None

    parts = module_name.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    MCoreSavePlan.__module__ = module_name
    MCoreSavePlan.__qualname__ = class_name
    setattr(sys.modules[module_name], class_name, MCoreSavePlan)
    return MCoreSavePlan


def test_mcore_save_plan_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cls = _install_fake_megatron(monkeypatch)
    md = _sample_metadata()
    mcore_data = {"w": {"nd_reformulated_orig_global_shape": (8, 12)}}
    plan = fake_cls(md.all_local_plans[0].items, usable=False, mcore_data=mcore_data)
    md.all_local_plans = [plan]
    raw = pickle.dumps(md)
    monkeypatch.undo()  # Megatron is gone again
    assert not any(name.startswith("megatron") for name in sys.modules)

    loaded: Any = load_metadata(io.BytesIO(raw), source="x")
    (stand_in,) = loaded.all_local_plans
    assert type(stand_in) is LegacyMCoreSavePlan and isinstance(stand_in, SavePlan)
    assert stand_in.items == plan.items and stand_in.usable is False
    assert stand_in.mcore_data == mcore_data
    assert stand_in.storage_data is None and stand_in.planner_data is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        stand_in.usable = True  # type: ignore[misc]

    # Pickled again, it becomes torch's own SavePlan: readable without this library.
    again = pickle.loads(pickle.dumps(loaded))
    assert type(again.all_local_plans[0]) is SavePlan
    assert again.all_local_plans[0].items == plan.items and again.all_local_plans[0].usable is False
    assert load_metadata(io.BytesIO(pickle.dumps(loaded)), source="x") == again


def test_allowlist_excludes_callables_that_could_be_abused() -> None:
    allowed = set(allowed_metadata_globals())
    for name in (
        "builtins.getattr",
        "builtins.eval",
        "builtins.exec",
        "builtins.__import__",
        "builtins.open",
        "builtins.type",
        "os.system",
        "posix.system",
        "subprocess.Popen",
        "torch.load",
        "torch.serialization.load",
        "torch._utils._rebuild_tensor_v2",
        "operator.attrgetter",
        "operator.methodcaller",
        "functools.partial",
        "functools.reduce",
        "copyreg.__newobj__",
        "pickle.loads",
        "torch.distributed.checkpoint.planner.SavePlanner",
    ):
        assert name not in allowed and not is_allowed_metadata_global(name), name
    assert "torch.distributed.checkpoint.metadata.Metadata" in allowed
    assert MCORE_SAVE_PLAN_GLOBAL in allowed
    assert "torch.bfloat16" in allowed


# --------------------------------------------------------------------------- malicious metadata


def _global_call(module: str, name: str, arg: str) -> bytes:
    """Protocol-0 pickle that calls module.name(arg)."""
    return f"c{module}\n{name}\n(V{arg}\ntR.".encode()


class _Evil:
    """Pickles as a call of ``func(*args)``; pickling it runs nothing, loading would."""

    def __init__(self, func: Any, args: tuple[Any, ...]) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


def _qualname(func: Any) -> str:
    return f"{func.__module__}.{func.__qualname__}"


def _evil_payloads(marker: Path) -> list[tuple[_Evil, str]]:
    touch = f"touch {marker}"
    return [
        (_Evil(os.system, (touch,)), _qualname(os.system)),  # posix.system
        (_Evil(exec, (f"open({str(marker)!r}, 'w').close()",)), "builtins.exec"),
        (_Evil(subprocess.Popen, (["touch", str(marker)],)), "subprocess.Popen"),
        (_Evil(open, (str(marker), "w")), _qualname(open)),
    ]


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("os", "system"),
        ("posix", "system"),
        ("nt", "system"),
        ("builtins", "exec"),
        ("builtins", "eval"),
        ("__builtin__", "eval"),  # Python 2 spelling, renamed to builtins.eval
        ("subprocess", "Popen"),
        ("builtins", "open"),
        ("io", "open"),
        ("torch", "load"),
        ("builtins", "getattr"),
        ("functools", "partial"),
    ],
)
def test_metadata_refuses_dangerous_global(tmp_path: Path, module: str, name: str) -> None:
    marker = tmp_path / "MARKER"
    raw = _global_call(module, name, f"touch {marker}")
    with pytest.raises(UnsafeCheckpointError) as info:
        load_metadata(io.BytesIO(raw), source="ckpt/.metadata")
    shown = "builtins.eval" if module == "__builtin__" else f"{module}.{name}"
    assert f"'{shown}'" in str(info.value) and "ckpt/.metadata" in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [0, 2, pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL])
def test_metadata_refuses_reduce_payloads_nested_in_metadata(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "MARKER"
    for evil, qualname in _evil_payloads(marker):
        md = _sample_metadata()
        md.storage_meta.modules = ["ok", evil]
        raw = pickle.dumps(md, protocol=protocol)
        with pytest.raises(UnsafeCheckpointError, match=f"'{qualname}'") as info:
            load_metadata(io.BytesIO(raw), source="dir/.metadata")
        assert "dir/.metadata" in str(info.value)
        assert not marker.exists()


def _op_global(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


def _op_str(text: str) -> bytes:
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


_MD = "torch.distributed.checkpoint.metadata"
_DCP_PLANNER = "torch.distributed.checkpoint.planner"


def test_build_on_allowlisted_class_is_refused() -> None:
    # BUILD with slot state on the class object itself would set a class attribute
    # for the whole process (e.g. replace Metadata.__repr__).
    raw = (
        b"\x80\x02"
        + _op_global(_MD, "Metadata")
        + b"N}"
        + _op_str("__repr__")
        + _op_str("pwned")
        + b"s\x86b."
    )
    with pytest.raises(UnsafeCheckpointError, match="class 'torch.distributed"):
        load_metadata(io.BytesIO(raw), source="f")
    assert not isinstance(vars(Metadata).get("__repr__"), str)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # REDUCE on a dtype value (not callable)
        (b"\x80\x02" + _op_global("torch", "float32") + b")R.", "calling .*torch.dtype"),
        # a dataclass may only be created empty by NEWOBJ, not called with arguments
        (b"\x80\x02" + _op_global(_MD, "StorageMeta") + _op_str("x") + b"\x85R.", "StorageMeta"),
        # NEWOBJ with constructor arguments
        (b"\x80\x02" + _op_global(_MD, "StorageMeta") + _op_str("x") + b"\x85\x81.", "argument"),
        # functional Enum API (creates a class) instead of a member lookup
        (
            b"\x80\x02"
            + _op_global("torch.distributed.checkpoint.planner", "WriteItemType")
            + _op_str("X")
            + _op_str("A B")
            + b"\x86R.",
            "WriteItemType",
        ),
        # an instance attribute named like a special method
        (
            b"\x80\x02"
            + _op_global(_MD, "StorageMeta")
            + b")\x81}"
            + _op_str("__setstate__")
            + _op_global("torch", "Size")
            + b"sb.",
            "__setstate__",
        ),
        # SETITEM on an object that is not a dict
        (
            b"\x80\x02" + _op_global(_MD, "StorageMeta") + b")\x81" + _op_str("k") + b"Ns.",
            "SETITEM on .*StorageMeta",
        ),
        # persistent ids and copyreg extension codes
        (b"\x80\x02" + _op_str("id") + b"Q.", "persistent id"),
        (b"\x80\x02\x82\x01.", "extension"),
    ],
    ids=[
        "reduce-dtype",
        "reduce-dataclass",
        "newobj-args",
        "enum-functional-api",
        "dunder-attribute",
        "setitem-non-dict",
        "persistent-id",
        "extension-code",
    ],
)
def test_metadata_refuses_abuse_of_allowed_objects(raw: bytes, expected: str) -> None:
    with pytest.raises(UnsafeCheckpointError, match=expected) as info:
        load_metadata(io.BytesIO(raw), source="the/.metadata")
    assert "the/.metadata" in str(info.value)


def test_truncated_metadata_is_corrupt() -> None:
    ckpt, _ = _case(GOLDEN_CASES[0])
    raw = (ckpt / ".metadata").read_bytes()
    for cut in (0, 1, len(raw) // 3, len(raw) - 1):
        with pytest.raises(CorruptCheckpointError, match="ckpt-x/.metadata"):
            load_metadata(io.BytesIO(raw[:cut]), source="ckpt-x/.metadata")


def test_metadata_of_wrong_type_is_corrupt() -> None:
    with pytest.raises(
        CorruptCheckpointError, match="expected a pickled .*Metadata.*'builtins.dict'"
    ):
        load_metadata(io.BytesIO(pickle.dumps({"a": 1})), source="m")
    with pytest.raises(CorruptCheckpointError, match="m2"):
        load_metadata(io.BytesIO(b"not a pickle at all"), source="m2")


# --------------------------------------------------------------------------- fast unpickler
#
# load_metadata reads with pickle's C unpickler and lets the checked pure-Python one decide
# any file the C one declines (logged at DEBUG). These tests check that real metadata takes
# the fast path, that its result is exactly plain pickle's, and that no pickle can use the
# fast path to change anything outside the load (the attacks the C unpickler cannot gate).

_LOGGER = "dist_checkpointing.engine.safety"
_DECLINED = "checked unpickling"


def _load_fast_only(raw: bytes, caplog: pytest.LogCaptureFixture, source: str = "x") -> Any:
    """load_metadata(raw), asserting that the fast unpickler produced the result."""
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=_LOGGER):
        loaded = load_metadata(io.BytesIO(raw), source=source)
    assert not [r for r in caplog.records if _DECLINED in r.getMessage()], caplog.text
    return loaded


def _load_declined(raw: bytes, caplog: pytest.LogCaptureFixture) -> Any:
    """load_metadata(raw), asserting that the checked unpickler decided it."""
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=_LOGGER):
        loaded = load_metadata(io.BytesIO(raw), source="x")
    assert [r for r in caplog.records if _DECLINED in r.getMessage()]
    return loaded


def _large_metadata(n: int) -> Any:
    """A Metadata shaped like a real checkpoint's: n tensors in two chunks each."""
    sdm: dict[str, Any] = {}
    storage: dict[MetadataIndex, StorageInfo] = {}
    for i in range(n):
        key = f"layers.{i // 8}.w{i % 8}"
        chunks = []
        for rank in range(2):
            offsets = torch.Size([rank * 4, 0])
            chunks.append(ChunkStorageMetadata(offsets, torch.Size([4, 8])))
            storage[MetadataIndex(key, offsets, rank)] = StorageInfo(f"__{rank}_0.distcp", i, 9)
        props = TensorProperties(dtype=torch.bfloat16 if i % 2 else torch.float32)
        sdm[key] = TensorStorageMetadata(props, torch.Size([8, 8]), chunks)
    sdm["blob"] = BytesStorageMetadata()
    return Metadata(
        sdm,
        planner_data={k: tuple(k.split(".")) for k in sdm},
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=Path("/ckpt"), save_id="s", modules=["m"]),
        version="1.0.0",
    )


@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_golden_metadata_takes_the_fast_path(case: str, caplog: pytest.LogCaptureFixture) -> None:
    ckpt, _ = _case(case)
    raw = (ckpt / ".metadata").read_bytes()
    loaded = _load_fast_only(raw, caplog)
    # The checked unpickler (forced by a registered copyreg extension) agrees exactly.
    with _extension_registered("os", "getcwd", _PRIVATE_EXT_CODE):
        checked = load_metadata(io.BytesIO(raw), source="x")
    assert loaded == checked and vars(loaded).keys() == vars(checked).keys()
    assert loaded.storage_data == checked.storage_data
    assert loaded.all_local_plans == checked.all_local_plans
    assert [type(p) for p in loaded.all_local_plans] == [type(p) for p in checked.all_local_plans]


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_fast_path_result_is_plain_picklers(
    protocol: int, caplog: pytest.LogCaptureFixture
) -> None:
    md = _large_metadata(300)
    md.all_local_plans = _sample_metadata().all_local_plans
    loaded = _load_fast_only(pickle.dumps(md, protocol=protocol), caplog)
    assert loaded == md and loaded.storage_data == md.storage_data
    assert loaded.planner_data == md.planner_data and loaded.all_local_plans == md.all_local_plans
    # Every object is of its real class (no per-load stand-in class is left behind) and
    # shared singletons are the process's own.
    assert type(loaded) is Metadata and type(loaded.storage_meta) is StorageMeta
    assert type(loaded.storage_meta.checkpoint_id) is type(Path("/ckpt"))
    for item in loaded.state_dict_metadata.values():
        assert type(item) in (TensorStorageMetadata, BytesStorageMetadata)
        if type(item) is TensorStorageMetadata:
            assert type(item.properties) is TensorProperties
            assert item.properties.memory_format is torch.contiguous_format
            assert {type(c) for c in item.chunks} == {ChunkStorageMetadata}
    assert {type(k) for k in loaded.storage_data} == {MetadataIndex}
    assert {type(v) for v in loaded.storage_data.values()} == {StorageInfo}
    index = MetadataIndex("layers.0.w1", [4, 0])
    assert loaded.storage_data[index].relative_path == "__1_0.distcp"  # hashes still agree
    (plan,) = loaded.all_local_plans
    assert type(plan) is SavePlan and plan.items[0].type is WriteItemType.SHARD
    assert plan.items[1].type is WriteItemType.BYTE_IO


def test_fast_path_keeps_shared_and_cyclic_objects(caplog: pytest.LogCaptureFixture) -> None:
    md = _sample_metadata()
    loop: list[Any] = ["x"]
    loop.append(loop)
    shared = StorageMeta(save_id="same")
    md.planner_data = {"loop": loop, "a": shared, "b": [shared, shared]}
    loaded = _load_fast_only(pickle.dumps(md), caplog)
    assert loaded.planner_data["loop"][1] is loaded.planner_data["loop"]
    a, b = loaded.planner_data["a"], loaded.planner_data["b"]
    assert type(a) is StorageMeta and a is b[0] is b[1] and a.save_id == "same"


@pytest.mark.parametrize(
    "planner_data",
    [
        (WriteItemType.SHARD, Path("/p")),  # enum member and path inside a tuple
        {WriteItemType.TENSOR: 1},  # enum member as a dict key
    ],
    ids=["tuple", "dict-key"],
)
def test_unusual_metadata_is_decided_by_the_checked_unpickler(
    planner_data: Any, caplog: pytest.LogCaptureFixture
) -> None:
    md = _sample_metadata()
    md.planner_data = planner_data
    raw = pickle.dumps(md)
    loaded = _load_declined(raw, caplog)
    assert loaded == pickle.loads(raw) and loaded.planner_data == planner_data
    shared = [*loaded.planner_data, *_values(loaded.planner_data)]
    assert any(v is WriteItemType.SHARD or v is WriteItemType.TENSOR for v in shared)


def test_classes_as_plain_values_are_refused() -> None:
    # A class handed out as data could be changed by whoever uses it, for the process.
    md = _sample_metadata()
    md.planner_data = {"cls": Metadata, "size": torch.Size}
    with pytest.raises(UnsafeCheckpointError, match="hands out"):
        load_metadata(io.BytesIO(pickle.dumps(md)), source="x")


def _values(data: Any) -> list[Any]:
    return list(data.values()) if isinstance(data, dict) else list(data)


@pytest.mark.parametrize("initially_enabled", [True, False])
def test_garbage_collector_state_is_restored(initially_enabled: bool) -> None:
    raw = pickle.dumps(_large_metadata(50))
    was = gc.isenabled()
    try:
        gc.enable() if initially_enabled else gc.disable()
        load_metadata(io.BytesIO(raw), source="x")
        assert gc.isenabled() is initially_enabled
        with pytest.raises(UnsafeCheckpointError):
            load_metadata(io.BytesIO(_global_call("os", "system", "true")), source="x")
        assert gc.isenabled() is initially_enabled
    finally:
        gc.enable() if was else gc.disable()


def test_large_metadata_takes_the_fast_path() -> None:
    """A plain ``.metadata`` is read by the C unpickler (the checked pure-Python one is
    several times slower: bench/metadata_guard.py measures both); registered copyreg
    extension codes force the checked one, with the same result."""
    from dist_checkpointing.engine.safety.fast_unpickler import _load_fast

    raw = pickle.dumps(_large_metadata(2000))
    result, declined = _load_fast(raw, "x")
    assert declined is None and isinstance(result, Metadata)
    with _extension_registered("os", "getcwd", _PRIVATE_EXT_CODE):
        assert _load_fast(raw, "x")[1] is not None
        checked = load_metadata(io.BytesIO(raw), source="x")
    assert checked.state_dict_metadata == result.state_dict_metadata


# ----- attacks on what a pickle can reach


def _resolve(name: str) -> Any:
    if name == MCORE_SAVE_PLAN_GLOBAL:
        return LegacyMCoreSavePlan
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _attribute_snapshot(obj: Any) -> dict[str, Any]:
    attrs: dict[str, Any] = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
    for special in ("__bases__", "__name__", "__qualname__", "__defaults__", "__kwdefaults__"):
        if hasattr(obj, special):
            attrs[special] = getattr(obj, special)
    return attrs


def _process_state() -> dict[str, dict[str, Any]]:
    """The attributes of everything a metadata pickle can name, and of enum members."""
    state = {}
    for name in allowed_metadata_globals():
        obj = _resolve(name)
        state[name] = _attribute_snapshot(obj)
        if isinstance(obj, type) and issubclass(obj, enum.Enum):
            for member in obj:
                state[f"{name}.{member.name}"] = _attribute_snapshot(member)
    for cls in (OrderedDict, torch.Size, set, frozenset, Path, type(Path("/"))):
        state[cls.__qualname__] = _attribute_snapshot(cls)
    return state


def _assert_state_unchanged(before: dict[str, dict[str, Any]]) -> None:
    after = _process_state()
    assert after.keys() == before.keys()
    for name, attrs in before.items():
        assert after[name].keys() == attrs.keys(), name
        # (Built-in types make a new str for __name__ on each access: those compare equal.)
        changed = [k for k, v in attrs.items() if after[name][k] is not v and after[name][k] != v]
        assert not changed, (name, changed)


def _ops_global(name: str) -> bytes:
    module, _, attr = name.rpartition(".")
    return _op_global(module, attr)


_SLOT_STATE_ON_TOP = b"N}" + _op_str("__repr__") + _op_str("pwned") + b"s\x86b"


@pytest.mark.parametrize("name", allowed_metadata_globals())
def test_build_on_any_allowed_global_changes_nothing(name: str) -> None:
    before = _process_state()
    attacks = [
        # slot state: setattr on the object itself (a class: for the whole process)
        b"\x80\x02" + _ops_global(name) + _SLOT_STATE_ON_TOP + b".",
        # dict state: its __dict__
        b"\x80\x02" + _ops_global(name) + b"}" + _op_str("marker") + b"K\x01sb.",
        # slot state replacing the bases, then the class used again in the same pickle
        b"\x80\x02"
        + _ops_global(name)
        + b"N}"
        + _op_str("__bases__")
        + _ops_global(f"{_MD}.StorageMeta")
        + b"\x85s\x86b0"
        + _ops_global(name)
        + b")\x81.",
    ]
    for raw in attacks:
        with pytest.raises(UnsafeCheckpointError, match="the/.metadata") as info:
            load_metadata(io.BytesIO(raw), source="the/.metadata")
        assert "setting the state of" in str(info.value)
        _assert_state_unchanged(before)


def _reduce(name: str, *args: bytes) -> bytes:
    tuple_op = {0: b")", 1: b"\x85", 2: b"\x86", 3: b"\x87"}[len(args)]
    return _ops_global(name) + b"".join(args) + tuple_op + b"R"


def _int_op(value: int) -> bytes:
    return b"K" + bytes([value])


_MEM_FORMAT = type(TensorProperties().__getstate__()[3])


@pytest.mark.parametrize(
    "make_shared",
    [
        _reduce(f"{_DCP_PLANNER}.WriteItemType", _int_op(WriteItemType.SHARD.value)),
        _reduce(f"{_MEM_FORMAT.__module__}.{_MEM_FORMAT.__qualname__}", _int_op(0)),
        _reduce("torch.serialization._get_layout", _op_str("torch.strided")),
        _reduce("pathlib.PurePosixPath", _op_str("/a")),
        _reduce("torch.Size", b")"),
        _ops_global("torch.float32"),
        _ops_global("builtins.object"),
    ],
    ids=["enum-member", "mem-format-member", "layout", "path", "size", "dtype", "object"],
)
@pytest.mark.parametrize(
    "build",
    [
        b"}" + _op_str("_value_") + _int_op(99) + b"sb",  # dict state
        _SLOT_STATE_ON_TOP,  # slot state (setattr)
        b"N}" + _op_str("__class__") + _ops_global(f"{_MD}.StorageMeta") + b"s\x86b",
    ],
    ids=["dict-state", "slot-state", "class-swap"],
)
def test_build_on_shared_objects_is_refused(make_shared: bytes, build: bytes) -> None:
    before = _process_state()
    before_members = [(m, dict(vars(m))) for e in (WriteItemType, _MEM_FORMAT) for m in e]
    raw = b"\x80\x02" + make_shared + build + b"."
    with pytest.raises(UnsafeCheckpointError, match="setting the state of|slot state"):
        load_metadata(io.BytesIO(raw), source="f")
    _assert_state_unchanged(before)
    for member, attrs in before_members:
        assert vars(member) == attrs and type(member) in (WriteItemType, _MEM_FORMAT)
    assert WriteItemType(WriteItemType.SHARD.value) is WriteItemType.SHARD


def _new(name: str) -> bytes:
    return _ops_global(name) + b")\x81"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # an instance changing its class through slot state
        (
            _new(f"{_MD}.Metadata")
            + b"N}"
            + _op_str("__class__")
            + _ops_global(f"{_MD}.StorageMeta")
            + b"s\x86b",
            "slot state",
        ),
        # an instance's __dict__ replaced through slot state
        (_new(f"{_MD}.Metadata") + b"N}" + _op_str("__dict__") + b"}s\x86b", "slot state"),
        # BUILD puts __setstate__ in an instance dict, a second BUILD would call it
        (
            _new(f"{_MD}.StorageMeta")
            + b"}"
            + _op_str("__setstate__")
            + _ops_global("builtins.set")
            + b"sb]b",
            "__setstate__",
        ),
        # an instance attribute named like a container method, then a container opcode
        (
            _new(f"{_MD}.StorageMeta")
            + b"}"
            + _op_str("append")
            + _ops_global("builtins.set")
            + b"sb]a",
            "APPEND on",
        ),
        # plain data under a special-method name (later copy/pickle calls would look it up)
        (
            _new(f"{_MD}.Metadata")
            + b"}"
            + _op_str("state_dict_metadata")
            + b"}s"
            + _op_str("__reduce_ex__")
            + _op_str("x")
            + b"sb",
            "attribute names",
        ),
        # an attribute name that is not a str
        (_new(f"{_MD}.Metadata") + b"}" + _int_op(1) + _int_op(2) + b"sb", "attribute names"),
        # the same on an OrderedDict inside valid metadata
        (
            _new(f"{_MD}.Metadata")
            + b"}"
            + _op_str("state_dict_metadata")
            + b"}s"
            + _op_str("planner_data")
            + _reduce("collections.OrderedDict")
            + b"}"
            + _op_str("__deepcopy__")
            + b"Nsbsb",
            "attribute names",
        ),
        # copyreg._reconstructor with a base other than object
        (
            _reduce(
                "copyreg._reconstructor",
                _ops_global(f"{_MD}.StorageMeta"),
                _ops_global("builtins.set"),
                b"N",
            ),
            "copyreg._reconstructor",
        ),
    ],
    ids=[
        "class-swap",
        "dict-swap",
        "setstate-hijack",
        "append-hijack",
        "dunder-data",
        "non-str-name",
        "ordered-dict-dunder",
        "reconstructor-base",
    ],
)
def test_instance_attacks_are_refused(raw: bytes, expected: str) -> None:
    before = _process_state()
    with pytest.raises(UnsafeCheckpointError, match=expected):
        load_metadata(io.BytesIO(b"\x80\x02" + raw + b"."), source="f")
    _assert_state_unchanged(before)


_PRIVATE_EXT_CODE = 0xF1  # copyreg reserves 240-255 for private use


@contextlib.contextmanager
def _extension_registered(module: str, name: str, code: int) -> Iterator[None]:
    copyreg.add_extension(module, name, code)
    try:
        yield
    finally:
        copyreg.remove_extension(module, name, code)


def test_registered_extension_code_cannot_bypass_the_allowlist(tmp_path: Path) -> None:
    # With a code registered and cached (by an earlier plain unpickling), the C unpickler
    # would resolve it without find_class: load_metadata must not take that path.
    marker = tmp_path / "MARKER"
    ext = b"\x82" + bytes([_PRIVATE_EXT_CODE])
    raw = b"\x80\x02" + ext + _op_str(f"touch {marker}") + b"\x85R."
    with _extension_registered(os.system.__module__, "system", _PRIVATE_EXT_CODE):
        assert pickle.loads(b"\x80\x02" + ext + b".") is os.system  # now cached
        with pytest.raises(UnsafeCheckpointError, match="extension") as info:
            load_metadata(io.BytesIO(raw), source="dir/.metadata")
        assert "dir/.metadata" in str(info.value)
    assert not marker.exists()


def test_sharing_that_would_make_the_walk_exponential(caplog: pytest.LogCaptureFixture) -> None:
    # 64 levels of StorageMeta, each holding the one below twice: 2**64 paths, 65 objects.
    raw = b"\x80\x02" + _new(f"{_MD}.StorageMeta") + b"q\x000"
    for level in range(1, 65):
        below = b"h" + bytes([level - 1])
        raw += _new(f"{_MD}.StorageMeta") + b"}" + _op_str("save_id") + below + b"s"
        raw += _op_str("load_id") + below + b"sbq" + bytes([level]) + b"0"
    raw += _new(f"{_MD}.Metadata") + b"}" + _op_str("state_dict_metadata") + b"}s"
    raw += _op_str("planner_data") + b"h" + bytes([64]) + b"sb."
    start = time.perf_counter()
    loaded = _load_declined(raw, caplog)
    assert time.perf_counter() - start < 10
    top = loaded.planner_data
    assert type(top) is StorageMeta and top.save_id is top.load_id
    assert type(top.save_id) is StorageMeta and top.save_id.save_id is top.save_id.load_id


# --------------------------------------------------------------------------- safe_torch_load


@pytest.mark.parametrize("case", CASES_WITH_COMMON_PT)
def test_golden_common_pt(case: str) -> None:
    ckpt, manifest = _case(case)
    loaded = safe_torch_load((ckpt / "common.pt").read_bytes(), source="common.pt")
    _assert_same(loaded, _decode(manifest["common_state"]))
    with open(ckpt / "common.pt", "rb") as f:  # file objects work too
        _assert_same(safe_torch_load(f, source="common.pt"), _decode(manifest["common_state"]))


@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_golden_sharded_object_payloads(case: str) -> None:
    ckpt, manifest = _case(case)
    seen = 0
    for obj in manifest["sharded_objects"].values():
        for shard in obj["shards"]:
            if not shard["is_main_replica"]:
                continue
            raw = _item_bytes(ckpt, manifest, shard["unique_key"])
            loaded = safe_torch_load(raw, source=shard["unique_key"])
            _assert_same(loaded, [_decode(shard["payload"])])
            seen += 1
    assert seen == sum(
        1 for o in manifest["sharded_objects"].values() for s in o["shards"] if s["is_main_replica"]
    )
    if case.startswith("mcore-0.19.2/"):  # the common state lives in the data files
        raw = _item_bytes(ckpt, manifest, "common_state/shard_0_1")
        _assert_same(safe_torch_load(raw, source="x"), [_decode(manifest["common_state"])])


def test_torch_load_refuses_reduce_payloads(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    for evil, qualname in _evil_payloads(marker):
        buf = io.BytesIO()
        torch.save({"ok": torch.ones(2), "evil": evil}, buf)  # saving executes nothing
        with pytest.raises(UnsafeCheckpointError) as info:
            safe_torch_load(buf.getvalue(), source="ckpt/common.pt")
        message = str(info.value)
        assert f"'{qualname}'" in message and "ckpt/common.pt" in message
        assert "trusted=True" in message
        assert not marker.exists()


def test_torch_load_names_type_and_fix() -> None:
    buf = io.BytesIO()
    torch.save({"args": argparse.Namespace(lr=0.5), "t": torch.arange(3)}, buf)
    raw = buf.getvalue()
    before = torch.serialization.get_safe_globals()
    with pytest.raises(UnsafeCheckpointError) as info:
        safe_torch_load(raw, source="ckpt/common.pt")
    message = str(info.value)
    assert "'argparse.Namespace'" in message and "ckpt/common.pt" in message
    assert "allowed_types=[argparse.Namespace]" in message and "trusted=True" in message

    for loaded in (
        safe_torch_load(raw, source="c", allowed_types=[argparse.Namespace]),
        safe_torch_load(io.BytesIO(raw), source="c", trusted=True),
    ):
        assert loaded["args"] == argparse.Namespace(lr=0.5)
        assert torch.equal(loaded["t"], torch.arange(3))
    # The allowance was scoped to the call. (torch keeps its allowlist in a set and
    # returns it as a list: compare the contents, not the order.)
    assert set(torch.serialization.get_safe_globals()) == set(before)
    with pytest.raises(UnsafeCheckpointError):
        safe_torch_load(raw, source="c")


def test_torch_load_keeps_globally_registered_types() -> None:
    buf = io.BytesIO()
    torch.save(argparse.Namespace(a=1), buf)
    torch.serialization.add_safe_globals([argparse.Namespace])
    try:
        safe_torch_load(buf.getvalue(), source="c", allowed_types=[argparse.Namespace])
        assert argparse.Namespace in torch.serialization.get_safe_globals()
    finally:
        torch.serialization.clear_safe_globals()


def test_torch_load_rejects_non_types_in_allowed_types() -> None:
    with pytest.raises(TypeError, match="allowed_types"):
        safe_torch_load(b"", source="c", allowed_types=[os.system])  # type: ignore[list-item]


@pytest.mark.parametrize("trusted", [False, True])
def test_truncated_payload_is_corrupt(trusted: bool) -> None:
    ckpt, manifest = _case("mcore-0.13.1/tp2_basic")
    raw = _item_bytes(ckpt, manifest, "per_rank_obj/shard_0_2")
    for bad in (raw[: len(raw) // 2], raw[:-1], b"", b"garbage" * 10):
        with pytest.raises(CorruptCheckpointError, match="__0_0.distcp@per_rank_obj"):
            safe_torch_load(bad, source="__0_0.distcp@per_rank_obj", trusted=trusted)
    common = (ckpt / "common.pt").read_bytes()
    with pytest.raises(CorruptCheckpointError, match="common.pt"):
        safe_torch_load(common[:-30], source="checkpoint/common.pt")
