"""The torch_dist converter: our ShardedTensors as PyTorch ShardedTensors, ShardedObjects as
BytesIO, and the key-flattening helpers (Megatron-Core's converter API).

PyTorch ShardedTensors need an initialized process group, so those cases run on real gloo
ranks (world sizes 1 and 2); the pure dict helpers run in this process.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.errors import MappingError
from dist_checkpointing.strategies.torch import (
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    flatten_state_dict,
    mcore_to_pyt_state_dict,
    sharded_tensor_to_torch_sharded_tensor,
    unflatten_state_dict,
)
from tests.support.harness import run_distributed

pytestmark = pytest.mark.timeout(120)

G = torch.arange(48, dtype=torch.float32).reshape(4, 12)
FLAT_NUMEL = 48
TP_RANGE = slice(3, 20)  # a partial flat range of each (2, 12) block


def _cases(rank: int, world: int) -> dict[str, list[ShardedTensor]]:
    """This rank's ShardedTensors for each case (key -> list of shards of that key)."""
    fr = slice(rank * FLAT_NUMEL // world, (rank + 1) * FLAT_NUMEL // world)
    return {
        # axis 1 split over the ranks
        "regular": [
            ShardedTensor.from_rank_offsets(
                "regular", G.chunk(world, 1)[rank].clone(), (1, rank, world)
            )
        ],
        # a prepended axis of size world (e.g. one layer per rank)
        "prepended": [
            ShardedTensor.from_rank_offsets(
                "prepended", G.clone(), (0, rank, world), prepend_axis_num=1
            )
        ],
        # one block, its flat elements split over the ranks
        "flat": [
            ShardedTensor.from_rank_offsets_flat(
                "flat", G.reshape(-1)[fr].clone(), (4, 12), flattened_range=fr
            )
        ],
    }


def _tp_flat_cases(rank: int, world: int) -> list[ShardedTensor]:
    """Two (2, 12) blocks on axis 0; each rank holds the range TP_RANGE of its block(s)."""
    blocks = range(2) if world == 1 else [rank]
    return [
        ShardedTensor.from_rank_offsets_flat(
            "tp",
            G[2 * b : 2 * b + 2].reshape(-1)[TP_RANGE].clone(),
            (2, 12),
            (0, b, 2),
            flattened_range=TP_RANGE,
        )
        for b in blocks
    ]


def _describe(pyt: Any) -> dict[str, Any]:
    md = pyt.metadata()
    return {
        "size": tuple(md.size),
        "local": [
            (tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes), s.tensor.clone())
            for s in pyt.local_shards()
        ],
        "all": [
            (tuple(m.shard_offsets), tuple(m.shard_sizes), str(m.placement))
            for m in md.shards_metadata
        ],
        "unwrapped": [t.clone() for t in _unwrap_pyt_sharded_tensor(pyt)],
    }


