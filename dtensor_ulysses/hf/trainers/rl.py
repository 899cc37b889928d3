"""TRL's online RL trainers (``GRPOTrainer``, ``RLOOTrainer``) under :func:`with_ulysses`, exact.

Legend: ``B`` rows of this dp rank, ``S`` a row's full length (prompt + completion), ``s`` this
sp rank's piece, ``C`` the completion length (``logits_to_keep``).

The stock trainer's step, on ``dp x sp`` ranks, is the one of its rank for the same dp index:

* **Rollouts once per sp group** (:mod:`~dtensor_ulysses.hf.trainers.rollouts`): each rank of an
  sp group makes its ``1/sp`` share of the group's rollouts with the weights gathered once per
  round, tools, environments and a ``rollout_func`` included, and the shares are exchanged;
  decoding that does not depend on the split (greedy; each rollout sampled from its own seeded
  generator) makes the stock rank's rollouts.
* **Rewards once per completion per dp group, on the rollout's owner.** Each rank scores its own
  rollouts (an environment's ``get_reward`` and a reward function's ``environments`` are there),
  with TRL's own ``_calculate_rewards``; the ``[r, n_funcs]`` rewards (and what the functions
  logged with ``log_extra`` / ``log_metric``) are exchanged over sp, then gathered over dp as the
  stock trainer gathers them over its ranks, so advantages are computed from the numbers the
  stock trainer sees. A function is called once per share (``log_metric``'s values are averaged
  over the calls, as over the stock ranks).
* **Everything the stock trainer reduces over its ranks is reduced over dp** (its
  ``accelerator.gather`` / ``reduce`` / ``num_processes`` / ``process_index`` and TRL's
  ``gather`` / ``gather_object`` inside the step), since the sp ranks of a group are replicas of
  one stock rank there.
* **Log-probabilities on the sharded sequence.** Each prompt+completion row (a multi-turn row
  with its tool results, a vision-language row with its images) is cut by
  :func:`~dtensor_ulysses.hf.shard_batch` after the rollout (labels shifted over the full row
  first, left padding as its own document, global positions ``0..S-1`` as the stock forward
  uses; the right padding joins its row's document: causal attention never reads it for a real
  token, and rows with the same prompt get the same layout, so their values agree bit for bit
  as in the stock forward); a row shorter than sp is padded to sp columns (masked, no label),
  so a rank may hold only padding. Qwen2.5-VL / Qwen3-VL take the full rows and their images
  (each image encoded on one rank of the sp group, the decoder sliced after the merge:
  :mod:`~dtensor_ulysses.hf.models.vision`). The policy, old policy and reference models run
  this rank's slice, and TRL's own fused head returns the per-token log-probabilities (and
  entropies) of the slice in chunks, never ``[B, s, V]`` logits (TRL's head, not
  :func:`~dtensor_ulysses.hf.trainers.logps.token_rows`' plain one: GRPO's log-probabilities
  are those of the logits divided by the sampling temperature, with the model's logit scale and
  softcap). The ``[B, S]`` rows of every slice are summed over sp
  (:func:`~dtensor_ulysses.comm.all_reduce_sum`: forward all-reduce, the gradient of this rank's
  slice passes through; each value comes from one rank and zeros, so every rank holds the same
  bits) so that each rank holds the completion's ``[B, C]`` log-probabilities; the stock loss
  (ratios, clipping, KL, the tool mask, the top-entropy mask, every ``loss_type`` and
  ``importance_sampling_level``) then runs unchanged on them. ``top_entropy_quantile < 1``
  takes the quantile of entropies every rank agrees on bit for bit (gathered over dp as the
  stock ranks gather them). Each token's gradient flows through the one rank that computed it,
  so the normalisations count every token once; the returned loss keeps its value and carries
  ``1/dp`` of its gradient (FSDP2 sums gradients over dp x sp, where DDP averages over dp).
* **The reference model** (``beta > 0``) is loaded by the stock trainer and prepared like the
  policy (Ulysses on every attention layer, ``fully_shard`` over dp x sp), without gradients;
  ``beta = 0`` loads none; with a PEFT adapter it is the policy with the adapter disabled, as in
  the stock trainer.

Refused at construction, with the reason: vLLM generation (no GPU test here yet), transformers'
continuous batching (``use_transformers_paged``: its engine samples every request of a rank
from one stream, not per rollout), vision-language families other than Qwen2.5-VL / Qwen3-VL,
the adaptive entropy bonus, a router (MoE) auxiliary loss, ``sync_ref_model``, and multi-turn
rollouts whose weights cannot be gathered once per round. Evaluation runs the stock trainer's
``prediction_step`` (rollouts and loss as in training). The generation batch is
``per_device_train_batch_size x dp x steps_per_generation`` (the config resolves it over all
``dp x sp`` processes; it is re-resolved over dp, so set ``steps_per_generation``, not an
explicit ``generation_batch_size``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_ulysses.comm import all_reduce_sum
from dtensor_ulysses.hf.batch import shard_batch
from dtensor_ulysses.hf.models.vision import (
    is_vision_language,
    vision_family,
    vision_model_inputs,
)
from dtensor_ulysses.hf.trainers import _state
from dtensor_ulysses.hf.trainers._generation import patched
from dtensor_ulysses.hf.trainers.refusals import UnsupportedTrainerError, _refusals_in_one_line
from dtensor_ulysses.hf.trainers.rollouts import _dp_gather_same, _Rollouts
from dtensor_ulysses.plan.splits import padded_seq_len

__all__: list[str] = []

_RL_TRAINERS = ("GRPOTrainer", "RLOOTrainer")


class _UlyssesRL(_Rollouts):
    """Mixin placed before the shared :class:`~dtensor_ulysses.hf.trainers.base._UlyssesTrainer` for
    TRL's ``GRPOTrainer`` and ``RLOOTrainer`` (see the module docstring)."""

    _du_family_loss = True  # every loss_type runs as stock (on the sp-summed rows)
    _du_trl_classes = _RL_TRAINERS
    _du_sp_arg: int
    _du_dims: Any
    _du_options: Any  # the ParallelOptions
    args: Any
    model: Any
    accelerator: Any
    ref_model: Any
    reward_funcs: list
    _pending_extra_logs: Any
    _pending_metrics: Any

    @_refusals_in_one_line
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        names = list(_init_names(type(self)))
        bound = dict(zip(names, args))
        bound.update(kwargs)
        _refuse_rl(type(self), bound, self._du_sp_arg)
        targs = bound.get("args")
        if targs is not None and hasattr(targs, "generation_batch_size"):
            _dp_generation_batch(targs, self._du_sp_arg)
        super().__init__(*args, **kwargs)
        # the stock trainer's own rule for gradient accumulation (the shared mixin set its own)
        self.__dict__.pop("loss_is_scaled_for_ga", None)
        hf: Any = _state.base_model(self.model)
        if is_vision_language(hf) and vision_family(hf) != "qwen":
            raise UnsupportedTrainerError(
                f"with_ulysses({_user_class(type(self))}): vision-language rollouts run for "
                f"Qwen2.5-VL and Qwen3-VL (images as patch grids); "
                f"{hf.config.model_type} is not covered"
            )
        if getattr(self, "ref_model", None) is not None:
            self.ref_model = self._du_parallelize_reference(self.ref_model)  # type: ignore[attr-defined]
        # reward models run whole on the rank that owns the rollouts: on this rank's device (the
        # shared accelerator places no model itself; FSDP2 places the sharded ones)
        for func in self.reward_funcs:
            if isinstance(func, nn.Module):
                func.to(self.accelerator.device)
        multi_turn = any(getattr(self, k, None) for k in ("tools", "environment_factories",
                                                          "rollout_func"))  # fmt: skip
        self._du_init_rollouts(multi_turn=multi_turn)

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any,
                           completion_ids_list: Any) -> torch.Tensor:  # fmt: skip
        """The reward functions on the rank that owns each rollout (its environment is there),
        on its rollouts only; the rewards (and what the functions logged) exchanged over sp,
        then gathered over dp as the stock trainer gathers them over its ranks."""
        device = self.accelerator.device
        lo, hi = self._du_own_rows(len(prompts))
        if hi > lo:
            with self._du_owned_rollouts(lo, hi), patched(self._du_trl_module(), "gather",
                                                            lambda t: t):  # fmt: skip
                local = super()._calculate_rewards(  # type: ignore[misc]
                    inputs[lo:hi], prompts[lo:hi], completions[lo:hi], completion_ids_list[lo:hi]
                )
        else:
            local = torch.zeros(0, len(self.reward_funcs), device=device)
        if self._du_dims.sp > 1:
            parts = self._du_sp_gather_object((local.cpu(), dict(self._pending_extra_logs),
                                               dict(self._pending_metrics), hi - lo))  # fmt: skip
            local = torch.cat([p[0] for p in parts]).to(device)
            extra: dict[str, list] = {}
            for column in sorted({c for p in parts for c in p[1]}):
                extra[column] = [v for p in parts for v in p[1].get(column, [None] * p[3])]
            metrics: dict[str, list] = {}
            for name in sorted({m for p in parts for m in p[2]}):
                metrics[name] = [v for p in parts for v in p[2].get(name, [])]
            self._pending_extra_logs = defaultdict(list, extra)
            self._pending_metrics = defaultdict(list, metrics)
        return _dp_gather_same(local, self._du_dims.dp_mesh.get_group())

    # ------------------------------------------------------------------------------------------
    # log-probabilities on the sharded sequence
    # ------------------------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(
        self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
        logits_to_keep: int, batch_size: int | None = None, compute_entropy: bool = False,
        compute_aux_loss: bool = False, pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None, num_images: list[int] | None = None,
        mm_token_type_ids: torch.Tensor | None = None, **extra: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
        used = sorted(k for k, v in extra.items() if v is not None)
        if used or compute_aux_loss:
            raise UnsupportedTrainerError(
                f"with_ulysses: the RL log-probabilities take text rows and Qwen-VL images "
                f"only; got {used or ['compute_aux_loss']}"
            )
        dims = self._du_dims
        group, me = dims.sp_mesh.get_group(), dims.sp_rank
        B, S = input_ids.shape
        Sp = padded_seq_len(S, dims.sp, dims.ring)  # S, or longer: no rank holds an empty slice
        step = batch_size or B
        logps, entropies = [], []
        for lo in range(0, B, step):
            hi = min(lo + step, B)
            ids_BS = input_ids[lo:hi]
            mask_BS = attention_mask[lo:hi]
            labels_BS = ids_BS.masked_fill(mask_BS == 0, -100)
            labels_BS[:, :-logits_to_keep] = -100  # only completion tokens are scored
            # the right padding joins its row's document (causal attention never reads it for
            # a real token): rows with the same prompt get the same layout, so their values
            # agree bit for bit, as in the stock forward (ties at top_entropy_quantile's
            # quantile stay ties)
            rows = {
                "input_ids": ids_BS,
                "labels": labels_BS,
                "attention_mask": mask_BS.cummax(1).values,
            }
            if Sp > S:  # padding columns at the end: masked, no labels, a document of their own
                rows = {k: F.pad(v, (0, Sp - S), value=-100 if k == "labels" else 0)
                        for k, v in rows.items()}  # fmt: skip
            if mm_token_type_ids is not None:
                rows["mm_token_type_ids"] = F.pad(mm_token_type_ids[lo:hi], (0, Sp - S))
            if pixel_values is not None:
                rows.update(_image_rows(pixel_values, image_grid_thw, num_images, lo, hi))
            sb = shard_batch(rows, dims, count_valid=False)
            if pixel_values is not None or mm_token_type_ids is not None:
                # the full rows (sliced after the merge), the stock mask for M-RoPE's positions
                mask = F.pad(mask_BS, (0, Sp - S))
                call = vision_model_inputs({**rows, "attention_mask": mask}, sb)
            else:
                call = dict(input_ids=sb.input_ids, position_ids=sb.position_ids,
                            ulysses_layout=sb.layout)  # fmt: skip
            with self.accelerator.autocast():
                out = model(**call, shift_labels=sb.labels, fused_lm_head=True)
            left = sb.layout.offset(me)
            right = Sp - left - sb.input_ids.shape[1]
            # [B, S]: the log-probability at t is that of token t + 1 (the shifted labels)
            full_BS = all_reduce_sum(F.pad(out.log_probs.float(), (left, right)), group)[:, :S]
            logps.append(full_BS[:, -logits_to_keep - 1 : -1])
            if compute_entropy:
                ent_BS = all_reduce_sum(F.pad(out.entropy.float(), (left, right)), group)[:, :S]
                entropies.append(ent_BS[:, -logits_to_keep - 1 : -1])
        return (torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None)


