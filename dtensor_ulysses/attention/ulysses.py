"""The Ulysses engine: sequence-sharded q/k/v -> head-sharded -> attention -> sequence-sharded.

Legend (scaling-book notation; ``X_sp`` means "dim X split over the ``sp`` mesh axis"):

    B batch, S sequence, N q heads, K kv heads, H head dim, P = sp degree
    q[B, S_sp, N, H] -> q[B, S, N_sp, H]     DTensor: Shard(1) -> Shard(2) on the sp axis
    o[B, S, N_sp, H] -> o[B, S_sp, N, H]     DTensor: Shard(2) -> Shard(1) on the sp axis

Tensor names carry their local shape: ``q_BsNH`` is a rank's sequence slice (``s = S / P``),
``q_BSnH`` its head slice (``n = N / P``), ``k_BSmH`` the kv heads a rank holds after the exchange.

:class:`UlyssesAttention` is the one engine, on local tensors: the built-in model, the DTensor
functions of :mod:`dtensor_ulysses.attention.dtensor_api` and user code with its own kernel all
run through it. It handles

* uneven lengths: when ``P`` does not divide ``S`` (DTensor's uneven ``Shard(1)``) the
  all-to-alls carry uneven pieces (``all_to_all_single`` with split sizes); nothing is padded;
* uneven heads: ranks attend with ``ceil`` or ``floor(N / P)`` q heads (:func:`head_split`);
* GQA/MQA: when ``P`` divides ``K`` the kv heads are sharded like q heads; otherwise each rank is
  sent the kv heads its own q heads use (an ``index_select`` before the all-to-all, so autograd
  sums the gradients of the copies back into the original head);
* packed documents: from the step's :class:`~dtensor_ulysses.plan.SeqLayout` (no communication),
  or from this rank's slice of ``position_ids`` (one all-gather of the int64 ids);
* bidirectional blocks (an image's tokens): the layout's ``blocks``, full-length like the
  kernel's rows, handed over as ``block_ids=`` and ``block_spans=`` (no communication).

Communication per call (``e`` bytes per element; a rank's bytes are the buffer it passes in):
forward one fused all-to-all of ``B*s*(N + K')*H*e + B*s*K'*Hv*e`` (q, k, v; ``K'`` the kv
heads summed over the ranks they are sent to, after replication; ``Hv`` v's head dim, ``H``
unless the layer is multi-head latent attention) and one of ``B*s*N*Hv*e`` (o); backward the
same two again; with ``position_ids`` one all-gather of ``B*ceil(S/P)*8`` bytes in forward.
With ``kv_exchanged`` (k and v already full-length heads: :meth:`UlyssesAttention.exchange_kv`,
or a latent gathered and expanded by the layer) only q and o move.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dtensor_ulysses.attention._head_stages import StageExchange, run_head_stages
from dtensor_ulysses.attention.doc_tensors import build_block_ids
from dtensor_ulysses.attention.local import DeferredQ, starts_from_positions
from dtensor_ulysses.comm.alltoall import AllToAllInFlight, all_to_all
from dtensor_ulysses.plan import (
    HEAD_DIM,
    SP_AXIS,
    SeqLayout,
    divisors,
    head_plan,
    head_split,
    seq_split,
)
from dtensor_ulysses.plan.splits import SEQ_DIM, check_head_chunks

__all__ = [
    "SP_AXIS",
    "UlyssesAttention",
    "check_head_chunks",
    "gather_doc_starts",
    "sp_axis",
    "sp_group",
    "to_heads",
    "to_seq",
]

AttnFn = Callable[..., torch.Tensor]


def sp_axis(mesh: DeviceMesh) -> int:
    """Index of the ``"sp"`` axis of ``mesh``.

    Raises:
        ValueError: the mesh has no ``"sp"`` axis (the message says how to build one).
    """
    names = mesh.mesh_dim_names or ()
    if SP_AXIS not in names:
        raise ValueError(
            f"the device mesh has axes {names or '(unnamed)'} but no {SP_AXIS!r} axis; build it "
            f"with du.init_mesh(dp, sp) or init_device_mesh(..., mesh_dim_names=('dp', 'sp'))"
        )
    return names.index(SP_AXIS)


def sp_group(mesh: DeviceMesh | dist.ProcessGroup) -> dist.ProcessGroup:
    """The ``sp`` process group of a mesh (a 2-D mesh, its ``sp`` submesh) or a group as is."""
    if isinstance(mesh, dist.ProcessGroup):
        return mesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a DeviceMesh with an 'sp' axis or a ProcessGroup, got "
            f"{type(mesh).__name__}"
        )
    return mesh.get_group(sp_axis(mesh))


@functools.cache
def _warn_imbalance(n_q: int, sp: int) -> None:
    plan_q = head_split(n_q, sp)
    valid = "{" + ", ".join(map(str, divisors(n_q))) + "}"
    warnings.warn(
        f"{n_q} q heads on sp={sp}: ranks attend with {max(plan_q)} or {min(plan_q)} heads, "
        f"an attention load imbalance of {max(plan_q) * sp / n_q:.2f}x (max/mean); "
        f"sp in {valid} balances it",
        stacklevel=4,
    )


# ----------------------------------------------------------------------------------------------
# the two exchanges (also the bodies of du.seq_to_head / du.head_to_seq)
# ----------------------------------------------------------------------------------------------
def to_heads(
    xs: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    seq_sizes: Sequence[int],
    head_sizes: Sequence[Sequence[int]],
    dim_order: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """``x[B, S_sp, N, H] -> x[B, S, N_sp, H]`` for every tensor of ``xs``, in one all-to-all.

    ``seq_sizes[r]``: tokens sp rank ``r`` holds; ``head_sizes[i][r]``: heads of tensor ``i``
    that rank ``r`` receives; ``dim_order``: the memory layout the kernel wants (e.g.
    ``(0, 2, 1, 3)``: stored as ``[B, N, S, H]``), written directly by the exchange.
    """
    out = all_to_all(
        list(xs),
        scatter_dim=HEAD_DIM,
        gather_dim=SEQ_DIM,
        group=group,
        scatter_sizes=[list(h) for h in head_sizes],
        gather_sizes=list(seq_sizes),
        dim_order=dim_order,
    )
    return list(out)


def to_seq(
    x_BSnH: torch.Tensor,
    group: dist.ProcessGroup,
    seq_sizes: Sequence[int],
    head_sizes: Sequence[int],
) -> torch.Tensor:
    """``x[B, S, N_sp, H] -> x[B, S_sp, N, H]``: the inverse of :func:`to_heads`, one tensor."""
    out = all_to_all(
        x_BSnH,
        scatter_dim=SEQ_DIM,
        gather_dim=HEAD_DIM,
        group=group,
        scatter_sizes=list(seq_sizes),
        gather_sizes=list(head_sizes),
    )
    assert isinstance(out, torch.Tensor)
    return out


_KV_INDEX: dict = {}  # (HeadPlan, device) -> the flattened kv_index, on that device


def _kv_index_tensor(plan, device: torch.device) -> torch.Tensor:
    """The replication index of a head plan on ``device``: copied to it once per plan and
    device, not once per layer and call (compiled code builds it as a graph constant)."""
    flat = [h for hs in plan.kv_index for h in hs]
    if torch.compiler.is_compiling():
        return torch.tensor(flat, device=device)
    key = (plan, device)
    if key not in _KV_INDEX:
        _KV_INDEX[key] = torch.tensor(flat, device=device)
    return _KV_INDEX[key]


def _replicate_kv(plan, k_BsKH: torch.Tensor, v_BsKH: torch.Tensor):
    """GQA with sp not dividing K: each kv head copied for every rank whose q heads use it (an
    ``index_select``, so autograd sums the copies' gradients back); as they are otherwise."""
    if plan.is_plain_shard:
        return k_BsKH, v_BsKH
    idx = _kv_index_tensor(plan, k_BsKH.device)
    return k_BsKH.index_select(HEAD_DIM, idx), v_BsKH.index_select(HEAD_DIM, idx)


def gather_doc_starts(
    pos_Bs: torch.Tensor, seq_sizes: Sequence[int], group: dist.ProcessGroup
) -> list[list[int]]:
    """``pos[B, S_sp]`` on each rank -> document starts of the full ``[B, S]`` window.

    One all-gather of the int64 ids (padded to ``ceil(S/P)``), then one read back to the host.
    """
    P, chunk = len(seq_sizes), max(seq_sizes)
    padded = pos_Bs.new_full((pos_Bs.shape[0], chunk), -1)
    padded[:, : pos_Bs.shape[1]] = pos_Bs
    pieces = [torch.empty_like(padded) for _ in range(P)]
    dist.all_gather(pieces, padded.contiguous(), group=group)
    return starts_from_positions(torch.cat([p[:, :n] for p, n in zip(pieces, seq_sizes)], dim=1))


# ----------------------------------------------------------------------------------------------
# the engine
# ----------------------------------------------------------------------------------------------
class UlyssesAttention(nn.Module):
    """Ulysses around any local attention kernel, on this rank's local sequence slices.

    ``forward(q, k, v, *, layout=None, seq_len=None, position_ids=None, **kwargs)`` takes this
    rank's slices ``q[B, s, Nq, H]``, ``k/v[B, s, Nkv, H]`` (sp rank ``r`` holding the ``r``-th
    contiguous piece of the sequence), runs ``attn_fn(q, k, v, **kwargs)`` on full-length,
    head-sharded tensors ``[B, S, heads_r, H]`` and returns this rank's slice ``o[B, s, Nq, H]``.
    ``heads_r`` is ``Nq / P``, or its ``ceil``/``floor`` when P does not divide Nq. With GQA the
    kernel receives fewer kv heads than q heads (local q head ``j`` uses local kv head
    ``j // (nq / nkv)``). With packed documents the kernel also receives ``doc_starts=``: per
    batch row, the token indices where a document starts in the full sequence
    (:func:`~dtensor_ulysses.attention.local_attention` takes it).

    Example::

        attn = du.UlyssesAttention(my_kernel, mesh)   # mesh with an "sp" axis
        o = attn(q_local, k_local, v_local, causal=True)

    Args:
        attn_fn: ``(q, k, v, **kwargs) -> o`` on ``[B, S, heads, H]`` tensors (a function or an
            ``nn.Module``, e.g. :class:`~dtensor_ulysses.attention.LocalAttention`).
        mesh: a device mesh with an ``"sp"`` axis, or the sp process group itself.
        fuse_qkv: move q, k and v in one all-to-all (same bytes, one launch instead of three).
        head_chunks: run attention in this many stages (UPipe's head-chunked Ulysses): k and v
            are exchanged once; then per stage, ``heads_r / head_chunks`` q heads of every rank
            go out, attend and come back into the output. Each stage is recomputed in backward
            (its full-length tensors are never kept), so only one stage's ``[B, S, heads, H]``
            working set exists at a time, and ``d q`` is written stage by stage into one tensor
            (``_head_stages.py``). Forward and backward bytes are the closed
            form of one exchange, plus each stage's q all-to-all replayed by the recompute.
            Needs sp to divide the q heads and ``head_chunks`` to divide the heads each rank
            holds.
        overlap: hide communication behind compute (the same values, bit for bit, and
            bytes). Given q as a :class:`~dtensor_ulysses.attention.DeferredQ` (the built-in
            model does so when ``defers_q`` is true), k and v start moving before q is
            computed and travel while it is projected (DeepSpeed-Ulysses' ``sp_stream``
            overlap; q then has an all-to-all of its own: one more collective each way, the
            same bytes). With ``head_chunks > 1`` the stages' all-to-alls also run
            asynchronously, stage ``c + 1``'s moving while stage ``c`` attends. Costs the
            buffers of the exchanges in flight (memory), so it is off by default.
    """

    def __init__(
        self,
        attn_fn: AttnFn,
        mesh: DeviceMesh | dist.ProcessGroup,
        *,
        fuse_qkv: bool = True,
        head_chunks: int = 1,
        overlap: bool = False,
    ) -> None:
        super().__init__()
        if not callable(attn_fn):
            raise TypeError(f"attn_fn must be callable, got {type(attn_fn).__name__}")
        self.group = sp_group(mesh)
        self.attn_fn = attn_fn
        self._takes_doc_tensors = bool(getattr(attn_fn, "takes_doc_tensors", False))
        self.fuse_qkv = fuse_qkv
        if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1:
            raise ValueError(f"head_chunks={head_chunks!r} must be an int >= 1 (1: no chunking)")
        self.head_chunks = head_chunks
        self.overlap = bool(overlap)

    @property
    def defers_q(self) -> bool:
        """Whether a model should hand q over as a :class:`DeferredQ` (with ``overlap``)."""
        return self.overlap

    def extra_repr(self) -> str:
        return (
            f"sp={dist.get_world_size(self.group)}, fuse_qkv={self.fuse_qkv}, "
            f"head_chunks={self.head_chunks}, overlap={self.overlap}"
        )

    def _seq_sizes(self, s: int, layout: SeqLayout | None, seq_len: int | None) -> list[int]:
        P, me = dist.get_world_size(self.group), dist.get_rank(self.group)
        if layout is not None:
            sizes = list(layout.seq_sizes)
            if len(sizes) != P:
                raise ValueError(f"layout has {len(sizes)} sequence pieces for sp={P}")
        elif seq_len is not None:
            sizes = seq_split(seq_len, P)
        else:
            sizes = [s] * P
        if sizes[me] != s:
            raise ValueError(
                f"sp rank {me} holds {s} tokens, but the layout gives it {sizes[me]} of "
                f"{sizes}; pass the step's layout (or seq_len) that matches the slices"
            )
        return sizes

    def forward(
        self,
        q: torch.Tensor | DeferredQ,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        layout: SeqLayout | None = None,
        seq_len: int | None = None,
        position_ids: torch.Tensor | None = None,
        kv_exchanged: int | None = None,
        **attn_kwargs: Any,
    ) -> torch.Tensor:
        """Attention over the whole sequence for this rank's slice.

        Args:
            q: ``[B, s, Nq, H]``, this rank's sequence slice, or a :class:`DeferredQ` of it
                (computed after k and v start moving, with ``overlap``).
            k: ``[B, s, Nkv, H]`` (``Nkv`` divides ``Nq``).
            v: ``[B, s, Nkv, Hv]``: like ``k``, its head dim may differ (multi-head latent
                attention: ``Hv`` is the value head dim, ``H`` the nope + rope dims of q and k).
            layout: the step's layout (sequence pieces per rank, document starts). Default:
                equal pieces, or ``seq_len`` cut as DTensor's ``Shard(1)``.
            seq_len: the full length ``S`` when the pieces are uneven and no layout is given.
            position_ids: packed documents without a layout: this rank's ``[B, s]`` ids,
                restarting at 0 per document (costs one all-gather).
            kv_exchanged: ``Nkv``, the layer's kv heads, when ``k`` and ``v`` are already this
                rank's full-length kv heads ``[B, S, m, H]`` (what :meth:`exchange_kv` returns,
                or what a layer computed itself: the latent of multi-head latent attention
                gathered and expanded to this rank's heads): then only q and o move.
            **attn_kwargs: passed to ``attn_fn`` (e.g. ``causal``, ``backend``, ``window``,
                ``chunk``, ``softcap``: properties of the local kernel, unchanged per head),
                except ``sinks``: a ``[Nq]`` tensor of the whole layer's sink logits, of which
                ``attn_fn`` receives the slice of the q heads this rank attends with (per
                stage with ``head_chunks``); autograd carries each slice's gradient back.
        """
        for t, n in ((q, "q"), (k, "k"), (v, "v")):
            if isinstance(t, DTensor):
                raise TypeError(f"{n} is a DTensor; UlyssesAttention takes local tensors")
            if t.dim() != 4:
                raise ValueError(f"{n} must be 4-D [B, S/P, N, H], got shape {tuple(t.shape)}")
        P = dist.get_world_size(self.group)
        N = q.shape[HEAD_DIM]
        seq_sizes = self._seq_sizes(q.shape[SEQ_DIM], layout, seq_len)
        if kv_exchanged is not None:
            plan = self._check_exchanged(q, k, v, kv_exchanged, seq_sizes)
        else:
            if k.shape[:3] != v.shape[:3] or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
                raise ValueError(
                    f"q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)} must agree in "
                    f"B and S, q and k in H, k and v in heads (v's head dim may differ)"
                )
            plan = head_plan(N, k.shape[HEAD_DIM], P)  # validates Nkv | Nq and sp <= Nq
        if plan.imbalance > 1:
            _warn_imbalance(N, P)
        if position_ids is not None:
            if getattr(self.attn_fn, "global_doc_starts", False):
                raise ValueError(
                    f"{type(self.attn_fn).__name__} (ring attention) needs the documents' "
                    f"global starts over the full sequence; position_ids= only gives starts "
                    f"within this ring rank's tokens. Pass the step's layout instead "
                    f"(layout=SeqLayout.split(S, sp, doc_starts, ring=R), as data.get_batch "
                    f"builds it)"
                )
            if layout is not None and layout.doc_starts is not None:
                raise ValueError(
                    "pass the documents once: a layout with doc_starts, or position_ids"
                )
            if tuple(position_ids.shape) != tuple(q.shape[:2]):
                raise ValueError(
                    f"position_ids has shape {tuple(position_ids.shape)}; expected this rank's "
                    f"[B, s] = {tuple(q.shape[:2])}"
                )
            attn_kwargs["doc_starts"] = gather_doc_starts(position_ids, seq_sizes, self.group)
        elif layout is not None and layout.doc_tensors is not None and self._takes_doc_tensors:
            attn_kwargs["doc_tensors"] = layout.doc_tensors  # no int guards when compiled
        elif layout is not None and layout.doc_starts is not None:
            attn_kwargs["doc_starts"] = layout.doc_starts
        if layout is not None and layout.blocks is not None:  # full-length, as the kernel sees
            attn_kwargs["block_ids"] = layout.block_ids
            if layout.block_ids is None:
                attn_kwargs["block_ids"] = build_block_ids(layout.blocks, layout.seq_len, k.device)
            attn_kwargs["block_spans"] = layout.blocks

        sinks_N = attn_kwargs.pop("sinks", None)
        if sinks_N is not None and tuple(sinks_N.shape) != (N,):
            raise ValueError(
                f"sinks has shape {tuple(sinks_N.shape)}; expected [N] = ({N},), one logit per "
                f"q head of the layer (the engine gives each rank the sinks of its heads)"
            )
        order_of = getattr(self.attn_fn, "input_dim_order", None)  # the kernel's memory layout
        order = order_of(k) if callable(order_of) else None
        if isinstance(q, DeferredQ) and (P == 1 or torch.compiler.is_compiling()):
            q = q()  # nothing to overlap (one rank), or compiled (the compiler schedules)
        if self.head_chunks > 1:
            return self._chunked(q, k, v, plan, seq_sizes, attn_kwargs, order, sinks_N,
                                 kv_exchanged=kv_exchanged is not None)  # fmt: skip
        q_sizes, kv_sizes = list(plan.q_heads), plan.kv_heads
        if sinks_N is not None:  # the sinks of the q heads this rank attends with
            first = sum(q_sizes[: dist.get_rank(self.group)])
            attn_kwargs["sinks"] = sinks_N[first : first + q_sizes[dist.get_rank(self.group)]]
        # q[B, S_sp, N, H] -> q[B, S, N_sp, H]   (Shard(1) -> Shard(2) on sp), same for k and v
        if kv_exchanged is not None:  # k, v already full-length heads: only q moves
            q_BSnH = q() if isinstance(q, DeferredQ) else q
            (q_BSnH,) = to_heads([q_BSnH], self.group, seq_sizes, [q_sizes], order)
            k_BSmH, v_BSmH = k, v
        elif isinstance(q, DeferredQ):  # k and v move while q is projected
            k, v = _replicate_kv(plan, k, v)
            kv = self._start_kv(k, v, seq_sizes, kv_sizes, order)
            (q_BSnH,) = to_heads([q()], self.group, seq_sizes, [q_sizes], order)
            k_BSmH, v_BSmH = kv.wait()
        elif self.fuse_qkv:
            k, v = _replicate_kv(plan, k, v)
            q_BSnH, k_BSmH, v_BSmH = to_heads(
                [q, k, v], self.group, seq_sizes, [q_sizes, kv_sizes, kv_sizes], order
            )
        else:
            k, v = _replicate_kv(plan, k, v)
            (q_BSnH,), (k_BSmH,), (v_BSmH,) = (
                to_heads([t], self.group, seq_sizes, [sizes], order)
                for t, sizes in ((q, q_sizes), (k, kv_sizes), (v, kv_sizes))
            )
        o_BSnH = self.attn_fn(q_BSnH, k_BSmH, v_BSmH, **attn_kwargs)
        # o[B, S, N_sp, H] -> o[B, S_sp, N, H]   (Shard(2) -> Shard(1) on sp)
        return to_seq(o_BSnH, self.group, seq_sizes, q_sizes)

    def exchange_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        n_q_heads: int,
        *,
        layout: SeqLayout | None = None,
        seq_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``k[B, S_sp, K, H], v[B, S_sp, K, Hv] -> [B, S, m, H], [B, S, m, Hv]``: the kv heads
        this rank's share of ``n_q_heads`` q heads uses (replicated as the GQA plan says), in
        one all-to-all. Pass the result to ``forward(..., kv_exchanged=K)`` of any layer with
        the same heads and layout: a layer that reuses an earlier layer's keys and values
        (Gemma 4's KV sharing) then moves only q and o."""
        P = dist.get_world_size(self.group)
        plan = head_plan(n_q_heads, k.shape[HEAD_DIM], P)
        seq_sizes = self._seq_sizes(k.shape[SEQ_DIM], layout, seq_len)
        k, v = _replicate_kv(plan, k, v)
        k_BSmH, v_BSmH = to_heads([k, v], self.group, seq_sizes, [plan.kv_heads, plan.kv_heads])
        return k_BSmH, v_BSmH

    def _check_exchanged(self, q, k, v, n_kv: int, seq_sizes: list[int]):
        """The head plan of ``q``, checked against k, v already exchanged (``[B, S, m, H]``)."""
        P, me = dist.get_world_size(self.group), dist.get_rank(self.group)
        plan = head_plan(q.shape[HEAD_DIM], n_kv, P)
        want = (q.shape[0], sum(seq_sizes), plan.kv_heads[me])
        if tuple(k.shape[:3]) != want or tuple(v.shape[:3]) != want or k.shape[3] != q.shape[3]:
            raise ValueError(
                f"kv_exchanged={n_kv}: k {tuple(k.shape)} and v {tuple(v.shape)} must be sp rank "
                f"{me}'s full-length kv heads [B, S, m, .] = {want} with q's head dim "
                f"{q.shape[3]} (as exchange_kv returns them)"
            )
        return plan

    def _start_kv(self, k_BsKH, v_BsKH, seq_sizes, kv_sizes, order) -> AllToAllInFlight:
        """``k, v[B, S_sp, K, H] -> [B, S, K_sp, H]``, started (one collective)."""
        return AllToAllInFlight([k_BsKH, v_BsKH], scatter_dim=HEAD_DIM, gather_dim=SEQ_DIM,
                                group=self.group, scatter_sizes=[kv_sizes, kv_sizes],
                                gather_sizes=[seq_sizes, seq_sizes], dim_order=order)  # fmt: skip

    def _chunked(
        self,
        q_BsNH: torch.Tensor | DeferredQ,
        k_BsKH: torch.Tensor,
        v_BsKH: torch.Tensor,
        plan,
        seq_sizes: list[int],
        attn_kwargs: dict,
        order: tuple[int, ...] | None = None,
        sinks_N: torch.Tensor | None = None,
        *,
        kv_exchanged: bool = False,
    ) -> torch.Tensor:
        """Head-chunked attention: kv once, then ``C = head_chunks`` stages of q heads.

        Rank ``r`` holds q heads ``[r*n, (r+1)*n)`` (``n = N / P``); stage ``c`` moves, from
        every rank's sequence slice, the heads ``r*n + c*m .. r*n + (c+1)*m`` (``m = n / C``) of
        each destination ``r``, so rank ``r`` attends with its own heads ``c*m .. (c+1)*m`` and
        the kv heads they use, sliced from the kv it received once.
        """
        P, C = dist.get_world_size(self.group), self.head_chunks
        B, s, N, H = q_BsNH.shape
        check_head_chunks(N, P, C)
        n, m = N // P, N // P // C
        me = dist.get_rank(self.group)
        if v_BsKH.shape[3] != H:
            raise ValueError(
                f"head_chunks={C}: the value head dim {v_BsKH.shape[3]} differs from q's {H} "
                f"(multi-head latent attention); the head stages need one head dim, use "
                f"head_chunks=1"
            )
        kv_sizes = plan.kv_heads
        group_r = n // kv_sizes[me]  # local q heads per local kv head (rank me)
        if m % group_r and group_r % m:
            raise ValueError(
                f"head_chunks={C}: stages of {m} q heads cut across the GQA groups of "
                f"{group_r} q heads per kv head on sp rank {me}; choose head_chunks so that "
                f"{m} and {group_r} divide one another"
            )
        if kv_exchanged:
            q_BsNH = q_BsNH() if isinstance(q_BsNH, DeferredQ) else q_BsNH
            k_BSmH, v_BSmH = k_BsKH, v_BsKH
        elif isinstance(q_BsNH, DeferredQ):  # k and v move while q is projected
            k_BsKH, v_BsKH = _replicate_kv(plan, k_BsKH, v_BsKH)
            kv = self._start_kv(k_BsKH, v_BsKH, seq_sizes, kv_sizes, order)
            q_BsNH = q_BsNH()
            k_BSmH, v_BSmH = kv.wait()
        else:
            k_BsKH, v_BsKH = _replicate_kv(plan, k_BsKH, v_BsKH)
            k_BSmH, v_BSmH = to_heads(
                [k_BsKH, v_BsKH], self.group, seq_sizes, [kv_sizes, kv_sizes], order
            )
        ranges = []
        for c in range(C):
            lo = c * m // group_r  # the local kv heads that local q heads c*m .. (c+1)*m use
            ranges.append((lo, max(lo + 1, (c + 1) * m // group_r)))
        o_BsPCmH = run_head_stages(
            q_BsNH.view(B, s, P, C, m, H),
            k_BSmH,
            v_BSmH,
            ranges,
            exchange=StageExchange(self.group, seq_sizes, m, order, async_op=self.overlap),
            attend=functools.partial(self.attn_fn, **attn_kwargs),
            sinks_n=None if sinks_N is None else sinks_N[me * n : (me + 1) * n],
        )
        return o_BsPCmH.view(B, s, N, H)
