"""The blockwise kernel: exact attention in pure PyTorch, memory linear in ``S``, any device.

Legend: ``B`` batch, ``S`` sequence, ``N`` q heads, ``K`` kv heads, ``G = N / K`` q heads per kv
head, ``H`` head dim; ``q`` and ``k`` in a block are ``Q`` and ``J`` rows, ``R = Q * G``. Inputs
are ``q[B, S, N, H]``, ``k, v[B, S, K, H]``; inside, ``q`` is laid out once as ``[B, K, S, G, H]``
(a copy, linear in ``S``), so a block of queries of one kv head is a contiguous ``[B, K, R, H]``
slice: one batched matmul against that kv head's keys, which are never repeated per q head.

Forward (FlashAttention's online softmax): for each block of queries, the key blocks that can hold
a visible key are visited in order, keeping the running max ``m``, the running sum ``l`` and the
unnormalised output; a block's scores ``[B, K, R, J]`` are the largest tensor. The softmax
normaliser is ``L = log(sum_j exp(s_ij) + exp(sink_h))`` (no sink term without sinks), saved with
``o``; backward recomputes each block's probabilities ``p = exp(s - L)`` from them and
accumulates ``dq``, ``dk``, ``dv`` block by block (FlashAttention-2's backward), so no ``S x S``
tensor exists in either pass.

Mask: key ``j`` is visible to query ``i`` iff ``j <= i`` (causal) or both lie in one
bidirectional block (``block_ids[b, i] == block_ids[b, j] >= 0``: the tokens of one image), and
``i - left <= j <= i + right`` (window, ``-1`` an unlimited side), ``j // C == i // C`` (chunk)
and both lie in one document (``doc_ids[b, i] == doc_ids[b, j]``). Key blocks that the causal,
window and chunk rules (and, in eager code, the host document starts and block spans) rule out
entirely are skipped: a window of ``W`` costs ``O(S * W)``. Scores: ``s = scale * q.k``, then
``c * tanh(s / c)`` with a softcap ``c``.

Sinks (one logit per q head): ``exp(sink_h)`` joins the denominator and carries no value, so
``o = sum_j exp(s_ij - L_i) v_j`` and ``d sink_h = -sum_i exp(sink_h - L_i) (do_i . o_i)``.

Half-precision inputs are computed in float32 (outputs cast back); float32 and float64 in their
own precision. The kernel is a ``torch.library`` custom op pair (forward, backward) with fake
implementations, so ``torch.compile`` (any backend, ``fullgraph=True``) treats it as one opaque
op instead of unrolling its loops, and fake-tensor tracing (memtrace) sees its true outputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["DEFAULT_BLOCK", "blockwise_attention", "key_ranges"]

DEFAULT_BLOCK = 256  # queries and keys per block: a block's scores are B*N*256*256 elements


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def key_ranges(
    S: int,
    block: int,
    *,
    causal: bool,
    window: Sequence[int],
    chunk: int,
    doc_starts: Sequence[Sequence[int]] | None = None,
    blocks: bool = False,
    block_spans: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> list[int]:
    """Per block of ``block`` queries, the keys ``[lo, hi)`` that can be visible to any of them,
    flattened ``[lo0, hi0, lo1, hi1, ...]`` (host ints: causal, window, chunk, documents).

    With bidirectional ``blocks`` a query sees keys up to the end of its block: ``block_spans``
    (per row, each block's ``(start, end)``) bound them; unknown spans lift the causal bound."""
    left, right = window
    out = []
    for qs in range(0, S, block):
        qe = min(qs + block, S)
        lo, hi = 0, S
        if causal:
            hi = qe
            if blocks and block_spans is None:
                hi = S
            elif blocks:
                assert block_spans is not None
                ends = [e for row in block_spans for b0, e in row if b0 < qe and e > qs]
                hi = max([qe, *ends])
        if right >= 0:
            hi = min(hi, qe + right)
        if left >= 0:
            lo = max(lo, qs - left)
        if chunk > 0:
            lo = max(lo, qs // chunk * chunk)
            hi = min(hi, ((qe - 1) // chunk + 1) * chunk)
        if doc_starts is not None:  # the document of the block's first / last query, per row
            firsts, lasts = [], []
            for row in doc_starts:
                bounds = list(row) + [S]
                firsts.append(max(t for t in bounds[:-1] if t <= qs))
                lasts.append(min(t for t in bounds[1:] if t > qe - 1))
            lo, hi = max(lo, min(firsts)), min(hi, max(lasts))
        out += [lo, max(lo, hi)]
    return out


def _visible(
    qs: int, qe: int, ks: int, ke: int, device, causal: bool, window, chunk: int, doc_ids_BS,
    block_ids_BS=None,
) -> torch.Tensor | None:  # fmt: skip
    """``[B or 1, Q, J]`` booleans (broadcast over heads later), or ``None``: all visible."""
    i = torch.arange(qs, qe, device=device)[:, None]
    j = torch.arange(ks, ke, device=device)[None, :]
    mask = None

    def both(m, new):
        return new if m is None else m & new

    left, right = window
    causal_BQJ = None
    if causal and ke - 1 > qs:
        causal_BQJ = (j <= i)[None]
        if block_ids_BS is not None:  # one block's tokens see each other both ways
            bq_BQ1 = block_ids_BS[:, qs:qe, None]
            causal_BQJ = causal_BQJ | ((bq_BQ1 == block_ids_BS[:, None, ks:ke]) & (bq_BQ1 >= 0))
    if left >= 0 and ks < qe - 1 - left:
        mask = both(mask, j >= i - left)
    if right >= 0 and ke - 1 > qs + right:
        mask = both(mask, j <= i + right)
    if chunk > 0 and (qs // chunk != (qe - 1) // chunk or ks // chunk != (ke - 1) // chunk
                      or qs // chunk != ks // chunk):  # fmt: skip
        mask = both(mask, (j // chunk) == (i // chunk))
    mask_BQJ = None if mask is None else mask[None]
    if causal_BQJ is not None:
        mask_BQJ = causal_BQJ if mask_BQJ is None else mask_BQJ & causal_BQJ
    if doc_ids_BS is not None:
        same_BQJ = doc_ids_BS[:, qs:qe, None] == doc_ids_BS[:, None, ks:ke]
        mask_BQJ = same_BQJ if mask_BQJ is None else mask_BQJ & same_BQJ
    return mask_BQJ


def _scores(q_BKRH, k_BKJH, scale: float, softcap: float):
    """``(s, t)``: the scores ``[B, K, R, J]`` (``R = Q * G`` rows: query-major, then the q
    heads of the kv head) and ``tanh(s0 / c)`` (softcap) or ``None``."""
    s0 = torch.matmul(q_BKRH, k_BKJH.transpose(-1, -2)) * scale
    if softcap > 0:
        t = torch.tanh(s0 / softcap)
        return t * softcap, t
    return s0, None


def _heads_last(x_BSNH: torch.Tensor, K: int, acc: torch.dtype) -> torch.Tensor:
    """``x[B, S, N, H] -> x[B, K, S, G, H]`` contiguous in ``acc``: a block of queries is then a
    contiguous ``[B, K, Q * G, H]`` slice, one batched matmul against its kv head's keys."""
    B, S, N, H = x_BSNH.shape
    return x_BSNH.reshape(B, S, K, N // K, H).permute(0, 2, 1, 3, 4).to(acc).contiguous()


def _block_mask(qs, qe, ks, ke, device, causal, window, chunk, doc_ids_BS, block_ids_BS):
    """:func:`_visible` shaped to broadcast over ``[B, K, Q, G, J]`` (or ``None``)."""
    mask_BQJ = _visible(qs, qe, ks, ke, device, causal, window, chunk, doc_ids_BS, block_ids_BS)
    return None if mask_BQJ is None else mask_BQJ[:, None, :, None, :]


def _forward(q_BSNH, k_BSKH, v_BSKH, doc_ids_BS, block_ids_BS, sinks_N, scale, causal, window,
             chunk, softcap, ranges, block):  # fmt: skip
    """``o[B, S, N, H]`` (input dtype) and ``L[B, N, S]`` (float32 or float64)."""
    B, S, N, H = q_BSNH.shape
    K = k_BSKH.shape[2]
    G = N // K
    acc, dev = _acc_dtype(q_BSNH.dtype), q_BSNH.device
    q_BKSGH = _heads_last(q_BSNH, K, acc)
    k_BKSH, v_BKSH = (t.permute(0, 2, 1, 3).to(acc).contiguous() for t in (k_BSKH, v_BSKH))
    o_BSNH = q_BSNH.new_empty(q_BSNH.shape)  # contiguous, as the fake says
    L_BKSG = torch.empty(B, K, S, G, dtype=acc, device=dev)
    sink_1K1G = None if sinks_N is None else sinks_N.to(acc).view(1, K, 1, G)
    for n, qs in enumerate(range(0, S, block)):
        qe = min(qs + block, S)
        Q = qe - qs
        lo, hi = ranges[2 * n], ranges[2 * n + 1]
        q_BKRH = q_BKSGH[:, :, qs:qe].reshape(B, K, Q * G, H)
        m = torch.full((B, K, Q, G), -math.inf, dtype=acc, device=dev)
        l_sum = torch.zeros_like(m)
        o_acc = torch.zeros(B, K, Q, G, H, dtype=acc, device=dev)
        for ks in range(lo, hi, block):
            ke = min(ks + block, hi)
            s, _ = _scores(q_BKRH, k_BKSH[:, :, ks:ke], scale, softcap)
            s = s.view(B, K, Q, G, ke - ks)
            mask = _block_mask(qs, qe, ks, ke, dev, causal, window, chunk, doc_ids_BS,
                               block_ids_BS)  # fmt: skip
            if mask is not None:
                s = s.masked_fill(~mask, -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m - m_safe)
            l_sum = l_sum * alpha + p.sum(-1)
            pv = torch.matmul(p.view(B, K, Q * G, ke - ks), v_BKSH[:, :, ks:ke])
            o_acc = o_acc * alpha[..., None] + pv.view(B, K, Q, G, H)
            m = m_new
            del s, p, pv
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        lse = m_safe + torch.log(l_sum)  # -inf where a query sees no key
        L = lse if sink_1K1G is None else torch.logaddexp(lse, sink_1K1G.expand_as(lse))
        scale_o = torch.where(torch.isinf(L), torch.zeros_like(L), torch.exp(m_safe - L))
        o_blk = o_acc * scale_o[..., None]
        o_BSNH[:, qs:qe] = o_blk.permute(0, 2, 1, 3, 4).reshape(B, Q, N, H)
        L_BKSG[:, :, qs:qe] = L
    # contiguous, as the fake says (with one kv head the reshape is a strided view)
    return o_BSNH, L_BKSG.permute(0, 1, 3, 2).reshape(B, N, S).contiguous()


def _backward(do_BSNH, q_BSNH, k_BSKH, v_BSKH, o_BSNH, L_BNS, doc_ids_BS, block_ids_BS, sinks_N,
              scale, causal, window, chunk, softcap, ranges, block):  # fmt: skip
    """``dq, dk, dv`` (input dtypes) and ``dsinks[N]`` (float32/64; empty without sinks)."""
    B, S, N, H = q_BSNH.shape
    K = k_BSKH.shape[2]
    G = N // K
    acc, dev = _acc_dtype(q_BSNH.dtype), q_BSNH.device
    q_BKSGH, do_BKSGH, o_BKSGH = (_heads_last(t, K, acc) for t in (q_BSNH, do_BSNH, o_BSNH))
    k_BKSH, v_BKSH = (t.permute(0, 2, 1, 3).to(acc).contiguous() for t in (k_BSKH, v_BSKH))
    L_BKSG = L_BNS.view(B, K, G, S).permute(0, 1, 3, 2)
    L_BKSG = torch.where(torch.isinf(L_BKSG), torch.full_like(L_BKSG, math.inf), L_BKSG)
    dq_BKSGH = torch.zeros_like(q_BKSGH)
    dk_BKSH, dv_BKSH = torch.zeros_like(k_BKSH), torch.zeros_like(v_BKSH)
    dsink_KG = torch.zeros(K, G, dtype=acc, device=dev)
    sink_1K1G = None if sinks_N is None else sinks_N.to(acc).view(1, K, 1, G)
    for n, qs in enumerate(range(0, S, block)):
        qe = min(qs + block, S)
        Q = qe - qs
        lo, hi = ranges[2 * n], ranges[2 * n + 1]
        q_BKRH = q_BKSGH[:, :, qs:qe].reshape(B, K, Q * G, H)
        do_BKRH = do_BKSGH[:, :, qs:qe].reshape(B, K, Q * G, H)
        L = L_BKSG[:, :, qs:qe]  # [B, K, Q, G]
        D = (do_BKSGH[:, :, qs:qe] * o_BKSGH[:, :, qs:qe]).sum(-1)  # [B, K, Q, G]
        if sink_1K1G is not None:
            dsink_KG -= (torch.exp(sink_1K1G - L) * D).sum((0, 2))
        dq_BKRH = torch.zeros_like(q_BKRH)
        for ks in range(lo, hi, block):
            ke = min(ks + block, hi)
            J = ke - ks
            k_blk, v_blk = k_BKSH[:, :, ks:ke], v_BKSH[:, :, ks:ke]
            s, t = _scores(q_BKRH, k_blk, scale, softcap)
            p = torch.exp(s.view(B, K, Q, G, J) - L[..., None])
            mask = _block_mask(qs, qe, ks, ke, dev, causal, window, chunk, doc_ids_BS,
                               block_ids_BS)  # fmt: skip
            if mask is not None:
                p = p.masked_fill(~mask, 0.0)
            p = p.view(B, K, Q * G, J)
            dv_BKSH[:, :, ks:ke] += torch.matmul(p.transpose(-1, -2), do_BKRH)
            dp = torch.matmul(do_BKRH, v_blk.transpose(-1, -2))
            ds = p * (dp.view(B, K, Q, G, J) - D[..., None]).view(B, K, Q * G, J)
            if t is not None:
                ds = ds * (1 - t * t)
            dq_BKRH += torch.matmul(ds, k_blk) * scale
            dk_BKSH[:, :, ks:ke] += torch.matmul(ds.transpose(-1, -2), q_BKRH) * scale
            del s, p, dp, ds
        dq_BKSGH[:, :, qs:qe] = dq_BKRH.view(B, K, Q, G, H)
    dq = dq_BKSGH.permute(0, 2, 1, 3, 4).reshape(B, S, N, H).to(q_BSNH.dtype).contiguous()
    dk = dk_BKSH.permute(0, 2, 1, 3).to(k_BSKH.dtype).contiguous()
    dv = dv_BKSH.permute(0, 2, 1, 3).to(v_BSKH.dtype).contiguous()
    dsinks = dsink_KG.reshape(N) if sinks_N is not None else dsink_KG.new_zeros(0)
    return dq, dk, dv, dsinks


# ---------------------------------------------------------------------------------------------
# the custom ops (opaque to torch.compile; fake implementations for tracing)
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("dtensor_ulysses::blockwise_attn", mutates_args=())
def _attn_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: torch.Tensor | None,
    block_ids: torch.Tensor | None,
    sinks: torch.Tensor | None,
    scale: float,
    causal: bool,
    window: list[int],
    chunk: int,
    softcap: float,
    ranges: list[int],
    block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, doc_ids, block_ids, sinks, scale, causal, window, chunk, softcap,
                    ranges, block)  # fmt: skip


@_attn_op.register_fake
def _attn_fake(q, k, v, doc_ids, block_ids, sinks, scale, causal, window, chunk, softcap, ranges,
               block):  # fmt: skip
    B, S, N, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, N, S), dtype=_acc_dtype(q.dtype))


@torch.library.custom_op("dtensor_ulysses::blockwise_attn_backward", mutates_args=())
def _attn_backward_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    doc_ids: torch.Tensor | None,
    block_ids: torch.Tensor | None,
    sinks: torch.Tensor | None,
    scale: float,
    causal: bool,
    window: list[int],
    chunk: int,
    softcap: float,
    ranges: list[int],
    block: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(do, q, k, v, o, lse, doc_ids, block_ids, sinks, scale, causal, window, chunk,
                     softcap, ranges, block)  # fmt: skip


@_attn_backward_op.register_fake
def _attn_backward_fake(do, q, k, v, o, lse, doc_ids, block_ids, sinks, scale, causal, window,
                        chunk, softcap, ranges, block):  # fmt: skip
    N = q.shape[2]
    dsinks = q.new_empty((N if sinks is not None else 0,), dtype=_acc_dtype(q.dtype))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, doc_ids, block_ids, sinks, scale, causal, window, chunk, softcap, ranges, block = (
        inputs
    )
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, doc_ids, block_ids, sinks)
    ctx.args = (scale, causal, window, chunk, softcap, ranges, block)
    ctx.sinks_dtype = None if sinks is None else sinks.dtype


def _autograd_backward(ctx, do, _dlse):
    q, k, v, o, lse, doc_ids, block_ids, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = _attn_backward_op(do, q, k, v, o, lse, doc_ids, block_ids, sinks,
                                           *ctx.args)  # fmt: skip
    dsinks = None if ctx.sinks_dtype is None else dsinks.to(ctx.sinks_dtype)
    return dq, dk, dv, None, None, dsinks, None, None, None, None, None, None, None


_attn_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def blockwise_attention(
    q_BSNH: torch.Tensor,
    k_BSKH: torch.Tensor,
    v_BSKH: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    chunk: int = 0,
    softcap: float = 0.0,
    sinks_N: torch.Tensor | None = None,
    doc_ids_BS: torch.Tensor | None = None,
    doc_starts: Sequence[Sequence[int]] | None = None,
    block_ids_BS: torch.Tensor | None = None,
    block_spans: Sequence[Sequence[tuple[int, int]]] | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """``o[B, S, N, H]`` (see the module docstring); ``doc_ids`` mask the documents,
    ``doc_starts`` (host ints, when known) only let whole key blocks be skipped; ``block_ids``
    ``[B, S]`` (``-1``: none) the bidirectional blocks, ``block_spans`` (host ints, when known)
    bound the keys they add; ``block`` (default :data:`DEFAULT_BLOCK`, read at the call)
    queries and keys per block."""
    S = q_BSNH.shape[1]
    block = max(1, min(DEFAULT_BLOCK if block is None else block, S))
    ranges = key_ranges(S, block, causal=causal, window=window, chunk=chunk,
                        doc_starts=doc_starts, blocks=block_ids_BS is not None,
                        block_spans=block_spans)  # fmt: skip
    o_BSNH, _ = _attn_op(q_BSNH, k_BSKH, v_BSKH, doc_ids_BS, block_ids_BS, sinks_N, float(scale),
                         bool(causal), [int(window[0]), int(window[1])], int(chunk),
                         float(softcap), ranges, int(block))  # fmt: skip
    return o_BSNH
