"""A Llama-style decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP), free of any parallelism.

The model never imports ``torch.distributed``. Every module except attention is token-wise, so
under Ulysses it runs unchanged on a rank's local sequence slice; attention calls its
``inner_attention`` module, which is the local kernel by default and which ``du.parallelize``
swaps for the Ulysses engine (torchtitan's pattern). The step's
:class:`~dtensor_ulysses.plan.SeqLayout` (sequence pieces per rank, packed-document starts) is
passed down unchanged to every ``inner_attention``. Positions are always *global*: a rank
holding tokens ``[r*s, (r+1)*s)`` passes those position ids, and RoPE is computed from them on the
fly, so the model has no buffers and a model built on ``meta`` only needs
:func:`~dtensor_ulysses.models.init_weights`.

Here: attention, the block, the model, construction and FLOPs. The token-wise building blocks
(RMSNorm, RoPE, FeedForward, OutputHead) are in :mod:`dtensor_ulysses.models.layers`; the
initialization in :mod:`dtensor_ulysses.models.weights`.

Legend (tensor names carry their local shape):

    B batch              s local sequence slice (S / sp; S when sp = 1)
    D model dim          N q heads            K kv heads            H head dim
    R = H / 2 rotary frequencies              F SwiGLU inner dim    V vocabulary

Typical use::

    model = build_model("llama3-1b")          # on meta: no memory
    ...                                       # du.parallelize(model, mesh, ...)
    model.to_empty(device="cuda")
    init_weights(model, seed=0)               # same values for any sharding
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_ulysses.attention.doc_tensors import with_doc_tensors
from dtensor_ulysses.attention.local import DeferredQ, LocalAttention
from dtensor_ulysses.models.layers import (
    FeedForward,
    HeadFn,
    OutputHead,
    RMSNorm,
    _compute_dtype,
    apply_rope,
    rope_cos_sin,
)
from dtensor_ulysses.models.loss import cross_entropy_sum, tiled_cross_entropy_sum
from dtensor_ulysses.plan.presets import PRESETS, ModelShape, get_shape, training_flops_per_token
from dtensor_ulysses.plan.splits import SeqLayout

EmbedFn = Callable[[torch.Tensor], torch.Tensor]
"""``embed_fn(h[B, s, D]) -> h[B, s, D]``: a change of the token embeddings before the first
block (:meth:`Transformer.forward`)."""

__all__ = [
    "Attention",
    "EmbedFn",
    "build_model",
    "model_flops_per_token",
    "set_tiling",
    "Transformer",
    "TransformerBlock",
]


# ----------------------------------------------------------------------------------------------
# attention, the block, the model
# ----------------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Causal GQA self-attention with RoPE and optional per-head q/k RMSNorm (Qwen3).

    Attributes:
        inner_attention: ``(q, k, v, *, layout) -> o`` on ``[B, s, heads, H]`` tensors; the local
            kernel (:class:`~dtensor_ulysses.attention.LocalAttention`) unless ``du.parallelize``
            swapped it for the Ulysses engine.
    """

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.n_heads = shape.n_heads
        self.n_kv_heads = shape.n_kv_heads
        self.head_dim = shape.head_dim
        D, N, K, H = shape.dim, shape.n_heads, shape.n_kv_heads, shape.head_dim
        self.wq = nn.Linear(D, N * H, bias=False)
        self.wk = nn.Linear(D, K * H, bias=False)
        self.wv = nn.Linear(D, K * H, bias=False)
        self.wo = nn.Linear(N * H, D, bias=False)
        self.q_norm: RMSNorm | None = RMSNorm(H, shape.norm_eps) if shape.qk_norm else None
        self.k_norm: RMSNorm | None = RMSNorm(H, shape.norm_eps) if shape.qk_norm else None
        self.inner_attention: nn.Module = LocalAttention()

    def forward(
        self,
        x_BsD: torch.Tensor,
        cos_Bs1R: torch.Tensor,
        sin_Bs1R: torch.Tensor,
        layout: SeqLayout | None = None,
    ) -> torch.Tensor:
        """``x[B, s, D] -> y[B, s, D]``; ``cos``/``sin`` from :func:`rope_cos_sin`."""
        B, s, _ = x_BsD.shape
        N, K, H = self.n_heads, self.n_kv_heads, self.head_dim
        k_BsKH = self.wk(x_BsD).view(B, s, K, H)
        v_BsKH = self.wv(x_BsD).view(B, s, K, H)
        if self.k_norm is not None:
            k_BsKH = self.k_norm(k_BsKH)
        k_BsKH = apply_rope(k_BsKH, cos_Bs1R, sin_Bs1R)

        def project_q() -> torch.Tensor:
            q_BsNH = self.wq(x_BsD).view(B, s, N, H)
            if self.q_norm is not None:
                q_BsNH = self.q_norm(q_BsNH)
            return apply_rope(q_BsNH, cos_Bs1R, sin_Bs1R)

        # k and v first: an engine that defers q moves them while q is projected
        if getattr(self.inner_attention, "defers_q", False):
            q: torch.Tensor | DeferredQ = DeferredQ(project_q, (B, s, N, H))
        else:
            q = project_q()
        o_BsNH = self.inner_attention(q, k_BsKH, v_BsKH, layout=layout)
        return self.wo(o_BsNH.reshape(B, s, N * H))


