"""A padded or packed batch (transformers convention) to this rank's sequence slice.

Legend: ``B`` rows of this dp rank, ``S`` full length, ``s`` this sp rank's piece (DTensor's
``Shard(1)`` cut, :func:`~dtensor_ulysses.plan.seq_split`; uneven ``S`` is fine).

transformers' causal-LM ``labels`` are the inputs themselves (the model shifts them inside its
loss). Cut into slices, the last token of a slice would lose its target, so here labels are
shifted over the *full* sequence first (``labels[:, t] <- labels[:, t + 1]``, the last one
``-100``), then sliced. Padding (``attention_mask == 0``) is never attended to: each contiguous
run of real tokens becomes a document of the layout, and positions whose input or target is
padding get label ``-100``. Position ids stay global (given, or ``0..S-1``); packed documents
(position ids restarting at 0) become the layout's document starts. The valid-token count is
summed over the ``dp x sp`` ranks, for the loss ``sum / n_valid``. The cut itself is the one slicer
(:func:`dtensor_ulysses.data.slice_batch`), so a ``("dp", "ring", "sp")`` mesh gets its zigzag
tokens.

A batch whose cut would leave a rank no token (``S < sp``: a one-token or empty text row at
batch 1; also ``S=5`` at ``sp=4``, cut ``[2, 2, 1, 0]``) is padded at the end to
:func:`~dtensor_ulysses.plan.splits.padded_seq_len` (``S=2, sp=4 -> 4``; ``5 -> 7``): the
padding columns are a document of their own with label ``-100`` (input id 0, attention mask
0), so every rank holds at least one token and no real token's result changes (causal
attention never reads a later column). ``layout.seq_len`` is then the padded length; the
first ``S`` columns of anything gathered over sp are the batch's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ulysses.attention.local import starts_from_positions
from dtensor_ulysses.data.batch import IGNORE_INDEX, full_batch, slice_batch
from dtensor_ulysses.parallel.global_loss import global_valid_tokens
from dtensor_ulysses.parallel.mesh import ParallelDims
from dtensor_ulysses.plan.splits import SeqLayout, padded_seq_len

__all__ = ["ShardedBatch", "shard_batch"]


@dataclass
class ShardedBatch:
    """This rank's slice of a batch, ready for the model and the loss.

    Attributes:
        input_ids: ``[B, s]`` token ids.
        labels: ``[B, s]`` targets, already shifted (``-100``: no loss).
        position_ids: ``[B, s]`` global positions (per document when packed).
        layout: the batch's :class:`~dtensor_ulysses.plan.SeqLayout` (pieces, documents).
        n_valid: valid labels of the whole batch over all ``dp x sp`` ranks.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    layout: SeqLayout
    n_valid: int

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments for a model prepared by :func:`~dtensor_ulysses.hf.apply_ulysses`
        (no ``labels``: the targets are already shifted, use them with
        :func:`~dtensor_ulysses.models.cross_entropy_sum`)."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "ulysses_layout": self.layout,
        }

    def to(self, device: torch.device | str) -> ShardedBatch:
        ids, labels, pos = (t.to(device) for t in (self.input_ids, self.labels, self.position_ids))
        return ShardedBatch(ids, labels, pos, self.layout, self.n_valid)


def _get(batch: Any, key: str) -> Any:
    if isinstance(batch, Mapping):
        return batch.get(key)
    return getattr(batch, key, None)


def _runs(mask_BS: torch.Tensor) -> list[list[int]]:
    """Per row, the starts of the runs of equal mask values; ones must be contiguous."""
    out = []
    for b, row in enumerate(mask_BS.to(torch.int64).cpu()):
        change = (row[1:] != row[:-1]).nonzero().flatten().add(1).tolist()
        starts = [0, *change]
        ones = [i for i in starts if row[i] == 1]
        if len(ones) > 1:
            raise ValueError(
                f"attention_mask row {b} has {len(ones)} separate runs of real tokens; only "
                f"left or right padding is supported (for packed documents pass position_ids "
                f"restarting at 0 per document and an all-ones mask)"
            )
        out.append(starts)
    return out


