"""What a live Megatron-Core needs to run on this machine: stand-ins for the calls it
makes that a CPU-only torch or NumPy 2 lacks. Used by the benchmark table's ``megatron``
row and by ``tests/compat/test_megatron_live.py``; nothing here changes how our library
or Megatron-Core store or read a checkpoint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


@contextlib.contextmanager
def stand_ins() -> Iterator[None]:
    """While Megatron-Core runs:

    - without CUDA, ``torch.cuda.synchronize()`` (its save calls it before staging, even
      for CPU state) does nothing, and ``torch.cuda.current_device()`` (where it puts the
      failure flag it broadcasts) is the CPU;
    - without ``numpy.product`` (NumPy 2 removed it; 0.13 calls it for flat ranges), it is
      ``numpy.prod``.

    Everything is put back on exit, also when the call raises."""
    saved = torch.cuda.synchronize, torch.cuda.current_device
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    no_product = not hasattr(np, "product")
    if no_product:
        np.product = np.prod  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved
        if no_product:
            del np.product  # type: ignore[attr-defined]


__all__ = ["stand_ins"]
