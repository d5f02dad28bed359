"""Interoperability with plain PyTorch DCP and Megatron-Core 0.13's on-disk layout.

A checkpoint saved by our library (2 ranks: TP=2 tensors of several dtypes,
per-layer tensors, distributed-optimizer flat ranges, ShardedObjects, a common
part) must be readable by ``torch.distributed.checkpoint`` alone, in a process
where ``dist_checkpointing`` (and Megatron) cannot be imported, and must have the
layout Megatron-Core 0.13.1 writes (compared with the golden 0.13.1 checkpoints).
The golden checkpoints themselves go through the same plain-torch reader.
"""

from __future__ import annotations

import copy
import io
import json
import math
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

import dist_checkpointing as dc
from tests.support.golden_utils import (
    GoldenCase,
    assert_same_value,
    assert_tensor_bitwise,
    golden_cases,
    golden_values,
    load_metadata_with_stubs,
    pickle_globals,
    reformulate,
)
from tests.support.harness import run_distributed

pytestmark = pytest.mark.timeout(240)

REPO_ROOT = Path(__file__).resolve().parents[2]
CASES = golden_cases()
GOLDEN_19 = [c for c in CASES if not c.is_legacy]
GOLDEN_13 = [c for c in CASES if c.is_legacy]
GOLDEN_13_FLAT = next(c for c in GOLDEN_13 if c.name == "flat_dp2")
ALLOWED_PICKLE_MODULES = ("torch", "builtins", "collections")

# --------------------------------------------------------------------------------------------
# The checkpoint we save: key -> (key_index, global shape, dtype)
# --------------------------------------------------------------------------------------------

REGULAR = {
    "model.tp_row.float32": (0, (8, 12), torch.float32),
    "model.tp_col.bfloat16": (1, (4, 12), torch.bfloat16),
    "model.tp_row.int64": (2, (8, 4), torch.int64),
    "model.tp_col.float16": (3, (4, 6), torch.float16),
    "model.bias": (4, (5, 3), torch.float32),
    "decoder.layers.w": (5, (4, 6, 8), torch.float32),
}
# Flat (distributed-optimizer) keys: (key_index, global shape, dtype, TP axis or None).
FLAT = {
    "optimizer.state.exp_avg.w": (6, (8, 12), torch.float32, 0),
    "optimizer.state.exp_avg.b": (7, (12,), torch.float32, None),
    "optimizer.state.exp_avg_sq.w3d": (8, (2, 8, 6), torch.float32, 1),
    "optimizer.state.step.bf16": (9, (6, 4), torch.bfloat16, 1),
}
# The flat ranges: per key, per rank, a list of (TP block index, start, stop).
FLAT_RANGES = {
    # TP=2 x DP=2 folded onto 2 ranks: each rank holds one DP range of both TP blocks.
    "optimizer.state.exp_avg.w": {0: [(0, 0, 23), (1, 23, 48)], 1: [(0, 23, 48), (1, 0, 23)]},
    # TP=1, uneven DP=2.
    "optimizer.state.exp_avg.b": {0: [(0, 0, 5)], 1: [(0, 5, 12)]},
    "optimizer.state.exp_avg_sq.w3d": {0: [(0, 0, 30), (1, 30, 48)], 1: [(0, 30, 48), (1, 0, 30)]},
    # Each rank its own TP block, in two ranges.
    "optimizer.state.step.bf16": {0: [(0, 0, 7), (0, 7, 12)], 1: [(1, 0, 7), (1, 7, 12)]},
}
OBJECT_PAYLOADS = {
    "per_rank_obj/shard_0_2": {"rank": 0, "text": "rang 0 é", "v": [1, 2.5, None, True]},
    "per_rank_obj/shard_1_2": {"rank": 1, "text": "rang 1 é", "v": [2, 2.5, None, False]},
    "model.extra_state/shard_0_1": {"kind": "extra", "rng": torch.arange(4, dtype=torch.uint8)},
}
COMMON: dict[str, Any] = {
    "iteration": 5,
    "model": {"config_version": 3},
    "optimizer": {"param_groups": [{"lr": 0.5, "params": [0, 1]}]},
    "note": "ünïcode",
    "t": torch.tensor([1.5, -2.0]),
}