def _init_names(cls: type) -> list[str]:
    import inspect

    trl_cls = next(c for c in cls.__mro__ if c.__name__ in _RL_TRAINERS)
    init: Any = trl_cls.__dict__["__init__"]
    return list(inspect.signature(init).parameters)[1:]


def _dp_generation_batch(args: Any, sp: int) -> None:
    """GRPO's config resolved ``generation_batch_size`` over every process; the stock trainer
    at this dp resolves it over ``dp = world / sp``.

    Raises:
        ValueError: the batch over dp does not hold whole groups of ``num_generations``.
    """
    world = int(getattr(args, "world_size", 1) or 1)
    if world % sp:
        return  # the mesh check names it
    dp = world // sp
    steps = args.steps_per_generation
    batch = args.per_device_train_batch_size * dp * steps
    groups = int(getattr(args, "num_generations", 1) or 1)
    if batch % groups:
        raise ValueError(
            f"the generation batch per_device_train_batch_size x dp x steps_per_generation = "
            f"{args.per_device_train_batch_size} x {dp} x {steps} = {batch} rows does not hold "
            f"whole groups of num_generations={groups} (dp = {world} ranks / sp={sp}); raise "
            f"per_device_train_batch_size or steps_per_generation"
        )
    args.generation_batch_size = batch


