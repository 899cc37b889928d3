"""Gemma's bidirectional image blocks under Ulysses: which layers have them, and the step's
blocks from the model's own token types.

Legend: ``B`` rows, ``S`` full length, ``P`` ranks of the sp group.

Gemma 3 (``Gemma3ForConditionalGeneration``) lets the tokens of one image attend to each other
both ways inside causal text attention, on every layer; Gemma 4
(``Gemma4ForConditionalGeneration`` with ``use_bidirectional_attention="vision"``) on its
sliding-window layers only (its global layers stay causal). transformers builds that mask from
the token types of the full rows (``token_type_ids == 1``, Gemma 4's ``mm_token_type_ids`` in
``{1, 2}``): a block is a maximal run of such tokens (``get_block_sequence_ids_for_mask``), and
the mask is ``(causal or same block) and window``.

Under Ulysses each rank's kernel sees the full sequence of its heads, so the blocks are a
property of the step: :func:`install` puts a forward pre-hook on the multimodal base model
(``Gemma3Model``), which is called on the full rows
(:mod:`~dtensor_ulysses.hf.models.vision`), reads their token types and adds the blocks to the
step's
:class:`~dtensor_ulysses.plan.SeqLayout` (``blocks``: per row, each block's ``(start, end)``):
one device-to-host copy of ``[B, S]`` small ints per step, no collective (every rank of an sp
group holds the same rows). It also takes the ``attention_mask`` away from the model (which
would build its masks from it before the decoder): padding is already in the layout's
documents (:func:`~dtensor_ulysses.hf.shard_batch`); a padding mask without a layout is
refused. Each attention layer whose features say so
(:attr:`~dtensor_ulysses.hf.models.routing.LayerFeatures.blocks`) runs the kernel feature of
bidirectional blocks (``attention.local_attention(block_ids=)``: the blockwise kernel, or
FlexAttention on CUDA; no ``S x S`` mask); the other layers get the layout without them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtensor_ulysses.plan.splits import SeqLayout, padded_seq_len, seq_split

__all__ = ["ImageBlocks", "block_spans", "image_blocks", "install"]

_HOOK = "_du_image_blocks_hook"


@dataclass(frozen=True)
class ImageBlocks:
    """How a model marks its bidirectional image blocks.

    Attributes:
        key: the model's keyword argument of per-token types (``token_type_ids``).
        types: the type values whose runs form blocks.
        layer_types: the ``config.layer_types`` with blocks (``None``: every layer).
    """

    key: str
    types: tuple[int, ...]
    layer_types: tuple[str, ...] | None = None

    def on_layer(self, layer_type: str | None) -> bool:
        """Whether a layer of ``layer_type`` attends bidirectionally within a block."""
        return self.layer_types is None or layer_type in self.layer_types


def image_blocks(model: nn.Module) -> ImageBlocks | None:
    """The image blocks of a transformers model (its top-level config's ``model_type``), or
    ``None``: a model whose attention has none."""
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type == "gemma3" and getattr(cfg, "vision_config", None) is not None:
        return ImageBlocks("token_type_ids", (1,))
    if model_type == "gemma4" and getattr(cfg, "vision_config", None) is not None:
        text = cfg.get_text_config()  # type: ignore[union-attr]
        if getattr(text, "use_bidirectional_attention", None) == "vision":
            return ImageBlocks("mm_token_type_ids", (1, 2), ("sliding_attention",))
    return None


def block_spans(
    types_BS: torch.Tensor, values: tuple[int, ...]
) -> tuple[tuple[tuple[int, int], ...], ...] | None:
    """Per row, the ``(start, end)`` of each maximal run of tokens whose type is in ``values``
    (transformers' ``get_block_sequence_ids_for_mask``); ``None`` when no row has one."""
    host = torch.isin(types_BS.detach().to("cpu", torch.int64), torch.tensor(values))
    rows = []
    for row in host.to(torch.int8):
        edges = torch.diff(torch.nn.functional.pad(row, (1, 1))).nonzero().flatten().tolist()
        rows.append(tuple(zip(edges[::2], edges[1::2])))
    return tuple(rows) if any(rows) else None


def _pre_forward(
    base: nn.Module,
    args: tuple,
    kwargs: dict,
    params: list[str],
    blocks: ImageBlocks,
    group: dist.ProcessGroup,
):
    kwargs = dict(kwargs)
    for name, value in zip(params, args):
        kwargs[name] = value
    layout: SeqLayout | None = kwargs.get("ulysses_layout")
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor):  # padding: the layout's documents (shard_batch)
        if layout is None and not bool(mask.all()):
            raise ValueError(
                "an attention_mask with padding needs the batch's layout: pass the rows through "
                "du.hf.shard_batch and call the model with ulysses_layout=sb.layout"
            )
        del kwargs["attention_mask"]  # the model would build its mask from it, for the slice
    types = kwargs.get(blocks.key)
    if types is None:
        return (), kwargs
    x = kwargs.get("input_ids")
    x = kwargs.get("inputs_embeds") if x is None else x
    B, S = int(types.shape[0]), int(types.shape[-1])
    if x is not None and tuple(x.shape[:2]) != (B, S):
        raise ValueError(
            f"{blocks.key} has shape {tuple(types.shape)} but the inputs are "
            f"{tuple(x.shape[:2])}: a vision-language model under Ulysses takes the full rows"
        )
    spans = block_spans(types, blocks.types)
    if spans is None:
        return (), kwargs
    P = dist.get_world_size(group)
    if layout is None:  # as shard_batch cuts (padded where a rank would be empty)
        layout = SeqLayout(tuple(seq_split(padded_seq_len(S, P), P)))
    if layout.seq_len not in (S, padded_seq_len(S, P)):
        raise ValueError(
            f"ulysses_layout covers {layout.seq_len} tokens, the rows have {S}: pass the layout "
            f"of this batch"
        )
    if layout.blocks is not None and layout.blocks != spans:
        raise ValueError(
            f"ulysses_layout has image blocks {layout.blocks}, but the model's {blocks.key} give "
            f"{spans}: pass the layout of this batch"
        )
    kwargs["ulysses_layout"] = replace(layout, blocks=spans, block_ids=None)
    return (), kwargs


def install(model: Any, group: dist.ProcessGroup) -> ImageBlocks | None:
    """Add the step's image blocks to its layout on every forward of ``model``'s base model
    (see the module docstring); idempotent. Returns the model's :class:`ImageBlocks` or
    ``None`` (nothing installed)."""
    blocks = image_blocks(model)
    base = model.base_model
    old = base.__dict__.pop(_HOOK, None)
    if old is not None:
        old.remove()
    if blocks is None:
        return None
    params = list(inspect.signature(base.forward).parameters)
    base.__dict__[_HOOK] = base.register_forward_pre_hook(
        lambda mod, args, kwargs: _pre_forward(mod, args, kwargs, params, blocks, group),
        with_kwargs=True,
        prepend=True,
    )
    return blocks