def _global(key: str) -> torch.Tensor:
    index, shape, dtype = (REGULAR | {k: v[:3] for k, v in FLAT.items()})[key]
    return golden_values(index, shape, dtype)


def _flat_block_shape(key: str) -> tuple[int, ...]:
    _, shape, _, axis = FLAT[key]
    block = list(shape)
    if axis is not None:
        block[axis] //= 2
    return tuple(block)


def _expected_stored(key: str) -> torch.Tensor:
    """What plain DCP returns for ``key``: the logical tensor, or the N-D reformulation."""
    if key in FLAT:
        return reformulate(_global(key), _flat_block_shape(key))
    return _global(key)


def _split(key: str, axis: int, rank: int) -> torch.Tensor:
    """A view into the global tensor (contiguous or not, with a larger storage): each
    saved item must still hold only its chunk."""
    return _global(key).chunk(2, dim=axis)[rank]


def _rank_state_dict(rank: int) -> dict[str, Any]:
    """Rank ``rank``'s sharded state dict, the common part deep-merged in."""
    st = dc.ShardedTensor
    sd = copy.deepcopy(COMMON)
    sd["model"].update(
        row_f32=st.from_rank_offsets(
            "model.tp_row.float32", _split("model.tp_row.float32", 0, rank), (0, rank, 2)
        ),
        col_bf16=st.from_rank_offsets(
            "model.tp_col.bfloat16", _split("model.tp_col.bfloat16", 1, rank), (1, rank, 2)
        ),
        row_i64=st.from_rank_offsets(
            "model.tp_row.int64", _split("model.tp_row.int64", 0, rank), (0, rank, 2)
        ),
        col_f16=st.from_rank_offsets(
            "model.tp_col.float16", _split("model.tp_col.float16", 1, rank), (1, rank, 2)
        ),
        bias=st.from_rank_offsets("model.bias", _global("model.bias"), replica_id=rank),
        extra_state=dc.ShardedObject(
            "model.extra_state",
            OBJECT_PAYLOADS["model.extra_state/shard_0_1"],
            (1,),
            (0,),
            replica_id=rank,
        ),
    )
    layers = _global("decoder.layers.w")
    sd["decoder"] = [  # several shards of one key on a rank, in a list
        st.from_rank_offsets("decoder.layers.w", layers[layer], (0, layer, 4), prepend_axis_num=1)
        for layer in (2 * rank, 2 * rank + 1)
    ]
    sd["rng"] = dc.ShardedObject(
        "per_rank_obj", OBJECT_PAYLOADS[f"per_rank_obj/shard_{rank}_2"], (2,), (rank,)
    )
    state: dict[str, Any] = {}
    for key, (_, _, _, axis) in FLAT.items():
        shards = []
        for b, start, stop in FLAT_RANGES[key][rank]:
            offsets = () if axis is None else ((axis, b, 2),)
            block = _global(key) if axis is None else _global(key).chunk(2, dim=axis)[b]
            shards.append(
                st.from_rank_offsets_flat(
                    key,
                    block.reshape(-1)[start:stop],
                    _flat_block_shape(key),
                    *offsets,
                    flattened_range=slice(start, stop),
                )
            )
        state[key.removeprefix("optimizer.state.")] = shards
    sd["optimizer"]["state"] = state
    return sd


def _rank_save(ckpt_dir: str) -> None:
    dc.save(_rank_state_dict(dist.get_rank()), ckpt_dir)


@pytest.fixture(scope="module")
def our_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = tmp_path_factory.mktemp("ours") / "checkpoint"
    ckpt.mkdir()
    run_distributed(_rank_save, 2, str(ckpt), timeout=120.0)
    return ckpt


def _read_metadata(ckpt: Path) -> Metadata:
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)
    assert isinstance(md, Metadata)
    return md


# --------------------------------------------------------------------------------------------
# Plain torch in a subprocess that cannot import dist_checkpointing or Megatron
# --------------------------------------------------------------------------------------------

