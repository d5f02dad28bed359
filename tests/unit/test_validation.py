"""Unit tests of dist_checkpointing.validation: strict handling, key mismatches and the
sharding-integrity checks over simulated ranks' metadata (one process)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from dist_checkpointing.engine.collectives import raise_on_all_ranks
from dist_checkpointing.errors import (
    CheckpointingException,
    KeyMismatchError,
    ShardingError,
)
from dist_checkpointing.mapping import ShardedBase, ShardedObject, ShardedTensor
from dist_checkpointing.validation import (
    StrictHandling,
    apply_strict_handling,
    determine_global_metadata,
    determine_missing_and_unexpected_keys,
    drop_keys,
    local_metadata_of,
    parse_strict_flag,
    sharding_integrity_problems,
    validate_sharding_integrity,
    validate_sharding_integrity_on_all_ranks,
)


def _block(
    key: str,
    offset: tuple[int, ...],
    local_shape: tuple[int, ...],
    global_shape: tuple[int, ...],
    replica_id: Any = 0,
    dtype: torch.dtype = torch.float32,
    flat: slice | None = None,
    prepend_axis_num: int = 0,
    allow_shape_mismatch: bool = False,
) -> ShardedTensor:
    """Data-less ShardedTensor metadata, as gathered from a rank."""
    return ShardedTensor(
        key,
        None,
        dtype,
        local_shape,
        global_shape,
        offset,
        None,
        replica_id,
        prepend_axis_num,
        allow_shape_mismatch,
        flat,
    )


def _problems_and_error(global_metadata: list[list[ShardedBase]]) -> tuple[list[str], str]:
    """The problems, and the ShardingError message that validate_sharding_integrity raises."""
    problems = sharding_integrity_problems(global_metadata)
    assert problems, "expected an invalid sharding"
    with pytest.raises(ShardingError) as info:
        validate_sharding_integrity(global_metadata)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, CheckpointingException)
    message = str(err)
    for problem in problems:
        assert problem in message
    assert f"{len(problems)} problem(s)" in message
    return problems, message


# ------------------------------------------------------------------ strict flag


@pytest.mark.parametrize("mode", list(StrictHandling))
def test_parse_strict_flag_accepts_values_and_members(mode: StrictHandling) -> None:
    assert parse_strict_flag(mode) is mode
    assert parse_strict_flag(mode.value) is mode
    assert parse_strict_flag(mode.value.upper()) is mode


@pytest.mark.parametrize("bad", ["strict", "", "raise", True, None, 3])
def test_parse_strict_flag_rejects_invalid_values(bad: Any) -> None:
    with pytest.raises(CheckpointingException) as info:
        parse_strict_flag(bad)
    message = str(info.value)
    assert repr(bad) in message
    for mode in StrictHandling:
        assert repr(mode.value) in message


def test_strict_handling_predicates_match_megatron() -> None:
    S = StrictHandling  # noqa: N806 - short alias of the enum
    explicit = {m for m in S if S.requires_explicit_ckpt_mismatch_check(m)}
    assert explicit == set(S) - {S.ASSUME_OK_UNEXPECTED}
    global_md = {m for m in S if S.requires_global_app_metadata(m)}
    assert global_md == {S.IGNORE_ALL, S.RAISE_ALL, S.RETURN_ALL, S.LOG_ALL}
    returning = {m for m in S if S.requires_returning_mismatch_keys(m)}
    assert returning == {S.RETURN_UNEXPECTED, S.RETURN_ALL}


# ------------------------------------------------------------------ missing / unexpected keys

# The checkpoint holds 'a', 'b' and the object grid 'obj'. Rank 0 requests 'a' and 'x'
# (absent from the checkpoint: unexpected on rank 0); rank 1 requests 'a' and 'obj'.
# Nobody requests 'b': it is missing (a global notion).


def _ckpt_metadata() -> dict[str, ShardedBase]:
    obj = ShardedObject("obj", None, (2,), (0,))
    return {
        "a": _block("a", (0,), (4,), (4,)),
        "b": _block("b", (0,), (2,), (2,)),
        obj.unique_key: obj,
    }


def _request_rank0() -> dict[str, Any]:
    return {
        "model": {
            "a": ShardedTensor.from_rank_offsets("a", torch.ones(4)),
            "x": ShardedTensor.from_rank_offsets("x", torch.ones(1)),
        },
        "common": {"step": 7},
    }


def _global_metadata() -> list[list[ShardedBase]]:
    rank1 = [_block("a", (0,), (4,), (4,)), ShardedObject("obj", None, (2,), (1,))]
    return [local_metadata_of(_request_rank0()), rank1]


def test_missing_and_unexpected_semantics() -> None:
    local = local_metadata_of(_request_rank0())
    missing, unexpected = determine_missing_and_unexpected_keys(
        _ckpt_metadata(), local, _global_metadata()
    )
    assert missing == {"b"}
    assert unexpected == {"x"}
    # Without the global view, missing keys cannot be known.
    assert determine_missing_and_unexpected_keys(_ckpt_metadata(), local) == (set(), {"x"})
    # Rank 1 requests only existing keys; 'obj' requested by rank 1 is not missing for rank 0.
    missing1, unexpected1 = determine_missing_and_unexpected_keys(
        _ckpt_metadata(), _global_metadata()[1], _global_metadata()
    )
    assert (missing1, unexpected1) == ({"b"}, set())


def _apply(mode: StrictHandling) -> tuple[dict[str, Any], set[str], set[str], dict[str, Any]]:
    request = _request_rank0()
    out, missing, unexpected = apply_strict_handling(
        request, mode, _ckpt_metadata(), local_metadata_of(request), _global_metadata()
    )
    return out, missing, unexpected, request


@pytest.mark.parametrize(
    ("mode", "names"),
    [(StrictHandling.RAISE_ALL, ["'b'", "'x'"]), (StrictHandling.RAISE_UNEXPECTED, ["'x'"])],
)
def test_strict_raise(mode: StrictHandling, names: list[str]) -> None:
    with pytest.raises(KeyMismatchError) as info:
        _apply(mode)
    err = info.value
    assert isinstance(err, KeyError) and isinstance(err, CheckpointingException)
    message = str(err)
    for name in names:
        assert name in message
    if mode is StrictHandling.RAISE_UNEXPECTED:
        assert "'b'" not in message and "missing" not in message
    else:
        assert "missing" in message and "unexpected" in message


@pytest.mark.parametrize(
    ("mode", "expected_missing"),
    [(StrictHandling.LOG_ALL, {"b"}), (StrictHandling.LOG_UNEXPECTED, set())],
)
def test_strict_log(
    mode: StrictHandling, expected_missing: set[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="dist_checkpointing.validation"):
        out, missing, unexpected, request = _apply(mode)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "'x'" in warnings[0].getMessage()
    assert ("'b'" in warnings[0].getMessage()) == bool(expected_missing)
    assert (missing, unexpected) == (expected_missing, {"x"})
    assert set(out["model"]) == {"a"}
    assert out["common"] == {"step": 7}
    assert out["model"]["a"] is request["model"]["a"]


@pytest.mark.parametrize(
    ("mode", "expected_missing"),
    [(StrictHandling.RETURN_ALL, {"b"}), (StrictHandling.RETURN_UNEXPECTED, set())],
)
def test_strict_return(
    mode: StrictHandling, expected_missing: set[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        out, missing, unexpected, _ = _apply(mode)
    assert (missing, unexpected) == (expected_missing, {"x"})
    assert set(out["model"]) == {"a"}
    assert not caplog.records


def test_strict_ignore_all(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        out, missing, unexpected, _ = _apply(StrictHandling.IGNORE_ALL)
    assert (missing, unexpected) == (set(), set())
    assert set(out["model"]) == {"a"}  # unexpected keys are still skipped
    assert not caplog.records


def test_strict_assume_ok() -> None:
    out, missing, unexpected, request = _apply(StrictHandling.ASSUME_OK_UNEXPECTED)
    assert out is request
    assert set(out["model"]) == {"a", "x"}
    assert (missing, unexpected) == (set(), set())


@pytest.mark.parametrize("mode", list(StrictHandling))
def test_strict_modes_pass_a_matching_request(mode: StrictHandling) -> None:
    request = {"a": ShardedTensor.from_rank_offsets("a", torch.ones(4))}
    ckpt = {"a": _block("a", (0,), (4,), (4,))}
    local = local_metadata_of(request)
    out, missing, unexpected = apply_strict_handling(request, mode, ckpt, local, [local])
    assert (missing, unexpected) == (set(), set())
    assert set(out) == {"a"}


def test_drop_keys() -> None:
    request = _request_rank0()
    request["list"] = [ShardedTensor.from_rank_offsets("x", torch.ones(1)), 3]
    out = drop_keys(request, {"x"})
    assert set(out["model"]) == {"a"} and out["list"] == [3] and out["common"] == {"step": 7}
    assert drop_keys(request, set()) is request


# ------------------------------------------------------------------ tensors: valid layouts


def test_valid_layouts() -> None:
    # 2-D grid over 3 ranks with replicas, a prepended-axis tensor and a flat tensor.
    g = (4, 6)
    rank0 = [
        _block("w", (0, 0), (2, 3), g),
        _block("w", (0, 3), (2, 3), g),
        _block("w", (2, 0), (2, 3), g, replica_id=1),
        _block("layers", (0, 0), (5,), (2, 5), prepend_axis_num=1),
        _block("flat", (0, 0), (2, 3), g, flat=slice(0, 4)),
        _block("flat", (2, 0), (2, 3), g, flat=slice(0, 6)),
    ]
    rank1 = [
        _block("w", (2, 0), (2, 3), g),
        _block("w", (0, 0), (2, 3), g, replica_id=(0, 1)),
        _block("layers", (1, 0), (5,), (2, 5), prepend_axis_num=1),
        _block("flat", (0, 0), (2, 3), g, flat=slice(4, 6)),
        _block("flat", (0, 3), (2, 3), g, flat=slice(0, 6)),
    ]
    rank2 = [
        _block("w", (2, 3), (2, 3), g),
        _block("flat", (2, 3), (2, 3), g, flat=slice(0, 1)),
        _block("flat", (2, 3), (2, 3), g, flat=slice(1, 1)),  # empty range: harmless
        _block("flat", (2, 3), (2, 3), g, flat=slice(1, 6)),
        _block("flat", (2, 3), (2, 3), g, flat=slice(0, 6), replica_id=2),
    ]
    assert sharding_integrity_problems([rank0, rank1, rank2]) == []
    validate_sharding_integrity([rank0, rank1, rank2])
    assert sharding_integrity_problems([]) == []
    assert sharding_integrity_problems([[], []]) == []


def test_scalar_tensor() -> None:
    scalar = _block("s", (), (), ())
    assert sharding_integrity_problems([[scalar], [_block("s", (), (), (), replica_id=1)]]) == []
    problems, _ = _problems_and_error([[scalar], [scalar]])
    assert problems == ["'s': scalar saved as main replica by several ranks [0, 1]"]


# ------------------------------------------------------------------ tensors: invalid layouts


def test_overlap_names_both_ranks_and_the_region() -> None:
    g = (4, 4)
    rank0 = [_block("w", (0, 0), (4, 4), g)]
    rank1 = [_block("w", (2, 0), (2, 4), g)]
    problems, message = _problems_and_error([rank0, rank1])
    assert problems == [
        "'w': main replicas overlap at [2:4, 0:4] "
        "(rank 0 block [0:4, 0:4], rank 1 block [2:4, 0:4])"
    ]
    assert "'w'" in message


def test_every_overlapping_pair_is_reported() -> None:
    g = (4,)
    metadata = [
        [_block("v", (0,), (4,), g)],
        [_block("v", (0,), (2,), g)],
        [_block("v", (2,), (2,), g)],
    ]
    problems, _ = _problems_and_error(metadata)
    assert len(problems) == 2
    assert "rank 0 block [0:4], rank 1 block [0:2]" in problems[0]
    assert "rank 0 block [0:4], rank 2 block [2:4]" in problems[1]


def test_gap_names_the_uncovered_count_and_region() -> None:
    g = (4, 6)
    rank0 = [_block("w", (0, 0), (2, 6), g)]
    rank1 = [_block("w", (2, 0), (2, 3), g), _block("w", (2, 3), (2, 3), g, replica_id=1)]
    problems, _ = _problems_and_error([rank0, rank1])
    assert problems == ["'w': 6 of 24 elements are not covered (within region [2:4, 3:6])"]


def test_no_main_replica() -> None:
    problems, _ = _problems_and_error([[_block("w", (0,), (2,), (2,), replica_id=1)]])
    assert problems == ["'w': no rank holds a main replica (replica_id 0)"]


def test_dtype_disagreement_names_the_ranks() -> None:
    metadata = [
        [_block("w", (0,), (2,), (4,))],
        [_block("w", (2,), (2,), (4,), dtype=torch.bfloat16)],
    ]
    problems, _ = _problems_and_error(metadata)
    assert problems == [
        "'w': ranks disagree on global shape/dtype "
        "(rank 0: (4,) torch.float32, rank 1: (4,) torch.bfloat16)"
    ]


def test_shape_disagreement_even_on_replicas() -> None:
    metadata = [
        [_block("w", (0,), (4,), (4,))],
        [_block("w", (0,), (4,), (8,), replica_id=1)],
    ]
    problems, _ = _problems_and_error(metadata)
    assert len(problems) == 1
    assert "rank 0: (4,)" in problems[0] and "rank 1: (8,)" in problems[0]


def test_block_outside_global_shape_is_reported_without_crash() -> None:
    g = (4,)
    inside = _block("w", (0,), (4,), g)
    outside = _block("w", (4,), (2,), g, allow_shape_mismatch=True)
    problems, _ = _problems_and_error([[inside], [outside]])
    assert problems == ["'w': rank 1 block [4:6] lies outside global shape (4,)"]
    # A block sticking out must not hide a gap inside.
    partial = _block("w", (0,), (2,), g)
    sticking_out = _block("w", (3,), (3,), g, allow_shape_mismatch=True)
    problems, _ = _problems_and_error([[partial], [sticking_out]])
    assert problems == [
        "'w': rank 1 block [3:6] lies outside global shape (4,)",
        "'w': 1 of 4 elements are not covered (within region [2:3])",
    ]


def test_several_keys_are_reported_at_once() -> None:
    metadata = [
        [_block("a", (0,), (2,), (4,)), _block("b", (0,), (2,), (2,))],
        [_block("b", (0,), (2,), (2,)), ShardedObject("o", None, (2,), (0,))],
    ]
    problems, message = _problems_and_error(metadata)
    assert len(problems) == 3
    assert problems[0].startswith("'a': 2 of 4 elements")
    assert problems[1].startswith("'b': main replicas overlap")
    assert problems[2].startswith("'o': 1 of 2 object shards")
    assert "3 problem(s)" in message


def test_key_used_as_tensor_and_object() -> None:
    metadata = [[_block("k", (0,), (1,), (1,))], [ShardedObject("k", None, (1,), (0,))]]
    problems, _ = _problems_and_error(metadata)
    assert problems == ["'k': used both as a ShardedTensor and as a ShardedObject"]


# ------------------------------------------------------------------ flat ranges


def _flat_layout(*ranges: tuple[int, int], numel_shape: tuple[int, ...] = (2, 3)) -> list:
    """Each range on its own rank, all in the single block of a (2, 3) tensor."""
    return [[_block("f", (0, 0), numel_shape, (2, 3), flat=slice(a, b))] for a, b in ranges]


def test_flat_exact_split() -> None:
    assert sharding_integrity_problems(_flat_layout((0, 2), (2, 6))) == []
    assert sharding_integrity_problems(_flat_layout((3, 6), (0, 1), (1, 3))) == []


def test_flat_gap_inside() -> None:
    problems, _ = _problems_and_error(_flat_layout((0, 2), (3, 6)))
    assert problems == ["'f': flat elements [2, 3) of block [0:2, 0:3] are not covered by any rank"]


def test_flat_gap_at_end_and_start() -> None:
    problems, _ = _problems_and_error(_flat_layout((1, 5)))
    assert problems == [
        "'f': flat elements [0, 1) of block [0:2, 0:3] are not covered by any rank",
        "'f': flat elements [5, 6) of block [0:2, 0:3] are not covered by any rank",
    ]


def test_flat_overlap() -> None:
    problems, _ = _problems_and_error(_flat_layout((0, 3), (2, 6)))
    assert problems == [
        "'f': flat range [2, 6) of rank 1 overlaps another rank's range in block [0:2, 0:3]"
    ]


def test_flat_only_empty_ranges_is_a_gap() -> None:
    problems, _ = _problems_and_error(_flat_layout((2, 2)))
    assert problems == ["'f': flat elements [0, 6) of block [0:2, 0:3] are not covered by any rank"]


def test_flat_block_missing_entirely() -> None:
    g = (4, 3)
    metadata = [[_block("f", (0, 0), (2, 3), g, flat=slice(0, 6))]]
    problems, _ = _problems_and_error(metadata)
    assert problems == ["'f': 6 of 12 elements are not covered (within region [2:4, 0:3])"]


def test_flat_and_non_flat_copies_overlap() -> None:
    g = (2, 3)
    metadata = [
        [_block("f", (0, 0), (2, 3), g, flat=slice(0, 6))],
        [_block("f", (0, 0), (2, 3), g)],
    ]
    problems, _ = _problems_and_error(metadata)
    assert len(problems) == 1 and "overlap at [0:2, 0:3]" in problems[0]


# ------------------------------------------------------------------ objects


def _obj(key: str, shape: tuple[int, ...], offset: tuple[int, ...], replica: Any = 0) -> Any:
    return ShardedObject(key, None, shape, offset, replica)


def test_objects_valid() -> None:
    metadata = [
        [_obj("rng", (2, 2), (0, 0)), _obj("rng", (2, 2), (0, 1)), _obj("rng", (2, 2), (1, 1), 1)],
        [_obj("rng", (2, 2), (1, 0)), _obj("rng", (2, 2), (1, 1))],
        [_obj("single", (1,), (0,)), _obj("scalar", (), ())],
    ]
    assert sharding_integrity_problems(metadata) == []


def test_objects_duplicate_main_replica() -> None:
    metadata = [[_obj("rng", (2,), (0,))], [_obj("rng", (2,), (1,))], [_obj("rng", (2,), (1,))]]
    problems, _ = _problems_and_error(metadata)
    assert problems == ["'rng': shard at offset (1,) has 2 main replicas (ranks [1, 2])"]


def test_objects_missing_shard() -> None:
    metadata = [
        [_obj("rng", (2, 2), (0, 0)), _obj("rng", (2, 2), (1, 1), replica=1)],
        [_obj("rng", (2, 2), (0, 1))],
    ]
    problems, _ = _problems_and_error(metadata)
    assert problems == [
        "'rng': 2 of 4 object shards have no main replica (e.g. offsets [(1, 0), (1, 1)])"
    ]


def test_objects_grid_shape_disagreement() -> None:
    metadata = [[_obj("rng", (2,), (0,))], [_obj("rng", (3,), (1,))]]
    problems, _ = _problems_and_error(metadata)
    assert problems == ["'rng': ranks disagree on the object grid shape [(2,), (3,)]"]


# ------------------------------------------------------------------ single-process collectives


def test_determine_global_metadata_without_process_group() -> None:
    request = _request_rank0()
    request["obj"] = ShardedObject("o", {"big": "payload"}, (1,), (0,))
    local, global_md = determine_global_metadata(request)
    assert global_md == [local]
    assert sorted(sh.key for sh in local) == ["a", "o", "x"]
    assert all(sh.data is None for sh in local)
    assert request["model"]["a"].data is not None  # the request keeps its data


def test_raise_on_all_ranks_without_process_group() -> None:
    raise_on_all_ranks(None)
    err = OSError("disk full")
    with pytest.raises(OSError) as info:
        raise_on_all_ranks(err, what="save")
    assert info.value is err


def test_validate_on_all_ranks_without_process_group() -> None:
    validate_sharding_integrity_on_all_ranks([[_block("w", (0,), (2,), (2,))]])
    with pytest.raises(ShardingError, match="'w': 2 of 4 elements"):
        validate_sharding_integrity_on_all_ranks([[_block("w", (0,), (2,), (4,))]])
