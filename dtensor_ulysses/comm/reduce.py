"""A sum over a process group whose gradient passes through unchanged: communication only.

Legend: ``x`` any tensor; ``P`` ranks in the group; ``L`` a loss.

Sequence-level losses (DPO, KTO, RL) are non-linear in sums over a whole row, and each rank of
an sp group holds one slice of the row. Each rank computes its part ``x_r`` (e.g. the label
log-probabilities of its tokens), :func:`all_reduce_sum` gives every rank the same total
``X = sum_r x_r``, and every rank then computes the *same* loss ``L(X)``.

Backward: the gradient of ``X`` passes to ``x_r`` unchanged (no collective). Why that is the
right scaling: rank ``r`` then back-propagates ``dL/dX * dx_r/dtheta`` through its own graph (its
tokens, and through the attention all-to-alls the other ranks' activations), and FSDP2 *sums*
the gradients of the ranks, so the parameters get ``dL/dX * sum_r dx_r/dtheta = dL/dtheta``:
the gradient of one process. The adjoint of a sum (an all-reduce of the gradients) would be
the gradient of ``sum_r L(X) = P * L``: ``P`` times too large. The rule holds only when every
rank of the group computes the same loss from ``X`` (and counts it once); anything else must
use the adjoint.

Bytes per rank per call: forward one ``all_reduce`` of ``x`` (``numel * element_size``);
backward none.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_reduce_sum"]


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.detach().clone().contiguous()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        return g, None


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``sum_r x_r`` over ``group`` on every rank; the gradient passes to ``x`` unchanged (see
    the module docstring: every rank must compute the same loss from the sum). A group of one
    rank (or ``None`` without a process group) returns ``x``."""
    if group is None and not dist.is_initialized():
        return x
    if dist.get_world_size(group) == 1:
        return x
    out = _AllReduceSum.apply(x, group)
    assert isinstance(out, torch.Tensor)
    return out
