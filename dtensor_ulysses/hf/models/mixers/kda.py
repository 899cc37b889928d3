"""Kimi Delta Attention (Kimi Linear's KDA layers) through the Ulysses exchange.

Legend (``X_sp``: dim X split over the ``sp`` ranks; a rank's local names carry their shape):

    B batch, S sequence, s this rank's slice of it, D hidden
    H heads (h: this rank's), d head dim (q, k, v and the gates alike)
    q_BsHd: a rank's sequence slice of all heads; q_BShd: the full sequence of its heads

Why it is exact: KDA is a gated delta rule with a decay per channel instead of per head. It
mixes tokens in two places only, the short causal depthwise convolution over ``[q, k, v]`` (one
filter per channel; each channel in one head) and the chunked delta rule (a recurrence per
head over the whole sequence, reading that head's q, k, v, decay ``g`` and ``beta``). The
projections, the forget gate's low-rank projection, ``beta`` and the gated RMSNorm are per
token. So, like Gated DeltaNet:

    x[B, s, D] --q, k, v, f = f_b(f_a(x)) [B, s, H, d], b [B, s, H, 1]
               --one all-to-all (sp)--> [B, S, h, .]
               --causal conv (this rank's channels), SiLU; g = -exp(A_log) * softplus(f + dt_bias)
                 (its heads' A_log and dt_bias channels, as the forget gate computes it)
               --chunked KDA--> o[B, S, h, d] --one all-to-all (sp)--> o[B, s, H, d]
               --gated RMSNorm(o, g_b(g_a(x))) on the slice--> o_proj

The forget gate's raw projection ``f`` travels in the model's dtype and the decay is computed
after the exchange (the model computes it in fp32: sending the fp32 decay would need a second
collective). The output gate never travels. Packed documents: convolution and recurrence restart
at every document of the step's layout.

Bytes per layer and rank (``e`` bytes per element): forward ``B*s*H*(4*d + 1)*e`` in and
``B*S*h*d*e`` out; backward ``B*s*H*d*e`` and ``B*S*h*(4*d + 1)*e``: :func:`kda_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtensor_ulysses.attention.ulysses import to_heads, to_seq
from dtensor_ulysses.hf.models.mixers._route import (
    MixerRoute,
    check_call,
    install,
    model_kernels,
    per_document,
    split_heads,
)
from dtensor_ulysses.plan.splits import head_split

__all__ = ["KDA_CLASSES", "is_kda", "kda_bytes", "route_kda"]

KDA_CLASSES = ("KimiLinearDeltaAttention",)
_ATTRS = ("q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "g_a_proj",
          "g_b_proj", "o_norm", "o_proj", "num_heads", "head_dim", "activation")  # fmt: skip


def is_kda(module: nn.Module) -> bool:
    """Whether ``module`` is a Kimi Delta Attention layer this module can route."""
    return type(module).__name__ in KDA_CLASSES and all(hasattr(module, a) for a in _ATTRS)


def kda_bytes(
    B: int, seq_sizes: Sequence[int], rank: int, *, heads: int, head_dim: int, elem_bytes: int
) -> dict[str, list[int]]:
    """Closed-form all-to-all bytes of one KDA layer on sp rank ``rank``.

    Returns:
        ``{"forward": [in, out], "backward": [out_grad, in_grad]}``, send-buffer bytes.
    """
    P, S, s = len(seq_sizes), sum(seq_sizes), seq_sizes[rank]
    h, d, e = head_split(heads, P)[rank], head_dim, elem_bytes
    return {
        "forward": [B * s * heads * (4 * d + 1) * e, B * S * h * d * e],
        "backward": [B * s * heads * d * e, B * S * h * (4 * d + 1) * e],
    }


def route_kda(
    modules: Sequence[tuple[str, nn.Module]],
    group: dist.ProcessGroup,
    on_call,
    *,
    allow_uneven_heads: bool = False,
) -> None:
    """Route each KDA layer of ``modules`` through the Ulysses exchange.

    Raises:
        SequenceMixerError: sp does not divide the heads (the message names the valid sp).
    """
    sp = dist.get_world_size(group)
    for name, m in modules:
        H = int(m.num_heads)  # type: ignore[arg-type]
        sizes = split_heads(name, m, H, sp, what="KDA heads", allow_uneven=allow_uneven_heads)
        install(m, MixerRoute(group, sizes, on_call), _routed_forward)


def _routed_forward(
    self: Any,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The KDA layer on this rank's slice ``x[B, s, D]`` -> ``y[B, s, D]``."""
    route, layout, _, me = check_call(self, hidden_states, cache, attention_mask, kwargs)
    x = hidden_states
    B, s, _ = x.shape
    H, d = self.num_heads, self.head_dim
    fg = self.forget_gate
    shape = (B, s, H, d)
    q, k, v = (p(x).view(shape) for p in (self.q_proj, self.k_proj, self.v_proj))
    f_BsHd = fg.f_b_proj(fg.f_a_proj(x)).view(shape)
    b_BsH1 = self.b_proj(x).view(B, s, H, 1)
    sizes, seq_sizes = list(route.heads), list(layout.seq_sizes)
    q_BShd, k_BShd, v_BShd, f_BShd, b_BSh1 = to_heads(
        [q, k, v, f_BsHd, b_BsH1], route.group, seq_sizes, [sizes] * 5
    )
    h, h0 = sizes[me], sum(sizes[:me])
    Hd = H * d
    w_CW = self.conv1d.weight.squeeze(1)
    chans = [(i * Hd + h0 * d, i * Hd + (h0 + h) * d) for i in range(3)]  # q, k, v channels
    w_cW = torch.cat([w_CW[lo:hi] for lo, hi in chans])
    bias = self.conv1d.bias
    bias_c = None if bias is None else torch.cat([bias[lo:hi] for lo, hi in chans])
    dt_bias_hd = fg.dt_bias[h0 * d : (h0 + h) * d].float().view(1, 1, h, d)
    decay_h1 = torch.exp(fg.A_log.float()[:, :, h0 : h0 + h])  # [1, 1, h, 1]
    conv, rule = model_kernels(self, "causal_conv1d_fn", "chunk_kimi_delta_attention")

    def mix(q_BLhd, k_BLhd, v_BLhd, f_BLhd, b_BLh1):
        b_, L = q_BLhd.shape[:2]
        qkv_BLc = torch.cat([t.reshape(b_, L, h * d) for t in (q_BLhd, k_BLhd, v_BLhd)], dim=-1)
        qkv_BcL = conv(qkv_BLc.transpose(1, 2), w_cW, bias_c, activation=self.activation)
        qc, kc, vc = (t.reshape(b_, L, h, d) for t in qkv_BcL.transpose(1, 2).split(h * d, -1))
        # the forget gate of these heads, as the model computes it (fp32, bounded softplus)
        g = f_BLhd.float() + dt_bias_hd
        g = -decay_h1 * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
        beta = torch.sigmoid(b_BLh1.reshape(b_, L, h))
        o, _ = rule(qc, kc, vc, g=g, beta=beta, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=True)  # fmt: skip
        return o

    o_BShd = per_document(mix, [q_BShd, k_BShd, v_BShd, f_BShd, b_BSh1], layout)
    o_BsHd = to_seq(o_BShd.to(x.dtype), route.group, seq_sizes, sizes)
    gate_BsHd = self.g_b_proj(self.g_a_proj(x)).view(shape)
    out = self.o_norm(o_BsHd, gate_BsHd).reshape(B, s, Hd)
    route.on_call(self)
    return self.o_proj(out)
