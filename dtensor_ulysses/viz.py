"""Plain layout, accounting and plotting functions behind the teaching notebooks.

Every figure in ``notebooks/`` comes from a function here that takes plain numbers and returns a
``matplotlib.figure.Figure``; the notebooks only call them, and :func:`live` puts ipywidgets
controls over any of them (the default values render as an ordinary image output, so a notebook
executed headless still has its figures). matplotlib, IPython and ipywidgets are imported inside
the functions that need them (``pip install -e ".[notebooks]"``); the layout and accounting
functions need neither them nor torch.

Legend (as in the rest of the package; ``X_sp`` means "dim X split over the ``sp`` mesh axis"):

    B batch, S sequence, N q heads, K kv heads, H head dim, P = sp degree, e bytes per element
    q[B, S_sp, N, H] -> q[B, S, N_sp, H]     DTensor on the sp axis: Shard(1) -> Shard(2)

Groups of functions:

* placements (notebook 01): :func:`shard_range`, :func:`local_ranges`, :func:`ownership`,
  :func:`layout_notation`, :func:`describe_placements`, :func:`placement_mismatches`,
  :func:`plot_mesh`, :func:`plot_placements`;
* the all-to-all (notebook 02): :func:`a2a_plan`, :func:`send_matrix`, :func:`kv_plan`,
  :func:`ulysses_closed_form`, :func:`round_trip_report`, :func:`cells_by_stage`,
  :func:`plot_round_trip`, :func:`plot_a2a_bytes`, :func:`plot_gqa`;
* memory (notebook 03, from ``simulations``): :func:`memory_groups`, :func:`memory_sweep`,
  :func:`oom_walls`, :func:`plot_memory_scaling`, :func:`predicted_block_activations`,
  :func:`activation_table`, :func:`plot_activation_check`;
* communication (notebook 04, from ``simulations``): :func:`attention_comm`,
  :func:`methods_table`, :func:`plot_comm_methods`, :func:`plan_report`, :func:`format_plan`;
* training (notebook 05): :func:`plot_training`, :func:`loss_agreement`;
* display: :func:`figure_png`, :func:`show`, :func:`live`.
"""

from __future__ import annotations

import inspect
import io
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Chunk",
    "activation_table",
    "cells_by_stage",
    "methods_table",
    "placement_mismatches",
    "plan_report",
    "round_trip_report",
    "MEMORY_GROUPS",
    "a2a_plan",
    "attention_comm",
    "describe_placements",
    "figure_png",
    "format_plan",
    "head_ranges",
    "kv_plan",
    "layout_notation",
    "live",
    "local_ranges",
    "loss_agreement",
    "memory_groups",
    "memory_sweep",
    "mesh_ranks",
    "oom_walls",
    "owned_cells",
    "ownership",
    "parse_placement",
    "plot_a2a_bytes",
    "plot_activation_check",
    "plot_comm_methods",
    "plot_gqa",
    "plot_memory_scaling",
    "plot_mesh",
    "plot_placements",
    "plot_round_trip",
    "plot_training",
    "predicted_block_activations",
    "send_matrix",
    "shard_range",
    "show",
    "token_ranges",
    "ulysses_closed_form",
]

DIM_NAMES = "BSNH"
GiB = 2**30
_GREY = (0.92, 0.92, 0.92)


# ----------------------------------------------------------------------------------------------
# placements: which slice of a [B, S, N, H] tensor each rank holds
# ----------------------------------------------------------------------------------------------
def parse_placement(p: Any) -> int | None:
    """The tensor dim a placement shards, or ``None`` for ``Replicate()``.

    Accepts DTensor placement objects (``Shard(1)``, ``Replicate()``) and their spellings as
    strings (``"Shard(1)"``, ``"S(1)"``, ``"Replicate()"``, ``"R"``).

    Raises:
        ValueError: anything else (e.g. ``Partial()``, which describes pending reductions, not a
            layout of values).
    """
    if isinstance(p, str):
        text = p.strip()
        m = re.fullmatch(r"(?:Shard|S)\((\d+)\)", text)
        if m:
            return int(m.group(1))
        if text in ("Replicate()", "Replicate", "R"):
            return None
        raise ValueError(f"placement {p!r} is not Shard(d) or Replicate()")
    name = type(p).__name__
    if name == "Shard" and isinstance(getattr(p, "dim", None), int):
        return p.dim
    if name == "Replicate":
        return None
    raise ValueError(f"placement {p!r} is not Shard(d) or Replicate()")


def _fmt_placement(p: Any) -> str:
    d = parse_placement(p)
    return "Replicate()" if d is None else f"Shard({d})"


def shard_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """``[lo, hi)`` of part ``index`` when ``size`` is cut as DTensor's ``Shard`` cuts a dim.

    Chunks of ``ceil(size / parts)``, the last ones shorter or empty (``torch.chunk``):
    ``shard_range(5, 4, 3) == (5, 5)``.
    """
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"index {index} is not in 0..{parts - 1}")
    chunk = -(-size // parts)
    lo = min(index * chunk, size)
    return lo, min(lo + chunk, size)


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


def owned_cells(ranges: Sequence[tuple[int, int]]) -> set[tuple[int, ...]]:
    """Every index tuple inside ``ranges`` (small tensors only: it enumerates them)."""
    import itertools

    return set(itertools.product(*(range(lo, hi) for lo, hi in ranges)))


def layout_notation(
    placements: Sequence[Any], axis_names: Sequence[str] = ("dp", "sp"), name: str = "q"
) -> str:
    """The layout in scaling-book notation: ``(Shard(0), Shard(1)) -> "q[B_dp, S_sp, N, H]"``."""
    subs: list[list[str]] = [[] for _ in DIM_NAMES]
    for p, axis in zip(placements, axis_names):
        d = parse_placement(p)
        if d is not None:
            subs[d].append(axis)
    dims = [dim + ("_" + ",".join(s) if s else "") for dim, s in zip(DIM_NAMES, subs)]
    return f"{name}[{', '.join(dims)}]"


def describe_placements(
    dp: int, sp: int, B: int, S: int, N: int, H: int, placements: Sequence[Any]
) -> str:
    """One line per rank: the slice of ``q[B, S, N, H]`` it holds and its local shape."""
    own = ownership((B, S, N, H), placements, (dp, sp))
    ps = ", ".join(_fmt_placement(p) for p in placements)
    lines = [f"q[B={B}, S={S}, N={N}, H={H}], placements ({ps}) = {layout_notation(placements)}"]
    for rank, rng in own.items():
        d, s = divmod(rank, sp)
        idx = ", ".join(f"{lo}:{hi}" for lo, hi in rng)
        local = [hi - lo for lo, hi in rng]
        lines.append(f"  rank {rank} (dp={d}, sp={s}): q[{idx}]  local shape {local}")
    return "\n".join(lines)


def placement_mismatches(
    cases: Sequence[Mapping[str, Any]], per_rank: Sequence[Sequence[Mapping[str, Any]]]
) -> list[str]:
    """Differences between :func:`ownership` and what ``distribute_tensor`` placed on each rank.

    Args:
        cases: the cases given to ``notebook_workers.placement_worker``.
        per_rank: its return values, indexed by rank (``run_local_world``'s result).
    """
    problems = []
    for i, case in enumerate(cases):
        own = ownership(case["shape"], case["placements"], (case["dp"], case["sp"]))
        for rank, rows in enumerate(per_rank):
            got = {tuple(c) for c in rows[i]["cells"]}
            want = owned_cells(own[rank])
            if got != want:
                problems.append(
                    f"case {i} {case['placements']} rank {rank}: distribute_tensor placed "
                    f"{len(got)} cells, the placements say {len(want)} ({own[rank]})"
                )
    return problems


# ----------------------------------------------------------------------------------------------
# matplotlib helpers
# ----------------------------------------------------------------------------------------------
def _figure(width: float, height: float):
    """A figure not registered with pyplot (no global state, nothing shown twice)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            "plotting needs matplotlib: pip install -e '.[notebooks]' (or pip install matplotlib)"
        ) from None
    return Figure(figsize=(width, height), layout="constrained")


def _rank_color(rank: int) -> tuple[float, float, float]:
    import matplotlib

    return tuple(matplotlib.colormaps["tab10"](rank % 10)[:3])


def _cell_grid(ax, image, xlabel: str = "", ylabel: str = "") -> None:
    """Show an RGB image of cells with white lines between cells."""
    import numpy as np

    rows, cols = image.shape[:2]
    ax.imshow(image, aspect="auto", interpolation="nearest")
    ax.set_xticks(np.arange(-0.5, cols, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, rows, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=0.8)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)


def _log_axis(ax, which: str, ticks: Sequence[float] | None = None, fmt=None) -> None:
    """Log scale on ``which`` ("x" or "y") with plain tick labels (no 2x10^1)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis = ax.xaxis if which == "x" else ax.yaxis
    getattr(ax, f"set_{which}scale")("log")
    fmt = fmt or (lambda v: f"{v:g}")
    if ticks is not None:
        getattr(ax, f"set_{which}ticks")(list(ticks))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: fmt(v)))
    axis.set_minor_formatter(NullFormatter())


