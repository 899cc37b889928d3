"""``with_ulysses``: a ``transformers.Trainer`` / TRL ``SFTTrainer`` training with Ulysses on FSDP2.

::

    from dtensor_ulysses.hf import with_ulysses
    Trainer = with_ulysses(trl.SFTTrainer, sp=4)   # or transformers.Trainer, or a subclass
    trainer = Trainer(model=..., args=SFTConfig(...), train_dataset=..., processing_class=tok)
    trainer.train()                                 # torchrun --nproc-per-node P (P = dp * sp)

What the returned subclass does on ``P = dp x sp`` ranks:

* **Mesh**: the ``("dp", "sp")`` mesh, ``dp = P / sp``.
* **Model**: after the base ``__init__`` (so a model TRL loaded from a name or wrapped in a PEFT
  adapter is the one prepared), the steps of :func:`~dtensor_ulysses.hf.parallelize` (the one
  parallelize of transformers models): every attention layer through the engine
  (:func:`~dtensor_ulysses.hf.apply_ulysses`, with its refusals, its kernel chosen once per
  layer kind for autocast's dtype, and its first-step guard), optional activation
  checkpointing, then ``fully_shard`` of each decoder layer and of the root over the flattened
  ``dp x sp`` ranks with gradients *summed*.
* **Data**: the loaders are sharded over the dp ranks only: every rank of an sp group reads the
  same rows (accelerate's sampler, epochs and resume skipping unchanged). The global batch is
  ``per_device_train_batch_size x dp x gradient_accumulation_steps``. Each rank then feeds the
  model its sequence slice (:func:`~dtensor_ulysses.hf.shard_batch`): labels shifted over the
  full row before slicing, global position ids, padding and packed documents (position ids
  restarting at 0, as ``padding_free`` collators give) as the engine's document layout. A
  batch whose cut would leave a rank no token (rows shorter than sp, an empty text row, or
  e.g. 5 columns over sp=4) gets padding columns at the end (no labels, never attended to by
  a real token), so every rank holds a slice and the step is the stock one.
  A vision-language model (Qwen2.5-VL, Qwen3-VL) takes the full rows and the batch's images
  (``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``) and slices after the image
  merge, each image (Qwen: each video too) encoded on one rank of the sp group
  (:mod:`~dtensor_ulysses.hf.models.vision`); other families' video inputs are refused.
* **Loss**: ``sum of the slice's cross entropy / N`` with ``N`` the valid targets of the whole
  optimizer step (all micro-batches, all dp ranks; ``-100`` and assistant / completion masks
  respected), so the summed gradients are the single-process gradients and gradient
  accumulation needs no rescaling. The value handed back to the Trainer (logged, averaged over
  ranks) is the all-reduced global one. A slice with no valid target contributes ``0``. The
  count is the stock Trainer's: over the shifted labels for a causal-LM ``loss_type``, over
  the labels as they stand otherwise (GPT-2's ``loss_type=None``: one more per row, as the
  stock run divides). A model that takes no loss kwargs (``accepts_loss_kwargs = False``:
  Qwen2.5-VL, Qwen3-VL, Gemma 4 multimodal) averages each micro-batch over its dp rank's
  targets, as the stock model does; the Trainer divides that by the accumulation steps and
  DDP averages over dp, so here the value is the dp rank's mean (its sp group's slices
  summed) and each rank's gradient part is divided by the accumulation steps and by dp. With
  ``tiled_loss`` the output head returns that sum itself, computed in chunks of rows (the head
  stays the model's ``Linear``, its class swapped for ``_LossHead``), so no ``[B, s, V]``
  logits exist in training.
* **Router loss** (Mixture-of-Experts models whose stock forward adds one: Mixtral, Qwen3-MoE,
  gpt-oss, ...): the load-balancing loss of each micro-batch over *all* its tokens, every dp
  and sp rank's (:func:`~dtensor_ulysses.hf.models.moe.load_balancing_loss`), weighted as the stock
  trainer weights it (``Trainer``: ``router_aux_loss_coef`` when the config has
  ``output_router_logits``; TRL: its ``router_aux_loss_coef``, divided by the accumulation
  steps), padding excluded: the logged ``loss`` is the stock model's, cross entropy plus the
  weighted router loss, and so are the gradients.
* **Evaluation**: sharded at the training length (no fallback to one rank): the eval loss of a
  batch is its global token mean (over the dp ranks' rows: at dp > 1 the one-process value of
  the global batch); ``eval_loss`` weighs each batch by its rows as the stock loop does (a
  partial last batch counts its rows only: accelerate's remainder); with ``compute_metrics``
  the logits are gathered over sp to the full sequence and ``labels`` are the collator's, so
  metrics see what they see on one process.
* **Tokens seen** (``include_num_input_tokens_seen``): the stock count, which sums every rank's
  rows, divided by sp, since the sp ranks of a group read the same rows; it equals the count of
  a single-process run. TRL's ``entropy``, ``mean_token_accuracy`` (not with the tiled loss)
  and ``num_tokens`` are those of the global batch.
* **Files**: ``save_model`` / checkpoints write the files of a single-process run (full weights
  gathered one by one to rank 0, full optimizer state keyed by parameter name); resume reads
  them on every rank, each keeping its shard.
* **Stops**: SIGTERM, SIGUSR1, Ctrl-C and a launcher that died end ``train()`` after the same
  step on every rank, with that step saved as a Trainer checkpoint (``output_dir/checkpoint-N``,
  resumable with ``resume_from_checkpoint``), then the process with status 75; a second Ctrl-C
  stops at once (:mod:`~dtensor_ulysses.hf.trainers._stops`).

Why FSDP2 is applied directly and not through accelerate's FSDP2 plugin: the plugin shards over
the whole world with gradients *averaged* and wraps by its own policy; exactness needs summed
gradients (the loss is already divided by the global token count) and the shard order that
puts Ulysses (and checkpointing) before ``fully_shard``. The plugin also turns on accelerate's
FSDP paths in the Trainer (its own state-dict types, optimizer saving, ``cp_size`` handling)
whose behaviour with an sp axis is not defined. Applied directly, the Trainer sees a
non-FSDP multi-process run, and only four accelerator methods change (see
:mod:`~dtensor_ulysses.hf.trainers._accel`): data by dp rank, no DDP wrap, the DTensor norm,
metrics gathered over dp. At interpreter exit, every rank leaves the process group together
(:func:`~dtensor_ulysses._exit.leave_together_at_exit`), so a finished run exits 0.
Every other piece of the Trainer's loop (schedules, logging, callbacks, checkpoint cadence,
RNG files) is the stock one.

Refused at construction, with the reason: models the engine cannot run exactly (bidirectional
attention, ...), trainers that build their inputs by generation (online DPO, PPO, GKD, ...;
GRPO and RLOO are made exact by :mod:`~dtensor_ulysses.hf.trainers.rl`) or whose loss is not
the token cross entropy and has no family mixin (DPO and KTO have theirs:
:mod:`~dtensor_ulysses.hf.trainers.preference`; reward:
:mod:`~dtensor_ulysses.hf.trainers.reward`), DeepSpeed or accelerate's
FSDP also enabled, a ``parallelism_config`` with ``cp_size``,
``sp_size`` or ``tp_size > 1``, a ``compute_loss_func``, label smoothing, optimizers passed in
(built before sharding), iterable datasets, ``save_on_each_node``, a router loss on a model
that averages per micro-batch; chat rows without an assistant turn under
``assistant_only_loss=True`` (named, on every rank before TRL tokenizes them).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from dtensor_ulysses._exit import (
    leave_together_at_exit,
)
from dtensor_ulysses.data import IGNORE_INDEX
from dtensor_ulysses.hf.batch import shard_batch
from dtensor_ulysses.hf.models.causal_lm import plain_head
from dtensor_ulysses.hf.models.moe import load_balancing_loss, router_loss_config
from dtensor_ulysses.hf.models.parallelize import parallelize_root
from dtensor_ulysses.hf.models.routing import (
    check_supported,
)
from dtensor_ulysses.hf.models.vision import (
    VIDEO_KEYS,
    VISION_KEYS,
    is_vision_language,
    refuse_video,
    vision_model_inputs,
)
from dtensor_ulysses.hf.trainers import _accel, _state, _stops
from dtensor_ulysses.hf.trainers._generation import tracked_generation_callbacks
from dtensor_ulysses.hf.trainers.refusals import (
    UnsupportedTrainerError,
    _refusals_in_one_line,
    _refuse_args,
    _refuse_attention_dropout,
    _refuse_batch_keys,
    _refuse_rows_without_assistant,
    _rows_without_assistant,
    _single_process_launch,
)
from dtensor_ulysses.models import cross_entropy_sum, tiled_cross_entropy_sum
from dtensor_ulysses.parallel.mesh import ParallelDims
from dtensor_ulysses.plan import ParallelOptions
from dtensor_ulysses.plan.splits import default_loss_chunk

__all__: list[str] = []  # the shared mixin; with_ulysses (wrap.py) places it

_READ = {"input_ids", "labels", "attention_mask", "position_ids"}
_DROPPED = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
            "use_cache", "num_items_in_batch", "return_loss"}  # fmt: skip


def _router_rule(trainer: Any, model: Any) -> tuple[float, bool] | None:
    """The router (load-balancing) loss the stock trainer adds: ``(coef, divided by the
    accumulation steps)``, or ``None``. ``transformers.Trainer``: the model's own, when its
    config has ``output_router_logits`` (added to the loss of each micro-batch). TRL's
    ``SFTTrainer``: its ``aux_loss_enabled`` and ``router_aux_loss_coef`` (the SFTConfig's, else
    the model config's), divided by the accumulation steps in training."""
    rc = router_loss_config(model)
    if hasattr(trainer, "aux_loss_enabled"):  # TRL's rule, as SFTTrainer.__init__ set it
        if not trainer.aux_loss_enabled:
            return None
        if rc is None:
            raise UnsupportedTrainerError(
                f"{type(model).__name__}: the SFTConfig turns on a router auxiliary loss "
                f"(router_aux_loss_coef={trainer.router_aux_loss_coef}) but the model computes "
                f"none (no load_balancing_loss_func in its modeling file); set "
                f"router_aux_loss_coef=0.0"
            )
        return float(trainer.router_aux_loss_coef), True
    if rc is None or not rc.enabled:
        return None
    return rc.coef, False


def _targets(batch: dict, shifted: bool = True) -> int:
    """Valid targets of a full-length batch, as :func:`~dtensor_ulysses.hf.shard_batch` shifts
    them (the label of the next token, none from or into padding); ``shifted=False``: the
    labels that are not ``-100`` as they stand, the stock Trainer's count for a model whose
    ``loss_type`` is not the causal-LM loss (GPT-2: ``loss_type=None``), one more per row
    than the targets the loss sums."""
    labels = batch.get("labels")
    labels = batch["input_ids"] if labels is None else labels
    if not shifted:
        return int((labels != IGNORE_INDEX).sum())
    valid = labels[:, 1:] != IGNORE_INDEX
    mask = batch.get("attention_mask")
    if mask is not None:
        mask = mask.bool()
        valid &= mask[:, 1:] & mask[:, :-1]
    return int(valid.sum())


def _compute_dtype(args: Any) -> torch.dtype | None:
    """The dtype autocast computes in under the training arguments (``bf16``/``fp16``, TRL's
    default ``bf16=True`` included, on CPU too), or ``None``: no autocast."""
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return None


def _describe(trainer: Any) -> str:
    """One line: the mesh, sp and dp, the kernel that runs per layer kind, the precision that
    runs and the features in use."""
    from dtensor_ulysses.attention import describe_kernels, model_kernels

    o, dims = trainer._du_options, trainer._du_dims
    dp, sp = dims.dp, dims.sp
    device = trainer.args.device
    hf: Any = _state.base_model(trainer.model)
    cfg = hf.config.get_text_config()
    kernel = describe_kernels(model_kernels(hf))
    features = [
        name
        for name, on in (
            ("activation checkpointing", o.activation_checkpointing),
            ("offloaded activations", o.offload_activations),
            ("offloaded parameters", o.offload_params),
            (f"head chunks {o.head_chunks}", o.head_chunks > 1),
            ("tiled loss", o.tiled_loss),
            ("uneven heads", o.allow_uneven_heads),
        )
        if on
    ]
    policy = o.mixed_precision
    if policy == "auto":
        policy = None if device.type != "cuda" else "bf16"
    fsdp_dtype = torch.bfloat16 if policy == "bf16" else getattr(policy, "param_dtype", None)
    params = _dtype_name(next(iter(hf.parameters())).dtype)
    autocast = _compute_dtype(trainer.args)
    if autocast is not None:
        precision = f"{_dtype_name(autocast)} compute (autocast; {params} parameters)"
    elif fsdp_dtype is not None:
        precision = f"{_dtype_name(fsdp_dtype)} compute (FSDP2 mixed precision)"
    else:
        precision = f"{params} compute"
    name = next(c.__name__ for c in type(hf).__mro__ if not issubclass(c, FSDPModule))
    n = cfg.num_attention_heads
    per_rank = f"{n // sp} per rank" if n % sp == 0 else f"uneven over {sp} ranks"
    return (
        f"with_ulysses: sequence parallelism on: mesh dp={dp} x sp={sp} ({dp * sp} ranks, "
        f"{device.type}), {name} {n} q heads ({per_rank}), attention kernel {kernel}, "
        f"{precision}, features: {', '.join(features) or 'none'}"
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype).replace("torch.", "")
    )


