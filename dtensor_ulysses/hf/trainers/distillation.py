"""TRL's on-policy ``DistillationTrainer`` under :func:`with_ulysses`, exact.

Legend: ``B`` rows of this dp rank's micro-batch, ``S`` a row's full length (prompt +
completion), ``s`` this sp rank's piece, ``C`` the completion length, ``H_s`` / ``H_t`` the
student's and the teacher's hidden sizes, ``V`` the shared vocabulary.

The stock trainer's step, on ``dp x sp`` ranks, is the one of its rank for the same dp index:

* **Rollouts** as the RL trainers make them (:mod:`~dtensor_ulysses.hf.trainers.rollouts`):
  every rank of an sp group reads the same prompts and draws from the random stream of the
  stock rank with its dp index; each rank generates its share of the group's rollouts with the
  student's own attention on whole prompts (the weights gathered once per round) and the shares
  are exchanged. With ``tools``, TRL's own tool loop (``_tool_call_loop``, up to
  ``max_tool_calling_iterations``) runs inside each share, so every tool call happens once per
  rollout per dp group, on the rank that owns the rollout; its outputs (tool masks,
  completions, token ids, call and failure counts) are merged in rollout order and the stock
  bookkeeping replays them on the whole round. Everything the stock step reduces over its
  ranks (completion lengths, the global count of completion tokens, ``num_tokens``, the tool
  metrics, the completions it logs) is reduced over dp, and the generation batch the sampler
  groups is ``per_device_train_batch_size x dp x gradient_accumulation_steps``, the stock
  trainer's at this dp.
* **The teacher on the same mesh.** Loaded by the stock trainer (a path, with
  ``teacher_model_init_kwargs``, or a model), then prepared like the student
  (:meth:`~dtensor_ulysses.hf.trainers.base._UlyssesTrainer._du_parallelize_reference`:
  Ulysses on every attention layer, ``fully_shard`` over ``dp x sp``, rank 0's weights,
  frozen: no gradients, no optimizer state). It may be of another size or family; only the
  vocabulary must match (TRL's check).
* **The divergence on the sharded sequence.** Each prompt+completion row is cut by
  :func:`~dtensor_ulysses.hf.shard_batch` (padding as documents, global positions ``0..S-1``
  as the stock forward uses); the student's and then the teacher's backbone run this rank's
  slice, each giving ``[B, s, H]`` final hidden states, and TRL's own chunked divergence
  (``_chunked_divergence_loss``: the generalized Jensen-Shannon divergence for ``beta`` and
  ``temperature``, the models' logit scales, softcaps and biases, the projection to the
  vocabulary in tiles, never ``[B, s, V]`` logits of either model) runs on the slice's
  positions. Position ``t`` scores token ``t + 1``, so the slice's loss mask is TRL's
  (completion tokens, not padding, not tool results) shifted by one over the full row, then
  cut. The slice's divergence sum, entropy sum and valid-token count are summed over the sp
  group in one all-reduce (:func:`~dtensor_ulysses.comm.all_reduce_sum`: the gradient of this
  rank's part passes through), so each completion token counts once: the training loss is that
  sum over TRL's global token count (gathered over dp, divided by dp as the stock rank divides
  by its processes), the evaluation loss the mean over the group's tokens. The returned loss
  keeps its value and carries ``1/dp`` of its gradient (FSDP2 sums gradients over dp x sp,
  where DDP averages over dp).
* **The teacher's memory per rank**: its shards (``1/(dp x sp)`` of its parameters, in the
  dtype it was loaded in: load it in bf16 on GPUs, ``teacher_model_init_kwargs={"dtype":
  "bfloat16"}``), during its forward one gathered layer at a time and its root (embeddings,
  final norm, output head), no activations kept, its ``[B, s, H_t]`` hidden states, and its
  output head gathered whole (``V x H_t``, cast to the compute dtype; the student's is the
  one FSDP2 already holds) from the divergence's forward to its backward, which recomputes the
  tiles.

Refused at construction, with the reason: vision-language processors, vLLM generation (no GPU
test covers it here yet), a teacher supplied another way (``teacher_model=None``), and tools
whose rounds cannot gather the weights once (multi-turn rollouts: each sp rank makes its own
number of generation calls).
"""

from __future__ import annotations

import inspect
import sys
from collections import deque
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_ulysses.comm import all_reduce_sum
from dtensor_ulysses.hf.batch import ShardedBatch, shard_batch
from dtensor_ulysses.hf.trainers import _state
from dtensor_ulysses.hf.trainers.base import _UlyssesTrainer
from dtensor_ulysses.hf.trainers.refusals import UnsupportedTrainerError, _refusals_in_one_line
from dtensor_ulysses.hf.trainers.rollouts import _Rollouts
from dtensor_ulysses.plan.splits import padded_seq_len

__all__: list[str] = []

