"""File names read from a checkpoint, checked before they touch the file system.

A checkpoint made by someone else names its data files in ``.metadata``
(``StorageInfo.relative_path``) and elsewhere. Every such name goes through
:func:`safe_name` before it is joined to the checkpoint directory: it must be one
plain entry of that directory (no ``..``, no absolute path, no sub-directory, no
NUL), and equivalent spellings (``./__0_0.distcp``) become one canonical name, so
that two spellings of one file can never be told apart (``remove_sharded_tensors``
must not delete a file that a kept item still uses).

Refusals never look at the file system, so their messages say nothing about
whether a path outside the checkpoint exists.
"""

from __future__ import annotations

import posixpath

from ...errors import CorruptCheckpointError, UnsafeCheckpointError

# Longest name accepted (a file name, not a path: POSIX NAME_MAX is 255 bytes).
MAX_NAME_BYTES = 255


def safe_name(name: object, *, source: str) -> str:
    """``name`` as one canonical plain entry of the checkpoint directory.

    Args:
        name: a file name read from the checkpoint (e.g. a ``relative_path``).
        source: what named it (e.g. the ``.metadata`` path), for the message.

    Raises:
        CorruptCheckpointError: ``name`` is not a string.
        UnsafeCheckpointError: ``name`` is empty, absolute, contains ``..``, a
            separator, a backslash or NUL, or is too long.
    """
    if type(name) is not str:
        raise CorruptCheckpointError(
            f"{source}: a file name must be a string, found {type(name).__name__}"
        )
    shown = repr(name[:80]) + ("..." if len(name) > 80 else "")
    problem = _problem(name)
    if problem is not None:
        raise UnsafeCheckpointError(
            f"{source}: refusing file name {shown}: {problem} (a checkpoint names only "
            f"files directly inside its own directory)"
        )
    return posixpath.normpath(name)


def _problem(name: str) -> str | None:
    if not name:
        return "it is empty"
    if "\x00" in name or "\\" in name:
        return "it contains NUL or a backslash"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES * 4:
        return "it is too long"
    if name.startswith("/"):
        return "it is an absolute path"
    normal = posixpath.normpath(name)
    if normal in (".", "..") or normal.startswith("../") or "/" in normal:
        return "it leaves the checkpoint directory or names a sub-directory"
    if len(normal.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return "it is too long"
    return None


__all__ = ["MAX_NAME_BYTES", "safe_name"]
