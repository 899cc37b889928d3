"""A token-wise function over row chunks, forward and backward (ALST's tiling).

``tiled(fn, x_TD, weights, chunk, extras=(...), reduce="rows" | "sum")`` computes
``fn(x[lo:hi], *weights, *(e[lo:hi] for e in extras))`` for each chunk of ``chunk`` rows of
``x[T, D]`` and either stacks the results along the rows (``"rows"``: the tiled MLP) or adds them
up (``"sum"``: the tiled loss). Forward keeps nothing but its inputs. Backward recomputes one
chunk at a time and writes that chunk's input gradient into one preallocated ``[T, D]`` tensor;
the weights' gradients are summed over the chunks in their own dtype, as autograd sums them.

Why not checkpoint each chunk of a slice of ``x``: autograd then turns the gradient of every
slice into a full-size zero-padded ``[T, D]`` tensor and adds them, so three or four ``[T, D]``
gradients exist at once: at a million tokens per rank, the largest item of the backward. That
checkpointed form stays for ``torch.compile`` (dynamo does not trace a backward that calls
``torch.autograd.grad``); it computes the same values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["tiled"]


def _chunks(rows: int, chunk: int) -> range:
    return range(0, rows, chunk)


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, chunk: int, reduce: str, n_weights: int, x_TD, *rest):
        weights, extras = rest[:n_weights], rest[n_weights:]
        out = None
        for lo in _chunks(x_TD.shape[0], chunk):
            part = fn(x_TD[lo : lo + chunk], *weights, *(e[lo : lo + chunk] for e in extras))
            if reduce == "sum":
                out = part if out is None else out + part
                continue
            if out is None:  # the rows' shape is known from the first chunk
                out = part.new_empty((x_TD.shape[0], *part.shape[1:]))
            out[lo : lo + chunk] = part
        ctx.fn, ctx.chunk, ctx.reduce, ctx.n_weights = fn, chunk, reduce, n_weights
        ctx.save_for_backward(x_TD, *rest)
        return out

    @staticmethod
    def backward(ctx, g):
        x_TD, *rest = ctx.saved_tensors
        weights, extras = rest[: ctx.n_weights], rest[ctx.n_weights :]
        leaves = [w.detach().requires_grad_() for w in weights]
        gx_TD = torch.empty_like(x_TD)
        gws = [None] * len(leaves)  # each weight's gradient, summed over the chunks
        for lo in _chunks(x_TD.shape[0], ctx.chunk):
            hi = lo + ctx.chunk
            xc = x_TD[lo:hi].detach().requires_grad_()
            with torch.enable_grad():
                yc = ctx.fn(xc, *leaves, *(e[lo:hi] for e in extras))
            gy = g if ctx.reduce == "sum" else g[lo:hi]
            gxc, *gwc = torch.autograd.grad(yc, [xc, *leaves], gy, allow_unused=True)
            gx_TD[lo:hi] = gxc
            gws = [
                acc if gc is None else gc if acc is None else acc.add_(gc)
                for acc, gc in zip(gws, gwc, strict=True)
            ]
            del xc, yc, gxc, gwc  # one chunk alive at a time
        return None, None, None, None, gx_TD, *gws, *([None] * len(extras))


def tiled(
    fn: Callable[..., torch.Tensor],
    x_TD: torch.Tensor,
    weights: Sequence[torch.Tensor],
    chunk: int,
    *,
    extras: Sequence[torch.Tensor] = (),
    reduce: str = "rows",
) -> torch.Tensor:
    """``fn`` over chunks of ``chunk`` rows of ``x[T, D]`` (see the module docstring).

    Args:
        fn: ``(x_chunk, *weights, *extra_chunks) -> rows of the output, or a scalar``; token-wise.
        x_TD: the input, rows first.
        weights: tensors every chunk uses whole (their gradients are summed over the chunks).
        chunk: rows per chunk (>= 1).
        extras: row-aligned tensors without gradient (e.g. labels), sliced like ``x``.
        reduce: ``"rows"`` (stack the chunks' rows) or ``"sum"`` (add the chunks' results).
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1 rows")
    if reduce not in ("rows", "sum"):
        raise ValueError(f"reduce={reduce!r}: use 'rows' or 'sum'")
    if not torch.compiler.is_compiling():
        return _Tiled.apply(fn, chunk, reduce, len(weights), x_TD, *weights, *extras)
    parts = []
    for lo in _chunks(x_TD.shape[0], chunk):
        args = (x_TD[lo : lo + chunk], *weights, *(e[lo : lo + chunk] for e in extras))
        grad = torch.is_grad_enabled()
        parts.append(checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args))
    return torch.stack(parts).sum(0) if reduce == "sum" else torch.cat(parts)
