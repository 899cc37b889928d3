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
  restarting at 0, as ``padding_free`` collators give) as the engine's document layout.
  A vision-language model (Qwen2.5-VL, Qwen3-VL) takes the full rows and the batch's images
  (``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``) and slices after the image
  merge, each image (Qwen: each video too) encoded on one rank of the sp group
  (:mod:`~dtensor_ulysses.hf.vision`); other families' video inputs are refused.
* **Loss**: ``sum of the slice's cross entropy / N`` with ``N`` the valid targets of the whole
  optimizer step (all micro-batches, all dp ranks; ``-100`` and assistant / completion masks
  respected), so the summed gradients are the single-process gradients and gradient
  accumulation needs no rescaling. The value handed back to the Trainer (logged, averaged over
  ranks) is the all-reduced global one. A slice with no valid target contributes ``0``. With
  ``tiled_loss`` the output head returns that sum itself, computed in chunks of rows (the head
  stays the model's ``Linear``, its class swapped for ``_LossHead``), so no ``[B, s, V]``
  logits exist in training.
* **Router loss** (Mixture-of-Experts models whose stock forward adds one: Mixtral, Qwen3-MoE,
  gpt-oss, ...): the load-balancing loss of each micro-batch over *all* its tokens, every dp
  and sp rank's (:func:`~dtensor_ulysses.hf.moe.load_balancing_loss`), weighted as the stock
  trainer weights it (``Trainer``: ``router_aux_loss_coef`` when the config has
  ``output_router_logits``; TRL: its ``router_aux_loss_coef``, divided by the accumulation
  steps), padding excluded: the logged ``loss`` is the stock model's, cross entropy plus the
  weighted router loss, and so are the gradients.
* **Evaluation**: sharded at the training length (no fallback to one rank): the eval loss of a
  batch is its global token mean; with ``compute_metrics`` the logits are gathered over sp to
  the full sequence and ``labels`` are the collator's, so metrics see what they see on one
  process.
* **Tokens seen** (``include_num_input_tokens_seen``): the stock count, which sums every rank's
  rows, divided by sp, since the sp ranks of a group read the same rows; it equals the count of
  a single-process run. TRL's ``entropy``, ``mean_token_accuracy`` (not with the tiled loss)
  and ``num_tokens`` are those of the global batch.
* **Files**: ``save_model`` / checkpoints write the files of a single-process run (full weights
  gathered one by one to rank 0, full optimizer state keyed by parameter name); resume reads
  them on every rank, each keeping its shard.

Why FSDP2 is applied directly and not through accelerate's FSDP2 plugin: the plugin shards over
the whole world with gradients *averaged* and wraps by its own policy; exactness needs summed
gradients (the loss is already divided by the global token count) and the shard order that
puts Ulysses (and checkpointing) before ``fully_shard``. The plugin also turns on accelerate's
FSDP paths in the Trainer (its own state-dict types, optimizer saving, ``cp_size`` handling)
whose behaviour with an sp axis is not defined. Applied directly, the Trainer sees a
non-FSDP multi-process run, and only four accelerator methods change (see
:mod:`~dtensor_ulysses.hf._trainer_accel`): data by dp rank, no DDP wrap, the DTensor norm,
metrics gathered over dp. At interpreter exit, every rank leaves the process group together
(:func:`~dtensor_ulysses._exit.leave_together_at_exit`), so a finished run exits 0.
Every other piece of the Trainer's loop (schedules, logging, callbacks, checkpoint cadence,
RNG files) is the stock one.

