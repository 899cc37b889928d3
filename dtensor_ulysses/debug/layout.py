"""Layout helpers: who holds which slice of ``x[B, S, N, H]`` under a placement, and the all-to-all.

* :class:`CommCounter` - a ``TorchDispatchMode`` that records every c10d and functional
  collective (including those issued by DTensor, FSDP2 and autograd backward): kind, group, input
  bytes. A rank's *bytes* for a collective are the size of the buffer it passes in (for an
  all-gather, the local shard; for a reduce-scatter, the full buffer). Point-to-point: each send
  (``dist.send``/``isend``, also inside ``batch_isend_irecv``) is one ``p2p``; each receive is
  one ``p2p_recv``, with its buffer's bytes. It is defined, with :class:`CollectiveCall`, in
  :mod:`dtensor_ulysses.debug.comm_counter` (import both from ``dtensor_ulysses.debug``, or
  ``du.CommCounter``).
* Layouts of ``x[B, S, N, H]``: :func:`shard_range`, :func:`local_ranges`, :func:`ownership`,
  :func:`describe` (a real DTensor), :func:`describe_placements`, and the notation
  ``q[B_dp, S_sp, N, H]`` <-> ``(Shard(0), Shard(1))`` (:func:`layout_notation`,
  :func:`parse_layout`). ``X_sp`` means "dim X split over the ``sp`` mesh axis".
* The Ulysses all-to-all: :func:`a2a_plan` (which chunk goes where), :func:`send_matrix`,
  :func:`kv_plan` and :func:`ulysses_closed_form` (the all-to-alls and bytes per rank).

Example::

    with du.CommCounter() as comm:
        o = du.ulysses_attention(q, k, v)
    comm.count("all_to_all", group=mesh.get_group(SP_AXIS)), comm.bytes("all_to_all")
    print(describe(q))  # every rank's slice of q, this rank marked
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from dtensor_ulysses.plan.splits import DP_AXIS, SP_AXIS, head_plan, head_split, seq_split

__all__ = [
    "a2a_plan",
    "Chunk",
    "describe",
    "describe_placements",
    "head_ranges",
    "kv_plan",
    "layout_notation",
    "local_ranges",
    "mesh_ranks",
    "ownership",
    "parse_layout",
    "parse_placement",
    "send_matrix",
    "shard_range",
    "token_ranges",
    "ulysses_closed_form",
]

# ----------------------------------------------------------------------------------------------
# layouts: which slice of a tensor each rank holds
# ----------------------------------------------------------------------------------------------
DIM_NAMES = "BSNH"


def parse_placement(p: Any) -> int | None:
    """The tensor dim a placement shards, or ``None`` for ``Replicate()``.

    Accepts ``Shard(d)``/``Replicate()`` objects and their spellings (``"Shard(1)"``, ``"S(1)"``,
    ``"Replicate()"``, ``"R"``). Anything else (e.g. ``Partial()``, a pending reduction rather than
    a layout of values) is a ``ValueError``.
    """
    if isinstance(p, Shard):
        return p.dim
    if isinstance(p, Replicate):
        return None
    if isinstance(p, str):
        m = re.fullmatch(r"(?:Shard|S)\((\d+)\)", p.strip())
        if m:
            return int(m.group(1))
        if p.strip() in ("Replicate()", "Replicate", "R"):
            return None
    raise ValueError(f"placement {p!r} is not Shard(d) or Replicate()")


def _placement_name(p: Any) -> str:
    d = parse_placement(p)
    return "Replicate()" if d is None else f"Shard({d})"


def shard_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """``[lo, hi)`` of piece ``index`` when ``Shard`` cuts a dim of ``size`` into ``parts``.

    Chunks of ``ceil(size / parts)``, the last ones shorter or empty (``torch.chunk``, and
    :func:`dtensor_ulysses.plan.seq_split`): ``shard_range(5, 4, 3) == (5, 5)``.
    """
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"index {index} is not in 0..{parts - 1}")
    sizes = seq_split(size, parts)
    lo = sum(sizes[:index])
    return lo, lo + sizes[index]


def mesh_ranks(dp: int, sp: int) -> list[list[int]]:
    """The ``("dp", "sp")`` mesh as rows of ranks: ``rank = dp_coord * sp + sp_coord``."""
    return [[d * sp + s for s in range(sp)] for d in range(dp)]


def local_ranges(
    shape: Sequence[int], placements: Sequence[Any], mesh_shape: Sequence[int], coord: Sequence[int]
) -> list[tuple[int, int]]:
    """``[lo, hi)`` per tensor dim held by the rank at mesh coordinate ``coord``.

    Placements apply in mesh-axis order: when two axes shard the same dim, the second cuts the
    first's piece again (DTensor's default left-to-right sharding).
    """
    if not (len(placements) == len(mesh_shape) == len(coord)):
        raise ValueError(
            f"{len(placements)} placements, a {len(mesh_shape)}-D mesh and a {len(coord)}-D "
            f"coordinate: give one placement per mesh axis"
        )
    ranges = [(0, n) for n in shape]
    for p, parts, c in zip(placements, mesh_shape, coord):
        d = parse_placement(p)
        if d is None:
            continue
        if not 0 <= d < len(shape):
            raise ValueError(
                f"Shard({d}) on a {len(shape)}-D tensor; use Shard(0..{len(shape) - 1})"
            )
        lo, hi = ranges[d]
        a, b = shard_range(hi - lo, parts, c)
        ranges[d] = (lo + a, lo + b)
    return ranges


def ownership(
    shape: Sequence[int], placements: Sequence[Any], mesh_shape: Sequence[int]
) -> dict[int, list[tuple[int, int]]]:
    """``{rank: [lo, hi) per dim}`` for every rank of a mesh (row-major ranks)."""
    out = {}
    for rank in range(math.prod(mesh_shape)):
        coord, rest = [], rank
        for size in reversed(mesh_shape):
            coord.append(rest % size)
            rest //= size
        out[rank] = local_ranges(shape, placements, mesh_shape, coord[::-1])
    return out


def layout_notation(
    placements: Sequence[Any], axis_names: Sequence[str] = (DP_AXIS, SP_AXIS), name: str = "q"
) -> str:
    """The layout in scaling-book notation: ``(Shard(0), Shard(1)) -> "q[B_dp, S_sp, N, H]"``."""
    subs: list[list[str]] = [[] for _ in DIM_NAMES]
    for p, axis in zip(placements, axis_names):
        d = parse_placement(p)
        if d is not None:
            subs[d].append(axis)
    dims = [dim + ("_" + ",".join(s) if s else "") for dim, s in zip(DIM_NAMES, subs)]
    return f"{name}[{', '.join(dims)}]"


def parse_layout(notation: str, axis_names: Sequence[str] = (DP_AXIS, SP_AXIS)) -> list[Any]:
    """The placements of a layout written as ``"q[B, S_sp, N, H]"``, one per mesh axis.

    The inverse of :func:`layout_notation`: ``parse_layout("q[B_dp, S, N_sp, H]") ==
    [Shard(0), Shard(2)]``; an axis named nowhere is ``Replicate()``.
    """
    m = re.fullmatch(r"\s*\w*\[(.*)\]\s*", notation)
    dims = [d.strip() for d in m.group(1).split(",")] if m else []
    out: list[Any] = [Replicate() for _ in axis_names]
    # "S_dp,sp" splits on the comma: glue the extra axis names back onto their dim
    merged: list[str] = []
    for d in dims:
        if merged and d in axis_names and "_" in merged[-1]:
            merged[-1] += "," + d
        else:
            merged.append(d)
    for i, d in enumerate(merged):
        _, _, axes = d.partition("_")
        for axis in filter(None, axes.split(",")):
            if axis not in axis_names:
                raise ValueError(
                    f"{notation!r}: {axis!r} is not a mesh axis of {tuple(axis_names)}"
                )
            out[list(axis_names).index(axis)] = Shard(i)
    if not merged:
        raise ValueError(f"{notation!r} is not a layout like 'q[B, S_sp, N, H]'")
    return out


def describe_placements(
    dp: int, sp: int, B: int, S: int, N: int, H: int, placements: Sequence[Any]
) -> str:
    """One line per rank of a ``dp x sp`` mesh: the slice of ``q[B, S, N, H]`` it holds."""
    own = ownership((B, S, N, H), placements, (dp, sp))
    ps = ", ".join(_placement_name(p) for p in placements)
    lines = [f"q[B={B}, S={S}, N={N}, H={H}], placements ({ps}) = {layout_notation(placements)}"]
    for rank, rng in own.items():
        d, s = divmod(rank, sp)
        idx = ", ".join(f"{lo}:{hi}" for lo, hi in rng)
        local = [hi - lo for lo, hi in rng]
        lines.append(f"  rank {rank} (dp={d}, sp={s}): q[{idx}]  local shape {local}")
    return "\n".join(lines)


def describe(x: Any, name: str = "x") -> str:
    """Every rank's slice of the DTensor ``x`` (this rank marked with ``*``), from its layout.

    Computed from ``x.shape``, ``x.placements`` and the mesh; no communication.
    """
    mesh = x.device_mesh
    axes = mesh.mesh_dim_names or tuple(f"m{i}" for i in range(mesh.ndim))
    me = dist.get_rank() if dist.is_initialized() else 0
    ranks = mesh.mesh.flatten().tolist()
    lines = [f"{name}{list(x.shape)} {tuple(x.placements)} on mesh {dict(zip(axes, mesh.shape))}"]
    for i, rng in ownership(tuple(x.shape), x.placements, tuple(mesh.shape)).items():
        idx = ", ".join(f"{lo}:{hi}" for lo, hi in rng)
        mark = "*" if ranks[i] == me else " "
        lines.append(f" {mark}rank {ranks[i]}: {name}[{idx}]")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# the Ulysses all-to-all: who sends what to whom, and how many bytes
# ----------------------------------------------------------------------------------------------
def token_ranges(S: int, sp: int) -> list[tuple[int, int]]:
    """Tokens of each sp rank under ``Shard(1)`` (chunks of ``ceil(S / sp)``)."""
    return [shard_range(S, sp, r) for r in range(sp)]


def head_ranges(N: int, sp: int) -> list[tuple[int, int]]:
    """q heads of each sp rank inside attention (:func:`dtensor_ulysses.plan.head_split`)."""
    out, lo = [], 0
    for n in head_split(N, sp):
        out.append((lo, lo + n))
        lo += n
    return out


@dataclass(frozen=True)
class Chunk:
    """One piece of an all-to-all: ``src`` sends tokens ``[t0, t1)`` x heads ``[h0, h1)``."""

    src: int
    dst: int
    tokens: tuple[int, int]
    heads: tuple[int, int]
    bytes: int


def a2a_plan(
    S: int, N: int, sp: int, direction: str = "seq_to_head", *, B=1, H=1, elem_bytes=4
) -> list[Chunk]:
    """Which chunk each rank sends to which, for one ``[B, S, N, H]`` tensor.

    ``seq_to_head`` (``Shard(1) -> Shard(2)``): rank ``src`` holds tokens ``T_src`` of all heads
    and sends heads ``N_dst`` of them to rank ``dst``; ``head_to_seq`` is the reverse. The
    ``src == dst`` chunk stays but is part of the buffer passed in (the byte convention), so a
    rank's bytes are the sum over ``dst``.
    """
    if direction not in ("seq_to_head", "head_to_seq"):
        raise ValueError(f"direction={direction!r}; use 'seq_to_head' or 'head_to_seq'")
    toks, heads = token_ranges(S, sp), head_ranges(N, sp)
    out = []
    for src in range(sp):
        for dst in range(sp):
            t, h = (
                (toks[src], heads[dst]) if direction == "seq_to_head" else (toks[dst], heads[src])
            )
            out.append(Chunk(src, dst, t, h, B * (t[1] - t[0]) * (h[1] - h[0]) * H * elem_bytes))
    return out


def send_matrix(plan: Iterable[Chunk], sp: int) -> list[list[int]]:
    """``m[src][dst]``: bytes ``src`` puts in ``dst``'s slot of its all-to-all input buffer."""
    m = [[0] * sp for _ in range(sp)]
    for c in plan:
        m[c.src][c.dst] += c.bytes
    return m


