"""Differentiable all-to-all over a process group: communication only, no attention logic.

Legend: ``P`` ranks in the group; a tensor's *scatter dim* is split into ``P`` chunks, chunk ``j``
going to rank ``j``; the chunks received are concatenated, in rank order, along the *gather dim*.

    x[..., n_scatter, ..., m_gather, ...]  ->  y[..., n_scatter / P, ..., m_gather * P, ...]

Several tensors that share the group and the dims can travel in one collective (``all_to_all`` with
a list): each rank packs, per destination, the chunks of every tensor into one buffer, so q, k and v
move with one launch and the same bytes as three.

The backward of an all-to-all is the all-to-all with scatter and gather dims swapped, so forward and
backward are one ``all_to_all_single`` each, on every backend (NCCL and gloo alike). Only the
public ``torch.distributed.all_to_all_single`` is used.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["all_to_all"]


def _pack(xs: Sequence[torch.Tensor], scatter_dim: int, P: int) -> torch.Tensor:
    """Per destination rank, the chunks of every tensor: a contiguous ``[P, total / P]`` buffer."""
    parts = []
    for x in xs:
        n = x.shape[scatter_dim]
        split = x.reshape(*x.shape[:scatter_dim], P, n // P, *x.shape[scatter_dim + 1 :])
        parts.append(split.movedim(scatter_dim, 0).reshape(P, -1))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].contiguous()


def _unpack(
    buf: torch.Tensor, shapes: Sequence[torch.Size], scatter_dim: int, gather_dim: int, P: int
) -> list[torch.Tensor]:
    """Inverse of the exchange: ``buf[j]`` came from rank ``j``; slot ``j`` of gather dim."""
    out = []
    # Each source rank sent tensors with its input's shape, scatter dim cut to 1/P.
    chunk_shapes = []
    for s in shapes:
        cs = list(s)
        cs[scatter_dim] //= P
        chunk_shapes.append(cs)
    sizes = [int(torch.Size(cs).numel()) for cs in chunk_shapes]
    for piece, cs in zip(buf.split(sizes, dim=1), chunk_shapes):
        y = piece.reshape(P, *cs).movedim(0, gather_dim)  # [..., P, m, ...] at gather dim
        cs_out = list(cs)
        cs_out[gather_dim] *= P
        out.append(y.reshape(cs_out))
    return out


def _exchange(
    xs: Sequence[torch.Tensor], scatter_dim: int, gather_dim: int, group: dist.ProcessGroup
) -> list[torch.Tensor]:
    P = dist.get_world_size(group)
    send = _pack(xs, scatter_dim, P)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return _unpack(recv, [x.shape for x in xs], scatter_dim, gather_dim, P)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scatter_dim, gather_dim, group, *xs):  # type: ignore[override]
        ctx.dims = (scatter_dim, gather_dim)
        ctx.group = group
        return tuple(_exchange(xs, scatter_dim, gather_dim, group))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        scatter_dim, gather_dim = ctx.dims
        grads = [g.contiguous() for g in grads]
        return (None, None, None, *_exchange(grads, gather_dim, scatter_dim, ctx.group))


def all_to_all(
    xs: torch.Tensor | Sequence[torch.Tensor],
    *,
    scatter_dim: int,
    gather_dim: int,
    group: dist.ProcessGroup,
) -> torch.Tensor | list[torch.Tensor]:
    """All-to-all of one tensor or several tensors in a single collective, differentiable.

    Args:
        xs: a tensor, or a sequence of tensors of one dtype and device with the same rank, whose
            ``scatter_dim`` sizes are divisible by the group size.
        scatter_dim: dim cut into ``P`` chunks, chunk ``j`` sent to rank ``j``.
        gather_dim: dim along which the received chunks are concatenated in rank order.
        group: the process group (e.g. ``mesh.get_group("sp")``).

    Returns:
        The exchanged tensor (or a list, if ``xs`` was a sequence). Forward issues exactly one
        ``all_to_all_single`` (none when the group has one rank); backward issues exactly one.
    """
    single = isinstance(xs, torch.Tensor)
    tensors = [xs] if single else list(xs)
    ndim = tensors[0].dim()
    for d, name in ((scatter_dim, "scatter_dim"), (gather_dim, "gather_dim")):
        if not 0 <= d < ndim:
            raise ValueError(f"{name}={d} is out of range for {ndim}-D tensors; use 0..{ndim - 1}")
    if scatter_dim == gather_dim:
        raise ValueError(f"scatter_dim and gather_dim are both {scatter_dim}; they must differ")
    P = dist.get_world_size(group)
    for i, t in enumerate(tensors):
        if t.dim() != ndim or t.dtype != tensors[0].dtype or t.device != tensors[0].device:
            raise ValueError(
                f"tensor {i} is {t.dim()}-D {t.dtype} on {t.device}, tensor 0 is "
                f"{ndim}-D {tensors[0].dtype} on {tensors[0].device}; fused tensors must match"
            )
        if t.shape[scatter_dim] % P:
            raise ValueError(
                f"tensor {i}: dim {scatter_dim} has size {t.shape[scatter_dim]}, not divisible "
                f"by the group size {P}"
            )
    if P == 1:
        return xs if single else tensors
    out = _AllToAll.apply(scatter_dim, gather_dim, group, *tensors)
    return out[0] if single else list(out)
