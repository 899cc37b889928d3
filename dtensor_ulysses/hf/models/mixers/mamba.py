"""Mamba-2 mixers (Nemotron-H, Granite 4.0-H, Falcon-H1) through the Ulysses exchange.

Legend (``X_sp``: dim X split over the ``sp`` ranks; a rank's local names carry their shape):

    B batch, S sequence, s this rank's slice of it, D hidden
    N Mamba heads (h: this rank's), P head dim, G groups (g: the groups this rank's heads read),
    n state size, I = N*P the inner width; conv channels: x (I), then B and C (G*n each)
    x_BsNP: a rank's sequence slice of all heads; x_BShP: the full sequence of its heads

Why it is exact: a Mamba-2 mixer mixes tokens in two places only, the short causal depthwise
convolution over ``[x, B, C]`` (one filter per channel; each x channel belongs to one head,
each B / C channel to one group) and the selective scan (a recurrence per head over the whole
sequence, reading the B and C of its group). The projections, dt, the gated RMSNorm (per token
and group of the inner width) and the output projection are per token. So the layer runs on
full-length, head-sharded tensors between two all-to-alls, as attention does:

    x[B, s, D] --in_proj--> z[B, s, I], x[B, s, N, P], dt[B, s, N, 1], B, C[B, s, G, n]
               --one all-to-all (sp)--> x[B, S, h, P], dt[B, S, h, 1], B, C[B, S, g, n]
               --causal conv (this rank's channels of the depthwise weight), activation
               --chunked selective scan (A_log, D, dt_bias of its heads)--> y[B, S, h, P]
               --one all-to-all (sp)--> y[B, s, N, P] --gated RMSNorm(y, z)--> out_proj

Heads are split over the ranks (:func:`~dtensor_ulysses.plan.head_split`); each rank receives
the groups its heads read. Groups that sp does not divide (Granite 4.0-H and Falcon-H1 have one
group) are *replicated*: a group's B and C go to every rank with a head in it (its sender's
gradient sums what they send back), so any sp that divides the heads runs exactly, at
``2*n`` extra elements per token and extra rank of the group: small beside the ``P`` per head
of x. The gate ``z`` never travels (the norm runs on the slice after the exchange back).
Packed documents: the convolution and the scan restart at every document of the step's
:class:`~dtensor_ulysses.plan.SeqLayout` (each document through the model's own kernels alone).

Bytes per layer and rank (``e`` bytes per element; a rank's bytes are the buffer it passes in):
forward ``B*s*(N*P + N + 2*n*sum_r g_r)*e`` in and ``B*S*h*P*e`` out; backward
``B*s*N*P*e`` and ``B*S*(h*P + h + 2*n*g)*e``: :func:`mamba_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence
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

__all__ = ["MAMBA2_CLASSES", "is_mamba2", "mamba_bytes", "rank_groups", "route_mamba2"]

# the mixers whose forward this module reproduces (read line by line; another Mamba-2 class is
# refused by the routing rather than guessed at)
MAMBA2_CLASSES = ("NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer", "FalconH1Mixer")
_ATTRS = ("in_proj", "conv1d", "A_log", "D", "dt_bias", "norm", "out_proj", "num_heads",
          "head_dim", "n_groups", "ssm_state_size", "intermediate_size", "conv_dim",
          "chunk_size", "time_step_limit", "activation")  # fmt: skip
_CONV_FN, _SCAN_FN = "causal_conv1d_fn", "mamba2_chunk_scan"


def is_mamba2(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers Mamba-2 mixer this module can route."""
    return type(module).__name__ in MAMBA2_CLASSES and all(hasattr(module, a) for a in _ATTRS)