def _few_ticks(n: int, k: int = 4) -> list[int]:
    step = max(1, -(-n // k))
    return list(range(0, n, step))


# ----------------------------------------------------------------------------------------------
# notebook 01: the mesh and the placements
# ----------------------------------------------------------------------------------------------
def plot_mesh(dp: int = 2, sp: int = 2):
    """The ``("dp", "sp")`` mesh as a grid: rows are sp groups, columns are dp groups."""
    from matplotlib.patches import FancyBboxPatch, Rectangle

    _check_positive(dp=dp, sp=sp)
    fig = _figure(1.5 + 1.25 * sp, 1.2 + 0.95 * dp)
    ax = fig.add_subplot()
    for d, row in enumerate(mesh_ranks(dp, sp)):
        y = dp - 1 - d
        ax.add_patch(
            FancyBboxPatch((-0.45, y - 0.45), sp - 0.1, 0.9, boxstyle="round,pad=0.02",
                           fill=False, ec="0.4", ls="--", lw=1)
        )  # fmt: skip
        ax.text(sp - 0.4, y, f"  sp group {d}\n  ranks {row}", va="center", fontsize=8)
        for s, r in enumerate(row):
            ax.add_patch(
                Rectangle((s - 0.35, y - 0.35), 0.7, 0.7, color=_rank_color(r), alpha=0.85)
            )
            ax.text(s, y, f"rank {r}\n({d}, {s})", ha="center", va="center", fontsize=8,
                    color="white", weight="bold")  # fmt: skip
    for s in range(sp):
        ax.text(s, -0.75, f"dp group {s}", ha="center", fontsize=8, color="0.3")
    ax.set_xlim(-0.6, sp + 1.1)
    ax.set_ylim(-1.0, dp - 0.4)
    ax.set_axis_off()
    ax.set_title(
        f"mesh dp={dp} x sp={sp}: rank = dp_coord * {sp} + sp_coord "
        f"(an sp group is {sp} consecutive ranks)",
        fontsize=9,
    )
    return fig


def plot_placements(
    dp: int = 2,
    sp: int = 2,
    B: int = 2,
    S: int = 8,
    N: int = 4,
    dp_placement: str = "Shard(0)",
    sp_placement: str = "Shard(1)",
):
    """Per rank, which (batch, token, head) cells of ``q[B, S, N, H]`` it holds.

    One panel per rank, laid out like the mesh; in a panel each batch element is a block of
    ``N`` head rows by ``S`` token columns, colored where the rank holds the cell (every rank
    holds all ``H`` values of a cell it holds unless a placement is ``Shard(3)``).
    """
    import numpy as np

    _check_positive(dp=dp, sp=sp, B=B, S=S, N=N)
    placements = (dp_placement, sp_placement)
    own = ownership((B, S, N, 1), placements, (dp, sp))
    fig = _figure(0.6 + 2.3 * sp * max(1.0, S / 12), 0.8 + (0.35 * (B * N + B) + 0.9) * dp)
    axes = fig.subplots(dp, sp, squeeze=False)
    rows = B * N + (B - 1)  # one blank row between batch elements
    for rank, rng in own.items():
        d, s = divmod(rank, sp)
        (b0, b1), (s0, s1), (n0, n1), _ = rng
        img = np.ones((rows, S, 3))
        for b in range(B):
            img[b * (N + 1) : b * (N + 1) + N] = _GREY
            if b0 <= b < b1:
                img[b * (N + 1) + n0 : b * (N + 1) + n1, s0:s1] = _rank_color(rank)
        ax = axes[d][s]
        _cell_grid(ax, img, xlabel="token", ylabel="")
        ax.set_xticks(_few_ticks(S))
        ax.set_yticks([b * (N + 1) + (N - 1) / 2 for b in range(B)], [f"b={b}" for b in range(B)])
        local = [b1 - b0, s1 - s0, n1 - n0]
        ax.set_title(f"rank {rank} (dp={d}, sp={s})\nlocal [{local[0]}, {local[1]}, {local[2]}, H]",
                     fontsize=8)  # fmt: skip
    fig.suptitle(
        f"q[B={B}, S={S}, N={N}, H] with ({_fmt_placement(dp_placement)}, "
        f"{_fmt_placement(sp_placement)}) = {layout_notation(placements)}; rows: heads",
        fontsize=9,
    )
    return fig


# ----------------------------------------------------------------------------------------------
# notebook 02: the all-to-all
# ----------------------------------------------------------------------------------------------
def token_ranges(S: int, sp: int) -> list[tuple[int, int]]:
    """Tokens of each sp rank under ``Shard(1)`` (DTensor's chunks of ``ceil(S / sp)``)."""
    return [shard_range(S, sp, r) for r in range(sp)]


def head_ranges(N: int, sp: int) -> list[tuple[int, int]]:
    """q heads of each sp rank inside attention: contiguous, as even as possible."""
    out, lo = [], 0
    for r in range(sp):
        n = N // sp + (1 if r < N % sp else 0)
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
    S: int,
    N: int,
    sp: int,
    direction: str = "seq_to_head",
    *,
    B: int = 1,
    H: int = 1,
    elem_bytes: int = 4,
) -> list[Chunk]:
    """Which chunk each rank sends to which, for one ``[B, S, N, H]`` tensor.

    ``seq_to_head`` (``Shard(1) -> Shard(2)``): rank ``src`` holds tokens ``T_src`` of all heads
    and sends heads ``N_dst`` of them to rank ``dst``. ``head_to_seq`` is the reverse: rank ``src``
    holds heads ``N_src`` of all tokens and sends tokens ``T_dst`` of them. The ``src == dst``
    chunk stays on the rank but is part of the buffer it passes into the collective (the
    project's byte convention), so a rank's bytes are the sum over ``dst``.
    """
    if direction not in ("seq_to_head", "head_to_seq"):
        raise ValueError(f"direction={direction!r}; use 'seq_to_head' or 'head_to_seq'")
    _check_positive(S=S, N=N, sp=sp, B=B, H=H)
    toks, heads = token_ranges(S, sp), head_ranges(N, sp)
    out = []
    for src in range(sp):
        for dst in range(sp):
            t, h = (
                (toks[src], heads[dst]) if direction == "seq_to_head" else (toks[dst], heads[src])
            )
            n_bytes = B * (t[1] - t[0]) * (h[1] - h[0]) * H * elem_bytes
            out.append(Chunk(src, dst, t, h, n_bytes))
    return out


def send_matrix(plan: Iterable[Chunk], sp: int) -> list[list[int]]:
    """``m[src][dst]``: bytes ``src`` puts in ``dst``'s slot of its all-to-all input buffer."""
    m = [[0] * sp for _ in range(sp)]
    for c in plan:
        m[c.src][c.dst] += c.bytes
    return m


def kv_plan(n_q: int, n_kv: int, sp: int) -> list[dict[str, list[int]]]:
    """Per rank inside attention: the q heads it attends with and the kv heads it receives.

    The library's own plan (:func:`dtensor_ulysses.ulysses.head_plan`): q heads are split in
    contiguous, as-even-as-possible ranges; q head ``i`` uses kv head ``i // (n_q / n_kv)``. When
    ``sp`` divides ``n_kv`` the kv heads are sharded like the q heads; otherwise each rank is sent
    the kv heads its own q heads use, so a kv head may be replicated on several ranks.

    Raises:
        ValueError: ``n_kv`` does not divide ``n_q``, or ``sp > n_q``.
    """
    from dtensor_ulysses.ulysses import head_plan

    plan = head_plan(n_q, n_kv, sp)
    out, first = [], 0
    for n, kv in zip(plan.q_heads, plan.kv_index):
        out.append({"q_heads": list(range(first, first + n)), "kv_heads": list(kv)})
        first += n
    return out


def ulysses_closed_form(
    B: int, S: int, n_q: int, n_kv: int, H: int, sp: int, elem_bytes: int = 4, rank: int = 0
) -> dict[str, dict[str, int]]:
    """All-to-all calls and input bytes of one ``ulysses_attention`` on sp rank ``rank``.

    With ``s = S/sp`` tokens per rank, rank ``r`` attending with ``n_r`` q heads and ``m_r`` kv
    heads (:func:`kv_plan`), and ``K' = sum(m_r)`` the kv heads summed over the ranks they are
    sent to:

    * forward: one fused all-to-all of its sequence slice of q, k, v, ``B*s*(N + 2K')*H*e``, then
      one of its head slice of o, ``B*S*n_r*H*e``;
    * backward: the gradients of its head slices of q, k, v, ``B*S*(n_r + 2m_r)*H*e``, then of its
      sequence slice of o, ``B*s*N*H*e``.

    When ``sp`` splits the heads evenly every rank moves ``B*s*(N + 2K')*H*e + B*s*N*H*e`` each
    way. ``B`` is the batch on this rank (the global batch over dp). No all-to-all at all when
    ``sp == 1``.
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


def _stage_cells(S: int, N: int, sp: int) -> dict[str, dict[int, set[tuple[int, int]]]]:
    """Planned ``(token, head)`` cells per rank before, inside and after the round trip."""
    toks, heads = token_ranges(S, sp), head_ranges(N, sp)
    seq = {r: owned_cells([toks[r], (0, N)]) for r in range(sp)}
    head = {r: owned_cells([(0, S), heads[r]]) for r in range(sp)}
    return {"before": seq, "inside": head, "after": seq}


def plot_round_trip(
    S: int = 16,
    N: int = 8,
    sp: int = 4,
    observed: Mapping[str, Mapping[int, Iterable[tuple[int, int]]]] | None = None,
):
    """``q[B, S_sp, N, H] -> q[B, S, N_sp, H] -> q[B, S_sp, N, H]`` for one batch element.

    Three rows (before ``seq_to_head``, inside attention, after ``head_to_seq``), one panel per sp
    rank; each panel is the global ``heads x tokens`` grid with the rank's cells colored by the
    rank the chunk comes from (rows 1-2: the rank whose tokens they are; row 3: the rank that
    attended with those heads and sends them back). Labels name the peer of each chunk.

    Args:
        observed: ``{"before"|"inside"|"after": {rank: [(token, head), ...]}}`` from a real run
            (``notebook_workers.ulysses_round_trip_worker``); by default the plan is drawn.
    """
    import numpy as np

    _check_positive(S=S, N=N, sp=sp)
    cells = _stage_cells(S, N, sp) if observed is None else {
        k: {int(r): {tuple(c) for c in v} for r, v in observed[k].items()} for k in observed
    }  # fmt: skip
    toks, heads = token_ranges(S, sp), head_ranges(N, sp)
    tok_owner = [next(r for r, (a, b) in enumerate(toks) if a <= t < b) for t in range(S)]
    head_owner = [next(r for r, (a, b) in enumerate(heads) if a <= h < b) for h in range(N)]
    stages = [
        ("before", "before: Shard(1), q[B, S_sp, N, H]", lambda t, h: tok_owner[t], "to"),
        ("inside", "inside attention: Shard(2), q[B, S, N_sp, H]", lambda t, h: tok_owner[t],
         "from"),
        ("after", "after head_to_seq: Shard(1), o[B, S_sp, N, H]", lambda t, h: head_owner[h],
         "from"),
    ]  # fmt: skip
    fig = _figure(0.8 + sp * max(2.0, 0.17 * S), 1.0 + 3 * (0.9 + 0.2 * N))
    axes = fig.subplots(3, sp, squeeze=False)
    for row, (key, title, color_of, word) in enumerate(stages):
        for r in range(sp):
            img = np.empty((N, S, 3))
            img[:] = _GREY
            for t, h in cells[key].get(r, ()):
                img[h, t] = _rank_color(color_of(t, h))
            ax = axes[row][r]
            _cell_grid(ax, img, xlabel="token" if row == 2 else "", ylabel="head" if r == 0 else "")
            ax.set_xticks(_few_ticks(S))
            ax.set_yticks(range(N))
            ax.set_title(f"rank {r}" + (f"\n{title}" if r == 0 else ""), fontsize=8, loc="left")
            # label each chunk with its peer: before, the destination; after, the source
            for peer in range(sp):
                if key == "before":
                    (t0, t1), (h0, h1) = toks[r], heads[peer]
                elif key == "inside":
                    (t0, t1), (h0, h1) = toks[peer], heads[r]
                else:
                    (t0, t1), (h0, h1) = toks[r], heads[peer]
                if t1 > t0 and h1 > h0:
                    arrow = "\u2192" if word == "to" else "\u2190"
                    ax.text((t0 + t1 - 1) / 2, (h0 + h1 - 1) / 2, f"{arrow}{peer}", ha="center",
                            va="center", fontsize=9, color="black", weight="bold",
                            bbox={"boxstyle": "round,pad=0.1", "fc": "white", "alpha": 0.7,
                                  "lw": 0})  # fmt: skip
    src = "measured on a gloo world" if observed is not None else "from the plan"
    fig.suptitle(
        f"seq -> head -> seq for S={S}, N={N}, sp={sp} ({src}); color: the rank the chunk "
        f"comes from, label: the peer it goes to (\u2192) or came from (\u2190)",
        fontsize=9,
    )
    return fig


def cells_by_stage(
    rows: Sequence[Mapping[str, Any]], batch: int = 0, dp_rank: int = 0
) -> dict[str, dict[int, list[tuple[int, int]]]]:
    """``{stage: {sp_rank: [(token, head), ...]}}`` of one batch element, from a real run.

    Args:
        rows: one case's rows from ``notebook_workers.ulysses_round_trip_worker``, one per rank.
        batch: the batch element to keep.
        dp_rank: the dp coordinate whose sp group to keep.
    """
    out: dict[str, dict[int, list[tuple[int, int]]]] = {}
    for row in rows:
        d, r = row["coord"]
        if d != dp_rank:
            continue
        for stage, cells in row["cells"].items():
            out.setdefault(stage, {})[r] = [(t, h) for b, t, h in cells if b == batch]
    return out


def round_trip_report(
    rows: Sequence[Mapping[str, Any]], case: Mapping[str, Any]
) -> tuple[str, list[str]]:
    """Compare one case of a real round trip with the plan and the closed form.

    Checks, per rank: the cells held before, inside and after (:func:`a2a_plan`); one all-to-all
    per ``seq_to_head``/``head_to_seq`` whose input bytes equal the rank's row of
    :func:`send_matrix`; ``ulysses_attention`` forward and backward bytes and counts against
    :func:`ulysses_closed_form`; no other collective; the q and kv heads the kernel received
    against :func:`kv_plan`.

    Returns:
        ``(report text, problems)``; no problems means everything matched exactly.
    """
    dp, sp, B, S, N, K, H = (case[k] for k in ("dp", "sp", "B", "S", "N", "K", "H"))
    b_local = B // dp
    e = 4  # the worker runs fp32
    plan_s2h = send_matrix(a2a_plan(S, N, sp, B=b_local, H=H, elem_bytes=e), sp)
    plan_h2s = send_matrix(a2a_plan(S, N, sp, "head_to_seq", B=b_local, H=H, elem_bytes=e), sp)
    heads = kv_plan(N, K, sp)
    want_cells = _stage_cells(S, N, sp)
    problems: list[str] = []
    lines = [
        f"dp={dp} sp={sp}: x[B={B}, S={S}, N={N}, H={H}] fp32, attention with K={K} kv heads",
        f"{'rank':>4} {'(dp,sp)':>7} {'seq_to_head B':>14} {'plan':>6} {'head_to_seq B':>14} "
        f"{'plan':>6} {'attn fwd B':>11} {'closed':>7} {'bwd B':>7} {'closed':>7}  kv heads",
    ]
    for row in rows:
        d, r = row["coord"]
        cf = ulysses_closed_form(b_local, S, N, K, H, sp, e, rank=r)
        first_b = d * b_local  # the first batch element this dp rank holds
        got = {
            stage: {(t, h) for b, t, h in row["cells"][stage] if b == first_b}
            for stage in row["cells"]
        }
        for stage, want in want_cells.items():
            if b_local and got.get(stage) != want[r]:
                problems.append(f"rank {row['rank']}: cells {stage} differ from the plan")
        checks = [
            ("seq_to_head", row["seq_to_head"], 1, sum(plan_s2h[r])),
            ("head_to_seq", row["head_to_seq"], 1, sum(plan_h2s[r])),
            ("attention forward", row["attention"]["forward"], cf["forward"]["count"],
             cf["forward"]["bytes"]),
            ("attention backward", row["attention"]["backward"], cf["backward"]["count"],
             cf["backward"]["bytes"]),
        ]  # fmt: skip
        for what, m, count, nbytes in checks:
            if sp == 1:
                count, nbytes = 0, 0
            if (m["count"], m["bytes"], m["other"]) != (count, nbytes, 0):
                problems.append(
                    f"rank {row['rank']} {what}: measured {m['count']} all-to-alls, "
                    f"{m['bytes']} B, {m['other']} other collectives; expected {count}, "
                    f"{nbytes} B, 0"
                )
        kern = row.get("kernel", {})
        if kern and (kern["q_heads"], kern["kv_heads"]) != (
            heads[r]["q_heads"],
            heads[r]["kv_heads"],
        ):
            problems.append(f"rank {row['rank']}: kernel got heads {kern}, plan {heads[r]}")
        if not row.get("round_trip_exact", True):
            problems.append(f"rank {row['rank']}: head_to_seq(seq_to_head(x)) != x")
        att = row["attention"]
        lines.append(
            f"{row['rank']:>4} {f'({d},{r})':>7} {row['seq_to_head']['bytes']:>14,} "
            f"{sum(plan_s2h[r]):>6,} {row['head_to_seq']['bytes']:>14,} {sum(plan_h2s[r]):>6,} "
            f"{att['forward']['bytes']:>11,} {cf['forward']['bytes']:>7,} "
            f"{att['backward']['bytes']:>7,} {cf['backward']['bytes']:>7,}  {kern.get('kv_heads')}"
        )
    lines.append("all equal to the plan and the closed form" if not problems else "MISMATCHES:")
    lines += problems
    return "\n".join(lines), problems


def plot_a2a_bytes(
    B: int = 1,
    S: int = 16,
    n_q: int = 8,
    n_kv: int = 2,
    H: int = 8,
    sp: int = 4,
    elem_bytes: int = 4,
    measured: Sequence[Mapping[str, Mapping[str, int]]] | None = None,
):
    """Bytes of one ``ulysses_attention``: the fused q,k,v send matrix, and per-rank totals.

    Left: bytes rank ``src`` places in rank ``dst``'s slot of its q,k,v input buffer (the
    diagonal stays local). Right: per rank, the closed form forward and backward bytes next to the
    measured ones, if given (``[{"forward": {"bytes": ...}, "backward": {...}}, ...]`` by rank,
    from ``du.CommCounter``).
    """
    import numpy as np

    cfs = [ulysses_closed_form(B, S, n_q, n_kv, H, sp, elem_bytes, rank=r) for r in range(sp)]
    cf = cfs[0]
    plan = kv_plan(n_q, n_kv, sp)
    s = S // sp
    m = np.array(
        [[B * s * (len(plan[d]["q_heads"]) + 2 * len(plan[d]["kv_heads"])) * H * elem_bytes
          for d in range(sp)] for _ in range(sp)]
    )  # fmt: skip
    fig = _figure(10, 3.6)
    ax0, ax1 = fig.subplots(1, 2, width_ratios=[1, 1.4])
    ax0.imshow(m, cmap="Blues", vmin=0, vmax=max(1, m.max()) * 2.5)
    for i in range(sp):
        for j in range(sp):
            ax0.text(j, i, f"{m[i, j]:,}", ha="center", va="center", fontsize=7,
                     color="0.5" if i == j else "black")  # fmt: skip
    ax0.set(xticks=range(sp), yticks=range(sp), xlabel="to rank (dst)", ylabel="from rank (src)")
    ax0.set_title("fused q,k,v all-to-all, bytes per chunk\n(diagonal stays local)", fontsize=9)
    x = np.arange(sp)
    width = 0.2
    fwd = cf["forward"]["bytes"]
    ax1.bar(x - 1.5 * width, [c["forward"]["bytes"] for c in cfs], width, color="0.75",
            label="closed form, forward")  # fmt: skip
    ax1.bar(x - 0.5 * width, [c["backward"]["bytes"] for c in cfs], width, color="0.55",
            label="closed form, backward")  # fmt: skip
    if measured is not None:
        ax1.bar(x + 0.5 * width, [r["forward"]["bytes"] for r in measured], width,
                color="tab:blue", label="measured (CommCounter), forward")  # fmt: skip
        ax1.bar(x + 1.5 * width, [r["backward"]["bytes"] for r in measured], width,
                color="tab:orange", label="measured (CommCounter), backward")  # fmt: skip
    ax1.set(xticks=x, xlabel="rank", ylabel="bytes passed into all-to-alls")
    ax1.set_xticklabels([str(r) for r in range(sp)])
    wire = fwd * (sp - 1) / sp
    ax1.set_title(
        f"rank 0: {cf['forward']['count']} all-to-alls forward = {fwd:,} B "
        f"(q,k,v {cf['forward']['qkv_bytes']:,} + o {cf['forward']['o_bytes']:,});\n"
        f"of which (sp-1)/sp = {wire:,.0f} B leave the rank; backward "
        f"{cf['backward']['bytes']:,} B",
        fontsize=9,
    )
    ax1.set_ylim(0, 1.45 * max(max(c["forward"]["bytes"], c["backward"]["bytes"]) for c in cfs))
    ax1.legend(fontsize=7, loc="upper center", ncol=2)
    fig.suptitle(
        f"B={B}, S={S}, N={n_q}, K={n_kv}, H={H}, sp={sp}, {elem_bytes}-byte elements", fontsize=9
    )
    return fig


def plot_gqa(n_q: int = 8, n_kv: int = 2, sp: int = 4):
    """Which q heads each rank attends with and which kv heads it receives (GQA/MQA).

    q head ``i`` uses kv head ``i // (n_q / n_kv)``. When ``sp`` does not divide ``n_kv``, kv heads
    are replicated: hatched boxes are kv heads that more than one rank receives.
    """
    from matplotlib.patches import Rectangle

    plan = kv_plan(n_q, n_kv, sp)
    group = n_q // n_kv
    copies: dict[int, int] = {}
    for r in plan:
        for h in r["kv_heads"]:
            copies[h] = copies.get(h, 0) + 1
    k_prime = sum(copies.values())
    width = max(n_q, 1) + 3
    fig = _figure(1.0 + 0.55 * width, 0.9 + 0.62 * (sp + 1))
    ax = fig.add_subplot()

    def box(x, y, text, color, hatch=None):
        ax.add_patch(Rectangle((x, y), 0.9, 0.7, fc=color, ec="0.2", lw=0.6, hatch=hatch))
        ax.text(x + 0.45, y + 0.35, text, ha="center", va="center", fontsize=7)

    import matplotlib

    kv_color = matplotlib.colormaps["Pastel1"]
    y0 = sp
    ax.text(-0.2, y0 + 0.35, "model", ha="right", va="center", fontsize=8)
    for i in range(n_q):
        box(i, y0, f"q{i}", kv_color(i // group % 9))
    for r, row in enumerate(plan):
        y = sp - 1 - r
        ax.text(-0.2, y + 0.35, f"rank {r}", ha="right", va="center", fontsize=8)
        for i in row["q_heads"]:
            box(i, y, f"q{i}", kv_color(i // group % 9))
        x0 = n_q + 0.6
        for j, h in enumerate(row["kv_heads"]):
            box(x0 + j, y, f"kv{h}", kv_color(h % 9), hatch="///" if copies[h] > 1 else None)
    ax.text(n_q + 0.6, y0 + 0.35, "kv heads received", va="center", fontsize=8)
    ax.set_xlim(-2.0, n_q + 1 + max(len(r["kv_heads"]) for r in plan) + 0.5)
    ax.set_ylim(-0.3, sp + 1)
    ax.set_axis_off()
    rep = "sharded, no copies" if k_prime == n_kv else f"replicated: K' = {k_prime} > K = {n_kv}"
    ax.set_title(
        f"GQA with N={n_q} q heads, K={n_kv} kv heads on sp={sp}: kv heads {rep}\n"
        f"(color = kv group; hatched = sent to more than one rank; their gradients are summed "
        f"back by autograd)",
        fontsize=9,
    )
    return fig


# ----------------------------------------------------------------------------------------------
# notebook 03: memory, from the simulator
# ----------------------------------------------------------------------------------------------
# simulator components -> the groups the notebook shows
MEMORY_GROUPS: dict[str, tuple[str, ...]] = {
    "weights": ("parameters", "fsdp_buffers"),
    "grads": ("gradients",),
    "optimizer": ("optimizer_states",),
    "activations": (
        "activations_checkpoints",
        "activations_layer",
        "attention_working",
        "all_to_all_buffers",
        "mlp_working",
    ),
    "logits": ("logits_loss",),
    "other": ("inputs", "fixed"),
}
_GROUP_COLORS = {
    "weights": "tab:blue",
    "grads": "tab:cyan",
    "optimizer": "tab:purple",
    "activations": "tab:orange",
    "logits": "tab:red",
    "other": "tab:gray",
}


def memory_groups(components: Mapping[str, float]) -> dict[str, float]:
    """Simulator memory components (bytes) summed into :data:`MEMORY_GROUPS`.

    A component the mapping does not name is counted under ``"other"``, so the groups always add
    up to the simulator's peak.
    """
    out = dict.fromkeys(MEMORY_GROUPS, 0.0)
    known = {c: g for g, cs in MEMORY_GROUPS.items() for c in cs}
    for comp, v in components.items():
        if comp == "peak":
            continue
        out[known.get(comp, "other")] += float(v)
    return out


def _valid_sps(model: Any, gpus: int) -> list[int]:
    from simulations.config import Workload

    out = []
    for sp in range(1, gpus + 1):
        if gpus % sp:
            continue
        try:
            Workload(shape=model, seq_len=sp, dp=gpus // sp, sp=sp)
        except ValueError:
            continue
        out.append(sp)
    return out


def memory_sweep(
    model: Any = "llama3-8b",
    gpu: Any = "h100",
    gpus: int = 8,
    seq_lens: Sequence[int] | None = None,
    sps: Sequence[int] | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """Per-rank memory by group for every (sp, S), from ``simulations.predict``.

    The GPU count is fixed and ``dp = gpus / sp``, so the model states are sharded over the same
    ``gpus`` ranks (FSDP2 over dp x sp) for every sp and only what depends on tokens changes.

    Returns:
        rows ``{"sp", "dp", "seq_len", "peak", "capacity", "fits", "groups": {group: bytes}}``;
        combinations the simulator rejects are left out.
    """
    from simulations import predict

    sps = list(sps) if sps is not None else _valid_sps(model, gpus)
    seq_lens = list(seq_lens) if seq_lens is not None else [2**k for k in range(11, 23)]
    rows = []
    for sp in sps:
        for S in seq_lens:
            try:
                p = predict(model, S, dp=gpus // sp, sp=sp, gpu=gpu, **options)
            except ValueError:
                continue
            rows.append(
                {
                    "sp": sp,
                    "dp": gpus // sp,
                    "seq_len": S,
                    "peak": float(p.memory.peak),
                    "capacity": float(p.memory.capacity),
                    "fits": bool(p.fits),
                    "groups": memory_groups(p.memory.components),
                }
            )
    return rows


def oom_walls(
    model: Any = "llama3-8b",
    gpu: Any = "h100",
    gpus: int = 8,
    sps: Sequence[int] | None = None,
    **options: Any,
) -> dict[int, int]:
    """``{sp: longest sequence that fits}`` (the planner's search; 0 when nothing fits)."""
    from simulations.config import Workload
    from simulations.planner import max_seq_len

    sps = list(sps) if sps is not None else _valid_sps(model, gpus)
    out = {}
    for sp in sps:
        w = Workload(shape=model, seq_len=sp, dp=gpus // sp, sp=sp, gpu=gpu, **options)
        out[sp] = max_seq_len(w)
    return out


def _fmt_tokens(n: float) -> str:
    """Tokens with binary prefixes: ``131072 -> "128K"``, ``33280 -> "32.5K"``."""
    for unit, k in (("M", 2**20), ("K", 2**10)):
        if n >= k:
            return f"{n / k:.1f}".rstrip("0").rstrip(".") + unit
    return f"{n:.0f}"


def plot_memory_scaling(
    model: str = "llama3-8b",
    gpu: str = "h100",
    gpus: int = 8,
    ac: str = "full",
    tiled_loss: bool = False,
    seq_len: int = 65536,
):
    """Per-rank memory vs sequence length for every valid sp, the components, and the wall.

    Left: peak per rank vs S (one line per sp; solid where it fits, dotted beyond); the dashed line
    is the GPU's usable memory. Middle: the components at ``seq_len`` for each sp. Right: the
    longest sequence that fits (the out-of-memory wall) for each sp. All from the simulator, bf16,
    FSDP2 over all ``gpus`` ranks with ``dp = gpus / sp``.
    """
    opts = {"ac": ac, "tiled_loss": tiled_loss}
    rows = memory_sweep(model, gpu, gpus, **opts)
    walls = oom_walls(model, gpu, gpus, **opts)
    sps = sorted(walls)
    fig = _figure(15, 4.4)
    ax0, ax1, ax2 = fig.subplots(1, 3, width_ratios=[1.3, 1, 0.9])
    cap = rows[0]["capacity"] / GiB if rows else 0
    for sp in sps:
        pts = [(r["seq_len"], r["peak"] / GiB, r["fits"]) for r in rows if r["sp"] == sp]
        color = _rank_color(sps.index(sp))
        xs, ys, fits = zip(*pts)
        ax0.plot(xs, ys, ":", color=color, lw=1)
        ok = [(x, y) for x, y, f in pts if f]
        if ok:
            ax0.plot(*zip(*ok), "o-", ms=3, color=color, label=f"sp={sp} (dp={gpus // sp})")
        if walls[sp]:
            ax0.axvline(walls[sp], color=color, lw=0.8, alpha=0.6)
    ax0.axhline(cap, color="k", ls="--", lw=1, label=f"{gpu} usable ({cap:.0f} GiB)")
    ax0.set(xlabel="sequence length S", ylabel="GiB per rank", ylim=(0, cap * 1.6))
    _log_axis(ax0, "x", [2**k for k in range(11, 23, 2)], _fmt_tokens)
    ax0.set_title("peak memory per rank (vertical lines: the OOM wall)", fontsize=9)
    ax0.legend(fontsize=7)
    # components at seq_len
    bottoms = [0.0] * len(sps)
    at = {r["sp"]: r for r in memory_sweep(model, gpu, gpus, [seq_len], sps, **opts)}
    labels = [f"sp={sp}" for sp in sps]
    for g in MEMORY_GROUPS:
        vals = [at[sp]["groups"][g] / GiB if sp in at else 0.0 for sp in sps]
        ax1.bar(labels, vals, bottom=bottoms, color=_GROUP_COLORS[g], label=g)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax1.axhline(cap, color="k", ls="--", lw=1)
    ax1.set(ylabel="GiB per rank")
    ax1.set_title(f"components at S={_fmt_tokens(seq_len)} (the peak moment)", fontsize=9)
    ax1.legend(fontsize=7)
    # the wall
    vals = [walls[sp] for sp in sps]
    bars = ax2.bar(labels, vals, color=[_rank_color(i) for i in range(len(sps))])
    base = walls[sps[0]] or None
    for b, v in zip(bars, vals):
        txt = _fmt_tokens(v) + (f"\n({v / base:.1f}x)" if base and v else "")
        ax2.text(b.get_x() + b.get_width() / 2, v, txt, ha="center", va="bottom", fontsize=7)
    from matplotlib.ticker import FuncFormatter, MultipleLocator

    ax2.set(ylabel="tokens", ylim=(0, max(vals + [1]) * 1.25))
    top = max(vals + [1])
    ax2.yaxis.set_major_locator(MultipleLocator(2 ** max(10, math.ceil(math.log2(top / 5)))))
    ax2.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: _fmt_tokens(v)))
    ax2.set_title("longest sequence that fits (OOM wall)", fontsize=9)
    fig.suptitle(
        f"{model} on {gpus}x {gpu}, bf16, ac={ac}, tiled_loss={tiled_loss} (simulator)",
        fontsize=10,
    )
    return fig


