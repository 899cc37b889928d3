"""Memory per rank: model states, gathered parameters, activations, loss, buffers, peak.

Everything is counted tensor by tensor from what PyTorch autograd keeps alive, per token a rank
holds (``B * s`` tokens, ``s = S/P``), in bytes. Legend as in :mod:`simulations.config`.

**Saved activations of one block** (no checkpointing; ``e`` activation bytes, ``nb`` bytes an
RMSNorm keeps per element including its output, ``m`` F-sized SwiGLU tensors, ``K''`` kv heads the
attention kernel sees per rank, times ``P``; see :class:`ImplProfile`):

    attention norm            nb * D           eager fp32 upcast: 4 + 2 + 2 = 8; fused: 2 + 2 = 4
    q/k norms (Qwen3)         (nb - e)(N + K) H  RoPE reads their output without saving it
    kernel q, k, v            e * (N + 2K'') H FlashAttention saves its inputs ...
    kernel o, logsumexp       e * N H + 4 N    ... its output and fp32 logsumexp
    o, projection input       e * N H          Ulysses only: the all-to-all returns a new tensor
    MLP norm                  nb * D
    SwiGLU                    m * e * F        eager: gate, up, silu(gate), product (m = 4)

Rotary embeddings multiply by constant tables and save nothing per token; residual adds save
nothing. With FlashAttention there is no ``S^2`` term (contrast row M1's ``5 a s^2 b``).

**Per rank** (:class:`RankGeometry`): the attention kernel's rows are counted on the tokens and
heads the kernel sees, the rest on the rank's own tokens. Under Ulysses rank ``r`` holds
``B * s_r`` tokens outside attention and attends over all ``B * S`` with ``n_r`` q and ``m_r`` kv
heads: kernel q, k, v ``e (n_r + 2 m_r) H`` and o, logsumexp ``(e H + 4) n_r`` per attention
token, which is the table's per-local-token row when the layout is even (``S = P s``,
``n_r = N / P``). The backward d(q,k,v) all-to-all holds the head-sharded gradients and the
packed send buffer (``2 e (n_r + 2 m_r) H B S``) and the receive buffer and the unpacked outputs
(``2 e (N + 2K') H B s_r``). With uneven heads or sequence the ranks differ; :func:`estimate`
evaluates each distinct rank and reports the largest peak (``rank``, ``peak_by_rank``).

**Full checkpointing** keeps ``e * D`` per block (its input) and replays one block at a time in
backward, so the peak holds ``L`` block inputs + one block's saved set + that block's backward
transients (gradients, FlashAttention's fp32 dq accumulator, all-to-all send/receive buffers).

**Model states** per parameter, divided by the shard degree (FSDP2 / ZeRO-3), see
:data:`IMPL_PROFILES`; offloaded states move to the CPU and are reported in ``cpu_bytes``.

**Loss** (untiled): logits in ``e`` bytes, an fp32 upcast and the fp32 log-softmax the backward
needs: ``(e + 8) V`` per token in forward; backward holds the saved log-softmax, the incoming fp32
gradient and the produced one, ``12 V``. Tiled loss materializes one tile of tokens at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dtensor_ulysses.presets import ModelShape
from simulations.comm import fsdp_units, kv_heads_after_replication
from simulations.config import DTYPE_BYTES, Workload

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

GiB = 2**30
FP32 = 4


@dataclass(frozen=True)
class ImplProfile:
    """How an implementation stores things; the profiles differ only where the code differs.

    Attributes:
        name: profile key.
        norm_saved: bytes one RMSNorm keeps per hidden element, its output (the next matmul's
            saved input) included: eager with an fp32 upcast (HF ``LlamaRMSNorm``, PyTorch's
            composite ``rms_norm``) keeps the fp32 input (4), the normalized bf16 tensor for the
            weight gradient (2) and the output (2) = 8; a fused kernel keeps input and output = 4.
        mlp_saved: F-sized tensors the SwiGLU keeps: eager gate, up, silu(gate), product = 4; a
            fused SwiGLU keeps gate and up, the down projection its input = 3.
        mlp_bwd: F-sized gradients alive at once in the SwiGLU backward.
        loss_kept: bytes per vocab entry per token the caller keeps alive through backward
            (HF's model output holds the fp32 logits: 4; this project's loss returns a scalar: 0).
        gpu_state_bytes: bytes per parameter on the GPU (before sharding), ``(params, grads,
            optimizer)``, keyed by offload mode ``none``/``optimizer``/``params``.
        cpu_state_bytes: bytes per parameter on the CPU, same keys.
        loss_tile_bytes: fp32 logits of one loss tile (tiled loss).
        loss_tile_tokens: tokens of one loss tile, when the implementation fixes it instead.
        persistent_grads: gradient partitions stay allocated between steps (DeepSpeed ZeRO-3
            preallocates them); else they exist from backward to ``zero_grad(set_to_none=True)``.
        optimizer_temp: bytes per owned parameter of optimizer-step temporaries (torch AdamW
            ``foreach``: one fp32 gradient-sized buffer, assumption; DeepSpeed's fused Adam: 0).
        fixed_bytes: allocator-visible buffers that scale with neither the model nor the sequence
            (communication buckets, workspaces).
    """

    name: str
    norm_saved: int
    mlp_saved: int
    mlp_bwd: int
    loss_kept: int
    gpu_state_bytes: dict[str, tuple[float, float, float]]
    cpu_state_bytes: dict[str, tuple[float, float, float]]
    loss_tile_bytes: int
    fixed_bytes: int
    loss_tile_tokens: int | None = None
    persistent_grads: bool = False
    optimizer_temp: int = 4


# FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) and AdamW: sharded fp32
# parameters (4), their fp32 gradients (4), Adam exp_avg + exp_avg_sq (8) = 16 bytes/param.
# --offload-optimizer moves Adam's 8 to the CPU; --offload-params (CPUOffloadPolicy) all 16.
_FSDP2_GPU = {"none": (4, 4, 8), "optimizer": (4, 4, 0), "params": (0, 0, 0)}
_FSDP2_CPU = {"none": (0, 0, 0), "optimizer": (0, 0, 8), "params": (4, 4, 8)}
# DeepSpeed ZeRO-3 bf16 (ALST's 18 bytes/param, row M2): bf16 parameters (2), fp32 gradients (4),
# fp32 master weights + Adam (12). With offload_optimizer the GPU keeps the bf16 parameter partition
# (2) and a bf16 gradient partition (2); fp32 gradients, master weights and Adam (16) go to the CPU.
_ZERO3_GPU = {"none": (2, 4, 12), "optimizer": (2, 2, 0), "params": (0, 0, 0)}
_ZERO3_CPU = {"none": (0, 0, 0), "optimizer": (0, 4, 12), "params": (2, 4, 12)}

IMPL_PROFILES: dict[str, ImplProfile] = {
    # This project: FSDP2 + dtensor_ulysses/model.py. RMSNorm upcasts to fp32 and calls
    # F.rms_norm with an fp32 weight: it keeps the fp32 input (4) and the fp32 normalized tensor
    # for the weight gradient (4); the bf16 output is the next matmul's input (2) = 10. Eager
    # SwiGLU (4). train.py holds the bf16 logits until backward ends (loss_kept 2); loss.py's
    # tiled loss materializes 4096-token chunks.
    "dtensor-ulysses": ImplProfile(
        name="dtensor-ulysses", norm_saved=10, mlp_saved=4, mlp_bwd=3, loss_kept=2,
        gpu_state_bytes=_FSDP2_GPU, cpu_state_bytes=_FSDP2_CPU,
        loss_tile_bytes=GiB, fixed_bytes=256 * 2**20, loss_tile_tokens=4096,
    ),
    # Hugging Face Transformers eager modules + DeepSpeed ZeRO-3 (the Hugging Face blog, row M4);
    # the loss upcasts inside the loss function, the caller keeps no logits. DeepSpeed's buckets
    # ("auto": ~hidden^2 elements each) and live-parameter cache: 1 GiB (assumption).
    "hf-deepspeed": ImplProfile(
        name="hf-deepspeed", norm_saved=8, mlp_saved=4, mlp_bwd=3, loss_kept=0,
        gpu_state_bytes=_ZERO3_GPU, cpu_state_bytes=_ZERO3_CPU,
        loss_tile_bytes=GiB, fixed_bytes=GiB, persistent_grads=True, optimizer_temp=0,
    ),
    # As "hf-deepspeed" with fused RMSNorm and SwiGLU kernels (bf16 saved tensors only) and the
    # model output holding fp32 logits through backward: the storage that reproduces ALST's
    # Table 1 (row M3); see simulations/README.md.
    "hf-deepspeed-fused": ImplProfile(
        name="hf-deepspeed-fused", norm_saved=4, mlp_saved=3, mlp_bwd=3, loss_kept=4,
        gpu_state_bytes=_ZERO3_GPU, cpu_state_bytes=_ZERO3_CPU,
        loss_tile_bytes=GiB, fixed_bytes=GiB, persistent_grads=True, optimizer_temp=0,
    ),
    # Hugging Face eager modules on one GPU without DeepSpeed: fp32 parameters and gradients,
    # AdamW states on the GPU (16 bytes/param), autocast bf16 activations (row M4's 1-GPU figure).
    "hf": ImplProfile(
        name="hf", norm_saved=8, mlp_saved=4, mlp_bwd=3, loss_kept=0,
        gpu_state_bytes=_FSDP2_GPU, cpu_state_bytes=_FSDP2_CPU,
        loss_tile_bytes=GiB, fixed_bytes=256 * 2**20,
    ),
}  # fmt: skip


def causal_mask_bytes(batch: int, seq_len: int, e: int = 2) -> int:
    """A materialized 4-D causal mask ``[B, 1, S, S]`` in ``e`` bytes (what position ids avoid)."""
    return batch * seq_len * seq_len * e


def _offload_mode(w: Workload) -> str:
    if w.offload_params:
        return "params"
    return "optimizer" if w.offload_optimizer else "none"


def model_state_bytes_per_param(w: Workload) -> tuple[tuple[float, float, float], float]:
    """``((params, grads, optimizer) GPU bytes per parameter, CPU bytes per parameter)``."""
    prof = IMPL_PROFILES[w.impl]
    mode = _offload_mode(w)
    return prof.gpu_state_bytes[mode], sum(prof.cpu_state_bytes[mode])


# ----------------------------------------------------------------------------------------------
# Row M1: Korthikanti et al. (arXiv 2205.05198), GPT block, 16-bit, with dropout
# ----------------------------------------------------------------------------------------------
def korthikanti_layer_bytes(
    s: int, b: int, h: int, a: int, t: int = 1, *, sp: bool = True, recompute: str = "none"
) -> float:
    """Activation bytes per GPT layer, counted tensor by tensor as in Korthikanti et al. sec. 4.

    Attention: LN output for q,k,v ``2sbh``; q and k ``4sbh``; softmax ``2as^2b``; its dropout mask
    ``as^2b``; dropout output ``2as^2b`` and v ``2sbh``; projection input ``2sbh``; dropout mask
    ``sbh`` -> ``11sbh + 5as^2b``. MLP: input ``2sbh``, GELU input ``8sbh``, GELU output ``8sbh``,
    dropout mask ``sbh`` -> ``19sbh``. Two layer norms ``4sbh``. Total ``34sbh + 5as^2b``.

    Args:
        s, b, h, a: sequence, micro-batch, hidden, heads.
        t: tensor-parallel size; with ``sp`` (sequence parallelism) everything divides by ``t``.
        sp: Megatron sequence parallelism on (else the LN/dropout ``10sbh`` stays replicated).
        recompute: ``"none"``, ``"selective"`` (drop the ``5as^2b`` attention core) or ``"full"``
            (only the layer input, ``2sbh``, is kept).
    """
    if recompute == "full":
        return 2 * s * b * h
    attn_linear = 2 * s * b * h + 4 * s * b * h + 2 * s * b * h + 2 * s * b * h  # 10sbh
    attn_core = 2 * a * s * s * b + a * s * s * b + 2 * a * s * s * b  # 5as^2b
    attn_dropout_mask = s * b * h  # 1sbh
    mlp = 2 * s * b * h + 8 * s * b * h + 8 * s * b * h  # 18sbh (inputs of the two matmuls, GELU)
    mlp_dropout_mask = s * b * h  # 1sbh
    norms = 4 * s * b * h  # 4sbh
    if recompute == "selective":
        attn_core = 0
    # Tensor-parallel regions: attention linear parts (except the replicated LN output and the
    # projection's dropout mask) and the MLP matmuls; SP splits the rest too.
    tp_part = (attn_linear - 2 * s * b * h) + attn_core + (mlp - 2 * s * b * h)
    rest = 2 * s * b * h + attn_dropout_mask + 2 * s * b * h + mlp_dropout_mask + norms  # 10sbh
    return tp_part / t + (rest / t if sp else rest)


# ----------------------------------------------------------------------------------------------
# one block on one rank
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankGeometry:
    """What one sp rank holds; ranks with the same geometry are counted once.

    Attributes:
        ranks: the sp ranks with this geometry (group-rank order).
        tokens: tokens outside attention, ``B * s_r``.
        att_tokens: tokens the attention kernel sees (Ulysses ``B * S``; ring ``B * s``; USP
            ``B * S / ring degree``; Megatron ``B * S``).
        q_heads: q heads the kernel sees (Ulysses ``n_r``; ring ``N``; Megatron ``N / t``).
        kv_heads: kv heads the kernel sees, after GQA replication (Ulysses ``m_r``).
    """

    ranks: tuple[int, ...]
    tokens: int
    att_tokens: int
    q_heads: int
    kv_heads: int


def rank_geometries(w: Workload) -> list[RankGeometry]:
    """The distinct geometries of the sp ranks (one when the layout is even), in rank order."""
    m = w.shape
    B, S, s = w.micro_batch, w.seq_len, w.local_seq
    N, K = m.n_heads, m.n_kv_heads
    if w.attention == "ulysses":  # any P dividing nothing: the real code's split
        plan = w.heads
        per = [(B * sr, B * S, n, k) for sr, n, k in zip(w.seq_sizes, plan.q_heads, plan.kv_heads)]
    elif w.attention == "usp":  # ulysses over u ranks (u | N), then a ring over S/r-token blocks
        plan, u = w.heads, w.a2a_degree
        per = [
            (B * s, B * S // w.ring_degree, plan.q_heads[r % u], plan.kv_heads[r % u])
            for r in range(w.sp)
        ]
    elif w.attention == "ring":
        per = [(B * s, B * s, N, K)] * w.sp
    else:  # megatron-sp: the kernel sees all S tokens of N/t q and K/t kv heads
        per = [(B * s, B * S, N // w.tp, K // w.tp)] * w.sp
    ranks: dict[tuple[int, int, int, int], list[int]] = {}
    for r, g in enumerate(per):
        ranks.setdefault(g, []).append(r)
    return [RankGeometry(tuple(rs), *g) for g, rs in ranks.items()]


def _kernel_kv_heads(w: Workload) -> int:
    """kv heads the attention kernel sees, expressed per local token (times the a2a degree)."""
    m = w.shape
    if w.attention == "ulysses":
        return kv_heads_after_replication(m.n_heads, m.n_kv_heads, w.sp)
    if w.attention == "usp":
        return kv_heads_after_replication(m.n_heads, m.n_kv_heads, w.a2a_degree)
    return m.n_kv_heads  # ring: local tokens, all kv heads; megatron: S tokens, K/t heads


def block_saved_bytes(w: Workload, g: RankGeometry) -> dict[str, float]:
    """Bytes one block saves for backward on a rank of geometry ``g``, by tensor (no
    checkpointing). The attention kernel's tensors scale with ``att_tokens`` and the rank's heads,
    everything else with the rank's ``tokens``."""
    m = w.shape
    prof = IMPL_PROFILES[w.impl]
    e = w.e
    D, N, K, H, F = m.dim, m.n_heads, m.n_kv_heads, m.head_dim, m.ffn_dim
    nb = prof.norm_saved
    t, at, q, kv = g.tokens, g.att_tokens, g.q_heads, g.kv_heads
    return {
        "attention_norm": nb * D * t,
        # per-head q/k norms: RoPE upcasts their output without saving it (no output term)
        "qk_norm": (nb - e) * (N + K) * H * t if m.qk_norm else 0,
        "attention_qkv": e * (q + 2 * kv) * H * at,
        "attention_out": (e * H + FP32) * q * at,  # o + fp32 logsumexp per head
        # Ulysses returns o from an all-to-all: a new tensor saved by the o projection; ring and
        # Megatron feed the kernel's own output tensor to the projection.
        "o_proj_input": e * N * H * t if w.a2a_degree > 1 else 0,
        "mlp_norm": nb * D * t,
        "mlp": 0 if w.tiled_mlp else prof.mlp_saved * e * F * t,
    }


def block_activation_bytes(w: Workload) -> dict[str, float]:
    """Bytes one block saves for backward, per token the rank holds, by tensor (no
    checkpointing), on the rank whose peak is the largest (:func:`estimate`; every rank when the
    layout is even)."""
    g = _geometry_of(w, estimate(w).rank)
    return {k: v / max(g.tokens, 1) for k, v in block_saved_bytes(w, g).items()}


def _geometry_of(w: Workload, rank: int) -> RankGeometry:
    return next(g for g in rank_geometries(w) if rank in g.ranks)


def _block_backward_transients(w: Workload, g: RankGeometry) -> dict[str, float]:
    """Extra bytes alive while one block runs backward, by stage (the stages do not overlap)."""
    m = w.shape
    e = w.e
    D, N, H, F = m.dim, m.n_heads, m.head_dim, m.ffn_dim
    tokens, at, q, kv = g.tokens, g.att_tokens, g.q_heads, g.kv_heads
    qkv_heads = e * (q + 2 * kv) * H * at  # the kernel's q, k, v (and their gradients)
    stages: dict[str, float] = {}
    # FlashAttention backward: dO, dQ, dK, dV and the fp32 dQ accumulator (FA2)
    stages["attention_working"] = e * q * H * at + qkv_heads + FP32 * q * H * at
    if kv < q:
        # FA2 with GQA computes dK, dV for every q head ([B, S, n, H] in e), then sums the groups
        stages["attention_working"] += 2 * e * q * H * at
    if w.a2a_degree > 1:
        # dtensor_ulysses._all_to_all, backward d(q,k,v): the head-sharded gradients and the
        # packed send buffer, the receive buffer and the unpacked sequence-sharded outputs
        qkv_seq = e * (N + 2 * _kernel_kv_heads(w)) * H * tokens
        stages["all_to_all_buffers"] = 2 * qkv_heads + 2 * qkv_seq
    if w.ring_degree > 1:
        # ring: two incoming k,v blocks (double buffering) + fp32 dK,dV accumulators in flight
        kv_block = 2 * kv * H * at
        stages["attention_working"] += 2 * e * kv_block + 2 * FP32 * kv_block
    if w.tp > 1:
        # Megatron: the gathered sequence (t x local) and the reduce-scatter input, D wide
        stages["all_to_all_buffers"] = 2 * w.tp * e * D * tokens
    if w.tiled_mlp:
        # ALST TiledMLP: ceil(s / D) tiles; one tile replays the SwiGLU and its backward
        n_tiles = max(1, math.ceil(tokens / D))
        tile = math.ceil(tokens / n_tiles)
        prof = IMPL_PROFILES[w.impl]
        stages["mlp_working"] = (prof.mlp_saved + prof.mlp_bwd) * e * F * tile
    else:
        # SwiGLU backward: gradient of the down projection input, then of silu(gate) and up
        stages["mlp_working"] = IMPL_PROFILES[w.impl].mlp_bwd * e * F * tokens
    return stages


def _loss_bytes(w: Workload, tokens: int) -> tuple[float, float]:
    """``(peak while the loss runs, bytes kept from loss forward to backward)``."""
    # Megatron's vocab-parallel head sees all S tokens for V/t of the vocabulary: per rank the
    # same S * V / t = s * V entries as a sequence shard with the whole vocabulary
    V, e = w.shape.vocab_size, w.e
    if w.tiled_loss:
        prof = IMPL_PROFILES[w.impl]
        tile = prof.loss_tile_tokens or prof.loss_tile_bytes // (FP32 * V)
        tile = max(1, min(tokens, tile))
        # one tile: logits (e), fp32 log-softmax, fp32 gradient (forward and backward fused);
        # plus the gradient of the hidden states accumulated over tiles (e * D per token)
        return (e + 2 * FP32) * V * tile + e * w.shape.dim * tokens, 0.0
    kept = IMPL_PROFILES[w.impl].loss_kept * V * tokens  # logits the caller keeps alive
    fwd = (e + 2 * FP32) * V * tokens  # logits, fp32 upcast, fp32 log-softmax
    bwd = 3 * FP32 * V * tokens  # saved log-softmax, incoming grad, produced grad
    return max(fwd, kept + bwd), FP32 * V * tokens


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
    # gathered parameters (param dtype): FSDP2 keeps the root module (embedding, head) gathered
    # from forward to backward; blocks are gathered one at a time (+ one prefetched) and
    # resharded after use. In backward a block also holds its unsharded gradient (e) and the
    # reduce-scatter input (reduce dtype), and the root's gradient waits for the end of backward.
    blk, root = _unit_numel(m, w.tp)
    re_ = DTYPE_BYTES[w.reduce_dtype]
    if w.sharding == "fsdp" and w.shard_degree // w.tp > 1:
        gathered_fwd = root * e
        gathered_bwd = root * e + 2 * blk * e + blk * (e + re_) + root * e
    else:  # replicated parameters are cast per use; gradients accumulate in place
        gathered_fwd = 0.0
        gathered_bwd = blk * e
    # activations
    layer_saved = sum(block_saved_bytes(w, g).values())
    ckpt_one = e * m.dim * tokens
    if w.ac == "full":
        ckpt = (2 if w.offload_activations else L) * ckpt_one
        resident_layers = ckpt
    else:
        ckpt = 0.0
        resident_layers = L * layer_saved
    stages = _block_backward_transients(w, g)
    residual_grads = 2 * e * m.dim * tokens  # gradient of the residual stream in and out
    loss_peak, loss_kept = _loss_bytes(w, tokens)
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
    if w.offload_activations:
        cpu += L * ckpt_one
    per_layer = {"no_ac": layer_saved, "ac_full": ckpt_one}
    return MemoryBreakdown(
        comps, sum(comps.values()), name, cpu, per_layer, float(w.gpu.usable_bytes)
    )
