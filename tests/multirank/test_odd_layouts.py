"""Regressions found by fuzzing the load and save paths, both layouts.

- Checksum blocks whose size is not a multiple of the element size (the knob takes any
  size from 4,096 bytes, and an index from another writer may say anything): a
  ``raw_bytes`` row block read widened to such blocks landed the wanted rows at an offset
  that is not on an element, and the load failed with torch's ``RuntimeError`` ("must be
  divisible by 4 to view Byte as Float").
- A destination that torch calls contiguous with a stride other than 1 on a dimension of
  size 1 (``torch.zeros(8)[::2][2:3]``): a ``torch_dist`` item read straight into it
  failed with torch's ``RuntimeError`` ("stride(-1) must be 1 to view Float as Byte").
- A synchronous ``raw_bytes`` save of a non-contiguous local tensor (strided rows, a
  transpose, an expand) wrote the bytes at its data pointer as if it were contiguous:
  wrong values, and bytes from past the tensor, with no error.
- A ``torch_dist`` load of a request holding one ShardedObject shard twice (a main and a
  non-main replica) filled only the last one; the others came back None.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.engine.storage.tensor_bytes import byte_view
from dist_checkpointing.serialization import get_default_save_sharded_strategy
from tests.support.layouts import same_bits

LAYOUTS = ["torch_dist", "raw_bytes"]
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float16]


def _full(dtype: torch.dtype) -> torch.Tensor:
    values = torch.randn(64, 1000, generator=torch.Generator().manual_seed(5)) * 100
    return values.to(dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block", [4097, 4100, 5000, 12289])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_blocks_read_through_blocks_off_the_elements(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, block: int, dtype: torch.dtype
) -> None:
    full = _full(dtype)
    with monkeypatch.context() as mp:
        mp.setenv("DIST_CKPT_CHECKSUM_BLOCK_BYTES", str(block))
        state = {"w": ShardedTensor.from_rank_offsets("w", full.clone())}
        dc.save(state, tmp_path, get_default_save_sharded_strategy(layout, 1))
    for q in range(4):
        block_of_rows = torch.zeros(16, 1000, dtype=dtype)
        request = {"w": ShardedTensor.from_rank_offsets("w", block_of_rows, (0, q, 4))}
        out = dc.load(request, tmp_path, validate_access_integrity=False)
        assert same_bits(out["w"], full[16 * q : 16 * (q + 1)]), (q, block)
    # a distributed-optimizer shard that starts and ends inside rows
    flat = torch.zeros(10_007, dtype=dtype)
    request = {
        "w": ShardedTensor.from_rank_offsets_flat(
            "w", flat, (64, 1000), flattened_range=slice(3_001, 13_008)
        )
    }
    out = dc.load(request, tmp_path, validate_access_integrity=False)
    assert same_bits(out["w"], full.reshape(-1)[3_001:13_008])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("window", ["0", str(256 << 10)])
def test_a_one_element_destination_with_a_stride_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, window: str
) -> None:
    """A 400 KB item (read straight into its destinations, or every item so with a
    window of 0): one element into a contiguous view whose stride is 2."""
    monkeypatch.setenv("DIST_CKPT_READ_SMALL_ITEM_BYTES", window)
    full = torch.arange(100_000, dtype=torch.float32)
    state = {"w": ShardedTensor.from_rank_offsets("w", full)}
    dc.save(state, tmp_path, get_default_save_sharded_strategy(layout, 1))
    base = torch.zeros(8)
    dest = base[::2][2:3]
    assert dest.is_contiguous() and dest.stride() == (2,)
    request = {"w": ShardedTensor("w", dest, torch.float32, (1,), (100_000,), (777,), None)}
    out = dc.load(request, tmp_path, validate_access_integrity=False)
    assert out["w"].tolist() == [777.0]
    assert base.tolist() == [0, 0, 0, 0, 777.0, 0, 0, 0]  # in place, nothing else touched


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(8.0)[::2][2:3],  # (1,) stride 2
        lambda: torch.arange(24.0).reshape(4, 6)[1:2, :],  # (1, 6): stride (6, 1)
        lambda: torch.arange(24.0).reshape(4, 6)[:, 3:4].t()[:, 1:2],  # (1, 1) strides (1, 6)
        lambda: torch.arange(6.0).reshape(1, 6, 1).as_strided((1, 6, 1), (100, 1, 7)),
        lambda: torch.arange(5.0)[2],  # 0-d
        lambda: torch.empty(0, 3),
    ],
)
def test_byte_view_sees_the_bytes_of_any_contiguous_tensor(make: object) -> None:
    t = make()  # type: ignore[operator]
    assert t.is_contiguous()
    got = byte_view(t)
    assert got.dtype == torch.uint8 and got.numel() == t.nbytes
    if t.numel():
        assert got.data_ptr() == t.data_ptr()  # a view of the same bytes
        assert torch.equal(got.view(t.dtype), t.reshape(-1))


def test_byte_view_refuses_a_tensor_that_is_not_contiguous() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(torch.zeros(4, 4).t())


def _views() -> dict[str, torch.Tensor]:
    values = torch.arange(1.0, 9.0).reshape(4, 2)
    rows = torch.zeros(8, 2)
    rows[::2] = values
    cols = torch.zeros(4, 6)
    cols[:, 1::3] = values
    return {
        "strided rows": rows[::2],
        "strided columns": cols[:, 1::3],
        "transposed": values.t().contiguous().t(),
        "expanded": torch.tensor([[1.0, 2.0]]).expand(4, 2),
        "offset slice": torch.arange(20.0)[3:11].reshape(4, 2),  # contiguous, offset
    }


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("how", ["sync", "async", "sync, no copy-ahead"])
def test_views_of_other_tensors_save_their_own_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, how: str
) -> None:
    if how.endswith("no copy-ahead"):
        monkeypatch.setenv("DIST_CKPT_COPY_AHEAD_BYTES", "0")
    views = _views()
    state = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in views.items()}
    strategy = get_default_save_sharded_strategy(layout, 1)
    request = dc.save(state, tmp_path, strategy, async_sharded_save=how == "async")
    if request is not None:
        request.execute_sync()
    loaded = dc.load(
        {k: ShardedTensor.from_rank_offsets(k, torch.empty(4, 2)) for k in views}, tmp_path
    )
    for k, v in views.items():
        assert same_bits(loaded[k], v.contiguous()), (k, loaded[k], v)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_copy_of_an_object_shard_in_a_request_is_filled(tmp_path: Path, layout: str) -> None:
    payload = {"step": 7, "names": ["a", "b"]}
    dc.save(
        {"o": ShardedObject("o", payload, (1,), (0,))},
        tmp_path,
        get_default_save_sharded_strategy(layout, 1),
    )
    request = {
        "main": ShardedObject("o", None, (1,), (0,), replica_id=0),
        "replica": ShardedObject("o", None, (1,), (0,), replica_id=1),
        "nested": [ShardedObject("o", None, (1,), (0,), replica_id=2)],
    }
    out = dc.load(request, tmp_path)
    assert out["main"] == payload and out["replica"] == payload and out["nested"] == [payload]
    out["main"]["step"] = 8  # each copy is its own object
    assert out["replica"]["step"] == 7