def predicted_block_activations(
    model: Any, seq_len: int, dp: int, sp: int, dtype: str = "fp32", micro_batch: int = 1
) -> float:
    """Simulator: bytes the transformer blocks save for backward on one rank (no checkpointing).

    ``n_layers x`` the simulator's per-layer activation bytes (``memory.per_layer["no_ac"]``).
    """
    from simulations import predict

    p = predict(model, seq_len, dp=dp, sp=sp, dtype=dtype, ac="none", micro_batch=micro_batch)
    return float(p.memory.per_layer["no_ac"] * p.workload.shape.n_layers)


def activation_table(measured: Sequence[Mapping[str, Any]], model: str = "tiny") -> str:
    """Measured vs predicted saved-activation bytes per rank, one line per (sp, S)."""
    lines = [
        f"{'dp':>3} {'sp':>3} {'S':>6} {'S/sp':>5} {'blocks, measured':>17} {'simulator':>10} "
        f"{'ratio':>6} {'outside blocks':>15}"
    ]
    for r in sorted(measured, key=lambda r: (r["sp"], r["seq_len"])):
        pred = predicted_block_activations(model, r["seq_len"], r["dp"], r["sp"])
        lines.append(
            f"{r['dp']:>3} {r['sp']:>3} {r['seq_len']:>6} {r['local_tokens']:>5} "
            f"{r['blocks_bytes']:>17,} {pred:>10,.0f} {r['blocks_bytes'] / pred:>6.3f} "
            f"{r['other_bytes']:>15,}"
        )
    return "\n".join(lines)


