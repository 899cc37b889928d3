"""Ring attention's local math: the blockwise kernel and the ``autograd.Function`` of the ring.

Private to :mod:`dtensor_ulysses.attention.ring` (which documents the scheme, the API and the
bytes). Legend:
``L`` tokens per ring rank, ``Lq``/``Lk`` a block's q/k tokens, ``N`` q and ``K`` kv heads
(``G = N / K`` q heads per kv head), ``H`` head dim. Math in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dtensor_ulysses.comm.p2p import RingShift, ring_shift

__all__ = ["RingPlan", "RingAttentionFn"]

_KV_TAG, _DKV_TAG = 11, 12


# ----------------------------------------------------------------------------------------------
# one block: o and lse forward; dq, dk, dv backward (GQA by grouping q heads per kv head)
# ----------------------------------------------------------------------------------------------
def _scores(q, k, mask, scale, acc):
    B, Lq, N, H = q.shape
    K = k.shape[2]
    q5 = q.to(acc).view(B, Lq, K, N // K, H)
    s = torch.einsum("bqkgh,bjkh->bkgqj", q5, k.to(acc)) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
    return q5, s


def _block_forward(q, k, v, mask, scale, acc):
    """``o[B, Lq, N, H]`` (acc dtype) and ``lse[B, N, Lq]`` of q against one k/v block."""
    B, Lq, N, H = q.shape
    _, s = _scores(q, k, mask, scale, acc)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # fully masked rows
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    o = torch.einsum("bkgqj,bjkh->bqkgh", p, v.to(acc)) / denom.clamp_min(1e-30).permute(
        0, 3, 1, 2, 4
    )
    lse = (m + torch.log(denom)).squeeze(-1)  # -inf where nothing is attended
    return o.reshape(B, Lq, N, H), lse.reshape(B, N, Lq)


def _block_backward(q, k, v, mask, scale, acc, do, lse, delta):
    """``dq, dk, dv`` of one block from the final ``lse`` and ``delta = sum(do * o)``."""
    B, Lq, N, H = q.shape
    K = k.shape[2]
    q5, s = _scores(q, k, mask, scale, acc)
    lse5 = lse.view(B, K, N // K, Lq, 1)
    p = torch.exp(s - torch.where(torch.isfinite(lse5), lse5, torch.zeros_like(lse5)))
    do5 = do.view(B, Lq, K, N // K, H)
    dv = torch.einsum("bkgqj,bqkgh->bjkh", p, do5)
    dp = torch.einsum("bqkgh,bjkh->bkgqj", do5, v.to(acc))
    ds = p * (dp - delta.view(B, K, N // K, Lq, 1)) * scale
    dq = torch.einsum("bkgqj,bjkh->bqkgh", ds, k.to(acc)).reshape(B, Lq, N, H)
    dk = torch.einsum("bkgqj,bqkgh->bjkh", ds, q5)
    return dq, dk, dv


def _flash_block(q, k, v, causal, scale):
    from dtensor_ulysses.attention import flash_attn_module

    o, lse, _ = flash_attn_module().flash_attn_func(
        q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, return_attn_probs=True
    )
    return o.float(), lse.float()  # lse: [B, N, Lq]


# ----------------------------------------------------------------------------------------------
# the ring: which block each step computes, with which mask
# ----------------------------------------------------------------------------------------------
@dataclass
class RingPlan:
    group: dist.ProcessGroup
    size: int
    rank: int
    chunks: list[list[tuple[int, int]]]  # per ring rank: its global [lo, hi) ranges, in order
    causal: bool
    scale: float
    doc_ids: torch.Tensor | None  # [B, S] document index of every global position (CPU)
    flash: bool
    # device copies of the positions per ring rank and of doc_ids, made once per call (not per
    # ring step): the step masks are built on the device from them
    _dev: dict = field(default_factory=dict, repr=False)

    def device_mask(self, j: int, rows: slice, cols: slice, device: torch.device) -> torch.Tensor:
        """The mask of :meth:`step` for ring rank ``j``'s block, built on ``device``."""
        if not self._dev:
            self._dev["pos"] = [self.positions(r).to(device) for r in range(self.size)]
            if self.doc_ids is not None:
                self._dev["doc"] = self.doc_ids.to(device)
        qpos, kpos = self._dev["pos"][self.rank][rows], self._dev["pos"][j][cols]
        mask = None
        if "doc" in self._dev:
            doc = self._dev["doc"]
            mask = doc[:, qpos][:, :, None] == doc[:, kpos][:, None, :]
        q_lo, k_hi = self.positions(self.rank)[rows].min(), self.positions(j)[cols].max()
        if self.causal and int(k_hi) > int(q_lo):  # host ints (CPU positions): no sync
            causal = (kpos[None, :] <= qpos[:, None])[None]
            mask = causal if mask is None else mask & causal
        assert mask is not None
        return mask

    def pieces(self, j: int) -> list[tuple[int, int, int]]:
        """``(local_lo, local_hi, global_lo)`` of ring rank ``j``'s chunks."""
        out, at = [], 0
        for lo, hi in self.chunks[j]:
            out.append((at, at + hi - lo, lo))
            at += hi - lo
        return out

    def positions(self, j: int) -> torch.Tensor:
        return torch.cat([torch.arange(lo, hi) for lo, hi in self.chunks[j]])

    def step(
        self, j: int, flash: bool = False
    ) -> tuple[slice, slice, torch.Tensor | None, bool] | None:
        """For k/v of ring rank ``j``: ``(rows, cols, mask, diag)``, or ``None`` when no token
        of this rank attends to that block. ``rows``/``cols`` bound the live q/k sub-blocks (the
        zigzag halves); ``mask[B or 1, rows, cols]`` (CPU) is ``None`` when all of it is attended,
        or when ``flash`` and ``diag`` (the own block, plainly causal: flash-attn's ``causal``)."""
        qp, kp = self.pieces(self.rank), self.pieces(j)

        def live(a, b):  # some k position of piece b is <= some q position of piece a
            return not self.causal or b[2] <= a[2] + (a[1] - a[0]) - 1

        rows = [a for a in qp if any(live(a, b) for b in kp)]
        cols = [b for b in kp if any(live(a, b) for a in qp)]
        if not rows:
            return None
        rows_s = slice(min(a[0] for a in rows), max(a[1] for a in rows))
        cols_s = slice(min(b[0] for b in cols), max(b[1] for b in cols))
        qpos, kpos = self.positions(self.rank)[rows_s], self.positions(j)[cols_s]
        need_causal = self.causal and int(kpos.max()) > int(qpos.min())
        diag = need_causal and j == self.rank and rows_s == cols_s == slice(0, len(qpos))
        if self.doc_ids is None:
            if not need_causal or (diag and flash):
                return rows_s, cols_s, None, diag
            return rows_s, cols_s, (kpos[None, :] <= qpos[:, None])[None], diag
        mask = self.doc_ids[:, qpos][:, :, None] == self.doc_ids[:, kpos][:, None, :]
        if need_causal:
            mask &= (kpos[None, :] <= qpos[:, None])[None]
        return (rows_s, cols_s, mask, False) if bool(mask.any()) else None


class RingAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingPlan
    ) -> torch.Tensor:
        acc = torch.promote_types(q.dtype, torch.float32)
        B, L, N, H = q.shape
        o = q.new_zeros(B, L, N, H, dtype=acc)
        lse = q.new_full((B, N, L), float("-inf"), dtype=acc)
        kv = torch.stack([k, v]).contiguous()
        for i in range(ring.size):
            j = (ring.rank - i) % ring.size
            nxt: RingShift | None = (
                ring_shift(kv, ring.group, _KV_TAG) if i < ring.size - 1 else None
            )
            plan = ring.step(j, ring.flash)
            if plan is not None:
                rows, cols, mask, diag = plan
                qb, kb, vb = q[:, rows], kv[0][:, cols], kv[1][:, cols]
                if ring.flash and mask is None:
                    o_b, lse_b = _flash_block(qb, kb, vb, diag, ring.scale)
                else:
                    m = None if mask is None else ring.device_mask(j, rows, cols, q.device)
                    o_b, lse_b = _block_forward(qb, kb, vb, m, ring.scale, acc)
                old = lse[:, :, rows]
                new = torch.logaddexp(old, lse_b)
                safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
                w_old = torch.exp(old - safe).transpose(1, 2).unsqueeze(-1)
                w_new = torch.exp(lse_b - safe).transpose(1, 2).unsqueeze(-1)
                o[:, rows] = o[:, rows] * w_old + o_b * w_new
                lse[:, :, rows] = new
            if nxt is not None:
                kv = nxt.wait()
        out = o.to(q.dtype)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring: RingPlan = ctx.ring
        acc = lse.dtype
        do = do.to(acc)
        delta = (do * out.to(acc)).sum(-1).transpose(1, 2)  # [B, N, L]
        dq = torch.zeros_like(do)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        back: RingShift | None = None
        for i in range(ring.size):
            nxt = ring_shift(kv, ring.group, _KV_TAG) if i < ring.size - 1 else None
            j = (ring.rank - i) % ring.size
            plan = ring.step(j)  # rebuilt: no [L, L] mask is kept
            if plan is not None:
                rows, cols, mask, _ = plan
                m = None if mask is None else ring.device_mask(j, rows, cols, q.device)
                dq_b, dk_b, dv_b = _block_backward(
                    q[:, rows], kv[0][:, cols], kv[1][:, cols], m, ring.scale, acc,
                    do[:, rows], lse[:, :, rows], delta[:, :, rows],
                )  # fmt: skip
                dq[:, rows] += dq_b
            if back is not None:  # the accumulator of the block we hold, from the previous rank
                dkv = back.wait()
            if plan is not None:
                dkv[0][:, cols] += dk_b
                dkv[1][:, cols] += dv_b
            if ring.size > 1:
                back = ring_shift(dkv, ring.group, _DKV_TAG)
            if nxt is not None:
                kv = nxt.wait()
        if back is not None:
            dkv = back.wait()  # our own k/v's gradients, home after the last hop
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None
