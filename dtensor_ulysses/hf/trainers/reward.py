"""TRL's ``RewardTrainer`` under :func:`~dtensor_ulysses.hf.with_ulysses`: the pairwise loss of
rewards read at each row's last non-padding token, exact across sequence slices.

Legend: ``B`` rows of this dp rank's micro-batch (TRL's collator puts the ``B/2`` chosen rows
first, then the ``B/2`` rejected ones), ``S`` full length, ``s`` this sp rank's slice
(``S_sp``), ``L`` labels of the score head (1 for a reward model).

A transformers sequence-classification model (``GenericForSequenceClassification``: Llama,
Qwen2/3, Mistral, Gemma, gpt-oss, Mixtral, Qwen3-MoE, OLMo 3, Qwen3-Next, ...) computes
``score(h) [B, S, L]`` on every token and keeps, per row, the one at the rightmost token that is
not ``pad_token_id`` (found from the *full* row's ``input_ids``). Under the sequence shard each
rank holds ``[B, s]`` of every row, so here:

* the index is found once from the full rows (every sp rank of a dp group reads the same rows)
  with the model's own rule (:func:`last_token`); the batch is then padded at the right to a
  multiple of sp (at most ``sp - 1`` columns, never attended to), so that every slice holds a
  column (the model reads its own score position in each slice's ids);
* the score head's output on this rank's slice is kept where this rank holds a row's index and
  is ``0`` elsewhere (a forward hook on the head while the trainer's forward runs: the head and
  every module under it, a PEFT ``modules_to_save`` copy included, are unchanged);
* :func:`~dtensor_ulysses.comm.all_reduce_sum` adds the ``[B, L]`` pieces over the sp group:
  the forward is one all-reduce of ``B x L`` numbers, the backward hands each rank the gradient
  of its own piece
  (no collective), so only the rank holding a row's last token sends a gradient into the head,
  and from there through attention to the other slices of the row;
* the loss is TRL's, on the full rewards: ``-logsigmoid(r_chosen - r_rejected [- margin])``
  averaged over this dp rank's pairs, plus ``center_rewards_coefficient * mean(r^2)``; the
  part each rank differentiates is divided by ``dp`` (FSDP2 sums the gradients over
  ``dp x sp``; the stock DDP run averages them over dp) and, in training, by the accumulation
  steps (the stock trainer divides the loss by them). The value handed to the Trainer is the
  stock value on every rank of the dp group, so the logged loss is the stock one;
* the metrics (``accuracy``, ``margin``, ``min_reward``, ``mean_reward``, ``max_reward``,
  ``num_tokens``) are TRL's formulas on the full rewards, gathered over the dp ranks only.

Evaluation runs the same forward (no gradient) through the Trainer's own ``prediction_step``,
which sees the full ``[B, 1]`` rewards as its logits.

Refused at construction, with the reason (one line): ``tiled_loss`` (no vocabulary logits to
tile), TRL's ``activation_offloading`` (use ``offload_activations``), a model that is not a
``GenericForSequenceClassification``; at the first step, batch keys other than
``input_ids``, ``attention_mask`` and ``margin``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dtensor_ulysses.comm import all_reduce_sum
from dtensor_ulysses.hf.batch import shard_batch
from dtensor_ulysses.hf.trainers import _state
from dtensor_ulysses.hf.trainers._accel import dp_gather
from dtensor_ulysses.hf.trainers.base import _UlyssesTrainer
from dtensor_ulysses.hf.trainers.refusals import (
    UnsupportedTrainerError,
    _refusals_in_one_line,
    _refuse_batch_keys,
)
from dtensor_ulysses.parallel.mesh import ParallelDims
from dtensor_ulysses.plan.recipe import ParallelOptions

__all__ = ["last_token"]

# batch keys the reward step reads, and keys it drops (the model's own flags)
_READ = {"input_ids", "attention_mask", "margin"}
_DROPPED = {"use_cache", "num_items_in_batch", "return_loss"}


def last_token(input_ids_BS: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """Per row, the index of the token a sequence-classification model reads its score at:
    the rightmost token that is not ``pad_token_id`` (transformers' rule, left or right
    padding; ``0`` for a row of padding only), or the last column without a pad token (the
    stock model then takes one row only).

    Args:
        input_ids_BS: ``[B, S]`` token ids of the *full* rows.
        pad_token_id: the model config's ``pad_token_id``.

    Returns:
        ``[B]`` int64 indices into ``S``.

    Raises:
        ValueError: no ``pad_token_id`` and more than one row.
    """
    B, S = input_ids_BS.shape
    if pad_token_id is None:
        if B != 1:
            raise ValueError(
                f"the model config has no pad_token_id and the batch has {B} rows: the score "
                f"position of a padded row is unknown; set config.pad_token_id"
            )
        return torch.full((B,), S - 1, dtype=torch.int64, device=input_ids_BS.device)
    real_BS = (input_ids_BS != pad_token_id).to(torch.int32)
    columns_S = torch.arange(S, device=input_ids_BS.device, dtype=torch.int32)
    return (columns_S * real_BS).argmax(-1).to(torch.int64)


def _padded(ids_BS: torch.Tensor, mask_BS: torch.Tensor | None, pad_id: int | None,
            sp: int) -> dict[str, torch.Tensor]:  # fmt: skip
    """The batch with padding columns appended up to a multiple of ``sp`` (mask 0, the pad
    id): every rank's slice then holds ``S' / sp >= 1`` columns (the model's own read of its
    score position needs one), and no real token changes (causal attention; padding is never
    attended to; the score position, found before, is unchanged)."""
    mask_BS = torch.ones_like(ids_BS) if mask_BS is None else mask_BS
    extra = -ids_BS.shape[1] % sp
    if extra:
        fill = 0 if pad_id is None else pad_id
        ids_BS = nn.functional.pad(ids_BS, (0, extra), value=fill)
        mask_BS = nn.functional.pad(mask_BS, (0, extra), value=0)
    return {"input_ids": ids_BS, "attention_mask": mask_BS}


class _Pick:
    """A forward hook on the score head: while ``index`` is set, the head's ``[B, s, L]``
    output becomes ``[B, s, L]`` holding, at every position of a row, the score at the row's
    ``index`` when ``held`` (this rank's slice has it) and ``0`` otherwise; so any position the
    model then reads is this rank's piece of the row's score."""

    def __init__(self) -> None:
        self.index_B: torch.Tensor | None = None  # local column of the row's score token
        self.held_B: torch.Tensor | None = None

    def __call__(self, module: nn.Module, args: Any, out_BsL: torch.Tensor) -> Any:
        if self.index_B is None:
            return None
        assert self.held_B is not None
        B, s, L = out_BsL.shape
        at_B1L = out_BsL.gather(1, self.index_B.view(B, 1, 1).expand(B, 1, L))
        piece_B1L = torch.where(self.held_B.view(B, 1, 1), at_B1L, torch.zeros_like(at_B1L))
        return piece_B1L.expand(B, s, L)


def _score_head(hf: nn.Module) -> nn.Module:
    """The sequence-classification head of a ``GenericForSequenceClassification`` model (or a
    refusal naming the class)."""
    from transformers.modeling_layers import GenericForSequenceClassification

    if not isinstance(hf, GenericForSequenceClassification):
        raise UnsupportedTrainerError(
            f"{type(hf).__name__} is not a transformers sequence-classification model "
            f"(GenericForSequenceClassification, e.g. AutoModelForSequenceClassification of a "
            f"Llama, Qwen or Mistral checkpoint); with_ulysses reads the reward from its score "
            f"head at each row's last non-padding token"
        )
    return hf.score


class _UlyssesReward:
    """The ``RewardTrainer`` family's loss, placed before the shared mixin."""

    # provided by the shared mixin and the Trainer
    _du_options: ParallelOptions
    _du_dims: ParallelDims
    _du_pick: _Pick
    _metrics: dict
    _total_train_tokens: int
    _tp_size: int
    args: Any
    model: Any
    accelerator: Any

    @_refusals_in_one_line
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if self._du_options.tiled_loss:
            raise UnsupportedTrainerError(
                "tiled_loss=True: a reward model has no [B, S, vocab] logits (its score head "
                "gives one number per token); drop tiled_loss"
            )
        config = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(config, "activation_offloading", False):
            raise UnsupportedTrainerError(
                "activation_offloading=True (TRL's hooks, set on the unsharded model): use "
                "with_ulysses(..., offload_activations=True) instead"
            )
        model = kwargs.get("model", args[0] if args else None)
        if isinstance(model, nn.Module):  # a loaded model (a name: checked once TRL loads it)
            _score_head(_state.base_model(model))
        super().__init__(*args, **kwargs)

    def _du_parallelize(self, model: nn.Module) -> nn.Module:
        hf: Any = _state.base_model(model)
        head = _score_head(hf)
        if not hasattr(self, "_du_pick"):
            self._du_pick = _Pick()
            head.register_forward_hook(self._du_pick)
        return super()._du_parallelize(model)  # type: ignore[misc]

    def compute_loss(self, model: nn.Module, inputs: dict, return_outputs: bool = False,
                     num_items_in_batch: Any = None):  # fmt: skip
        mode = "train" if self.model.training else "eval"
        _refuse_batch_keys(inputs, _READ, _DROPPED, "the reward step")
        ids_BS, mask_BS = inputs["input_ids"], inputs.get("attention_mask")
        hf: Any = _state.base_model(model)
        pad_id = hf.config.get_text_config().pad_token_id
        index_B = last_token(ids_BS, pad_id)
        dims = self._du_dims
        sb = shard_batch(_padded(ids_BS, mask_BS, pad_id, dims.sp), dims, count_valid=False)
        lo, s = sb.layout.offset(dims.sp_rank), sb.input_ids.shape[1]
        pick = self._du_pick
        pick.held_B = (index_B >= lo) & (index_B < lo + s)
        pick.index_B = (index_B - lo).clamp(0, max(s - 1, 0))
        try:
            out = model(input_ids=sb.input_ids, position_ids=sb.position_ids,
                        ulysses_layout=sb.layout, use_cache=False)  # fmt: skip
        finally:
            pick.index_B = pick.held_B = None
        rewards_BL = all_reduce_sum(out.logits, dims.sp_mesh.get_group())
        chosen_b, rejected_b = torch.chunk(rewards_BL.squeeze(-1), chunks=2)
        if "margin" in inputs:
            margin = inputs["margin"]
            loss = -nn.functional.logsigmoid(chosen_b - rejected_b - margin).mean()
        else:
            loss = -nn.functional.logsigmoid(chosen_b - rejected_b).mean()
        if self.args.center_rewards_coefficient is not None:
            loss = loss + self.args.center_rewards_coefficient * torch.mean(
                (chosen_b + rejected_b) ** 2
            )
        self._du_reward_metrics(mode, mask_BS, rewards_BL, chosen_b, rejected_b)
        value = loss.detach()
        local = loss / dims.dp
        if mode == "train":  # the stock trainer divides by the accumulation steps
            steps = getattr(self, "current_gradient_accumulation_steps",
                            self.args.gradient_accumulation_steps)  # fmt: skip
            value, local = value / steps, local / steps
        loss = value + (local - local.detach())
        out.logits = rewards_BL
        return (loss, out) if return_outputs else loss

    def _du_reward_metrics(self, mode: str, mask_BS: torch.Tensor | None, rewards_BL: torch.Tensor,
                           chosen_b: torch.Tensor, rejected_b: torch.Tensor) -> None:  # fmt: skip
        """What ``RewardTrainer.compute_loss`` logs, from the full rewards, over the dp ranks."""
        group = self._du_dims.dp_mesh.get_group()
        metrics = self._metrics[mode]
        if mode == "train":
            assert mask_BS is not None, "TRL's reward collator gives an attention_mask"
            seen = dp_gather(mask_BS.sum(), group=group).sum().item()
            self._total_train_tokens += int(seen) // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        with torch.no_grad():
            every = dp_gather(rewards_BL.detach(), group=group)
            metrics["min_reward"].append(every.min().item())
            metrics["mean_reward"].append(every.mean().item())
            metrics["max_reward"].append(every.max().item())
            accuracy = (chosen_b > rejected_b).float().mean()
            metrics["accuracy"].append(dp_gather(accuracy, group=group).mean().item())
            margin = (chosen_b - rejected_b).detach().mean()
            metrics["margin"].append(dp_gather(margin, group=group).mean().item())

    def prediction_step(self, model: nn.Module, inputs: dict, prediction_loss_only: bool,
                        ignore_keys: Any = None):  # fmt: skip
        # the Trainer's own step (not the shared mixin's token loss): it calls compute_loss
        return super(_UlyssesTrainer, self).prediction_step(  # type: ignore[misc]
            model, inputs, prediction_loss_only, ignore_keys=ignore_keys
        )
