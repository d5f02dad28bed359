"""The interface a local checkpoint manager expects of a state dict, with or without
nvidia-resiliency-ext.

:data:`TensorAwareStateDict` is nvidia-resiliency-ext's base class when that
package is installed (so its checkpoint managers accept our objects), and
:class:`TensorAwareStateDictBase`, the same interface defined here, when it is
not (so :mod:`dist_checkpointing.tensor_aware_state_dict` always imports).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, ValuesView
from typing import TYPE_CHECKING, Any

import torch

NVRX_INSTALL_HINT = (
    'install nvidia-resiliency-ext: pip install "dist_checkpointing[nvrx]" '
    "(or pip install nvidia-resiliency-ext)"
)


class TensorAwareStateDictBase(ABC):
    """nvidia-resiliency-ext's ``TensorAwareStateDict`` interface, for use without it.

    A checkpoint manager calls, on every rank: (1) ``copy_tensors_to_cpu()``
    before saving; (2) when replicating to another rank, ``pop_tensors()``,
    sends the hollow object and the tensors, then ``insert_tensors()``; the
    receiving rank calls ``init_tensors()`` and fills ``tensors`` in place;
    (3) after loading, ``restore_tensor_device()``.
    """

    @abstractmethod
    def pop_tensors(self) -> list[torch.Tensor]:
        """Take the tensors out, keeping what is needed to recreate them (hollow afterwards)."""

    @property
    @abstractmethod
    def tensors(self) -> Iterator[torch.Tensor]:
        """The tensors held (not hollow)."""

    @property
    @abstractmethod
    def is_hollow(self) -> bool:
        """True between ``pop_tensors`` and ``insert_tensors`` / ``init_tensors``."""

    @abstractmethod
    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        """Put back the tensors ``pop_tensors`` returned (in the same order)."""

    @abstractmethod
    def init_tensors(self) -> None:
        """Allocate empty tensors where the popped ones were (same shape, dtype, device)."""

    @abstractmethod
    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replace the tensors by CPU copies, remembering their devices."""

    @abstractmethod
    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Move the tensors back to the devices ``copy_tensors_to_cpu`` remembered."""

    def values(self) -> ValuesView[Any]:
        """The object's attributes' values."""
        return vars(self).values()


def nvrx_base_class() -> type | None:
    """nvidia-resiliency-ext's ``TensorAwareStateDict``, or None when it is not installed."""
    try:
        module = importlib.import_module(
            "nvidia_resiliency_ext.checkpointing.local.base_state_dict"
        )
    except ImportError:
        return None
    base: type = module.TensorAwareStateDict
    return base


if TYPE_CHECKING:
    TensorAwareStateDict = TensorAwareStateDictBase
else:
    TensorAwareStateDict = nvrx_base_class() or TensorAwareStateDictBase

HAVE_NVRX: bool = TensorAwareStateDict is not TensorAwareStateDictBase


__all__ = [
    "HAVE_NVRX",
    "NVRX_INSTALL_HINT",
    "TensorAwareStateDict",
    "TensorAwareStateDictBase",
    "nvrx_base_class",
]
