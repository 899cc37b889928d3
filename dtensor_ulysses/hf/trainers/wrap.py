"""``with_ulysses(TrainerClass, sp=N, **options)``: the subclass that trains with Ulysses.

The shared behaviour (mesh, model, data, loss, files) is the mixin of
:mod:`~dtensor_ulysses.hf.trainers.base`; a TRL trainer family whose loss is not the token cross
entropy adds its own mixin (:data:`_FAMILIES`, a static table: the import graph sees every
family this module can place).
"""

from __future__ import annotations

from typing import Any

from dtensor_ulysses.hf.trainers.base import _UlyssesTrainer
from dtensor_ulysses.hf.trainers.distillation import _UlyssesDistillation
from dtensor_ulysses.hf.trainers.preference import _UlyssesDPO, _UlyssesKTO
from dtensor_ulysses.hf.trainers.refusals import UnsupportedTrainerError, _refusals_in_one_line
from dtensor_ulysses.hf.trainers.reward import _UlyssesReward
from dtensor_ulysses.hf.trainers.rl import _UlyssesRL
from dtensor_ulysses.plan.recipe import WITH_ULYSSES, ParallelOptions

__all__ = ["with_ulysses"]
# trainers whose inputs come from generation, or whose loss is not the token cross entropy
_GENERATION = ("OnlineDPOTrainer", "PPOTrainer", "GKDTrainer", "NashMDTrainer", "XPOTrainer",
               "GOLDTrainer", "AsyncGRPOTrainer")  # fmt: skip
# TRL trainers whose loss is not the token cross entropy, made exact by a mixin of their own
# (one module per trainer family's loss): class name in the MRO -> the mixin
_FAMILIES: dict[str, type] = {
    "DPOTrainer": _UlyssesDPO,
    "KTOTrainer": _UlyssesKTO,
    "RewardTrainer": _UlyssesReward,
    "GRPOTrainer": _UlyssesRL,
    "RLOOTrainer": _UlyssesRL,
    "DistillationTrainer": _UlyssesDistillation,
}


@_refusals_in_one_line
def with_ulysses(
    cls: type, sp: int, options: ParallelOptions | None = None, **keywords: Any
) -> type:
    """A subclass of ``cls`` (``transformers.Trainer``, TRL ``SFTTrainer``, ``DPOTrainer``,
    ``KTOTrainer``, ``RewardTrainer``, ``GRPOTrainer``, ``RLOOTrainer``, ``DistillationTrainer``
    or a subclass of one) that trains with Ulysses sequence parallelism of
    degree ``sp`` on FSDP2.

    ``with_ulysses(SFTTrainer, sp=4, options=ParallelOptions(activation_checkpointing=True))``
    and ``with_ulysses(SFTTrainer, sp=4, activation_checkpointing=True)`` are the same trainer:
    the recipe as one object or as its fields by keyword, not both. The subclass keeps the one
    :class:`~dtensor_ulysses.plan.ParallelOptions` (``_du_options``), checked here once.

    Args:
        cls: the trainer class.
        sp: the Ulysses degree; the launch's world size ``P`` must be a multiple (``dp = P/sp``).
        options: the recipe, of which a trainer applies ``activation_checkpointing`` (also
            turned on by the arguments' ``gradient_checkpointing``), ``offload_activations``,
            ``offload_params``, ``head_chunks``, ``tiled_loss`` (the loss from the final hidden
            states in chunks of ``loss_chunk_tokens``, default ``min(2048, local tokens)``: no
            ``[B, s, V]`` logits; needs a plain output head), ``attention_backend``
            (``"auto"`` or a kernel name), ``allow_uneven_heads`` (q heads that sp does not
            divide) and ``mixed_precision`` (an FSDP2 ``MixedPrecisionPolicy``, ``None``, or
            ``"auto"``: bf16 on CUDA); any other field set is refused (the built-in model's
            ``overlap_comm``, ``compile``, ``tiled_mlp``; the trainer's host AdamW,
            ``offload_optimizer``: a ``Trainer`` builds its own optimizer).
        **keywords: the same fields as keywords, instead of ``options``.

    Returns:
        The subclass; construct it as ``cls``.

    Raises:
        UnsupportedTrainerError: a trainer whose inputs come from generation or whose loss is
            not the token cross entropy without a family mixin (:data:`_FAMILIES`: DPO and KTO,
            :mod:`~dtensor_ulysses.hf.trainers.preference`; reward; GRPO and RLOO,
            :mod:`~dtensor_ulysses.hf.trainers.rl`; on-policy distillation,
            :mod:`~dtensor_ulysses.hf.trainers.distillation`).
        ValueError: bad ``sp``; an unknown keyword, both an object and keywords, a field
            the trainer does not apply, or a combination the one ``check`` refuses.
    """
    from transformers import Trainer

    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise TypeError(f"with_ulysses takes a transformers.Trainer subclass, got {cls!r}")
    if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
        raise ValueError(f"sp={sp!r} is not a positive int; use sp >= 1 (e.g. sp=4)")
    opts = ParallelOptions.at_door(options, keywords, door=WITH_ULYSSES, whole=True)
    opts.check(hf_model=True)
    names = [c.__name__ for c in cls.__mro__]
    generation = [n for n in names if n in _GENERATION]
    if generation:
        raise UnsupportedTrainerError(
            f"{cls.__name__} ({generation[0]}) builds its training inputs by generation, which "
            f"with_ulysses makes exact for GRPOTrainer, RLOOTrainer and DistillationTrainer only "
            f"(rollouts on whole prompts, shared by the sp group); supported: "
            f"transformers.Trainer, trl.SFTTrainer{''.join(', trl.' + n for n in _FAMILIES)} "
            f"(and subclasses)"
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
        bases = (_FAMILIES[family], *bases)
    attrs = {"_du_sp_arg": sp, "_du_options": opts, "__module__": __name__}
    return type(f"Ulysses{cls.__name__}", bases, attrs)
