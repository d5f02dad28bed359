"""A reader that parses ``.metadata`` once (Megatron-Core's module path).

Useful when the same checkpoint is read several times in a row (e.g. the
``load_*`` helpers and then ``load``): the parsed metadata is kept, not re-read
and re-checked by the restricted unpickler. With ``cache_metadata=True`` (the
default, as in Megatron-Core 0.19) it is shared by every reader of the same
directory in this process until :meth:`clear_metadata_cache`; with False, each
reader keeps its own.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from torch.distributed.checkpoint.metadata import Metadata

from ..engine.storage.location import CheckpointDir
from ..engine.storage.reader import FileSystemReader


class CachedMetadataFileSystemReader(FileSystemReader):
    """:class:`~dist_checkpointing.engine.storage.reader.FileSystemReader` that keeps
    the parsed ``.metadata`` (per directory, or per reader with ``cache_metadata=False``)."""

    _metadata_cache: ClassVar[dict[str, Metadata]] = {}

    def __init__(
        self, path: str | os.PathLike[str] | CheckpointDir, cache_metadata: bool = True
    ) -> None:
        super().__init__(path)
        self.cache_metadata = cache_metadata
        self._cached_metadata: Metadata | None = None

    def _shared_key(self) -> str:
        return os.path.abspath(self.path) if "://" not in self.path else self.path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if args or kwargs:
            self._cached_metadata = super().read_metadata(*args, **kwargs)
            return self._cached_metadata
        if self.cache_metadata:
            key = self._shared_key()
            if key not in self._metadata_cache:
                self._metadata_cache[key] = super().read_metadata()
            return self._metadata_cache[key]
        if self._cached_metadata is None:
            self._cached_metadata = super().read_metadata()
        return self._cached_metadata

    @classmethod
    def clear_metadata_cache(cls) -> None:
        """Forget the metadata shared between readers (e.g. after a checkpoint
        directory was rewritten)."""
        cls._metadata_cache.clear()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id and os.fspath(checkpoint_id) != self.path:
            self._cached_metadata = None
        super().reset(checkpoint_id)


__all__ = ["CachedMetadataFileSystemReader"]
