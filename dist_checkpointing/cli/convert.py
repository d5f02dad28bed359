"""``convert``: a sharded checkpoint to one ``torch.save`` file, to Hugging Face
style safetensors shards, or to the other sharded layout (``torch_dist`` <->
``raw_bytes``, :mod:`.relayout`), and a ``torch.save``/safetensors file to a
sharded checkpoint for N ranks.

From a sharded checkpoint, tensors are read one at a time. Safetensors output
holds at most one tensor in memory; a ``torch.save`` file needs all of them at
once, so they are read into file-backed shared mappings (temporary files next to
the destination, deleted at once) that the kernel pages out instead of keeping
them in RAM. To a sharded checkpoint, each of N worker
processes (a gloo group on 127.0.0.1) holds only its own rows of each tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from ..engine.storage.resolve import is_url
from ..errors import CheckpointingException
from . import safetensors_io
from .source import Checkpoint, is_checkpoint_dir, one_line, open_checkpoint
from .ui import CliError, human_bytes, parse_size, progress


def _inside(path: str, root: str) -> bool:
    """Whether local ``path`` is ``root`` or lies under it (links resolved)."""
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _check_destination(dst: str, is_dir: bool, url_ok: bool = False, src: str = "") -> None:
    """Refuse a destination the conversion cannot write safely: a non-empty directory,
    an existing file, one inside the source checkpoint (whose files it would change)
    or the source itself."""
    if src and not is_url(src) and not is_url(dst) and _inside(dst, src):
        raise CliError(f"{dst}: inside the source {src} (write the output elsewhere)")
    if is_url(dst):  # msc://: a prefix, created by its first object
        if not url_ok:
            raise CliError(f"{dst}: this output is written to local files, not to a URL")
        if is_checkpoint_dir(dst):
            raise CliError(f"{dst}: destination directory is not empty")
        return
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise CliError(f"{dst}: parent directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise CliError(f"{dst}: destination is not writable")
    if is_dir and os.path.isdir(dst) and os.listdir(dst):
        raise CliError(f"{dst}: destination directory is not empty")
    if not is_dir and os.path.isdir(dst):
        raise CliError(f"{dst}: is a directory (give a file name, e.g. model.pt)")
    if not is_dir and os.path.lexists(dst):
        raise CliError(f"{dst}: already exists (remove it first, or choose another name)")


def file_backed(where: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor whose memory is a shared mapping of a (deleted) temporary
    file in ``where``: the kernel can write its pages back to disk instead of keeping them
    in RAM, so many of them do not add up in memory."""
    nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    fd, path = tempfile.mkstemp(dir=where, suffix=".buf")
    os.close(fd)
    try:
        raw = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    finally:
        os.remove(path)  # the mapping stays valid
    return raw.view(dtype).reshape(shape)


