"""What one block keeps and briefly needs on one rank: the activation model.

Counted tensor by tensor from what PyTorch autograd keeps alive, per token a rank holds (``B * s``
tokens, ``s = S/P``), in bytes; legend as in :mod:`simulations.config`. The memory features
(tiled MLP, tiled loss, ...) change these functions; :mod:`simulations.memory` adds them up into
the rank's peak.

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
nothing. With FlashAttention there is no ``S^2`` term (contrast row M1's ``5 a s^2 b``). With
``K > 1`` head chunks (``dtensor_ulysses/attention/_head_stages.py``) the attention keeps only its
inputs:
this rank's slice of q (``e * N H``) and the exchanged k, v (``2 e * K'' H``), no kernel output;
the o projection keeps the stages' output (``e * N H``).

**Per rank** (:class:`RankGeometry`): the attention kernel's rows are counted on the tokens and
heads the kernel sees, the rest on the rank's own tokens. Under Ulysses rank ``r`` holds
``B * s_r`` tokens outside attention and attends over all ``B * S`` with ``n_r`` q and ``m_r`` kv
heads: kernel q, k, v ``e (n_r + 2 m_r) H`` and o, logsumexp ``(e H + 4) n_r`` per attention
token, which is the table's per-local-token row when the layout is even (``S = P s``,
``n_r = N / P``). The backward d(q,k,v) all-to-all holds the head-sharded gradients and the
packed send buffer (``2 e (n_r + 2 m_r) H B S``) and the receive buffer and the unpacked outputs
(``2 e (N + 2K') H B s_r``). With uneven heads or sequence the ranks differ;
:func:`simulations.memory.estimate` evaluates each distinct rank and reports the largest peak.

**Backward of one block**: :func:`block_backward_transients` (the published profiles: the saved
set stays whole, plus the largest transient, FlashAttention-2's workspace included) or
:func:`block_backward_stages` (``staged_backward``, this project's step as traced: stage by stage,
each with what is still alive). Per local token, llama-like, with checkpointing and tiled MLP,
the stages are ``5D + 2q + 2kv'`` (MLP; ``+ q`` without head chunks under Ulysses) plus a tile,
and ``2D + 3q + 4kv' + (4 q_c + 2 k_c)`` elements with ``K`` head chunks on ``sp > 1``
(``q_c = q / K``; ``k_c`` the kv heads of a stage), besides the replayed block's input.

**Loss** (untiled): logits in ``e`` bytes, an fp32 upcast and the fp32 log-softmax the backward
needs: ``(e + 8) V`` per token in forward; backward holds the saved log-softmax, the incoming fp32
gradient and the produced one, ``12 V``. Tiled loss materializes one tile of tokens at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from simulations.comm import kv_heads_after_replication
from simulations.config import Workload
from simulations.profiles import IMPL_PROFILES

__all__ = [
    "RankGeometry",
    "block_backward_stages",
    "block_backward_transients",
    "block_saved_bytes",
    "causal_mask_bytes",
    "korthikanti_layer_bytes",
    "loss_bytes",
    "rank_geometries",
]

FP32 = 4


def causal_mask_bytes(batch: int, seq_len: int, e: int = 2) -> int:
    """A materialized 4-D causal mask ``[B, 1, S, S]`` in ``e`` bytes (what position ids avoid)."""
    return batch * seq_len * seq_len * e


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
    nb = 2 * e if prof.norm_saved is None else prof.norm_saved  # None: input + output, e each
    t, at, q, kv = g.tokens, g.att_tokens, g.q_heads, g.kv_heads
    chunked = w.head_chunks > 1
    # head-chunked (_head_stages.py): the function keeps its inputs only, this rank's sequence
    # slice of q (all N heads) and the exchanged k, v
    qkv = e * (N * H * t + 2 * kv * H * at) if chunked else e * (q + 2 * kv) * H * at
    return {
        "attention_norm": nb * D * t,
        # per-head q/k norms: RoPE upcasts their output without saving it (no output term)
        "qk_norm": (nb - e) * (N + K) * H * t if m.qk_norm else 0,
        "attention_qkv": qkv,
        # o + fp32 logsumexp per head; head stages keep nothing of a stage
        "attention_out": 0 if chunked else (e * H + FP32) * q * at,
        # Ulysses returns o from an all-to-all, head stages from their output tensor: a new
        # tensor saved by the o projection; ring and Megatron feed the kernel's own output
        # tensor to the projection.
        "o_proj_input": e * N * H * t if w.a2a_degree > 1 or chunked else 0,
        "mlp_norm": nb * D * t,
        "mlp": 0 if w.tiled_mlp else prof.mlp_saved * e * F * t,
    }


def _kernel_backward(w: Workload, g: RankGeometry) -> tuple[float, float]:
    """``(dO, dQ, dK, dV and the ring's blocks in flight; FlashAttention-2's own workspace)``."""
    e, H = w.e, w.shape.head_dim
    at, q, kv = g.att_tokens, g.q_heads, g.kv_heads
    kernel = e * q * H * at + e * (q + 2 * kv) * H * at
    if w.ring_degree > 1:
        # ring: two incoming k,v blocks (double buffering) + fp32 dK,dV accumulators in flight
        kv_block = 2 * kv * H * at
        kernel += 2 * e * kv_block + 2 * FP32 * kv_block
    fa2 = FP32 * q * H * at  # FA2's fp32 dQ accumulator
    if kv < q:
        # FA2 with GQA computes dK, dV for every q head ([B, S, n, H] in e), then sums the groups
        fa2 += 2 * e * q * H * at
    return kernel, fa2


def block_backward_transients(w: Workload, g: RankGeometry) -> dict[str, float]:
    """Extra bytes alive while one block runs backward, by stage (the stages do not overlap),
    for profiles without ``staged_backward`` (see :func:`block_backward_stages`)."""
    m = w.shape
    e = w.e
    D, N, H, F = m.dim, m.n_heads, m.head_dim, m.ffn_dim
    tokens, at, q, kv = g.tokens, g.att_tokens, g.q_heads, g.kv_heads
    qkv_heads = e * (q + 2 * kv) * H * at  # the kernel's q, k, v (and their gradients)
    stages: dict[str, float] = {}
    # FlashAttention backward: dO, dQ, dK, dV and the fp32 dQ accumulator (FA2; with GQA, dK
    # and dV per q head); ring attention: its k,v blocks and dK,dV accumulators in flight
    stages["attention_working"] = sum(_kernel_backward(w, g))
    if w.a2a_degree > 1:
        # dtensor_ulysses.comm.alltoall, backward d(q,k,v): the head-sharded gradients and the
        # packed send buffer, the receive buffer and the unpacked sequence-sharded outputs
        qkv_seq = e * (N + 2 * _kernel_kv_heads(w)) * H * tokens
        stages["all_to_all_buffers"] = 2 * qkv_heads + 2 * qkv_seq
    if w.tp > 1:
        # Megatron: the gathered sequence (t x local) and the reduce-scatter input, D wide
        stages["all_to_all_buffers"] = 2 * w.tp * e * D * tokens
    if w.tiled_mlp:
        # ALST TiledMLP: ceil(s / D) tiles; one tile replays the SwiGLU and its backward
        if w.mlp_chunk_tokens:
            tile = min(tokens, w.mlp_chunk_tokens)
        else:
            n_tiles = max(1, math.ceil(tokens / D))
            tile = math.ceil(tokens / n_tiles)
        prof = IMPL_PROFILES[w.impl]
        stages["mlp_working"] = (prof.mlp_saved + prof.mlp_bwd) * e * F * tile
    else:
        # SwiGLU backward: gradient of the down projection input, then of silu(gate) and up
        stages["mlp_working"] = IMPL_PROFILES[w.impl].mlp_bwd * e * F * tokens
    return stages


def block_backward_stages(w: Workload, g: RankGeometry) -> dict[str, dict[str, float]]:
    """One block's backward, stage by stage, for profiles with ``staged_backward`` (this
    project's step, traced): per stage, the bytes alive by component. ``activations_layer`` is
    what the block still keeps (its input included) plus the gradients of the residual stream;
    the other components are the stage's working set. In backward order:

    * ``mlp``: the whole saved set, the incoming gradient and the MLP input's gradient (one
      preallocated tensor when tiled), and the MLP's working set (one tile replayed and
      differentiated when tiled; else its three F-sized gradients).
    * ``attention``: the MLP's tensors are gone; the attention's saved tensors and the residual
      gradient stay. Without head chunks: the kernel's backward (``dO, dQ, dK, dV`` on the
      kernel's heads and tokens, in ``e``, as the traced SDPA kernel; FlashAttention-2 adds an
      fp32 ``dQ`` accumulator and, with GQA, per-q-head ``dK, dV``, which a trace on CPU cannot
      see). With ``K`` head chunks (``_head_stages.py``, one exchange at a time, the default):
      the incoming ``d o`` and the preallocated ``d q`` (``[B, s, N, H]`` each), the
      ``d k, d v`` accumulators (as the exchanged ``k, v``), and one stage on ``q_c = n / K``
      q heads and ``k_c`` kv heads: its exchanged ``q, d o`` (views on one rank), the
      recomputed ``o`` (+ fp32 logsumexp), ``d q, d k, d v``; between stages
      (``exchange_o``), the send and receive buffers of the next stage's ``q, d o`` (and,
      with more than one head per rank and stage, the copies of their strided slices). With the
      trainer's ``--overlap-comm`` (not modelled) a stage also has the next stage's ``q, d o``
      and a ``d q`` in flight: six more one-stage tensors.
    * ``exchange_o``, ``exchange_qkv`` (Ulysses without head chunks): before the kernel, ``d o``
      goes to heads (the gradient on the sequence, the receive buffer and the result, all
      saved tensors of the attention alive); after it, ``d(q, k, v)`` goes back (the
      kernel's gradients with the send and receive buffers, or the receive buffer and the
      results: a pending exchange holds only its two buffers, its results are allocated when
      it is waited for), the attention norm's tensors and the residual gradient alive.
      Megatron: its gather and reduce-scatter instead.
    """
    m = w.shape
    e = w.e
    D, N, H = m.dim, m.n_heads, m.head_dim
    t, at, q, kv = g.tokens, g.att_tokens, g.q_heads, g.kv_heads
    saved = block_saved_bytes(w, g)
    transients = block_backward_transients(w, g)
    grad = e * D * t  # one gradient of the residual stream
    norm = saved["attention_norm"] + saved["qk_norm"]
    attention = norm + saved["attention_qkv"] + saved["attention_out"]
    stages = {
        "mlp": {
            "activations_layer": sum(saved.values()) + 2 * grad,
            "mlp_working": transients["mlp_working"],
        }
    }
    K = w.head_chunks
    if K > 1:
        qc, kc = max(1, q // K), max(1, kv // K)
        head = e * H * at  # one head over the tokens the kernel sees
        working = 2 * e * N * H * t + 2 * e * kv * H * at  # d o, d q; d k, d v accumulators
        stage = head * (2 * qc + 2 * kc) + FP32 * qc * at  # o (+ logsumexp), d q, d k, d v
        if w.a2a_degree > 1:
            stage += 2 * qc * head  # this stage's q, d o, received
            # between two stages, one exchange: q, d o of the next (send and receive buffers),
            # and, with more than one head per rank and stage, their strided slices copied
            stages["exchange_o"] = {
                "activations_layer": attention + grad,
                "attention_working": working,
                "all_to_all_buffers": (4 + (2 if qc > 1 else 0)) * qc * head,
            }
        stages["attention"] = {
            "activations_layer": attention + grad,
            "attention_working": working + stage,
        }
        return stages
    stages["attention"] = {
        "activations_layer": attention + grad,
        "attention_working": _kernel_backward(w, g)[0],
    }
    if w.a2a_degree > 1:
        # before the kernel, d o to heads: d o on the sequence, the receive buffer, the result
        stages["exchange_o"] = {
            "activations_layer": attention + grad,
            "all_to_all_buffers": 3 * e * N * H * t,
        }
        # after it, d(q, k, v) to the sequence: the kernel's gradients and the send and receive
        # buffers, or the receive buffer and the results (the send buffer is freed first)
        heads = e * (q + 2 * kv) * H * at
        seq = e * (N + 2 * _kernel_kv_heads(w)) * H * t
        stages["exchange_qkv"] = {
            "activations_layer": norm + grad,
            "all_to_all_buffers": heads + seq + max(heads, seq),
        }
    elif "all_to_all_buffers" in transients:  # Megatron: the gathered sequence, the RS input
        stages["exchange_qkv"] = {
            "activations_layer": norm + grad,
            "all_to_all_buffers": transients["all_to_all_buffers"],
        }
    return stages


def loss_bytes(w: Workload, tokens: int) -> tuple[float, float]:
    """``(peak while the loss runs, bytes kept from loss forward to backward)``."""
    # Megatron's vocab-parallel head sees all S tokens for V/t of the vocabulary: per rank the
    # same S * V / t = s * V entries as a sequence shard with the whole vocabulary
    V, e = w.shape.vocab_size, w.e
    if w.tiled_loss:
        prof = IMPL_PROFILES[w.impl]
        tile = w.loss_chunk_tokens or prof.loss_tile_tokens or prof.loss_tile_bytes // (FP32 * V)
        tile = max(1, min(tokens, tile))
        if prof.staged_backward:
            # memory/tiling.py, traced: one tile replayed and differentiated, its fp32
            # log-softmax and the incoming and produced fp32 gradients (12 V), next to the output
            # weight's gradient (e, summed over the tiles); the hidden states' gradient (one tensor)
            D = w.shape.dim
            return 3 * FP32 * V * tile + e * V * D // w.tp + e * D * tokens, 0.0
        # one tile: logits (e), fp32 log-softmax, fp32 gradient (forward and backward fused);
        # plus the gradient of the hidden states accumulated over tiles (e * D per token)
        return (e + 2 * FP32) * V * tile + e * w.shape.dim * tokens, 0.0
    kept = IMPL_PROFILES[w.impl].loss_kept * V * tokens  # logits the caller keeps alive
    fwd = (e + 2 * FP32) * V * tokens  # logits, fp32 upcast, fp32 log-softmax
    bwd = 3 * FP32 * V * tokens  # saved log-softmax, incoming grad, produced grad
    return max(fwd, kept + bwd), FP32 * V * tokens