def plot_activation_check(measured: Sequence[Mapping[str, Any]], model: str = "tiny"):
    """Measured saved-activation bytes of the real model vs the simulator, per rank.

    Args:
        measured: rows ``{"dp", "sp", "seq_len", "blocks_bytes", ...}`` from
            ``notebook_workers.activation_memory_worker`` (one micro-batch per rank, fp32, CPU).
    """
    sps = sorted({r["sp"] for r in measured})
    seqs = sorted({r["seq_len"] for r in measured})
    fig = _figure(11, 3.8)
    ax0, ax1 = fig.subplots(1, 2)
    for i, sp in enumerate(sps):
        rows = sorted((r for r in measured if r["sp"] == sp), key=lambda r: r["seq_len"])
        color = _rank_color(i)
        dp = rows[0]["dp"]
        pred = [predicted_block_activations(model, S, dp, sp) for S in seqs]
        ax0.plot(seqs, [p / 2**20 for p in pred], "-", color=color, lw=1.2,
                 label=f"simulator, sp={sp}")  # fmt: skip
        ax0.plot([r["seq_len"] for r in rows], [r["blocks_bytes"] / 2**20 for r in rows], "o",
                 color=color, ms=6, mfc="none", mew=1.5, label=f"measured, sp={sp}")  # fmt: skip
        ratio = [
            r["blocks_bytes"] / predicted_block_activations(model, r["seq_len"], dp, sp)
            for r in rows
        ]
        ax1.plot([r["seq_len"] for r in rows], ratio, "o-", color=color, label=f"sp={sp}")
    ax0.set(xlabel="sequence length S", ylabel="MiB per rank")
    _log_axis(ax0, "x", seqs)
    _log_axis(ax0, "y")
    ax0.set_title("activations the blocks save for backward, per rank", fontsize=9)
    ax0.legend(fontsize=7, ncol=2)
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.set(xlabel="sequence length S", ylabel="measured / simulator", ylim=(0.8, 1.2))
    _log_axis(ax1, "x", seqs)
    ax1.set_title("measured / predicted", fontsize=9)
    ax1.legend(fontsize=7)
    fig.suptitle(
        f"{model} preset, fp32 on CPU, no checkpointing, one sequence per rank: measured with "
        f"torch.autograd.graph.saved_tensors_hooks (unique storages, parameters excluded)",
        fontsize=9,
    )
    return fig