def _rank_convert(with_tp: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = _cases(rank, world)
    if with_tp:
        cases["tp"] = _tp_flat_cases(rank, world)
    return {
        key: _describe(sharded_tensor_to_torch_sharded_tensor(shs)) for key, shs in cases.items()
    }


def _assert_exact_cover(
    all_shards: list[tuple[tuple[int, ...], tuple[int, ...], str]], size: tuple[int, ...]
) -> None:
    """The shard metadata (local and placeholders) tile the global tensor exactly once."""
    count = torch.zeros(size, dtype=torch.int32)
    for offsets, sizes, _ in all_shards:
        count[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
    assert bool((count == 1).all()), all_shards


@pytest.mark.parametrize("world", [1, 2])
def test_sharded_tensor_to_torch_sharded_tensor(world: int) -> None:
    results = run_distributed(_rank_convert, world, world == 2, timeout=60)
    for rank, res in enumerate(results):
        fr = slice(rank * FLAT_NUMEL // world, (rank + 1) * FLAT_NUMEL // world)
        cols = 12 // world

        reg = res["regular"]
        assert reg["size"] == (4, 12)
        assert [(o, s) for o, s, _ in reg["local"]] == [((0, rank * cols), (4, cols))]
        assert torch.equal(reg["local"][0][2], G[:, rank * cols : (rank + 1) * cols])
        assert [t.shape for t in reg["unwrapped"]] == [(4, cols)]

        pre = res["prepended"]
        assert pre["size"] == (world, 4, 12)
        assert [(o, s) for o, s, _ in pre["local"]] == [((rank, 0, 0), (1, 4, 12))]
        assert torch.equal(pre["local"][0][2], G.unsqueeze(0))
        assert len(pre["unwrapped"]) == 1 and torch.equal(pre["unwrapped"][0], G)  # squeezed

        flat = res["flat"]
        assert flat["size"] == (1, 1, FLAT_NUMEL)  # N-D reformulated: [1, 1, 4 * 12]
        assert [(o, s) for o, s, _ in flat["local"]] == [
            ((0, 0, fr.start), (1, 1, fr.stop - fr.start))
        ]
        assert torch.equal(flat["local"][0][2].reshape(-1), G.reshape(-1)[fr])
        assert len(flat["unwrapped"]) == 1
        assert torch.equal(flat["unwrapped"][0], G.reshape(-1)[fr])  # 1-D again

        for key in ("regular", "prepended", "flat"):
            _assert_exact_cover(res[key]["all"], res[key]["size"])
            # Every rank describes the same global layout.
            assert sorted(res[key]["all"]) == sorted(results[0][key]["all"])

        if world == 2:
            tp = res["tp"]
            assert tp["size"] == (2, 1, 24)  # 2 blocks of 2 * 12
            n = TP_RANGE.stop - TP_RANGE.start
            assert [(o, s) for o, s, _ in tp["local"]] == [((rank, 0, TP_RANGE.start), (1, 1, n))]
            assert torch.equal(tp["unwrapped"][0], G[2 * rank : 2 * rank + 2].reshape(-1)[TP_RANGE])
            # Placeholders for what this rank does not hold complete the cover.
            _assert_exact_cover(tp["all"], tp["size"])
            assert ((rank, 0, TP_RANGE.start), (1, 1, n), f"rank:{rank}/cpu") in tp["all"]


def _rank_convert_partial_on_one_rank() -> Any:
    return _describe(sharded_tensor_to_torch_sharded_tensor(_tp_flat_cases(0, 1)))


def test_partial_flat_tensor_on_one_rank() -> None:
    try:
        run_distributed(_rank_convert_partial_on_one_rank, 1, timeout=60)
    except AssertionError as e:  # the harness reports the rank's exception
        assert "MappingError" in str(e) and "'tp'" in str(e), str(e)[:2000]


def _rank_mcore_to_pyt() -> dict[str, Any]:
    saving: dict[str, list[Any]] = {
        "w": [ShardedTensor.from_rank_offsets("w", G.clone())],
        "obj/shard_0_1": [ShardedObject("obj", {"step": 3, "t": torch.ones(2)}, (1,), (0,))],
    }
    out: dict[str, Any] = {}
    converted = mcore_to_pyt_state_dict(saving)
    out["obj_bytes"] = converted["obj/shard_0_1"].getvalue()
    out["w"] = _describe(converted["w"])

    loading: dict[str, list[Any]] = {
        "w": [ShardedTensor.from_rank_offsets("w", torch.empty(4, 12)).without_data()],
        "obj/shard_0_1": [ShardedObject("obj", None, (1,), (0,))],
    }
    converted = mcore_to_pyt_state_dict(loading, is_loading=True)
    out["load_obj_bytes"] = converted["obj/shard_0_1"].getvalue()
    out["load_w"] = [
        (tuple(s.metadata.shard_sizes), s.tensor.dtype) for s in converted["w"].local_shards()
    ]
    out["load_w_allocated"] = loading["w"][0].data is not None
    try:
        mcore_to_pyt_state_dict(
            {"mixed": [loading["w"][0], ShardedObject("mixed", None, (1,), (0,))]}
        )
        out["mixed"] = None
    except MappingError as e:
        out["mixed"] = str(e)
    return out


def test_mcore_to_pyt_state_dict() -> None:
    (res,) = run_distributed(_rank_mcore_to_pyt, 1, timeout=60)
    # Objects: BytesIO holding torch.save([data]) (a one-element list, as Megatron-Core).
    payload = torch.load(io.BytesIO(res["obj_bytes"]), weights_only=True)
    assert isinstance(payload, list) and len(payload) == 1
    assert payload[0]["step"] == 3 and torch.equal(payload[0]["t"], torch.ones(2))
    assert res["w"]["size"] == (4, 12)
    assert torch.equal(res["w"]["local"][0][2], G)
    # Loading: empty buffers to fill, tensors allocated.
    assert res["load_obj_bytes"] == b""
    assert res["load_w"] == [((4, 12), torch.float32)] and res["load_w_allocated"]
    assert res["mixed"] is not None and "'mixed'" in res["mixed"]


# ----------------------------------------------------------------------------- dict helpers


def _st(key: str, n: int = 2, replica_id: int = 0) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets(
        key, torch.full((n,), float(len(key))), replica_id=replica_id
    )


def _nested() -> dict[Any, Any]:
    return {
        "layers": [{"w": _st(f"layers.{i}.w"), "b": _st(f"layers.{i}.b")} for i in range(12)],
        "emb": {0: _st("emb.0"), 7: [_st("emb.7.a"), _st("emb.7.b")]},
        "rng": ShardedObject("rng", {"seed": 1}, (1,), (0,)),
        "tied": [_st("tied"), _st("tied")],  # two leaves with the same sharded key
        "deep": {"x": {"y": [[_st("deep.0.0")], [_st("deep.1.0"), _st("deep.1.1")]]}},
    }


def test_flatten_and_unflatten_state_dict() -> None:
    sd = _nested()
    flat, mapping = flatten_state_dict(sd)
    assert flat["layers.11.w"] is sd["layers"][11]["w"]
    assert flat["emb.7.1"] is sd["emb"][7][1]
    assert flat["deep.x.y.1.0"] is sd["deep"]["x"]["y"][1][0]
    assert mapping["emb.7.1"] == ("emb", 7, 1)  # int dict keys and list indices stay ints
    assert mapping["rng"] == ("rng",)
    assert len(flat) == 12 * 2 + 3 + 1 + 2 + 3
    back = unflatten_state_dict(flat, mapping)
    _restore_dict_types(back, sd)
    assert back == sd


def test_flatten_rejects_colliding_keys() -> None:
    with pytest.raises(MappingError) as info:
        flatten_state_dict({"a": {1: _st("x"), "1": _st("y")}})
    assert "'a.1'" in str(info.value)


def test_replace_keys_round_trip() -> None:
    sd = _nested()
    by_key, flat_mapping, rename = _replace_state_dict_keys_with_sharded_keys(sd)
    assert [sh.key for sh in by_key["layers.3.b"]] == ["layers.3.b"]
    assert by_key["rng/shard_0_1"] == [sd["rng"]]  # objects by unique key
    assert by_key["tied"] == [sd["tied"][0], sd["tied"][1]]
    assert rename["tied"] == ["tied.0", "tied.1"]

    loaded = {key: [f"{key}#{i}" for i in range(len(shs))] for key, shs in by_key.items()}
    back = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename)
    _restore_dict_types(back, sd)
    assert isinstance(back["layers"], list) and len(back["layers"]) == 12
    assert back["layers"][10] == {"w": "layers.10.w#0", "b": "layers.10.b#0"}  # numeric order
    assert back["emb"] == {0: "emb.0#0", 7: ["emb.7.a#0", "emb.7.b#0"]}  # int keys kept
    assert back["rng"] == "rng/shard_0_1#0"
    assert back["tied"] == ["tied#0", "tied#1"]
    assert back["deep"] == {"x": {"y": [["deep.0.0#0"], ["deep.1.0#0", "deep.1.1#0"]]}}


def test_replace_keys_keep_only_main_replica() -> None:
    sd = {"a": _st("a"), "b": _st("b", replica_id=1), "c": [_st("c"), _st("c", replica_id=2)]}
    by_key, _, rename = _replace_state_dict_keys_with_sharded_keys(sd, keep_only_main_replica=True)
    assert set(by_key) == {"a", "c"} and rename["c"] == ["c.0"]


def test_replace_keys_errors() -> None:
    with pytest.raises(MappingError) as info:
        _replace_state_dict_keys_with_sharded_keys({"a": {"b": torch.ones(1)}})
    assert "'a.b'" in str(info.value) and "Tensor" in str(info.value)
    _, flat_mapping, rename = _replace_state_dict_keys_with_sharded_keys(
        {"t": [_st("t"), _st("t")]}
    )
    with pytest.raises(MappingError) as info:
        _replace_sharded_keys_with_state_dict_keys({"t": ["only one"]}, flat_mapping, rename)
    assert "'t'" in str(info.value)


def test_restore_dict_types_leaves_dicts_with_int_keys() -> None:
    template = {"d": {2: "x", 10: "y"}, "l": ["p", "q", "r"]}
    x = {"d": {2: 1, 10: 2}, "l": {0: 1, 1: 2, 2: 3}}
    _restore_dict_types(x, template)
    assert x == {"d": {2: 1, 10: 2}, "l": [1, 2, 3]}