_PLAIN_TORCH_SCRIPT = r"""
import importlib.abc, io, sys, traceback, types

BLOCKED = ("dist_checkpointing", "megatron", "tests")


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"plain-torch check: importing {name} is not allowed")
        return None


sys.meta_path.insert(0, _Blocker())

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata


def install_megatron_stand_in():
    # README of tests/data/golden: an empty stand-in class is enough for 0.13.1's .metadata.
    names = ["megatron", "megatron.core", "megatron.core.dist_checkpointing",
             "megatron.core.dist_checkpointing.strategies",
             "megatron.core.dist_checkpointing.strategies.torch"]
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    stand_in = type("MCoreSavePlan", (), {"__module__": names[-1]})
    sys.modules[names[-1]].MCoreSavePlan = stand_in


def sentinel(size, dtype):
    if dtype.is_floating_point:
        return torch.full(tuple(size), float("nan"), dtype=dtype)
    return torch.full(tuple(size), torch.iinfo(dtype).min, dtype=dtype)


def run_job(ckpt, out_pt):
    res = {}
    try:
        dcp_to_torch_save(ckpt, out_pt)
        res["dcp_to_torch_save"] = torch.load(out_pt, weights_only=True)
    except Exception:
        res["dcp_to_torch_save_error"] = traceback.format_exc()
    try:
        md = FileSystemReader(ckpt).read_metadata()
        sd = {}
        for key, item in md.state_dict_metadata.items():
            if isinstance(item, TensorStorageMetadata):
                sd[key] = sentinel(item.size, item.properties.dtype)
            else:
                sd[key] = io.BytesIO()
        dcp.load(sd, checkpoint_id=ckpt, no_dist=True)
        res["dcp_load"] = sd
    except Exception:
        res["dcp_load_error"] = traceback.format_exc()
    return res


def main():
    mode, result_path, *jobs = sys.argv[1:]
    if mode == "stand_in":
        install_megatron_stand_in()
    results = {}
    for i in range(0, len(jobs), 2):
        results[jobs[i]] = run_job(jobs[i], jobs[i + 1])
    results["__modules__"] = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    try:
        import dist_checkpointing  # noqa: F401
        results["__import_guard__"] = "NOT BLOCKED"
    except ImportError:
        results["__import_guard__"] = "blocked"
    results["__sys_path__"] = list(sys.path)
    torch.save(results, result_path)


main()
"""


