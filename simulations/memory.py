"""Memory per rank: model states, gathered parameters, activations, loss, buffers, peak.

The peak is the largest of three moments (the loss, the first block backward, the optimizer
step), each the sum of its components. What one block saves and briefly needs comes from
:mod:`simulations.activations`, how an implementation stores things from
:mod:`simulations.profiles`. Legend as in :mod:`simulations.config`.

**Full checkpointing** keeps ``e * D`` per block (its input) and replays one block at a time in
backward, so the peak holds ``L`` block inputs + one block's saved set + that block's backward
transients (gradients, FlashAttention's fp32 dq accumulator, all-to-all send/receive buffers).
With ``staged_backward`` (this project's step) the replayed block's input is its checkpoint, the
block's backward is evaluated stage by stage (MLP, attention, exchanges), each stage with what is
still alive (:func:`simulations.activations.block_backward_stages`), and the offloaded
checkpoints (``--offload-activations``) are on the host except the one being replayed; every
block also keeps its RoPE tables on the device (``cast_block_inputs``). Against the trace of the
real step (``simulations trace``; llama3-8b and qwen3-4b, 16K to 6.2M tokens, sp 1 to 32, every
memory feature) the device peak is within 1%. Not seen by that trace (CPU fake tensors), so not
counted: on a GPU the offloader also brings the previous block's input back while a block runs
its backward (one more ``e * D`` per token), and FlashAttention-2's backward adds an fp32 dq
accumulator and, with GQA, per-q-head dK, dV to the kernel's stage. The head stages' exchanges
are one at a time (the default; ``--overlap-comm`` keeps more in flight, not modelled).

**Model states** per parameter, divided by the shard degree (FSDP2 / ZeRO-3), see
:data:`IMPL_PROFILES`; offloaded states move to the CPU and are reported in ``cpu_bytes``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dtensor_ulysses.plan import ModelShape
from simulations.activations import (
    RankGeometry,
    block_backward_stages,
    block_backward_transients,
    block_saved_bytes,
    causal_mask_bytes,
    korthikanti_layer_bytes,
    loss_bytes,
    rank_geometries,
)
from simulations.comm import fsdp_units
from simulations.config import DTYPE_BYTES, Workload
from simulations.profiles import IMPL_PROFILES, ImplProfile

__all__ = [
    "IMPL_PROFILES",
    "ImplProfile",
    "MemoryBreakdown",
    "RankGeometry",
    "block_activation_bytes",
    "block_saved_bytes",
    "causal_mask_bytes",
    "estimate",
    "korthikanti_layer_bytes",
    "model_state_bytes_per_param",
    "rank_geometries",
]

FP32 = 4


def _offload_mode(w: Workload) -> str:
    if w.offload_params:
        return "params"
    return "optimizer" if w.offload_optimizer else "none"


def model_state_bytes_per_param(w: Workload) -> tuple[tuple[float, float, float], float]:
    """``((params, grads, optimizer) GPU bytes per parameter, CPU bytes per parameter)``."""
    prof = IMPL_PROFILES[w.impl]
    mode = _offload_mode(w)
    return prof.gpu_state_bytes[mode], sum(prof.cpu_state_bytes[mode])


def block_activation_bytes(w: Workload) -> dict[str, float]:
    """Bytes one block saves for backward, per token the rank holds, by tensor (no
    checkpointing), on the rank whose peak is the largest (:func:`estimate`; every rank when the
    layout is even)."""
    g = _geometry_of(w, estimate(w).rank)
    return {k: v / max(g.tokens, 1) for k, v in block_saved_bytes(w, g).items()}


def _geometry_of(w: Workload, rank: int) -> RankGeometry:
    return next(g for g in rank_geometries(w) if rank in g.ranks)


# ----------------------------------------------------------------------------------------------
# the whole rank
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryBreakdown:
    """Per-rank memory at the peak moment, by component, plus facts around it.

    Attributes:
        components: bytes by component at the peak moment (keys of :data:`COMPONENTS`).
        peak: allocator peak, bytes (the sum of ``components``).
        peak_moment: ``"loss"`` (logits/loss), ``"block_backward"`` or ``"optimizer_step"``.
        cpu_bytes: offloaded bytes per rank living in host memory.
        per_layer: activation bytes of one block: ``{"no_ac": ..., "ac_full": ...}``.
        capacity: bytes tensors may use on the GPU (profile ``usable_bytes``).
        rank: the sp rank these figures are of: the one with the largest peak (the first such).
        peak_by_rank: the peak of every sp rank (equal when the layout is even).
    """

    components: dict[str, float]
    peak: float
    peak_moment: str
    cpu_bytes: float
    per_layer: dict[str, float]
    capacity: float
    rank: int = 0
    peak_by_rank: tuple[float, ...] = ()

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity

    def to_dict(self) -> dict:
        d = {k: int(v) for k, v in self.components.items()}
        d["peak"] = int(self.peak)
        return d


COMPONENTS = (
    "parameters",
    "gradients",
    "optimizer_states",
    "fsdp_buffers",
    "activations_checkpoints",
    "activations_layer",
    "attention_working",
    "all_to_all_buffers",
    "mlp_working",
    "logits_loss",
    "inputs",
    "fixed",
)


def _unit_numel(shape: ModelShape, t: int) -> tuple[int, int]:
    units = fsdp_units(shape)

    def numel(shapes, split):
        return sum(math.prod(s) // (t if split and len(s) > 1 else 1) for s in shapes)

    return numel(units["block"], True), numel(units["root"], True)


def estimate(w: Workload) -> MemoryBreakdown:
    """Peak memory of the busiest rank for workload ``w`` (see module docstring): every distinct
    rank geometry is estimated and the largest peak is reported, with every rank's peak."""
    per = [(g, _estimate_rank(w, g)) for g in rank_geometries(w)]
    g, best = max(per, key=lambda x: x[1].peak)  # the first of equal peaks: the lowest rank
    by_rank = [0.0] * w.sp
    for gg, mb in per:
        for r in gg.ranks:
            by_rank[r] = mb.peak
    return replace(best, rank=g.ranks[0], peak_by_rank=tuple(by_rank))


