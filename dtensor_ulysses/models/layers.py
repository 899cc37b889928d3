"""The model's token-wise building blocks: RMSNorm, RoPE, the SwiGLU MLP and the output head.

Attention, the block, the model and its construction are in :mod:`dtensor_ulysses.models.llama`.
Nothing here
imports ``torch.distributed``, and every module here is token-wise: under Ulysses it runs unchanged
on a rank's local sequence slice.

* :class:`RMSNorm` and its chunked autograd function (:data:`NORM_CHUNK_ELEMENTS` rows x D per
  chunk).
* :func:`rope_cos_sin` / :func:`apply_rope`: RoPE from global position ids, with a backward that
  saves nothing per tensor.
* :class:`FeedForward` (SwiGLU, optionally tiled) and :class:`OutputHead` (logits, or the loss).

Legend (tensor names carry their local shape):

    B batch              s local sequence slice (S / sp; S when sp = 1)
    D model dim          H head dim             h heads (N for q, K for kv)
    R in RMSNorm: rows (every leading dim flattened); in RoPE: H / 2 rotary frequencies
    T tokens (B * s)     F SwiGLU inner dim     V vocabulary
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_ulysses.memory.tiling import tiled
from dtensor_ulysses.models.loss import cross_entropy_sum, tiled_cross_entropy_sum

__all__ = ["FeedForward", "HeadFn", "OutputHead", "RMSNorm", "apply_rope", "rope_cos_sin"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for low-precision inputs; float64 stays float64 (for exact reference checks)."""
    return torch.promote_types(dtype, torch.float32)


# ----------------------------------------------------------------------------------------------
# building blocks
# ----------------------------------------------------------------------------------------------
NORM_CHUNK_ELEMENTS = 1 << 25
"""Elements (rows x D) of one RMSNorm chunk: its float32 temporaries are ~128 MiB each, not
``[s, D]`` float32 (7.5 GiB per tensor at ``s = 488K``, ``D = 4096``: five of them were the peak
of a million-token backward)."""


