"""Which storage backend handles a checkpoint location.

The only place that looks at the form of a path (``scheme://...``).
"""

from __future__ import annotations

import os

from ...errors import UnsupportedFeatureError
from .base import FileSystemIO
from .local import LocalFileSystem


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is URL-like (``scheme://...``) rather than a local path."""
    return "://" in os.fspath(path)


def filesystem_for(path: str | os.PathLike[str]) -> FileSystemIO:
    """The :class:`FileSystemIO` that handles ``path``.

    Raises:
        UnsupportedFeatureError: for URL-like paths (``scheme://...``), which need an
            object-storage backend that is not available yet.
    """
    text = os.fspath(path)
    if is_url(text):
        raise UnsupportedFeatureError(
            f"checkpoint path {text!r} looks like a URL; only local filesystem paths are "
            f"supported (object storage such as msc:// is not available yet)"
        )
    return LocalFileSystem()


__all__ = ["filesystem_for", "is_url"]