def _announce(trainer: Any) -> None:
    """Print :func:`_describe` once, from rank 0, when the trainer is built."""
    if dist.get_rank() == 0:
        print(_describe(trainer), flush=True)


class _UlyssesTrainer:
    """Mixin placed before the user's trainer class by :func:`with_ulysses`.

    What it holds: the recipe (``_du_options``, one :class:`~dtensor_ulysses.plan.
    ParallelOptions`, set by ``with_ulysses``; ``dataclasses.replace`` of it for a second
    model, :meth:`_du_parallelize_reference`) and the degrees (``_du_dims``, one
    :class:`~dtensor_ulysses.parallel.ParallelDims` bound to the mesh once the accelerator
    exists: ``.sp``, ``.dp``, ``.sp_mesh``, ``.dp_mesh``, ``.flat_mesh``, ``.sp_rank``,
    ``.dp_rank``, ``.mesh``). ``_du_sp_arg`` is the ``sp`` ``with_ulysses`` was given, for the
    checks that run before the world exists; everything after asks ``_du_dims``.
    """

    _du_sp_arg: int
    _du_options: ParallelOptions
    _du_dims: ParallelDims
    _du_router: tuple[float, bool] | None = None
    _du_family_loss: bool = False  # a family mixin computes the loss (and checks loss_type)
    _du_step_mean: bool = True  # the stock loss: the step's token mean (else per micro-batch)
    _du_shifted_count: bool = True  # the stock count: the shifted labels (else as they stand)
    # provided by transformers.Trainer
    args: Any
    model_accepts_loss_kwargs: bool
    loss_is_scaled_for_ga: bool | None
    model: Any
    model_wrapped: Any
    accelerator: Any
    optimizer: Any
    lr_scheduler: Any
    state: Any

    @_refusals_in_one_line
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        model = kwargs.get("model", args[0] if args else None)
        _refuse_attention_dropout(model, kwargs.get("args", args[1] if len(args) > 1 else None))
        if isinstance(model, nn.Module):
            check_supported(_state.base_model(model))
            if self._du_options.tiled_loss:
                plain_head(_state.base_model(model))
        opts = kwargs.get("optimizers")
        if opts is not None and any(o is not None for o in opts):
            raise UnsupportedTrainerError(
                "optimizers=(...) were built on the unsharded parameters; let the trainer build "
                "them (args.optim, learning_rate, lr_scheduler_type) after FSDP2 sharding"
            )
        if kwargs.get("compute_loss_func") is not None:
            raise UnsupportedTrainerError(
                "compute_loss_func: the loss over sequence slices is the token-weighted cross "
                "entropy computed by with_ulysses; a custom loss cannot be made exact"
            )
        for key in ("train_dataset", "eval_dataset"):
            data = kwargs.get(key)
            if data is not None and hasattr(data, "__len__") and len(data) == 0:
                raise ValueError(
                    f"{key} is empty (0 rows): there is nothing to "
                    f"{'train on' if key == 'train_dataset' else 'evaluate'}; check how the "
                    f"dataset was loaded, split or filtered"
                )
            if isinstance(data, torch.utils.data.IterableDataset):
                raise UnsupportedTrainerError(
                    f"{key} is an IterableDataset: accelerate dispatches its batches over all "
                    f"ranks, not per dp group; pass a map-style dataset (datasets.Dataset)"
                )
        data = {k: kwargs.get(k) for k in ("train_dataset", "eval_dataset")}
        _refuse_rows_without_assistant(kwargs.get("args", args[1] if len(args) > 1 else None),
                                       data)  # fmt: skip
        try:
            super().__init__(*args, **kwargs)
        except RuntimeError as e:  # TRL's, for chat rows without an assistant token: one line
            refusal = _rows_without_assistant(e, data)
            if refusal is None:
                raise
            raise refusal from None
        self._du_router = _router_rule(self, _state.base_model(self.model))
        # the stock normalization, read before it is replaced below: a model that takes
        # num_items_in_batch gets the token mean of the optimizer step, counted over the
        # shifted labels when its loss_type is the causal-LM loss (else over the labels as they
        # stand, GPT-2's); one that does not (Qwen-VL, Gemma 4: accepts_loss_kwargs=False)
        # averages each micro-batch on each dp rank, the Trainer dividing by the accumulation
        # steps and DDP averaging over dp
        self._du_step_mean = bool(self.model_accepts_loss_kwargs)
        self._du_shifted_count = bool(getattr(self, "_loss_shifts_labels", True))
        if self._du_router and not self._du_step_mean:
            raise UnsupportedTrainerError(
                f"{type(_state.base_model(self.model)).__name__} averages its loss per "
                f"micro-batch (accepts_loss_kwargs=False) and adds a router loss: that "
                f"combination is not made exact yet; set router_aux_loss_coef=0.0 (or "
                f"output_router_logits=False)"
            )
        if self.args.gradient_checkpointing:  # ours, per decoder layer, inside FSDP2
            self._du_options = replace(self._du_options, activation_checkpointing=True)
            self.args.gradient_checkpointing = False
        self.model_accepts_loss_kwargs = True  # the loss below is normalized over the step
        self.loss_is_scaled_for_ga = True
        _refuse_attention_dropout(self.model, self.args)  # a model TRL loaded from its name
        self.model = self.model_wrapped = self._du_parallelize(self.model)
        _announce(self)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The stock ``train``; a stop signal, Ctrl-C or a dead launcher ends it after the same
        step on every rank with the Trainer's checkpoint, and the process with status 75
        (:mod:`~dtensor_ulysses.hf.trainers._stops`)."""
        with tracked_generation_callbacks(self):
            return _stops.train_until_stopped(self, super().train, *args, **kwargs)  # type: ignore[misc]

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """The stock ``evaluate``; TRL's generation callbacks (``on_evaluate``) generate from
        the gathered model (:mod:`~dtensor_ulysses.hf.trainers._generation`)."""
        with tracked_generation_callbacks(self):
            return super().evaluate(*args, **kwargs)  # type: ignore[misc]

    # ------------------------------------------------------------------------------------------
    # construction
    # ------------------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        _refuse_args(self.args, self._du_sp_arg, own_loss=self._du_family_loss)
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        kind = str(getattr(self.accelerator, "distributed_type", ""))
        if "DEEPSPEED" in kind or kind.endswith("FSDP"):
            raise UnsupportedTrainerError(
                f"the accelerator runs {kind} (from the accelerate config): with_ulysses shards "
                f"with FSDP2 itself; launch with a plain multi-process config (torchrun)"
            )
        if not dist.is_initialized():
            raise ValueError(
                _single_process_launch(f"with_ulysses(sp={self._du_sp_arg})", self._du_sp_arg)
            )
        world = dist.get_world_size()
        if self.args.world_size != world:
            raise ValueError(
                f"accelerate sees {self.args.world_size} process(es) of the {world}-rank launch "
                f"(its distributed type is {kind or 'NO'}); on CPU pass use_cpu=True in the "
                f"training arguments so that it runs multi-process"
            )
        # the degrees (checked against the world), bound to their mesh: the one holder
        dims = ParallelDims.resolve(world, dp=None, sp=self._du_sp_arg)
        self._du_dims = ParallelDims.from_mesh(dims.build_mesh(self.args.device.type))
        leave_together_at_exit()
        _accel.install(self.accelerator, self._du_dims)
        self.gather_function = self.accelerator.gather_for_metrics

    def _move_model_to_device(self, model: nn.Module, device: Any) -> None:
        """Nothing: ``fully_shard`` moves each rank's shards to its device (no full copy of
        the model on every device first)."""

    def _du_parallelize(self, model: nn.Module) -> nn.Module:
        if isinstance(model, FSDPModule):
            return model
        hf: Any = _state.base_model(model)
        if self._du_options.tiled_loss:  # the same Linear, now able to return the loss
            plain_head(hf).__class__ = _LossHead  # (names unchanged)
        # every rank starts from rank 0's weights, as under DDP
        moved = _state.start_from_rank0(
            model, self._du_dims.flat_mesh.get_group(), self.args.device
        )
        if moved and dist.get_rank() == 0:
            more = f" and {len(moved) - 3} more" if len(moved) > 3 else ""
            print(
                f"with_ulysses: {len(moved)} tensor(s) differed between ranks "
                f"({', '.join(moved[:3])}{more}); every rank now starts from rank 0's, as "
                f"under DDP",
                flush=True,
            )
        return parallelize_root(model, hf, self._du_dims.world_mesh, self._du_options,
                                compute_dtype=_compute_dtype(self.args))  # fmt: skip

    def _du_parallelize_reference(self, ref: nn.Module) -> nn.Module:
        """A family's second model (a reference, a teacher) on the policy's mesh: the same
        checks, rank 0's weights on every rank, Ulysses + FSDP2 with the policy's recipe
        (``dataclasses.replace`` of ``_du_options``) less activation checkpointing, frozen (no
        gradients, no optimizer state). The one way a second model gets the policy's recipe."""
        hf: Any = _state.base_model(ref)
        check_supported(hf)
        _refuse_attention_dropout(ref, self.args)
        ref.requires_grad_(False)
        _state.start_from_rank0(ref, self._du_dims.flat_mesh.get_group(), self.args.device)
        frozen = replace(self._du_options, activation_checkpointing=False,
                         offload_activations=False)  # fmt: skip
        ref = parallelize_root(ref, hf, self._du_dims.world_mesh, frozen,
                               compute_dtype=_compute_dtype(self.args))  # fmt: skip
        return ref.eval()

    def create_optimizer(self, *args: Any, **kwargs: Any):
        # a forward before training (evaluate) leaves the root unsharded; the optimizer must
        # hold the sharded parameters
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return super().create_optimizer(*args, **kwargs)  # type: ignore[misc]

    def _track_num_input_tokens(self, inputs: dict) -> None:
        # the stock count sums each rank's batch over the world, and the sp ranks of a group
        # hold the same rows: the count it adds is exactly sp times the tokens seen
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)  # type: ignore[misc]
        added = self.state.num_input_tokens_seen - before
        self.state.num_input_tokens_seen = before + added // self._du_dims.sp

    # ------------------------------------------------------------------------------------------
    # loss
    # ------------------------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any):
        batches, _ = super().get_batch_samples(  # type: ignore[misc]
            epoch_iterator, num_batches, device
        )
        if not batches or not self._du_step_mean:  # (a mean per micro-batch: no count)
            return batches, None
        shifted = self._du_shifted_count
        count = torch.tensor([sum(_targets(b, shifted) for b in batches)], dtype=torch.int64)
        count = count.to(device)
        if self._du_dims.dp > 1:  # sp ranks hold the same rows: count over dp
            dist.all_reduce(count, group=self._du_dims.dp_mesh.get_group())
        return batches, count[0]

    @_refusals_in_one_line
    def _du_forward(self, model: nn.Module, inputs: dict, num_items: Any, *, logits: bool):
        """This rank's slice through the model: the loss (its value the global one, its gradient
        this rank's part), the slice's logits (``None`` with the tiled loss unless ``logits``),
        and the sharded batch."""
        vision = is_vision_language(_state.base_model(model))
        # images (and videos): the model takes them whole
        read = _READ | set(VISION_KEYS) | set(VIDEO_KEYS) if vision else _READ
        if vision:
            refuse_video(inputs, _state.base_model(model))
        _refuse_batch_keys(inputs, read, _DROPPED, "it")
        dims = self._du_dims
        sb = shard_batch(inputs, dims, count_valid=False)
        group = dims.flat_mesh.get_group()
        training = bool(self.model.training)
        # the stock model averages each micro-batch on each dp rank (no num_items_in_batch)
        per_rank = training and not self._du_step_mean
        sp_group = dims.sp_mesh.get_group()
        if num_items is None:  # this batch's count (evaluation: over every rank)
            n = (sb.labels != IGNORE_INDEX).sum().reshape(1).to(torch.int64)
            dist.all_reduce(n, group=sp_group if per_rank else group)
            num_items = n[0]
        n_valid = max(int(num_items), 1)
        head: Any = None
        if self._du_options.tiled_loss and not logits:
            head = _state.base_model(model).get_output_embeddings()  # type: ignore[operator]
            head.labels = sb.labels
            head.chunk_tokens = self._du_options.loss_chunk_tokens or default_loss_chunk(
                sb.labels.numel()
            )
        extra_kw = {"output_router_logits": True} if self._du_router else {}
        if vision:  # the full rows and their images; the model slices after the merge
            call = vision_model_inputs(inputs, sb)
        else:
            call = dict(input_ids=sb.input_ids, position_ids=sb.position_ids,
                        ulysses_layout=sb.layout)  # fmt: skip
        try:
            out = model(**call, use_cache=False, **extra_kw)
        finally:
            if head is not None:
                head.labels = None
        if head is not None:
            if out.logits.dim() != 0:
                raise RuntimeError("the model changed its output head's result (the tiled loss)")
            slice_logits, ce_sum = None, out.logits
        else:
            slice_logits = out.logits
            ce_sum = cross_entropy_sum(slice_logits, sb.labels)
        local = ce_sum / n_valid
        aux = None
        if self._du_router:
            local, aux = self._du_router_loss(local, out, inputs, sb, group, training=training)
        if per_rank:  # the value: this dp rank's stock loss; the gradient: DDP's mean over dp
            local = local / getattr(self, "current_gradient_accumulation_steps",
                                    self.args.gradient_accumulation_steps)  # fmt: skip
            total = local.detach().clone()
            dist.all_reduce(total, group=sp_group)
            local = local / dims.dp
        else:
            total = local.detach().clone()
            dist.all_reduce(total, group=group)
        if hasattr(self, "_metrics"):  # TRL's SFT metrics
            self._du_trl_metrics(inputs, sb.labels, slice_logits, group)
            if aux is not None:  # what TRL logs: the unweighted router loss
                mode = "train" if self.model.training else "eval"
                self._metrics[mode]["aux_loss"].append(aux.item())
        # the value is the global loss (what the Trainer logs), the gradient this rank's part
        return total + (local - local.detach()), slice_logits, sb

    def _du_router_loss(self, local: torch.Tensor, out: Any, inputs: dict, sb: Any, group: Any,
                        *, training: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``local`` plus this rank's share of ``coef * L`` (the load-balancing loss over the
        micro-batch of every dp x sp rank,
        :func:`~dtensor_ulysses.hf.models.moe.load_balancing_loss`; padding excluded as the stock
        model excludes it), and ``L``."""
        assert self._du_router is not None
        coef, per_ga = self._du_router
        mask = inputs.get("attention_mask")
        S = inputs["input_ids"].shape[1]
        if sb.layout.seq_len > S:  # shard_batch's padding columns: no router loss either
            mask = torch.ones_like(inputs["input_ids"]) if mask is None else mask
            mask = nn.functional.pad(mask, (0, sb.layout.seq_len - S), value=0)
        if mask is not None:  # this rank's columns of its rows
            lo = sb.layout.offset(self._du_dims.sp_rank)
            mask = mask[:, lo : lo + sb.input_ids.shape[1]]
        rc = router_loss_config(_state.base_model(self.model))
        assert rc is not None  # _router_rule found it at construction
        rl = load_balancing_loss(out.router_logits, rc.num_experts, rc.top_k, group, valid=mask)
        if per_ga and training:  # TRL: a per-micro-batch mean, averaged over accumulation
            coef = coef / getattr(self, "current_gradient_accumulation_steps",
                                  self.args.gradient_accumulation_steps)  # fmt: skip
        return local + coef * rl.share.to(local.dtype), rl.value

    def _du_trl_metrics(self, inputs: dict, labels: torch.Tensor, logits: torch.Tensor | None,
                        group: Any) -> None:  # fmt: skip
        """What ``SFTTrainer.compute_loss`` logs, over the global batch: ``entropy`` and
        ``mean_token_accuracy`` at the valid targets (summed over every slice of every row; not
        with the tiled loss, which makes no logits), and ``num_tokens`` seen."""
        mode = "train" if self.model.training else "eval"
        metrics = self._metrics[mode]  # type: ignore[attr-defined]
        if logits is not None:
            with torch.no_grad():
                valid = labels != IGNORE_INDEX
                logp = logits.detach().float().log_softmax(-1)
                entropy = -(logp.exp() * logp).sum(-1)
                top1 = logits.argmax(-1) == labels
                sums = torch.stack([valid.sum(), entropy[valid].sum(), top1[valid].sum()])
                sums = sums.to(torch.float64)
                dist.all_reduce(sums, group=group)
            n, ent, correct = sums.tolist()
            metrics["entropy"].append(ent / n if n > 0 else 0.0)
            metrics["mean_token_accuracy"].append(correct / n if n > 0 else 0.0)
        if mode == "train":  # the rows' tokens, as TRL counts them; sp ranks share the rows
            if "attention_mask" in inputs:
                seen = int(inputs["attention_mask"].sum())
            else:
                seen = inputs["position_ids"].size(1)
            count = torch.tensor([seen], dtype=torch.int64)
            if self._du_dims.dp > 1:
                dist.all_reduce(count, group=self._du_dims.dp_mesh.get_group())
            self._total_train_tokens += int(count[0]) // getattr(self, "_tp_size", 1)  # type: ignore[attr-defined]
        metrics["num_tokens"] = [self._total_train_tokens]  # type: ignore[attr-defined]  # (eval too)

    def compute_loss(self, model: nn.Module, inputs: dict, return_outputs: bool = False,
                     num_items_in_batch: Any = None):  # fmt: skip
        loss, logits, _ = self._du_forward(model, inputs, num_items_in_batch,
                                           logits=return_outputs)  # fmt: skip
        return (loss, {"loss": loss, "logits": logits}) if return_outputs else loss

    def prediction_step(self, model: nn.Module, inputs: dict, prediction_loss_only: bool,
                        ignore_keys: Any = None):  # fmt: skip
        inputs = self._prepare_inputs(inputs)  # type: ignore[attr-defined]
        with torch.no_grad():
            loss, logits, sb = self._du_forward(model, inputs, None,
                                                logits=not prediction_loss_only)  # fmt: skip
        loss = loss.detach()
        if prediction_loss_only:
            return loss, None, None
        S = inputs["input_ids"].shape[1]  # (shard_batch's padding columns dropped)
        return loss, _gather_seq(logits, sb.layout, self._du_dims)[:, :S], inputs.get("labels")

    # ------------------------------------------------------------------------------------------
    # files
    # ------------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = _state.full_model_state(self.model)  # collective
        if self.args.should_save:
            self._save(output_dir, state_dict=state)  # type: ignore[attr-defined]
        dist.barrier()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")  # type: ignore[attr-defined]

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

        state = _state.optimizer_state(self.model, self.optimizer)  # collective
        if self.args.should_save:
            torch.save(state, os.path.join(output_dir, OPTIMIZER_NAME))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        dist.barrier()

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

        if checkpoint is None:
            return
        path = Path(checkpoint)
        if (path / OPTIMIZER_NAME).is_file():
            _state.load_optimizer(self.model, self.optimizer, path / OPTIMIZER_NAME)
        if (path / SCHEDULER_NAME).is_file():
            self.lr_scheduler.load_state_dict(
                torch.load(path / SCHEDULER_NAME, map_location="cpu", weights_only=True)
            )

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        _state.load_model_files(model or self.model, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        _state.load_model_files(self.model, self.state.best_model_checkpoint)


class _LossHead(nn.Linear):
    """The model's output head (the same parameters, the same names) that, while ``labels`` is
    set, returns the cross-entropy sum of its input in chunks of ``chunk_tokens`` rows
    (:func:`~dtensor_ulysses.models.tiled_cross_entropy_sum`) instead of ``[B, s, V]`` logits.
    It runs inside the model's own forward, so FSDP2's root unit has its weight gathered."""

    labels: torch.Tensor | None = None
    chunk_tokens: int = 0

    def forward(self, h_BsD: torch.Tensor) -> torch.Tensor:
        if self.labels is None:
            return super().forward(h_BsD)
        return tiled_cross_entropy_sum(h_BsD, self.weight, self.labels, self.chunk_tokens)


def _gather_seq(local_BsV: torch.Tensor, layout: Any, dims: ParallelDims) -> torch.Tensor:
    """The full ``[B, S, ...]`` tensor from each sp rank's ``[B, s, ...]`` slice."""
    group = dims.sp_mesh.get_group()
    sizes = layout.seq_sizes
    if len(sizes) == 1:
        return local_BsV
    longest = max(sizes)
    pad = local_BsV.new_zeros((local_BsV.shape[0], longest - local_BsV.shape[1],
                               *local_BsV.shape[2:]))  # fmt: skip
    parts = [torch.empty_like(torch.cat([local_BsV, pad], 1)) for _ in sizes]
    dist.all_gather(parts, torch.cat([local_BsV, pad], 1).contiguous(), group=group)
    return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)