def _to_torch(ckpt: Checkpoint, keys: list[str], dst: str, bar_on: bool | None) -> None:
    state: dict[str, Any] = ckpt.common()
    total = sum(ckpt.tensors[k].nbytes for k in keys)
    where = os.path.dirname(os.path.abspath(dst))
    with progress(total, "convert", bar_on) as bar:
        for key in keys:
            if key in state:
                raise CliError(f"tensor key {key!r} collides with a common-state key")
            info = ckpt.tensors[key]
            state[key] = ckpt.read(key, out=file_backed(where, info.shape, info.dtype))
            bar.update(info.nbytes)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(dst)), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def plan_shards(ckpt: Checkpoint, keys: list[str], max_bytes: int) -> list[list[str]]:
    """Keys grouped in order into shards of at most ``max_bytes`` (a bigger tensor
    gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key in keys:
        n = ckpt.tensors[key].nbytes
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += n
    return shards


def _to_safetensors(
    ckpt: Checkpoint, keys: list[str], dst: str, max_bytes: int, bar_on: bool | None
) -> None:
    shards = plan_shards(ckpt, keys, max_bytes)
    os.makedirs(dst, exist_ok=True)
    n = len(shards)
    names = (
        ["model.safetensors"]
        if n == 1
        else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    weight_map: dict[str, str] = {}
    total = sum(ckpt.tensors[k].nbytes for k in keys)
    with progress(total, "convert", bar_on) as bar:
        for name, shard in zip(names, shards):
            entries = [(k, ckpt.tensors[k].shape, ckpt.tensors[k].dtype) for k in shard]
            tmp = os.path.join(dst, name + ".tmp")
            safetensors_io.write_file(tmp, entries, ckpt.read, bar.update)
            os.replace(tmp, os.path.join(dst, name))
            weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(dst, safetensors_io.INDEX_FNAME), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2, sort_keys=True)


def _from_checkpoint(args: argparse.Namespace, bar_on: bool | None) -> int:
    ckpt = open_checkpoint(args.src)
    keys = ckpt.select(args.keys)
    if not keys:
        raise CliError(f"{args.src}: no tensor matches {args.keys!r}")
    if args.to == "torch":
        _check_destination(args.dst, is_dir=False, src=args.src)
        _to_torch(ckpt, keys, args.dst, bar_on)
    else:
        _check_destination(args.dst, is_dir=True, src=args.src)
        _to_safetensors(ckpt, keys, args.dst, parse_size(args.max_shard_size), bar_on)
    total = sum(ckpt.tensors[k].nbytes for k in keys)
    print(f"wrote {len(keys)} tensor(s), {human_bytes(total)}, to {args.dst}")
    return 0


# --------------------------------------------------------------------------- to a sharded checkpoint


def _open_torch_file(src: str) -> dict[str, Any]:
    try:
        state = torch.load(src, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError) as e:
        raise CliError(f"{src}: not a loadable torch.save file ({one_line(e)})") from e
    if not isinstance(state, dict):
        raise CliError(f"{src}: holds a {type(state).__name__}, not a dict")
    return state


def source_kind(src: str) -> str:
    """``"safetensors"`` or ``"torch"`` for a conversion input; CliError otherwise."""
    if os.path.isdir(src):
        if os.path.isfile(os.path.join(src, "metadata.json")) or os.path.isfile(
            os.path.join(src, ".metadata")
        ):
            raise CliError(
                f"{src}: already a sharded checkpoint (convert --to torch or safetensors)"
            )
        return "safetensors"
    if not os.path.isfile(src):
        raise CliError(f"{src}: no such file or directory")
    with open(src, "rb") as f:
        head = f.read(8)
    if head[:2] == b"PK":
        return "torch"
    if src.endswith(".safetensors"):
        return "safetensors"
    raise CliError(f"{src}: neither a torch.save (zip) file nor a .safetensors file")


def _to_dist(args: argparse.Namespace) -> int:
    from .to_dist import convert_to_dist

    kind = source_kind(args.src)
    if args.ranks < 1:
        raise CliError(f"--ranks must be at least 1, got {args.ranks}")
    if kind == "torch":
        _open_torch_file(args.src)  # fail here, with one line, if it does not load
    _check_destination(args.dst, is_dir=True, url_ok=True, src=args.src)
    if not is_url(args.dst):
        os.makedirs(args.dst, exist_ok=True)
    convert_to_dist(kind, args.src, args.dst, args.ranks, args.keys)
    print(f"wrote a sharded checkpoint for {args.ranks} rank(s) to {args.dst}")
    return 0


def _to_layout(args: argparse.Namespace) -> int:
    from .relayout import relayout

    if not os.path.isfile(os.path.join(args.src, "metadata.json")):
        raise CliError(f"{args.src}: not a sharded checkpoint of ours (no metadata.json)")
    if args.keys is not None:
        raise CliError("--keys is not supported with --to torch_dist/raw_bytes (all is converted)")
    _check_destination(args.dst, is_dir=True, src=args.src)
    os.makedirs(args.dst, exist_ok=True)
    count = relayout(args.src, args.dst, args.to, file_backed)
    print(f"wrote {count} tensor(s) in the {args.to} layout to {args.dst}")
    return 0


def cmd_convert(args: argparse.Namespace, bar_on: bool | None = None) -> int:
    try:
        if args.to == "dist":
            return _to_dist(args)
        if args.to in ("torch_dist", "raw_bytes"):
            return _to_layout(args)
        return _from_checkpoint(args, bar_on)
    except (CheckpointingException, OSError) as e:
        raise CliError(one_line(e)) from e


Reader = Callable[[slice | None], torch.Tensor]

__all__ = ["Reader", "cmd_convert", "plan_shards", "source_kind"]