def _row_chunks(rows: int, dim: int) -> list[tuple[int, int]]:
    step = max(1, NORM_CHUNK_ELEMENTS // max(dim, 1))
    return [(i, min(i + step, rows)) for i in range(0, rows, step)]


class _RMSNormFunction(torch.autograd.Function):
    """``y = x * rsqrt(mean(x^2) + eps) * w``, computed in (at least) float32 over row chunks
    (:data:`NORM_CHUNK_ELEMENTS`), that keeps only ``x`` in its own dtype and one float32 scale
    per row for backward (a float32 copy of ``x`` would be 2-3x the bytes at bf16: the largest
    saved tensor of a block at long context). Rows are independent, so chunking changes nothing
    but the order in which the weight's gradient is summed (in float32)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = _compute_dtype(x.dtype)
        x_RD = x.reshape(-1, x.shape[-1])
        y_RD = torch.empty_like(x_RD)
        rstd_R1 = x_RD.new_empty((x_RD.shape[0], 1), dtype=dtype)
        wf = w.to(dtype)
        for a, b in _row_chunks(*x_RD.shape):
            xf = x_RD[a:b].to(dtype)
            rstd_R1[a:b] = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
            y_RD[a:b] = xf * rstd_R1[a:b] * wf
        ctx.save_for_backward(x, w, rstd_R1)
        return y_RD.view(x.shape)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x, w, rstd_R1 = ctx.saved_tensors
        dtype = rstd_R1.dtype
        x_RD = x.reshape(-1, x.shape[-1])
        gy_RD = gy.reshape(-1, x.shape[-1])
        gx_RD = torch.empty_like(x_RD)
        gw = torch.zeros(x.shape[-1], dtype=dtype, device=x.device)
        wf = w.to(dtype)
        for a, b in _row_chunks(*x_RD.shape):
            rstd = rstd_R1[a:b]
            xhat = x_RD[a:b].to(dtype) * rstd
            gyf = gy_RD[a:b].to(dtype)
            gw += (gyf * xhat).sum(0)
            g_xhat = gyf * wf
            gx_RD[a:b] = rstd * (g_xhat - xhat * (g_xhat * xhat).mean(-1, keepdim=True))
        return gx_RD.view(x.shape), gw.to(w.dtype), None


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain, computed in (at least) float32.

    Backward keeps only the input (in its own dtype) and one float32 scale per row, and
    recomputes the rest in float32.

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
        if x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm({self.dim}) got an input of shape {tuple(x.shape)}")
        return _RMSNormFunction.apply(x, self.weight, self.eps)

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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.to(cos.dtype).chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class _RoPEFunction(torch.autograd.Function):
    """The rotation, whose gradient is the inverse rotation: nothing per tensor is saved (only
    the tables, shared by every block), instead of float32 copies of q and k."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(gy, cos, -sin), None, None


def apply_rope(
    x_BshH: torch.Tensor, cos_Bs1R: torch.Tensor, sin_Bs1R: torch.Tensor
) -> torch.Tensor:
    """Rotate ``x[B, s, heads, H]`` by the RoPE angles (rotate-half convention, as in Llama/HF).

    The head dim is split into halves ``(x1, x2)``; pair ``(x1[j], x2[j])`` is rotated by angle
    ``j``. Computed in ``cos``'s dtype and cast back to ``x``'s. Backward rotates the gradient
    back by ``-angle`` and keeps nothing but the (shared) tables.
    """
    return _RoPEFunction.apply(x_BshH, cos_Bs1R, sin_Bs1R)


def _swiglu(x_TD: torch.Tensor, w1_FD: torch.Tensor, w2_DF: torch.Tensor, w3_FD: torch.Tensor):
    return F.linear(F.silu(F.linear(x_TD, w1_FD)) * F.linear(x_TD, w3_FD), w2_DF)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``, no biases.

    Attributes:
        chunk_tokens: tiled MLP (ALST): when set, the MLP runs over chunks of at most this many
            tokens, each recomputed in backward, so its ``[tokens, F]`` intermediates exist for
            one chunk at a time (forward and backward), and the input's gradient is written
            chunk by chunk into one tensor (:mod:`dtensor_ulysses.memory.tiling`). Token-wise, so
            exact.
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.chunk_tokens: int | None = None

    def _mlp(self, x_TD: torch.Tensor) -> torch.Tensor:
        return _swiglu(x_TD, self.w1.weight, self.w2.weight, self.w3.weight)

    def forward(self, x_BsD: torch.Tensor) -> torch.Tensor:
        B, s, D = x_BsD.shape
        c = self.chunk_tokens
        if c is None or B * s <= c:
            return self._mlp(x_BsD)
        ws = (self.w1.weight, self.w2.weight, self.w3.weight)
        return tiled(_swiglu, x_BsD.reshape(B * s, D), ws, c).view(B, s, D)


HeadFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(h_BsD, weight_VD, labels_Bs) -> tensor``: what the output head computes from its weight
instead of the cross-entropy sum (:meth:`OutputHead.forward`, ``Transformer.forward``)."""


class OutputHead(nn.Linear):
    """The output projection ``[V, D]`` (no bias); given labels, its forward returns the loss.

    Computing the loss in this module's forward (not from ``weight`` elsewhere) lets FSDP2 wrap
    it on its own (``du.parallelize`` does): its weight is gathered for the loss and its
    backward, and freed, with its gradient reduced, as soon as that backward is done, instead
    of staying unsharded with the root's parameters until the end of the backward.
    """

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__(dim, vocab_size, bias=False)

    def forward(
        self,
        h_BsD: torch.Tensor,
        labels: torch.Tensor | None = None,
        chunk_tokens: int | None = None,
        head_fn: HeadFn | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, s, V]``; with ``labels``, the float32 loss *sum* (tiled over
        ``chunk_tokens`` rows when given); with ``head_fn`` as well, ``head_fn(h_BsD, weight_VD,
        labels_Bs)`` instead (e.g. per-token log-probabilities, tiled), computed here so that
        FSDP2 gathers the weight for it and reduces its gradient."""
        if head_fn is not None and labels is not None:
            return head_fn(h_BsD, self.weight, labels)
        if labels is None:
            return super().forward(h_BsD)
        if chunk_tokens is not None:
            return tiled_cross_entropy_sum(h_BsD, self.weight, labels, chunk_tokens)
        return cross_entropy_sum(super().forward(h_BsD), labels)
