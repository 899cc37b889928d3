"""Head-chunked Ulysses (UPipe): the attention layer in ``C`` stages of q heads.

Legend: ``B`` batch, ``s`` this rank's tokens, ``S`` all tokens, ``P`` the sp degree, ``C``
stages, ``m`` q heads per rank per stage, ``H`` head dim. The q slice ``q[B, s, N, H]`` is viewed
as ``q[B, s, P, C, m, H]``: stage ``c`` sends ``q[:, :, r, c]`` to rank ``r``.

Per stage, forward: ``q_c[B, s, P*m, H] -> q[B, S, m, H]`` (all-to-all), attend with the kv heads
those q heads use (exchanged once, before the stages), ``o[B, S, m, H] -> o_c[B, s, P*m, H]``
(all-to-all), written into the preallocated output. Nothing of a stage is kept: the function
saves only its inputs (``q`` and the exchanged ``k``, ``v``).

Per stage, backward: q (the recompute) and ``d o`` (the adjoint of o's exchange is q's) go to
heads in one all-to-all, attention runs forward and backward, and ``d q`` comes back by the
inverse all-to-all into one preallocated ``[B, s, N, H]`` gradient; ``d k``, ``d v`` are summed
over the stages that use them. Checkpointing each stage instead gives the same values and bytes,
but the gradient of each ``q[:, :, :, c]`` slice becomes a full-size zero-padded tensor that
autograd sums: three or four ``[B, s, N, H]`` tensors at once, the peak of a million-token
backward. That checkpointed form is kept for ``torch.compile`` (dynamo does not trace a backward
that calls ``torch.autograd.grad``).

Overlap (``UlyssesAttention(..., overlap=True)``, the trainer's ``--overlap-comm``): the
all-to-alls are asynchronous. While stage ``c`` attends, stage ``c + 1``'s inputs are already
moving to heads and stage ``c - 1``'s output (forward) or ``d q`` (backward) is moving back; each
is waited for just before it is used. The values, the bytes and the order of every
floating-point operation are those of the one-at-a-time schedule; what it costs is memory: the
send and receive buffers of two exchanges in flight during a stage's backward, six one-stage
tensors, which shortens the longest sequence that fits. Off by default,
since head chunks are a memory feature; on for speed where memory is not the limit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from dtensor_ulysses.comm.alltoall import PendingExchange, all_to_all, start_exchange
from dtensor_ulysses.plan import HEAD_DIM
from dtensor_ulysses.plan.splits import SEQ_DIM

__all__ = ["StageExchange", "run_head_stages"]


Attend = Callable[..., torch.Tensor]  # (q, k, v, **kw) -> o


class _Ready:
    """A finished "exchange" (one rank: nothing moves)."""

    def __init__(self, xs: list[torch.Tensor]) -> None:
        self._xs = xs

    def wait(self) -> list[torch.Tensor]:
        return self._xs


class StageExchange:
    """The two all-to-alls of a stage.

    Args:
        group: the sp group (``P`` ranks).
        seq_sizes: tokens each rank holds.
        m: q heads per rank per stage.
        order: the kernel's memory layout for the received q (and ``d o``).
        async_op: overlap the exchanges with the stages' attention (see the module docstring).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        seq_sizes: Sequence[int],
        m: int,
        order=None,
        *,
        async_op: bool = False,
    ) -> None:
        self.group, self.seq_sizes, self.order = group, list(seq_sizes), order
        self.heads_each = [m] * dist.get_world_size(group)
        self.async_op = async_op

    def heads(self, xs: list[torch.Tensor]) -> PendingExchange | _Ready:
        """``x[B, s, P*m, H] -> x[B, S, m, H]`` for every tensor of ``xs``, one collective."""
        if len(self.heads_each) == 1:
            return _Ready(xs)
        n = len(xs)
        return start_exchange(xs, HEAD_DIM, SEQ_DIM, [self.heads_each] * n, [self.seq_sizes] * n,
                              self.group, self.order, async_op=self.async_op)  # fmt: skip

    def seq(self, o_BSmH: torch.Tensor) -> PendingExchange | _Ready:
        """``o[B, S, m, H] -> o[B, s, P*m, H]``."""
        if len(self.heads_each) == 1:
            return _Ready([o_BSmH])
        return start_exchange([o_BSmH], SEQ_DIM, HEAD_DIM, [self.seq_sizes], [self.heads_each],
                              self.group, async_op=self.async_op)  # fmt: skip

    def heads_differentiable(self, x: torch.Tensor) -> torch.Tensor:
        out = all_to_all(x, scatter_dim=HEAD_DIM, gather_dim=SEQ_DIM, group=self.group,
                         scatter_sizes=self.heads_each, gather_sizes=self.seq_sizes)  # fmt: skip
        assert isinstance(out, torch.Tensor)
        return out

    def seq_differentiable(self, o: torch.Tensor) -> torch.Tensor:
        out = all_to_all(o, scatter_dim=SEQ_DIM, gather_dim=HEAD_DIM, group=self.group,
                         scatter_sizes=self.seq_sizes, gather_sizes=self.heads_each)  # fmt: skip
        assert isinstance(out, torch.Tensor)
        return out


