"""Differentiable all-gather of sequence slices: communication only.

Legend: ``P`` ranks in the group, ``B`` batch, ``s`` this rank's tokens (``seq_sizes[rank]``),
``S`` all tokens, ``m = max(seq_sizes)``, ``C`` channels per token.

    x[B, s, C] on each rank  --all-gather-->  x[B, S, C] on every rank (the slices in rank order)

Forward is one ``all_gather_into_tensor`` of ``[B, m, C]`` (each slice padded to the longest,
so uneven slices travel in one collective); backward is its adjoint, one
``reduce_scatter_tensor`` of the ``[P, B, m, C]`` gradient (summed over the ranks, each rank
keeping its own slice's rows). Bytes per rank (the buffer it passes in, ``e`` bytes per
element): forward ``B*m*C*e``, backward ``P*B*m*C*e``.

Multi-head latent attention gathers its compressed key-value latent with it
(:mod:`dtensor_ulysses.hf.models.latent_attention`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["all_gather_seq", "all_gather_seq_bytes"]


def all_gather_seq_bytes(B: int, seq_sizes: Sequence[int], channels: int, elem_bytes: int):
    """``(forward, backward)`` bytes one rank passes into :func:`all_gather_seq`'s two
    collectives for ``[B, s, channels]`` slices of ``seq_sizes``."""
    m = max(seq_sizes)
    return B * m * channels * elem_bytes, len(seq_sizes) * B * m * channels * elem_bytes


class _AllGatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BsC, group, seq_sizes):
        P, me = dist.get_world_size(group), dist.get_rank(group)
        B, s, C = x_BsC.shape
        m = max(seq_sizes)
        send_BmC = F.pad(x_BsC, (0, 0, 0, m - s)).contiguous()
        recv_PBmC = x_BsC.new_empty(P * B, m, C)  # gathered along dim 0 (what gloo takes)
        dist.all_gather_into_tensor(recv_PBmC, send_BmC, group=group)
        recv_PBmC = recv_PBmC.view(P, B, m, C)
        ctx.group, ctx.seq_sizes, ctx.me = group, tuple(seq_sizes), me
        return torch.cat([recv_PBmC[r, :, :n] for r, n in enumerate(seq_sizes)], dim=1)

    @staticmethod
    def backward(ctx, dx_BSC):
        sizes, m = ctx.seq_sizes, max(ctx.seq_sizes)
        B, _, C = dx_BSC.shape
        send_PBmC = dx_BSC.new_zeros(len(sizes), B, m, C)
        lo = 0
        for r, n in enumerate(sizes):
            send_PBmC[r, :, :n] = dx_BSC[:, lo : lo + n]
            lo += n
        recv_BmC = dx_BSC.new_empty(B, m, C)
        dist.reduce_scatter_tensor(recv_BmC, send_PBmC.view(-1, m, C), group=ctx.group)
        return recv_BmC[:, : sizes[ctx.me]], None, None


def all_gather_seq(
    x_BsC: torch.Tensor, group: dist.ProcessGroup, seq_sizes: Sequence[int]
) -> torch.Tensor:
    """``x[B, s, C]`` of every rank -> ``x[B, S, C]`` on each (differentiable; see the module
    docstring for the collectives and their bytes).

    Raises:
        ValueError: ``x`` is not 3-D, or its length is not this rank's ``seq_sizes`` entry.
    """
    P, me = dist.get_world_size(group), dist.get_rank(group)
    if x_BsC.dim() != 3:
        raise ValueError(f"all_gather_seq takes [B, s, C], got shape {tuple(x_BsC.shape)}")
    if len(seq_sizes) != P or seq_sizes[me] != x_BsC.shape[1]:
        raise ValueError(
            f"rank {me} holds {x_BsC.shape[1]} tokens but seq_sizes={list(seq_sizes)} gives "
            f"{seq_sizes[me] if me < len(seq_sizes) else 'none'} for {P} ranks"
        )
    if P == 1:
        return x_BsC
    out = _AllGatherSeq.apply(x_BsC, group, list(seq_sizes))
    assert isinstance(out, torch.Tensor)
    return out
