"""The staging step of a save: which tensors must reach host memory before the write.

A save writes from host memory. Its request's staging step (``AsyncRequest.preload_fn``)
names the tensors that must be copied there first — accelerator tensors, and tensors the
writer cannot take as they are — as *slots*: places in the save's own structures where a
tensor sits and where its host copy goes. Each layout has its own structures (the
``torch_dist`` write buckets, the ``raw_bytes`` per-file item lists); the slots let one
copier serve them all:

- :meth:`StagingStep.__call__` copies into pinned memory (freshly allocated, through
  torch's caching host allocator), one asynchronous copy per tensor on a side stream per
  device and one wait per device at the end (:func:`stage_slots`);
- an async caller that keeps its own snapshot memory (the persistent caller's
  :class:`~dist_checkpointing.engine.async_save.snapshot.SnapshotArena`) copies the same
  slots into that memory instead, then takes :meth:`StagingStep.result`.

Call sequence (the saving process, once per save): the layout builds the step with its
request; then exactly one of ``step()`` or ``[copier over step.slots()]`` followed by
``step.result()``; then the write, from the structures the step filled.

A step built ``deferred`` (a synchronous save with a copy-ahead budget) copies only the
host tensors its writer cannot take as they are (:meth:`StagingStep.host_copies`): its
writer streams accelerator tensors through the staging pool while it writes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from .staging_pool import pinning_available


@dataclass(frozen=True)
class TensorSlot:
    """Where a tensor to stage sits: ``container[index][position]`` (a tuple in a list).

    ``required``: the writer cannot take the tensor as it is even on the host (a
    non-contiguous one for a layout that writes raw memory): it is copied whatever the
    caller's policy for host tensors.
    """

    container: list[Any]
    index: int
    position: int
    required: bool = False

    def get(self) -> torch.Tensor:
        value: torch.Tensor = self.container[self.index][self.position]
        return value

    def put(self, tensor: torch.Tensor) -> None:
        entry = self.container[self.index]
        self.container[self.index] = entry[: self.position] + (tensor,) + entry[self.position + 1 :]


class StagingStep(ABC):
    """An async request's staging step (``preload_fn``); picklable. See the module
    docstring for the call sequence."""

    deferred: bool = False

    @abstractmethod
    def slots(self) -> list[TensorSlot]:
        """The tensors that are not on the host, and those the writer cannot take as
        they are (``required``); host tensors the writer takes may be listed too (an
        async caller that snapshots host tensors copies them)."""

    def host_copies(self) -> list[TensorSlot]:
        """The host tensors the writer cannot take as they are (the ``required`` slots on
        the host): a deferred step copies these still (the writer streams only
        accelerator tensors). A layout may list them faster than this filter does."""
        return [s for s in self.slots() if s.required and s.get().is_cpu]

    def result(self) -> Any:
        """What the step returns once staged (replaces ``async_fn_args[1]``; None:
        the arguments stay as they are)."""
        return None

    def __call__(self) -> Any:
        stage_slots(self.host_copies() if self.deferred else self.slots())
        return self.result()


def _needs_copy(slot: TensorSlot, tensor: torch.Tensor) -> bool:
    return not tensor.is_cpu or slot.required


def stage_slots(slots: list[TensorSlot]) -> None:
    """Copy the accelerator tensors of ``slots`` (and the ``required`` ones) to host
    memory and put the copies in their place; returns once every copy is complete.

    CUDA tensors go to pinned memory with one asynchronous copy each on a side stream
    per device (which first waits for the current stream: what was computed is
    copied); each side stream is waited for once, at the end.
    """
    streams: dict[torch.device, Any] = {}
    pin = None
    for slot in slots:
        tensor = slot.get()
        if not _needs_copy(slot, tensor):
            continue
        if tensor.device.type != "cuda":
            slot.put(tensor.to("cpu").contiguous())
            continue
        if pin is None:
            pin = pinning_available()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
        copy_to_host(host, tensor, streams)
        slot.put(host)
    for stream in streams.values():
        stream.synchronize()


def copy_to_host(dst: torch.Tensor, src: torch.Tensor, streams: dict[torch.device, Any]) -> None:
    """Start the copy of ``src`` into host tensor ``dst``: from CUDA, asynchronously on
    the side stream of ``src``'s device in ``streams`` (created on first use, after
    waiting for the current stream); from anywhere else, at once. The caller
    synchronizes every stream of ``streams`` before using ``dst``."""
    if not src.is_cuda:  # (the property: ``device.type`` builds a device per call)
        dst.copy_(src)
        return
    stream = streams.get(src.device)
    if stream is None:
        stream = streams[src.device] = torch.cuda.Stream(src.device)
        stream.wait_stream(torch.cuda.current_stream(src.device))
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)


__all__ = ["StagingStep", "TensorSlot", "copy_to_host", "stage_slots"]