def _stage(x_BsPCmH: torch.Tensor, c: int) -> torch.Tensor:
    B, s, P, _, m, H = x_BsPCmH.shape
    return x_BsPCmH[:, :, :, c].reshape(B, s, P * m, H)


def _store(x_BsPCmH: torch.Tensor, c: int, pending) -> None:
    B, s, P, _, m, H = x_BsPCmH.shape
    (x_c,) = pending.wait()
    x_BsPCmH[:, :, :, c] = x_c.view(B, s, P, m, H)


def _pipeline(C: int, start_in, compute, start_out, store, overlap: bool) -> None:
    """Stage ``c``: its inputs move in (``start_in(c)``), ``compute(c, inputs)``, the result
    moves out (``start_out(result)``) and lands (``store(c, pending)``). With ``overlap``, stage
    ``c + 1``'s inputs start before stage ``c`` computes and stage ``c``'s result lands after
    stage ``c + 1`` started computing; without, one exchange at a time, nothing in flight."""
    incoming, outgoing = start_in(0), None
    for c in range(C):
        inputs = incoming.wait()
        if overlap and c + 1 < C:
            incoming = start_in(c + 1)
        result = compute(c, inputs)
        del inputs
        if outgoing is not None:
            store(c - 1, outgoing)
        outgoing = start_out(result)
        del result
        if not overlap:
            store(c, outgoing)
            outgoing = None
            if c + 1 < C:
                incoming = start_in(c + 1)
    if outgoing is not None:
        store(C - 1, outgoing)


def _sinks_kw(sinks_n: torch.Tensor | None, c: int, m: int) -> dict:
    """Stage ``c``'s sinks (its ``m`` q heads of this rank's ``n``), as ``attend`` keywords."""
    return {} if sinks_n is None else {"sinks": sinks_n[c * m : (c + 1) * m]}


