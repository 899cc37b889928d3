"""Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo hybrid) through the Ulysses
exchange.

Legend (``X_sp``: dim X split over the ``sp`` ranks; a rank's local names carry their shape):

    B batch, S sequence, s this rank's slice of it, D hidden
    K linear key heads, V value heads (r = V / K value heads per key head), k / v: this rank's
    dk key head dim, dv value head dim, C conv channels (q, k, v: 2*K*dk + V*dv), W = kernel width
    q_BsKH: a rank's sequence slice of all key heads; q_BSkH: the full sequence of its key heads

Why it is exact: a Gated DeltaNet layer mixes tokens only in two places, the short causal
convolution (depthwise: one filter per channel, and every channel belongs to one key or value
head) and the gated delta rule (a recurrence per value head over the whole sequence, reading the
key head its value head belongs to). Everything else is per token: the projections, the gates
and the gated RMSNorm. So, as for attention, the layer runs on full-length, head-sharded tensors
between two all-to-alls:

    x[B, s, D] --in_proj--> q, k[B, s, K, dk], v[B, s, K, r*dv], b, a[B, s, K, r]
               --one all-to-all (sp)--> q, k[B, S, k, dk], v[B, S, k*r, dv], b, a[B, S, k*r]
               --causal conv (this rank's channels of the depthwise weight), SiLU
               --gated delta rule (A_log, dt_bias of its value heads)--> o[B, S, k*r, dv]
               --one all-to-all (sp)--> o[B, s, V, dv] --gated RMSNorm(o, z)--> out_proj

Key heads are split over the ranks (:func:`~dtensor_ulysses.plan.head_split`: contiguous, even,
or ``ceil``/``floor`` with ``allow_uneven_heads``), and each rank receives the value heads of its
key heads (value head ``j`` belongs to key head ``j // r``, the kernel's ``repeat_interleave``).
The gate ``z`` never travels: the gated norm is per token and head, so it runs on the sequence
slice after the exchange back (the same values; ``V*dv`` fewer elements per token each way).
Packed documents: the convolution and the recurrence restart at every document of the step's
:class:`~dtensor_ulysses.plan.SeqLayout` (each document run through the model's own kernels on
its own: zero conv padding, zero initial state), so no state crosses a boundary.

Bytes per layer and rank (``e`` bytes per element; a rank's bytes are the buffer it passes in):
forward ``B*s*(2*K*dk + V*dv + 2*V)*e`` in and ``B*S*(k*r*dv)*e`` out; backward the same two the
other way round (``B*S*k*(2*dk + r*dv + 2*r)*e`` and ``B*s*V*dv*e``): :func:`gdn_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtensor_ulysses.attention.ulysses import to_heads, to_seq
from dtensor_ulysses.hf.models.mixers._route import (
    MixerRoute,
    SequenceMixerError,
    check_call,
    install,
    model_kernels,
    per_document,
    split_heads,
)
from dtensor_ulysses.plan.splits import head_split

__all__ = [
    "LinearAttentionError",
    "gdn_bytes",
    "is_gated_deltanet",
    "route_gated_deltanet",
]

# the model file's kernels the layer calls (transformers binds a native kernel when installed)
_CONV_FN, _RULE_FN = "causal_conv1d_fn", "torch_chunk_gated_delta_rule"


# the name this module's refusals had before every routed mixer shared one error (the same class)
LinearAttentionError = SequenceMixerError


def is_gated_deltanet(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers Gated DeltaNet mixer this module can route: Qwen3.5
    / Qwen3.5-MoE (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), Qwen3-Next
    (``in_proj_qkvz``, ``in_proj_ba``, interleaved per key head) or OLMo hybrid (one projection
    each: ``q_proj`` .. ``g_proj``, ``o_norm``, ``o_proj``, ``allow_neg_eigval``)."""
    if not type(module).__name__.endswith("GatedDeltaNet"):
        return False
    common = ("conv1d", "A_log", "dt_bias", "num_k_heads", "num_v_heads")
    if not all(hasattr(module, a) for a in common):
        return False
    if type(module).__name__ == "OlmoHybridGatedDeltaNet":
        olmo = ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_norm", "o_proj",
                "allow_neg_eigval")  # fmt: skip
        return all(hasattr(module, a) for a in olmo)
    if not (hasattr(module, "norm") and hasattr(module, "out_proj")):
        return False
    qwen35 = all(hasattr(module, a) for a in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
    qwen3_next = all(hasattr(module, a) for a in ("in_proj_qkvz", "in_proj_ba"))
    return qwen35 or qwen3_next


def gdn_bytes(
    B: int,
    seq_sizes: Sequence[int],
    rank: int,
    *,
    key_heads: int,
    value_heads: int,
    key_dim: int,
    value_dim: int,
    elem_bytes: int,
) -> dict[str, list[int]]:
    """Closed-form all-to-all bytes of one Gated DeltaNet layer on sp rank ``rank``.

    Returns:
        ``{"forward": [in, out], "backward": [out_grad, in_grad]}``, each a send-buffer size
        in bytes, in the order the collectives run.
    """
    P, S, s = len(seq_sizes), sum(seq_sizes), seq_sizes[rank]
    r = value_heads // key_heads
    k = head_split(key_heads, P)[rank]
    width = 2 * key_dim + r * value_dim + 2 * r  # q, k, v, b, a of one key head
    fwd_in = B * s * key_heads * width * elem_bytes
    fwd_out = B * S * k * r * value_dim * elem_bytes
    return {
        "forward": [fwd_in, fwd_out],
        "backward": [B * s * value_heads * value_dim * elem_bytes, B * S * k * width * elem_bytes],
    }


def route_gated_deltanet(
    modules: Sequence[tuple[str, nn.Module]],
    group: dist.ProcessGroup,
    on_call: Callable[[nn.Module], None],
    *,
    allow_uneven_heads: bool = False,
) -> None:
    """Route each Gated DeltaNet layer of ``modules`` through the Ulysses exchange.

    Replaces the layer's ``forward`` on the instance (the model's class and code are untouched);
    calling it again replaces the previous routing. The layer then takes this rank's slice
    ``hidden_states[B, s, D]`` and the step's ``ulysses_layout`` (as ``apply_ulysses``'s
    pre-hook passes it) and returns this rank's slice of the single-device output.

    Args:
        modules: ``(name, layer)`` pairs (:func:`is_gated_deltanet` true for each).
        group: the sp process group.
        on_call: called with the layer on each routed call (the first-forward guard).
        allow_uneven_heads: accept key heads not divisible by sp (ranks then hold ``ceil`` or
            ``floor(K / sp)`` key heads).

    Raises:
        SequenceMixerError: sp and the key heads do not fit (the message names the valid sp),
            or the value heads are not a multiple of the key heads.
    """
    sp = dist.get_world_size(group)
    for name, m in modules:
        K, V = int(m.num_k_heads), int(m.num_v_heads)  # type: ignore[arg-type]
        if V % K:
            raise SequenceMixerError(
                f"{name} ({type(m).__name__}): {V} value heads are not a multiple of its {K} "
                f"key heads, so value heads cannot follow their key heads over the sp ranks"
            )
        what = "linear-attention key heads"
        sizes = split_heads(name, m, K, sp, what=what, allow_uneven=allow_uneven_heads)
        install(m, MixerRoute(group, sizes, on_call), _routed_forward)


def _routed_forward(
    self: Any,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The Gated DeltaNet layer on this rank's slice ``x[B, s, D]`` -> ``y[B, s, D]``."""
    route, layout, _, me = check_call(self, hidden_states, cache, attention_mask, kwargs)
    B, s, _ = hidden_states.shape
    seq_sizes = list(layout.seq_sizes)
    K, V, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
    r = V // K

    # per token: the projections of all heads, grouped by key head
    q_BsKH, k_BsKH, v_BsKR, z_BsVH, b_BsKr, a_BsKr = _project(self, hidden_states)
    # [B, S_sp, K, .] -> [B, S, K_sp, .]: q, k, v, b, a in one all-to-all
    sizes = list(route.heads)
    q_BSkH, k_BSkH, v_BSkR, b_BSkr, a_BSkr = to_heads(
        [q_BsKH, k_BsKH, v_BsKR, b_BsKr, a_BsKr], route.group, seq_sizes, [sizes] * 5
    )
    S, kh = sum(seq_sizes), sizes[me]
    k0 = sum(sizes[:me])
    v_BSvH = v_BSkR.reshape(B, S, kh * r, dv)
    b_BSv, a_BSv = b_BSkr.reshape(B, S, kh * r), a_BSkr.reshape(B, S, kh * r)
    # this rank's channels of the depthwise conv: its q, k and v heads, in the model's order
    w_CW = self.conv1d.weight.squeeze(1)
    kd = K * dk
    chans = [(k0 * dk, (k0 + kh) * dk), (kd + k0 * dk, kd + (k0 + kh) * dk),
             (2 * kd + k0 * r * dv, 2 * kd + (k0 + kh) * r * dv)]  # fmt: skip
    w_cW = torch.cat([w_CW[lo:hi] for lo, hi in chans])
    bias = self.conv1d.bias
    bias_c = None if bias is None else torch.cat([bias[lo:hi] for lo, hi in chans])
    heads = slice(k0 * r, (k0 + kh) * r)
    mix = _Mixer(self, w_cW, bias_c, self.A_log[heads], self.dt_bias[heads])
    # packed documents: conv and recurrence restart at each one (zero state)
    o_BSvH = per_document(mix, [q_BSkH, k_BSkH, v_BSvH, b_BSv, a_BSv], layout)
    # [B, S, K_sp, r*dv] -> [B, S_sp, K, r*dv]
    o_BsKR = to_seq(o_BSvH.reshape(B, S, kh, r * dv), route.group, seq_sizes, sizes)
    # the gated RMSNorm per token and value head, on the slice (z never travels)
    olmo = hasattr(self, "o_proj")  # OLMo hybrid's names
    norm, out_proj = (self.o_norm, self.o_proj) if olmo else (self.norm, self.out_proj)
    o_NH = norm(o_BsKR.reshape(-1, dv), z_BsVH.reshape(-1, dv))
    route.on_call(self)
    return out_proj(o_NH.reshape(B, s, V * dv))


def _project(m: Any, x_BsD: torch.Tensor):
    """The layer's projections of this rank's tokens, grouped by key head: ``q, k[B, s, K, dk]``,
    ``v[B, s, K, r*dv]``, ``z[B, s, V, dv]``, ``b, a[B, s, K, r]`` (views where possible)."""
    B, s, _ = x_BsD.shape
    K, V, dk, dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    r = V // K
    if hasattr(m, "g_proj"):  # OLMo hybrid: one projection each, heads in order
        return (m.q_proj(x_BsD).view(B, s, K, dk), m.k_proj(x_BsD).view(B, s, K, dk),
                m.v_proj(x_BsD).view(B, s, K, r * dv), m.g_proj(x_BsD).view(B, s, V, dv),
                m.b_proj(x_BsD).view(B, s, K, r), m.a_proj(x_BsD).view(B, s, K, r))  # fmt: skip
    if hasattr(m, "in_proj_qkvz"):  # Qwen3-Next: interleaved per key head [q k v z], [b a]
        qkvz = m.in_proj_qkvz(x_BsD).view(B, s, K, 2 * dk + 2 * r * dv)
        ba = m.in_proj_ba(x_BsD).view(B, s, K, 2 * r)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = ba.split([r, r], dim=-1)
        return q, k, v, z.reshape(B, s, V, dv), b, a
    # Qwen3.5: [all q | all k | all v] in one projection, z, b, a in their own
    q, k, v = m.in_proj_qkv(x_BsD).split([K * dk, K * dk, V * dv], dim=-1)
    z = m.in_proj_z(x_BsD).view(B, s, V, dv)
    b = m.in_proj_b(x_BsD).view(B, s, K, r)
    a = m.in_proj_a(x_BsD).view(B, s, K, r)
    return q.view(B, s, K, dk), k.view(B, s, K, dk), v.view(B, s, K, r * dv), z, b, a


class _Mixer:
    """The layer's token mixing on full-length local heads, with the model's own kernels:
    ``q, k[B, L, k, dk], v[B, L, v, dv], b, a[B, L, v] -> o[B, L, v, dv]`` (``v = k * r``)."""

    def __init__(self, m: Any, w_cW, bias_c, A_log_v, dt_bias_v) -> None:
        self.m, self.w_cW, self.bias_c = m, w_cW, bias_c
        self.A_log_v, self.dt_bias_v = A_log_v, dt_bias_v
        self.conv, self.rule = model_kernels(m, _CONV_FN, _RULE_FN)

    def __call__(self, q_BLkH, k_BLkH, v_BLvH, b_BLv, a_BLv) -> torch.Tensor:
        B, L, kh, dk = q_BLkH.shape
        nv, dv = v_BLvH.shape[2:]
        mixed_BLC = torch.cat(
            [q_BLkH.reshape(B, L, kh * dk), k_BLkH.reshape(B, L, kh * dk),
             v_BLvH.reshape(B, L, nv * dv)], dim=-1,
        )  # fmt: skip
        mixed_BCL = self.conv(
            mixed_BLC.transpose(1, 2), self.w_cW, self.bias_c, activation=self.m.activation
        )
        q, k, v = mixed_BCL.transpose(1, 2).split([kh * dk, kh * dk, nv * dv], dim=-1)
        beta_BLv = b_BLv.sigmoid()
        if getattr(self.m, "allow_neg_eigval", False):  # OLMo hybrid: beta in [0, 2]
            beta_BLv = beta_BLv * 2.0
        # as the model: in fp32, so that A cannot become -inf in half precision
        g_BLv = -self.A_log_v.float().exp() * F.softplus(a_BLv.float() + self.dt_bias_v)
        o_BLvH, _ = self.rule(
            q.reshape(B, L, kh, dk), k.reshape(B, L, kh, dk), v.reshape(B, L, nv, dv),
            g=g_BLv, beta=beta_BLv, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        return o_BLvH
