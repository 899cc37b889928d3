"""Ring attention (exact, forward and backward) and its composition with the Ulysses engine.

Legend: ``R`` ring ranks, ``S`` the full sequence, ``L = S / R`` tokens per ring rank,
``c = S / 2R`` a zigzag chunk, ``N`` q heads, ``K`` kv heads (``N % K == 0``), ``H`` head dim,
``e`` bytes per element. Tensors are ``[B, L, heads, H]``.

* **Zigzag (head-tail) order.** The global sequence is cut into ``2R`` chunks of ``c`` tokens; ring
  rank ``r`` holds chunks ``r`` and ``2R-1-r``, in that order (:func:`ring_chunks`). Under a causal
  mask every step of every rank then does the same work: its own block (causal on the diagonal),
  ``q x`` the first half of an earlier rank's k/v, or the second half of ``q x`` a later rank's.
  ``order="contiguous"`` (rank ``r`` holds ``[rL, (r+1)L)``) is there for non-causal attention.
* **Steps.** k and v travel as one ``[2, B, L, K, H]`` buffer: at step ``i`` rank ``r`` holds the
  block of ring rank ``r - i``; it posts the batched send/recv of the next block, computes this one
  with a blockwise kernel that returns its log-sum-exp, merges it into the output, then waits.
* **Backward** is a custom ``autograd.Function`` (ring-flash-attn's scheme): it recomputes every
  block's probabilities from the final ``lse``, keeps ``dq`` locally and sends ``dk, dv``
  accumulators (``[2, B, L, K, H]`` in float32, float64 for float64 inputs) around the ring with
  k/v; one last hop brings each rank its own. Memory: one block's ``[B, N, Lq, Lk]`` scores at a
  time (kernel: ``_ring_kernel.py``; p2p: ``_p2p.py``).
* **Packed documents**: ``doc_starts`` per batch row in *global* positions ``[0, S)``; a token
  attends only inside its document (and causally). **GQA**: local q head ``j`` uses kv head
  ``j // (N/K)``. **Lengths**: ``S`` must be a multiple of ``2R`` (zigzag) or ``R``, else a
  ValueError; the sp pieces inside a ring rank may be uneven (the engine's ``seq_len=``).
* **Kernel**: a blockwise kernel in torch (float32 math, float64 for float64 inputs; any device).
  On CUDA with flash-attn importable, fp16/bf16 blocks without a document mask run forward through
  ``flash_attn_func(..., return_attn_probs=True)`` (its ``lse``); UNTESTED here (no GPU), and the
  backward stays in torch.

Communication per call, on each rank (:func:`ring_closed_form`): forward ``R-1`` sends of the
k/v block, ``B*L*2K*H*e`` each; backward ``R-1`` such sends plus ``R`` sends of the dk/dv
accumulators (``B*L*2K*H*4``); every send has a matching receive of the same size.

Ulysses x Ring (USP): ``UlyssesAttention(RingAttention(mesh), mesh)`` on a ``("dp", "ring", "sp")``
mesh: all-to-all over ``sp``, ring over ``ring``, all-to-all back. Data: the rank at
``(ring r, sp p)`` holds the global tokens :func:`zigzag_positions` ``(S, R, sp, r, p)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ulysses._ring_kernel import RingAttentionFn, RingPlan
from dtensor_ulysses.plan import seq_split

__all__ = [
    "RING_AXIS",
    "RingAttention",
    "check_ring_mesh",
    "check_ring_seq",
    "ring_attention",
    "ring_chunks",
    "ring_closed_form",
    "ring_group",
    "ring_seq_sizes",
    "zigzag_permutation",
    "zigzag_positions",
]

RING_AXIS = "ring"
ORDERS = ("zigzag", "contiguous")


# ----------------------------------------------------------------------------------------------
# torch-free: who holds which tokens, checks, closed-form bytes
# ----------------------------------------------------------------------------------------------
def check_ring_seq(S: int, ring: int, order: str = "zigzag") -> None:
    """``S`` tokens must cut into ``2 * ring`` (zigzag) or ``ring`` equal chunks.

    Raises:
        ValueError: the numbers and the nearest lengths that work.
    """
    if order not in ORDERS:
        raise ValueError(f"order={order!r}; use one of {ORDERS}")
    if ring < 1:
        raise ValueError(f"ring={ring} must be >= 1")
    parts = 2 * ring if order == "zigzag" else ring
    if parts > S or S % parts:
        lo, hi = S // parts * parts, -(-S // parts) * parts
        why = f"2 x ring = {parts} zigzag chunks" if order == "zigzag" else f"ring = {parts} blocks"
        raise ValueError(
            f"ring attention over ring={ring} needs the sequence to divide into {why}; "
            f"S={S} tokens {'is shorter than that' if parts > S else 'does not'}: use a multiple "
            f"of {parts} (e.g. {max(lo, parts)} or {hi})"
        )


def ring_chunks(S: int, ring: int, ring_rank: int, order: str = "zigzag") -> list[tuple[int, int]]:
    """Global ``[lo, hi)`` token ranges ring rank ``ring_rank`` holds, in its local order.

    Zigzag: chunks ``ring_rank`` and ``2*ring-1-ring_rank`` of ``S / (2*ring)`` tokens;
    contiguous: ``[r*S/ring, (r+1)*S/ring)``.
    """
    check_ring_seq(S, ring, order)
    if not 0 <= ring_rank < ring:
        raise ValueError(f"ring_rank={ring_rank} is not in 0..{ring - 1}")
    if order == "contiguous":
        L = S // ring
        return [(ring_rank * L, (ring_rank + 1) * L)]
    c = S // (2 * ring)
    head, tail = ring_rank, 2 * ring - 1 - ring_rank
    return [(head * c, (head + 1) * c), (tail * c, (tail + 1) * c)]


def ring_seq_sizes(S: int, ring: int, sp: int) -> list[int]:
    """Tokens of each sp rank within a ring rank's ``S / ring`` (the engine's ``seq_sizes``)."""
    check_ring_seq(S, ring, "contiguous")
    return seq_split(S // ring, sp)


def zigzag_positions(
    S: int, ring: int, sp: int, ring_rank: int, sp_rank: int, order: str = "zigzag"
) -> list[int]:
    """The global token positions the rank at ``(ring_rank, sp_rank)`` holds, in local order.

    A ring rank's tokens (:func:`ring_chunks`, concatenated) are cut over ``sp`` like DTensor's
    ``Shard(1)`` (:func:`ring_seq_sizes`); the Ulysses all-to-all gathers them back in sp order.
    The data loader slices ``tokens[:, zigzag_positions(...)]`` (and labels, position ids alike).
    """
    if not 0 <= sp_rank < sp:
        raise ValueError(f"sp_rank={sp_rank} is not in 0..{sp - 1}")
    local = [t for lo, hi in ring_chunks(S, ring, ring_rank, order) for t in range(lo, hi)]
    sizes = seq_split(len(local), sp)
    start = sum(sizes[:sp_rank])
    return local[start : start + sizes[sp_rank]]


def zigzag_permutation(S: int, ring: int, sp: int, order: str = "zigzag") -> list[int]:
    """All ranks' :func:`zigzag_positions`, ring-major then sp: ``x[:, perm]`` reorders a global
    sequence so that DTensor's ``Shard(1)`` on a ``("ring", "sp")`` mesh (ring cuts first) gives
    every rank its zigzag tokens; ``argsort(perm)`` undoes it."""
    return [
        t
        for r in range(ring)
        for p in range(sp)
        for t in zigzag_positions(S, ring, sp, r, p, order)
    ]


def check_ring_mesh(dp: int, ring: int, sp: int, world_size: int) -> None:
    """``dp * ring * sp`` must equal the world size (for ``init_mesh(dp, sp, ring=...)``)."""
    for name, n in (("dp", dp), ("ring", ring), ("sp", sp)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}={n!r} must be an int >= 1")
    if dp * ring * sp != world_size:
        raise ValueError(
            f"dp x ring x sp = {dp} x {ring} x {sp} = {dp * ring * sp}, but the world has "
            f"{world_size} ranks; choose degrees whose product is {world_size}"
        )


def ring_closed_form(
    B: int, L: int, n_kv: int, H: int, ring: int, elem_bytes: int = 4, grad_bytes: int = 4
) -> dict[str, dict[str, int]]:
    """p2p sends of one ring-attention call on one rank (receives: the same count and bytes).

    ``L`` tokens per ring rank, ``n_kv`` kv heads the kernel sees (after Ulysses: this sp rank's),
    ``grad_bytes`` the dk/dv accumulators' element size (4; 8 for float64 inputs). With
    ``kv = B*L*2*n_kv*H``: forward ``ring-1`` sends of ``kv*elem_bytes``; backward ``ring-1``
    of ``kv*elem_bytes`` and ``ring`` of ``kv*grad_bytes``. Nothing when ``ring == 1``.
    """
    if ring == 1:
        return {"forward": {"count": 0, "bytes": 0}, "backward": {"count": 0, "bytes": 0}}
    kv = B * L * 2 * n_kv * H
    return {
        "forward": {"count": ring - 1, "bytes": (ring - 1) * kv * elem_bytes},
        "backward": {
            "count": 2 * ring - 1,
            "bytes": (ring - 1) * kv * elem_bytes + ring * kv * grad_bytes,
        },
    }


# ----------------------------------------------------------------------------------------------
# the API
# ----------------------------------------------------------------------------------------------
def ring_group(mesh: DeviceMesh | dist.ProcessGroup) -> dist.ProcessGroup:
    """The ring process group of a mesh with a ``"ring"`` axis, or a group as is."""
    if isinstance(mesh, dist.ProcessGroup):
        return mesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"expected a DeviceMesh or a ProcessGroup, got {type(mesh).__name__}")
    names = mesh.mesh_dim_names or ()
    if RING_AXIS not in names:
        raise ValueError(
            f"the device mesh has axes {names or '(unnamed)'} but no {RING_AXIS!r} axis; build "
            f"it with init_device_mesh(..., mesh_dim_names=('dp', 'ring', 'sp'))"
        )
    return mesh.get_group(names.index(RING_AXIS))


def _doc_ids(doc_starts: Sequence[Sequence[int]], B: int, S: int) -> torch.Tensor:
    """``[B, S]`` document index of every global position, from per-row global starts."""
    if len(doc_starts) != B:
        raise ValueError(f"doc_starts has {len(doc_starts)} rows for a batch of {B}")
    ids = torch.zeros(B, S, dtype=torch.int64)
    for b, row in enumerate(doc_starts):
        starts = list(row)
        if not starts or starts[0] != 0 or starts != sorted(set(starts)) or starts[-1] >= S:
            raise ValueError(
                f"doc_starts row {b} is {starts}; ring attention takes global document starts: "
                f"increasing, from 0, below the full length S={S}"
            )
        ids[b, starts[1:]] = 1
    return ids.cumsum(dim=1)


def _use_flash(backend: str, q: torch.Tensor) -> bool:
    from dtensor_ulysses.attention import _flash_attn_problem

    if backend not in ("auto", "flash_attn", "torch", "sdpa"):
        raise ValueError(
            f"ring attention backend={backend!r}; use 'auto', 'flash_attn' or 'torch' ('sdpa')"
        )
    problem = _flash_attn_problem(q)
    if backend == "flash_attn" and problem is not None:
        raise RuntimeError(f"backend='flash_attn' cannot run: {problem}; use backend='torch'")
    return backend in ("auto", "flash_attn") and problem is None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: DeviceMesh | dist.ProcessGroup,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    doc_starts: Sequence[Sequence[int]] | None = None,
    order: str = "zigzag",
    backend: str = "auto",
) -> torch.Tensor:
    """Exact attention over the whole ring's sequence for this ring rank's tokens.

    Args:
        q: ``[B, L, N, H]``, this ring rank's ``L = S / R`` tokens in :func:`ring_chunks` order.
        k: ``[B, L, K, H]`` (``K`` divides ``N``).
        v: like ``k``.
        group: the ring process group, or a mesh with a ``"ring"`` axis.
        causal: causal masking in global positions.
        softmax_scale: default ``1 / sqrt(H)``.
        doc_starts: packed documents: per batch row, the *global* positions in ``[0, S)`` where
            a document starts (0 first).
        order: ``"zigzag"`` (load-balanced causal) or ``"contiguous"``.
        backend: ``"auto"`` (flash-attn forward blocks when it can run), ``"flash_attn"`` or
            ``"torch"`` (the blockwise kernel; ``"sdpa"`` is an alias, so the trainer's
            attention-backend choice carries over: SDPA itself returns no log-sum-exp).

    Raises:
        ValueError: bad shapes, ``S`` not a multiple of ``2R`` (zigzag) / ``R``, bad doc starts.
    """
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        if t.dim() != 4:
            raise ValueError(f"{n} must be 4-D [B, L, heads, H], got shape {tuple(t.shape)}")
    B, L, N, H = q.shape
    if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != H or N % k.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)} must agree in B, L "
            f"and H, with the kv heads dividing the q heads"
        )
    pg = ring_group(group)
    R = dist.get_world_size(pg)
    try:
        check_ring_seq(R * L, R, order)
    except ValueError as e:
        raise ValueError(f"{e} (each ring rank holds L={L} tokens: S = {R} x {L})") from None
    ring = RingPlan(
        group=pg,
        size=R,
        rank=dist.get_rank(pg),
        chunks=[ring_chunks(R * L, R, j, order) for j in range(R)],
        causal=causal,
        scale=softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(H),
        doc_ids=None if doc_starts is None else _doc_ids(doc_starts, B, R * L),
        flash=_use_flash(backend, q),
    )
    return RingAttentionFn.apply(q, k, v, ring)


class RingAttention(nn.Module):
    """:func:`ring_attention` as a local attention kernel (the engine's ``attn_fn`` convention).

    ``UlyssesAttention(RingAttention(mesh), mesh)`` is Ulysses x Ring: the engine's all-to-all
    over ``sp`` hands this module ``[B, S/R, heads_r, H]`` tensors, the ring runs over ``ring``,
    the engine's all-to-all takes the output back. ``doc_starts`` (or ``layout.doc_starts``) must
    be *global* positions over the full ``S``: the engine's ``position_ids=`` path yields starts
    local to a ring rank and is wrong here (``global_doc_starts`` marks that for the engine).

    Args:
        mesh: a mesh with a ``"ring"`` axis, or the ring process group.
        causal, order, softmax_scale, backend: defaults for :func:`ring_attention`; a call's
            keyword arguments override them.
    """

    global_doc_starts = True

    def __init__(
        self,
        mesh: DeviceMesh | dist.ProcessGroup,
        *,
        causal: bool = True,
        order: str = "zigzag",
        softmax_scale: float | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.group = ring_group(mesh)
        check_ring_seq(2 * dist.get_world_size(self.group), dist.get_world_size(self.group), order)
        self.causal, self.order = causal, order
        self.softmax_scale, self.backend = softmax_scale, backend

    def extra_repr(self) -> str:
        return f"ring={dist.get_world_size(self.group)}, causal={self.causal}, order={self.order!r}"

    def forward(self, q, k, v, *, layout: Any = None, doc_starts=None, **kwargs) -> torch.Tensor:
        if layout is not None and doc_starts is None:
            doc_starts = layout.doc_starts
        opts: dict[str, Any] = {
            "causal": self.causal,
            "order": self.order,
            "softmax_scale": self.softmax_scale,
            "backend": self.backend,
            **kwargs,
        }
        return ring_attention(q, k, v, self.group, doc_starts=doc_starts, **opts)
