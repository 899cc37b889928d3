"""Memory per rank: model states, gathered parameters, activations, loss, buffers, peak.

The peak is the largest of three moments (the loss, the first block backward, the optimizer
step), each the sum of its components. What one block saves and briefly needs comes from
:mod:`simulations.activations`, how an implementation stores things from
:mod:`simulations.profiles`. Legend as in :mod:`simulations.config`.

**Full checkpointing** keeps ``e * D`` per block (its input) and replays one block at a time in
backward, so the peak holds ``L`` block inputs + one block's saved set + that block's backward
transients (gradients, FlashAttention's fp32 dq accumulator, all-to-all send/receive buffers).

**Model states** per parameter, divided by the shard degree (FSDP2 / ZeRO-3), see
:data:`IMPL_PROFILES`; offloaded states move to the CPU and are reported in ``cpu_bytes``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dtensor_ulysses.presets import ModelShape
from simulations.activations import (
    RankGeometry,
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
    blk, root = _unit_numel(m, w.tp)
    head = m.vocab_size * m.dim // w.tp if prof.head_unit and not m.tie_embeddings else 0
    re_ = DTYPE_BYTES[w.reduce_dtype]
    gathered_fwd: float
    gathered_bwd: float
    if w.sharding == "fsdp" and w.shard_degree // w.tp > 1 and head:
        gathered_fwd = 2 * head * e
        gathered_bwd = 2 * blk * e + blk * (e + re_) + head * re_
    elif w.sharding == "fsdp" and w.shard_degree // w.tp > 1:
        gathered_fwd = root * e
        gathered_bwd = root * e + 2 * blk * e + blk * (e + re_) + root * e
    else:  # replicated parameters are cast per use; gradients accumulate in place
        gathered_fwd = 0.0
        gathered_bwd = blk * e
    # activations
    layer_saved = sum(block_saved_bytes(w, g).values())
    ckpt_one = e * m.dim * tokens
    ckpt: float
    resident_layers: float
    if w.ac == "full":
        ckpt = (2 if w.offload_activations else L) * ckpt_one
        resident_layers = ckpt
    else:
        ckpt = 0.0
        resident_layers = L * layer_saved
    stages = block_backward_transients(w, g)
    residual_grads = 2 * e * m.dim * tokens  # gradient of the residual stream in and out
    loss_peak, loss_kept = loss_bytes(w, tokens)
    inputs = tokens * 3 * 8 + 2 * FP32 * m.head_dim * tokens  # ids, positions, labels, rope
    if w.pack_docs:
        inputs += g.att_tokens * 8  # the position ids all-gathered for document masking
    fixed = prof.fixed_bytes

    # Gradients exist only from backward to the optimizer step (zero_grad(set_to_none=True));
    # the sharded ones land block by block as backward proceeds and activations are freed.
    if not prof.persistent_grads:
        base = dict(states, gradients=0.0, inputs=inputs, fixed=fixed)
    else:
        base = dict(states, inputs=inputs, fixed=fixed)
    # moment 1: the loss (end of forward, start of backward), all block activations resident
    at_loss = dict(
        base,
        fsdp_buffers=gathered_fwd,
        activations_checkpoints=resident_layers if w.ac == "full" else 0.0,
        activations_layer=0.0 if w.ac == "full" else resident_layers,
        logits_loss=loss_peak,
    )
    # moment 2: backward of the last block (the first to run backward): checkpoints of all blocks,
    # that block's replayed activations and its largest backward stage
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
    cpu = cpu_pb * m.n_params / w.shard_degree
    if w.offload_optimizer and not w.offload_params:
        # HostOffloadAdamW steps on the host: its temporaries are host memory (traced)
        cpu += prof.optimizer_temp * owned
    if w.offload_activations:
        cpu += L * ckpt_one
    per_layer = {"no_ac": layer_saved, "ac_full": ckpt_one}
    return MemoryBreakdown(
        comps, sum(comps.values()), name, cpu, per_layer, float(w.gpu.usable_bytes)
    )
