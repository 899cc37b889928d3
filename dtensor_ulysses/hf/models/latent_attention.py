"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash, Kimi) under Ulysses.

Legend (``X_sp``: dim X split over the ``sp`` ranks; a rank's local names carry their shape):

    B batch, S sequence, s this rank's slice of it, P the sp degree, e bytes per element
    N heads (n: this rank's), dn / dr the nope / rope parts of a q or k head (dqk = dn + dr),
    dv the value head dim, r the kv latent rank (kv_lora_rank), L = r + dr the latent per token

What a latent attention layer computes (transformers' ``*Attention.forward`` and its
``expand_kv``): per token, ``q[N, dqk]`` and a latent ``c = [kv_nope (r, normed), k_rot (dr,
RoPE'd)]``; ``kv_b_proj`` expands ``kv_nope`` to ``k_nope[N, dn]`` and ``v[N, dv]`` per head,
``k = [k_nope, k_rot]`` (``k_rot`` shared by the heads). Then softmax attention, whose q/k head
dim ``dqk`` differs from v's ``dv``: the Ulysses engine takes that as it is (only SDPA runs two
head dims natively; the other kernels get the shorter side zero-padded, exactly).

Two ways to run it under Ulysses, chosen per layer by the bytes they move:

* **heads** (the plain exchange): expand on the slice, then the engine's fused all-to-all of q,
  k, v (``B*s*N*(2*dqk + dv)*e`` passed in per rank) and the output's all-to-all back
  (``B*S*n*dv*e``), ``(P-1)/P`` of each on the wire; backward the same two reversed.
* **latent**: q goes to heads alone; the latent ``c[B, s, L]`` is all-gathered
  (:func:`~dtensor_ulysses.comm.all_gather_seq`) and each rank expands it to its own ``n``
  heads over the whole sequence with its rows of ``kv_b_proj`` (the same flops as the plain
  path: ``S * n = s * N`` token-heads), attends, and o comes back. Per rank and layer forward
  ``B*m*L*e`` gathered (``m = ceil(S/P)``; ``(P-1)`` times that received), ``B*s*N*dqk*e`` (q)
  and ``B*S*n*dv*e`` (o) by all-to-all; backward the two all-to-alls reversed and one
  reduce-scatter of the latent's gradient (``P*B*m*L*e`` passed in, ``(P-1)/P`` of it on the
  wire).

Wire bytes per token: the heads path pays ``(P-1)/P * N*(dqk + dv)`` for k and v, the latent
path ``(P-1) * L`` for the gathered latent (q and o cost both the same), so the latent wins
iff ``P * L < N * (dqk + dv)``: DeepSeek-V3 (N=128, dqk=192, dv=128, L=576) gathers the latent
up to sp=71, moving ``P*576`` instead of ``40960`` elements per token (71x fewer at sp=1,
~9x at sp=8). :func:`latent_exchange` is that rule; :func:`latent_bytes` the closed form
each path moves (the tests check it against the collectives that ran).

Ring attention would pass the latent around the ring (``L`` per token and step instead of
``N*(dqk + dv)``) and expand every visiting block to all ``N`` heads (``kv_b_proj`` on every
block: ``P`` times the expansion flops), and the latent's gradient back around the ring.

The latent path replaces two methods on the layer instance (the class and its code are
untouched): ``forward`` (reads the step's layout, then runs the class's own forward) and
``expand_kv`` (the gather and this rank's expansion); the attention call then hands the engine
full-length k, v of this rank's heads (``kv_exchanged``). A ``kv_b_proj`` that is not a plain
``nn.Linear`` (a PEFT adapter) keeps the heads path, whose expansion runs the module itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtensor_ulysses.comm.allgather import all_gather_seq, all_gather_seq_bytes
from dtensor_ulysses.plan.splits import SeqLayout, head_split

__all__ = [
    "LatentShape",
    "is_latent_attention",
    "latent_bytes",
    "latent_exchange",
    "route_latent_attention",
    "take_exchanged_kv",
]

_ROUTE = "_du_mla_route"  # the layer's _Route (latent path)
_LAYOUT = "_du_mla_layout"  # the step's layout during the layer's forward
_KV = "_du_mla_kv"  # the (k, v) its expand_kv returned, for the attention call
_ATTRS = ("expand_kv", "kv_b_proj", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
          "v_head_dim", "num_heads")  # fmt: skip


def is_latent_attention(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers multi-head latent attention layer (an ``expand_kv``
    of the latent through ``kv_b_proj``: DeepSeek-V2/V3, GLM-4.7-Flash, Kimi, LongCat)."""
    return all(hasattr(module, a) for a in _ATTRS)


@dataclass(frozen=True)
class LatentShape:
    """A latent attention layer's dims (see the module legend)."""

    heads: int
    nope: int
    rope: int
    v: int
    rank: int

    @classmethod
    def of(cls, m: nn.Module) -> LatentShape:
        return cls(int(m.num_heads), int(m.qk_nope_head_dim), int(m.qk_rope_head_dim),  # type: ignore[arg-type]
                   int(m.v_head_dim), int(m.kv_lora_rank))  # type: ignore[arg-type]  # fmt: skip

    @property
    def latent(self) -> int:
        """``L = r + dr``: the elements per token the latent path gathers."""
        return self.rank + self.rope


def latent_exchange(shape: LatentShape, sp: int) -> str:
    """``"latent"`` when gathering the latent moves fewer bytes over the wire than exchanging
    the expanded k and v heads (``sp * L < N * (dqk + dv)``), else ``"heads"``."""
    dqk = shape.nope + shape.rope
    return "latent" if sp > 1 and sp * shape.latent < shape.heads * (dqk + shape.v) else "heads"


def latent_bytes(
    shape: LatentShape, B: int, seq_sizes: Sequence[int], rank: int, elem_bytes: int, how: str
) -> dict[str, list[tuple[str, int]]]:
    """The collectives one latent attention layer runs on sp rank ``rank``, with the bytes it
    passes into each: ``{"forward": [(kind, bytes), ...], "backward": [...]}`` (forward in the
    order they run; backward's order is autograd's).

    Args:
        how: ``"heads"`` or ``"latent"`` (:func:`latent_exchange`).
    """
    P, s = len(seq_sizes), seq_sizes[rank]
    N, dqk, dv, e = shape.heads, shape.nope + shape.rope, shape.v, elem_bytes
    n = head_split(N, P)[rank]
    S = sum(seq_sizes)
    # forward: a slice of all heads goes out, the full length of this rank's heads comes
    # back; backward: the adjoints the other way round
    o_fwd, o_bwd = B * S * n * dv * e, B * s * N * dv * e
    if how == "heads":
        return {"forward": [("all_to_all", B * s * N * (2 * dqk + dv) * e), ("all_to_all", o_fwd)],
                "backward": [("all_to_all", o_bwd),
                             ("all_to_all", B * S * n * (2 * dqk + dv) * e)]}  # fmt: skip
    if how != "latent":
        raise ValueError(f"how={how!r}: 'heads' or 'latent'")
    gather, scatter = all_gather_seq_bytes(B, seq_sizes, shape.latent, e)
    return {"forward": [("all_gather", gather), ("all_to_all", B * s * N * dqk * e),
                        ("all_to_all", o_fwd)],
            "backward": [("all_to_all", o_bwd), ("all_to_all", B * S * n * dqk * e),
                         ("reduce_scatter", scatter)]}  # fmt: skip


@dataclass(frozen=True)
class _Route:
    group: dist.ProcessGroup
    heads: tuple[int, int]  # this rank's heads [lo, hi)


def route_latent_attention(
    modules: Sequence[tuple[str, nn.Module]], group: dist.ProcessGroup
) -> dict[str, str]:
    """Put each latent attention layer of ``modules`` on the path that moves fewer bytes.

    Returns:
        ``{name: "latent" | "heads"}``. Calling again re-decides (the old routing removed).
    """
    P, me = dist.get_world_size(group), dist.get_rank(group)
    chosen = {}
    for name, m in modules:
        for attr in ("forward", "expand_kv"):  # back to the class's own methods
            m.__dict__.pop(attr, None)
        m.__dict__.pop(_ROUTE, None)
        shape = LatentShape.of(m)
        how = latent_exchange(shape, P)
        if type(m.kv_b_proj) is not nn.Linear:
            how = "heads"  # a wrapped expansion (PEFT) must run as the module itself
        chosen[name] = how
        if how == "latent":
            sizes = head_split(shape.heads, P)
            lo = sum(sizes[:me])
            m.__dict__[_ROUTE] = _Route(group, (lo, lo + sizes[me]))
            m.forward = _forward.__get__(m, type(m))
            m.expand_kv = _expand_kv.__get__(m, type(m))
    return chosen


def take_exchanged_kv(module: nn.Module, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``key, value`` (``[B, n, S, .]``) are what the latent path of ``module`` just
    expanded: this rank's heads over the whole sequence (forgotten once asked)."""
    kv = module.__dict__.pop(_KV, None)
    return kv is not None and kv[0] is key and kv[1] is value


def _forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """The class's forward, with the step's layout at hand for :func:`_expand_kv`."""
    self.__dict__[_LAYOUT] = kwargs.get("ulysses_layout")
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        self.__dict__.pop(_LAYOUT, None)


def _expand_kv(self: Any, kv_nope_B1sR: torch.Tensor, k_rot_B1sD: torch.Tensor):
    """The latent of this rank's slice gathered over the sequence, expanded to this rank's
    heads: ``k[B, n, S, dqk]``, ``v[B, n, S, dv]`` (the class's ``expand_kv``, its heads only)."""
    route: _Route = self.__dict__[_ROUTE]
    layout: SeqLayout | None = self.__dict__.get(_LAYOUT)
    if type(self.kv_b_proj) is not nn.Linear:  # wrapped after routing (PEFT): the heads path
        return type(self).expand_kv(self, kv_nope_B1sR, k_rot_B1sD)
    if layout is None:
        raise RuntimeError(
            f"{type(self).__name__}: the latent path needs the step's ulysses_layout (call the "
            f"model that apply_ulysses prepared)"
        )
    B, _, s, R = kv_nope_B1sR.shape
    c_BsL = torch.cat([kv_nope_B1sR[:, 0], k_rot_B1sD[:, 0]], dim=-1)
    c_BSL = all_gather_seq(c_BsL, route.group, layout.seq_sizes)
    kv_nope_BSR, k_rot_BSD = c_BSL.split([R, c_BSL.shape[-1] - R], dim=-1)
    lo, hi = route.heads
    dn, dv, N = self.qk_nope_head_dim, self.v_head_dim, self.num_heads
    w_nER = self.kv_b_proj.weight.view(N, dn + dv, R)[lo:hi]  # this rank's heads' rows
    bias = self.kv_b_proj.bias
    b_nE = None if bias is None else bias.view(N, dn + dv)[lo:hi].reshape(-1)
    S, n = c_BSL.shape[1], hi - lo
    kv_BSnE = F.linear(kv_nope_BSR, w_nER.reshape(-1, R), b_nE).view(B, S, n, dn + dv)
    k_nope_BSnH, v_BSnH = kv_BSnE.split([dn, dv], dim=-1)
    k_rot_BSnD = k_rot_BSD[:, :, None].expand(B, S, n, k_rot_BSD.shape[-1])
    k_BnSH = torch.cat([k_nope_BSnH, k_rot_BSnD], dim=-1).transpose(1, 2)
    v_BnSH = v_BSnH.transpose(1, 2)
    self.__dict__[_KV] = (k_BnSH, v_BnSH)
    return k_BnSH, v_BnSH
