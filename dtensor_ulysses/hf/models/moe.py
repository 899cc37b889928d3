"""The Mixture-of-Experts router (load-balancing) loss over the global batch.

Legend: ``T`` router rows of this rank (its ``B x s`` tokens, flattened batch-major), ``E``
experts, ``k`` experts per token.

The stock models (Mixtral, Qwen3-MoE, gpt-oss, Qwen3-Next, Qwen3.5-MoE: each modeling file's
``load_balancing_loss_func``) add ``coef * L`` to the loss, with

    L = E * sum_e f_e * P_e,
    f_e = (top-k slots routed to e, summed over layers) / (rows * layers),
    P_e = (router probabilities of e, summed over rows and layers) / (rows * layers),

rows counted over every (unpadded) token the model sees in one call. ``L`` is a product of
batch-wide statistics, so it is *not* the sum or mean of per-slice losses: a rank holding a
sequence slice (sp) of some rows (dp) must combine its statistics with every other rank's before
the product. :func:`load_balancing_loss` does it without a differentiable collective: one
all-reduce (no gradient) of ``[counts_e, prob sums_e, rows]`` over the group that shares the
batch (``dp x sp``), then this rank's *share*

    share = E * sum_e f_e * (sum of this rank's probabilities for e) / rows_global,

with the global ``f``. The shares of all ranks add up to ``L`` (the ``P`` term is linear in each
rank's probability sums and ``f`` carries no gradient, as in the stock function: ``topk`` and
the counts are not differentiable), so with gradients *summed* over the ranks (FSDP2 here) each
router receives exactly the single-process gradient. The value of ``L`` itself (what the stock
model returns as ``aux_loss``) comes from the same all-reduce.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["RouterLoss", "RouterLossConfig", "load_balancing_loss", "router_loss_config"]


@dataclass(frozen=True)
class RouterLossConfig:
    """What a model's stock forward uses for its load-balancing loss.

    Attributes:
        num_experts: ``E`` (the model's ``num_experts``).
        top_k: ``k`` (its ``num_experts_per_tok``).
        coef: the loss weight (its ``router_aux_loss_coef``).
        enabled: the config's ``output_router_logits`` (the stock forward adds the loss only then).
    """

    num_experts: int
    top_k: int
    coef: float
    enabled: bool


@dataclass(frozen=True)
class RouterLoss:
    """The global load-balancing loss, as one rank holds it.

    Attributes:
        share: this rank's term (differentiable); the terms of all ranks add up to ``value``.
        value: ``L`` over the global batch (no gradient; equal on every rank).
    """

    share: torch.Tensor
    value: torch.Tensor


def router_loss_config(model: nn.Module) -> RouterLossConfig | None:
    """The load-balancing loss the stock forward of ``model`` computes, or ``None``.

    ``None`` when the model's modeling file has no ``load_balancing_loss_func`` (dense models,
    and MoE models trained without an auxiliary loss, e.g. GLM-4-MoE's bias-balanced router or
    Llama 4), or the model lacks the attributes its forward reads.

    Args:
        model: a transformers causal LM (a PEFT wrapper or :class:`~dtensor_ulysses.hf.
            HFCausalLM` is looked through).
    """
    hf = model.__dict__.get("hf_model", model)
    get_base = getattr(hf, "get_base_model", None)
    if callable(get_base):  # PEFT
        hf = get_base()
    modules = [sys.modules.get(c.__module__) for c in type(hf).__mro__]  # FSDP2 subclasses it
    if not any(callable(getattr(m, "load_balancing_loss_func", None)) for m in modules):
        return None
    num_experts = getattr(hf, "num_experts", None)
    top_k = getattr(hf, "num_experts_per_tok", None)
    coef = getattr(hf, "router_aux_loss_coef", None)
    if num_experts is None or top_k is None or coef is None:
        return None
    enabled = bool(getattr(hf.config, "output_router_logits", False))
    return RouterLossConfig(int(num_experts), int(top_k), float(coef), enabled)


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...] | list[torch.Tensor],
    num_experts: int,
    top_k: int,
    group: Any = None,
    *,
    valid: torch.Tensor | None = None,
) -> RouterLoss:
    """The stock ``load_balancing_loss_func`` over every token of the ranks in ``group``.

    Args:
        router_logits: per router layer, ``[T, E]`` logits of this rank's tokens (the model's
            ``outputs.router_logits``, rows batch-major like ``valid``).
        num_experts: ``E``.
        top_k: ``k``.
        group: the process group that shares the batch (``dp x sp``: every rank holding a
            slice of it), a 1-D device mesh, or ``None`` for one process.
        valid: ``[B, s]`` (or ``[T]``) 1 for a real token, 0 for padding (the stock function's
            ``attention_mask``); ``None``: every row counts.

    Returns:
        The rank's :class:`RouterLoss`; ``share`` summed over ``group`` is ``value``.

    Raises:
        ValueError: no router layers, or rows that do not match ``valid`` or ``num_experts``.
    """
    logits = list(router_logits) if router_logits is not None else []
    if not logits:
        raise ValueError(
            "no router logits: call the model with output_router_logits=True (an MoE model)"
        )
    dev = logits[0].device
    E = num_experts
    mask_T = None
    if valid is not None:
        mask_T = valid.reshape(-1).to(device=dev, dtype=torch.float32)
    counts_E = torch.zeros(E, dtype=torch.float32, device=dev)
    probs_E = torch.zeros(E, dtype=torch.float32, device=dev)
    rows = torch.zeros((), dtype=torch.float32, device=dev)
    for i, layer_TE in enumerate(logits):
        if layer_TE.dim() != 2 or layer_TE.shape[1] != E:
            raise ValueError(
                f"router layer {i} gives logits of shape {tuple(layer_TE.shape)}, not [T, "
                f"{E}] (num_experts={E})"
            )
        if mask_T is not None and mask_T.numel() != layer_TE.shape[0]:
            raise ValueError(
                f"router layer {i} has {layer_TE.shape[0]} rows but valid has {mask_T.numel()}"
            )
        p_TE = torch.softmax(layer_TE.to(dev), dim=-1)
        _, top_Tk = torch.topk(p_TE, top_k, dim=-1)
        w_T = mask_T if mask_T is not None else p_TE.new_ones(p_TE.shape[0], dtype=torch.float32)
        counts_E = counts_E.scatter_add(0, top_Tk.reshape(-1), w_T.repeat_interleave(top_k))
        probs_E = probs_E + (p_TE.float() * w_T.unsqueeze(-1)).sum(0)
        rows = rows + w_T.sum()
    stats = torch.cat([counts_E, probs_E.detach(), rows.reshape(1)]).to(torch.float64)
    pg = _group(group)
    if pg is not None and dist.get_world_size(pg) > 1:
        dist.all_reduce(stats, group=pg)
    counts_g, probs_g, rows_g = stats[:E], stats[E : 2 * E], stats[2 * E]
    f_E = (counts_g / rows_g).to(torch.float32)
    share = E * (f_E * probs_E).sum() / rows_g.to(torch.float32)
    value = (E * (counts_g / rows_g * probs_g / rows_g).sum()).to(torch.float32)
    return RouterLoss(share, value)


def _group(group: Any) -> Any:
    if group is None or not dist.is_initialized():
        return None
    if hasattr(group, "get_group"):  # a 1-D device mesh
        return group.get_group()
    return group