def _pad_columns(
    ids_BS: torch.Tensor,
    labels_BS: torch.Tensor,
    mask_BS: torch.Tensor | None,
    pos_BS: torch.Tensor,
    extra: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``extra`` padding columns appended: input id 0, label ``-100``, attention mask 0 (an
    all-ones mask where there was none), positions continuing the row's (a document of their
    own through the mask)."""
    B, S = ids_BS.shape
    if mask_BS is None:
        mask_BS = torch.ones((B, S), dtype=torch.bool, device=ids_BS.device)
    mask_BS = mask_BS.to(ids_BS.device, torch.bool)
    tail = torch.arange(1, extra + 1, device=pos_BS.device)
    more = tail - 1 if S == 0 else pos_BS[:, -1:] + tail
    return (
        F.pad(ids_BS, (0, extra), value=0),
        F.pad(labels_BS, (0, extra), value=IGNORE_INDEX),
        F.pad(mask_BS, (0, extra), value=False),
        torch.cat([pos_BS, more.to(pos_BS.dtype).expand(B, extra)], 1),
    )


def shard_batch(
    batch: Any, mesh: DeviceMesh | ParallelDims, *, count_valid: bool = True
) -> ShardedBatch:
    """This rank's slice of a ``[B, S]`` batch; call on every rank (one all-reduce).

    Args:
        batch: a mapping or object with ``input_ids [B, S]`` and optional ``labels`` (transformers
            convention: unshifted, ``-100`` for no loss; default: ``input_ids``),
            ``attention_mask`` (1 real, 0 padding; left or right padding) and ``position_ids``
            (global; restarting at 0 per packed document). Every sp rank of a dp group passes
            the same batch.
        mesh: the ``("dp", "sp")`` mesh (or ``("dp", "ring", "sp")``), or its
            :class:`~dtensor_ulysses.parallel.ParallelDims` bound to it (what a trainer
            holds: nothing is rebuilt per step).
        count_valid: count the batch's valid labels over ``dp x sp`` (the all-reduce; raises
            when there are none); ``False``: no collective, ``n_valid`` is 0 (the caller
            counts, e.g. over a gradient-accumulation window).

    Returns:
        A :class:`ShardedBatch` on the device of ``input_ids``; a batch whose cut would leave
        a rank no token is padded at the end first (module docstring), so ``layout.seq_len``
        may exceed ``S``.
    """
    ids = _get(batch, "input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("batch['input_ids'] must be a [B, S] tensor")
    B, S = ids.shape
    labels = _get(batch, "labels")
    labels = ids.clone() if labels is None else labels.to(ids.device, torch.int64).clone()
    mask = _get(batch, "attention_mask")
    pos = _get(batch, "position_ids")
    for name, t in (("labels", labels), ("attention_mask", mask), ("position_ids", pos)):
        if t is not None and t.shape[-1] != S:
            raise ValueError(f"batch[{name!r}] has shape {tuple(t.shape)}; expected [B, {S}]")
    pos = (
        torch.arange(S, device=ids.device).expand(B, S)
        if pos is None
        else pos.to(ids.device).expand(B, S)
    )
    dims = ParallelDims.of(mesh)
    padded = padded_seq_len(S, dims.sp, dims.ring)
    if padded > S:  # no rank may hold an empty slice: padding columns at the end
        ids, labels, mask, pos = _pad_columns(ids, labels, mask, pos, padded - S)
    starts = starts_from_positions(pos)
    if mask is not None:
        mask = mask.to(ids.device).bool()
        for b, extra in enumerate(_runs(mask)):
            starts[b] = sorted(set(starts[b]) | set(extra))
        labels[~mask] = IGNORE_INDEX
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    if mask is not None:
        shifted[~mask] = IGNORE_INDEX  # no loss where the input is padding
    docs = None if all(len(r) == 1 for r in starts) else tuple(tuple(r) for r in starts)
    out = slice_batch(full_batch(ids, shifted, pos, docs), **dims.cut())
    n_valid = global_valid_tokens(out.labels, dims.flat_mesh.get_group()) if count_valid else 0
    return ShardedBatch(out.input_ids, out.labels, out.position_ids, out.layout, n_valid)
