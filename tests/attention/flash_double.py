"""A pure-PyTorch test double of flash-attn 2's Python API, enforcing the real kernel's rules.

Written from flash-attn 2.8's ``flash_attn/flash_attn_interface.py`` (argument names, defaults,
return values) and the ``TORCH_CHECK``\\ s of ``csrc/flash_attn/flash_api.cpp`` (what the CUDA
entry point refuses); no code is taken from them. The project's flash path runs through it on CPU
when a test installs it through the seam in :mod:`dtensor_ulysses.attention`
(``DTENSOR_ULYSSES_FLASH_ATTN_MODULE=tests.attention.flash_double``, or
:func:`~dtensor_ulysses.attention.use_flash_attn_module`).

What it holds the caller to, as the real kernel does:

* q, k, v float16 or bfloat16, one dtype, one device; on CUDA compute capability 8.0 or newer;
* ``[B, S, N, H]`` (:func:`flash_attn_func`) or ``[total, N, H]`` (:func:`flash_attn_varlen_func`);
  k and v of one shape; head dim <= 256 and equal for q, k, v; ``N % K == 0`` (GQA/MQA);
* varlen: ``cu_seqlens_q``/``cu_seqlens_k`` int32, contiguous, 1-D, on q's device, of one length
  (batch + 1); in eager mode also their contents: from 0, non-decreasing, ending at the token
  count, every segment no longer than ``max_seqlen_*`` (the real kernel does not read them on the
  host: wrong contents there are silently wrong results, here an error);
* causal masking aligned to the bottom-right corner when ``Sq != Sk`` (query ``i`` sees keys
  ``j <= i + Sk - Sq``); a query row that sees no key returns zeros and ``lse = +inf``;
* ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)``: ``softmax_lse`` float32
  ``[B, N, Sq]`` (dense) or ``[N, total_q]`` (varlen); ``S_dmask`` is ``None`` without dropout
  (the real interface only asks the kernel for it when ``dropout_p > 0``).

* ``window_size=(left, right)`` (``-1``: unlimited) aligned like causal: query ``i`` sees keys
  ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``; ``causal=True`` sets ``right`` to 0;
* ``softcap > 0``: scores ``softcap * tanh(softmax_scale * q.k / softcap)``.

Only what the project uses is implemented: dropout, ALiBi and paged KV raise
``NotImplementedError``. Math in float32, results cast back to the input dtype; the
backward is the explicit flash recipe (probabilities recomputed from the saved ``lse``). Both
functions are ``torch.autograd.Function.apply`` calls with the tensors as inputs, as in the real
package, so ``torch.compile`` sees the same structure (e.g. dynamo's rule against one tensor
passed twice to ``apply``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DEVICE_TYPES", "calls", "flash_attn_func", "flash_attn_varlen_func"]

DEVICE_TYPES = ("cpu", "cuda")  # read by the seam: the real package runs on CUDA only
calls = {"dense": 0, "varlen": 0}  # how often each entry point ran (tests check the path was taken)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)  # the C++ TORCH_CHECK surfaces as a RuntimeError


def _check_common(q, k, v, dropout_p, window_size, softcap, alibi_slopes, block_table=None):
    if dropout_p != 0.0:
        raise NotImplementedError("the flash-attn double has no dropout")
    _check(len(window_size) == 2 and min(window_size) >= -1, "window_size must be (left, right)")
    _check(softcap >= 0.0, "softcap must be >= 0")
    if alibi_slopes is not None or block_table is not None:
        raise NotImplementedError("the flash-attn double has no ALiBi or paged KV")
    _check(q.dtype in (torch.float16, torch.bfloat16),
           "FlashAttention only support fp16 and bf16 data type")  # fmt: skip
    _check(k.dtype == q.dtype and v.dtype == q.dtype, "query and key must have the same dtype")
    _check(q.device == k.device == v.device, "q, k, v must be on one device")
    _check(q.device.type in DEVICE_TYPES, f"Input tensor must be on CUDA device, got {q.device}")
    if q.device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(q.device)
        _check(major >= 8, "FlashAttention only supports Ampere GPUs or newer.")
    _check(k.shape == v.shape, f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree")
    H, Hk = q.shape[-1], k.shape[-1]
    _check(H <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(Hk == H, "key head dim must equal query head dim")
    N, K = q.shape[-2], k.shape[-2]
    _check(N % K == 0, "Number of heads in key/value must divide number of heads in query")


def _scores(q, kr, scale, softcap):
    """``(s, t)``: fp32 scores and ``tanh(s0 / softcap)`` (``None`` without a softcap)."""
    s = torch.einsum("bqnh,bknh->bnqk", q.float(), kr) * scale
    if softcap > 0:
        t = torch.tanh(s / softcap)
        return t * softcap, t
    return s, None


def _attend(q, k, v, mask, scale, softcap=0.0):
    """fp32 ``o[B, Tq, N, H]``, ``lse[B, N, Tq]`` (+inf on empty rows), probabilities."""
    G = q.shape[2] // k.shape[2]
    kr, vr = (t.float().repeat_interleave(G, dim=2) for t in (k, v))
    s, _ = _scores(q, kr, scale, softcap)
    s = s.masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    p = torch.exp(s - lse[..., None])
    return torch.einsum("bnqk,bknh->bqnh", p, vr), lse, p


def _grads(q, k, v, o, do, mask, scale, lse, softcap=0.0):
    B, Tk, K, H = k.shape
    G = q.shape[2] // K
    kr, vr = (t.float().repeat_interleave(G, dim=2) for t in (k, v))
    s, t = _scores(q, kr, scale, softcap)
    s = s.masked_fill(~mask[:, None], float("-inf"))
    p = torch.exp(s - lse[..., None])
    do = do.float()
    delta = (do * o.float()).sum(-1).transpose(1, 2)  # [B, N, Tq]
    dv = torch.einsum("bnqk,bqnh->bknh", p, do)
    ds = p * (torch.einsum("bqnh,bknh->bnqk", do, vr) - delta[..., None]) * scale
    if t is not None:
        ds = ds * (1 - t * t)  # d(c * tanh(s0 / c)) / d s0
    dq = torch.einsum("bnqk,bknh->bqnh", ds, kr)
    dk = torch.einsum("bnqk,bqnh->bknh", ds, q.float())
    dk, dv = (t.view(B, Tk, K, G, H).sum(3) for t in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _window(i, j, causal: bool, window) -> torch.Tensor:
    """Visibility of key offset ``j`` to query offset ``i`` (both already bottom-right aligned):
    causal is a right window of 0."""
    left, right = window
    if causal:
        right = 0
    ok = torch.ones(torch.broadcast_shapes(i.shape, j.shape), dtype=torch.bool, device=i.device)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def _dense_mask(Sq: int, Sk: int, causal: bool, device, window=(-1, -1)) -> torch.Tensor:
    i = torch.arange(Sq, device=device)[:, None] + (Sk - Sq)  # bottom-right aligned
    j = torch.arange(Sk, device=device)[None, :]
    return _window(i, j, causal, window)[None]


def _varlen_mask(cu_q, cu_k, Tq: int, Tk: int, causal: bool, window=(-1, -1)) -> torch.Tensor:
    """``[1, Tq, Tk]``: same segment, and (causal) bottom-right aligned inside it."""
    cu_q, cu_k = cu_q.long(), cu_k.long()
    tq = torch.arange(Tq, device=cu_q.device)
    tk = torch.arange(Tk, device=cu_k.device)
    seg_q = torch.searchsorted(cu_q, tq, right=True) - 1
    seg_k = torch.searchsorted(cu_k, tk, right=True) - 1
    mask = seg_q[:, None] == seg_k[None, :]
    len_q = (cu_q[1:] - cu_q[:-1])[seg_q.clamp(0, len(cu_q) - 2)]
    len_k = (cu_k[1:] - cu_k[:-1])[seg_k.clamp(0, len(cu_k) - 2)]
    iq, ik = tq - cu_q[seg_q.clamp(0, len(cu_q) - 2)], tk - cu_k[seg_k.clamp(0, len(cu_k) - 2)]
    # offsets from each segment's end: bottom-right aligned inside the segment
    mask &= _window((iq - len_q)[:, None], (ik - len_k)[None, :], causal, window)
    return mask[None]


class _DenseFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q, k, v, scale: float, causal: bool, window, softcap: float):
        mask = _dense_mask(q.shape[1], k.shape[1], causal, q.device, window)
        o, lse, _ = _attend(q, k, v, mask, scale, softcap)
        out = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, causal, window, softcap)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, do, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        scale, causal, window, softcap = ctx.args
        mask = _dense_mask(q.shape[1], k.shape[1], causal, q.device, window)
        return (*_grads(q, k, v, out, do, mask, scale, lse, softcap), None, None, None, None)


class _VarlenFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q, k, v, cu_q, cu_k, scale: float, causal: bool, window, softcap):
        mask = _varlen_mask(cu_q, cu_k, q.shape[0], k.shape[0], causal, window)
        o, lse, _ = _attend(q[None], k[None], v[None], mask, scale, softcap)
        out = o[0].to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (scale, causal, window, softcap)
        ctx.mark_non_differentiable(lse)
        return out, lse[0]

    @staticmethod
    def backward(ctx: Any, do, _dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        scale, causal, window, softcap = ctx.args
        mask = _varlen_mask(cu_q, cu_k, q.shape[0], k.shape[0], causal, window)
        dq, dk, dv = _grads(q[None], k[None], v[None], out[None], do[None], mask, scale, lse,
                            softcap)  # fmt: skip
        return dq[0], dk[0], dv[0], None, None, None, None, None, None


def _contig(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()  # as the real interface does


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """``q[B, Sq, N, H]``, ``k/v[B, Sk, K, H]`` -> ``out[B, Sq, N, H]`` (and lse, None)."""
    _check(q.dim() == 4 and k.dim() == 4, "q, k, v must be [batch, seqlen, heads, head_dim]")
    _check(k.shape[0] == q.shape[0], "q and k must have the same batch size")
    _check_common(q, k, v, dropout_p, window_size, softcap, alibi_slopes)
    if not torch.compiler.is_compiling():  # a counter in the graph would be a guard
        calls["dense"] += 1
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    window = (int(window_size[0]), int(window_size[1]))
    out, lse = _DenseFn.apply(_contig(q), _contig(k), _contig(v), scale, causal, window,
                              float(softcap))  # fmt: skip
    return (out, lse, None) if return_attn_probs else out


def _check_cu(cu: torch.Tensor, name: str, q: torch.Tensor, total: int, max_len: int) -> None:
    _check(cu.dtype == torch.int32, f"{name} must have dtype int32, got {cu.dtype}")
    _check(cu.device == q.device, f"{name} must be on q's device {q.device}, got {cu.device}")
    _check(cu.dim() == 1 and cu.is_contiguous(), f"{name} must be a contiguous 1-D tensor")
    if torch.compiler.is_compiling():
        return  # the contents are data: checked in eager runs only
    vals = cu.tolist()
    lengths = [b - a for a, b in zip(vals, vals[1:])]
    _check(vals[0] == 0 and vals[-1] == total and min(lengths, default=0) >= 0,
           f"{name}={vals} must rise from 0 to the token count {total}")  # fmt: skip
    _check(max(lengths, default=0) <= max_len,
           f"{name} has a segment of {max(lengths)} tokens > max_seqlen {max_len}")  # fmt: skip


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """``q[total_q, N, H]``, ``k/v[total_k, K, H]`` segmented by ``cu_seqlens_*``."""
    _check(q.dim() == 3 and k.dim() == 3, "varlen q, k, v must be [total, heads, head_dim]")
    _check_common(q, k, v, dropout_p, window_size, softcap, alibi_slopes, block_table)
    _check(cu_seqlens_q.shape == cu_seqlens_k.shape, "cu_seqlens_q and _k must agree in length")
    _check_cu(cu_seqlens_q, "cu_seqlens_q", q, q.shape[0], max_seqlen_q)
    _check_cu(cu_seqlens_k, "cu_seqlens_k", q, k.shape[0], max_seqlen_k)
    if not torch.compiler.is_compiling():
        calls["varlen"] += 1
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    window = (int(window_size[0]), int(window_size[1]))
    out, lse = _VarlenFn.apply(_contig(q), _contig(k), _contig(v), cu_seqlens_q, cu_seqlens_k,
                               scale, causal, window, float(softcap))  # fmt: skip
    return (out, lse, None) if return_attn_probs else out
