"""The preference (DPO), RL (GRPO) and distillation training steps of the built-in model, as the
tracer runs them.

The memory tracer (:func:`dtensor_ulysses.memtrace.trace_train_step`) runs the *real* step under
fake tensors: for supervised fine-tuning that is the trainer's
:func:`dtensor_ulysses.train.train_step`; for the three post-training losses it is the step
functions here, written on the built-in model (``du.parallelize``: Ulysses, checkpointing, FSDP2
and every memory feature) as ``du.hf.with_ulysses`` runs TRL's trainers on a transformers
model: the same tensors, in the same order.

* :func:`dpo_step` (TRL's ``DPOTrainer``, ``loss_type="sigmoid"``): one pair per dp rank, the
  chosen and the rejected row in one ``[2, S]`` batch, both sequence-sharded alike. The policy's
  forward gives per-token log-probabilities of the labels from the tiled output head (no
  ``[B, s, V]`` logits), summed per row on this rank's slice and then over the sp group
  (:func:`sequence_logps`); then the
  reference model's forward without gradients on the same rows (TRL's order: the policy's graph
  is alive meanwhile); the loss ``-log sigmoid(beta * margin)``; backward, clipping, AdamW.
* :func:`grpo_step` (TRL's ``GRPOTrainer``, ``loss_type="dapo"``): ``G`` prompt+completion rows
  of one prompt per dp rank. The old policy's per-token log-probabilities (no gradient; only for
  ``num_iterations > 1``, else the current ones detached, as TRL), the reference's (no gradient;
  only for ``beta > 0``), then the policy's forward with gradients, the clipped ratio times the
  row's advantage, the KL term ``exp(r - l) - (r - l) - 1``, summed over valid tokens and divided
  by their global count (each token counted once over dp x sp), backward, clipping, AdamW.

* :func:`distill_step` (TRL's ``DistillationTrainer``, on-policy distillation): one
  prompt+completion row per dp rank. The student's forward to its final hidden states; inside
  its output head's forward (the head's weight gathered, as TRL runs the whole loss inside the
  student's forward), the teacher's forward without gradients to its final hidden states, the
  teacher resharded and its output head gathered whole (TRL's ``full_tensor`` of a sharded
  head), then TRL's chunked generalized Jensen-Shannon divergence
  (``trl.kernels.chunked_divergence.ChunkedDivergenceFunction``: both heads projected in tiles
  of ``4096 x 32768`` logits, never ``[B, s, V]``; its backward recomputes the tiles); the
  divergence, entropy and token count summed over sp, the loss divided by the global count of
  scored tokens; backward, clipping, AdamW. TRL is imported when the step runs. On a GPU, TRL
  projects only the scored positions (copies of both models' hidden states), folds the tiles
  with Triton kernels and projects with float32-output matmuls into its tile buffers; none of
  these allocates. A fake tensor can neither run Triton nor size a masked selection, so the
  CUDA trace (``cuda=True``) copies every position (all are scored in the traced row) and
  replaces the five torch helpers that stand for them on a CPU (``_project``,
  ``_addmm_fp32``, the three tile folds), which make float32 copies and tile temporaries
  there, by ones that do nothing (:func:`_gpu_divergence`): it counts the allocations of
  TRL's own forward and backward (tile buffers, per-token statistics, the float32 gradient
  accumulators, each tile's gradient in the compute dtype), computing no values. The CPU trace
  (``cuda=False``) runs TRL's torch path as a CPU run does.
* :func:`generation_round` (``StepSpec(kind="grpo", generation="round" | "layer")``): before
  the GRPO step, the memory of the rollout round that made its rows (``du.hf.with_ulysses``'s
  :mod:`~dtensor_ulysses.hf.trainers.rollouts`): FSDP2's own unshard of every unit (``"round"``:
  the weights gathered once for the round) or of the root and two decoder layers
  (``"layer"``: the running one and the prefetched one), and the KV cache of this rank's share
  of the group's ``G`` rows (``ceil(G / sp)``) at the row's full length, ``2 x [r, S, kv heads,
  head dim]`` per block in the compute dtype, with one decoding step's ``[r, V]`` float32
  logits; then resharded (phase ``generate``).

The vision-language step (``kind="vl"``) is in :mod:`dtensor_ulysses.memtrace.vision_step`;
:class:`StepSpec` carries its images and tower (``vision``).

The reference model (the teacher, for distillation) is a second copy of the architecture, built and
sharded by the same ``build`` (Ulysses + FSDP2 over ``dp x sp``), with ``requires_grad`` off: no
gradients and no optimizer state, and its shards in the compute dtype (bf16 on a GPU: no master
weights to keep; :func:`reference_model`); its FSDP2 units are resharded after its forward (its
output head keeps its gathered weight after a forward otherwise, as the policy's does for its
backward).

Per-token log-probabilities come from the library's tiled primitive
(:func:`dtensor_ulysses.models.loss.tiled_token_logps`, the one ``du.hf``'s preference and RL
trainers use), inside the output head's forward (``Transformer.forward(..., head_fn=)``, so
FSDP2 gathers the head's weight and reduces its gradient): ``loss_chunk_tokens`` rows of logits
at a time, forward and backward, as the tiled loss. The per-row sums go over the sp group with
:func:`dtensor_ulysses.comm.all_reduce_sum` (its gradient passes through).

Legend: ``B`` rows of this rank's micro-batch (2 for a DPO pair: chosen, rejected; ``G`` for
GRPO), ``s`` this rank's slice of each row, ``D`` model dim, ``V`` vocabulary, ``C`` rows of a
chunk, ``P`` pairs, ``N = B * s`` positions of the slice.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from dtensor_ulysses._torch_private import fsdp_param_dtype
from dtensor_ulysses.comm import all_reduce_sum
from dtensor_ulysses.data import Batch
from dtensor_ulysses.data.batch import IGNORE_INDEX
from dtensor_ulysses.memtrace.vision_step import VisionSpec
from dtensor_ulysses.models.loss import tiled_token_logps
from dtensor_ulysses.parallel import global_valid_tokens

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "STEP_KINDS",
    "PostTrainStepResult",
    "StepSpec",
    "batch_token_logps",
    "dpo_loss",
    "distill_step",
    "dpo_step",
    "generation_round",
    "grpo_step",
    "grpo_token_loss",
    "reference_model",
    "sequence_logps",
    "step_runner",
]

STEP_KINDS = ("sft", "dpo", "grpo", "distill", "vl")
DEFAULT_CHUNK_TOKENS = 4096  # rows of logits at a time when the model has no loss_chunk_tokens


@dataclass(frozen=True)
class StepSpec:
    """Which training step is traced, and its loss's options.

    Attributes:
        kind: ``"sft"`` (the trainer's step), ``"dpo"``, ``"grpo"``, ``"distill"`` or
            ``"vl"`` (a vision-language SFT step, :mod:`dtensor_ulysses.memtrace.vision_step`).
        beta: DPO's temperature (default 0.1, TRL's), GRPO's KL coefficient (default 0.0, TRL's:
            no reference model), distillation's divergence (0 forward KL, 0.5 JSD, 1 reverse KL:
            default 1.0, TRL's; the bytes do not depend on it).
        generations: GRPO's completions per prompt ``G``: the rows of a dp rank's micro-batch.
        num_iterations: GRPO's updates per generation batch (> 1: old-policy log-probabilities
            are computed before the step, without gradients).
        epsilon: GRPO's clipping range.
        vision: the vision-language step's images and vision tower
            (:class:`~dtensor_ulysses.memtrace.vision_step.VisionSpec`; ``kind="vl"`` only,
            default ``VisionSpec()``).
        generation: GRPO only: also the rollout round before the step
            (:func:`generation_round`), its weights gathered ``"round"`` (once) or ``"layer"``
            (layer by layer); ``None``: the step alone.
    """

    kind: str = "sft"
    beta: float | None = None
    generations: int = 8
    num_iterations: int = 1
    epsilon: float = 0.2
    vision: VisionSpec | None = None
    generation: str | None = None

    def __post_init__(self) -> None:
        if self.generation is not None and (
            self.kind != "grpo" or self.generation not in ("round", "layer")
        ):
            raise ValueError(
                f"generation={self.generation!r}: a rollout round ('round' or 'layer') is "
                f"traced before a GRPO step only (step={self.kind!r})"
            )
        if self.kind not in STEP_KINDS:
            raise ValueError(f"step={self.kind!r}: trace one of {', '.join(STEP_KINDS)}")
        if self.vision is not None and self.kind != "vl":
            raise ValueError(f"images and a vision tower belong to step='vl', not {self.kind!r}")
        if self.kind == "vl" and self.vision is None:
            object.__setattr__(self, "vision", VisionSpec())
        if self.generations < 1:
            raise ValueError(
                f"generations={self.generations}: GRPO needs G >= 1 completions per prompt "
                f"(TRL's default is 8)"
            )
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations={self.num_iterations} must be >= 1 (TRL's default 1)")
        if self.beta is not None and self.beta < 0:
            raise ValueError(f"beta={self.beta} must be >= 0")
        if self.kind == "distill" and self.beta is not None and self.beta > 1:
            raise ValueError(
                f"beta={self.beta}: distillation's beta is in [0, 1] (0 forward KL, 0.5 JSD, "
                f"1 reverse KL)"
            )

    @property
    def loss_beta(self) -> float:
        """``beta`` or the trainer's default (DPO 0.1, GRPO 0.0, distillation 1.0)."""
        if self.beta is not None:
            return self.beta
        return {"dpo": 0.1, "distill": 1.0}.get(self.kind, 0.0)

    @property
    def rows(self) -> int:
        """Rows of one dp rank's micro-batch: 1 (SFT, distillation), 2 (a DPO pair), ``G``
        (GRPO)."""
        return {"sft": 1, "dpo": 2, "grpo": self.generations, "distill": 1, "vl": 1}[self.kind]

    @property
    def has_reference(self) -> bool:
        """A reference model is loaded: DPO always, GRPO when ``beta > 0``, distillation's
        teacher always."""
        return self.kind in ("dpo", "distill") or (self.kind == "grpo" and self.loss_beta > 0)

    @property
    def has_old_policy(self) -> bool:
        """GRPO computes old-policy log-probabilities (``num_iterations > 1``)."""
        return self.kind == "grpo" and self.num_iterations > 1

    def describe(self) -> dict[str, Any]:
        """The step's options as the trace reports them."""
        out: dict[str, Any] = {"kind": self.kind, "rows_per_dp_rank": self.rows}
        if self.kind == "sft":
            return out
        if self.vision is not None:
            v = self.vision
            out.update(images=v.images, image_patches=v.image_patches, vision_layers=v.layers,
                       vision_hidden=v.hidden)  # fmt: skip
            return out
        if self.kind == "distill":
            out.update(beta=self.loss_beta, teacher="the same preset, frozen",
                       loss="generalized JSD (TRL's chunked divergence)")  # fmt: skip
            return out
        out.update(beta=self.loss_beta, reference_model=self.has_reference)
        if self.kind == "grpo":
            out.update(generations=self.generations, num_iterations=self.num_iterations,
                       old_policy_logps=self.has_old_policy, loss_type="dapo",
                       generation=self.generation)  # fmt: skip
        else:
            out["loss_type"] = "sigmoid"
        return out


