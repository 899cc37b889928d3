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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtensor_ulysses.data.batch import IGNORE_INDEX
from dtensor_ulysses.memory.tiling import tiled

__all__ = [
    "cross_entropy_sum",
    "tiled_cross_entropy_sum",
]


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
