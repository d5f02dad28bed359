"""Helpers for nested state dicts: dicts and lists of arbitrary depth.

Same names and semantics as Megatron-Core's ``dist_checkpointing.dict_utils``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

T = TypeVar("T")
U = TypeVar("U")

NestedContainer = dict[Any, Any] | list[Any]


def extract_matching_values(
    x: NestedContainer,
    predicate: Callable[[Any], bool],
    return_lists_as_dicts: bool = False,
) -> tuple[NestedContainer, NestedContainer]:
    """Split a nested dict/list into the leaves matching ``predicate`` and the rest.

    Args:
        x: the nested container to split.
        predicate: called on every leaf; True sends the leaf to the first result.
        return_lists_as_dicts: if True, lists are returned as dicts keyed by index,
            so that the positions of the matching elements are kept.

    Returns:
        ``(matching, nonmatching)``, both with the structure of ``x``. A
        sub-container left empty by the split is dropped from that side, but a
        container that was empty in ``x`` is kept on the nonmatching side (as
        Megatron-Core does), so that e.g. an optimizer's empty ``state`` dict
        survives in the common state.
    """

    def _set(target: NestedContainer, key: Any, value: Any) -> None:
        if isinstance(target, dict):
            target[key] = value
        else:
            target.append(value)

    def _split(obj: Any) -> tuple[Any, Any]:
        if isinstance(obj, dict):
            items: Iterable[tuple[Any, Any]] = obj.items()
            match: NestedContainer = {}
            other: NestedContainer = {}
        elif isinstance(obj, list):
            items = enumerate(obj)
            match = {} if return_lists_as_dicts else []
            other = {} if return_lists_as_dicts else []
        else:
            raise TypeError(f"Unexpected container type {type(obj)}")
        for k, v in items:
            if isinstance(v, (dict, list)):
                m, o = _split(v)
                if m:
                    _set(match, k, m)
                if o or not v:
                    _set(other, k, o)
            elif predicate(v):
                _set(match, k, v)
            else:
                _set(other, k, v)
        return match, other

    return _split(x)


def diff(x1: Any, x2: Any, prefix: tuple[Any, ...] = ()) -> tuple[list[Any], list[Any], list[Any]]:
    """Recursive comparison of two nested containers.

    Returns:
        ``(only_left, only_right, mismatch)``: key paths present only in ``x1``,
        only in ``x2``, and paths whose leaf values differ (tensors compared by
        value, a mismatch entry is ``(path, type(x1), type(x2))``).
    """
    mismatch: list[Any] = []
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        only_right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        for k in x1.keys() & x2.keys():
            l, r, m = diff(x1[k], x2[k], prefix + (k,))
            only_left.extend(l)
            only_right.extend(r)
            mismatch.extend(m)
    elif isinstance(x1, list) and isinstance(x2, list):
        only_left = [prefix + (i,) for i in range(len(x2), len(x1))]
        only_right = [prefix + (i,) for i in range(len(x1), len(x2))]
        for i, (v1, v2) in enumerate(zip(x1, x2)):
            l, r, m = diff(v1, v2, prefix + (i,))
            only_left.extend(l)
            only_right.extend(r)
            mismatch.extend(m)
    else:
        only_left, only_right = [], []
        if isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor):
            equal = (
                x1.shape == x2.shape
                and x1.dtype == x2.dtype
                and bool(torch.equal(x1.cpu(), x2.cpu()))
            )
        else:
            try:
                equal = bool(x1 == x2)
            except (RuntimeError, ValueError, TypeError):
                equal = False
        if not equal:
            mismatch.append((prefix, type(x1), type(x2)))
    return only_left, only_right, mismatch


def inspect_types(x: Any, prefix: tuple[Any, ...] = (), indent: int = 4) -> list[str]:
    """Lines describing the structure and leaf types of a nested container."""
    lines: list[str] = []
    pad = " " * indent * len(prefix)
    if isinstance(x, dict):
        for k, v in x.items():
            if isinstance(v, (dict, list)):
                lines.append(f"{pad}{k!r}:")
                lines.extend(inspect_types(v, prefix + (k,), indent))
            else:
                lines.append(f"{pad}{k!r}: {type(v).__name__}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            if isinstance(v, (dict, list)):
                lines.append(f"{pad}[{i}]:")
                lines.extend(inspect_types(v, prefix + (i,), indent))
            else:
                lines.append(f"{pad}[{i}]: {type(v).__name__}")
    return lines


def nested_values(x: NestedContainer) -> Iterator[Any]:
    """Yield every leaf of a nested dict/list."""
    for v in x.values() if isinstance(x, dict) else x:
        if isinstance(v, (dict, list)):
            yield from nested_values(v)
        else:
            yield v


def nested_items_iter(x: NestedContainer) -> Iterator[tuple[Any, Any]]:
    """Yield ``(key, leaf)`` for every leaf; the key is the leaf's own key or index."""
    for k, v in x.items() if isinstance(x, dict) else enumerate(x):
        if isinstance(v, (dict, list)):
            yield from nested_items_iter(v)
        else:
            yield k, v


