"""Loading checkpoint files without executing code stored in them.

A checkpoint holds two kinds of pickles:

* ``.metadata`` (a pickled DCP ``Metadata``): :func:`load_metadata`
  (:mod:`.metadata`) over the allowlist (:mod:`.allowlist`), read by the fast
  unpickler (:mod:`.fast_unpickler`, :mod:`.shadows`, :mod:`.adoption`) or, for
  every file it declines, by the checked one (:mod:`.restricted_unpickler`);
* ``torch.save`` payloads (``common.pt``, ShardedObject bytes):
  :func:`safe_torch_load` (:mod:`.torch_load`), ``weights_only`` semantics
  unless the caller trusts the file.

Before and after unpickling, bounds for files made by someone else:
:mod:`.pickle_scan` (nesting depth, collidable dict keys and the cost of hashing
keys, from the opcodes of ``torch.save`` payloads and small ``.metadata`` files),
:mod:`.cpu_bounded` (a ``.metadata`` of 16 KiB or more is parsed first in a forked
child under a CPU-time limit: dict keys with colliding hashes make one opcode take
minutes), :mod:`.metadata_check` (the structure of a ``.metadata``: field types, chunk
overlap, N-D reformulation; no callable or class handed out as data), :mod:`.bounded`
(error messages in bounded time). File names from a checkpoint are checked by
:mod:`..storage.names`.
"""

from __future__ import annotations

from .allowlist import (
    MCORE_SAVE_PLAN_GLOBAL,
    LegacyMCoreSavePlan,
    allowed_metadata_globals,
    is_allowed_metadata_global,
)
from .metadata import load_metadata
from .torch_load import object_loader, safe_torch_load

__all__ = [
    "MCORE_SAVE_PLAN_GLOBAL",
    "LegacyMCoreSavePlan",
    "allowed_metadata_globals",
    "is_allowed_metadata_global",
    "load_metadata",
    "object_loader",
    "safe_torch_load",
]