class _HeadStages(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BsPCmH, k_BSkH, v_BSkH, sinks_n, kv_ranges, ex: StageExchange,
                attend: Attend):  # fmt: skip
        o_BsPCmH = torch.empty_like(q_BsPCmH)
        m = q_BsPCmH.shape[4]

        def compute(c: int, inputs: list[torch.Tensor]) -> torch.Tensor:
            lo, hi = kv_ranges[c]
            kw = _sinks_kw(sinks_n, c, m)
            return attend(inputs[0], k_BSkH[:, :, lo:hi], v_BSkH[:, :, lo:hi], **kw)

        _pipeline(
            q_BsPCmH.shape[3],
            lambda c: ex.heads([_stage(q_BsPCmH, c)]),
            compute,
            ex.seq,
            lambda c, pending: _store(o_BsPCmH, c, pending),
            ex.async_op,
        )
        ctx.save_for_backward(q_BsPCmH, k_BSkH, v_BSkH, sinks_n)
        ctx.fns = (kv_ranges, ex, attend)
        return o_BsPCmH

    @staticmethod
    def backward(ctx, do_BsPCmH):
        q_BsPCmH, k_BSkH, v_BSkH, sinks_n = ctx.saved_tensors
        kv_ranges, ex, attend = ctx.fns
        dq_BsPCmH = torch.empty_like(q_BsPCmH)
        dk_BSkH, dv_BSkH = torch.zeros_like(k_BSkH), torch.zeros_like(v_BSkH)
        dsinks_n = None if sinks_n is None else torch.zeros_like(sinks_n)
        m = q_BsPCmH.shape[4]

        def compute(c: int, inputs: list[torch.Tensor]) -> torch.Tensor:
            lo, hi = kv_ranges[c]
            q_BSmH = inputs[0].detach().requires_grad_()
            k_c = k_BSkH[:, :, lo:hi].detach().requires_grad_()
            v_c = v_BSkH[:, :, lo:hi].detach().requires_grad_()
            leaves = [q_BSmH, k_c, v_c]
            kw = {}
            if sinks_n is not None:
                kw["sinks"] = sinks_n[c * m : (c + 1) * m].detach().requires_grad_()
                leaves.append(kw["sinks"])
            with torch.enable_grad():
                o_BSmH = attend(q_BSmH, k_c, v_c, **kw)  # the recompute
            grads = torch.autograd.grad(o_BSmH, leaves, inputs[1])
            dk_BSkH[:, :, lo:hi] += grads[1]
            dv_BSkH[:, :, lo:hi] += grads[2]
            if dsinks_n is not None:
                dsinks_n[c * m : (c + 1) * m] += grads[3]
            return grads[0]

        _pipeline(
            q_BsPCmH.shape[3],
            # the recompute's q and d o (the adjoint of o's exchange) to heads, in one exchange
            lambda c: ex.heads([_stage(q_BsPCmH, c), _stage(do_BsPCmH, c)]),
            compute,
            ex.seq,  # d q back
            lambda c, pending: _store(dq_BsPCmH, c, pending),
            ex.async_op,
        )
        return dq_BsPCmH, dk_BSkH, dv_BSkH, dsinks_n, None, None, None


def run_head_stages(
    q_BsPCmH: torch.Tensor,
    k_BSkH: torch.Tensor,
    v_BSkH: torch.Tensor,
    kv_ranges: Sequence[tuple[int, int]],
    *,
    exchange: StageExchange,
    attend: Attend,
    sinks_n: torch.Tensor | None = None,
) -> torch.Tensor:
    """``o[B, s, P, C, m, H]`` from ``q[B, s, P, C, m, H]`` and the exchanged ``k, v[B, S, k, H]``.

    Args:
        kv_ranges: per stage, the local kv heads ``[lo, hi)`` its q heads use.
        exchange: the stage's all-to-alls.
        attend: the kernel on ``q[B, S, m, H]`` and that stage's ``k, v`` (and ``sinks=``).
        sinks_n: this rank's ``n = C * m`` sink logits (stage ``c`` attends with
            ``sinks_n[c*m : (c+1)*m]``), or ``None``.
    """
    if len(kv_ranges) != q_BsPCmH.shape[3]:
        raise ValueError(f"{len(kv_ranges)} kv ranges for {q_BsPCmH.shape[3]} stages")
    if not torch.compiler.is_compiling():
        return _HeadStages.apply(q_BsPCmH, k_BSkH, v_BSkH, sinks_n, tuple(kv_ranges), exchange,
                                 attend)  # fmt: skip

    def stage(q_c, k, v, lo, hi, *sinks):
        q_h = exchange.heads_differentiable(q_c)
        kw = {"sinks": sinks[0]} if sinks else {}
        return exchange.seq_differentiable(attend(q_h, k[:, :, lo:hi], v[:, :, lo:hi], **kw))

    B, s, P, _, m, H = q_BsPCmH.shape
    o_BsPCmH = q_BsPCmH.new_empty(q_BsPCmH.shape)
    for c, (lo, hi) in enumerate(kv_ranges):
        q_c = _stage(q_BsPCmH, c)
        extra = () if sinks_n is None else (sinks_n[c * m : (c + 1) * m],)
        if torch.is_grad_enabled():
            o_c = checkpoint(stage, q_c, k_BSkH, v_BSkH, lo, hi, *extra, use_reentrant=False)
        else:
            o_c = stage(q_c, k_BSkH, v_BSkH, lo, hi, *extra)
        o_BsPCmH[:, :, :, c] = o_c.view(B, s, P, m, H)
    return o_BsPCmH
