"""A transformers causal LM with the trainer's call (:class:`HFCausalLM`), and what its output
head computes (:func:`plain_head`, for the tiled loss and log-probabilities).

:class:`HFCausalLM` gives a transformers causal LM the call the trainer makes,
``model(input_ids, position_ids, layout=, labels=) -> float32 loss sum`` over this rank's slice,
with the transformers parameter names unchanged (it adopts the model's children).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from dtensor_ulysses.hf.models.moe import load_balancing_loss, router_loss_config
from dtensor_ulysses.models.loss import cross_entropy_sum, tiled_cross_entropy_sum
from dtensor_ulysses.parallel.global_loss import global_valid_tokens

__all__ = ["HFCausalLM", "config_head_dim", "plain_head"]

# config attributes that change the logits beyond ``h @ lm_head.weight.T``
_HEAD_EXTRAS = ("logit_scale", "logits_scaling", "final_logit_softcapping", "output_multiplier")


def config_head_dim(cfg: Any) -> int:
    """The largest attention head dim of a text config: its ``head_dim``, or per layer where
    transformers keeps per-layer values (Gemma 4's global layers: ``per_layer_config[i]``,
    whose global ``head_dim`` raises on access), else ``hidden_size / heads``."""
    dims = []
    with contextlib.suppress(RuntimeError):  # a per-layer attribute: read per layer below
        dims.append(int(getattr(cfg, "head_dim", 0) or 0))
    per_layer = getattr(cfg, "per_layer_config", None)
    if per_layer is not None:
        for i in range(int(cfg.num_hidden_layers)):
            dims.append(int(getattr(per_layer[i], "head_dim", 0) or 0))
    return max(dims, default=0) or int(cfg.hidden_size) // int(cfg.num_attention_heads)


def plain_head(model: Any) -> nn.Linear:
    """The output head, if the logits are exactly ``h @ lm_head.weight.T`` (what the tiled loss
    computes); else a ``ValueError`` naming what it does more."""
    cfg = model.config.get_text_config()
    head = model.get_output_embeddings()
    extras = [a for a in _HEAD_EXTRAS if getattr(cfg, a, None) not in (None, 1, 1.0)]
    if type(head) is not nn.Linear:
        extras.append(f"a {type(head).__name__}, not a plain Linear")
    elif head.bias is not None:
        extras.append("a bias")
    if extras:
        raise ValueError(
            f"the tiled loss computes h @ lm_head.weight.T, but the output head of "
            f"{type(model).__name__} does more ({', '.join(extras)}); train without the tiled loss"
        )
    return head


class HFCausalLM(nn.Module):
    """A transformers causal LM with the trainer's call; parameter names are transformers'.

    ``forward(input_ids, position_ids=None, *, layout=None, labels=None)``: this rank's slice in,
    and with ``labels`` (already shifted, ``-100`` for no loss) the float32 cross-entropy *sum*
    over the valid labels of the slice; without, the logits ``[B, s, V]``.

    A Mixture-of-Experts model whose stock forward adds a router loss (``output_router_logits``
    in its config) adds, in training, ``N * coef * share``: ``N`` the valid labels of the whole
    batch, ``share`` this rank's part of the load-balancing loss over every token of the batch
    (:func:`~dtensor_ulysses.hf.models.moe.load_balancing_loss`, over the ``dp x sp`` ranks that
    :func:`parallelize` recorded). Divided by ``N`` as the trainer divides the sum, the step's
    loss is the stock model's, cross entropy plus ``coef`` times the router loss, and so are its
    gradients. In evaluation (``model.eval()``) the sum stays the cross entropy's.

    Args:
        model: a transformers causal LM (``AutoModelForCausalLM``).
        loss_chunk_tokens: compute the loss from the final hidden states in chunks of this many
            tokens (:func:`~dtensor_ulysses.models.tiled_cross_entropy_sum`, no ``[B, s, V]``
            logits); needs a plain output head.
    """

    hf_model: PreTrainedModel

    def __init__(self, model: PreTrainedModel, *, loss_chunk_tokens: int | None = None) -> None:
        super().__init__()
        if not isinstance(model, PreTrainedModel):
            raise TypeError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
        self.__dict__["hf_model"] = model  # not a submodule: its children become ours
        for name, child in model.named_children():
            self.add_module(name, child)
        if any(True for _ in model.named_parameters(recurse=False)):
            raise ValueError(f"{type(model).__name__} has parameters outside its submodules")
        self.loss_chunk_tokens = loss_chunk_tokens
        if loss_chunk_tokens is not None:
            plain_head(model)

    @property
    def config(self) -> Any:
        return self.hf_model.config

    def train(self, mode: bool = True) -> HFCausalLM:
        super().train(mode)
        self.hf_model.training = mode
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        layout: Any = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {"input_ids": input_ids, "position_ids": position_ids}
        if layout is not None:
            kwargs["ulysses_layout"] = layout
        rc = router_loss_config(self.hf_model) if labels is not None and self.training else None
        if rc is not None and rc.enabled:
            kwargs["output_router_logits"] = True
        else:
            rc = None
        if labels is not None and self.loss_chunk_tokens is not None:
            out = self.hf_model.base_model(**kwargs)
            weight = self.hf_model.get_output_embeddings().weight
            loss = tiled_cross_entropy_sum(
                out.last_hidden_state, weight, labels, self.loss_chunk_tokens
            )
        else:
            out = self.hf_model(**kwargs)
            if labels is None:
                return out.logits
            loss = cross_entropy_sum(out.logits, labels)
        if rc is not None:
            assert labels is not None
            group = self.__dict__.get("_du_loss_group")
            n_valid = global_valid_tokens(labels, group)
            rl = load_balancing_loss(out.router_logits, rc.num_experts, rc.top_k, group)
            loss = loss + (n_valid * rc.coef) * rl.share.to(loss.dtype)
        return loss