class TransformerBlock(nn.Module):
    """Pre-norm decoder block: ``h + attn(norm(h))``, then ``h + ffn(norm(h))``."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.attention = Attention(shape)
        self.ffn_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.feed_forward = FeedForward(shape.dim, shape.ffn_dim)

    def forward(
        self,
        h_BsD: torch.Tensor,
        cos_Bs1R: torch.Tensor,
        sin_Bs1R: torch.Tensor,
        layout: SeqLayout | None = None,
    ) -> torch.Tensor:
        h_BsD = h_BsD + self.attention(self.attention_norm(h_BsD), cos_Bs1R, sin_Bs1R, layout)
        return h_BsD + self.feed_forward(self.ffn_norm(h_BsD))


class Transformer(nn.Module):
    """Decoder-only language model.

    Args:
        shape: the model shape (see :mod:`dtensor_ulysses.plan.presets`).

    With ``shape.tie_embeddings`` there is no ``output`` module and the logits use
    ``tok_embeddings.weight``; under FSDP2 keep ``tok_embeddings`` in the root's parameter group
    then (do not ``fully_shard`` it on its own), so it is unsharded when the logits need it.
    """

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.shape = shape
        self.tok_embeddings = nn.Embedding(shape.vocab_size, shape.dim)
        self.layers = nn.ModuleList(TransformerBlock(shape) for _ in range(shape.n_layers))
        self.norm = RMSNorm(shape.dim, shape.norm_eps)
        self.output: OutputHead | None = (
            None if shape.tie_embeddings else OutputHead(shape.dim, shape.vocab_size)
        )
        self.loss_chunk_tokens: int | None = None

    def forward_hidden(
        self,
        input_ids_Bs: torch.Tensor,
        position_ids_Bs: torch.Tensor,
        *,
        layout: SeqLayout | None = None,
        embed_fn: EmbedFn | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``h[B, s, D]`` (for a tiled loss).

        Args:
            input_ids_Bs: ``[B, s]`` token ids of this rank's sequence slice.
            position_ids_Bs: ``[B, s]`` their positions: global, or restarting at 0 at each
                packed document (they drive RoPE only).
            layout: the step's sequence layout, passed unchanged to every attention layer:
                the sequence pieces per sp rank (uneven when sp does not divide ``S``) and,
                for packed documents, where each document starts (attention never crosses a
                start). ``None``: one piece per rank, equal, no documents.
            embed_fn: ``embed_fn(h[B, s, D]) -> h[B, s, D]`` applied to the token embeddings
                before the first block (e.g. image features merged at the image tokens of this
                slice); ``None``: the embeddings as they are.
        """
        if input_ids_Bs.shape != position_ids_Bs.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids_Bs.shape)} and position_ids "
                f"{tuple(position_ids_Bs.shape)} must have the same [B, s] shape"
            )
        h_BsD = self.tok_embeddings(input_ids_Bs)
        if embed_fn is not None:
            h_BsD = embed_fn(h_BsD)
        cos_Bs1R, sin_Bs1R = rope_cos_sin(
            position_ids_Bs, self.shape.head_dim, self.shape.rope_theta, _compute_dtype(h_BsD.dtype)
        )
        layout = with_doc_tensors(layout, input_ids_Bs.device)  # once per step, not per layer
        for layer in self.layers:
            h_BsD = layer(h_BsD, cos_Bs1R, sin_Bs1R, layout=layout)
        return self.norm(h_BsD)

    def output_weight(self) -> torch.Tensor:
        """The ``[V, D]`` output projection (the embedding matrix when tied)."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def forward(
        self,
        input_ids_Bs: torch.Tensor,
        position_ids_Bs: torch.Tensor,
        *,
        layout: SeqLayout | None = None,
        labels: torch.Tensor | None = None,
        head_fn: HeadFn | None = None,
        embed_fn: EmbedFn | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, s, V]`` for this rank's slice; with ``labels``, the loss instead.

        With ``labels[B, s]`` the forward returns the float32 *sum* of the cross entropy over
        the valid labels of this slice (:func:`~dtensor_ulysses.models.cross_entropy_sum`),
        computed inside the forward so that, under FSDP2, the output weight is the unsharded
        parameter while it is used. With ``loss_chunk_tokens`` set (tiled loss), the logits
        are made, scored and dropped ``loss_chunk_tokens`` rows at a time and recomputed in
        backward: no ``[B, s, V]`` tensor ever exists. With ``labels`` and ``head_fn``, the
        output is ``head_fn(h_BsD, weight_VD, labels_Bs)`` (e.g. per-token log-probabilities for
        a preference or RL loss), computed inside the output head's forward like the loss.
        ``embed_fn``: see :meth:`forward_hidden`.
        """
        h_BsD = self.forward_hidden(input_ids_Bs, position_ids_Bs, layout=layout, embed_fn=embed_fn)
        chunk = self.loss_chunk_tokens if labels is not None else None
        if self.output is not None:  # through the module, so its FSDP2 hooks run
            return self.output(h_BsD, labels, chunk, head_fn)
        if labels is not None and head_fn is not None:
            return head_fn(h_BsD, self.tok_embeddings.weight, labels)
        if labels is not None and chunk is not None:
            return tiled_cross_entropy_sum(h_BsD, self.tok_embeddings.weight, labels, chunk)
        logits_BsV = F.linear(h_BsD, self.tok_embeddings.weight)
        return logits_BsV if labels is None else cross_entropy_sum(logits_BsV, labels)