# ----------------------------------------------------------------------------------------------
# notebook 04: communication, from the simulator
# ----------------------------------------------------------------------------------------------
_NOT_ATTENTION_GROUPS = ("dp_sp", "dp", "world")


def attention_comm(prediction: Any) -> dict[str, float]:
    """The attention method's share of a prediction, per rank per step.

    Returns:
        ``{"bytes": input-buffer bytes, "wire_bytes": bytes sent, "time_s": seconds if nothing
        overlapped}`` over the collectives of the sequence/tensor-parallel groups (FSDP, data
        parallel and loss collectives left out).
    """
    L = prediction.workload.shape.n_layers
    b = wire = 0.0
    for c in prediction.comm.items:
        if c.group in _NOT_ATTENTION_GROUPS:
            continue
        _, nb, nw = c.per_step(L)
        b += nb
        wire += nw
    t = sum(v for g, v in prediction.time.by_group.items() if g not in _NOT_ATTENTION_GROUPS)
    return {"bytes": b, "wire_bytes": wire, "time_s": t}


def _gpu_profile(
    gpu: Any, intra_gbps: float | None, inter_gbps: float | None, per_node: int | None
):
    from simulations import get_gpu

    g = get_gpu(gpu)
    changes: dict[str, Any] = {}
    if intra_gbps:
        changes["intra_bw"] = intra_gbps * 1e9
    if inter_gbps:
        changes["inter_bw"] = inter_gbps * 1e9
    if per_node:
        changes["gpus_per_node"] = per_node
    return g.with_(**changes) if changes else g


