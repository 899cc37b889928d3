"""Packed-document boundaries as tensors, built once per step, so no layer syncs or recompiles.

A step's :class:`~dtensor_ulysses.plan.SeqLayout` gives the documents as Python ints
(``doc_starts``). Inside a compiled block those ints would be guards: every new layout would
recompile the block (and ``fullgraph=True`` hits the recompile limit after a few steps). So the
model converts them once per step, before the compiled blocks run, into :class:`DocTensors`:

* ``doc_ids[B, S]`` (int32, on the device): the document index of every token. Fixed shape, so
  the compiled kernels that mask with it (FlexAttention's block mask, the blockwise kernel; no
  ``S x S`` mask anywhere) never recompile;
* ``cu_seqlens_q`` and ``cu_seqlens_k`` (int32, on the device, contiguous): flash-attn's
  ``cu_seqlens`` over the ``B * S`` flattened tokens, two distinct tensors (dynamo refuses one
  tensor passed twice to an ``autograd.Function``). Their length (documents + 1) changes per step:
  dynamo makes that dimension dynamic after the first change (one recompile, then none);
* ``doc_starts`` and ``max_seqlen``, the host values, for eager code only (exact per-document
  SDPA, flash-attn's ``max_seqlen``, the blockwise kernel's skipped key blocks); compiled code
  passes ``max_seqlen = S`` instead, an upper bound flash-attn accepts (it sizes the grid;
  blocks past a document's end exit at once).

One host-to-device copy per step (all three tensors in one buffer), none per layer.

Bidirectional blocks (the tokens of one image, :attr:`~dtensor_ulysses.plan.SeqLayout.blocks`)
become ``block_ids[B, S]`` the same way (:func:`build_block_ids`: int32, ``-1`` outside a block),
attached to the layout beside the documents by :func:`with_doc_tensors`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

__all__ = [
    "DocTensors",
    "build_block_ids",
    "build_doc_tensors",
    "check_doc_starts",
    "with_doc_tensors",
]


@dataclass(frozen=True, eq=False)
class DocTensors:
    """A step's document boundaries on the device (see the module docstring)."""

    doc_ids: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    doc_starts: tuple[tuple[int, ...], ...]
    max_seqlen: int


def check_doc_starts(doc_starts: Sequence[Sequence[int]], B: int, S: int) -> None:
    """Raise ``ValueError`` unless every row is increasing, starts at 0 and stays below ``S``."""
    if len(doc_starts) != B:
        raise ValueError(f"doc_starts has {len(doc_starts)} rows for a batch of {B}")
    for b, row in enumerate(doc_starts):
        starts = list(row)
        if not starts or starts[0] != 0 or any(x >= y for x, y in zip(starts, starts[1:])):
            raise ValueError(
                f"doc_starts row {b} is {starts}: document starts must rise strictly from 0 "
                f"(every token belongs to a document)"
            )
        if starts[-1] >= S:
            raise ValueError(
                f"doc_starts row {b} is {starts}: the last start {starts[-1]} is not below the "
                f"sequence length S={S}"
            )


def build_doc_tensors(
    doc_starts: Sequence[Sequence[int]], S: int, device: torch.device | str
) -> DocTensors:
    """:class:`DocTensors` of per-row ``doc_starts`` over ``[B, S]`` tokens, on ``device``."""
    B = len(doc_starts)
    check_doc_starts(doc_starts, B, S)
    starts = tuple(tuple(int(x) for x in row) for row in doc_starts)
    bounds = [b * S + t for b, row in enumerate(starts) for t in row] + [B * S]
    longest = max(hi - lo for lo, hi in zip(bounds, bounds[1:]))
    flags = torch.zeros(B, S, dtype=torch.int32)
    for b, row in enumerate(starts):
        flags[b, list(row[1:])] = 1
    cu = torch.tensor(bounds, dtype=torch.int32)
    host = torch.cat([flags.cumsum(1, dtype=torch.int32).flatten(), cu, cu])
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    buf = host.to(device, non_blocking=True)  # the one copy of the step
    n = len(bounds)
    return DocTensors(
        doc_ids=buf[: B * S].view(B, S),
        cu_seqlens_q=buf[B * S : B * S + n],
        cu_seqlens_k=buf[B * S + n :],
        doc_starts=starts,
        max_seqlen=longest,
    )


def build_block_ids(
    blocks: Sequence[Sequence[tuple[int, int]]], S: int, device: torch.device | str
) -> torch.Tensor:
    """``block_ids[B, S]`` (int32 on ``device``) of per-row block spans ``(start, end)``: the
    blocks of a row numbered ``0, 1, ...`` in order, ``-1`` for a token in none."""
    ids = torch.full((len(blocks), S), -1, dtype=torch.int32)
    for b, spans in enumerate(blocks):
        for n, (lo, hi) in enumerate(spans):
            ids[b, lo:hi] = n
    return ids.to(device)


def with_doc_tensors(layout: Any, device: torch.device) -> Any:
    """``layout`` with its :class:`DocTensors` attached (a layout with packed documents and no
    ring; the ring keeps its own host-side masks) and its bidirectional blocks' ``block_ids``,
    else ``layout`` as it is."""
    if layout is None or torch.compiler.is_compiling():
        return layout
    blocks = getattr(layout, "blocks", None)
    if blocks is not None and layout.block_ids is None:
        layout = replace(layout, block_ids=build_block_ids(blocks, layout.seq_len, device))
    if layout.doc_starts is None or layout.ring != 1 or layout.doc_tensors is not None:
        return layout
    return replace(layout, doc_tensors=build_doc_tensors(layout.doc_starts, layout.seq_len, device))