def _run_plain_torch(tmp: Path, ckpts: list[Path], mode: str) -> dict[str, Any]:
    """Read ``ckpts`` with torch DCP only, in a fresh interpreter (isolated mode: no
    PYTHONPATH, no working directory on sys.path; imports of our package are blocked)."""
    args = [mode, str(tmp / "result.pt")]
    for i, ckpt in enumerate(ckpts):
        args += [str(ckpt), str(tmp / f"converted_{i}.pt")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    proc = subprocess.run(
        [sys.executable, "-I", "-c", _PLAIN_TORCH_SCRIPT, *args],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, f"plain-torch reader failed:\n{proc.stdout}\n{proc.stderr}"
    results: dict[str, Any] = torch.load(tmp / "result.pt", weights_only=False)
    return results


@pytest.fixture(scope="module")
def plain_torch(our_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Our checkpoint and the 0.19.2 golden ones, read by torch alone."""
    ckpts = [our_ckpt] + [c.ckpt_dir for c in GOLDEN_19]
    return _run_plain_torch(tmp_path_factory.mktemp("plain"), ckpts, "plain")


@pytest.fixture(scope="module")
def plain_torch_stand_in(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The 0.13.1 golden checkpoints, read by torch with an empty stand-in Megatron class."""
    return _run_plain_torch(
        tmp_path_factory.mktemp("stand_in"), [c.ckpt_dir for c in GOLDEN_13], "stand_in"
    )


def _job(results: dict[str, Any], ckpt: Path, step: str) -> dict[str, Any]:
    res = results[str(ckpt)]
    assert f"{step}_error" not in res, f"{step} of {ckpt} failed:\n{res[f'{step}_error']}"
    loaded: dict[str, Any] = res[step]
    return loaded


def test_plain_torch_process_did_not_import_our_library(plain_torch: dict[str, Any]) -> None:
    assert plain_torch["__modules__"] == []
    assert plain_torch["__import_guard__"] == "blocked"  # the guard was effective
    assert str(REPO_ROOT) not in plain_torch["__sys_path__"]
    assert "" not in plain_torch["__sys_path__"]


def _check_our_values(loaded: dict[str, Any], how: str) -> None:
    expected_keys = set(REGULAR) | set(FLAT) | set(OBJECT_PAYLOADS)
    assert set(loaded) == expected_keys, f"{how}: keys differ: {set(loaded) ^ expected_keys}"
    for key in list(REGULAR) + list(FLAT):
        assert_tensor_bitwise(loaded[key], _expected_stored(key), f"{how} {key}")
    for unique_key, payload in OBJECT_PAYLOADS.items():
        assert_same_value(loaded[unique_key], [payload], f"{how} {unique_key}")


@pytest.mark.parametrize("step", ["dcp_to_torch_save", "dcp_load"])
def test_plain_torch_reads_our_checkpoint(
    plain_torch: dict[str, Any], our_ckpt: Path, step: str
) -> None:
    """Regular keys come back whole in their logical shape, flat keys in the N-D
    reformulated shape, objects as ``[payload]``."""
    _check_our_values(_job(plain_torch, our_ckpt, step), step)


def test_reformulated_shapes_of_our_flat_keys() -> None:
    expected = {
        "optimizer.state.exp_avg.w": (2, 1, 48),
        "optimizer.state.exp_avg.b": (1, 12),
        "optimizer.state.exp_avg_sq.w3d": (1, 2, 1, 48),
        "optimizer.state.step.bf16": (1, 2, 12),
    }
    for key, shape in expected.items():
        assert tuple(_expected_stored(key).shape) == shape


@pytest.mark.parametrize("case", GOLDEN_19, ids=[c.id for c in GOLDEN_19])
@pytest.mark.parametrize("step", ["dcp_to_torch_save", "dcp_load"])
def test_plain_torch_reads_golden_0_19(
    plain_torch: dict[str, Any], case: GoldenCase, step: str
) -> None:
    loaded = _job(plain_torch, case.ckpt_dir, step)
    payloads = case.main_payloads()
    assert set(loaded) == set(case.tensors) | set(payloads) | {"common_state/shard_0_1"}
    for key in case.tensors:
        assert_tensor_bitwise(loaded[key], case.global_tensor(key), f"{case.id} {step} {key}")
    for unique_key, payload in payloads.items():
        assert_same_value(loaded[unique_key], [payload], f"{case.id} {step} {unique_key}")
    assert_same_value(loaded["common_state/shard_0_1"], [case.common_state()], "common_state")


@pytest.mark.parametrize("case", GOLDEN_13, ids=[c.id for c in GOLDEN_13])
def test_plain_torch_reads_golden_0_13_with_stand_in(
    plain_torch_stand_in: dict[str, Any], case: GoldenCase
) -> None:
    """Also checks our reformulation formula against what Megatron-Core 0.13.1 stored."""
    assert plain_torch_stand_in["__modules__"] == sorted(
        [
            "megatron",
            "megatron.core",
            "megatron.core.dist_checkpointing",
            "megatron.core.dist_checkpointing.strategies",
            "megatron.core.dist_checkpointing.strategies.torch",
        ]
    )
    loaded = _job(plain_torch_stand_in, case.ckpt_dir, "dcp_to_torch_save")
    payloads = case.main_payloads()
    assert set(loaded) == set(case.tensors) | set(payloads)
    for key in case.tensors:
        expected = case.global_tensor(key)
        if key in case.flat_keys:
            block = tuple(case.tensors[key]["shards"][0]["non_flat_local_shape"])
            expected = reformulate(expected, block)
        assert_tensor_bitwise(loaded[key], expected, f"{case.id} {key}")
    for unique_key, payload in payloads.items():
        assert_same_value(loaded[unique_key], [payload], f"{case.id} {unique_key}")


# --------------------------------------------------------------------------------------------
# Megatron-Core 0.13 on-disk layout
# --------------------------------------------------------------------------------------------


def test_metadata_pickle_references_only_torch(our_ckpt: Path) -> None:
    names = pickle_globals((our_ckpt / ".metadata").read_bytes())
    assert names, "no globals found: the scan is broken"
    bad = sorted(n for n in names if n.split(".")[0] not in ALLOWED_PICKLE_MODULES)
    assert bad == [], f".metadata references non-torch globals: {bad}"
    assert not [n for n in names if n.startswith(("dist_checkpointing", "megatron"))]
    assert "torch.distributed.checkpoint.metadata.Metadata" in names


def test_metadata_json_like_megatron_0_13(our_ckpt: Path) -> None:
    with open(our_ckpt / "metadata.json", encoding="utf-8") as f:
        ours = json.load(f)
    assert ours == GOLDEN_13_FLAT.manifest["metadata_json"]
    assert ours == {
        "sharded_backend": "torch_dist",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }


def test_common_pt_loads_weights_only(our_ckpt: Path) -> None:
    common = torch.load(our_ckpt / "common.pt", weights_only=True)
    assert_same_value(common, COMMON, "common.pt")
    names = pickle_globals(_zip_member(our_ckpt / "common.pt", "data.pkl"))
    assert all(n.split(".")[0] in ALLOWED_PICKLE_MODULES for n in names), names


def _zip_member(path: Path, suffix: str) -> bytes:
    import zipfile

    with zipfile.ZipFile(path) as z:
        (name,) = [n for n in z.namelist() if n.endswith("/" + suffix)]
        return z.read(name)


def test_file_names_like_megatron_0_13(our_ckpt: Path) -> None:
    names = set(os.listdir(our_ckpt))
    data_files = {n for n in names if n.endswith(".distcp")}
    # Megatron-Core's files, plus our commit record and the JSON index of .metadata
    # (which neither reader needs).
    assert names - data_files == {
        ".metadata",
        "metadata.json",
        "common.pt",
        "commit.json",
        ".metadata_index.json",
    }
    pattern = re.compile(r"__(\d+)_(\d+)\.distcp")
    assert all(pattern.fullmatch(n) for n in data_files), sorted(data_files)
    assert {int(pattern.fullmatch(n).group(1)) for n in data_files} == {0, 1}  # type: ignore[union-attr]
    md = _read_metadata(our_ckpt)
    assert {info.relative_path for info in md.storage_data.values()} == data_files


def test_mcore_data_like_megatron_0_13(our_ckpt: Path) -> None:
    ours = _read_metadata(our_ckpt).mcore_data  # type: ignore[attr-defined]
    golden = load_metadata_with_stubs(GOLDEN_13_FLAT.ckpt_dir / ".metadata").mcore_data
    assert type(ours) is type(golden) is dict
    assert set(ours) == set(REGULAR) | set(FLAT)
    flat_example = golden["optimizer.state.exp_avg.w"]
    for key in REGULAR:
        assert_same_value(ours[key], golden["param.w"], f"mcore_data[{key}]")
    for key, (_, shape, _, _) in FLAT.items():
        assert set(ours[key]) == set(flat_example)
        orig = ours[key]["nd_reformulated_orig_global_shape"]
        assert type(orig) is type(flat_example["nd_reformulated_orig_global_shape"])
        assert_same_value(orig, tuple(shape), f"mcore_data[{key}]")


def test_stored_sizes_and_chunks(our_ckpt: Path) -> None:
    md = _read_metadata(our_ckpt)
    sdm = md.state_dict_metadata
    assert set(sdm) == set(REGULAR) | set(FLAT) | set(OBJECT_PAYLOADS)
    for key in OBJECT_PAYLOADS:
        assert isinstance(sdm[key], BytesStorageMetadata)
    for key in list(REGULAR) + list(FLAT):
        item = sdm[key]
        assert isinstance(item, TensorStorageMetadata)
        assert tuple(item.size) == tuple(_expected_stored(key).shape), key
        assert item.properties.dtype == _expected_stored(key).dtype, key
    chunks = {
        key: sorted((tuple(c.offsets), tuple(c.sizes)) for c in sdm[key].chunks)  # type: ignore[union-attr]
        for key in FLAT
    }
    assert chunks["optimizer.state.exp_avg.w"] == [
        ((0, 0, 0), (1, 1, 23)),
        ((0, 0, 23), (1, 1, 25)),
        ((1, 0, 0), (1, 1, 23)),
        ((1, 0, 23), (1, 1, 25)),
    ]
    assert chunks["optimizer.state.exp_avg.b"] == [((0, 0), (1, 5)), ((0, 5), (1, 7))]
    assert chunks["optimizer.state.step.bf16"] == [
        ((0, 0, 0), (1, 1, 7)),
        ((0, 0, 7), (1, 1, 5)),
        ((0, 1, 0), (1, 1, 7)),
        ((0, 1, 7), (1, 1, 5)),
    ]
    layers = sorted((tuple(c.offsets), tuple(c.sizes)) for c in sdm["decoder.layers.w"].chunks)  # type: ignore[union-attr]
    assert layers == [((layer, 0, 0), (1, 6, 8)) for layer in range(4)]
    assert [tuple(c.sizes) for c in sdm["model.bias"].chunks] == [(5, 3)]  # type: ignore[union-attr]


def _torch_save_bytes(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def test_storage_items_are_torch_save_zips(our_ckpt: Path) -> None:
    """Each tensor item is the torch.save zip of exactly its chunk, each object item
    ``torch.save([payload])``, all loadable with ``weights_only=True``."""
    md = _read_metadata(our_ckpt)
    seen: set[tuple[str, tuple[int, ...] | None]] = set()
    for index, info in md.storage_data.items():
        with open(our_ckpt / info.relative_path, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        assert len(raw) == info.length, index
        assert raw[:4] == b"PK\x03\x04", f"{index.fqn}: not a zip"
        value = torch.load(io.BytesIO(raw), weights_only=True)
        # Byte for byte what torch.save writes for it (so, what Megatron-Core writes).
        assert raw == _torch_save_bytes(value), f"{index.fqn} at {index.offset}"
        item = md.state_dict_metadata[index.fqn]
        if isinstance(item, BytesStorageMetadata):
            assert_same_value(value, [OBJECT_PAYLOADS[index.fqn]], index.fqn)
            seen.add((index.fqn, None))
            continue
        assert index.offset is not None, index
        offsets = tuple(index.offset)
        (sizes,) = [tuple(c.sizes) for c in item.chunks if tuple(c.offsets) == offsets]
        box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        where = f"{index.fqn} chunk at {offsets}"
        assert_tensor_bitwise(value, _expected_stored(index.fqn)[box], where)
        # The zip holds the chunk only, not a larger storage it was sliced from.
        assert value.untyped_storage().nbytes() == math.prod(sizes) * value.element_size(), where
        seen.add((index.fqn, offsets))
    expected_items = {(k, None) for k in OBJECT_PAYLOADS} | {
        (k, tuple(c.offsets))
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
        for c in v.chunks
    }
    assert seen == expected_items


def test_our_checkpoint_loads_back_with_logical_shapes(our_ckpt: Path) -> None:
    """Sanity of the saved content through our own reader (no process group)."""
    metadata = dc.load_tensors_metadata(our_ckpt)
    for key in list(REGULAR) + list(FLAT):
        assert tuple(metadata[key].global_shape) == tuple(_global(key).shape), key
    request = {
        key: dc.ShardedTensor.from_rank_offsets(key, torch.empty_like(_global(key)))
        for key in list(REGULAR) + list(FLAT)
    }
    loaded = dc.load(request, our_ckpt)
    assert isinstance(loaded, dict)
    for key in request:
        assert_tensor_bitwise(loaded[key], _global(key), key)
    assert_same_value({k: loaded[k] for k in COMMON}, COMMON, "common part")