def _method_point(model, S, sp, gpu, method, **options):
    from simulations import predict

    try:
        return predict(model, S, dp=1, sp=sp, gpu=gpu, attention=method, **options)
    except ValueError:
        return None


def plot_comm_methods(
    model: str = "llama3-8b",
    seq_len: int = 131072,
    sp: int = 8,
    gpu: str = "h100",
    kv_heads: int | None = None,
    intra_gbps: float | None = None,
    inter_gbps: float | None = None,
    gpus_per_node: int | None = None,
):
    """Ulysses vs Ring vs Megatron-SP vs USP: volume and time as S, P, heads and links change.

    Four panels, all per rank per training step (forward + backward + recompute), attention
    collectives only: (1) bytes vs S at ``sp``; (2) bytes vs P at ``seq_len`` (and at a fixed
    ``S/P``, dashed, for Ulysses); (3) communication time vs P with the node boundary (the
    intra- vs inter-node cliff); (4) step time at (``seq_len``, ``sp``) split into compute and
    exposed communication. ``kv_heads`` overrides the model's kv-head count (GQA degree);
    ``intra_gbps``/``inter_gbps``/``gpus_per_node`` override the GPU profile's links.
    """
    from dtensor_ulysses.presets import get_shape
    from simulations import METHODS

    shape = get_shape(model) if isinstance(model, str) else model
    if kv_heads:
        shape = shape.with_(n_kv_heads=kv_heads)
    g = _gpu_profile(gpu, intra_gbps, inter_gbps, gpus_per_node)
    colors = dict(zip(METHODS, ("tab:blue", "tab:green", "tab:red", "tab:purple")))
    fig = _figure(16, 4.2)
    ax0, ax1, ax2, ax3 = fig.subplots(1, 4)
    seqs = [2**k for k in range(13, 21)]
    Ps = [2**k for k in range(1, 7)]
    for m in METHODS:
        pts = [(S, _method_point(shape, S, sp, g, m)) for S in seqs]
        pts = [(S, attention_comm(p)["bytes"] / GiB) for S, p in pts if p is not None]
        if pts:
            ax0.plot(*zip(*pts), "o-", ms=3, color=colors[m], label=m)
        by_p = [(P, _method_point(shape, seq_len, P, g, m)) for P in Ps]
        by_p = [(P, p) for P, p in by_p if p is not None]
        if by_p:
            ax1.plot([P for P, _ in by_p], [attention_comm(p)["bytes"] / GiB for _, p in by_p],
                     "o-", ms=3, color=colors[m], label=m)  # fmt: skip
            ax2.plot([P for P, _ in by_p], [attention_comm(p)["time_s"] for _, p in by_p],
                     "o-", ms=3, color=colors[m], label=m)  # fmt: skip
    per_rank = seq_len // sp
    fixed = [(P, _method_point(shape, per_rank * P, P, g, "ulysses")) for P in Ps]
    fixed = [(P, attention_comm(p)["bytes"] / GiB) for P, p in fixed if p is not None]
    if fixed:
        ax1.plot(*zip(*fixed), "--", color=colors["ulysses"], lw=1,
                 label=f"ulysses at S/P={_fmt_tokens(per_rank)}")  # fmt: skip
    ax0.set(xlabel="sequence length S", ylabel="GiB per rank per step")
    _log_axis(ax0, "x", seqs[::2], _fmt_tokens)
    _log_axis(ax0, "y")
    ax0.set_title(f"volume vs S (P={sp})", fontsize=9)
    ax1.set(xlabel="P (sequence-parallel ranks)", ylabel="GiB per rank per step")
    _log_axis(ax1, "x", Ps)
    _log_axis(ax1, "y")
    ax1.set_title(f"volume vs P (S={_fmt_tokens(seq_len)})", fontsize=9)
    for ax in (ax0, ax1):
        ax.legend(fontsize=7)
    ax2.axvspan(g.gpus_per_node, Ps[-1] * 1.5, color="0.9")
    ax2.text(g.gpus_per_node * 1.1, 0.98, "group spans nodes", transform=ax2.get_xaxis_transform(),
             va="top", fontsize=7)  # fmt: skip
    ax2.set(xlabel="P", ylabel="seconds per step (if not overlapped)")
    _log_axis(ax2, "x", Ps)
    _log_axis(ax2, "y")
    ax2.set_title(
        f"comm time vs P: NVLink {g.intra_bw / 1e9:.0f} GB/s inside a node of "
        f"{g.gpus_per_node}, {g.inter_bw / 1e9:.0f} GB/s across",
        fontsize=8,
    )
    ax2.legend(fontsize=7)
    names, comp, exposed = [], [], []
    for m in METHODS:
        p = _method_point(shape, seq_len, sp, g, m)
        if p is None:
            continue
        names.append(m)
        comp.append(p.time.compute)
        exposed.append(p.time.comm_exposed)
    ax3.bar(names, comp, color="0.7", label="compute")
    ax3.bar(names, exposed, bottom=comp, color=[colors[n] for n in names], label="exposed comm")
    ax3.set(ylabel="seconds per step")
    ax3.set_title(f"step time at S={_fmt_tokens(seq_len)}, P={sp}", fontsize=9)
    ax3.legend(fontsize=7)
    ax3.tick_params(axis="x", labelsize=7)
    fig.suptitle(
        f"{shape.name}: N={shape.n_heads} q heads, K={shape.n_kv_heads} kv heads; {g.name}; "
        f"attention collectives only (FSDP excluded); simulator",
        fontsize=10,
    )
    return fig