def _estimate_rank(w: Workload, g: RankGeometry) -> MemoryBreakdown:
    """Peak memory of a rank of geometry ``g``."""
    m = w.shape
    prof = IMPL_PROFILES[w.impl]
    e = w.e
    tokens = g.tokens
    L = m.n_layers
    # model states: the parameters a rank owns, sharded (FSDP2 / ZeRO-3) or replicated (DDP)
    (pb, gb, ob), cpu_pb = model_state_bytes_per_param(w)
    owned = m.n_params / w.shard_degree
    states = {"parameters": pb * owned, "gradients": gb * owned, "optimizer_states": ob * owned}
    # gathered parameters (param dtype): blocks are gathered one at a time, and FSDP2 keeps each
    # all-gather's output buffer until the next all-gather (2 per block); in backward a block also
    # holds its unsharded gradient (e) and the reduce-scatter input (reduce dtype). The root unit
    # (embedding, head) is gathered from forward to the end of backward, where its gradient waits.
    # With ``head_unit`` (untied), the head is gathered for the loss only (its weight and buffer,
    # 2e), and its reduce-scatter input stays until the last block's reduce-scatter (re).
    # With ``staged_backward`` (traced) FSDP2 prefetches the next unit in backward order: at the
    # last block (the first to run backward) the block before it, at the first block the
    # embedding (untied; tied, the root is gathered already); a block's own reduce-scatter input
    # appears after its backward, when its activations are gone, and the one before lingers
    # until the next reduce-scatter: the head's at the last block, a block's at the first one
    # (``first_bwd``). With ``head_unit`` FSDP2 shards on any number of ranks; on one rank a
    # gathered copy is a cast, without an all-gather buffer.
    blk, root = _unit_numel(m, w.tp)
    head = m.vocab_size * m.dim // w.tp if prof.head_unit and not m.tie_embeddings else 0
    re_ = DTYPE_BYTES[w.reduce_dtype]
    ag = 2 if w.shard_degree // w.tp > 1 else 1  # unsharded parameters + all-gather buffer
    sharded = w.sharding == "fsdp" and (w.shard_degree // w.tp > 1 or prof.head_unit)
    gathered_fwd: float
    gathered_bwd: float
    first_bwd: float
    if sharded and head and prof.staged_backward:
        gathered_fwd = head * e + blk * e  # the head and the last block, prefetched
        gathered_bwd = ag * blk * e + blk * e + head * re_
        first_bwd = 2 * blk * e + blk * re_ + head * e
    elif sharded and head:
        gathered_fwd = ag * head * e
        gathered_bwd = ag * blk * e + blk * (e + re_) + head * re_
    elif sharded and prof.staged_backward:
        gathered_fwd = root * e
        gathered_bwd = root * e + ag * blk * e + blk * e + root * e
        first_bwd = root * e + 2 * blk * e + blk * re_ + root * e
    elif sharded:
        gathered_fwd = root * e
        gathered_bwd = root * e + ag * blk * e + blk * (e + re_) + root * e
    else:  # replicated parameters are cast per use; gradients accumulate in place
        gathered_fwd = 0.0
        gathered_bwd = blk * e
    if not (sharded and prof.staged_backward):
        first_bwd = gathered_bwd
    # activations. ``cast_block_inputs``: every block keeps its own RoPE tables (``rope``),
    # checkpointed or not, never offloaded. With ``staged_backward`` the offloaded checkpoints
    # are on the host at the loss; in a block's backward two are on the device: the replayed
    # block's input and the one before it, which the offloader brings back meanwhile (CUDA's
    # side stream; the trace follows that schedule).
    layer_saved = sum(block_saved_bytes(w, g).values())
    ckpt_one = e * m.dim * tokens
    rope = e * m.head_dim * tokens if prof.cast_block_inputs else 0.0
    ckpt: float
    resident_layers: float
    if w.ac == "full":
        on_device = min(L, 2) if w.offload_activations else L
        ckpt = on_device * ckpt_one + L * rope
        resident_layers = ckpt
        if prof.staged_backward and w.offload_activations:
            resident_layers = L * rope
    else:
        ckpt = 0.0
        resident_layers = L * (layer_saved + rope)
    loss_peak, loss_kept = loss_bytes(w, tokens)
    inputs = tokens * 3 * 8  # ids, positions, labels
    if not prof.cast_block_inputs:  # the float32 RoPE tables, alive through the step
        inputs += 2 * FP32 * m.head_dim * tokens
    if w.pack_docs:
        inputs += g.att_tokens * 4  # the step's int32 document ids over the full sequence
    fixed = prof.fixed_bytes

    # Gradients exist only from backward to the optimizer step (zero_grad(set_to_none=True));
    # the sharded ones land block by block as backward proceeds and activations are freed.
    if not prof.persistent_grads:
        base = dict(states, gradients=0.0, inputs=inputs, fixed=fixed)
    else:
        base = dict(states, inputs=inputs, fixed=fixed)
    # moment 1: the loss (end of forward, start of backward), all block activations resident;
    # with ``staged_backward`` also the final norm's input and output (traced)
    final_norm = 2 * ckpt_one if prof.staged_backward else 0.0
    at_loss = dict(
        base,
        fsdp_buffers=gathered_fwd,
        activations_checkpoints=resident_layers if w.ac == "full" else 0.0,
        activations_layer=0.0 if w.ac == "full" else resident_layers,
        logits_loss=loss_peak + final_norm,
    )
    # moment 2: backward of the last block (the first to run backward): checkpoints of all blocks,
    # that block's replayed activations and its largest backward stage
    at_block: dict[str, float]
    if prof.staged_backward:
        # Stage by stage (block_backward_stages): what the block still keeps, less its input
        # when that is its checkpoint. Two blocks: the last (the first to run backward), with
        # every other block's checkpoint (or, without checkpointing, saved set) and RoPE tables,
        # and the first (the last to run), with every other block's sharded gradient, the
        # reduce-scatter input of the block after it and the embedding gathered for its
        # backward; the head's sharded gradient exists at both.
        per_block_grad = gb * blk * w.tp / w.shard_degree
        head_grad = gb * head * w.tp / w.shard_degree if sharded else 0.0
        last_others: float
        first_ckpt: float
        first_others: float
        if w.ac == "full":
            last_others, first_ckpt, first_others = -ckpt_one, ckpt_one + rope, -ckpt_one
        else:
            last_others, first_ckpt, first_others = (L - 1) * layer_saved + L * rope, 0.0, rope
        blocks = [  # (checkpoints, other blocks' activations, gradients, FSDP2 buffers)
            (ckpt, last_others, head_grad, gathered_bwd),
            (first_ckpt, first_others, head_grad + (L - 1) * per_block_grad, first_bwd),
        ]
        candidates = [
            dict(
                base,
                gradients=base.get("gradients", 0.0) + grads,
                fsdp_buffers=fsdp,
                activations_checkpoints=kept,
                logits_loss=0.0,
                **dict(parts, activations_layer=parts["activations_layer"] + others),
            )
            for kept, others, grads, fsdp in blocks
            for parts in block_backward_stages(w, g).values()
        ]
        at_block = max(candidates, key=lambda d: sum(d.values()))
    else:
        stages = block_backward_transients(w, g)
        residual_grads = 2 * e * m.dim * tokens  # gradient of the residual stream in and out
        worst = max(stages, key=lambda k: stages[k])
        at_block = dict(
            base,
            fsdp_buffers=gathered_bwd,
            activations_checkpoints=ckpt,
            activations_layer=(layer_saved if w.ac == "full" else resident_layers) + residual_grads,
            logits_loss=0.0,
            **{worst: stages[worst]},
        )
    # moment 3: the optimizer step: every gradient, plus the optimizer's temporaries
    at_step = dict(states, inputs=inputs, fixed=fixed)
    at_step["optimizer_states"] += prof.optimizer_temp * owned if ob else 0.0
    moments = {"loss": at_loss, "block_backward": at_block, "optimizer_step": at_step}
    name = max(moments, key=lambda k: sum(moments[k].values()))
    comps = {k: float(moments[name].get(k, 0.0)) for k in COMPONENTS}
    del loss_kept  # freed before block backward; already inside loss_peak
    # Host memory: the offloaded states, the offloaded checkpoints (all of them at the loss) and
    # the optimizer step's temporaries (HostOffloadAdamW steps on the host; traced). With
    # ``staged_backward`` backward has released the checkpoints' host copies before the step
    # (the larger of the two counts), and offloaded FSDP2 gradients (``--offload-params``)
    # exist only from backward to ``zero_grad(set_to_none=True)``, not with the checkpoints.
    host_step = prof.optimizer_temp * owned if w.offload_optimizer and not w.offload_params else 0
    host_fwd = L * ckpt_one if w.offload_activations else 0.0
    if not prof.staged_backward:
        cpu = cpu_pb * owned + host_step + host_fwd
    else:
        if w.offload_params and not prof.persistent_grads:
            host_fwd -= prof.cpu_state_bytes["params"][1] * owned
        cpu = cpu_pb * owned + max(host_step, host_fwd)
    per_layer = {"no_ac": layer_saved, "ac_full": ckpt_one}
    return MemoryBreakdown(
        comps, sum(comps.values()), name, cpu, per_layer, float(w.gpu.usable_bytes)
    )
