"""Per-token label log-probabilities of a sequence-sharded batch, for losses over whole rows.

Legend: ``B`` rows, ``S`` full length, ``s`` this sp rank's tokens, ``K`` values per token
(the log-probability, then :data:`~dtensor_ulysses.models.TOKEN_STATS` when asked for).

Preference and RL losses (DPO, KTO, GRPO, ...) are non-linear functions of sums over each row's
completion tokens, while each rank of an sp group holds one slice of every row. Here:

1. :func:`~dtensor_ulysses.hf.shard_batch` cuts the rows (labels shifted over the *full* row
   before slicing, so a slice's last token keeps its target);
2. the model runs on the slice with its output head in *log-prob mode* (:func:`logp_head`: the
   same ``Linear``, its class swapped for the call, returning
   :func:`~dtensor_ulysses.models.tiled_token_logps` in chunks: no ``[B, s, V]`` logits);
3. the slice's values reach every rank of the sp group through
   :func:`~dtensor_ulysses.comm.all_reduce_sum`, whose gradient passes through unchanged:
   correct because every sp rank then computes the *same* loss, and FSDP2 sums the ranks'
   gradients (see :mod:`dtensor_ulysses.comm.reduce`).

:func:`sequence_logps` returns the per-row sums (one all-reduce of ``B`` floats);
:func:`token_rows` the full per-token rows ``[B, S, K]`` (one all-reduce of ``B*S*K`` floats),
for code that masks and sums per token itself (TRL's own loss code, unchanged).

Only for sp ranks that all compute the same loss from the result, once each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ulysses.comm import all_reduce_sum
from dtensor_ulysses.hf.batch import ShardedBatch, shard_batch
from dtensor_ulysses.hf.models.causal_lm import plain_head
from dtensor_ulysses.hf.trainers import _state
from dtensor_ulysses.models import TOKEN_STATS, tiled_token_logps
from dtensor_ulysses.parallel.mesh import ParallelDims
from dtensor_ulysses.plan.splits import default_loss_chunk

__all__ = ["logp_head", "sequence_logps", "token_rows"]


class _LogpHead(nn.Linear):
    """The model's output head (same parameters, same names) that, while ``labels`` is set,
    returns the label log-probabilities of its input (``[B, s]``, or ``[B, s, K]`` with
    ``stats``) in chunks of ``chunk_tokens`` rows instead of logits."""

    labels: torch.Tensor | None = None
    chunk_tokens: int = 0
    stats: bool = False

    def forward(self, h_BsD: torch.Tensor) -> torch.Tensor:
        if self.labels is None:
            return super().forward(h_BsD)
        return tiled_token_logps(h_BsD, self.weight, self.labels, self.chunk_tokens,
                                 stats=self.stats)  # fmt: skip


@contextlib.contextmanager
def logp_head(model: nn.Module, labels_Bs: torch.Tensor, *, chunk_tokens: int | None = None,
              stats: bool = False) -> Iterator[nn.Linear]:  # fmt: skip
    """While inside, ``model``'s output head (a plain ``Linear``: no bias, softcap or logit
    scale) returns :func:`~dtensor_ulysses.models.tiled_token_logps` of ``labels_Bs`` (already
    shifted) as the model's ``logits``; restored on exit.

    Raises:
        ValueError: the head does more than ``h @ weight.T``.
    """
    hf: Any = _state.base_model(model)
    head: Any = plain_head(hf)
    head.__class__ = _LogpHead
    try:
        head.labels = labels_Bs
        head.chunk_tokens = chunk_tokens or default_loss_chunk(labels_Bs.numel())
        head.stats = stats
        yield head
    finally:
        for name in ("labels", "chunk_tokens", "stats"):
            head.__dict__.pop(name, None)
        head.__class__ = nn.Linear


def _slice_values(model: nn.Module, sb: ShardedBatch, chunk_tokens: int | None, stats: bool,
                  model_kwargs: Mapping[str, Any]) -> torch.Tensor:  # fmt: skip
    with logp_head(model, sb.labels, chunk_tokens=chunk_tokens, stats=stats):
        out = model(input_ids=sb.input_ids, position_ids=sb.position_ids,
                    ulysses_layout=sb.layout, use_cache=False, **model_kwargs)  # fmt: skip
    values = out.logits
    want = (*sb.labels.shape, 1 + len(TOKEN_STATS)) if stats else tuple(sb.labels.shape)
    if tuple(values.shape) != want:
        raise RuntimeError(
            f"the model changed its output head's result (log-prob mode): got shape "
            f"{tuple(values.shape)}, expected {want}"
        )
    return values


def token_rows(
    model: nn.Module,
    batch: Any,
    mesh: DeviceMesh | ParallelDims,
    *,
    chunk_tokens: int | None = None,
    stats: bool = False,
    **model_kwargs: Any,
) -> tuple[torch.Tensor, ShardedBatch]:
    """The full rows of per-token values on every rank of the sp group.

    Args:
        model: a model prepared by :func:`~dtensor_ulysses.hf.parallelize` (or a PEFT wrapper of
            one); its output head must be a plain ``Linear``.
        batch: ``input_ids [B, S]``, ``labels`` (unshifted, ``-100`` for none; default the
            inputs), ``attention_mask``, ``position_ids``, as
            :func:`~dtensor_ulysses.hf.shard_batch` takes them; every sp rank of a dp group
            passes the same rows.
        mesh: the ``("dp", "sp")`` mesh, or its :class:`~dtensor_ulysses.parallel.ParallelDims`
            bound to it. A batch whose cut would leave a rank no token is padded at the end
            (masked, no labels; :func:`~dtensor_ulysses.hf.shard_batch`).
        chunk_tokens: logit rows at a time (default ``min(2048, B * s)``).
        stats: also the per-token statistics (no gradient).
        **model_kwargs: more keyword arguments of the model's forward.

    Returns:
        ``(values, sharded)``: ``values`` ``[B, S]`` float32 (``[B, S, K]`` with ``stats``),
        position ``t`` the log-probability of token ``t + 1`` given tokens ``<= t`` (``0`` where
        no label, and at ``S - 1``); differentiable (see the module docstring). ``sharded`` is
        this rank's :class:`~dtensor_ulysses.hf.ShardedBatch`.
    """
    S = batch["input_ids"].shape[1]
    dims = ParallelDims.of(mesh)
    sb = shard_batch(batch, dims, count_valid=False)
    local = _slice_values(model, sb, chunk_tokens, stats, model_kwargs)
    sizes = sb.layout.seq_sizes
    if len(sizes) == 1:
        return local, sb
    lo = sb.layout.offset(dims.sp_rank)
    pad = (0, 0) if stats else ()
    # zeros outside this rank's slice (and no columns past S: shard_batch's padding)
    full = F.pad(local, (*pad, lo, sum(sizes) - lo - local.shape[1]))[:, :S]
    return all_reduce_sum(full, dims.sp_mesh.get_group()), sb


def sequence_logps(
    model: nn.Module,
    batch: Any,
    mesh: DeviceMesh | ParallelDims,
    *,
    chunk_tokens: int | None = None,
    **model_kwargs: Any,
) -> torch.Tensor:
    """``[B]`` float32: each row's sum of its label log-probabilities over the *whole* row (all
    sp ranks' slices), on every rank of the sp group; differentiable (see the module
    docstring). Arguments as :func:`token_rows`; one all-reduce of ``B`` floats."""
    dims = ParallelDims.of(mesh)
    sb = shard_batch(batch, dims, count_valid=False)
    local_B = _slice_values(model, sb, chunk_tokens, False, model_kwargs).sum(1)
    if len(sb.layout.seq_sizes) == 1:
        return local_B
    return all_reduce_sum(local_B, dims.sp_mesh.get_group())
