"""Independent single-process references, written without any code from ``dtensor_ulysses``.

Legend: B batch, S sequence, N q heads, K kv heads, H head dim.
"""

from __future__ import annotations

import math

import torch


def reference_attention(
    q_BSNH: torch.Tensor,
    k_BSKH: torch.Tensor,
    v_BSKH: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Naive softmax attention, one head at a time; q head ``n`` uses kv head ``n // (N // K)``."""
    B, S, N, H = q_BSNH.shape
    K = k_BSKH.shape[2]
    group = N // K
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(H)
    future = torch.ones(S, S, dtype=torch.bool, device=q_BSNH.device).triu(diagonal=1)
    heads = []
    for n in range(N):
        q_BSH, k_BSH, v_BSH = q_BSNH[:, :, n], k_BSKH[:, :, n // group], v_BSKH[:, :, n // group]
        scores_BSS = torch.einsum("bih,bjh->bij", q_BSH, k_BSH) * scale
        if causal:
            scores_BSS = scores_BSS.masked_fill(future, float("-inf"))
        weights_BSS = torch.softmax(scores_BSS, dim=-1)
        heads.append(torch.einsum("bij,bjh->bih", weights_BSS, v_BSH))
    return torch.stack(heads, dim=2)


def reference_adamw(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    """Plain AdamW with the trainer's settings: weight decay 0.1 on matrices, none on vectors,
    betas (0.9, 0.95), eps 1e-8."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8,
    )  # fmt: skip
