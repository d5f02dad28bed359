"""Which storage backend handles a checkpoint location.

The only place that looks at the form of a path (``scheme://...``): local paths
go to :class:`~.local.LocalFileSystem`, ``msc://profile/path`` URLs to
:class:`~.msc.MscFileSystem` (multi-storage-client, an optional extra).
"""

from __future__ import annotations

import os

from ...errors import UnsupportedFeatureError
from .base import FileSystemIO
from .local import LocalFileSystem

MSC_SCHEME = "msc://"


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is URL-like (``scheme://...``) rather than a local path."""
    return "://" in os.fspath(path)


def filesystem_for(path: str | os.PathLike[str]) -> FileSystemIO:
    """The :class:`FileSystemIO` that handles ``path``.

    Raises:
        MissingDependencyError: an ``msc://`` URL without multi-storage-client
            installed (the message says ``pip install dist_checkpointing[msc]``).
        UnsupportedFeatureError: other URL-like paths (``s3://``, ``gs://``, ...):
            reach them through an MSC profile (``msc://profile/path``).
    """
    text = os.fspath(path)
    if text.startswith(MSC_SCHEME):
        from .msc import MscFileSystem

        return MscFileSystem()
    if is_url(text):
        raise UnsupportedFeatureError(
            f"checkpoint path {text!r} looks like a URL; only local filesystem paths and "
            f"msc://profile/path URLs (multi-storage-client) are supported"
        )
    return LocalFileSystem()


__all__ = ["MSC_SCHEME", "filesystem_for", "is_url"]
