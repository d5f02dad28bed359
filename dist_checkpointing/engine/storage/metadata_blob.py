"""The bytes of ``.metadata``: DCP's ``Metadata`` pickled, cheaply when only its
``storage_meta`` changed.

A save that reuses the previous structure (same sharding, same write results) writes the
previous save's ``Metadata`` object again; only ``storage_meta`` differs (the new
directory and save id). Pickling walks every entry (about 70 ms per 6,000 chunks
here); instead, the second pickle of a ``Metadata`` object (the first is a plain one:
most objects are pickled only once), or its first where the save said it will be
written again (:func:`expect_reuse`: a save that caches its structure), is made with
two unique marker strings in place of ``storage_meta.checkpoint_id`` and ``save_id``
and kept as a template. Each pickle of the same object after that splices the real
strings in and fixes the length of the protocol-4 frame that holds them: a copy of the
bytes, no walk over the entries. The result unpickles to the same objects as
``pickle.dumps(metadata, protocol=4)`` (a property test checks it). Pickles are made by
``pickle.dumps`` itself up to ``METADATA_PLAIN_PICKLE_ENTRIES`` stored chunks (65,536:
up to twice as fast as the library's writer, and holding some 0.5 KiB per chunk while
it runs), by :func:`.metadata_pickle.dumps` beyond (the same objects, in a third of the
memory).

The template is reused only while ``state_dict_metadata``, ``planner_data`` and
``storage_data`` are the very objects it was made from (compared with ``is``; the
template holds them, so their ids cannot be reused), ``version`` and the other
``storage_meta`` fields are equal, and both strings are ``str``. Callers must not
mutate those objects in place after the metadata was written (the save path builds
a new ``Metadata`` whenever the structure or write results change). Any other
shape of pickle (no frames where expected, a marker not found exactly once) falls
back to the plain pickle.
"""

from __future__ import annotations

import pickle
import secrets
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..knobs import METADATA_PLAIN_PICKLE_ENTRIES
from . import metadata_pickle
from .pickle_writer import PROTOCOL, str_op

_HEADER = b"\x80\x04"  # PROTO 4
_FRAME = 0x95
_FRAME_HEADER_BYTES = 9  # FRAME opcode and an 8-byte little-endian length
_MAX_TEMPLATES = 8  # metadata objects remembered (one per model being saved, typically)
T = TypeVar("T")


def _frames(blob: bytes) -> list[tuple[int, int]] | None:
    """``(start, end)`` of each frame's content; None unless the blob is protocol 4
    made only of back-to-back frames."""
    if not blob.startswith(_HEADER):
        return None
    frames = []
    pos = len(_HEADER)
    while pos < len(blob):
        if blob[pos] != _FRAME or pos + _FRAME_HEADER_BYTES > len(blob):
            return None
        start = pos + _FRAME_HEADER_BYTES
        end = start + int.from_bytes(blob[pos + 1 : start], "little")
        if end > len(blob):
            return None
        frames.append((start, end))
        pos = end
    return frames


@dataclass
class _Template:
    """A pickle of one ``Metadata`` with marker strings in ``storage_meta``."""

    owner: weakref.ref[Metadata]
    fields: tuple[Any, Any, Any]  # state_dict_metadata, planner_data, storage_data
    version: Any
    load_id: Any
    modules: list[str]
    blob: bytes
    frames: list[tuple[int, int]]
    spots: list[tuple[int, int]]  # where the checkpoint_id and save_id ops lie in blob
    derived: dict[str, Any] = field(default_factory=dict)  # see derived_from_structure

    def same_structure(self, metadata: Metadata) -> bool:
        return self.owner() is metadata and all(
            a is b
            for a, b in zip(
                self.fields,
                (metadata.state_dict_metadata, metadata.planner_data, metadata.storage_data),
            )
        )

    def matches(self, metadata: Metadata, meta: StorageMeta) -> bool:
        return (
            self.same_structure(metadata)
            and self.version == metadata.version
            and self.load_id == meta.load_id
            and self.modules == meta.modules
        )

    def fill(self, values: tuple[str, str]) -> bytes:
        """The pickle with ``values`` in place of the markers."""
        out = [self.blob[: len(_HEADER)]]
        spots = sorted(zip(self.spots, values))
        for start, end in self.frames:
            inside = [(s, v) for s, v in spots if start <= s[0] < end]
            if not inside:
                out.append(self.blob[start - _FRAME_HEADER_BYTES : end])
                continue
            parts, pos = [], start
            for (s0, s1), value in inside:
                parts += [self.blob[pos:s0], str_op(value)]
                pos = s1
            parts.append(self.blob[pos:end])
            content = b"".join(parts)
            out += [bytes((_FRAME,)) + len(content).to_bytes(8, "little"), content]
        return b"".join(out)


