"""Head-chunked Ulysses (UPipe): the attention layer in ``C`` stages of q heads.

Legend: ``B`` batch, ``s`` this rank's tokens, ``S`` all tokens, ``P`` the sp degree, ``C``
stages, ``m`` q heads per rank per stage, ``H`` head dim. The q slice ``q[B, s, N, H]`` is viewed
as ``q[B, s, P, C, m, H]``: stage ``c`` sends ``q[:, :, r, c]`` to rank ``r``.

Per stage, forward: ``q_c[B, s, P*m, H] -> q[B, S, m, H]`` (all-to-all), attend with the kv heads
those q heads use (exchanged once, before the stages), ``o[B, S, m, H] -> o_c[B, s, P*m, H]``
(all-to-all), written into the preallocated output. Nothing of a stage is kept: the function
saves only its inputs (``q`` and the exchanged ``k``, ``v``).

Per stage, backward: the q all-to-all again (the recompute), the all-to-all of ``d o`` (the
adjoint of o's: the same exchange as q's), attention forward and backward, and the all-to-all of
``d q``, written into one preallocated ``[B, s, N, H]`` gradient; ``d k``, ``d v`` are summed
over the stages that use them. Checkpointing each stage instead gives the same values and bytes,
but the gradient of each ``q[:, :, :, c]`` slice becomes a full-size zero-padded tensor that
autograd sums: three or four ``[B, s, N, H]`` tensors at once, the peak of a million-token
backward. That checkpointed form is kept for ``torch.compile`` (dynamo does not trace a backward
that calls ``torch.autograd.grad``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["run_head_stages"]

Exchange = Callable[[torch.Tensor], torch.Tensor]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _stage_q(q_BsPCmH: torch.Tensor, c: int) -> torch.Tensor:
    B, s, P, _, m, H = q_BsPCmH.shape
    return q_BsPCmH[:, :, :, c].reshape(B, s, P * m, H)


class _HeadStages(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BsPCmH, k_BSkH, v_BSkH, kv_ranges, to_heads, attend, to_seq):
        B, s, P, C, m, H = q_BsPCmH.shape
        o_BsPCmH = q_BsPCmH.new_empty(B, s, P, C, m, H)
        for c, (lo, hi) in enumerate(kv_ranges):
            q_BSmH = to_heads(_stage_q(q_BsPCmH, c))
            o_BSmH = attend(q_BSmH, k_BSkH[:, :, lo:hi], v_BSkH[:, :, lo:hi])
            o_BsPCmH[:, :, :, c] = to_seq(o_BSmH).view(B, s, P, m, H)
        ctx.save_for_backward(q_BsPCmH, k_BSkH, v_BSkH)
        ctx.fns = (kv_ranges, to_heads, attend)
        return o_BsPCmH

    @staticmethod
    def backward(ctx, do_BsPCmH):
        q_BsPCmH, k_BSkH, v_BSkH = ctx.saved_tensors
        kv_ranges, to_heads, attend = ctx.fns
        B, s, P, C, m, H = q_BsPCmH.shape
        dq_BsPCmH = torch.empty_like(q_BsPCmH)
        dk_BSkH, dv_BSkH = torch.zeros_like(k_BSkH), torch.zeros_like(v_BSkH)
        for c, (lo, hi) in enumerate(kv_ranges):
            q_c = _stage_q(q_BsPCmH, c).requires_grad_()
            k_c = k_BSkH[:, :, lo:hi].detach().requires_grad_()
            v_c = v_BSkH[:, :, lo:hi].detach().requires_grad_()
            with torch.enable_grad():
                o_BSmH = attend(to_heads(q_c), k_c, v_c)  # recompute: q's all-to-all again
            do_BSmH = to_heads(_stage_q(do_BsPCmH, c))  # d o to heads: adjoint of o's exchange
            dq_c, dk_c, dv_c = torch.autograd.grad(o_BSmH, (q_c, k_c, v_c), do_BSmH)
            dq_BsPCmH[:, :, :, c] = dq_c.view(B, s, P, m, H)  # d q came back by all-to-all
            dk_BSkH[:, :, lo:hi] += dk_c
            dv_BSkH[:, :, lo:hi] += dv_c
            del q_c, k_c, v_c, o_BSmH, do_BSmH, dq_c, dk_c, dv_c  # one stage alive at a time
        return dq_BsPCmH, dk_BSkH, dv_BSkH, None, None, None, None


def run_head_stages(
    q_BsPCmH: torch.Tensor,
    k_BSkH: torch.Tensor,
    v_BSkH: torch.Tensor,
    kv_ranges: Sequence[tuple[int, int]],
    *,
    to_heads: Exchange,
    attend: Attend,
    to_seq: Exchange,
) -> torch.Tensor:
    """``o[B, s, P, C, m, H]`` from ``q[B, s, P, C, m, H]`` and the exchanged ``k, v[B, S, k, H]``.

    Args:
        kv_ranges: per stage, the local kv heads ``[lo, hi)`` its q heads use.
        to_heads: ``x[B, s, P*m, H] -> x[B, S, m, H]`` (one all-to-all).
        attend: the kernel on ``q[B, S, m, H]`` and that stage's ``k, v``.
        to_seq: ``o[B, S, m, H] -> o[B, s, P*m, H]`` (the inverse all-to-all).
    """
    if len(kv_ranges) != q_BsPCmH.shape[3]:
        raise ValueError(f"{len(kv_ranges)} kv ranges for {q_BsPCmH.shape[3]} stages")
    if not torch.compiler.is_compiling():
        fns = (tuple(kv_ranges), to_heads, attend, to_seq)
        return _HeadStages.apply(q_BsPCmH, k_BSkH, v_BSkH, *fns)

    def stage(q_c, k, v, lo, hi):
        return to_seq(attend(to_heads(q_c), k[:, :, lo:hi], v[:, :, lo:hi]))

    B, s, P, _, m, H = q_BsPCmH.shape
    o_BsPCmH = q_BsPCmH.new_empty(q_BsPCmH.shape)
    for c, (lo, hi) in enumerate(kv_ranges):
        q_c = _stage_q(q_BsPCmH, c)
        if torch.is_grad_enabled():
            o_c = checkpoint(stage, q_c, k_BSkH, v_BSkH, lo, hi, use_reentrant=False)
        else:
            o_c = stage(q_c, k_BSkH, v_BSkH, lo, hi)
        o_BsPCmH[:, :, :, c] = o_c.view(B, s, P, m, H)
    return o_BsPCmH
