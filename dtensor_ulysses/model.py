"""A Llama-style decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP) built from a ``ModelShape``.

Every module except attention is token-wise, so under Ulysses it runs unchanged on a rank's local
sequence slice; :class:`Attention` switches to :func:`~dtensor_ulysses.ulysses.ulysses_attention`
when its ``sp_mesh`` is set (``du.parallelize`` does that). Positions are always *global*: a rank
holding tokens ``[r*s, (r+1)*s)`` passes those position ids, and RoPE is computed from them on the
fly, so the model has no buffers and a model built on ``meta`` only needs :func:`init_weights`.

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

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils.checkpoint import checkpoint

from dtensor_ulysses.attention import local_attention
from dtensor_ulysses.plan import contiguous_stride
from dtensor_ulysses.presets import PRESETS, ModelShape, get_shape
from dtensor_ulysses.ulysses import ulysses_attention

__all__ = [
    "Attention",
    "FeedForward",
    "RMSNorm",
    "Transformer",
    "TransformerBlock",
    "apply_rope",
    "build_model",
    "init_weights",
    "model_flops_per_token",
    "rope_cos_sin",
]

INIT_STD = 0.02
# Prefixes that wrappers insert into parameter names; init_weights keys its seeds on the bare name.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for low-precision inputs; float64 stays float64 (for exact reference checks)."""
    return torch.promote_types(dtype, torch.float32)


# ----------------------------------------------------------------------------------------------
# building blocks
# ----------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain, computed in (at least) float32.

    Args:
        dim: size of the normalized (last) dimension.
        eps: added to the mean square before the reciprocal square root.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(x.dtype)
        y = F.rms_norm(x.to(dtype), (self.dim,), self.weight.to(dtype), self.eps)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


def rope_cos_sin(
    position_ids_Bs: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE rotation tables for the given (global) positions.

    Frequency ``j`` of ``R = H / 2`` is ``theta ** (-2j / H)``; the angle of position ``p`` is
    ``p * theta ** (-2j / H)``.

    Args:
        position_ids_Bs: ``[B, s]`` integer positions (global, not slice-relative).
        head_dim: ``H`` (even).
        theta: RoPE base.
        dtype: computation dtype of the angles (float32, or float64 for reference checks).

    Returns:
        ``(cos, sin)``, each ``[B, s, 1, R]`` in ``dtype``, broadcastable over heads.
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {head_dim}")
    device = position_ids_Bs.device
    exponent_R = torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim
    inv_freq_R = theta**-exponent_R
    angle_BsR = position_ids_Bs.to(dtype)[..., None] * inv_freq_R
    return angle_BsR.cos()[:, :, None, :], angle_BsR.sin()[:, :, None, :]


def apply_rope(
    x_BshH: torch.Tensor, cos_Bs1R: torch.Tensor, sin_Bs1R: torch.Tensor
) -> torch.Tensor:
    """Rotate ``x[B, s, heads, H]`` by the RoPE angles (rotate-half convention, as in Llama/HF).

    The head dim is split into halves ``(x1, x2)``; pair ``(x1[j], x2[j])`` is rotated by angle
    ``j``. Computed in ``cos``'s dtype and cast back to ``x``'s.
    """
    x1, x2 = x_BshH.to(cos_Bs1R.dtype).chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos_Bs1R - x2 * sin_Bs1R, x2 * cos_Bs1R + x1 * sin_Bs1R), dim=-1)
    return rotated.to(x_BshH.dtype)