def methods_table(
    model: str = "llama3-8b", seq_len: int = 131072, sp: int = 8, gpu: str = "h100", **options: Any
) -> str:
    """Every attention method at one (S, P): attention bytes, time, step time, tokens/s."""
    from simulations import METHODS

    lines = [
        f"{model}, S={seq_len:,}, P={sp}, {gpu} (per rank per step, attention collectives only)",
        f"{'method':>12} {'GiB in':>8} {'GiB sent':>9} {'comm s':>8} {'exposed*':>10} "
        f"{'step s':>8} {'tokens/s':>10}",
    ]
    for m in METHODS:
        p = _method_point(model, seq_len, sp, gpu, m, **options)
        if p is None:
            lines.append(f"{m:>12}  cannot run this layout")
            continue
        a = attention_comm(p)
        lines.append(
            f"{m:>12} {a['bytes'] / GiB:>8.2f} {a['wire_bytes'] / GiB:>9.2f} {a['time_s']:>8.3f} "
            f"{p.time.comm_exposed:>10.3f} {p.step_time_s:>8.3f} {p.tokens_per_s:>10,.0f}"
        )
    lines.append("* exposed: seconds of all communication (FSDP included) not hidden by compute")
    return "\n".join(lines)


def plan_report(
    model: str = "llama3-8b",
    gpus: int = 8,
    gpu: str = "h100",
    seq_len: int | None = None,
    ac: str = "full",
    tiled_loss: bool = False,
) -> str:
    """The planner's ranking of (dp, sp) layouts as text (``simulations.plan``)."""
    from simulations import plan

    return format_plan(plan(model, gpus, gpu, seq_len=seq_len, ac=ac, tiled_loss=tiled_loss))