Refused at construction, with the reason: models the engine cannot run exactly (bidirectional
attention, ...), trainers that build their inputs by generation (online DPO, PPO, GKD, ...;
GRPO and RLOO are made exact by :mod:`~dtensor_ulysses.hf.rl`) or whose loss is not the token
cross entropy and has no family mixin (DPO and KTO have theirs:
:mod:`~dtensor_ulysses.hf.preference`; reward: :mod:`~dtensor_ulysses.hf.reward`), DeepSpeed or
accelerate's
FSDP also enabled, a ``parallelism_config`` with ``cp_size``,
``sp_size`` or ``tp_size > 1``, a ``compute_loss_func``, label smoothing, optimizers passed in
(built before sharding), iterable datasets, ``save_on_each_node``.
"""

from __future__ import annotations

import functools
import importlib
import linecache
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from dtensor_ulysses._exit import (
    exit_process,
    leave_together,
    leave_together_at_exit,
    write_rank_note,
)
from dtensor_ulysses.data import IGNORE_INDEX
from dtensor_ulysses.hf import _trainer_accel, _trainer_state
from dtensor_ulysses.hf.batch import shard_batch
from dtensor_ulysses.hf.model import _parallelize_root, _plain_head
from dtensor_ulysses.hf.moe import load_balancing_loss, router_loss_config
from dtensor_ulysses.hf.routing import (
    UnsupportedModelError,
    attention_dropout,
    attention_modules,
    check_supported,
)
from dtensor_ulysses.hf.vision import (
    VIDEO_KEYS,
    VISION_KEYS,
    is_vision_language,
    refuse_video,
    vision_model_inputs,
)
from dtensor_ulysses.models import cross_entropy_sum, tiled_cross_entropy_sum
from dtensor_ulysses.parallel import flatten_dp_sp
from dtensor_ulysses.parallel.mesh import ParallelDims
from dtensor_ulysses.plan import ParallelOptions
from dtensor_ulysses.plan.splits import default_loss_chunk

__all__ = ["UnsupportedTrainerError", "with_ulysses"]

# the ParallelOptions fields with_ulysses takes, with their defaults (the recipe's one type)
OPTIONS = {
    name: getattr(ParallelOptions(), name)
    for name in ("activation_checkpointing", "offload_activations", "offload_params",
                 "head_chunks", "tiled_loss", "loss_chunk_tokens", "attention_backend",
                 "allow_uneven_heads", "mixed_precision")
}  # fmt: skip
# trainers whose inputs come from generation, or whose loss is not the token cross entropy
_GENERATION = ("OnlineDPOTrainer", "PPOTrainer", "GKDTrainer", "NashMDTrainer", "XPOTrainer",
               "GOLDTrainer", "AsyncGRPOTrainer")  # fmt: skip
# TRL trainers whose loss is not the token cross entropy, made exact by a mixin of their own
# (one module per trainer family's loss): class name in the MRO -> (module, mixin)
_FAMILIES: dict[str, tuple[str, str]] = {
    "DPOTrainer": ("dtensor_ulysses.hf.preference", "_UlyssesDPO"),
    "KTOTrainer": ("dtensor_ulysses.hf.preference", "_UlyssesKTO"),
    "RewardTrainer": ("dtensor_ulysses.hf.reward", "_UlyssesReward"),
    "GRPOTrainer": ("dtensor_ulysses.hf.rl", "_UlyssesRL"),
    "RLOOTrainer": ("dtensor_ulysses.hf.rl", "_UlyssesRL"),
}
# batch keys the slicing reads, and keys it replaces (varlen kwargs of the local slice)
_READ = {"input_ids", "labels", "attention_mask", "position_ids"}
_DROPPED = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
            "use_cache", "num_items_in_batch", "return_loss"}  # fmt: skip


class UnsupportedTrainerError(ValueError):
    """A trainer, argument or model that :func:`with_ulysses` cannot make exact; the message
    names it and the reason."""


# ----------------------------------------------------------------------------------------------
# a refusal under a launch: one line, from rank 0 (the exception itself is unchanged)
# ----------------------------------------------------------------------------------------------
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _is_refusal(e: BaseException) -> bool:
    """An exception the library raised on purpose for bad input: the engine's and the trainer's
    refusals, or a ``ValueError`` from a ``raise`` statement in this package (a ``ValueError``
    a builtin raised inside it is a bug, and keeps its traceback)."""
    if isinstance(e, (UnsupportedTrainerError, UnsupportedModelError)):
        return True
    if not isinstance(e, ValueError) or e.__traceback__ is None:
        return False
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename
    line = linecache.getline(filename, tb.tb_lineno).strip()
    return os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep) and line.startswith("raise")


def _refusals_in_one_line(fn: Any) -> Any:
    """Decorate ``fn`` so that a refusal it raises, if nothing catches it, ends the process with
    one ``error:`` line printed by rank 0 alone (status 2, the message also in torchrun's failure
    summary) instead of a traceback from every rank. In-process (no launcher) it is raised."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            if _is_refusal(e):
                e._du_refusal = True  # type: ignore[attr-defined]
                _install_refusal_hook()
            raise

    return wrapper


