"""Ring point-to-point: pass a buffer to the next rank of a group, receive the previous rank's.

Communication only (the ring attention math is in :mod:`dtensor_ulysses.attention.ring`). One
call posts one batched send and one batched receive (``dist.batch_isend_irecv`` with ``P2POp``;
gloo and NCCL both take it) and returns at once, so the caller computes while the bytes move
and waits afterwards. Ring rank ``i`` sends to ``i + 1`` and receives from ``i - 1`` (mod the
group size).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["RingShift", "ring_shift"]


class RingShift:
    """A posted exchange: ``wait()`` blocks until the send has left and ``recv`` has arrived."""

    def __init__(self, recv: torch.Tensor, works: list) -> None:
        self.recv = recv
        self._works = works

    def wait(self) -> torch.Tensor:
        for w in self._works:
            w.wait()
        self._works = []
        return self.recv


def ring_shift(send: torch.Tensor, group: dist.ProcessGroup, tag: int = 0) -> RingShift:
    """Post ``send`` to the next ring rank and a receive of the same shape from the previous one.

    ``send`` must stay unmodified until :meth:`RingShift.wait` returns. ``tag`` keeps exchanges
    that are in flight at the same time apart (gloo matches on it; NCCL orders them as posted).
    """
    size, me = dist.get_world_size(group), dist.get_rank(group)
    recv = torch.empty_like(send)
    nxt = dist.get_global_rank(group, (me + 1) % size)
    prv = dist.get_global_rank(group, (me - 1) % size)
    ops = [
        dist.P2POp(dist.isend, send, nxt, group, tag),
        dist.P2POp(dist.irecv, recv, prv, group, tag),
    ]
    return RingShift(recv, list(dist.batch_isend_irecv(ops)))