_DISTILLATION_TRAINERS = ("DistillationTrainer",)
# the batch keys of a vision-language rollout (refused: the slice path takes text rows)
_MULTIMODAL = (
    "pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
    "token_type_ids", "mm_token_type_ids", "image_position_ids",
)  # fmt: skip


def _logit_scale(config: Any) -> float:
    """The multiplier a model applies to its logits before the softmax, read from its text
    config as TRL's ``DistillationTrainer._compute_loss`` reads it (``logit_scale``, else
    ``output_multiplier``, else ``lm_head_multiplier``, else ``1 / logits_scaling``; HyperCLOVA
    X multiplies by ``logits_scaling``), ``1.0`` when there is none."""
    scale = getattr(config, "logit_scale", None)
    if scale is None:
        scale = getattr(config, "output_multiplier", None)
    if scale is None:
        scale = getattr(config, "lm_head_multiplier", None)
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        ls = config.logits_scaling
        scale = ls if config.model_type == "hyperclovax" else 1 / ls
    return 1.0 if scale is None else scale


class _UlyssesDistillation(_Rollouts):
    """Mixin placed before the shared :class:`~dtensor_ulysses.hf.trainers.base._UlyssesTrainer`
    for TRL's ``DistillationTrainer`` (see the module docstring)."""

    _du_family_loss = True  # the divergence is the family's loss
    _du_trl_classes = _DISTILLATION_TRAINERS
    _du_dims: Any  # the bound ParallelDims (the shared mixin's)
    args: Any
    model: Any
    accelerator: Any
    teacher_model: Any
    tools: list
    beta: float
    temperature: float
    _forward_redirection: Any
    _logs: dict

    @_refusals_in_one_line
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = dict(zip(_init_names(type(self)), args))
        bound.update(kwargs)
        _refuse_distillation(type(self), bound)
        super().__init__(*args, **kwargs)
        # the stock trainer's own rule for gradient accumulation (the shared mixin set its own)
        self.__dict__.pop("loss_is_scaled_for_ga", None)
        self.teacher_model = self._du_parallelize_reference(self.teacher_model)  # type: ignore[attr-defined]
        # the completions log holds the stock trainer's generation batch at this dp
        dp = self._du_dims.dp
        size = self.args.per_device_train_batch_size * dp * self.args.gradient_accumulation_steps
        self._logs = {key: deque(maxlen=size) for key in self._logs}
        # tools: TRL's tool loop inside the shared rollout path (each call on the rollout's owner)
        self._du_init_rollouts(multi_turn=bool(self.tools))

    def _du_trl_module(self) -> Any:
        # TRL's own module (deprecated aliases of the class, e.g. trl.experimental's, subclass it)
        return sys.modules[_trl_class(type(self)).__module__]

    def _get_train_sampler(self, dataset: Any = None) -> Any:
        # the generation batch the sampler repeats is the stock trainer's at this dp
        with self._du_dp_view():
            return super()._get_train_sampler(dataset)  # type: ignore[misc]

    # ------------------------------------------------------------------------------------------
    # the divergence on the sharded sequence
    # ------------------------------------------------------------------------------------------
    def _du_hidden(self, model: nn.Module, sb: ShardedBatch) -> torch.Tensor:
        """``[B, s, H]``: the final hidden states of this rank's slice, from the backbone (the
        model's ``base_model``: no output head), as TRL's ``_get_last_hidden_state`` takes
        them."""
        backbone: Any = _state.base_model(model).base_model
        out = backbone(input_ids=sb.input_ids, position_ids=sb.position_ids,
                       ulysses_layout=sb.layout, use_cache=False)  # fmt: skip
        return out.last_hidden_state

    def _compute_loss(self, unwrapped_student: nn.Module, inputs: dict, num_items_in_batch: Any):
        """TRL's ``_compute_loss`` on this rank's slice: ``(loss, entropy sum, valid tokens)``,
        the sums over the sp group (see the module docstring). Runs inside the student's
        forward (TRL's ``_forward_redirection``), so FSDP2 holds its output head gathered."""
        from trl.trainer.distillation_trainer import _chunked_divergence_loss

        used = sorted(k for k in _MULTIMODAL if inputs.get(k) is not None)
        if used:
            raise UnsupportedTrainerError(
                f"with_ulysses: the distillation loss takes text rows only; got {used}"
            )
        dims = self._du_dims
        group = dims.sp_mesh.get_group()
        ids_BS = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask_BS = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        loss_mask_BC = inputs["completion_mask"]
        if "tool_mask" in inputs:
            loss_mask_BC = loss_mask_BC * inputs["tool_mask"]
        B, S = ids_BS.shape
        C = loss_mask_BC.shape[1]
        # position t's divergence scores token t + 1: the completion's mask, one to the left
        scored_BS = torch.zeros_like(mask_BS)
        scored_BS[:, S - C - 1 : S - 1] = loss_mask_BC
        # no rank may hold an empty slice (a model layer cannot run on one): padding columns
        # at the end, masked and never scored, change no real token's result (causal attention)
        extra = padded_seq_len(S, dims.sp, dims.ring) - S
        ids_BS, mask_BS, scored_BS = (F.pad(t, (0, extra)) for t in (ids_BS, mask_BS, scored_BS))
        sb = shard_batch({"input_ids": ids_BS, "attention_mask": mask_BS}, dims,
                         count_valid=False)  # fmt: skip
        lo = sb.layout.offset(dims.sp_rank)
        s = sb.input_ids.shape[1]
        scored_Bs = F.pad(scored_BS, (0, max(0, lo + s - scored_BS.shape[1])))[:, lo : lo + s]

        student_h_BsH = self._du_hidden(unwrapped_student, sb)
        teacher = self.teacher_model
        teacher.eval()
        with torch.no_grad():
            # through the teacher's own call, so that FSDP2 gathers its root (TRL's redirection)
            redirect = self._forward_redirection
            teacher_h_BsH = redirect(teacher, teacher, self._du_hidden, teacher, sb)
        # the teacher's root (embeddings, norm, head) would stay gathered after a forward
        # without backward; its head is gathered again, whole, by TRL's divergence below
        teacher.reshard()
        s_head = unwrapped_student.get_output_embeddings()  # type: ignore[operator]
        t_head = teacher.get_output_embeddings()
        s_cfg = unwrapped_student.config.get_text_config()  # type: ignore[union-attr,operator]
        t_cfg = teacher.config.get_text_config()
        div_sum, ent_sum, n_valid = _chunked_divergence_loss(
            student_h_BsH, teacher_h_BsH, s_head.weight, t_head.weight, scored_Bs, self.beta,
            num_items_in_batch=1,  # the slice's sum; normalized after the sum over sp
            student_lm_head_bias=s_head.bias, teacher_lm_head_bias=t_head.bias,
            student_logit_scale=_logit_scale(s_cfg), teacher_logit_scale=_logit_scale(t_cfg),
            student_final_logit_softcapping=getattr(s_cfg, "final_logit_softcapping", None),
            teacher_final_logit_softcapping=getattr(t_cfg, "final_logit_softcapping", None),
            temperature=self.temperature,
        )  # fmt: skip
        # one all-reduce over sp: [divergence, entropy, count] (float64: exact counts)
        sums = all_reduce_sum(
            torch.stack([div_sum.double(), ent_sum.detach().double(), n_valid.double()]), group
        )
        total = sums[0].to(div_sum.dtype)
        n_total = sums[2].detach()
        if num_items_in_batch is None:  # evaluation: the mean over this batch's tokens
            loss = total / n_total.clamp(min=1).to(total.dtype)
        else:
            if isinstance(num_items_in_batch, torch.Tensor):
                num_items_in_batch = num_items_in_batch.to(total.device)
            loss = total / num_items_in_batch
        return loss, sums[1].detach().to(ent_sum.dtype), n_total.to(n_valid.dtype)