class Attention(nn.Module):
    """Causal GQA self-attention with RoPE and optional per-head q/k RMSNorm (Qwen3).

    Attributes:
        sp_mesh: the 1-D ``"sp"`` submesh; when set, attention runs through Ulysses on this rank's
            contiguous sequence slice, otherwise locally on the whole sequence.
        backend: attention kernel, see :mod:`dtensor_ulysses.attention`.
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
        self.sp_mesh: DeviceMesh | None = None
        self.backend: str = "auto"

    def forward(
        self,
        x_BsD: torch.Tensor,
        cos_Bs1R: torch.Tensor,
        sin_Bs1R: torch.Tensor,
        position_ids_Bs: torch.Tensor | None = None,
        seq_len: int | None = None,
    ) -> torch.Tensor:
        """``x[B, s, D] -> y[B, s, D]``; ``cos``/``sin`` from :func:`rope_cos_sin`.

        ``position_ids_Bs`` (packed documents: attention stays inside each document) and
        ``seq_len`` (the global ``S`` when the slices are uneven) come from the Transformer.
        """
        B, s, _ = x_BsD.shape
        N, K, H = self.n_heads, self.n_kv_heads, self.head_dim
        q_BsNH = self.wq(x_BsD).view(B, s, N, H)
        k_BsKH = self.wk(x_BsD).view(B, s, K, H)
        v_BsKH = self.wv(x_BsD).view(B, s, K, H)
        if self.q_norm is not None and self.k_norm is not None:
            q_BsNH, k_BsKH = self.q_norm(q_BsNH), self.k_norm(k_BsKH)
        q_BsNH = apply_rope(q_BsNH, cos_Bs1R, sin_Bs1R)
        k_BsKH = apply_rope(k_BsKH, cos_Bs1R, sin_Bs1R)

        if self.sp_mesh is None:
            o_BsNH = local_attention(
                q_BsNH, k_BsKH, v_BsKH, causal=True, backend=self.backend,
                position_ids=position_ids_Bs,
            )  # fmt: skip
        else:
            S = seq_len if seq_len is not None else s * self.sp_mesh.size()

            def dt(t: torch.Tensor) -> DTensor:  # this rank's slice of the global [B, S, ...]
                shape = (B, S, *t.shape[2:])
                return DTensor.from_local(
                    t, self.sp_mesh, [Shard(1)], run_check=False, shape=shape,
                    stride=contiguous_stride(shape),
                )  # fmt: skip

            pos = None if position_ids_Bs is None else dt(position_ids_Bs)
            o_BsNH = ulysses_attention(
                dt(q_BsNH), dt(k_BsKH), dt(v_BsKH), causal=True, backend=self.backend,
                position_ids=pos, allow_uneven=True,
            ).to_local()  # fmt: skip
        return self.wo(o_BsNH.reshape(B, s, N * H))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``, no biases."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x_BsD: torch.Tensor) -> torch.Tensor:
        h_BsF = F.silu(self.w1(x_BsD)) * self.w3(x_BsD)
        return self.w2(h_BsF)


class TransformerBlock(nn.Module):
    """Pre-norm decoder block: ``h + attn(norm(h))``, then ``h + ffn(norm(h))``.

    Attributes:
        checkpoint: when True and grad is enabled, the block's activations are recomputed in
            backward (non-reentrant ``torch.utils.checkpoint``); parameter names do not change.
    """

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.attention = Attention(shape)
        self.ffn_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.feed_forward = FeedForward(shape.dim, shape.ffn_dim)
        self.checkpoint: bool = False

    def _forward(self, h_BsD, cos_Bs1R, sin_Bs1R, position_ids_Bs, seq_len) -> torch.Tensor:
        attn_in = self.attention_norm(h_BsD)
        h_BsD = h_BsD + self.attention(attn_in, cos_Bs1R, sin_Bs1R, position_ids_Bs, seq_len)
        return h_BsD + self.feed_forward(self.ffn_norm(h_BsD))

    def forward(
        self,
        h_BsD: torch.Tensor,
        cos_Bs1R: torch.Tensor,
        sin_Bs1R: torch.Tensor,
        position_ids_Bs: torch.Tensor | None = None,
        seq_len: int | None = None,
    ) -> torch.Tensor:
        args = (h_BsD, cos_Bs1R, sin_Bs1R, position_ids_Bs, seq_len)
        if self.checkpoint and torch.is_grad_enabled():
            return checkpoint(self._forward, *args, use_reentrant=False)
        return self._forward(*args)


class Transformer(nn.Module):
    """Decoder-only language model.

    Args:
        shape: the model shape (see :mod:`dtensor_ulysses.presets`).

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
        self.output: nn.Linear | None = (
            None if shape.tie_embeddings else nn.Linear(shape.dim, shape.vocab_size, bias=False)
        )

    def forward_hidden(
        self,
        input_ids_Bs: torch.Tensor,
        position_ids_Bs: torch.Tensor,
        *,
        seq_len: int | None = None,
        document_masking: bool = False,
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``h[B, s, D]`` (for a tiled loss).

        Args:
            input_ids_Bs: ``[B, s]`` token ids of this rank's sequence slice.
            position_ids_Bs: ``[B, s]`` their positions: global, or restarting at 0 at each
                packed document.
            seq_len: the global sequence length ``S``; needed only when the sp slices are
                uneven (``S`` not divisible by sp). Default: ``s * sp``.
            document_masking: packed documents: attention never crosses a document start
                (where the position ids restart).
        """
        if input_ids_Bs.shape != position_ids_Bs.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids_Bs.shape)} and position_ids "
                f"{tuple(position_ids_Bs.shape)} must have the same [B, s] shape"
            )
        h_BsD = self.tok_embeddings(input_ids_Bs)
        cos_Bs1R, sin_Bs1R = rope_cos_sin(
            position_ids_Bs, self.shape.head_dim, self.shape.rope_theta, _compute_dtype(h_BsD.dtype)
        )
        doc_pos = position_ids_Bs if document_masking else None
        for layer in self.layers:
            h_BsD = layer(h_BsD, cos_Bs1R, sin_Bs1R, doc_pos, seq_len)
        return self.norm(h_BsD)

    def output_weight(self) -> torch.Tensor:
        """The ``[V, D]`` output projection (the embedding matrix when tied)."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def forward(
        self,
        input_ids_Bs: torch.Tensor,
        position_ids_Bs: torch.Tensor,
        *,
        seq_len: int | None = None,
        document_masking: bool = False,
    ) -> torch.Tensor:
        """Logits ``[B, s, V]`` for this rank's slice (see :meth:`forward_hidden`)."""
        h_BsD = self.forward_hidden(
            input_ids_Bs, position_ids_Bs, seq_len=seq_len, document_masking=document_masking
        )
        if self.output is None:
            return F.linear(h_BsD, self.tok_embeddings.weight)
        return self.output(h_BsD)  # through the module, so FSDP2 hooks on it (if any) run


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
    :func:`init_weights`. On any other device the model is materialized there and initialized with
    ``init_weights(model, seed=0)``.

    Args:
        shape: a ``ModelShape`` or a preset name.
        device: where parameters live.

    Raises:
        ValueError: unknown preset name (the message lists the presets).
    """
    shape = _resolve(shape)
    with torch.device("meta"):
        model = Transformer(shape)
    device = torch.device(device)
    if device.type != "meta":
        model.to_empty(device=device)
        init_weights(model, seed=0)
    return model


def _bare_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _init_std(name: str, module: nn.Module, n_layers: int) -> float | None:
    """Std of the normal init for a parameter, or ``None`` for a norm gain (ones)."""
    if isinstance(module, RMSNorm):
        return None
    if name.endswith(("wo.weight", "w2.weight")):  # projections into the residual stream
        return INIT_STD / math.sqrt(2 * n_layers)
    return INIT_STD


def _generator(seed: int, name: str) -> torch.Generator:
    """CPU generator for one parameter: seeded with CRC-32 of ``name`` started from ``seed``.

    torch's CPU generator (mt19937) keeps only 32 bits of its seed, so ``seed`` and the name are
    combined into 32 bits; for a fixed name, distinct seeds give distinct generator seeds (CRC-32 is
    a bijection of its start value).
    """
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed} must be in [0, 2**32)")
    return torch.Generator(device="cpu").manual_seed(zlib.crc32(name.encode(), seed))


@torch.no_grad()
def init_weights(model: Transformer, seed: int = 0) -> None:
    """Deterministic weights, identical whatever the sharding.

    Each parameter's *full* value is drawn on CPU in float32 from a generator seeded by
    ``zlib.crc32(name, seed)`` (the CRC-32 of ``name`` continued from ``seed``), where ``name``
    is its ``named_parameters()`` name without wrapper prefixes; then each rank copies in its own
    part (FSDP2 ``DTensor`` parameters: the local shard, cut without communication). Linear and
    embedding weights are ``N(0, 0.02^2)``, the residual projections ``wo`` and ``w2`` use std
    ``0.02 / sqrt(2 * n_layers)``, norm gains are ones.

    Every rank draws every full value: ``O(n_params)`` CPU time, about 3 s per 1e8 parameters
    (measured on one core: ~40 s for ``llama3-1b``, ~4 min for ``llama3-8b``).

    Args:
        model: a materialized model (built on a device, or on meta then ``to_empty``), plain or
            wrapped by ``fully_shard`` / activation checkpointing.
        seed: base seed in ``[0, 2**32)``.

    Raises:
        RuntimeError: a parameter is still on ``meta``.
        ValueError: ``seed`` outside ``[0, 2**32)``.
    """
    n_layers = model.shape.n_layers
    for module_name, module in model.named_modules():
        for param_name, p in module.named_parameters(recurse=False):
            name = _bare_name(f"{module_name}.{param_name}" if module_name else param_name)
            if p.is_meta:
                raise RuntimeError(
                    f"{name} is on meta; materialize the model first, e.g. "
                    f"model.to_empty(device=...)"
                )
            std = _init_std(name, module, n_layers)
            if std is None:
                full = torch.ones(p.shape, dtype=torch.float32)
            else:
                full = torch.empty(p.shape, dtype=torch.float32)
                full.normal_(0.0, std, generator=_generator(seed, name))
            if isinstance(p, DTensor):
                # src_data_rank=None: each rank keeps its own chunk of `full`, no scatter.
                local = distribute_tensor(
                    full, p.device_mesh, p.placements, src_data_rank=None
                ).to_local()
                p.to_local().copy_(local)
            else:
                p.copy_(full)


def model_flops_per_token(shape: ModelShape | str, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward, no recomputation), for MFU.

    Convention: ``6 * N_matmul + 6 * L * N * H * S``, where ``N_matmul`` counts the weights used
    in matrix multiplies (all linears, including the output head, which for tied embeddings is the
    embedding matrix; not the embedding lookup or the norm gains), and the attention term is
    ``12 * L * N * H * S / 2``: ``QK^T`` and ``PV`` cost ``4 * N * H * S`` per token in forward,
    times 3 for training, halved because causal attention computes half of the score matrix.
    Activation recomputation is not counted (MFU, not hardware FLOPs utilization).

    Args:
        shape: a ``ModelShape`` or a preset name.
        seq_len: tokens per sequence ``S``.
    """
    shape = _resolve(shape)
    D, L, V = shape.dim, shape.n_layers, shape.vocab_size
    N, K, H = shape.n_heads, shape.n_kv_heads, shape.head_dim
    per_layer = D * H * (N + 2 * K) + N * H * D + 3 * D * shape.ffn_dim
    n_matmul = L * per_layer + V * D
    return 6.0 * n_matmul + 12.0 * L * N * H * seq_len / 2
