"""LFM2 / LFM2-MoE short convolutions under Ulysses: a halo exchange, not an all-to-all.

Legend: ``B`` batch, ``S`` sequence, ``s`` this rank's slice of it, ``D`` hidden (= the conv's
channels), ``W`` kernel width, ``k = W - 1`` the halo, ``o`` this rank's offset in the row.

Why it is exact: LFM2's short-convolution block is ``out_proj(C * conv(B * x))`` with ``B, C, x``
per-token projections and ``conv`` a causal depthwise convolution of width ``W`` (3 in the
released models). Output ``t`` reads inputs ``t - W + 1 .. t`` only, so a rank's slice needs its
own tokens and the previous rank's last ``W - 1`` gated inputs, nothing else: one point-to-point
halo (:func:`~dtensor_ulysses.comm.halo.halo_exchange`) instead of two all-to-alls, and no head
split (the channels stay whole on every rank):

    x[B, s, D] --in_proj--> b, c, x[B, s, D] --u = b*x--> halo: the previous rank's u[B, k, D]
               --conv over [halo, u] (the model's own kernel), keep the last s--> c * . --out_proj

Rank 0's halo is zeros: the convolution's own zero padding at the row start. Packed documents:
each document's piece is convolved alone from its first token (the halo is used only where the
document began on an earlier rank), as the stock model run per document does. Every rank that
sends needs at least ``k`` tokens; a shorter slice is refused with the numbers.

Bytes per layer and rank: forward ``B*k*D*e`` to the next rank (none from the last), backward
the same to the previous rank (none from rank 0): :func:`~dtensor_ulysses.comm.halo.halo_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtensor_ulysses.comm.halo import halo_exchange
from dtensor_ulysses.hf.models.mixers._route import (
    MixerRoute,
    SequenceMixerError,
    check_call,
    install,
    model_kernels,
)

__all__ = ["SHORT_CONV_CLASSES", "is_short_conv", "route_short_conv"]

SHORT_CONV_CLASSES = ("Lfm2ShortConv", "Lfm2MoeShortConv")
_ATTRS = ("in_proj", "conv", "out_proj", "conv_kernel_size")


def is_short_conv(module: nn.Module) -> bool:
    """Whether ``module`` is an LFM2 short-convolution block this module can route."""
    return type(module).__name__ in SHORT_CONV_CLASSES and all(hasattr(module, a) for a in _ATTRS)


def route_short_conv(
    modules: Sequence[tuple[str, nn.Module]], group: dist.ProcessGroup, on_call
) -> None:
    """Route each short-convolution block of ``modules`` through the halo exchange."""
    for _, m in modules:
        install(m, MixerRoute(group, (), on_call), _routed_forward)


def _routed_forward(
    self: Any,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The block on this rank's slice ``x[B, s, D]`` -> ``y[B, s, D]``."""
    route, layout, P, me = check_call(self, hidden_states, cache, attention_mask, kwargs)
    k = int(self.conv_kernel_size) - 1
    sizes = list(layout.seq_sizes)
    short = [(r, n) for r, n in enumerate(sizes[:-1]) if n < k]
    if short:
        raise SequenceMixerError(
            f"{type(self).__name__}: a kernel of width {k + 1} needs the previous rank's last "
            f"{k} tokens, but sp ranks {[r for r, _ in short]} hold {[n for _, n in short]} "
            f"of the slices {sizes}; use a smaller sp or longer sequences"
        )
    s = hidden_states.shape[1]
    b_BDs, c_BDs, x_BDs = self.in_proj(hidden_states).transpose(-1, -2).chunk(3, dim=-2)
    u_BDs = b_BDs * x_BDs
    (conv,) = model_kernels(self, "causal_conv1d_fn")
    w, bias = self.conv.weight.squeeze(1), self.conv.bias
    if k == 0:
        y_BDs = conv(u_BDs, w, bias)
    else:
        halo_BkD = halo_exchange(u_BDs.transpose(1, 2), k, route.group)
        ext_BDe = torch.cat([halo_BkD.transpose(1, 2), u_BDs], dim=-1)  # positions o-k .. o+s-1
        y_BDs = _conv_pieces(conv, ext_BDe, w, bias, layout, me, s, k)
    y_BsD = (c_BDs * y_BDs).transpose(-1, -2).contiguous()
    route.on_call(self)
    return self.out_proj(y_BsD)


def _conv_pieces(conv, ext_BDe, w, bias, layout, me: int, s: int, k: int) -> torch.Tensor:
    """The convolution's last ``s`` outputs over ``ext`` (the halo, then the slice), restarted
    at every packed document that starts in or before the slice."""
    docs = layout.doc_starts
    if docs is None or all(len(row) == 1 for row in docs):
        return conv(ext_BDe, w, bias)[..., k:]
    o = layout.offset(me)
    rows = []
    for i, starts in enumerate(docs):
        ends = [*starts[1:], layout.seq_len]
        parts = []
        for d0, d1 in zip(starts, ends):
            a, b = max(d0, o), min(d1, o + s)
            if a >= b:
                continue
            lo = max(d0, a - k)  # the document's first token, or the window's reach
            y = conv(ext_BDe[i : i + 1, :, lo - (o - k) : b - (o - k)], w, bias)
            parts.append(y[..., a - lo :])
        rows.append(torch.cat(parts, dim=-1))
    return torch.cat(rows, dim=0)