def rank_groups(heads: int, groups: int, head_sizes: Sequence[int]) -> list[range]:
    """The groups each rank's heads read (contiguous heads per rank; ``heads / groups`` heads a
    group). A group is listed for every rank that has a head in it (replicated across them)."""
    per = heads // groups
    out, h0 = [], 0
    for n in head_sizes:
        out.append(range(h0 // per, (h0 + n - 1) // per + 1) if n else range(0))
        h0 += n
    return out


def mamba_bytes(
    B: int,
    seq_sizes: Sequence[int],
    rank: int,
    *,
    heads: int,
    head_dim: int,
    groups: int,
    state: int,
    elem_bytes: int,
) -> dict[str, list[int]]:
    """Closed-form all-to-all bytes of one Mamba-2 layer on sp rank ``rank`` (even head split).

    Returns:
        ``{"forward": [in, out], "backward": [out_grad, in_grad]}``, send-buffer bytes, in the
        order the collectives run.
    """
    P, S, s = len(seq_sizes), sum(seq_sizes), seq_sizes[rank]
    sizes = head_split(heads, P)
    ranges = rank_groups(heads, groups, sizes)
    h, g = sizes[rank], len(ranges[rank])
    sent_groups = sum(len(r) for r in ranges)
    e = elem_bytes
    return {
        "forward": [B * s * (heads * head_dim + heads + 2 * state * sent_groups) * e,
                    B * S * h * head_dim * e],
        "backward": [B * s * heads * head_dim * e,
                     B * S * (h * head_dim + h + 2 * state * g) * e],
    }  # fmt: skip


def route_mamba2(
    modules: Sequence[tuple[str, nn.Module]],
    group: dist.ProcessGroup,
    on_call,
    *,
    allow_uneven_heads: bool = False,
) -> None:
    """Route each Mamba-2 mixer of ``modules`` through the Ulysses exchange (see the module).

    Raises:
        SequenceMixerError: sp does not divide the heads (the message names the valid sp), or
            the heads are not a multiple of the groups.
    """
    sp = dist.get_world_size(group)
    for name, m in modules:
        N, G = int(m.num_heads), int(m.n_groups)  # type: ignore[arg-type]
        if N % G:
            raise SequenceMixerError(
                f"{name} ({type(m).__name__}): {N} Mamba heads are not a multiple of its {G} groups"
            )
        sizes = split_heads(name, m, N, sp, what="Mamba heads", allow_uneven=allow_uneven_heads)
        install(m, MixerRoute(group, sizes, on_call), _routed_forward)


def _routed_forward(
    self: Any,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The Mamba-2 mixer on this rank's slice ``x[B, s, D]`` -> ``y[B, s, D]``."""
    route, layout, _, me = check_call(self, hidden_states, cache, attention_mask, kwargs)
    dtype = hidden_states.dtype
    B, s, _ = hidden_states.shape
    N, Pd, G, n = self.num_heads, self.head_dim, self.n_groups, self.ssm_state_size
    I, per = self.intermediate_size, self.num_heads // self.n_groups

    # per token: the projections (Falcon-H1's muP multipliers as its forward applies them)
    x_BsD = hidden_states * getattr(self, "ssm_in_multiplier", 1.0)
    proj = self.in_proj(x_BsD)
    if hasattr(self, "mup_vector"):
        proj = proj * self.mup_vector
    z_BsI, x_BsI, B_BsGn, C_BsGn, dt_BsN = proj.split([I, I, G * n, G * n, N], dim=-1)
    sizes = list(route.heads)
    ranges = rank_groups(N, G, sizes)
    B_BsGn, C_BsGn = B_BsGn.view(B, s, G, n), C_BsGn.view(B, s, G, n)
    if sum(len(r) for r in ranges) != G:  # replicated groups: each rank's, concatenated
        idx = torch.tensor([g for r in ranges for g in r], device=proj.device)
        B_BsGn, C_BsGn = B_BsGn.index_select(2, idx), C_BsGn.index_select(2, idx)
    gsizes = [len(r) for r in ranges]
    # [B, S_sp, N, .] -> [B, S, N_sp, .]: x, dt, B, C in one all-to-all
    seq_sizes = list(layout.seq_sizes)
    x_BShP, dt_BSh1, B_BSgn, C_BSgn = to_heads(
        [x_BsI.view(B, s, N, Pd), dt_BsN.view(B, s, N, 1), B_BsGn, C_BsGn],
        route.group, seq_sizes, [sizes, sizes, gsizes, gsizes],
    )  # fmt: skip
    h, h0 = sizes[me], sum(sizes[:me])
    mine = ranges[me]
    # this rank's channels of the depthwise conv: its heads' x, its groups' B and C
    w_CW = self.conv1d.weight.squeeze(1)
    chans = [(h0 * Pd, (h0 + h) * Pd), (I + mine.start * n, I + mine.stop * n),
             (I + G * n + mine.start * n, I + G * n + mine.stop * n)]  # fmt: skip
    w_cW = torch.cat([w_CW[lo:hi] for lo, hi in chans])
    bias = self.conv1d.bias
    bias_c = None if bias is None else torch.cat([bias[lo:hi] for lo, hi in chans])
    heads = slice(h0, h0 + h)
    # which of its groups each local head reads (the scan repeats groups to heads itself when
    # the local heads fill their groups evenly; otherwise B and C are given per head)
    group_of = [(h0 + j) // per - mine.start for j in range(h)]
    g = len(mine)
    even = g and h % g == 0 and group_of == [j // (h // g) for j in range(h)]
    head_idx = None if even else torch.tensor(group_of, device=proj.device)
    conv, scan = model_kernels(self, _CONV_FN, _SCAN_FN)
    A_h = -torch.exp(self.A_log[heads].float())

    def mix(x_BLhP, dt_BLh1, B_BLgn, C_BLgn):
        b, L = x_BLhP.shape[:2]
        g = B_BLgn.shape[2]
        xbc_BLc = torch.cat([x_BLhP.reshape(b, L, h * Pd), B_BLgn.reshape(b, L, g * n),
                             C_BLgn.reshape(b, L, g * n)], dim=-1)  # fmt: skip
        xbc_BcL = conv(xbc_BLc.transpose(1, 2), w_cW, bias_c, activation=self.activation)
        xs, Bc, Cc = xbc_BcL.transpose(1, 2).split([h * Pd, g * n, g * n], dim=-1)
        Bc, Cc = Bc.reshape(b, L, g, n), Cc.reshape(b, L, g, n)
        if head_idx is not None:
            Bc, Cc = Bc.index_select(2, head_idx), Cc.index_select(2, head_idx)
        y = scan(
            xs.reshape(b, L, h, Pd), dt_BLh1.reshape(b, L, h), A_h, Bc, Cc,
            chunk_size=self.chunk_size, D=self.D[heads], dt_bias=self.dt_bias[heads],
            dt_softplus=True, dt_limit=self.time_step_limit,
        )  # fmt: skip
        return y.reshape(b, L, h, Pd)

    y_BShP = per_document(mix, [x_BShP, dt_BSh1, B_BSgn, C_BSgn], layout)
    # [B, S, N_sp, P] -> [B, S_sp, N, P]
    y_BsI = to_seq(y_BShP, route.group, seq_sizes, sizes).reshape(B, s, I)
    gated = isinstance(self.norm, nn.Identity)  # Falcon-H1 without mamba_rms_norm
    y_BsI = y_BsI * F.silu(z_BsI) if gated else self.norm(y_BsI, z_BsI)
    route.on_call(self)
    return self.out_proj(y_BsI.to(dtype))