# ----------------------------------------------------------------------------------------------
# per-token and per-sequence log-probabilities
# ----------------------------------------------------------------------------------------------
def batch_token_logps(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Per-token log-probabilities of ``batch.labels`` on this rank's slice, ``[B, s]`` float32
    (0 where ignored), through the model's output head (tiled: ``model.loss_chunk_tokens`` or
    :data:`DEFAULT_CHUNK_TOKENS` rows of logits at a time; never ``[B, s, V]``)."""
    chunk = getattr(model, "loss_chunk_tokens", None) or DEFAULT_CHUNK_TOKENS

    def head(h_BsD: torch.Tensor, weight_VD: torch.Tensor, labels_Bs: torch.Tensor):
        # flat [B * s] out of the module (FSDP2 warns about a view it returns), [B, s] after
        return tiled_token_logps(h_BsD, weight_VD, labels_Bs, chunk).flatten()

    out = model(
        batch.input_ids, batch.position_ids, layout=batch.layout, labels=batch.labels,
        head_fn=head,
    )  # fmt: skip
    return out.view(batch.labels.shape)


def sequence_logps(
    model: torch.nn.Module, batch: Batch, sp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Each row's log-probability of its labels, summed over the whole row: this rank's slice
    (:func:`batch_token_logps`), then over the ``sp`` group (one all-reduce of ``B`` floats, the
    gradient passed through). ``[B]`` float32, equal on every rank of the sp group."""
    return all_reduce_sum(batch_token_logps(model, batch).sum(1), sp_group)