def _trl_class(cls: type) -> type:
    """TRL's ``DistillationTrainer`` in ``cls``'s bases (the last of the name: aliases subclass
    it)."""
    return [c for c in cls.__mro__ if c.__name__ in _DISTILLATION_TRAINERS][-1]


def _init_names(cls: type) -> list[str]:
    init: Any = _trl_class(cls).__dict__["__init__"]
    return list(inspect.signature(init).parameters)[1:]


def _refuse_distillation(cls: type, bound: dict) -> None:
    """One line per refused feature, before anything is loaded."""
    problems = []
    mro = cls.__mro__
    user = mro[mro.index(_UlyssesTrainer) + 1 : mro.index(_trl_class(cls))]
    for name in ("_compute_loss", "_get_last_hidden_state"):
        owners = [c.__name__ for c in user if name in c.__dict__]
        if owners:
            problems.append(
                f"{owners[0]}.{name}: a subclass's own loss path (with_ulysses replaces it by the "
                f"divergence on sequence slices, which would ignore it)"
            )
    if bound.get("teacher_model") is None:
        problems.append(
            "teacher_model=None: a teacher supplied another way does not run on the mesh; "
            "pass teacher_model (a path or a model)"
        )
    processing = bound.get("processing_class")
    if processing is not None and hasattr(processing, "image_processor"):
        problems.append("a vision-language processor: vision-language rollouts are not supported")
    args = bound.get("args")
    if args is not None and getattr(args, "use_vllm", False):
        problems.append("use_vllm=True: vLLM generation: no GPU test covers it here yet; use "
                        "use_vllm=False")  # fmt: skip
    if problems:
        raise UnsupportedTrainerError(
            f"with_ulysses({cls.__name__}) cannot run this exactly: " + "; ".join(problems)
        )
