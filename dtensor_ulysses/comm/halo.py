"""Halo exchange: each rank of a group receives the previous rank's last ``k`` sequence positions.

Communication only (what a short causal convolution does with the halo lives with the
mixer, :mod:`dtensor_ulysses.hf.models.mixers.short_conv`). Legend: ``B`` batch, ``s`` this rank's
sequence slice, ``C`` channels, ``k`` halo width (a kernel of width ``W`` needs ``k = W - 1``).

Forward: rank ``i`` sends ``x[:, s-k:]`` to rank ``i + 1`` and receives rank ``i - 1``'s; rank 0
receives nothing and gets zeros (the convolution's own zero padding at the row start). Backward:
the gradient of the received halo goes back to the rank it came from and is added to the
gradient of its last ``k`` positions. No wrap-around: the last rank sends nothing forward and
rank 0 nothing backward. One batched send/receive per direction (``dist.batch_isend_irecv``).

Bytes per rank and call (``e`` bytes per element): forward ``B*k*C*e`` sent by every rank but the
last; backward the same by every rank but the first (:func:`halo_bytes`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["halo_bytes", "halo_exchange"]


def halo_bytes(B: int, k: int, channels: int, elem_bytes: int, rank: int, P: int) -> dict:
    """Bytes rank ``rank`` of ``P`` sends in one :func:`halo_exchange` of ``x[B, s, channels]``.

    Returns:
        ``{"forward": f, "backward": b}`` (0 where the rank sends nothing).
    """
    one = B * k * channels * elem_bytes
    return {"forward": one if rank < P - 1 else 0, "backward": one if rank > 0 else 0}


def _shift(send: torch.Tensor | None, like: torch.Tensor, group, to_next: bool) -> torch.Tensor:
    """Send ``send`` one rank forward (``to_next``) or back; receive a tensor shaped ``like``
    from the other side (zeros where no rank sends)."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    dst, src = (me + 1, me - 1) if to_next else (me - 1, me + 1)
    recv = like.new_zeros(like.shape)  # contiguous, whatever the strides of `like`
    ops = []
    if send is not None and 0 <= dst < P:
        peer = dist.get_global_rank(group, dst)
        ops.append(dist.P2POp(dist.isend, send.contiguous(), peer, group))
    if 0 <= src < P:
        ops.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, src), group))
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    return recv


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BsC: torch.Tensor, k: int, group) -> torch.Tensor:
        ctx.k, ctx.group, ctx.shape = k, group, x_BsC.shape
        B, _, C = x_BsC.shape
        like = x_BsC.new_empty(B, k, C)
        return _shift(x_BsC[:, -k:], like, group, to_next=True)

    @staticmethod
    def backward(ctx, g_BkC: torch.Tensor):
        back = _shift(g_BkC, g_BkC, ctx.group, to_next=False)
        g_BsC = g_BkC.new_zeros(ctx.shape)
        g_BsC[:, -ctx.k :] = back
        return g_BsC, None, None


def halo_exchange(x_BsC: torch.Tensor, k: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The previous rank's last ``k`` positions, ``[B, k, C]`` (zeros on rank 0); differentiable.

    Every rank's slice must hold at least ``k`` positions (the caller checks, naming the numbers).
    """
    if x_BsC.shape[1] < k:
        raise ValueError(
            f"a halo of {k} positions needs at least {k} per rank; this rank holds "
            f"{x_BsC.shape[1]} (shorten the kernel or lengthen the sequence per rank)"
        )
    out = _Halo.apply(x_BsC, k, group)
    assert isinstance(out, torch.Tensor)
    return out
