"""Tests of dist_checkpointing.dict_utils (nested dict/list helpers)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch

from dist_checkpointing.dict_utils import (
    dict_list_map_inplace,
    dict_list_map_outplace,
    dict_map,
    dict_map_with_key,
    diff,
    extract_matching_values,
    inspect_types,
    map_reduce,
    merge,
    nested_items_iter,
    nested_paths_iter,
    nested_values,
)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _sample() -> dict[str, Any]:
    return {
        "a": torch.ones(2),
        "b": 3,
        "c": {"d": torch.zeros(1), "e": "text", "f": {"g": torch.ones(1)}},
        "h": [torch.ones(3), 5, {"i": torch.zeros(2), "j": None}, [6, torch.ones(1)]],
        "k": {"only_plain": 1},
    }


# ------------------------------------------------------------------ extract_matching_values


def test_extract_matching_values_dicts() -> None:
    x = _sample()
    match, other = extract_matching_values(x, _is_tensor)
    assert set(match) == {"a", "c", "h"}
    assert match["a"] is x["a"]
    assert set(match["c"]) == {"d", "f"} and match["c"]["f"]["g"] is x["c"]["f"]["g"]
    assert other["b"] == 3 and other["c"] == {"e": "text"} and other["k"] == {"only_plain": 1}
    assert "a" not in other and "f" not in other["c"]  # emptied sub-dicts are dropped
    # The input is not modified.
    assert set(x["c"]) == {"d", "e", "f"}


def test_extract_matching_values_lists_compacted() -> None:
    x = _sample()
    match, other = extract_matching_values(x, _is_tensor)
    # Lists keep only their matching (resp. non-matching) elements, in order.
    h_match = match["h"]
    assert isinstance(h_match, list) and len(h_match) == 3
    assert h_match[0] is x["h"][0]
    assert set(h_match[1]) == {"i"} and h_match[1]["i"] is x["h"][2]["i"]
    assert len(h_match[2]) == 1 and h_match[2][0] is x["h"][3][1]
    assert other["h"] == [5, {"j": None}, [6]]


def test_extract_matching_values_lists_as_dicts() -> None:
    x = _sample()
    match, other = extract_matching_values(x, _is_tensor, return_lists_as_dicts=True)
    # Lists become dicts keyed by the original index, so positions survive.
    assert isinstance(match["h"], dict) and set(match["h"]) == {0, 2, 3}
    assert match["h"][0] is x["h"][0]
    assert match["h"][2] == {"i": x["h"][2]["i"]}
    assert match["h"][3] == {1: x["h"][3][1]}
    assert other["h"] == {1: 5, 2: {"j": None}, 3: {0: 6}}


def test_extract_matching_values_top_level_list() -> None:
    x = [1, torch.ones(1), [2]]
    match, other = extract_matching_values(x, _is_tensor)
    assert len(match) == 1 and match[0] is x[1]
    assert other == [1, [2]]
    match_d, other_d = extract_matching_values(x, _is_tensor, return_lists_as_dicts=True)
    assert list(match_d) == [1] and other_d == {0: 1, 2: {0: 2}}


def test_extract_matching_values_keeps_originally_empty_containers() -> None:
    # An optimizer state dict has an empty 'state' and empty 'params' lists that must survive
    # in the non-sharded part (Megatron-Core keeps them too).
    x = {
        "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": []}]},
        "w": torch.ones(1),
        "empty_list": [],
        "nested": [[], {}],
    }
    match, other = extract_matching_values(x, _is_tensor)
    assert set(match) == {"w"}
    assert other == {
        "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": []}]},
        "empty_list": [],
        "nested": [[], {}],
    }


def test_extract_matching_values_rejects_a_leaf() -> None:
    with pytest.raises(TypeError):
        extract_matching_values(torch.ones(1), _is_tensor)  # type: ignore[arg-type]


# ------------------------------------------------------------------ diff


def test_diff_equal_structures() -> None:
    assert diff(_sample(), _sample()) == ([], [], [])


def test_diff_reports_keys_and_mismatches() -> None:
    left = {"a": torch.ones(2), "b": 1, "only_left": 0, "l": [1, 2, 3], "n": {"x": "s"}}
    right = {"a": torch.tensor([1.0, 2.0]), "b": 1, "only_right": 0, "l": [1, 9], "n": {"x": "s"}}
    only_left, only_right, mismatch = diff(left, right)
    assert sorted(only_left) == [("l", 2), ("only_left",)]
    assert only_right == [("only_right",)]
    assert sorted(mismatch, key=str) == sorted(
        [(("a",), torch.Tensor, torch.Tensor), (("l", 1), int, int)], key=str
    )
    only_left, only_right, _ = diff([1], [1, 2, 3])
    assert only_left == [] and only_right == [(1,), (2,)]


@pytest.mark.parametrize(
    ("t1", "t2", "equal"),
    [
        (torch.arange(4), torch.arange(4), True),
        (torch.arange(4), torch.arange(4).reshape(2, 2), False),
        (torch.arange(4), torch.arange(4, dtype=torch.float32), False),
        (torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0]), False),
        (torch.zeros(0), torch.zeros(0), True),
    ],
)
def test_diff_compares_tensors_by_value(t1: torch.Tensor, t2: torch.Tensor, equal: bool) -> None:
    _, _, mismatch = diff({"t": t1}, {"t": t2})
    assert (mismatch == []) is equal


def test_diff_mismatched_container_types() -> None:
    _, _, mismatch = diff({"a": {"b": 1}}, {"a": [1]})
    assert mismatch == [(("a",), dict, list)]
    # A multi-element tensor against a scalar has no truth value: a mismatch, not a crash.
    _, _, mismatch = diff({"a": torch.ones(2)}, {"a": 1.0})
    assert mismatch == [(("a",), torch.Tensor, float)]


# ------------------------------------------------------------------ iteration and mapping


def test_nested_iterators() -> None:
    x = {"a": 1, "b": {"c": 2, "d": [3, {"e": 4}]}, "f": []}
    assert list(nested_values(x)) == [1, 2, 3, 4]
    assert list(nested_items_iter(x)) == [("a", 1), ("c", 2), (0, 3), ("e", 4)]
    assert list(nested_paths_iter(x)) == [
        (("a",), 1),
        (("b", "c"), 2),
        (("b", "d", 0), 3),
        (("b", "d", 1, "e"), 4),
    ]
    assert list(nested_values([1, [2]])) == [1, 2]


def test_inspect_types() -> None:
    lines = inspect_types({"a": 1, "b": {"c": torch.ones(1)}, "d": ["s"]}, indent=2)
    assert lines == ["'a': int", "'b':", "  'c': Tensor", "'d':", "  [0]: str"]


def test_dict_map_treats_lists_as_leaves() -> None:
    x = {"a": 1, "b": {"c": 2}, "l": [1, 2]}
    dict_map(lambda v: v * 10, x)
    assert x == {"a": 10, "b": {"c": 20}, "l": [1, 2] * 10}


def test_dict_map_with_key() -> None:
    x = {"a": 1, "b": {"c": 2}}
    dict_map_with_key(lambda k, v: f"{k}={v}", x)
    assert x == {"a": "a=1", "b": {"c": "c=2"}}


def test_dict_list_map_inplace() -> None:
    inner = [1, {"b": 2}]
    x = {"a": inner, "c": 3}
    out = dict_list_map_inplace(lambda v: v + 1, x)
    assert out is x and x["a"] is inner
    assert x == {"a": [2, {"b": 3}], "c": 4}
    assert dict_list_map_inplace(lambda v: v * 2, 5) == 10


def test_dict_list_map_outplace() -> None:
    x = {"a": [1, {"b": 2}], "c": 3}
    out = dict_list_map_outplace(lambda v: v + 1, x)
    assert out == {"a": [2, {"b": 3}], "c": 4}
    assert x == {"a": [1, {"b": 2}], "c": 3}
    assert out["a"] is not x["a"]


# ------------------------------------------------------------------ merge


def test_merge_dicts_and_lists() -> None:
    x1: dict[str, Any] = {"a": 1, "b": {"c": 2}, "l": [{"x": 1}, {}]}
    x2 = {"b": {"d": 3}, "e": 4, "l": [{"y": 2}, {"z": 3}]}
    out = merge(x1, x2)
    assert out is x1
    assert x1 == {"a": 1, "b": {"c": 2, "d": 3}, "e": 4, "l": [{"x": 1, "y": 2}, {"z": 3}]}


def test_merge_inverts_extract_matching_values() -> None:
    x = _sample()
    match, other = extract_matching_values(x, _is_tensor, return_lists_as_dicts=False)
    del match["h"], other["h"]  # compacted lists do not merge back by position
    merged = merge(other, match)
    ref = _sample()
    del ref["h"]
    assert diff(merged, ref) == ([], [], [])


def test_merge_errors_name_the_path() -> None:
    with pytest.raises(ValueError, match=r"lists of different lengths \(2 and 1\).*\('a', 'l'\)"):
        merge({"a": {"l": [1, 2]}}, {"a": {"l": [1]}})
    with pytest.raises(ValueError, match=r"\('a', 'b'\).*int and int"):
        merge({"a": {"b": 1}}, {"a": {"b": 2}})
    with pytest.raises(ValueError, match=r"\('a', 0\).*dict and list"):
        merge({"a": [{"b": 1}]}, {"a": [[1]]})


# ------------------------------------------------------------------ map_reduce


def test_map_reduce() -> None:
    words = ["apple", "avocado", "banana", "blueberry", "cherry"]
    assert map_reduce(words, key_fn=lambda w: w[0]) == {
        "a": ["apple", "avocado"],
        "b": ["banana", "blueberry"],
        "c": ["cherry"],
    }
    assert map_reduce(words, lambda w: w[0], len, sum) == {"a": 12, "b": 15, "c": 6}
    assert map_reduce([1, 2, 1]) == {1: [1, 1], 2: [2]}
    assert map_reduce([]) == {}
    # Groups keep first-seen order.
    assert list(map_reduce([3, 1, 3, 2], reduce_fn=len)) == [3, 1, 2]


def test_extract_matching_values_accepts_dict_subclasses() -> None:
    x = OrderedDict(a=torch.ones(1), b=2)
    match, other = extract_matching_values(x, _is_tensor)
    assert list(match) == ["a"] and other == {"b": 2}
