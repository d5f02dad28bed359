"""A reader that parses ``.metadata`` once per instance (Megatron-Core's module path).

Useful when the same checkpoint is read several times in a row (e.g. the
``load_*`` helpers and then ``load``): the parsed metadata is kept on the
reader, not re-read and re-checked by the restricted unpickler.
"""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from ..engine.storage.location import CheckpointDir
from ..engine.storage.reader import FileSystemReader


class CachedMetadataFileSystemReader(FileSystemReader):
    """:class:`~dist_checkpointing.engine.storage.reader.FileSystemReader` that keeps
    the parsed ``.metadata`` until :meth:`reset` points it at another checkpoint."""

    def __init__(self, path: str | os.PathLike[str] | CheckpointDir) -> None:
        super().__init__(path)
        self._cached_metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._cached_metadata is None or args or kwargs:
            self._cached_metadata = super().read_metadata(*args, **kwargs)
        return self._cached_metadata

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id and os.fspath(checkpoint_id) != self.path:
            self._cached_metadata = None
        super().reset(checkpoint_id)


__all__ = ["CachedMetadataFileSystemReader"]
