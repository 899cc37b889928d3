"""Figures of layouts and the all-to-all, from the library's own layout math (notebooks 1, 2, 5).

Every function takes plain numbers and returns a ``matplotlib.figure.Figure`` that is not
registered with pyplot (no global state); :func:`tutorial.widgets.show` displays it as a PNG and
:func:`tutorial.widgets.live` puts controls over it. Who holds what comes from
:mod:`dtensor_ulysses.debug` (torch-free functions of the placements), so a figure is the same
arithmetic the library and the checks use. Legend: B batch, S sequence, N q heads, K kv heads,
H head dim; ``X_sp`` means "dim X split over the sp mesh axis". (About 440 lines: one function
per figure, sharing the drawing helpers at the top, which :mod:`tutorial.sim_figures` uses too.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Rectangle
from matplotlib.ticker import FuncFormatter, NullFormatter

from dtensor_ulysses.debug import (
    head_ranges,
    kv_plan,
    layout_notation,
    mesh_ranks,
    ownership,
    parse_placement,
    token_ranges,
    ulysses_closed_form,
)
from tutorial.checks import stage_cells

__all__ = [
    "plot_a2a_bytes",
    "plot_gqa",
    "plot_mesh",
    "plot_placements",
    "plot_round_trip",
    "plot_training",
]

GREY = (0.92, 0.92, 0.92)


def placement_name(p: Any) -> str:
    d = parse_placement(p)
    return "Replicate()" if d is None else f"Shard({d})"


def new_figure(width: float, height: float) -> Figure:
    """A figure not registered with pyplot (no global state, nothing shown twice)."""
    return Figure(figsize=(width, height), layout="constrained")


def rank_color(rank: int) -> tuple[float, float, float]:
    return tuple(matplotlib.colormaps["tab10"](rank % 10)[:3])


def cell_grid(ax, image, xlabel: str = "", ylabel: str = "") -> None:
    """Show an RGB image of cells with white lines between cells."""
    rows, cols = image.shape[:2]
    ax.imshow(image, aspect="auto", interpolation="nearest")
    ax.set_xticks(np.arange(-0.5, cols, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, rows, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=0.8)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)


def log_axis(ax, which: str, ticks: Sequence[float] | None = None, fmt=None) -> None:
    """Log scale on ``which`` ("x" or "y") with plain tick labels (no 2x10^1)."""
    axis = ax.xaxis if which == "x" else ax.yaxis
    getattr(ax, f"set_{which}scale")("log")
    fmt = fmt or (lambda v: f"{v:g}")
    if ticks is not None:
        getattr(ax, f"set_{which}ticks")(list(ticks))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: fmt(v)))
    axis.set_minor_formatter(NullFormatter())


def few_ticks(n: int, k: int = 4) -> list[int]:
    step = max(1, -(-n // k))
    return list(range(0, n, step))


def check_positive(**values: int) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")


def plot_mesh(dp: int = 2, sp: int = 2):
    """The ``("dp", "sp")`` mesh as a grid: rows are sp groups, columns are dp groups."""
    check_positive(dp=dp, sp=sp)
    fig = new_figure(1.5 + 1.25 * sp, 1.2 + 0.95 * dp)
    ax = fig.add_subplot()
    for d, row in enumerate(mesh_ranks(dp, sp)):
        y = dp - 1 - d
        ax.add_patch(
            FancyBboxPatch(
                (-0.45, y - 0.45),
                sp - 0.1,
                0.9,
                boxstyle="round,pad=0.02",
                fill=False,
                ec="0.4",
                ls="--",
                lw=1,
            )
        )
        ax.text(sp - 0.4, y, f"  sp group {d}\n  ranks {row}", va="center", fontsize=8)
        for s, r in enumerate(row):
            ax.add_patch(Rectangle((s - 0.35, y - 0.35), 0.7, 0.7, color=rank_color(r), alpha=0.85))
            ax.text(
                s,
                y,
                f"rank {r}\n({d}, {s})",
                ha="center",
                va="center",
                fontsize=8,
                color="white",
                weight="bold",
            )
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
    check_positive(dp=dp, sp=sp, B=B, S=S, N=N)
    placements = (dp_placement, sp_placement)
    own = ownership((B, S, N, 1), placements, (dp, sp))
    fig = new_figure(0.6 + 2.3 * sp * max(1.0, S / 12), 0.8 + (0.35 * (B * N + B) + 0.9) * dp)
    axes = fig.subplots(dp, sp, squeeze=False)
    rows = B * N + (B - 1)  # one blank row between batch elements
    for rank, rng in own.items():
        d, s = divmod(rank, sp)
        (b0, b1), (s0, s1), (n0, n1), _ = rng
        img = np.ones((rows, S, 3))
        for b in range(B):
            img[b * (N + 1) : b * (N + 1) + N] = GREY
            if b0 <= b < b1:
                img[b * (N + 1) + n0 : b * (N + 1) + n1, s0:s1] = rank_color(rank)
        ax = axes[d][s]
        cell_grid(ax, img, xlabel="token", ylabel="")
        ax.set_xticks(few_ticks(S))
        ax.set_yticks([b * (N + 1) + (N - 1) / 2 for b in range(B)], [f"b={b}" for b in range(B)])
        local = [b1 - b0, s1 - s0, n1 - n0]
        ax.set_title(
            f"rank {rank} (dp={d}, sp={s})\nlocal [{local[0]}, {local[1]}, {local[2]}, H]",
            fontsize=8,
        )
    fig.suptitle(
        f"q[B={B}, S={S}, N={N}, H] with ({placement_name(dp_placement)}, "
        f"{placement_name(sp_placement)}) = {layout_notation(placements)}; rows: heads",
        fontsize=9,
    )
    return fig


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
            (:func:`tutorial.checks.cells_by_stage`); by default the plan is drawn.
    """
    check_positive(S=S, N=N, sp=sp)
    cells = (
        stage_cells(S, N, sp)
        if observed is None
        else {k: {int(r): {tuple(c) for c in v} for r, v in observed[k].items()} for k in observed}
    )
    toks, heads = token_ranges(S, sp), head_ranges(N, sp)
    tok_owner = [next(r for r, (a, b) in enumerate(toks) if a <= t < b) for t in range(S)]
    head_owner = [next(r for r, (a, b) in enumerate(heads) if a <= h < b) for h in range(N)]
    stages = [
        ("before", "before: Shard(1), q[B, S_sp, N, H]", lambda t, h: tok_owner[t], "to"),
        (
            "inside",
            "inside attention: Shard(2), q[B, S, N_sp, H]",
            lambda t, h: tok_owner[t],
            "from",
        ),
        (
            "after",
            "after head_to_seq: Shard(1), o[B, S_sp, N, H]",
            lambda t, h: head_owner[h],
            "from",
        ),
    ]
    # At most two ranks side by side, so the figure stays as wide as the docs' text (6.4 in at
    # 90 dpi) and its labels legible; each stage takes ceil(sp / 2) rows of panels.
    cols = min(sp, 2)
    per_stage = -(-sp // cols)
    fig = new_figure(6.4, 1.0 + 3 * per_stage * (0.75 + 0.2 * N))
    grid = fig.subplots(3 * per_stage, cols, squeeze=False)
    for row in range(3):  # the empty slot of an odd sp
        for r in range(sp, per_stage * cols):
            grid[row * per_stage + r // cols][r % cols].set_axis_off()
    for row, (key, title, color_of, word) in enumerate(stages):
        for r in range(sp):
            img = np.empty((N, S, 3))
            img[:] = GREY
            for t, h in cells[key].get(r, ()):
                img[h, t] = rank_color(color_of(t, h))
            ax = grid[row * per_stage + r // cols][r % cols]
            last = row == 2 and r // cols == per_stage - 1
            cell_grid(
                ax, img, xlabel="token" if last else "", ylabel="head" if r % cols == 0 else ""
            )
            ax.set_xticks(few_ticks(S))
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
                    ax.text(
                        (t0 + t1 - 1) / 2,
                        (h0 + h1 - 1) / 2,
                        f"{arrow}{peer}",
                        ha="center",
                        va="center",
                        fontsize=9,
                        color="black",
                        weight="bold",
                        bbox={"boxstyle": "round,pad=0.1", "fc": "white", "alpha": 0.7, "lw": 0},
                    )
    src = "measured on a gloo world" if observed is not None else "from the plan"
    fig.suptitle(
        f"seq -> head -> seq for S={S}, N={N}, sp={sp} ({src});\ncolor: the rank the chunk "
        f"comes from, label: the peer it goes to (\u2192) or came from (\u2190)",
        fontsize=9,
    )
    return fig


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
    cfs = [ulysses_closed_form(B, S, n_q, n_kv, H, sp, elem_bytes, rank=r) for r in range(sp)]
    cf = cfs[0]
    plan = kv_plan(n_q, n_kv, sp)
    s = S // sp
    m = np.array(
        [
            [
                B * s * (len(plan[d]["q_heads"]) + 2 * len(plan[d]["kv_heads"])) * H * elem_bytes
                for d in range(sp)
            ]
            for _ in range(sp)
        ]
    )
    fig = new_figure(6.4, 7.4)  # one column: as wide as the docs' text at 90 dpi
    ax0, ax1 = fig.subplots(2, 1, height_ratios=[1, 1])
    ax0.imshow(m, cmap="Blues", vmin=0, vmax=max(1, m.max()) * 2.5)
    for i in range(sp):
        for j in range(sp):
            ax0.text(
                j,
                i,
                f"{m[i, j]:,}",
                ha="center",
                va="center",
                fontsize=7,
                color="0.5" if i == j else "black",
            )
    ax0.set(xticks=range(sp), yticks=range(sp), xlabel="to rank (dst)", ylabel="from rank (src)")
    ax0.set_title("fused q,k,v all-to-all, bytes per chunk\n(diagonal stays local)", fontsize=9)
    x = np.arange(sp)
    width = 0.2
    fwd = cf["forward"]["bytes"]
    ax1.bar(
        x - 1.5 * width,
        [c["forward"]["bytes"] for c in cfs],
        width,
        color="0.75",
        label="closed form, forward",
    )
    ax1.bar(
        x - 0.5 * width,
        [c["backward"]["bytes"] for c in cfs],
        width,
        color="0.55",
        label="closed form, backward",
    )
    if measured is not None:
        ax1.bar(
            x + 0.5 * width,
            [r["forward"]["bytes"] for r in measured],
            width,
            color="tab:blue",
            label="measured (CommCounter), forward",
        )
        ax1.bar(
            x + 1.5 * width,
            [r["backward"]["bytes"] for r in measured],
            width,
            color="tab:orange",
            label="measured (CommCounter), backward",
        )
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
    plan = kv_plan(n_q, n_kv, sp)
    group = n_q // n_kv
    copies: dict[int, int] = {}
    for r in plan:
        for h in r["kv_heads"]:
            copies[h] = copies.get(h, 0) + 1
    k_prime = sum(copies.values())
    width = max(n_q, 1) + 3
    fig = new_figure(1.0 + 0.55 * width, 0.9 + 0.62 * (sp + 1))
    ax = fig.add_subplot()

    def box(x, y, text, color, hatch=None):
        ax.add_patch(Rectangle((x, y), 0.9, 0.7, fc=color, ec="0.2", lw=0.6, hatch=hatch))
        ax.text(x + 0.45, y + 0.35, text, ha="center", va="center", fontsize=7)

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


def plot_training(runs: Mapping[str, Sequence[Mapping[str, Any]]]):
    """Loss and tokens/s per step for several runs (``--metrics-file`` records, by label)."""
    fig = new_figure(6.4, 6.4)  # one column: as wide as the docs' text at 90 dpi
    ax0, ax1 = fig.subplots(2, 1)
    styles = ["o-", "s--", "^:", "v-.", "d-"]
    for i, (name, recs) in enumerate(runs.items()):
        steps = [r["step"] for r in recs]
        ax0.plot(
            steps,
            [r["loss"] for r in recs],
            styles[i % len(styles)],
            ms=7 - 1.5 * i,
            mfc="none",
            color=rank_color(i),
            label=name,
        )
        ax1.plot(
            steps,
            [r["tokens_per_s"] for r in recs],
            styles[i % len(styles)],
            ms=4,
            color=rank_color(i),
            label=name,
        )
    ax0.set(xlabel="step", ylabel="loss (token-weighted cross entropy)")
    ax0.set_title("loss: same global batch and seed for every layout", fontsize=9)
    ax0.legend(fontsize=8)
    ax1.set(xlabel="step", ylabel="tokens / s (whole job)")
    ax1.set_title("throughput (CPU, gloo; first step includes warm-up)", fontsize=9)
    ax1.legend(fontsize=8)
    return fig
