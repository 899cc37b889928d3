"""The FlexAttention backend: documents, windows, chunks and bidirectional blocks as a block
mask, softcap as a ``score_mod``, sinks through the log-sum-exp.

Legend: ``B`` batch, ``S`` sequence, ``N`` q heads, ``K`` kv heads, ``H`` head dim, ``T`` the block
size (128), ``n = ceil(S / T)`` blocks.

The block mask is built from block-level facts, never from an ``S x S`` mask: for each pair of
(query block, key block), whether some key can be visible (the causal, window and chunk rules on
the blocks' first and last index; documents from the document ids of the blocks' first and last
token, which rise along a row; bidirectional blocks, which lift causality, from the least and
greatest block id in each block: a pair whose ranges overlap may share one) and whether all are
(then the block skips ``mask_mod``; never decided by a bidirectional block, only widened).
``[B, n, n]`` booleans: ``(S/128)^2`` per row, 1 MiB at 128K tokens. Partially visible blocks
apply the exact ``mask_mod``.

Sinks: FlexAttention returns ``o`` normalised by ``lse = log(sum_j exp(s_ij))`` and ``lse``
itself; with a sink logit ``z_h`` the true normaliser is ``log(exp(lse) + exp(z_h))``, so
``o_sinks = o * sigmoid(lse - z_h)``, differentiable in ``o``, ``lse`` and ``z`` (FlexAttention
takes the gradient of ``lse`` on CUDA).

Eager on CUDA it runs a ``torch.compile``\\ d ``flex_attention`` (the fused kernel); inside a
compiled region, ``flex_attention`` itself (the region compiles it). Eager on CPU, torch runs an
unfused reference that materialises the scores (forward only: for inference and tests).
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "flex_attention", "flex_block_mask"]

BLOCK = 128
_compiled: list = []  # the compiled flex_attention, built on first eager CUDA use


def flex_block_mask(
    S: int,
    device: torch.device,
    *,
    causal: bool,
    window: tuple[int, int],
    chunk: int,
    doc_ids_BS: torch.Tensor | None,
    block_ids_BS: torch.Tensor | None = None,
):
    """The :class:`~torch.nn.attention.flex_attention.BlockMask` of the mask rules (see the
    module docstring); its ``mask_mod`` is exact on partially visible blocks."""
    from torch.nn.attention.flex_attention import BlockMask

    T, n = BLOCK, -(-S // BLOCK)
    first = torch.arange(n, device=device) * T
    last = torch.clamp(first + T - 1, max=S - 1)
    qmin, qmax, kmin, kmax = first[:, None], last[:, None], first[None, :], last[None, :]
    anyv = torch.ones(n, n, dtype=torch.bool, device=device)
    full = anyv.clone()
    left, right = window
    causal_bnn = None
    if causal:
        causal_bnn = (kmin <= qmax)[None]
        full &= kmax <= qmin
        if block_ids_BS is not None:  # a shared block lifts causality: its id range per block
            B = block_ids_BS.shape[0]
            ids_BnT = torch.nn.functional.pad(block_ids_BS, (0, n * T - S), value=-1).view(B, n, T)
            hi_Bn = ids_BnT.amax(-1)
            lo_Bn = torch.where(ids_BnT >= 0, ids_BnT, hi_Bn.max() + 1).amin(-1)
            shares_Bnn = (lo_Bn[:, :, None] <= hi_Bn[:, None, :]) & (
                lo_Bn[:, None, :] <= hi_Bn[:, :, None]
            )
            causal_bnn = causal_bnn | (shares_Bnn & (hi_Bn[:, :, None] >= 0))
    if left >= 0:
        anyv &= kmax >= qmin - left
        full &= kmin >= qmax - left
    if right >= 0:
        anyv &= kmin <= qmax + right
        full &= kmax <= qmin + right
    if chunk > 0:
        cq0, cq1, ck0, ck1 = qmin // chunk, qmax // chunk, kmin // chunk, kmax // chunk
        anyv &= (ck0 <= cq1) & (ck1 >= cq0)
        full &= (cq0 == cq1) & (ck0 == ck1) & (cq0 == ck0)
    anyv_bnn, full_bnn = anyv[None], full[None]
    if causal_bnn is not None:
        anyv_bnn = anyv_bnn & causal_bnn
    if doc_ids_BS is not None:
        d0, d1 = doc_ids_BS[:, first], doc_ids_BS[:, last]  # [B, n]: ids rise along a row
        dq0, dq1, dk0, dk1 = d0[:, :, None], d1[:, :, None], d0[:, None, :], d1[:, None, :]
        anyv_bnn = anyv_bnn & (dk1 >= dq0) & (dk0 <= dq1)
        full_bnn = full_bnn & (dq0 == dq1) & (dk0 == dk1) & (dq0 == dk0)
    partial_bnn = anyv_bnn & ~full_bnn

    def blocks(sel_bnn):
        num = sel_bnn.sum(-1, dtype=torch.int32)
        idx = torch.argsort((~sel_bnn).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return num[:, None].contiguous(), idx[:, None].contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        ok = q_idx >= 0
        if causal and block_ids_BS is not None:
            bq = block_ids_BS[b, q_idx]
            ok = ok & ((kv_idx <= q_idx) | ((bq == block_ids_BS[b, kv_idx]) & (bq >= 0)))
        elif causal:
            ok = ok & (kv_idx <= q_idx)
        if left >= 0:
            ok = ok & (kv_idx >= q_idx - left)
        if right >= 0:
            ok = ok & (kv_idx <= q_idx + right)
        if chunk > 0:
            ok = ok & ((kv_idx // chunk) == (q_idx // chunk))
        if doc_ids_BS is not None:
            ok = ok & (doc_ids_BS[b, q_idx] == doc_ids_BS[b, kv_idx])
        return ok

    kv_num, kv_idx = blocks(partial_bnn)
    full_num, full_idx = blocks(full_bnn)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=T, mask_mod=mask_mod, seq_lengths=(S, S)
    )


def _flex_fn():
    from torch.nn.attention import flex_attention as fa

    return fa.flex_attention


def flex_attention(
    q_BSNH: torch.Tensor,
    k_BSKH: torch.Tensor,
    v_BSKH: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    window: tuple[int, int],
    chunk: int,
    softcap: float,
    sinks_N: torch.Tensor | None,
    doc_ids_BS: torch.Tensor | None,
    block_ids_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """``o[B, S, N, H]`` by FlexAttention (see the module docstring)."""
    from torch.nn.attention.flex_attention import AuxRequest

    S = q_BSNH.shape[1]
    block_mask = flex_block_mask(S, q_BSNH.device, causal=causal, window=window, chunk=chunk,
                                 doc_ids_BS=doc_ids_BS, block_ids_BS=block_ids_BS)  # fmt: skip
    score_mod = None
    if softcap > 0:
        cap = float(softcap)

        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

    fn = _flex_fn()
    if q_BSNH.device.type == "cuda" and not torch.compiler.is_compiling():
        if not _compiled:
            _compiled.append(torch.compile(fn, dynamic=False))
        fn = _compiled[0]
    q_BNSH, k_BKSH, v_BKSH = (t.transpose(1, 2) for t in (q_BSNH, k_BSKH, v_BSKH))
    o_BNSH, aux = fn(
        q_BNSH,
        k_BKSH,
        v_BKSH,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=k_BSKH.shape[2] != q_BSNH.shape[2],
        return_aux=AuxRequest(lse=True),
    )
    if sinks_N is not None:
        lse_BNS = aux.lse
        keep_BNS = torch.sigmoid(lse_BNS - sinks_N.to(lse_BNS.dtype)[None, :, None])
        o_BNSH = (o_BNSH * keep_BNS[..., None]).to(q_BSNH.dtype)
    return o_BNSH.transpose(1, 2)