def format_plan(plan: Any) -> str:
    """A planner result (``simulations.plan``) as a text table, best layout first."""
    lines = [
        f"{plan.model} on {plan.gpus}x {plan.gpu}"
        + (f", target S={plan.seq_len:,}" if plan.seq_len else ""),
        f"{'dp':>3} {'sp':>3} {'max seq':>10} {'tokens/s':>12}  why",
    ]
    for x in plan.layouts:
        if not x.valid:
            lines.append(f"{x.dp:>3} {x.sp:>3} {'-':>10} {'-':>12}  invalid: {x.why}")
            continue
        lines.append(f"{x.dp:>3} {x.sp:>3} {x.max_seq_len:>10,} {x.tokens_per_s:>12,.0f}  {x.why}")
    best = plan.best
    if best is not None:
        lines.append(f"recommendation: dp={best.dp}, sp={best.sp}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# notebook 05: training runs
# ----------------------------------------------------------------------------------------------
def loss_agreement(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, float]:
    """Largest relative loss difference of every run from the first one, over their common steps."""
    names = list(runs)
    if not names:
        return {}
    ref = {r["step"]: r["loss"] for r in runs[names[0]]}
    out = {}
    for name in names[1:]:
        diffs = [abs(r["loss"] - ref[r["step"]]) / abs(ref[r["step"]]) for r in runs[name]
                 if r["step"] in ref]  # fmt: skip
        out[name] = max(diffs) if diffs else float("nan")
    return out


def plot_training(runs: Mapping[str, Sequence[Mapping[str, Any]]]):
    """Loss and tokens/s per step for several runs (``--metrics-file`` records, by label)."""
    fig = _figure(11, 3.6)
    ax0, ax1 = fig.subplots(1, 2)
    styles = ["o-", "s--", "^:", "v-.", "d-"]
    for i, (name, recs) in enumerate(runs.items()):
        steps = [r["step"] for r in recs]
        ax0.plot(steps, [r["loss"] for r in recs], styles[i % len(styles)], ms=7 - 1.5 * i,
                 mfc="none", color=_rank_color(i), label=name)  # fmt: skip
        ax1.plot(steps, [r["tokens_per_s"] for r in recs], styles[i % len(styles)], ms=4,
                 color=_rank_color(i), label=name)  # fmt: skip
    ax0.set(xlabel="step", ylabel="loss (token-weighted cross entropy)")
    ax0.set_title("loss: same global batch and seed for every layout", fontsize=9)
    ax0.legend(fontsize=8)
    ax1.set(xlabel="step", ylabel="tokens / s (whole job)")
    ax1.set_title("throughput (CPU, gloo; first step includes warm-up)", fontsize=9)
    ax1.legend(fontsize=8)
    return fig


# ----------------------------------------------------------------------------------------------
# display: figures as PNG outputs, widgets over plain functions
# ----------------------------------------------------------------------------------------------
def figure_png(fig: Any, dpi: int = 90) -> bytes:
    """PNG bytes of a figure, without the software tag (so re-executing does not churn)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def _renderable(result: Any) -> Any:
    from IPython.display import Image, Pretty

    if hasattr(result, "savefig"):
        return Image(data=figure_png(result), format="png")
    if isinstance(result, str):
        return Pretty(result)
    return result


def show(result: Any) -> None:
    """Display a figure as a PNG image output (anything else is displayed as it is)."""
    from IPython.display import display

    display(_renderable(result))


def live(fn: Callable[..., Any], /, **controls: Any) -> None:
    """Show ``fn(**defaults)`` now as an ordinary output, with widgets that redraw it in place.

    ``controls`` are ipywidgets ``interact`` abbreviations (``(1, 8)`` a slider, a list a
    dropdown, a bool a checkbox) or widgets; a control's initial value is ``fn``'s default for
    that argument. The first figure is a plain image output, so a notebook executed headless (CI,
    the docs site) shows the defaults; in JupyterLab moving a control re-runs ``fn`` and replaces
    the image (``display_id`` update). An invalid combination shows the error text instead.
    """
    import ipywidgets as widgets
    from IPython.display import display

    sig = inspect.signature(fn)
    made = {}
    for name, abbrev in controls.items():
        if name not in sig.parameters:
            raise ValueError(f"{fn.__name__} has no argument {name!r}")
        default = sig.parameters[name].default
        if isinstance(abbrev, widgets.Widget):
            w = abbrev
        else:
            kw = {} if default is inspect.Parameter.empty else {"default": default}
            w = widgets.interactive.widget_from_abbrev(abbrev, **kw)
            if w is None:
                raise ValueError(f"cannot make a widget for {name}={abbrev!r}")
        w.description = name
        w.style = {"description_width": "initial"}
        made[name] = w
    box = widgets.HBox(list(made.values()), layout=widgets.Layout(flex_flow="row wrap"))
    bundle = box._repr_mimebundle_()
    bundle["text/plain"] = (
        f"[interactive controls for {fn.__name__} ({', '.join(made)}): run this cell in "
        f"JupyterLab to use them]"
    )
    display(bundle, raw=True)

    def render() -> Any:
        try:
            return _renderable(fn(**{k: w.value for k, w in made.items()}))
        except (ValueError, ZeroDivisionError) as e:
            return _renderable(f"{type(e).__name__}: {e}")

    handle = display(render(), display_id=True)

    def update(_change: Any = None) -> None:
        handle.update(render())

    for w in made.values():
        w.observe(update, names="value")


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
