"""Token-weighted cross entropy across sequence and data shards.

The single-device loss of a global batch is the mean over its valid tokens (label != -100)::

    L = sum_{all tokens t} ce(t) / T_valid

Each rank holds a slice of the tokens (its dp samples, its sp slice of each), so it computes
``sum_{its tokens} ce(t) / T_valid`` with the *global* count ``T_valid`` (one all-reduce of one
integer over the ``dp x sp`` group, :func:`dtensor_ulysses.parallel.global_valid_tokens`); the
rank losses add up to ``L`` and so do their gradients,
which FSDP2 sums (``du.parallelize`` sets its gradient divide factor to 1). Whatever (dp, sp) is,
loss and gradients equal the single-device run.

:func:`tiled_cross_entropy_sum` computes the same sum without materializing ``[B, s, V]`` logits:
chunks of the sequence are projected, scored and discarded, and recomputed in backward, where
the hidden states' gradient is written chunk by chunk into one tensor
(:mod:`dtensor_ulysses.memory.tiling`).

:func:`tiled_token_logps` is the same pass for losses over whole sequences (preference and RL
trainers): the float32 log-probability of each label, per token, again without ``[B, s, V]``
logits; on request also the per-token statistics TRL logs (entropy, mean logit, whether the
label is the argmax), computed from the same chunk of logits and carried without gradient.

Legend: ``B`` rows, ``s`` this rank's tokens of a row, ``D`` hidden size, ``V`` vocabulary,
``T = B * s`` rows of the flattened slice, ``C`` rows of one chunk, ``K`` values per token.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dtensor_ulysses.data.batch import IGNORE_INDEX
from dtensor_ulysses.memory.tiling import tiled

__all__ = [
    "TOKEN_STATS",
    "cross_entropy_sum",
    "tiled_cross_entropy_sum",
    "tiled_token_logps",
    "token_logps",
]

# what ``tiled_token_logps(..., stats=True)`` returns after the log-probability, in this order
TOKEN_STATS = ("entropy", "mean_logits", "is_top1")


def cross_entropy_sum(logits_BsV: torch.Tensor, labels_Bs: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross entropy over valid labels, in float32."""
    return F.cross_entropy(
        logits_BsV.flatten(0, 1).float(),
        labels_Bs.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def _chunk_ce_sum(h_CD: torch.Tensor, weight_VD: torch.Tensor, labels_C: torch.Tensor):
    return F.cross_entropy(
        (h_CD @ weight_VD.t()).float(), labels_C, ignore_index=IGNORE_INDEX, reduction="sum"
    )


def tiled_cross_entropy_sum(
    h_BsD: torch.Tensor, weight_VD: torch.Tensor, labels_Bs: torch.Tensor, chunk_tokens: int = 4096
) -> torch.Tensor:
    """:func:`cross_entropy_sum` of ``h @ weight.T``, at most ``chunk_tokens`` logit rows at once.

    Args:
        h_BsD: final hidden states.
        weight_VD: output projection (``Transformer.output_weight()``).
        labels_Bs: labels, ``IGNORE_INDEX`` where no loss is taken.
        chunk_tokens: rows of logits materialized at a time, forward and backward.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    h_TD, labels_T = h_BsD.flatten(0, 1), labels_Bs.flatten()
    return tiled(_chunk_ce_sum, h_TD, [weight_VD], chunk_tokens, extras=[labels_T], reduce="sum")


def _chunk_token_logps(h_CD: torch.Tensor, weight_VD: torch.Tensor, labels_C: torch.Tensor,
                       stats: bool = False) -> torch.Tensor:  # fmt: skip
    """``[C]`` log-probabilities of the labels (``0`` where ``IGNORE_INDEX``), or with ``stats``
    ``[C, 1 + len(TOKEN_STATS)]``: the log-probability (differentiable), then the statistics
    (no gradient; ``0`` where ``IGNORE_INDEX``)."""
    logits_CV = (h_CD @ weight_VD.t()).float()
    valid_C = labels_C != IGNORE_INDEX
    target_C = labels_C.clamp(min=0)
    logz_C = logits_CV.logsumexp(-1)
    logp_C = logits_CV.gather(-1, target_C[:, None]).squeeze(-1) - logz_C
    logp_C = torch.where(valid_C, logp_C, torch.zeros_like(logp_C))
    if not stats:
        return logp_C
    with torch.no_grad():
        p_CV = (logits_CV - logz_C[:, None]).exp()
        entropy_C = logz_C - (p_CV * logits_CV).sum(-1)
        mean_C = logits_CV.mean(-1)
        top1_C = (logits_CV.argmax(-1) == target_C).float()
        extra_CK = torch.stack([entropy_C, mean_C, top1_C], -1) * valid_C[:, None]
    return torch.cat([logp_C[:, None], extra_CK], -1)


def token_logps(logits_BsV: torch.Tensor, labels_Bs: torch.Tensor) -> torch.Tensor:
    """``[B, s]`` float32 log-probabilities of the labels from full logits, ``0`` where the label
    is ``IGNORE_INDEX`` (the reference :func:`tiled_token_logps` equals)."""
    logp_BsV = logits_BsV.float().log_softmax(-1)
    valid_Bs = labels_Bs != IGNORE_INDEX
    logp_Bs = logp_BsV.gather(-1, labels_Bs.clamp(min=0)[..., None]).squeeze(-1)
    return torch.where(valid_Bs, logp_Bs, torch.zeros_like(logp_Bs))


def tiled_token_logps(
    h_BsD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_Bs: torch.Tensor,
    chunk_tokens: int = 4096,
    *,
    stats: bool = False,
) -> torch.Tensor:
    """:func:`token_logps` of ``h @ weight.T``, at most ``chunk_tokens`` logit rows at once,
    forward and backward (:func:`~dtensor_ulysses.memory.tiled`).

    Args:
        h_BsD: final hidden states.
        weight_VD: output projection.
        labels_Bs: labels (already shifted: the next token), ``IGNORE_INDEX`` where none.
        chunk_tokens: rows of logits materialized at a time.
        stats: also return, per token and without gradient, ``TOKEN_STATS``: the entropy of
            the next-token distribution, the mean logit over the vocabulary, and ``1.0`` where
            the label is the argmax (all ``0`` where the label is ``IGNORE_INDEX``).

    Returns:
        ``logp[B, s]`` (float32), or with ``stats`` ``[B, s, 1 + len(TOKEN_STATS)]`` whose
        column 0 is ``logp``.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    B, s = labels_Bs.shape
    h_TD, labels_T = h_BsD.flatten(0, 1), labels_Bs.flatten()
    fn = functools.partial(_chunk_token_logps, stats=stats)
    out = tiled(fn, h_TD, [weight_VD], chunk_tokens, extras=[labels_T], reduce="rows")
    return out.view(B, s, *out.shape[1:])
