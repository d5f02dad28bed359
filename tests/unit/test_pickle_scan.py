"""The opcode scan of torch.save payloads (and small .metadata files): collidable keys
inserted by a call (set, frozenset, Counter, OrderedDict), collidable tuple and
torch.Size keys, keys that take exponential time to hash, every data.pkl of an
archive; and no refusal of plain data."""

from __future__ import annotations

import collections
import io
import pickle
import time
import warnings
import zipfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_checkpointing.engine.safety import safe_torch_load
from dist_checkpointing.engine.safety.pickle_scan import check_pickle
from dist_checkpointing.errors import CorruptCheckpointError
from tests.support.crafted_pickles import (
    colliding_ints,
    colliding_pairs,
    dict_op,
    int_op,
    reduce_op,
    saved,
    tuple_op,
)

pytestmark = pytest.mark.timeout(120)

PROTO = b"\x80\x02"
KEYS = 5000  # more than MAX_COLLIDABLE_KEYS


def _payload(pickled: bytes) -> bytes:
    """A torch.save archive whose data.pkl is ``pickled``."""
    src = zipfile.ZipFile(io.BytesIO(saved({"a": 1})))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, pickled if info.filename.endswith("data.pkl") else src.read(info))
    return out.getvalue()


def _refused(pickled: bytes, match: str) -> None:
    start = time.perf_counter()
    with pytest.raises(CorruptCheckpointError, match=f"ckpt/common.pt: refusing .*{match}"):
        safe_torch_load(_payload(pickled), source="ckpt/common.pt")
    assert time.perf_counter() - start < 10


def _ints() -> list[bytes]:
    return [int_op(k) for k in colliding_ints(KEYS)]


CALLS = {
    "set": ("__builtin__", "set", _ints),
    "frozenset": ("builtins", "frozenset", _ints),
    "Counter": ("collections", "Counter", _ints),
    "OrderedDict": ("collections", "OrderedDict", lambda: [b"(" + k + b"Nt" for k in _ints()]),
    "dict": ("builtins", "dict", lambda: [b"(" + k + b"Nt" for k in _ints()]),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_a_call_inserting_colliding_items_is_refused(call: str) -> None:
    module, name, items = CALLS[call]
    _refused(PROTO + reduce_op(module, name, items()) + b".", "collide")


def test_colliding_tuple_and_size_keys_are_refused() -> None:
    pairs = colliding_pairs(KEYS)
    assert len({hash(p) for p in pairs}) == 1
    _refused(PROTO + dict_op([tuple_op(p) for p in pairs]) + b".", "collide")
    sizes = [b"ctorch\nSize\n" + tuple_op(p) + b"\x85R" for p in pairs]
    _refused(PROTO + dict_op(sizes) + b".", "collide")


def _shared_tuples(levels: int, base: int = 0) -> bytes:
    """Pushes tuple ``t_levels``, where ``t_i = (t_{i-1}, t_{i-1})`` (memo ``base + i``):
    a few bytes per level, but hashing it visits ``2**levels`` tuples."""
    ops = b"K\x01\x85q%c" % base
    for i in range(base, base + levels):
        ops += b"0h%ch%c\x86q%c" % (i, i, i + 1)
    return ops


def test_a_key_whose_hash_walks_shared_tuples_is_refused() -> None:
    small = pickle.loads(PROTO + b"}" + _shared_tuples(12) + b"Ns.")  # 4096 steps: fine
    assert isinstance(next(iter(small)), tuple)
    check_pickle(PROTO + b"}" + _shared_tuples(12) + b"Ns.", "x")
    _refused(PROTO + b"}" + _shared_tuples(60) + b"Ns.", "steps to hash")
    _refused(PROTO + b"c__builtin__\nset\n]" + _shared_tuples(60) + b"a\x85R.", "steps to hash")


def test_state_set_on_a_shared_object_counts_for_what_holds_it() -> None:
    """Tuples holding an object are built first, then BUILD gives the object a state:
    hashing what holds it may now cost more than the scan counted so far."""
    ops = b"cbuiltins\nobject\n)\x81q\x000"  # an instance, memo 0
    for i in range(4):  # t_{i+1} = (t_i,) * 8, t_0 the instance: 8**4 elements
        ops += b"(" + b"h%c" % i * 8 + b"tq%c0" % (i + 1)
    key = b"}h\x04Ns0"
    check_pickle(PROTO + ops + key + b"N.", "x")  # 4681 steps: fine
    state = _shared_tuples(10, base=100)
    with pytest.raises(CorruptCheckpointError, match="steps to hash"):
        check_pickle(PROTO + ops + b"h\x00" + state + b"b0" + key + b"N.", "x")


def test_every_data_pkl_of_an_archive_is_scanned() -> None:
    out = io.BytesIO(_payload(pickle.dumps({"a": 1}, protocol=2)))
    with zipfile.ZipFile(out, "a") as dst, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate name
        dst.writestr("archive/data.pkl", PROTO + b"}" + _shared_tuples(60) + b"Ns.")
    with pytest.raises(CorruptCheckpointError, match="steps to hash"):
        safe_torch_load(out.getvalue(), source="ckpt/common.pt")


def test_plain_data_passes() -> None:
    check_pickle(pickle.dumps({(str(i), "x"): i for i in range(20_000)}, protocol=2), "x")
    check_pickle(pickle.dumps({2**60 + i: 0 for i in range(20_000)}, protocol=2), "x")
    check_pickle(pickle.dumps(set(map(str, range(20_000))), protocol=2), "x")
    check_pickle(pickle.dumps(frozenset(range(20_000)), protocol=4), "x")
    counts = collections.Counter(str(i) for i in range(20_000))
    check_pickle(pickle.dumps(counts, protocol=2), "x")
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(100)])
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2)).sum().backward()
    optimizer.step()
    loaded = safe_torch_load(saved({"optimizer": optimizer.state_dict()}), source="x")
    assert len(loaded["optimizer"]["state"]) == 200


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**60), 2**60)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
_KEYS = st.text(max_size=8) | st.integers(0, 2**60) | st.tuples(st.text(max_size=4))
_DATA = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.tuples(inner, inner)
        | st.dictionaries(_KEYS, inner, max_size=6)
        | st.frozensets(st.integers(0, 1000), max_size=6)
    ),
    max_leaves=40,
)


@settings(max_examples=200, deadline=None)
@given(data=_DATA, protocol=st.integers(0, pickle.HIGHEST_PROTOCOL))
def test_the_scan_never_refuses_plain_data(data: object, protocol: int) -> None:
    check_pickle(pickle.dumps(data, protocol=protocol), "x")
