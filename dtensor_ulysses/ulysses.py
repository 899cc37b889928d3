"""Ulysses sequence parallelism: sequence-sharded <-> head-sharded, and attention in between.

Legend (scaling-book notation; ``X_sp`` means "dim X split over the ``sp`` mesh axis"):

    B batch, S sequence, N q heads, K kv heads, H head dim, P = sp degree
    q[B, S_sp, N, H] -> q[B, S, N_sp, H]     DTensor: Shard(1) -> Shard(2) on the sp axis
    o[B, S, N_sp, H] -> o[B, S_sp, N, H]     DTensor: Shard(2) -> Shard(1) on the sp axis

Tensor names carry their local shape: ``q_BsNH`` is a rank's sequence slice (``s = S / P``),
``q_BSnH`` its head slice (``n = N / P``), ``k_BSmH`` the kv heads a rank holds after the exchange.

Uneven layouts: when ``P`` does not divide ``S`` (DTensor's uneven ``Shard(1)``) or ``N``
(:func:`head_split`), the all-to-alls carry uneven pieces (``all_to_all_single`` with split
sizes); nothing is padded, no token is dropped, and results stay exact.

Packed documents: with ``position_ids`` (restarting at 0 per document) every rank all-gathers the
small ``[B, S]`` ids after the exchange and the kernel keeps attention inside each document.

GQA/MQA (``K < N``): when ``P`` divides ``K`` the kv heads are sharded like q heads. When it does
not (e.g. ``P > K``), each rank is sent the kv heads its own q heads use, which replicates a kv head
on several ranks; the replication is an ``index_select`` before the all-to-all, so gradients of the
copies are summed back into the original head by autograd.

Communication per call (``e`` bytes per element; a rank's bytes are the buffer it passes in):
forward one fused all-to-all of ``B*s*(N + 2*K')*H*e`` (q, k, v; ``K'`` the kv heads summed
over the ranks they are sent to, after replication) and one of ``B*s*N*H*e`` (o); backward the
same two again; with ``position_ids`` one all-gather of ``B*ceil(S/P)*8`` bytes in forward.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from dtensor_ulysses._all_to_all import all_to_all
from dtensor_ulysses.attention import local_attention
from dtensor_ulysses.plan import (
    HeadPlan,
    contiguous_stride,
    divisors,
    head_plan,
    head_split,
    kv_head_index,
    seq_split,
)

__all__ = [
    "SP_AXIS",
    "HeadPlan",
    "UlyssesAttention",
    "head_plan",
    "head_split",
    "head_to_seq",
    "kv_head_index",
    "seq_split",
    "seq_to_head",
    "ulysses_attention",
]

SP_AXIS = "sp"
SEQ_DIM, HEAD_DIM = 1, 2


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------
def _divisors(n: int) -> str:
    return "{" + ", ".join(map(str, divisors(n))) + "}"


def _sp_axis(mesh: DeviceMesh) -> int:
    names = mesh.mesh_dim_names or ()
    if SP_AXIS not in names:
        raise ValueError(
            f"the device mesh has axes {names or '(unnamed)'} but no {SP_AXIS!r} axis; build it "
            f"with du.init_mesh(dp, sp) or init_device_mesh(..., mesh_dim_names=('dp', 'sp'))"
        )
    return names.index(SP_AXIS)


def _check_dtensor(x: object, name: str) -> DTensor:
    if not isinstance(x, DTensor):
        raise TypeError(
            f"{name} must be a DTensor, got {type(x).__name__}; wrap a local shard with "
            f"DTensor.from_local(t, mesh, placements), or use du.UlyssesAttention for local tensors"
        )
    if x.dim() != 4:
        raise ValueError(f"{name} must be 4-D [B, S, N, H], got shape {tuple(x.shape)}")
    return x


def _fmt(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    return "Replicate()" if isinstance(p, Replicate) else repr(p)


def _check_placements(x: DTensor, name: str, sp_axis: int, sp_dim: int) -> None:
    """The sp axis must shard ``sp_dim``; other axes may only replicate or shard the batch."""
    for axis, p in enumerate(x.placements):
        axis_name = x.device_mesh.mesh_dim_names[axis]
        if axis == sp_axis:
            if not (isinstance(p, Shard) and p.dim % 4 == sp_dim):
                want = "sequence" if sp_dim == SEQ_DIM else "head"
                raise ValueError(
                    f"{name} has placement {_fmt(p)} on the {SP_AXIS!r} axis; expected "
                    f"Shard({sp_dim}) ({want}-sharded [B, S, N, H]); redistribute or build it "
                    f"with Shard({sp_dim})"
                )
        elif not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim % 4 == 0)):
            raise ValueError(
                f"{name} has placement {_fmt(p)} on mesh axis {axis_name!r}; only Shard(0) "
                f"(batch) or Replicate() are supported outside the {SP_AXIS!r} axis"
            )


def _check_divisible(what: str, n: int, P: int, fix: str) -> None:
    if n % P:
        raise ValueError(f"{n} {what} not divisible by sp={P}; {fix}")


@functools.cache
def _warn_imbalance(n_q: int, sp: int) -> None:
    plan_q = head_split(n_q, sp)
    warnings.warn(
        f"{n_q} q heads on sp={sp}: ranks attend with {max(plan_q)} or {min(plan_q)} heads, "
        f"an attention load imbalance of {max(plan_q) * sp / n_q:.2f}x (max/mean); "
        f"sp in {_divisors(n_q)} balances it",
        stacklevel=3,
    )


# ----------------------------------------------------------------------------------------------
# the algorithm on local tensors (shared by the DTensor API and the nn.Module)
# ----------------------------------------------------------------------------------------------
AttnFn = Callable[..., torch.Tensor]


def _gather_positions(pos_Bs: torch.Tensor, seq_sizes: list[int], group) -> torch.Tensor:
    """``pos[B, S_sp] -> pos[B, S]`` on every sp rank: one all-gather of the int64 ids only."""
    P = len(seq_sizes)
    chunk = max(seq_sizes)
    padded = pos_Bs.new_full((pos_Bs.shape[0], chunk), -1)
    padded[:, : pos_Bs.shape[1]] = pos_Bs
    pieces = [torch.empty_like(padded) for _ in range(P)]
    dist.all_gather(pieces, padded.contiguous(), group=group)
    return torch.cat([p[:, :n] for p, n in zip(pieces, seq_sizes)], dim=1)


def _ulysses_local(
    q_BsNH: torch.Tensor,
    k_BsKH: torch.Tensor,
    v_BsKH: torch.Tensor,
    group: dist.ProcessGroup,
    attn_fn: AttnFn,
    *,
    seq_sizes: list[int] | None = None,
    position_ids_Bs: torch.Tensor | None = None,
    fuse_qkv: bool = True,
    **attn_kwargs,
) -> torch.Tensor:
    P = dist.get_world_size(group)
    N, K = q_BsNH.shape[HEAD_DIM], k_BsKH.shape[HEAD_DIM]
    plan = head_plan(N, K, P)
    if plan.imbalance > 1:
        _warn_imbalance(N, P)
    seq_sizes = seq_sizes or [q_BsNH.shape[SEQ_DIM]] * P
    if not plan.is_plain_shard:  # GQA with sp not dividing K: replicate kv heads where needed
        idx = torch.tensor([h for heads in plan.kv_index for h in heads], device=k_BsKH.device)
        k_BsKH, v_BsKH = k_BsKH.index_select(HEAD_DIM, idx), v_BsKH.index_select(HEAD_DIM, idx)
    q_sizes, kv_sizes = list(plan.q_heads), plan.kv_heads
    # q[B, S_sp, N, H] -> q[B, S, N_sp, H]   (Shard(1) -> Shard(2) on sp), same for k and v
    exchange = dict(scatter_dim=HEAD_DIM, gather_dim=SEQ_DIM, group=group, gather_sizes=seq_sizes)
    if fuse_qkv:
        q_BSnH, k_BSmH, v_BSmH = all_to_all(
            [q_BsNH, k_BsKH, v_BsKH], scatter_sizes=[q_sizes, kv_sizes, kv_sizes], **exchange
        )
    else:
        q_BSnH, k_BSmH, v_BSmH = (
            all_to_all(t, scatter_sizes=sizes, **exchange)
            for t, sizes in ((q_BsNH, q_sizes), (k_BsKH, kv_sizes), (v_BsKH, kv_sizes))
        )
    if position_ids_Bs is not None:
        attn_kwargs["position_ids"] = _gather_positions(position_ids_Bs, seq_sizes, group)
    o_BSnH = attn_fn(q_BSnH, k_BSmH, v_BSmH, **attn_kwargs)
    # o[B, S, N_sp, H] -> o[B, S_sp, N, H]   (Shard(2) -> Shard(1) on sp)
    return all_to_all(
        o_BSnH,
        scatter_dim=SEQ_DIM,
        gather_dim=HEAD_DIM,
        group=group,
        scatter_sizes=seq_sizes,
        gather_sizes=q_sizes,
    )


def _rewrap(x: DTensor, local: torch.Tensor, sp_axis: int, sp_dim: int) -> DTensor:
    placements: list[Placement] = list(x.placements)
    placements[sp_axis] = Shard(sp_dim)
    return DTensor.from_local(
        local,
        x.device_mesh,
        placements,
        run_check=False,
        shape=x.shape,
        stride=contiguous_stride(x.shape),
    )


# ----------------------------------------------------------------------------------------------
# public API on DTensors
# ----------------------------------------------------------------------------------------------
def _swap(x: DTensor, name: str, from_dim: int, to_dim: int) -> DTensor:
    x = _check_dtensor(x, name)
    sp_axis = _sp_axis(x.device_mesh)
    _check_placements(x, name, sp_axis, from_dim)
    P = x.device_mesh.size(sp_axis)
    B, S, N, H = x.shape
    _check_divisible("heads are", N, P, f"choose sp in {_divisors(N)}")
    _check_divisible(
        "tokens (sequence length) are", S, P, f"pad the sequence to a multiple of {P} tokens"
    )
    group = x.device_mesh.get_group(sp_axis)
    local = all_to_all(x.to_local(), scatter_dim=to_dim, gather_dim=from_dim, group=group)
    return _rewrap(x, local, sp_axis, to_dim)


def seq_to_head(x: DTensor) -> DTensor:
    """``x[B, S_sp, N, H] -> x[B, S, N_sp, H]``: on the ``sp`` axis, ``Shard(1) -> Shard(2)``.

    One all-to-all on the ``sp`` group in forward and one in backward; placements on other mesh
    axes (e.g. ``Shard(0)`` on ``dp``) are kept. ``N`` and ``S`` must be divisible by sp (uneven
    layouts are handled inside :func:`ulysses_attention`, which never exposes them).

    Args:
        x: ``[B, S, N, H]`` DTensor on a mesh with an ``"sp"`` axis, ``Shard(1)`` on it.

    Raises:
        TypeError: ``x`` is not a DTensor.
        ValueError: no ``sp`` axis, wrong placements, ``N`` or ``S`` not divisible by sp.
    """
    return _swap(x, "x", SEQ_DIM, HEAD_DIM)


def head_to_seq(x: DTensor) -> DTensor:
    """``x[B, S, N_sp, H] -> x[B, S_sp, N, H]``: on the ``sp`` axis, ``Shard(2) -> Shard(1)``.

    The inverse of :func:`seq_to_head`, with the same communication and the same errors.
    """
    return _swap(x, "x", HEAD_DIM, SEQ_DIM)


def ulysses_attention(
    q: DTensor,
    k: DTensor,
    v: DTensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    position_ids: DTensor | None = None,
    allow_uneven: bool = False,
    fuse_qkv: bool = True,
) -> DTensor:
    """Attention on sequence-sharded DTensors: each rank attends over all of S for its heads.

    ``q[B, S_sp, Nq, H]``, ``k/v[B, S_sp, Nkv, H]`` -> all-to-all -> ``[B, S, heads_sp, H]`` ->
    local attention (see :mod:`dtensor_ulysses.attention`) -> all-to-all -> ``o[B, S_sp, Nq, H]``.

    Args:
        q: ``[B, S, Nq, H]`` DTensor, ``Shard(1)`` on the ``sp`` axis (``Shard(0)`` or
            ``Replicate()`` on other axes).
        k: ``[B, S, Nkv, H]`` with ``Nkv`` dividing ``Nq`` (GQA/MQA), placed like ``q``.
        v: like ``k``.
        causal: causal (lower-triangular) masking.
        softmax_scale: defaults to ``1 / sqrt(H)``.
        backend: ``"auto"``, ``"flash_attn"`` or ``"sdpa"``; an explicit one that cannot run raises.
        position_ids: packed documents: a ``[B, S]`` int64 DTensor placed like ``q`` whose values
            restart at 0 at each document start (any break in ``+1`` steps starts a document).
            Attention then never crosses a document boundary. Costs one all-gather of the ids.
        allow_uneven: accept ``S`` not divisible by sp (DTensor's uneven ``Shard(1)``, e.g.
            ``S=37`` on sp=4 is ``[10, 10, 10, 7]``): the all-to-alls carry uneven pieces, no
            token is padded or dropped and results are exact. Off by default so a length that
            does not divide is a visible choice; the trainer turns it on.
        fuse_qkv: move q, k and v in one all-to-all (same bytes, one launch instead of three).

    ``Nq`` need not divide by sp: ranks then attend with ``ceil`` or ``floor(Nq / sp)`` heads
    (a one-time warning reports the imbalance); ``sp > Nq`` is an error.

    Returns:
        ``o`` with ``q``'s shape and placements.

    Raises:
        TypeError: an input is not a DTensor.
        ValueError: mismatched meshes, placements, shapes or head dims; ``S`` not divisible by
            sp without ``allow_uneven``; ``sp > Nq``; ``Nq`` not a multiple of ``Nkv``; no
            ``sp`` mesh axis.
    """
    q, k, v = (_check_dtensor(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    mesh = q.device_mesh
    for t, n in ((k, "k"), (v, "v")):
        if t.device_mesh != mesh:
            raise ValueError(
                f"{n} is on mesh {t.device_mesh} but q is on mesh {mesh}; "
                f"put q, k and v on one mesh"
            )
    sp_axis = _sp_axis(mesh)
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        _check_placements(t, n, sp_axis, SEQ_DIM)
    if k.placements != q.placements or v.placements != q.placements:
        raise ValueError(
            f"q, k, v placements differ: "
            f"{[[_fmt(p) for p in t.placements] for t in (q, k, v)]}; "
            f"place them alike"
        )
    (B, S, N, H), (Bk, Sk, K, Hk) = q.shape, k.shape
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
    if Hk != H:
        raise ValueError(f"head dims differ: q has {H}, k/v have {Hk}; use one head dim")
    if (Bk, Sk) != (B, S):
        raise ValueError(
            f"q is [B={B}, S={S}] but k/v are [B={Bk}, S={Sk}]; self-attention needs equal B and S"
        )
    if N % K:
        raise ValueError(f"{N} q heads are not a multiple of {K} kv heads (GQA needs Nkv | Nq)")
    P = mesh.size(sp_axis)
    head_plan(N, K, P)  # validates sp <= N
    if S % P and not allow_uneven:
        raise ValueError(
            f"{S} tokens (sequence length) are not divisible by sp={P}; pad the sequence to a "
            f"multiple of {P} tokens, or pass allow_uneven=True (exact, uneven pieces)"
        )
    pos_local = None
    if position_ids is not None:
        position_ids = _check_positions(position_ids, q, sp_axis)
        pos_local = position_ids.to_local()
    o_BsNH = _ulysses_local(
        q.to_local(),
        k.to_local(),
        v.to_local(),
        mesh.get_group(sp_axis),
        local_attention,
        seq_sizes=seq_split(S, P),
        position_ids_Bs=pos_local,
        fuse_qkv=fuse_qkv,
        causal=causal,
        softmax_scale=softmax_scale,
        backend=backend,
    )
    return _rewrap(q, o_BsNH, sp_axis, SEQ_DIM)


def _check_positions(pos: object, q: DTensor, sp_axis: int) -> DTensor:
    if not isinstance(pos, DTensor):
        raise TypeError(
            f"position_ids must be a [B, S] int64 DTensor placed like q, got {type(pos).__name__}"
        )
    if tuple(pos.shape) != tuple(q.shape[:2]):
        raise ValueError(
            f"position_ids has shape {tuple(pos.shape)}; expected [B, S] = {tuple(q.shape[:2])}"
        )
    if pos.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"position_ids must be integer (int64), got {pos.dtype}")
    if pos.device_mesh != q.device_mesh or pos.placements != q.placements:
        raise ValueError(
            f"position_ids must be placed like q ({[_fmt(p) for p in q.placements]} on the same "
            f"mesh), got {[_fmt(p) for p in pos.placements]}"
        )
    return pos


class UlyssesAttention(nn.Module):
    """Wrap any local attention kernel with Ulysses, for local (non-DTensor) tensors.

    ``forward(q, k, v, **kwargs)`` takes this rank's sequence slices ``q[B, S/P, Nq, H]``,
    ``k/v[B, S/P, Nkv, H]`` (every rank of the sp group holding an equal slice, in rank order), runs
    ``attn_fn(q, k, v, **kwargs)`` on full-length, head-sharded tensors ``[B, S, heads_r, H]``, and
    returns this rank's slice ``o[B, S/P, Nq, H]``. ``heads_r`` is ``Nq / P`` when P divides Nq,
    else ``ceil`` or ``floor`` of it (see :func:`head_split`). With GQA the kernel receives fewer
    kv heads than q heads (local q head ``j`` uses local kv head ``j // (nq / nkv)``) and must
    handle that.

    Example::

        attn = du.UlyssesAttention(my_kernel, mesh)   # mesh with an "sp" axis
        o = attn(q_local, k_local, v_local, causal=True)

    Args:
        attn_fn: ``(q, k, v, **kwargs) -> o`` on ``[B, S, heads, H]`` tensors.
        mesh: a device mesh with an ``"sp"`` axis, or the sp process group itself.
        fuse_qkv: move q, k and v in one all-to-all.
    """

    def __init__(
        self, attn_fn: AttnFn, mesh: DeviceMesh | dist.ProcessGroup, *, fuse_qkv: bool = True
    ) -> None:
        super().__init__()
        if not callable(attn_fn):
            raise TypeError(f"attn_fn must be callable, got {type(attn_fn).__name__}")
        if isinstance(mesh, DeviceMesh):
            self.group = mesh.get_group(_sp_axis(mesh))
        elif isinstance(mesh, dist.ProcessGroup):
            self.group = mesh
        else:
            raise TypeError(
                f"mesh must be a DeviceMesh with an 'sp' axis or a ProcessGroup, got "
                f"{type(mesh).__name__}"
            )
        self.attn_fn = attn_fn
        self.fuse_qkv = fuse_qkv

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **attn_kwargs
    ) -> torch.Tensor:
        for t, n in ((q, "q"), (k, "k"), (v, "v")):
            if isinstance(t, DTensor):
                raise TypeError(f"{n} is a DTensor; UlyssesAttention takes local tensors")
            if t.dim() != 4:
                raise ValueError(f"{n} must be 4-D [B, S/P, N, H], got shape {tuple(t.shape)}")
        if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
            raise ValueError(
                f"q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)} must agree in "
                f"B, S and H"
            )
        N, K = q.shape[HEAD_DIM], k.shape[HEAD_DIM]
        if N % K:
            raise ValueError(f"{N} q heads are not a multiple of {K} kv heads")
        head_plan(N, K, dist.get_world_size(self.group))  # validates sp <= N
        return _ulysses_local(
            q, k, v, self.group, self.attn_fn, fuse_qkv=self.fuse_qkv, **attn_kwargs
        )