def _install_refusal_hook() -> None:
    """Wrap ``sys.excepthook`` (once): an uncaught refusal leaves as :func:`_leave_refused`
    says; anything else goes to the previous hook (its traceback)."""
    if getattr(sys.excepthook, "_du_refusals", False):
        return
    previous = sys.excepthook

    def hook(kind: type, value: BaseException, tb: Any) -> None:
        if not getattr(value, "_du_refusal", False):
            return previous(kind, value, tb)
        _leave_refused(value)

    hook._du_refusals = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _leave_refused(e: BaseException) -> None:
    """Rank 0 prints ``error: <message>`` on one line; every rank writes the message where
    torchrun's failure summary shows it; the other ranks wait for rank 0 to end the job
    (:func:`~dtensor_ulysses._exit.leave_together`); all leave with status 2."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK") or 0)
    text = " ".join(str(e).split())
    write_rank_note(f"{type(e).__name__}: {text}")
    if rank == 0:
        print(f"error: {text}", file=sys.stderr, flush=True)
    exit_process(leave_together(2, rank))


@_refusals_in_one_line
def with_ulysses(cls: type, sp: int, **options: Any) -> type:
    """A subclass of ``cls`` (``transformers.Trainer``, TRL ``SFTTrainer``, ``DPOTrainer``,
    ``KTOTrainer`` or a subclass of one) that trains with Ulysses sequence parallelism of
    degree ``sp`` on FSDP2.

    Args:
        cls: the trainer class.
        sp: the Ulysses degree; the launch's world size ``P`` must be a multiple (``dp = P/sp``).
        **options: ``activation_checkpointing`` (also turned on by the arguments'
            ``gradient_checkpointing``), ``offload_activations``, ``offload_params``,
            ``head_chunks``, ``tiled_loss`` (the loss from the final hidden states in chunks of
            ``loss_chunk_tokens``, default ``min(2048, local tokens)``: no ``[B, s, V]``
            logits; needs a plain output head), ``attention_backend`` (``"auto"`` or a kernel
            name),
            ``allow_uneven_heads`` (q heads that sp does not divide), ``mixed_precision`` (an
            FSDP2 ``MixedPrecisionPolicy``, ``None``, or ``"auto"``: bf16 on CUDA): the
            fields of :class:`~dtensor_ulysses.plan.ParallelOptions` that apply to a
            transformers trainer, checked by its one ``check``.

    Returns:
        The subclass; construct it as ``cls``.

    Raises:
        UnsupportedTrainerError: a trainer whose inputs come from generation or whose loss is
            not the token cross entropy without a family mixin (DPO and KTO have theirs:
            :mod:`~dtensor_ulysses.hf.preference`).
        ValueError: bad ``sp`` or an unknown option.
    """
    from transformers import Trainer

    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise TypeError(f"with_ulysses takes a transformers.Trainer subclass, got {cls!r}")
    if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
        raise ValueError(f"sp={sp!r} is not a positive int; use sp >= 1 (e.g. sp=4)")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(
            f"unknown with_ulysses options {unknown}; the options are {list(OPTIONS)} (fields "
            f"of dtensor_ulysses.plan.ParallelOptions)"
        )
    ParallelOptions(**options).check(hf_model=True)
    names = [c.__name__ for c in cls.__mro__]
    generation = [n for n in names if n in _GENERATION]
    if generation:
        raise UnsupportedTrainerError(
            f"{cls.__name__} ({generation[0]}) builds its training inputs by generation, which "
            f"with_ulysses makes exact for GRPOTrainer and RLOOTrainer only (rollouts on whole "
            f"prompts, shared by the sp group); supported: transformers.Trainer, "
            f"trl.SFTTrainer{''.join(', trl.' + n for n in _FAMILIES)} (and subclasses)"
        )
    family = next((n for n in names if n in _FAMILIES), None)
    is_trl = any(c.__module__.split(".")[0] == "trl" for c in cls.__mro__)
    if is_trl and family is None and "SFTTrainer" not in names:
        raise UnsupportedTrainerError(
            f"{cls.__name__} computes its own loss (not the token-weighted cross entropy that "
            f"with_ulysses makes exact across sequence slices); supported: transformers.Trainer, "
            f"trl.SFTTrainer{''.join(', trl.' + n for n in _FAMILIES)}"
        )
    bases: tuple[type, ...] = (_UlyssesTrainer, cls)
    if family is not None:  # the family's loss, placed before the shared mixin
        module, mixin = _FAMILIES[family]
        bases = (getattr(importlib.import_module(module), mixin), *bases)
    attrs = {"_du_sp": sp, "_du_options": {**OPTIONS, **options}, "__module__": __name__}
    return type(f"Ulysses{cls.__name__}", bases, attrs)


def _refuse_batch_keys(inputs: dict, read: set[str], dropped: set[str], who: str) -> None:
    """Refuse the batch's tensors that a step neither reads (``read``) nor replaces
    (``dropped``): with_ulysses could not cut them into sequence slices. ``who`` names the step
    in the message ("it", "the reward step")."""
    extra = sorted(
        k for k, v in inputs.items() if k not in read | dropped and isinstance(v, torch.Tensor)
    )
    if extra:
        raise UnsupportedTrainerError(
            f"batch keys {extra} cannot be cut into sequence slices by with_ulysses ({who} "
            f"reads {sorted(read)}); remove them from the collator's output"
        )


def _refuse_args(args: Any, sp: int, *, own_loss: bool = False) -> None:
    """The training arguments with_ulysses cannot make exact; ``own_loss``: a trainer family
    whose mixin checks its own ``loss_type``."""
    from transformers import Trainer

    problems = []
    if getattr(args, "deepspeed", None):
        problems.append(
            "DeepSpeed is enabled (args.deepspeed): it shards and reduces the model itself; "
            "with_ulysses shards with FSDP2 - drop the DeepSpeed config"
        )
    if getattr(args, "fsdp", None):
        problems.append(
            "accelerate's FSDP is enabled (args.fsdp): with_ulysses applies FSDP2 itself over "
            "dp x sp with summed gradients - drop args.fsdp / fsdp_config"
        )
    pc = getattr(args, "parallelism_config", None)
    for name in ("cp_size", "sp_size", "tp_size"):
        size = getattr(pc, name, 1) or 1
        if pc is not None and size > 1:
            problems.append(
                f"parallelism_config.{name}={size}: a second sequence / tensor parallelism "
                f"cannot run with Ulysses (sp={sp}) here; set {name}=1"
            )
    if float(getattr(args, "label_smoothing_factor", 0.0) or 0.0) > 0:
        problems.append(
            f"label_smoothing_factor={args.label_smoothing_factor}: the sharded loss is the "
            f"plain token cross entropy; set it to 0"
        )
    loss_type = getattr(args, "loss_type", None)
    if loss_type not in (None, "nll") and not own_loss:
        problems.append(f"loss_type={loss_type!r}: only 'nll' is made exact; set loss_type='nll'")
    tokens_seen = getattr(args, "include_num_input_tokens_seen", "no")
    if tokens_seen not in ("no", False, None) and not hasattr(Trainer, "_track_num_input_tokens"):
        problems.append(
            f"include_num_input_tokens_seen={tokens_seen!r}: this transformers version counts "
            f"tokens where with_ulysses cannot undo the sp-fold count; set it to 'no'"
        )
    if getattr(args, "save_on_each_node", False):
        problems.append("save_on_each_node=True: the full weights are gathered to rank 0 only")
    if problems:
        raise UnsupportedTrainerError(
            "with_ulysses cannot run this exactly: " + "; ".join(problems)
        )


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


def _targets(batch: dict) -> int:
    """Valid targets of a full-length batch, as :func:`~dtensor_ulysses.hf.shard_batch` shifts
    them (the label of the next token, none from or into padding)."""
    labels = batch.get("labels")
    labels = batch["input_ids"] if labels is None else labels
    valid = labels[:, 1:] != IGNORE_INDEX
    mask = batch.get("attention_mask")
    if mask is not None:
        mask = mask.bool()
        valid &= mask[:, 1:] & mask[:, :-1]
    return int(valid.sum())


def _refuse_attention_dropout(model: Any, args: Any) -> None:
    """Refuse attention dropout at construction, before the model is loaded when TRL loads it
    from a name (its config, with ``model_init_kwargs``), and on the modules of a loaded model
    (the probability each attention layer would pass to the kernel in training): the one
    detector, :func:`~dtensor_ulysses.hf.routing.attention_dropout`."""
    found: dict[str, float] = {}
    if isinstance(model, str):
        try:
            from transformers import AutoConfig

            cfg: Any = AutoConfig.from_pretrained(model).get_text_config()
        except Exception:  # not readable here: the loaded model is checked after loading
            return
        overrides = getattr(args, "model_init_kwargs", None) or {}
        found = attention_dropout(cfg, overrides=overrides)
        what = repr(model)
    elif isinstance(model, nn.Module):
        hf: Any = _trainer_state.base_model(model)
        cfg = hf.config.get_text_config()
        found = {f"config.{k}": v for k, v in attention_dropout(cfg).items()}
        for name, m in attention_modules(hf):
            for key, v in attention_dropout(None, m).items():
                found[f"{name}.{key.removeprefix('module.')}"] = v
        what = type(hf).__name__
    else:
        return
    if found:
        items = [f"{k}={v}" for k, v in found.items()]
        more = f" and {len(items) - 2} more" if len(items) > 2 else ""
        raise UnsupportedModelError(
            f"{what} has attention dropout ({', '.join(items[:2])}{more}): each rank would draw "
            f"its own mask for its heads and slice, so training cannot equal the single-process "
            f"run; set attention_dropout=0.0 in the model config (from_pretrained(..., "
            f"attention_dropout=0.0), or SFTConfig(model_init_kwargs={{'attention_dropout': "
            f"0.0}}))"
        )


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

    o, mesh = trainer._du_options, trainer._du_mesh
    dp, sp = mesh["dp"].size(), mesh["sp"].size()
    device = trainer.args.device
    hf: Any = _trainer_state.base_model(trainer.model)
    cfg = hf.config.get_text_config()
    kernel = describe_kernels(model_kernels(hf))
    features = [
        name
        for name, on in (
            ("activation checkpointing", o["activation_checkpointing"]),
            ("offloaded activations", o["offload_activations"]),
            ("offloaded parameters", o["offload_params"]),
            (f"head chunks {o['head_chunks']}", o["head_chunks"] > 1),
            ("tiled loss", o["tiled_loss"]),
            ("uneven heads", o["allow_uneven_heads"]),
        )
        if on
    ]
    policy = o["mixed_precision"]
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
    """Mixin placed before the user's trainer class by :func:`with_ulysses`."""

    _du_sp: int
    _du_options: dict[str, Any]
    _du_mesh: Any
    _du_router: tuple[float, bool] | None = None
    _du_family_loss: bool = False  # a family mixin computes the loss (and checks loss_type)
    # provided by transformers.Trainer
    args: Any
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
            check_supported(_trainer_state.base_model(model))
            if self._du_options["tiled_loss"]:
                _plain_head(_trainer_state.base_model(model))
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
        super().__init__(*args, **kwargs)
        self._du_router = _router_rule(self, _trainer_state.base_model(self.model))
        if self.args.gradient_checkpointing:  # ours, per decoder layer, inside FSDP2
            self._du_options = {**self._du_options, "activation_checkpointing": True}
            self.args.gradient_checkpointing = False
        self.model_accepts_loss_kwargs = True  # the loss below is normalized over the step
        self.loss_is_scaled_for_ga = True
        _refuse_attention_dropout(self.model, self.args)  # a model TRL loaded from its name
        self.model = self.model_wrapped = self._du_parallelize(self.model)
        _announce(self)

    # ------------------------------------------------------------------------------------------
    # construction
    # ------------------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        _refuse_args(self.args, self._du_sp, own_loss=self._du_family_loss)
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        kind = str(getattr(self.accelerator, "distributed_type", ""))
        if "DEEPSPEED" in kind or kind.endswith("FSDP"):
            raise UnsupportedTrainerError(
                f"the accelerator runs {kind} (from the accelerate config): with_ulysses shards "
                f"with FSDP2 itself; launch with a plain multi-process config (torchrun)"
            )
        if not dist.is_initialized():
            raise ValueError(
                f"with_ulysses(sp={self._du_sp}) needs a distributed launch: torchrun "
                f"--nproc-per-node P with P a multiple of {self._du_sp}"
            )
        world = dist.get_world_size()
        if self.args.world_size != world:
            raise ValueError(
                f"accelerate sees {self.args.world_size} process(es) of the {world}-rank launch "
                f"(its distributed type is {kind or 'NO'}); on CPU pass use_cpu=True in the "
                f"training arguments so that it runs multi-process"
            )
        self._du_dims = ParallelDims.resolve(world, dp=None, sp=self._du_sp)  # the checks
        self._du_mesh = self._du_dims.build_mesh(self.args.device.type)
        leave_together_at_exit()
        _trainer_accel.install(self.accelerator, self._du_mesh)
        self.gather_function = self.accelerator.gather_for_metrics

    def _move_model_to_device(self, model: nn.Module, device: Any) -> None:
        """Nothing: ``fully_shard`` moves each rank's shards to its device (no full copy of
        the model on every device first)."""

    def _du_parallelize(self, model: nn.Module) -> nn.Module:
        if isinstance(model, FSDPModule):
            return model
        o = self._du_options
        hf: Any = _trainer_state.base_model(model)
        ParallelOptions(**o).check(hf_model=True)  # gradient_checkpointing may have changed it
        if o["tiled_loss"]:  # the same Linear, now able to return the loss (names unchanged)
            _plain_head(hf).__class__ = _LossHead
        # every rank starts from rank 0's weights, as under DDP
        moved = _trainer_state.start_from_rank0(
            model, flatten_dp_sp(self._du_mesh).get_group(), self.args.device
        )
        if moved and dist.get_rank() == 0:
            more = f" and {len(moved) - 3} more" if len(moved) > 3 else ""
            print(
                f"with_ulysses: {len(moved)} tensor(s) differed between ranks "
                f"({', '.join(moved[:3])}{more}); every rank now starts from rank 0's, as "
                f"under DDP",
                flush=True,
            )
        return _parallelize_root(
            model, hf, self._du_mesh, activation_checkpointing=o["activation_checkpointing"],
            offload_activations=o["offload_activations"], offload_params=o["offload_params"],
            head_chunks=o["head_chunks"], mixed_precision=o["mixed_precision"],
            attention_backend=o["attention_backend"], allow_uneven_heads=o["allow_uneven_heads"],
            compute_dtype=_compute_dtype(self.args),
        )  # fmt: skip

    def _du_parallelize_reference(self, ref: nn.Module) -> nn.Module:
        """A family's reference model on the policy's mesh: the same checks, rank 0's weights
        on every rank, Ulysses + FSDP2 as the policy, frozen (no gradients, no optimizer
        state, no activation checkpointing)."""
        hf: Any = _trainer_state.base_model(ref)
        check_supported(hf)
        _refuse_attention_dropout(ref, self.args)
        ref.requires_grad_(False)
        _trainer_state.start_from_rank0(
            ref, flatten_dp_sp(self._du_mesh).get_group(), self.args.device
        )
        o = self._du_options
        ref = _parallelize_root(
            ref, hf, self._du_mesh, activation_checkpointing=False, offload_activations=False,
            offload_params=o["offload_params"], head_chunks=o["head_chunks"],
            mixed_precision=o["mixed_precision"], attention_backend=o["attention_backend"],
            allow_uneven_heads=o["allow_uneven_heads"], compute_dtype=_compute_dtype(self.args),
        )  # fmt: skip
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
        self.state.num_input_tokens_seen = before + added // self._du_sp

    # ------------------------------------------------------------------------------------------
    # loss
    # ------------------------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any):
        batches, _ = super().get_batch_samples(  # type: ignore[misc]
            epoch_iterator, num_batches, device
        )
        if not batches:
            return batches, None
        count = torch.tensor([sum(_targets(b) for b in batches)], dtype=torch.int64)
        count = count.to(device)
        dp_mesh = self._du_dims.dp_group(self._du_mesh)
        if dp_mesh.size() > 1:  # sp ranks hold the same rows: count over dp
            dist.all_reduce(count, group=dp_mesh.get_group())
        return batches, count[0]

    @_refusals_in_one_line
    def _du_forward(self, model: nn.Module, inputs: dict, num_items: Any, *, logits: bool):
        """This rank's slice through the model: the loss (its value the global one, its gradient
        this rank's part), the slice's logits (``None`` with the tiled loss unless ``logits``),
        and the sharded batch."""
        vision = is_vision_language(_trainer_state.base_model(model))
        # images (and videos): the model takes them whole
        read = _READ | set(VISION_KEYS) | set(VIDEO_KEYS) if vision else _READ
        if vision:
            refuse_video(inputs, _trainer_state.base_model(model))
        _refuse_batch_keys(inputs, read, _DROPPED, "it")
        mesh = self._du_mesh
        sb = shard_batch(inputs, mesh, count_valid=False)
        group = flatten_dp_sp(mesh).get_group()
        if num_items is None:  # evaluation: this batch's global count
            n = (sb.labels != IGNORE_INDEX).sum().reshape(1).to(torch.int64)
            dist.all_reduce(n, group=group)
            num_items = n[0]
        n_valid = max(int(num_items), 1)
        head: Any = None
        if self._du_options["tiled_loss"] and not logits:
            head = _trainer_state.base_model(model).get_output_embeddings()  # type: ignore[operator]
            head.labels = sb.labels
            head.chunk_tokens = self._du_options["loss_chunk_tokens"] or default_loss_chunk(
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
            training = num_items is not None
            local, aux = self._du_router_loss(local, out, inputs, sb, group, training=training)
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
        micro-batch of every dp x sp rank, :func:`~dtensor_ulysses.hf.moe.load_balancing_loss`;
        padding excluded as the stock model excludes it), and ``L``."""
        assert self._du_router is not None
        coef, per_ga = self._du_router
        mask = inputs.get("attention_mask")
        if mask is not None:  # this rank's columns of its rows
            me = self._du_mesh.get_local_rank("sp")
            lo = sb.layout.offset(me)
            mask = mask[:, lo : lo + sb.input_ids.shape[1]]
        rc = router_loss_config(_trainer_state.base_model(self.model))
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
            if self._du_dims.dp_group(self._du_mesh).size() > 1:
                dist.all_reduce(count, group=self._du_dims.dp_group(self._du_mesh).get_group())
            self._total_train_tokens += int(count[0]) // getattr(self, "_tp_size", 1)  # type: ignore[attr-defined]
            metrics["num_tokens"] = [self._total_train_tokens]  # type: ignore[attr-defined]

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
        return loss, _gather_seq(logits, sb.layout, self._du_mesh), inputs.get("labels")

    # ------------------------------------------------------------------------------------------
    # files
    # ------------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = _trainer_state.full_model_state(self.model)  # collective
        if self.args.should_save:
            self._save(output_dir, state_dict=state)  # type: ignore[attr-defined]
        dist.barrier()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")  # type: ignore[attr-defined]

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

        state = _trainer_state.optimizer_state(self.model, self.optimizer)  # collective
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
            _trainer_state.load_optimizer(self.model, self.optimizer, path / OPTIMIZER_NAME)
        if (path / SCHEDULER_NAME).is_file():
            self.lr_scheduler.load_state_dict(
                torch.load(path / SCHEDULER_NAME, map_location="cpu", weights_only=True)
            )

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        _trainer_state.load_model_files(model or self.model, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        _trainer_state.load_model_files(self.model, self.state.best_model_checkpoint)


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


def _gather_seq(local_BsV: torch.Tensor, layout: Any, mesh: Any) -> torch.Tensor:
    """The full ``[B, S, ...]`` tensor from each sp rank's ``[B, s, ...]`` slice."""
    group = ParallelDims.from_mesh(mesh).sp_group(mesh).get_group()
    sizes = layout.seq_sizes
    if len(sizes) == 1:
        return local_BsV
    longest = max(sizes)
    pad = local_BsV.new_zeros((local_BsV.shape[0], longest - local_BsV.shape[1],
                               *local_BsV.shape[2:]))  # fmt: skip
    parts = [torch.empty_like(torch.cat([local_BsV, pad], 1)) for _ in sizes]
    dist.all_gather(parts, torch.cat([local_BsV, pad], 1).contiguous(), group=group)
    return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)
