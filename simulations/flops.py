"""FLOP accounting: the MFU convention, the hardware FLOPs the GPUs execute, Megatron's formula.

Conventions (2 FLOPs per multiply-add; ``T`` tokens, ``S`` sequence, attention width ``N*H``):

* Matmuls, forward: ``2 * T * (weights of the layer)`` (Kaplan et al.); backward ``2x`` forward.
* Attention kernel, forward: ``4 * S^2 * N * H`` per sequence (``q k^T`` and ``p v``, FlashAttention
  papers, row T3), half when causal; the FlashAttention backward does 2.5x its forward (fwd+bwd =
  3.5x fwd, row T3).
* **Model FLOPs** (for MFU and ``tflops_per_gpu``): forward + backward = 3x forward for every
  matmul *and* for causal attention (half of ``4 S^2 N H``), logits included, embedding lookups,
  norms and recompute excluded. This is the PaLM / torchtitan convention with causal halving.
* **Hardware FLOPs** (for time): adds the recompute forward under full checkpointing and uses the
  FlashAttention 3.5x for attention.
* **Megatron FLOPs** (row T1, Narayanan et al. 2021): ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``
  per iteration with full recompute: a GPT block (MHA, 4h MLP), non-causal attention, 4x forward
  (forward, recompute, 2x backward) for the blocks and 3x for the logits. The DeepSpeed-Ulysses and
  ALST papers report TFLOPS with it; :func:`gpt_block_flops` derives it term by term.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtensor_ulysses.plan import ModelShape

__all__ = [
    "FlopCount",
    "count",
    "gpt_block_flops",
    "layer_matmul_params",
    "megatron_flops",
]

FA_BWD_OVER_FWD = 2.5  # FlashAttention backward / forward FLOPs (fwd+bwd = 3.5x fwd, row T3)


def layer_matmul_params(shape: ModelShape) -> int:
    """Weights one block multiplies by: q,k,v and o projections plus the three SwiGLU matrices."""
    D, N, K, H, F = shape.dim, shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.ffn_dim
    return D * H * (N + 2 * K) + N * H * D + 3 * D * F


def megatron_flops(B: int, s: int, l: int, h: int, V: int) -> float:
    """Model FLOPs per iteration with activation recompute (Narayanan et al. 2021, eq. 3)."""
    return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))


def gpt_block_flops(B: int, s: int, l: int, h: int, V: int, *, recompute: bool = True) -> float:
    """Megatron's count rebuilt op by op for a GPT model (MHA, 4h GELU MLP, non-causal).

    Per block forward: q,k,v ``2*B*s*h*3h`` + ``q k^T`` ``2*B*s^2*h`` + ``p v`` ``2*B*s^2*h`` +
    output projection ``2*B*s*h*h`` + MLP ``2 * 2*B*s*h*4h`` = ``24 B s h^2 + 4 B s^2 h``; logits
    ``2 B s h V``. Blocks run forward, (recompute,) backward = 2x: 4x (3x) forward; logits 3x.
    Equals :func:`megatron_flops` exactly with ``recompute=True``.
    """
    fwd_block = 2 * B * s * h * 3 * h + 4 * B * s * s * h + 2 * B * s * h * h + 16 * B * s * h * h
    logits = 2 * B * s * h * V
    return (4 if recompute else 3) * l * fwd_block + 3 * logits


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of one step, summed over all ranks (divide by ``W`` for one GPU).

    Attributes:
        model: MFU-convention FLOPs (see module docstring).
        matmul_hw: matmul FLOPs executed (includes recompute).
        attention_hw: attention-kernel FLOPs executed (causal, FlashAttention backward, recompute).
        megatron: row T1's convention for the same step (GPT-style count of this shape).
    """

    model: float
    matmul_hw: float
    attention_hw: float
    megatron: float

    @property
    def hardware(self) -> float:
        return self.matmul_hw + self.attention_hw


def count(
    shape: ModelShape, seq_len: int, n_seqs: int, *, recompute: bool, causal: bool = True
) -> FlopCount:
    """FLOPs of a step that processes ``n_seqs`` sequences of ``seq_len`` tokens.

    Args:
        shape: model shape.
        seq_len: ``S``.
        n_seqs: sequences per step over all ranks (``dp * micro_batch``).
        recompute: full activation checkpointing (the forward of every block runs twice).
        causal: causal attention (half the score matrix).
    """
    T = seq_len * n_seqs
    L, D, V = shape.n_layers, shape.dim, shape.vocab_size
    attn_width = shape.n_heads * shape.head_dim
    mm_fwd_layer = 2 * T * layer_matmul_params(shape)  # 2 FLOPs per weight per token
    logits_fwd = 2 * T * D * V
    # 4 S^2 N H per sequence non-causal (row T3); causal computes half the scores
    att_fwd_layer = 4 * seq_len * seq_len * attn_width * n_seqs * (0.5 if causal else 1.0)
    model = 3 * (L * (mm_fwd_layer + att_fwd_layer) + logits_fwd)
    fwd_passes = 2 if recompute else 1
    matmul_hw = L * mm_fwd_layer * (fwd_passes + 2) + 3 * logits_fwd
    attention_hw = L * att_fwd_layer * (fwd_passes + FA_BWD_OVER_FWD)
    # Megatron's convention applied to this shape's hidden size, layers and vocabulary (T1)
    mega = megatron_flops(n_seqs, seq_len, L, D, V)
    return FlopCount(model, matmul_hw, attention_hw, mega)
