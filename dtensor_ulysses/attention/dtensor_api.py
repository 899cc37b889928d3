"""The DTensor face of Ulysses: ``seq_to_head``, ``head_to_seq``, ``ulysses_attention``.

Thin adapters over the one engine (:mod:`dtensor_ulysses.attention.ulysses`): each checks the
DTensors' mesh, placements and shapes, hands the local shards to the engine's exchange or to
:class:`~dtensor_ulysses.attention.UlyssesAttention`, and wraps the local result back into a
DTensor with the new ``sp`` placement. Same collectives, same bytes as the engine.

Legend: ``B`` batch, ``S`` sequence, ``N`` q heads, ``H`` head dim, ``P`` the sp degree;
``x[B, S_sp, N, H]`` is ``Shard(1)`` on the ``sp`` mesh axis, ``x[B, S, N_sp, H]`` is ``Shard(2)``.

Why not ``DTensor.redistribute(Shard(1) -> Shard(2))``: on a CPU/gloo mesh torch 2.13 runs it
as all-gather + chunk, moving ``P`` times the bytes; these adapters issue one
``all_to_all_single`` on every backend.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from dtensor_ulysses.attention.local import local_attention
from dtensor_ulysses.attention.ulysses import SP_AXIS, UlyssesAttention, to_heads, to_seq
from dtensor_ulysses.attention.ulysses import sp_axis as _sp_axis
from dtensor_ulysses.plan import (
    HEAD_DIM,
    SeqLayout,
    check_sp_for_heads,
    contiguous_stride,
    head_plan,
)
from dtensor_ulysses.plan.splits import SEQ_DIM

__all__ = ["head_to_seq", "seq_to_head", "ulysses_attention"]


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------
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
        axis_name = (x.device_mesh.mesh_dim_names or ())[axis]
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


def _check_positions(pos: object, q: DTensor) -> DTensor:
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
# public API
# ----------------------------------------------------------------------------------------------
def _swap(x: DTensor, from_dim: int, to_dim: int) -> DTensor:
    x = _check_dtensor(x, "x")
    sp_axis = _sp_axis(x.device_mesh)
    _check_placements(x, "x", sp_axis, from_dim)
    P = x.device_mesh.size(sp_axis)
    _, S, N, _ = x.shape
    check_sp_for_heads(N, P, what="heads")
    _check_divisible(
        "tokens (sequence length) are", S, P, f"pad the sequence to a multiple of {P} tokens"
    )
    group = x.device_mesh.get_group(sp_axis)
    seq_sizes, head_sizes = [S // P] * P, [N // P] * P
    if to_dim == HEAD_DIM:
        (local,) = to_heads([x.to_local()], group, seq_sizes, [head_sizes])
    else:
        local = to_seq(x.to_local(), group, seq_sizes, head_sizes)
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
    return _swap(x, SEQ_DIM, HEAD_DIM)


def head_to_seq(x: DTensor) -> DTensor:
    """``x[B, S, N_sp, H] -> x[B, S_sp, N, H]``: on the ``sp`` axis, ``Shard(2) -> Shard(1)``.

    The inverse of :func:`seq_to_head`, with the same communication and the same errors.
    """
    return _swap(x, HEAD_DIM, SEQ_DIM)


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
    window: tuple[int, int] | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> DTensor:
    """Attention on sequence-sharded DTensors: each rank attends over all of S for its heads.

    ``q[B, S_sp, Nq, H]``, ``k/v[B, S_sp, Nkv, H]`` -> all-to-all -> ``[B, S, heads_sp, H]`` ->
    local attention (see :mod:`dtensor_ulysses.attention.local`) -> all-to-all ->
    ``o[B, S_sp, Nq, H]``.

    Args:
        q: ``[B, S, Nq, H]`` DTensor, ``Shard(1)`` on the ``sp`` axis (``Shard(0)`` or
            ``Replicate()`` on other axes).
        k: ``[B, S, Nkv, H]`` with ``Nkv`` dividing ``Nq`` (GQA/MQA), placed like ``q``.
        v: like ``k``.
        causal: causal (lower-triangular) masking.
        softmax_scale: defaults to ``1 / sqrt(H)``.
        backend: ``"auto"`` or a name of :data:`~dtensor_ulysses.attention.BACKENDS`; an explicit
            one that cannot run the features raises.
        position_ids: packed documents: a ``[B, S]`` int64 DTensor placed like ``q`` whose values
            restart at 0 at each document start (any break in ``+1`` steps starts a document).
            Attention then never crosses a document boundary. Costs one all-gather of the ids.
        allow_uneven: accept ``S`` not divisible by sp (DTensor's uneven ``Shard(1)``, e.g.
            ``S=37`` on sp=4 is ``[10, 10, 10, 7]``): the all-to-alls carry uneven pieces, no
            token is padded or dropped and results are exact. Off by default so a length that
            does not divide is a visible choice.
        fuse_qkv: move q, k and v in one all-to-all (same bytes, one launch instead of three).
        window: a sliding window ``(left, right)``; chunk: chunked attention (``C`` tokens);
            softcap: a logit softcap; see :func:`~dtensor_ulysses.attention.local_attention`.
        sinks: a plain ``[Nq]`` tensor (the same on every rank): one sink logit per q head; each
            rank attends with the sinks of its heads, and their gradients come back to them.

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
        pos_local = _check_positions(position_ids, q).to_local()
    engine = UlyssesAttention(local_attention, mesh.get_group(sp_axis), fuse_qkv=fuse_qkv)
    o_BsNH = engine(
        q.to_local(),
        k.to_local(),
        v.to_local(),
        layout=SeqLayout.split(S, P),
        position_ids=pos_local,
        causal=causal,
        softmax_scale=softmax_scale,
        backend=backend,
        **{n: x for n, x in (("window", window), ("chunk", chunk), ("softcap", softcap),
                             ("sinks", sinks)) if x is not None},
    )  # fmt: skip
    return _rewrap(q, o_BsNH, sp_axis, SEQ_DIM)
