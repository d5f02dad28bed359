"""Checkpoint-level configuration: ``metadata.json`` and checkpoint detection.

``metadata.json`` names the sharded and common backends (and their versions)
that wrote the checkpoint; ``load`` dispatches on it rather than guessing the
format from the files present.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, fields

from .engine.checkpoint.commit import COMMIT_MARKER
from .engine.storage.location import CheckpointDir

# Megatron-Core users import the base error from here; it lives in errors.py.
from .errors import CheckpointingException, CorruptCheckpointError  # noqa: F401

logger = logging.getLogger(__name__)

CONFIG_FNAME = COMMIT_MARKER  # the config file is the commit marker

__all__ = [
    "CONFIG_FNAME",
    "CheckpointingConfig",
    "check_is_distributed_checkpoint",
    "config_bytes",
    "maybe_load_config",
    "save_config",
]


@dataclass
class CheckpointingConfig:
    """The backends (and versions) that wrote a checkpoint, stored in ``metadata.json``.

    Megatron-Core 0.16+ writes only the sharded backend; the common backend then
    defaults to ``torch`` version 1.
    """

    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: str = "torch"
    common_backend_version: int = 1


def check_is_distributed_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> bool:
    """Whether ``checkpoint_dir`` holds a distributed checkpoint (has ``metadata.json``)."""
    return maybe_load_config(checkpoint_dir) is not None


def maybe_load_config(checkpoint_dir: str | os.PathLike[str]) -> CheckpointingConfig | None:
    """The checkpoint's config, or None if ``metadata.json`` is absent.

    Unknown fields (written by newer releases) are ignored.

    Raises:
        CorruptCheckpointError: ``metadata.json`` exists but is not a valid config.
    """
    ckpt = CheckpointDir.of(checkpoint_dir)
    if not ckpt.has(CONFIG_FNAME):
        return None
    path = ckpt.path(CONFIG_FNAME)
    try:
        raw = json.loads(ckpt.read_bytes(CONFIG_FNAME))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{path}: unreadable checkpoint config ({e})") from e
    known = {f.name for f in fields(CheckpointingConfig)}
    if not isinstance(raw, dict) or "sharded_backend" not in raw:
        raise CorruptCheckpointError(f"{path}: expected a JSON object with 'sharded_backend'")
    unknown = set(raw) - known
    if unknown:
        logger.debug("Ignoring unknown fields %s in %s", sorted(unknown), path)
    values = {k: v for k, v in raw.items() if k in known}
    for f in fields(CheckpointingConfig):
        want = int if f.name.endswith("_version") else str
        value = values.get(f.name)
        if f.name in values and type(value) is not want:  # bool is not int
            raise CorruptCheckpointError(
                f"{path}: field {f.name!r} must be {want.__name__}, found "
                f"{type(value).__name__} {str(value)[:80]!r}"
            )
    return CheckpointingConfig(**values)


def config_bytes(config: CheckpointingConfig) -> bytes:
    """The content of ``metadata.json`` for ``config``."""
    return json.dumps(asdict(config)).encode()


def save_config(config: CheckpointingConfig, checkpoint_dir: str | os.PathLike[str]) -> None:
    """Write ``metadata.json`` durably and atomically (it marks the checkpoint complete)."""
    CheckpointDir.of(checkpoint_dir).atomic_write(CONFIG_FNAME, config_bytes(config))