def kv_plan(n_q: int, n_kv: int, sp: int) -> list[dict[str, list[int]]]:
    """Per sp rank inside attention: the q heads it attends with and the kv heads it receives.

    From :func:`dtensor_ulysses.plan.head_plan`; a kv head may go to several ranks (GQA with
    ``sp`` not dividing ``n_kv``).
    """
    plan = head_plan(n_q, n_kv, sp)
    out, first = [], 0
    for n, kv in zip(plan.q_heads, plan.kv_index):
        out.append({"q_heads": list(range(first, first + n)), "kv_heads": list(kv)})
        first += n
    return out


def ulysses_closed_form(
    B: int, S: int, n_q: int, n_kv: int, H: int, sp: int, elem_bytes: int = 4, rank: int = 0
) -> dict[str, dict[str, int]]:
    """All-to-alls and input bytes of one ``ulysses_attention`` call on sp rank ``rank``.

    With ``s = S/sp``, rank ``r`` attending with ``n_r`` q heads and ``m_r`` kv heads
    (:func:`kv_plan`), ``K' = sum(m_r)``: forward moves ``B*s*(N + 2K')*H*e`` (fused q, k, v) then
    ``B*S*n_r*H*e`` (o); backward ``B*S*(n_r + 2m_r)*H*e`` then ``B*s*N*H*e``. ``B`` is this
    rank's batch. Nothing moves when ``sp == 1``.
    """
    keys = ("count", "bytes", "qkv_bytes", "o_bytes")
    if sp == 1:
        return {"forward": dict.fromkeys(keys, 0), "backward": dict.fromkeys(keys, 0)}
    if S % sp:
        raise ValueError(f"S={S} is not divisible by sp={sp}")
    heads = kv_plan(n_q, n_kv, sp)
    k_prime = sum(len(r["kv_heads"]) for r in heads)
    n_r, m_r = len(heads[rank]["q_heads"]), len(heads[rank]["kv_heads"])
    s, unit = S // sp, B * H * elem_bytes
    fwd = (s * (n_q + 2 * k_prime) * unit, S * n_r * unit)
    bwd = (S * (n_r + 2 * m_r) * unit, s * n_q * unit)
    return {
        phase: {"count": 2, "bytes": qkv + o, "qkv_bytes": qkv, "o_bytes": o}
        for phase, (qkv, o) in (("forward", fwd), ("backward", bwd))
    }