def _user_class(cls: type) -> str:
    """The name of the class the user passed to :func:`with_ulysses` (the last base)."""
    return cls.__bases__[-1].__name__


def _image_rows(pixel_values: torch.Tensor, image_grid_thw: Any, num_images: list[int] | None,
                lo: int, hi: int) -> dict[str, torch.Tensor]:  # fmt: skip
    """Rows ``lo:hi``'s images of a Qwen-VL batch (TRL's cut: each image's ``t*h*w`` patch
    rows, ``num_images`` per row)."""
    if image_grid_thw is None or num_images is None:
        raise UnsupportedTrainerError(
            "with_ulysses: vision-language rollouts need image_grid_thw and num_images (Qwen-VL "
            "images as patch grids)"
        )
    first, last = sum(num_images[:lo]), sum(num_images[:hi])
    patches = image_grid_thw.prod(-1).tolist()
    p0, p1 = sum(patches[:first]), sum(patches[:last])
    return {"pixel_values": pixel_values[p0:p1], "image_grid_thw": image_grid_thw[first:last]}


def _refuse_rl(cls: type, bound: dict, sp: int) -> None:
    """One line per refused feature, before anything is loaded."""
    args = bound.get("args")
    name = _user_class(cls)
    problems = []
    if args is not None:
        for key, why in (
            ("use_vllm", "vLLM generation: no GPU test covers it here yet; use use_vllm=False"),
            ("use_transformers_continuous_batching",
             "transformers' continuous batching (use_transformers_paged is its deprecated name) "
             "schedules and samples every request of a rank in one engine, not per rollout, so "
             "its rollouts would change with sp, and its paged cache is not covered by the "
             "tests; set it to False (with_ulysses splits each round over the sp group)"),
            ("sync_ref_model", "sync_ref_model: the sharded reference is not re-synced"),
            ("use_adaptive_entropy", "an adaptive entropy bonus is not covered by the tests"),
        ):  # fmt: skip
            if getattr(args, key, False):
                problems.append(f"{key}=True: {why}")
        coef = getattr(args, "router_aux_loss_coef", None)
        if coef:
            problems.append(f"router_aux_loss_coef={coef}: the router loss of a sharded "
                            f"sequence is not wired into the RL loss; set it to 0.0")  # fmt: skip
    if problems:
        raise UnsupportedTrainerError(
            f"with_ulysses({name}) cannot run this exactly: " + "; ".join(problems)
        )