def nested_paths_iter(
    x: NestedContainer, prefix: tuple[Any, ...] = ()
) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Yield ``(path, leaf)`` for every leaf; the path is the tuple of keys/indices."""
    for k, v in x.items() if isinstance(x, dict) else enumerate(x):
        if isinstance(v, (dict, list)):
            yield from nested_paths_iter(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def dict_map(f: Callable[[Any], Any], d: dict[Any, Any]) -> None:
    """Apply ``f`` to every leaf of a nested dict in place (lists are leaves)."""
    for k, v in d.items():
        if isinstance(v, dict):
            dict_map(f, v)
        else:
            d[k] = f(v)


def dict_map_with_key(f: Callable[[Any, Any], Any], d: dict[Any, Any]) -> None:
    """Like :func:`dict_map`, with ``f(key, value)``."""
    for k, v in d.items():
        if isinstance(v, dict):
            dict_map_with_key(f, v)
        else:
            d[k] = f(k, v)


def dict_list_map_inplace(f: Callable[[Any], Any], x: Any) -> Any:
    """Apply ``f`` to every leaf of nested dicts and lists, in place; returns ``x``."""
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = dict_list_map_inplace(f, v)
    elif isinstance(x, list):
        x[:] = (dict_list_map_inplace(f, v) for v in x)
    else:
        return f(x)
    return x


def dict_list_map_outplace(f: Callable[[Any], Any], x: Any) -> Any:
    """Apply ``f`` to every leaf of nested dicts and lists, returning a new structure."""
    if isinstance(x, dict):
        return {k: dict_list_map_outplace(f, v) for k, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)


def merge(x1: NestedContainer, x2: NestedContainer, key: tuple[Any, ...] = ()) -> NestedContainer:
    """Merge ``x2`` into ``x1`` in place (dicts by key, lists by position); returns ``x1``.

    Raises:
        ValueError: if the structures disagree (a list against a dict, or lists
            of different lengths), naming the path.
    """
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                x1[k] = v2
            else:
                x1[k] = merge(x1[k], v2, key=key + (k,))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(
                f"Cannot merge two lists of different lengths ({len(x1)} and {len(x2)}) "
                f"at key {key}"
            )
        for i, v2 in enumerate(x2):
            x1[i] = merge(x1[i], v2, key=key + (i,))
    else:
        raise ValueError(
            f"Duplicate non-dict and non-list values at key {key}: "
            f"{type(x1).__name__} and {type(x2).__name__}"
        )
    return x1


def map_reduce(
    xs: Iterable[T],
    key_fn: Callable[[T], Any] = lambda x: x,
    value_fn: Callable[[T], Any] = lambda x: x,
    reduce_fn: Callable[[list[Any]], Any] = lambda x: x,
) -> dict[Any, Any]:
    """Group ``xs`` by ``key_fn``, map each with ``value_fn`` and reduce each group."""
    groups: defaultdict[Any, list[Any]] = defaultdict(list)
    for x in xs:
        groups[key_fn(x)].append(value_fn(x))
    return {k: reduce_fn(v) for k, v in groups.items()}
