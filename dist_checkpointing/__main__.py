"""``python -m dist_checkpointing``: the checkpoint CLI (see :mod:`dist_checkpointing.cli`)."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