def reference_model(net: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """``net`` as a reference: no parameter requires a gradient (no gradient, no optimizer
    state), evaluation mode, its (sharded) weights in ``dtype`` when given: a frozen model
    needs no fp32 master weights, so on a GPU its shards are kept in the compute dtype (bf16,
    half the policy's fp32 shards; FSDP2 then gathers them without a cast)."""
    net.requires_grad_(False)
    if dtype is not None:
        net.to(dtype)
    return net.eval()


def _reshard(net: torch.nn.Module) -> None:
    """Free every FSDP2 unit's gathered weights (after a forward without backward)."""
    for m in net.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


@torch.no_grad()
def _frozen_token_logps(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    out = batch_token_logps(model, batch)
    _reshard(model)
    return out


def _finish(model, optimizer, scheduler, loss: torch.Tensor, grad_clip: float) -> float | None:
    loss.backward()
    grad_norm = None
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


@dataclass
class PostTrainStepResult:
    """What :func:`dpo_step` / :func:`grpo_step` return (this rank's values)."""

    loss: float  # this rank's loss term (its dp rank's share; equal over its sp group)
    grad_norm: float | None


# ----------------------------------------------------------------------------------------------
# DPO
# ----------------------------------------------------------------------------------------------
def dpo_loss(
    policy_P2: torch.Tensor, reference_P2: torch.Tensor, beta: float, dp: int = 1
) -> torch.Tensor:
    """TRL's sigmoid DPO loss of ``P`` pairs ``[chosen, rejected]`` of sequence log-probabilities,
    averaged over the ``P * dp`` pairs of the global batch (this rank's share)."""
    margin_P = (policy_P2[:, 0] - reference_P2[:, 0]) - (policy_P2[:, 1] - reference_P2[:, 1])
    return -F.logsigmoid(beta * margin_P).sum() / (margin_P.numel() * dp)


def dpo_step(
    policy: torch.nn.Module,
    reference: torch.nn.Module,
    batch: Batch,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    sp_group: dist.ProcessGroup | None = None,
    dp: int = 1,
    beta: float = 0.1,
    grad_clip: float = 1.0,
) -> PostTrainStepResult:
    """One DPO step on this rank's slice of ``P`` pairs: ``batch`` rows ``[c0, r0, c1, r1, ...]``
    (chosen, rejected), each sharded on the sequence like the other rows (see the module
    docstring). ``dp``: data-parallel ranks (the loss is the mean over every pair)."""
    if batch.input_ids.shape[0] % 2:
        raise ValueError(
            f"a DPO batch holds pairs (chosen, rejected): got {batch.input_ids.shape[0]} rows"
        )
    pol_B = sequence_logps(policy, batch, sp_group)
    with torch.no_grad():
        ref_B = all_reduce_sum(_frozen_token_logps(reference, batch).sum(1), sp_group)
    loss = dpo_loss(pol_B.view(-1, 2), ref_B.view(-1, 2), beta, dp)
    grad_norm = _finish(policy, optimizer, scheduler, loss, grad_clip)
    return PostTrainStepResult(float(loss.detach()), grad_norm)


# ----------------------------------------------------------------------------------------------
# GRPO
# ----------------------------------------------------------------------------------------------
def grpo_token_loss(
    logp_Bs: torch.Tensor,
    old_Bs: torch.Tensor | None,
    ref_Bs: torch.Tensor | None,
    advantages_B: torch.Tensor,
    *,
    beta: float,
    epsilon: float,
) -> torch.Tensor:
    """TRL's GRPO per-token loss ``[B, s]``: ``-min(ratio * A, clip(ratio) * A)``, plus
    ``beta * (exp(r - l) - (r - l) - 1)`` with a reference; ``old_Bs=None``: the current
    log-probabilities detached (``num_iterations = 1``)."""
    old = logp_Bs.detach() if old_Bs is None else old_Bs
    ratio = torch.exp(logp_Bs - old)
    a_B1 = advantages_B.unsqueeze(1)
    loss = -torch.min(ratio * a_B1, torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * a_B1)
    if beta > 0 and ref_Bs is not None:
        d = ref_Bs - logp_Bs
        loss = loss + beta * (torch.exp(d) - d - 1)
    return loss


def grpo_step(
    policy: torch.nn.Module,
    reference: torch.nn.Module | None,
    batch: Batch,
    advantages_B: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    group: dist.ProcessGroup | None = None,
    beta: float = 0.0,
    epsilon: float = 0.2,
    num_iterations: int = 1,
    old_logps_Bs: torch.Tensor | None = None,
    grad_clip: float = 1.0,
) -> PostTrainStepResult:
    """One GRPO step (``loss_type="dapo"``) on this rank's slice of ``B`` prompt+completion rows
    with their advantages (see the module docstring). ``group``: the ``dp x sp`` ranks (the
    valid-token count); ``reference`` is needed when ``beta > 0``. ``old_logps_Bs``: the old
    policy's log-probabilities kept from the batch's first iteration; ``None`` with
    ``num_iterations > 1``: computed here from ``policy`` (this is the first iteration)."""
    if beta > 0 and reference is None:
        raise ValueError(f"beta={beta} needs a reference model (beta=0 loads none)")
    old_Bs = old_logps_Bs
    if old_Bs is None and num_iterations > 1:
        old_Bs = _frozen_token_logps(policy, batch)
    ref_Bs = _frozen_token_logps(reference, batch) if beta > 0 and reference else None
    logp_Bs = batch_token_logps(policy, batch)
    valid_Bs = batch.labels != IGNORE_INDEX
    n_valid = global_valid_tokens(batch.labels, group)
    per_tok = grpo_token_loss(logp_Bs, old_Bs, ref_Bs, advantages_B, beta=beta, epsilon=epsilon)
    loss = (per_tok * valid_Bs).sum() / n_valid
    grad_norm = _finish(policy, optimizer, scheduler, loss, grad_clip)
    return PostTrainStepResult(float(loss.detach()), grad_norm)


def generation_round(policy: torch.nn.Module, rows: int, seq_len: int, gathering: str) -> None:
    """The memory of a rollout round on this rank (see the module docstring): the weights held
    gathered (``gathering``: ``"round"`` every FSDP2 unit, ``"layer"`` the root and two decoder
    layers), the KV cache of ``rows`` rows of ``seq_len`` tokens, one decoding step's logits;
    everything freed and resharded at the end."""
    units = [m for m in policy.modules() if isinstance(m, FSDPModule)]
    blocks = [m for m in getattr(policy, "layers", []) if isinstance(m, FSDPModule)]
    others = [m for m in units if m not in blocks]  # the root, the embedding, the head
    held = units if gathering == "round" else [*others, *blocks[:2]]
    for m in held:
        m.unshard()
    shape: Any = policy.shape
    dtype = fsdp_param_dtype(policy) or next(iter(policy.parameters())).dtype
    kv = [torch.empty(2, rows, seq_len, shape.n_kv_heads, shape.head_dim, dtype=dtype)
          for _ in range(shape.n_layers)]  # fmt: skip
    logits = torch.empty(rows, shape.vocab_size, dtype=torch.float32)
    del kv, logits
    for m in held:
        m.reshard()


# ----------------------------------------------------------------------------------------------
# on-policy distillation
# ----------------------------------------------------------------------------------------------
def _head_weight(net: torch.nn.Module) -> torch.Tensor:
    """The output head's weight ``[V, D]`` (the embedding's when tied), whole: a sharded one is
    gathered (TRL's ``full_tensor`` of a head outside its module's forward)."""
    output: Any = getattr(net, "output", None)
    holder: Any = output if output is not None else net.tok_embeddings
    weight: torch.Tensor = holder.weight
    full = getattr(weight, "full_tensor", None)
    return full() if callable(full) else weight


# TRL's CPU stand-ins, in trl/kernels/chunked_divergence.py, for what allocates nothing on a
# GPU: the projection and gradient matmuls (float32 output into existing buffers) and the tile
# folds (Triton kernels that write the tiles and per-token statistics in place)
_GPU_IN_PLACE = ("_project", "_addmm_fp32", "_stats_tile", "_jsd_tile", "_backward_tile")


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def _gpu_divergence() -> Iterator[None]:
    """TRL's chunked divergence allocating what its GPU path allocates (for the tracer's fake
    tensors: no values are computed; see the module docstring).

    Raises:
        ValueError: TRL's kernel module lacks one of the helpers (it changed since TRL 1.16).
    """
    import trl.kernels.chunked_divergence as cd

    missing = [n for n in _GPU_IN_PLACE if not callable(getattr(cd, n, None))]
    if missing:
        raise ValueError(
            f"trl.kernels.chunked_divergence has no {', '.join(missing)} (changed since TRL "
            f"1.16): trace the distillation step with device='cpu', or update "
            f"dtensor_ulysses/memtrace/steps.py"
        )
    saved = {n: getattr(cd, n) for n in _GPU_IN_PLACE}
    for n in _GPU_IN_PLACE:
        setattr(cd, n, _nothing)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(cd, n, fn)


def _hidden_head(h_BsD: torch.Tensor, weight_VD: torch.Tensor, labels_Bs: torch.Tensor):
    """A ``head_fn`` that returns the final hidden states (a backbone's output)."""
    return h_BsD


def distill_step(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    batch: Batch,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    group: dist.ProcessGroup | None = None,
    sp_group: dist.ProcessGroup | None = None,
    beta: float = 1.0,
    temperature: float = 1.0,
    cuda: bool = False,
    grad_clip: float = 1.0,
) -> PostTrainStepResult:
    """One step of on-policy distillation (TRL's ``DistillationTrainer`` as ``du.hf`` runs it)
    on this rank's slice of ``B`` prompt+completion rows; positions whose label is not
    ``IGNORE_INDEX`` are scored (see the module docstring). ``group``: the ``dp x sp`` ranks
    (the global count of scored positions), ``sp_group``: this rank's sp group; ``cuda``: the
    divergence allocating as on a GPU, for fake tensors only (it computes no values,
    :func:`_gpu_divergence`)."""
    with _gpu_divergence() if cuda else contextlib.nullcontext():
        return _distill_step(student, teacher, batch, optimizer, scheduler, group=group,
                             sp_group=sp_group, beta=beta, temperature=temperature, cuda=cuda,
                             grad_clip=grad_clip)  # fmt: skip


def _distill_step(student, teacher, batch, optimizer, scheduler, *, group, sp_group, beta,
                  temperature, cuda, grad_clip) -> PostTrainStepResult:  # fmt: skip
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    valid_N = (batch.labels != IGNORE_INDEX).reshape(-1)
    n_valid = global_valid_tokens(batch.labels, group)
    entropy: list[torch.Tensor] = []

    def head(hs_BsD: torch.Tensor, ws_VD: torch.Tensor, labels_Bs: torch.Tensor):
        with torch.no_grad(), warnings.catch_warnings():  # TRL's order: after the student's
            # backbone; its output is the final norm's (a view): no backward hook to lose
            warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view")
            ht_BsD = teacher(batch.input_ids, batch.position_ids, layout=batch.layout,
                             labels=labels_Bs, head_fn=_hidden_head)  # fmt: skip
        _reshard(teacher)  # its root would stay gathered (a forward without backward)
        wt_VD = _head_weight(teacher).to(ht_BsD.dtype)
        hs_ND, ht_ND = hs_BsD.reshape(-1, hs_BsD.shape[-1]), ht_BsD.reshape(-1, ht_BsD.shape[-1])
        if cuda:  # TRL on a GPU projects h[valid]: a copy of each (every position scored here)
            hs_ND, ht_ND = hs_ND.clone(), ht_ND.clone()
        div_N, ent_N = ChunkedDivergenceFunction.apply(
            hs_ND, ws_VD, None, ht_ND, wt_VD, None, beta, temperature, 1.0, None, 1.0, None
        )
        entropy.append(ent_N.masked_fill(~valid_N, 0).sum())
        return div_N.masked_fill(~valid_N, 0)

    div_N = student(batch.input_ids, batch.position_ids, layout=batch.layout,
                    labels=batch.labels, head_fn=head)  # fmt: skip
    div_sum = div_N.sum()
    # the trainer's one all-reduce over sp: [divergence, entropy, count] (its gradient passes)
    count = valid_N.sum().to(torch.float64)
    sums = all_reduce_sum(torch.stack([div_sum.double(), entropy[0].double(), count]), sp_group)
    loss = sums[0].to(div_sum.dtype) / n_valid
    grad_norm = _finish(student, optimizer, scheduler, loss, grad_clip)
    return PostTrainStepResult(float(loss.detach()), grad_norm)


# ----------------------------------------------------------------------------------------------
# one step of a kind, for the tracer and for the real run it is checked against
# ----------------------------------------------------------------------------------------------
def step_runner(
    spec: StepSpec,
    policy: torch.nn.Module,
    reference: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    mesh: Any,
    *,
    grad_clip: float = 1.0,
    cuda: bool = False,
    mark: Callable[[str], None] | None = None,
) -> Callable[[Batch], Any]:
    """``run(batch)``: one step of ``spec``'s kind on this rank's slice ``batch`` (the trainer's
    :func:`~dtensor_ulysses.train.train_step` for SFT; GRPO's advantages are ones: their values
    do not change the bytes), after its rollout round when ``spec.generation`` is set (marked
    ``generate:-`` with ``mark``). ``mesh``: the ``("dp", "sp")`` mesh, or its
    :class:`~dtensor_ulysses.parallel.ParallelDims` bound to it; ``cuda``: distillation's
    divergence as on a GPU (:func:`distill_step`)."""
    from dtensor_ulysses.parallel import ParallelDims
    from dtensor_ulysses.train import train_step

    dims = ParallelDims.of(mesh)
    group = dims.flat_mesh.get_group()
    if spec.kind == "vl":
        raise ValueError("the vision-language step is run by trace_train_step (it needs a tower)")
    if spec.kind == "sft":
        return lambda b: train_step(
            policy, b, optimizer, scheduler, group=group, grad_clip=grad_clip
        )
    if spec.kind == "dpo":
        if reference is None:
            raise ValueError("a DPO step needs a reference model")
        sp_group, dp = dims.sp_mesh.get_group(), dims.dp
        return lambda b: dpo_step(policy, reference, b, optimizer, scheduler, sp_group=sp_group,
                                  dp=dp, beta=spec.loss_beta, grad_clip=grad_clip)  # fmt: skip

    if spec.kind == "distill":
        if reference is None:
            raise ValueError("a distillation step needs a teacher model")
        sp_group = dims.sp_mesh.get_group()
        return lambda b: distill_step(policy, reference, b, optimizer, scheduler, group=group,
                                      sp_group=sp_group, beta=spec.loss_beta, cuda=cuda,
                                      grad_clip=grad_clip)  # fmt: skip
    sp = dims.sp

    def grpo(b: Batch) -> PostTrainStepResult:
        if spec.generation is not None:
            if mark is not None:
                mark("generate:-")
            seq_len = b.layout.seq_len
            generation_round(policy, -(-spec.generations // sp), seq_len, spec.generation)
        advantages_B = torch.ones(b.input_ids.shape[0])
        return grpo_step(policy, reference, b, advantages_B, optimizer, scheduler, group=group,
                         beta=spec.loss_beta, epsilon=spec.epsilon,
                         num_iterations=spec.num_iterations, grad_clip=grad_clip)  # fmt: skip

    return grpo
