"""The ranks that save or load together, and one rule for failing together.

Every collective of the library goes through a :class:`RankGroup`: an explicit
process group (default: the world) with a coordinator, so the library works
inside a subgroup. Outside ``torch.distributed`` (or with one rank) every call
degrades to its single-process meaning, so the same code runs in unit tests.

The rule for failing together (:meth:`RankGroup.fail_together`): each rank
catches what its step raised, then one all-reduce tells every rank whether
any rank failed. If one did, the failing ranks raise their own exception and
every other rank raises :class:`RankFailureError` naming each failing rank and
its cause. No rank is ever left waiting in the next collective.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import RankFailureError

ProcessGroup = dist.ProcessGroup | None


def dist_active() -> bool:
    """Whether ``torch.distributed`` is available and initialized."""
    return dist.is_available() and dist.is_initialized()


def describe_error(error: BaseException) -> str:
    """``"TypeName: message"``, the form in which a rank reports its error to others."""
    return f"{type(error).__name__}: {error}"


def format_failures(failures: dict[int, str], separator: str = "\n") -> str:
    """One line per failing rank, in rank order."""
    return separator.join(f"rank {rank}: {failures[rank]}" for rank in sorted(failures))


@dataclass(frozen=True)
class RankGroup:
    """A process group and its coordinator (a rank within the group, default 0).

    Collective methods must be called by every rank of the group, in the same
    order; each says which ranks receive what.
    """

    group: ProcessGroup = None
    coordinator: int = 0
    rank: int = field(init=False)
    world: int = field(init=False)

    def __post_init__(self) -> None:
        active = dist_active()
        object.__setattr__(self, "rank", dist.get_rank(self.group) if active else 0)
        object.__setattr__(self, "world", dist.get_world_size(self.group) if active else 1)

    @property
    def distributed(self) -> bool:
        """Whether collectives are needed (more than one rank)."""
        return self.world > 1

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.coordinator

    def global_rank(self, group_rank: int | None = None) -> int:
        """The global rank of ``group_rank`` (default: this rank)."""
        if group_rank is None:
            group_rank = self.rank
        if self.group is None or not dist_active():
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    @property
    def members(self) -> tuple[int, ...]:
        """The global ranks of the group, in group-rank order."""
        if self.group is None or not dist_active():
            return tuple(range(self.world))
        return tuple(dist.get_process_group_ranks(self.group))

    @property
    def coordinator_global_rank(self) -> int:
        """The coordinator's global rank (the ``src``/``dst`` of collectives)."""
        return self.global_rank(self.coordinator)

    @property
    def device(self) -> torch.device:
        """Where tensors for this group's collectives live (CUDA for NCCL, else CPU)."""
        if not dist_active():
            return torch.device("cpu")
        if dist.get_backend(self.group) == dist.Backend.NCCL:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ------------------------------------------------------------------ collectives

    def all_reduce_ints(
        self, values: Sequence[int], op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> list[int]:
        """Every rank gets the element-wise reduction of ``values`` (one all-reduce)."""
        if not self.distributed:
            return [int(v) for v in values]
        t = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=op, group=self.group)
        return [int(v) for v in t.tolist()]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank gets every rank's ``obj``, in group-rank order."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        """The coordinator gets every rank's ``obj``; the others get None.

        The coordinator's own entry is ``obj`` itself, not a pickled copy:
        ``gather_object`` would pickle and unpickle it, so that the coordinator of a save
        of 100,000 tensors held its write results twice (about 45 MiB)."""
        if not self.distributed:
            return [obj]
        if not self.is_coordinator:
            dist.gather_object(obj, None, dst=self.coordinator_global_rank, group=self.group)
            return None
        out: list[Any] = [None] * self.world
        dist.gather_object(None, out, dst=self.coordinator_global_rank, group=self.group)
        out[self.rank] = obj
        return out

    def scatter(self, objs: Sequence[Any] | None) -> Any:
        """Rank ``r`` gets ``objs[r]`` (``objs`` is read on the coordinator only)."""
        if not self.distributed:
            if objs is None:
                raise ValueError("scatter needs the objects on the coordinator")
            return objs[0]
        out: list[Any] = [None]
        dist.scatter_object_list(
            out,
            list(objs) if self.is_coordinator and objs is not None else None,
            src=self.coordinator_global_rank,
            group=self.group,
        )
        return out[0]

    def all_to_all(self, objs: Sequence[Any]) -> list[Any]:
        """Rank ``r`` gets ``objs[r]`` of every rank, in group-rank order (two
        ``all_to_all_single``: the payload sizes, then the pickled payloads). Each rank
        sends and receives only its own payloads, unlike an all-gather."""
        if len(objs) != self.world:
            raise ValueError(
                f"all_to_all needs one object per rank ({self.world}), got {len(objs)}"
            )
        if not self.distributed:
            return [objs[0]]
        payloads = [pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL) for o in objs]
        send_sizes = [len(p) for p in payloads]
        sizes = torch.tensor(send_sizes, dtype=torch.int64, device=self.device)
        recv_sizes_t = torch.empty_like(sizes)
        dist.all_to_all_single(recv_sizes_t, sizes, group=self.group)
        recv_sizes = [int(n) for n in recv_sizes_t.tolist()]
        blob = b"".join(payloads)
        send = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0)
        send = send.to(dtype=torch.uint8, device=self.device)
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=self.device)
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=self.group)
        data = recv.cpu().numpy().tobytes()
        out, pos = [], 0
        for n in recv_sizes:
            out.append(
                pickle.loads(data[pos : pos + n])
            )  # peers of the group, as in all_gather_object
            pos += n
        return out

    def broadcast(self, obj: Any) -> Any:
        """Every rank gets the coordinator's ``obj``."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.coordinator_global_rank, group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    # ------------------------------------------------------------------ failing together

    def gather_failures(self, error: str | None) -> dict[int, str]:
        """``{global rank: cause}`` of every rank whose ``error`` is not None (all ranks
        get it; one all-gather). Call only once ranks know that some rank failed."""
        mine = (self.global_rank(), error)
        return {rank: cause for rank, cause in self.all_gather(mine) if cause is not None}

    def fail_together(
        self,
        error: BaseException | None,
        what: str = "operation",
        flags: Sequence[int] = (),
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    ) -> list[int]:
        """Raise on every rank if any rank passed an error; else return ``flags``
        reduced by ``op`` (``SUM`` or ``MAX``).

        One all-reduce of ``[error?, *flags]``; only when some rank failed, one
        all-gather of the causes follows. A failing rank re-raises ``error``;
        every other rank raises :class:`RankFailureError` naming each failing
        rank and its cause. Every rank passes as many ``flags``.
        """
        summed = self.all_reduce_ints([0 if error is None else 1, *flags], op)
        if summed[0] == 0:
            return summed[1:]
        if not self.distributed:
            assert error is not None
            raise error
        failures = self.gather_failures(None if error is None else describe_error(error))
        if error is not None:
            raise error
        raise RankFailureError(
            f"{what} failed on other rank(s):\n{format_failures(failures)}", failures
        )


def equal_ballot(values: Sequence[int]) -> list[int]:
    """Ints to all-reduce with ``MAX`` (alone, or among others) that tell every rank
    whether every rank passed the same ``values``: each value, then each negated (the
    largest of a negation is the smallest value; see :func:`all_equal`)."""
    return [*values, *(-v for v in values)]


def all_equal(reduced: Sequence[int]) -> bool:
    """Whether the ``MAX`` of every rank's :func:`equal_ballot` shows that every rank
    passed the same values (in each slot the largest is the smallest)."""
    half = len(reduced) // 2
    return list(reduced[:half]) == [-v for v in reduced[half:]]


def raise_on_all_ranks(
    local_error: BaseException | None,
    process_group: ProcessGroup = None,
    what: str = "operation",
) -> None:
    """:meth:`RankGroup.fail_together` for ``process_group`` (every rank calls it)."""
    RankGroup(process_group).fail_together(local_error, what)


__all__ = [
    "ProcessGroup",
    "RankGroup",
    "all_equal",
    "describe_error",
    "dist_active",
    "equal_ballot",
    "format_failures",
    "raise_on_all_ranks",
]
