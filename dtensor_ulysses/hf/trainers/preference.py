"""TRL's ``DPOTrainer`` and ``KTOTrainer`` under Ulysses: the family mixins of
:func:`~dtensor_ulysses.hf.with_ulysses`.

Legend: ``B`` rows of this dp rank (DPO: chosen rows then rejected rows), ``S`` full length,
``K`` values per token (log-probability, entropy, mean logit, top-1).

How the loss stays TRL's own. TRL 1.16 computes both losses from its fused output head: the
model called with ``labels`` and ``fused_lm_head=True`` returns per-token ``log_probs``,
``entropy``, ``mean_logits`` and ``is_top1`` over the full rows ``[B, S - 1]``, and everything
after that (every DPO ``loss_type`` and their weighted sums with ``loss_weights``, ``ld_alpha``,
``f_divergence_type``, IPO's length normalization, the ``sft`` term, KTO's KL estimate and
weights, every logged metric) is per-token masking and summing over those rows. The mixins keep
that code and change what stands for the model (``_SlicedLM``): it cuts the rows
(:func:`~dtensor_ulysses.hf.shard_batch`, labels shifted over the full row before slicing;
chosen and rejected rows cut alike), runs the sharded model on this rank's slice with the
output head in log-prob mode (no ``[B, s, V]`` logits, :func:`~dtensor_ulysses.hf.logp_head`),
and hands back the full rows assembled over the sp group
(:func:`~dtensor_ulysses.hf.token_rows`: one all-reduce of ``B * S * K`` floats whose gradient
passes through, since every sp rank then computes the same loss). Every sp rank of a dp group
thus computes exactly the loss and metrics the stock trainer computes on that dp rank.

The reference log-probabilities come from TRL's own ``compute_ref_log_probs`` called with the
same stand-in over the reference model (``ref_model``, sharded on the same mesh: Ulysses +
FSDP2, frozen, no optimizer state) or, with a PEFT adapter, over the policy with the adapter
disabled (TRL's rule); they enter TRL's loss as if precomputed. With
``precompute_ref_log_probs=True``, TRL's precompute pass (which the base ``__init__`` would run
on the unsharded model) is deferred until the model is sharded and then runs TRL's own code
with the stand-in: the rows cut over sp, each dp rank its batches, the values gathered over dp;
no reference model is kept for training (TRL's rule).

Scaling: TRL's loss is a mean over this dp rank's rows; the stock trainer divides it by the
accumulation steps and DDP averages over the dp ranks. Here each rank's gradient part is
``loss / (dp * accumulation)`` (FSDP2 sums the ``dp x sp`` ranks' gradients: the sp ranks
contribute their slices' parts, see :mod:`dtensor_ulysses.comm.reduce`), and the value handed to
the Trainer is its all-reduced sum over dp (what the stock run logs, averaged over ranks).

Cost of the reference (full fine-tuning): the reference model's parameters, sharded over the
``dp x sp`` ranks like the policy's (no gradients, no optimizer state: about 1/4 of the policy's
bytes under AdamW in fp32), one more all-gather of its weights per forward, and one forward
without activations kept (about a third of a training step's compute). With a PEFT adapter the
reference is the same weights: no memory, one more forward.

Refused at construction, with the reason (one line): ``use_weighting`` (WPO needs
``log(sum p^2)`` per token, not computed by the tiled head), ``sync_ref_model``, TRL's
``activation_offloading`` (use ``offload_activations``), a router auxiliary loss
(Mixture-of-Experts), ``compute_metrics`` (TRL's logits for it need a second full-vocabulary
forward), vision datasets, and inputs other than ids, masks and labels.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtensor_ulysses.hf.trainers.logps import token_rows
from dtensor_ulysses.hf.trainers.refusals import (
    UnsupportedTrainerError,
    _refusals_in_one_line,
)
from dtensor_ulysses.parallel.mesh import ParallelDims
from dtensor_ulysses.plan.recipe import ParallelOptions

__all__: list[str] = []

# the batch keys the stand-in model takes; any other tensor is refused (it would not be cut)
_MODEL_KEYS = {"input_ids", "attention_mask", "labels", "fused_lm_head", "use_cache"}


class _SlicedLM:
    """Stands in for a model in TRL's loss code: called as TRL calls its fused head
    (``model(input_ids=, attention_mask=, labels=, fused_lm_head=True)``), it runs ``model``
    on this rank's slice and returns TRL's ``FusedCausalLMOutput`` over the full rows."""

    def __init__(self, trainer: Any, model: nn.Module, *, stats: bool) -> None:
        self.trainer, self.model, self.stats = trainer, model, stats

    def __call__(self, **kwargs: Any) -> Any:
        from trl.trainer.utils import FusedCausalLMOutput

        extra = sorted(k for k, v in kwargs.items() if k not in _MODEL_KEYS and v is not None)
        if extra or not kwargs.get("fused_lm_head"):
            raise UnsupportedTrainerError(
                f"with_ulysses cuts only input_ids, attention_mask and labels into sequence "
                f"slices; the batch also has {extra or 'no fused_lm_head'}: remove them from "
                f"the collator's output"
            )
        labels = kwargs["labels"]
        batch = {"input_ids": kwargs["input_ids"], "labels": labels,
                 "attention_mask": kwargs.get("attention_mask")}  # fmt: skip
        rows, _ = token_rows(
            self.model, batch, self.trainer._du_dims, stats=self.stats,
            chunk_tokens=self.trainer._du_options.loss_chunk_tokens,
        )  # fmt: skip
        rows = rows[:, :-1]  # TRL's rows: position t scores token t + 1
        mask = labels[:, 1:] != -100
        # contiguous [B, S - 1] values, for the policy and the reference alike: TRL sums them
        # per row, and a sum over a strided view (a column of [B, S, K]) may add in another
        # order, so equal weights (step 1) would give unequal sums and a broken tie
        if not self.stats:
            return FusedCausalLMOutput(log_probs=rows.contiguous(), label_mask=mask)
        logps, entropy, mean_logits, top1 = (rows[..., k].contiguous() for k in range(4))
        return FusedCausalLMOutput(
            log_probs=logps, entropy=entropy, mean_logits=mean_logits, is_top1=top1 > 0.5,
            label_mask=mask,
        )  # fmt: skip


def _refuse_preference_args(args: Any, kwargs: dict) -> None:
    problems = []
    if getattr(args, "use_weighting", False):
        problems.append(
            "use_weighting=True (WPO) needs log(sum p^2) per token, which the tiled output "
            "head does not compute; set use_weighting=False"
        )
    if getattr(args, "sync_ref_model", False):
        problems.append(
            "sync_ref_model=True: the sharded reference is not synchronized; set it False"
        )
    if getattr(args, "activation_offloading", False):
        problems.append(
            "activation_offloading=True (TRL's hooks on the unsharded model): use "
            "with_ulysses(..., offload_activations=True) instead"
        )
    if kwargs.get("compute_metrics") is not None:
        problems.append(
            "compute_metrics: TRL recomputes full [B, S, V] logits for it, which with_ulysses "
            "never builds; evaluate with the logged metrics (rewards/*, logps/*, logits/*)"
        )
    if problems:
        raise UnsupportedTrainerError(
            "with_ulysses cannot run this exactly: " + "; ".join(problems)
        )


class _UlyssesPreference:
    """Shared by the DPO and KTO mixins (placed before ``_UlyssesTrainer``)."""

    _du_family_loss = True  # the trainer's own loss_type: checked here, not as a token CE
    _du_dims: ParallelDims
    _du_options: ParallelOptions
    args: Any
    model: Any
    ref_model: Any
    accelerator: Any
    precompute_ref_logps: bool
    aux_loss_enabled: bool

    _du_deferred: list | None = None  # TRL's precompute calls, run once the model is sharded

    @_refusals_in_one_line
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse_preference_args(kwargs.get("args"), kwargs)
        self._du_deferred = []
        super().__init__(*args, **kwargs)
        if getattr(self, "_is_vision_dataset", False):
            raise UnsupportedTrainerError(
                "a vision dataset: the preference trainers' image inputs are not cut into "
                "sequence slices by with_ulysses yet; train on text"
            )
        if self.aux_loss_enabled:
            raise UnsupportedTrainerError(
                f"a router auxiliary loss (router_aux_loss_coef={self.router_aux_loss_coef}) "  # type: ignore[attr-defined]
                f"with a preference loss is not made exact yet; set router_aux_loss_coef=0.0"
            )
        if self.ref_model is not None:
            self.ref_model = self._du_parallelize_reference(self.ref_model)  # type: ignore[attr-defined]
        deferred, self._du_deferred = self._du_deferred, None
        for key, name, batch_size in deferred:  # precompute_ref_log_probs, now sharded
            data = getattr(self, key)
            if isinstance(data, dict):
                data = {**data, name: self._precompute_ref_logps(data[name], name, batch_size)}
            else:
                data = self._precompute_ref_logps(data, name, batch_size)
            setattr(self, key, data)

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        """TRL's precompute of the reference log-probabilities, deferred while the base
        ``__init__`` runs (the model is not sharded yet) and run right after sharding, with the
        sharded reference (or the policy as it is before training) through ``_SlicedLM``."""
        if self._du_deferred is not None:
            key = "train_dataset" if name == "train" else "eval_dataset"
            self._du_deferred.append((key, name, batch_size))
            return dataset
        return super()._precompute_ref_logps(dataset, name, batch_size)  # type: ignore[misc]

    def compute_ref_log_probs(self, model: Any, inputs: dict) -> Any:
        """TRL's own, with the (sharded) model called through ``_SlicedLM``."""
        if not isinstance(model, _SlicedLM):
            model = _SlicedLM(self, model, stats=False)
        return super().compute_ref_log_probs(model, inputs)  # type: ignore[misc]

    def _du_reference_keys(self, ref_out: tuple) -> dict[str, Any]:
        raise NotImplementedError

    def compute_loss(self, model: nn.Module, inputs: dict, return_outputs: bool = False,
                     num_items_in_batch: Any = None):  # fmt: skip
        if return_outputs:
            raise UnsupportedTrainerError(
                "return_outputs=True: TRL's logits for it need a full [B, S, V] forward, which "
                "with_ulysses never builds"
            )
        if not self.precompute_ref_logps:  # TRL's reference code, on the sharded reference
            ref = self.ref_model if self.ref_model is not None else model
            ref_out = self.compute_ref_log_probs(ref, inputs)
            inputs = {**inputs, **self._du_reference_keys(ref_out)}
        saved, self.precompute_ref_logps = self.precompute_ref_logps, True
        try:
            loss = self._compute_loss(_SlicedLM(self, model, stats=True), inputs, False)  # type: ignore[attr-defined]
        finally:
            self.precompute_ref_logps = saved
        if not self.model.training:  # evaluation: this dp rank's loss (gathered over dp)
            return loss
        dims = self._du_dims
        steps = getattr(self, "current_gradient_accumulation_steps",
                        self.args.gradient_accumulation_steps)  # fmt: skip
        local = loss / (dims.dp * steps)
        total = local.detach().clone()
        if dims.dp > 1:
            dist.all_reduce(total, group=dims.dp_mesh.get_group())
        # the value is the global loss (what the Trainer logs), the gradient this rank's part
        return total + (local - local.detach())

    def prediction_step(self, model: nn.Module, inputs: dict, prediction_loss_only: bool,
                        ignore_keys: Any = None):  # fmt: skip
        inputs = self._prepare_inputs(inputs)  # type: ignore[attr-defined]
        with torch.no_grad(), self.compute_loss_context_manager():  # type: ignore[attr-defined]
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None


class _UlyssesDPO(_UlyssesPreference):
    """``DPOTrainer`` under Ulysses (see the module docstring)."""

    def _du_reference_keys(self, ref_out: tuple) -> dict[str, Any]:
        chosen, rejected = ref_out
        return {"ref_chosen_logps": chosen, "ref_rejected_logps": rejected}


class _UlyssesKTO(_UlyssesPreference):
    """``KTOTrainer`` under Ulysses (see the module docstring); the KL term's mismatched pairs
    are TRL's, built per ``per_device_train_batch_size`` rows, so a run equals the stock
    trainer at the same dp (as the stock trainer at another dp differs from itself)."""

    def _du_reference_keys(self, ref_out: tuple) -> dict[str, Any]:
        logps, kl_logps = ref_out
        keys = {"ref_logps": logps}
        if kl_logps is not None:
            keys["ref_KL_logps"] = kl_logps
        return keys
