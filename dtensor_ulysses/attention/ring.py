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
  time (kernel: ``_ring_kernel.py``; p2p: ``comm/p2p.py``).
* **Packed documents**: ``doc_starts`` per batch row in *global* positions ``[0, S)``; a token
  attends only inside its document (and causally). **GQA**: local q head ``j`` uses kv head
  ``j // (N/K)``. **Lengths**: ``S`` must be a multiple of ``2R`` (zigzag) or ``R``, else a
  ValueError; the sp pieces inside a ring rank may be uneven (the engine's ``seq_len=``).
* **Kernel** (chosen by :func:`~dtensor_ulysses.attention.choose_kernel` with ``ring=True``,
  the same rule and names as every layer): ``"blockwise"``, exact blocks in torch (float32
  math, float64 for float64 inputs; any device), or ``"flash_attn"``: fp16/bf16 blocks without a
  document mask run forward through ``flash_attn_func(..., return_attn_probs=True)`` (its
  ``lse``; on CPU through the test suite's flash-attn double, not yet on a GPU), the backward
  stays in torch. An explicit ``"flash_attn"`` with packed documents is refused (their blocks
  need a mask flash-attn cannot apply), as are kernels that return no log-sum-exp (sdpa, flex).

Communication per call, on each rank (:func:`ring_closed_form`): forward ``R-1`` sends of the
k/v block, ``B*L*2K*H*e`` each; backward ``R-1`` such sends plus ``R`` sends of the dk/dv
accumulators (``B*L*2K*H*4``); every send has a matching receive of the same size.

Ulysses x Ring (USP): ``UlyssesAttention(RingAttention(mesh), mesh)`` on a ``("dp", "ring", "sp")``
mesh: all-to-all over ``sp``, ring over ``ring``, all-to-all back. Data: the rank at
``(ring r, sp p)`` holds the global tokens :func:`zigzag_positions` ``(S, R, sp, r, p)``.
Training: ``du.init_mesh(dp, sp, ring=R)`` builds that mesh, ``du.parallelize(model, mesh)``
installs this composition in every block (FSDP2 over ``dp x ring x sp``), and
``data.get_batch(..., ring=R, ring_rank=r)`` slices the tokens and builds the layout (global
document starts). The torch-free helpers (chunks, zigzag order, checks, closed-form bytes) live
in :mod:`dtensor_ulysses.plan`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ulysses.attention._ring_kernel import RingAttentionFn, RingPlan
from dtensor_ulysses.attention.kernels import AttnFeatures, KernelChoice, choose_kernel

# torch-free: shared with the data loader and the simulator
from dtensor_ulysses.plan.splits import (
    RING_AXIS,
    RING_ORDERS,
    check_ring_seq,
    ring_chunks,
)

__all__ = [
    "ring_attention",
    "RING_AXIS",
    "ring_group",
    "RingAttention",
]

ORDERS = RING_ORDERS


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


def _ring_choice(backend: str | KernelChoice, q: torch.Tensor, docs: bool) -> KernelChoice:
    """The stored choice, or (a direct call) :func:`~dtensor_ulysses.attention.choose_kernel`
    for ring blocks on ``q``."""
    if isinstance(backend, KernelChoice):
        return backend
    return choose_kernel(AttnFeatures(), device_type=q.device.type, dtype=q.dtype,
                         head_dim=q.shape[-1], requested=backend, ring=True, docs=docs,
                         compiled=torch.compiler.is_compiling(),
                         device_index=q.device.index)  # fmt: skip


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
    backend: str | KernelChoice = "auto",
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
        backend: the blocks' kernel (:data:`~dtensor_ulysses.attention.kernels.RING_KERNELS`):
            ``"auto"`` (flash-attn blocks where it runs, blocks crossing documents in the exact
            torch kernel), ``"flash_attn"``, ``"blockwise"`` (the exact torch blocks), or a
            stored :class:`~dtensor_ulysses.attention.KernelChoice`. The ring merges blocks by
            their log-sum-exp, so kernels that return none (sdpa, flex) are refused.

    Raises:
        ValueError: bad shapes, ``S`` not a multiple of ``2R`` (zigzag) / ``R``, bad doc starts,
            a kernel that cannot run the ring's blocks (``"flash_attn"`` with ``doc_starts``:
            an explicit kernel is never replaced).
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
    flash = _ring_choice(backend, q, doc_starts is not None).name(doc_starts is not None)
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
        flash=flash == "flash_attn",
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
        causal: default for :func:`ring_attention` (a call's keyword arguments override the
            four defaults).
        order: default ``order`` of :func:`ring_attention`.
        softmax_scale: default ``softmax_scale`` of :func:`ring_attention`.
        backend: default ``backend`` of :func:`ring_attention` (``kernel_choice``, when set
            where the recipe is applied, is what runs).
    """

    global_doc_starts = True
    kernel_choice: KernelChoice | None = None  # the stored choice (du.parallelize sets it)

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
            "backend": self.kernel_choice or self.backend,
            **kwargs,
        }
        return ring_attention(q, k, v, self.group, doc_starts=doc_starts, **opts)
