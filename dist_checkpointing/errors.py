"""The exceptions raised by dist_checkpointing.

Every error derives from :class:`CheckpointingException` (Megatron-Core's name,
which users already catch). Specific errors also inherit the matching built-in
exception, so ``except FileNotFoundError`` or ``except ValueError`` keeps working.
"""

from __future__ import annotations


class CheckpointingException(Exception):
    """Base class of every error raised by dist_checkpointing."""


class ShardingError(CheckpointingException, ValueError):
    """The shards of a global tensor or object do not cover it exactly once,
    or the ranks disagree on its global shape or dtype."""


class MappingError(CheckpointingException, ValueError):
    """A ShardedTensor / ShardedObject / factory was built with inconsistent metadata."""


class CheckpointNotFoundError(CheckpointingException, FileNotFoundError):
    """The directory does not exist or holds no distributed checkpoint."""


class IncompleteCheckpointError(CheckpointingException, FileNotFoundError):
    """The directory holds a checkpoint whose save never finished (no metadata)."""


class StrategyNotFoundError(CheckpointingException, KeyError):
    """No strategy is registered for the requested (action, backend, version)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class IncompatibleStrategyError(CheckpointingException, ValueError):
    """A strategy was asked to handle a backend or version it does not support."""


class KeyMismatchError(CheckpointingException, KeyError):
    """Keys requested at load are missing from the checkpoint, or the checkpoint
    holds keys that were not requested (depending on the strictness mode)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(CheckpointingException, ValueError):
    """A requested global shape or dtype differs from the stored one."""


class CorruptCheckpointError(CheckpointingException, OSError):
    """A checkpoint file is truncated, unreadable or fails its integrity check."""


class ChecksumMismatchError(CorruptCheckpointError):
    """Bytes read from a checkpoint differ from the checksum recorded when they were
    written. ``key``, ``file`` and ``offset`` (of the failing block in the file) say
    where."""

    def __init__(self, message: str, key: str = "", file: str = "", offset: int = -1) -> None:
        super().__init__(message)
        self.key = key
        self.file = file
        self.offset = offset


class ForeignFileError(CorruptCheckpointError):
    """A file of the checkpoint was not written by the save its commit record names
    (copied from another checkpoint, or left by another tool)."""


class UnsafeCheckpointError(CheckpointingException, ValueError):
    """Loading would require executing or importing code that is not allowed."""


class CheckpointWriteError(CheckpointingException, OSError, RuntimeError):
    """Writing the checkpoint failed on some rank (worker error, disk full, ...).

    Raised on every rank; where the ranks agreed on the causes, ``failures`` maps
    each failing global rank to its cause. Also a ``RuntimeError``, as
    Megatron-Core raises for a failed writer ("Worker failure: ...").
    """

    failures: dict[int, str]


class ConcurrentSaveError(CheckpointWriteError):
    """Another save is writing to the same checkpoint directory (it holds the lock)."""


class RankFailureError(CheckpointingException):
    """A collective step failed on other rank(s) of the group.

    Raised on every rank that did not fail itself, so that no rank goes on into
    the next collective while another gave up (a failing rank raises its own,
    more specific exception). ``failures`` maps each failing global rank to a
    description of its error.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})


class InvalidArgumentError(CheckpointingException, ValueError):
    """An argument of a public function has an invalid value (e.g. an unknown strict flag)."""


class UnsupportedFeatureError(CheckpointingException, NotImplementedError):
    """The caller asked for a feature this library deliberately does not provide."""


class MissingDependencyError(UnsupportedFeatureError, ImportError):
    """A feature needs an optional package that is not installed; the message says
    what to install."""


class StorageAccessError(CheckpointingException, OSError):
    """The storage backend refused a request (credentials, permissions) or could not
    be reached after a bounded number of retries; the message names the URL."""


__all__ = [
    "CheckpointingException",
    "ShardingError",
    "MappingError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "StrategyNotFoundError",
    "IncompatibleStrategyError",
    "KeyMismatchError",
    "ShapeMismatchError",
    "CorruptCheckpointError",
    "ChecksumMismatchError",
    "ForeignFileError",
    "UnsafeCheckpointError",
    "ConcurrentSaveError",
    "CheckpointWriteError",
    "RankFailureError",
    "InvalidArgumentError",
    "UnsupportedFeatureError",
    "MissingDependencyError",
    "StorageAccessError",
]
