"""The sharding check split by key, simulated in one process (one owner report per
simulated rank, merged): it must list exactly the problems of the single-rank check,
in the same order."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dist_checkpointing.engine.sharding_check import (
    ShardRecord,
    merge_key_problems,
    shard_record,
    sharding_integrity_problems,
)
from dist_checkpointing.engine.sharding_split import (
    key_owner,
    owned_key_problems,
    records_by_owner,
    structure_digest,
)
from dist_checkpointing.mapping import ShardedObject, ShardedTensor
from tests.unit.test_validation_properties import (
    PERTURBATIONS,
    PROPERTY_SETTINGS,
    Layout,
    _perturb,
    object_layouts,
    tensor_layouts,
)


def split_problems(metadata: list[list[object]]) -> list[str]:
    """What every rank of the split check reports: each simulated rank bins its records
    by owner, each owner checks what it received, the reports are merged."""
    world = len(metadata)
    outgoing = [records_by_owner([shard_record(sh) for sh in md], world) for md in metadata]  # type: ignore[arg-type]
    reports = [
        owned_key_problems([outgoing[src][owner] for src in range(world)]) for owner in range(world)
    ]
    return merge_key_problems(reports)


@PROPERTY_SETTINGS
@given(
    a=tensor_layouts("a"),
    b=tensor_layouts("b"),
    flat=tensor_layouts("c", flat=True),
    objects=object_layouts(),
    data=st.data(),
    broken=st.sets(st.sampled_from(["a", "b", "c", "obj"])),
)
def test_split_check_reports_what_the_single_rank_check_reports(
    a: Layout, b: Layout, flat: Layout, objects: Layout, data: st.DataObject, broken: set[str]
) -> None:
    parts = {"a": a, "b": b, "c": flat, "obj": objects}
    shards = []
    for name, layout in parts.items():
        if name in broken and layout.shards:
            names = ["drop", "duplicate"] if name == "obj" else list(PERTURBATIONS)
            _, (perturbed, _) = _perturb(data.draw, layout, names)
            shards += perturbed
        else:
            shards += layout.shards
    world = max(layout.world_size for layout in parts.values())
    metadata = Layout(world, shards).metadata()
    assert split_problems(metadata) == sharding_integrity_problems(metadata)


def test_a_key_used_as_tensor_and_object_is_reported_by_its_owner() -> None:
    t = ShardedTensor("k", None, torch.float32, (4,), (4,), (0,), None)
    o = ShardedObject("k", None, (1,), (0,))
    metadata: list[list[object]] = [[t], [o], []]
    expected = sharding_integrity_problems(metadata)  # type: ignore[arg-type]
    assert expected[0] == "'k': used both as a ShardedTensor and as a ShardedObject"
    assert split_problems(metadata) == expected


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_a_tensor_named_like_an_object_shard_is_reported_by_the_owner_of_the_name(
    world: int,
) -> None:
    """A tensor key equal to an object shard's stored name (its unique key) would make
    one overwrite the other in the checkpoint: reported once, whichever ranks hold them
    and whichever ranks own the two keys (the object is routed by its key, the claim of
    its stored name by that name)."""
    o = ShardedObject("o", None, (2,), (1,))
    t = ShardedTensor(o.unique_key, None, torch.float32, (4,), (4,), (0,), None)
    assert key_owner("o", 5) != key_owner(o.unique_key, 5)  # different owners at 5 ranks
    other = ShardedObject("o", None, (2,), (0,))  # the other shard: no problem of its own
    for where in ([[o, other, t]] + [[]] * (world - 1), [[o], [other, t]] + [[]] * (world - 2)):
        metadata: list[list[object]] = where[:world] if world > 1 else [[o, other, t]]
        expected = sharding_integrity_problems(metadata)  # type: ignore[arg-type]
        assert expected == [
            f"'{o.unique_key}': a ShardedTensor key that is the stored name of ShardedObject "
            "'o' (one of its shards): one would overwrite the other"
        ]
        assert split_problems(metadata) == expected


def test_owner_is_stable_and_spread() -> None:
    owners = [key_owner(f"decoder.layers.{i}.weight", 64) for i in range(1000)]
    assert owners == [key_owner(f"decoder.layers.{i}.weight", 64) for i in range(1000)]
    assert len(set(owners)) == 64  # a thousand keys reach every one of 64 owners
    assert key_owner("w", 1) == 0


def test_digest_follows_records_rank_and_world() -> None:
    rec = ShardRecord("w", True, "torch.float32", (4,), (0,), (2,), None, True)
    base = structure_digest([rec], 0, 2)
    assert base == structure_digest([ShardRecord(*rec)], 0, 2)
    assert base != structure_digest([rec._replace(global_offset=(2,))], 0, 2)
    assert base != structure_digest([rec], 1, 2)
    assert base != structure_digest([rec], 0, 4)
    # The group's members: the world by default; another group of the same size differs.
    assert base == structure_digest([rec], 0, 2, (0, 1))
    assert base != structure_digest([rec], 0, 2, (0, 2))
    assert base != structure_digest([rec, rec], 0, 2)
    # An unhashable field (a list where a tuple belongs) is digested through its pickle.
    odd = rec._replace(global_shape=[4])  # type: ignore[arg-type]
    assert structure_digest([odd], 0, 2) == structure_digest([odd], 0, 2)
    assert structure_digest([odd], 0, 2) != structure_digest([odd], 1, 2)
    assert 0 <= base < 2**63


def test_one_process_group_uses_the_validated_structure() -> None:
    import pytest

    from dist_checkpointing.engine.collectives import RankGroup
    from dist_checkpointing.engine.sharding_split import (
        ValidatedStructure,
        validate_sharding_split,
    )
    from dist_checkpointing.errors import ShardingError

    group = RankGroup(None)
    assert not group.distributed  # no process group in this process
    good = [ShardRecord("w", True, "torch.float32", (4,), (0,), (4,), None, True)]
    bad = [good[0]._replace(chunk_shape=(2,))]  # half of "w" is not covered
    cache = ValidatedStructure()
    validate_sharding_split(good, group, cache)
    assert cache.digest == structure_digest(good, 0, 1)
    with pytest.raises(ShardingError, match="'w'"):
        validate_sharding_split(bad, group, cache)  # changed records: checked again
    assert cache.digest == structure_digest(good, 0, 1)  # a failed check records nothing
    cache.digest = structure_digest(bad, 0, 1)  # a cache claiming these were validated
    validate_sharding_split(bad, group, cache)  # is believed: skipped
    with pytest.raises(ShardingError, match="'w'"):
        validate_sharding_split(bad, group, None)  # no cache: always checked


def test_records_go_out_as_equal_tuples_with_shared_parts() -> None:
    import pickle

    def record(i: int) -> ShardRecord:
        # Fresh but equal dtype names and shapes, as shard_record builds them per leaf.
        return ShardRecord(
            f"w{i}",
            True,
            "".join(["torch.", "float32"]),
            tuple([4, 8]),
            (0, 0),
            tuple([4, 8]),
            None,
            True,
        )

    records = [record(i) for i in range(50)]
    (sent,) = records_by_owner(records, 1)
    assert sent == [tuple(r) for r in records]  # the same values, in order
    assert all(type(t) is tuple for t in sent)
    assert len({id(t[2]) for t in sent}) == 1  # one dtype name
    assert len({id(t[3]) for t in sent} | {id(t[5]) for t in sent}) == 1  # one shape
    plain = pickle.dumps([tuple(r) for r in records], protocol=pickle.HIGHEST_PROTOCOL)
    shared = pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL)
    assert len(shared) < len(plain)
    received = pickle.loads(shared)
    assert received == sent
    assert owned_key_problems([received]) == []  # each "w<i>" is one whole block
    broken = [*received, received[0]]  # "w0" twice: its main replicas overlap
    (problem,) = owned_key_problems([broken])
    assert problem[1] == "w0" and "overlap" in problem[2][0]