_templates: dict[int, _Template] = {}
_pickled_once: dict[int, weakref.ref[Metadata]] = {}  # see _pickled_before
_lock = threading.Lock()


def _make_template(metadata: Metadata, meta: StorageMeta) -> _Template | None:
    markers = [f"\x00dist-ckpt-marker-{secrets.token_hex(16)}-{i}" for i in range(2)]
    original = metadata.storage_meta
    metadata.storage_meta = StorageMeta(markers[0], markers[1], meta.load_id, meta.modules)
    try:
        blob = _pickled(metadata)
    finally:
        metadata.storage_meta = original
    frames = _frames(blob)
    if frames is None:
        return None
    spots = []
    for marker in markers:
        op = str_op(marker)
        at = blob.find(op)
        if at < 0 or blob.find(op, at + 1) >= 0:
            return None
        if not any(s <= at and at + len(op) <= e for s, e in frames):
            return None
        spots.append((at, at + len(op)))
    return _Template(
        weakref.ref(metadata),
        (metadata.state_dict_metadata, metadata.planner_data, metadata.storage_data),
        metadata.version,
        meta.load_id,
        list(meta.modules),
        blob,
        frames,
        spots,
    )


def _pickled(metadata: Metadata) -> bytes:
    """A plain pickle of ``metadata`` (see the module docstring for which pickler)."""
    if len(metadata.storage_data or ()) <= METADATA_PLAIN_PICKLE_ENTRIES.get():
        return pickle.dumps(metadata, protocol=PROTOCOL)
    return metadata_pickle.dumps(metadata)


def metadata_bytes(metadata: Metadata) -> bytes:
    """``pickle.dumps(metadata, protocol=4)``, reusing this object's earlier pickle when
    only ``storage_meta.checkpoint_id`` and ``save_id`` changed (see the module doc)."""
    meta = metadata.storage_meta
    if (
        type(meta) is not StorageMeta
        or not isinstance(meta.checkpoint_id, str)
        or not isinstance(meta.save_id, str)
    ):
        return _pickled(metadata)
    values = (meta.checkpoint_id, meta.save_id)
    with _lock:
        template = _templates.get(id(metadata))
        if template is not None and template.matches(metadata, meta):
            return template.fill(values)
        if not _pickled_before(metadata):  # most objects are pickled once: no template
            return _pickled(metadata)
    template = _make_template(metadata, meta)
    if template is None:
        return _pickled(metadata)
    with _lock:
        while len(_templates) >= _MAX_TEMPLATES:
            del _templates[next(iter(_templates))]
        _templates[id(metadata)] = template
    # The template (as large as the file) goes when its metadata object goes.
    # (The finalizer holds the template weakly: one evicted by the bound is freed at once.)
    weakref.finalize(metadata, _forget, id(metadata), weakref.ref(template))
    return template.fill(values)


def _pickled_before(metadata: Metadata) -> bool:
    """Whether ``metadata`` (this very object) was pickled before (or is expected to be
    pickled again: :func:`expect_reuse`); remembers it if not. A template is made from
    the second pickle of an object on: a save whose structure is not reused pickles its
    new metadata once, and a template would only cost it a second copy of the bytes
    (10 MB for 100,000 tensors) and a splice."""
    seen = _pickled_once.get(id(metadata))
    if seen is not None and seen() is metadata:
        return True
    while len(_pickled_once) >= _MAX_TEMPLATES:
        del _pickled_once[next(iter(_pickled_once))]
    _pickled_once[id(metadata)] = weakref.ref(metadata)
    return False


def expect_reuse(metadata: Metadata) -> None:
    """Say that ``metadata`` (this very object) will be written again with only
    ``storage_meta`` changed (a save that caches its structure): its next pickle is
    made as the template already, so the first save that reuses it splices instead of
    walking every entry again (and what :func:`derived_from_structure` computes during
    that pickle is kept with it)."""
    with _lock:
        _pickled_before(metadata)


def derived_from_structure(metadata: Metadata, name: str, compute: Callable[[], T]) -> T:
    """``compute()``, a function of ``metadata``'s entries only (not of ``storage_meta``),
    kept beside the pickle template of :func:`metadata_bytes` and reused while that
    template is (e.g. the JSON index's entries); computed afresh where there is none."""
    with _lock:
        template = _templates.get(id(metadata))
    if template is None or not template.same_structure(metadata):
        return compute()
    if name not in template.derived:
        template.derived[name] = compute()
    value: T = template.derived[name]
    return value


def _forget(key: int, template: weakref.ref[_Template]) -> None:
    with _lock:
        current = _templates.get(key)
        if current is not None and current is template():
            del _templates[key]


__all__ = ["PROTOCOL", "derived_from_structure", "expect_reuse", "metadata_bytes"]