# ----------------------------------------------------------------------------------------------
# construction, initialization, FLOPs
# ----------------------------------------------------------------------------------------------
def _resolve(shape: ModelShape | str) -> ModelShape:
    if isinstance(shape, str):
        return get_shape(shape)
    if not isinstance(shape, ModelShape):
        raise TypeError(
            f"shape must be a ModelShape or a preset name ({', '.join(PRESETS)}), "
            f"got {type(shape).__name__}"
        )
    return shape


def build_model(shape: ModelShape | str, *, device: str | torch.device = "meta") -> Transformer:
    """Build a :class:`Transformer`.

    On ``meta`` (the default) nothing is allocated: parallelize, then ``to_empty`` and
    :func:`~dtensor_ulysses.models.init_weights`. On any other device the model is materialized
    there and initialized with ``init_weights(model, seed=0)``.

    Args:
        shape: a ``ModelShape`` or a preset name.
        device: where parameters live.

    Raises:
        ValueError: unknown preset name (the message lists the presets).
    """
    # weights.py handles DTensor shards: imported here, so that importing the model never
    # imports torch.distributed (the layering test follows every module-level import)
    from dtensor_ulysses.models.weights import init_weights

    shape = _resolve(shape)
    with torch.device("meta"):
        model = Transformer(shape)
    device = torch.device(device)
    if device.type != "meta":
        model.to_empty(device=device)
        init_weights(model, seed=0)
    return model


def set_tiling(
    model: Transformer,
    *,
    loss_chunk_tokens: int | None = None,
    mlp_chunk_tokens: int | None = None,
) -> Transformer:
    """Turn the tiled loss and the tiled MLP on (a chunk size) or off (``None``), in place.

    Both are exact: the same values and gradients, computed a chunk of tokens at a time.

    Raises:
        ValueError: a chunk size below 1.
    """
    for name, value in (
        ("loss_chunk_tokens", loss_chunk_tokens),
        ("mlp_chunk_tokens", mlp_chunk_tokens),
    ):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{name}={value!r} must be a positive number of tokens (or None: off)")
    model.loss_chunk_tokens = loss_chunk_tokens
    for block in model.layers:
        block.feed_forward.chunk_tokens = mlp_chunk_tokens  # type: ignore[union-attr]
    return model


def model_flops_per_token(shape: ModelShape | str, seq_len: int) -> float:
    """Training FLOPs per token of the built-in model, for MFU
    (:func:`dtensor_ulysses.plan.training_flops_per_token`'s convention).

    Args:
        shape: a ``ModelShape`` or a preset name.
        seq_len: tokens per sequence ``S``.
    """
    shape = _resolve(shape)
    D, L, V = shape.dim, shape.n_layers, shape.vocab_size
    N, K, H = shape.n_heads, shape.n_kv_heads, shape.head_dim
    per_layer = D * H * (N + 2 * K) + N * H * D + 3 * D * shape.ffn_dim
    return training_flops_per_token(
        n_matmul=L * per_layer + V * D, n_layers=L, n_heads=N, head_dim=H, seq_len=seq_len
    )
