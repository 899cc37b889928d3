"""Figures from the simulator (notebooks 3 and 4): memory per rank, the OOM wall, traffic,
pure Ulysses against Ulysses x Ring.

Rows come from :mod:`simulations.report` and :mod:`simulations.planner` (torch-free); the plotting
helpers are :mod:`tutorial.figures`'. Every ``plot_*`` function returns a
``matplotlib.figure.Figure``. (About 400 lines: one function per figure, plus the rows and table
of the Ulysses x Ring figure.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.ticker import FuncFormatter, MultipleLocator

import simulations as sim
from simulations import METHODS
from simulations.planner import hybrid_split
from simulations.report import (
    MEMORY_GROUPS,
    attention_comm,
    fmt_tokens,
    gpu_with_links,
    memory_sweep,
    method_point,
    oom_walls,
    predicted_block_activations,
)
from tutorial.figures import log_axis, new_figure, rank_color

__all__ = [
    "hybrid_rows",
    "hybrid_table",
    "plot_activation_check",
    "plot_comm_methods",
    "plot_hybrid",
    "plot_memory_scaling",
]

GiB = 2**30


_GROUP_COLORS = {
    "weights": "tab:blue",
    "grads": "tab:cyan",
    "optimizer": "tab:purple",
    "activations": "tab:orange",
    "logits": "tab:red",
    "other": "tab:gray",
}


def plot_memory_scaling(
    model: str = "llama3-8b",
    gpu: str = "h100",
    gpus: int = 8,
    ac: str = "full",
    tiled_loss: bool = False,
    seq_len: int = 65536,
):
    """Per-rank memory vs sequence length for every valid sp, the components, and the wall.

    Top: peak per rank vs S (one line per sp; solid where it fits, dotted beyond); the dashed line
    is the GPU's usable memory. Bottom left: the components at ``seq_len`` for each sp. Bottom
    right: the longest sequence that fits (the out-of-memory wall) for each sp. All from the
    simulator, bf16, FSDP2 over all ``gpus`` ranks with ``dp = gpus / sp``. Two rows, 6.4 in wide:
    at the notebooks' 90 dpi that is the docs column's width, so its 8 pt text is shown at 8 pt.
    """
    opts = {"ac": ac, "tiled_loss": tiled_loss}
    rows = memory_sweep(model, gpu, gpus, **opts)
    walls = oom_walls(model, gpu, gpus, **opts)
    sps = sorted(walls)
    fig = new_figure(6.4, 7.4)
    grid = fig.add_gridspec(2, 2, height_ratios=[1.15, 1])
    ax0 = fig.add_subplot(grid[0, :])
    ax1, ax2 = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    cap = rows[0]["capacity"] / GiB if rows else 0
    for sp in sps:
        pts = [(r["seq_len"], r["peak"] / GiB, r["fits"]) for r in rows if r["sp"] == sp]
        color = rank_color(sps.index(sp))
        xs, ys, fits = zip(*pts)
        ax0.plot(xs, ys, ":", color=color, lw=1)
        ok = [(x, y) for x, y, f in pts if f]
        if ok:
            ax0.plot(*zip(*ok), "o-", ms=3, color=color, label=f"sp={sp} (dp={gpus // sp})")
        if walls[sp]:
            ax0.axvline(walls[sp], color=color, lw=0.8, alpha=0.6)
    ax0.axhline(cap, color="k", ls="--", lw=1, label=f"{gpu} usable ({cap:.0f} GiB)")
    ax0.set(xlabel="sequence length S", ylabel="GiB per rank", ylim=(0, cap * 1.6))
    log_axis(ax0, "x", [2**k for k in range(11, 23, 2)], fmt_tokens)
    ax0.set_title("peak memory per rank (vertical lines: the OOM wall)", fontsize=10)
    ax0.legend(fontsize=8, ncol=2, loc="upper left")
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
    ax1.set_title(f"components at S={fmt_tokens(seq_len)}\n(the peak moment)", fontsize=10)
    ax1.legend(fontsize=8)
    # the wall
    vals = [walls[sp] for sp in sps]
    bars = ax2.bar(labels, vals, color=[rank_color(i) for i in range(len(sps))])
    base = walls[sps[0]] or None
    for b, v in zip(bars, vals):
        txt = fmt_tokens(v) + (f"\n({v / base:.1f}x)" if base and v else "")
        ax2.text(b.get_x() + b.get_width() / 2, v, txt, ha="center", va="bottom", fontsize=8)
    ax2.set(ylabel="tokens", ylim=(0, max(vals + [1]) * 1.25))
    top = max(vals + [1])
    ax2.yaxis.set_major_locator(MultipleLocator(2 ** max(10, math.ceil(math.log2(top / 5)))))
    ax2.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: fmt_tokens(v)))
    ax2.set_title("longest sequence that fits\n(the OOM wall)", fontsize=10)
    for ax in (ax0, ax1, ax2):
        ax.tick_params(labelsize=8)
        ax.xaxis.label.set_size(9)
        ax.yaxis.label.set_size(9)
    fig.suptitle(
        f"{model} on {gpus}x {gpu}, bf16, ac={ac}, tiled_loss={tiled_loss} (simulator)",
        fontsize=10,
    )
    return fig


def plot_activation_check(measured: Sequence[Mapping[str, Any]], model: str = "tiny"):
    """Measured saved-activation bytes of the real model vs the simulator, per rank.

    Args:
        measured: rows ``{"dp", "sp", "seq_len", "blocks_bytes", ...}`` from
            ``notebook_workers.activation_memory_worker`` (one micro-batch per rank, fp32, CPU).
    """
    sps = sorted({r["sp"] for r in measured})
    seqs = sorted({r["seq_len"] for r in measured})
    fig = new_figure(6.4, 6.6)  # one column: as wide as the docs' text at 90 dpi
    ax0, ax1 = fig.subplots(2, 1)
    for i, sp in enumerate(sps):
        rows = sorted((r for r in measured if r["sp"] == sp), key=lambda r: r["seq_len"])
        color = rank_color(i)
        dp = rows[0]["dp"]
        pred = [predicted_block_activations(model, S, dp, sp) for S in seqs]
        ax0.plot(
            seqs, [p / 2**20 for p in pred], "-", color=color, lw=1.2, label=f"simulator, sp={sp}"
        )
        ax0.plot(
            [r["seq_len"] for r in rows],
            [r["blocks_bytes"] / 2**20 for r in rows],
            "o",
            color=color,
            ms=6,
            mfc="none",
            mew=1.5,
            label=f"measured, sp={sp}",
        )
        ratio = [
            r["blocks_bytes"] / predicted_block_activations(model, r["seq_len"], dp, sp)
            for r in rows
        ]
        ax1.plot([r["seq_len"] for r in rows], ratio, "o-", color=color, label=f"sp={sp}")
    ax0.set(xlabel="sequence length S", ylabel="MiB per rank")
    log_axis(ax0, "x", seqs)
    log_axis(ax0, "y")
    ax0.set_title("activations the blocks save for backward, per rank", fontsize=9)
    ax0.legend(fontsize=7, ncol=2)
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.set(xlabel="sequence length S", ylabel="measured / simulator", ylim=(0.8, 1.2))
    log_axis(ax1, "x", seqs)
    ax1.set_title("measured / predicted", fontsize=9)
    ax1.legend(fontsize=7)
    fig.suptitle(
        f"{model} preset, fp32 on CPU, no checkpointing, one sequence per rank:\nmeasured with "
        f"torch.autograd.graph.saved_tensors_hooks (unique storages, parameters excluded)",
        fontsize=9,
    )
    return fig


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
    from dtensor_ulysses.plan import get_shape

    shape = get_shape(model) if isinstance(model, str) else model
    if kv_heads:
        shape = shape.with_(n_kv_heads=kv_heads)
    g = gpu_with_links(gpu, intra_gbps, inter_gbps, gpus_per_node)
    colors = dict(zip(METHODS, ("tab:blue", "tab:green", "tab:red", "tab:purple")))
    fig = new_figure(6.4, 7.8)  # two by two: as wide as the docs' text at 90 dpi
    (ax0, ax1), (ax2, ax3) = fig.subplots(2, 2)
    seqs = [2**k for k in range(13, 21)]
    Ps = [2**k for k in range(1, 7)]
    for m in METHODS:
        pts = [(S, method_point(shape, S, sp, g, m)) for S in seqs]
        pts = [(S, attention_comm(p)["bytes"] / GiB) for S, p in pts if p is not None]
        if pts:
            ax0.plot(*zip(*pts), "o-", ms=3, color=colors[m], label=m)
        by_p = [(P, method_point(shape, seq_len, P, g, m)) for P in Ps]
        by_p = [(P, p) for P, p in by_p if p is not None]
        if by_p:
            ax1.plot(
                [P for P, _ in by_p],
                [attention_comm(p)["bytes"] / GiB for _, p in by_p],
                "o-",
                ms=3,
                color=colors[m],
                label=m,
            )
            ax2.plot(
                [P for P, _ in by_p],
                [attention_comm(p)["time_s"] for _, p in by_p],
                "o-",
                ms=3,
                color=colors[m],
                label=m,
            )
    per_rank = seq_len // sp
    fixed = [(P, method_point(shape, per_rank * P, P, g, "ulysses")) for P in Ps]
    fixed = [(P, attention_comm(p)["bytes"] / GiB) for P, p in fixed if p is not None]
    if fixed:
        ax1.plot(
            *zip(*fixed),
            "--",
            color=colors["ulysses"],
            lw=1,
            label=f"ulysses at S/P={fmt_tokens(per_rank)}",
        )
    ax0.set(xlabel="sequence length S", ylabel="GiB per rank per step")
    log_axis(ax0, "x", seqs[::2], fmt_tokens)
    log_axis(ax0, "y")
    ax0.set_title(f"volume vs S (P={sp})", fontsize=9)
    ax1.set(xlabel="P (sequence-parallel ranks)", ylabel="GiB per rank per step")
    log_axis(ax1, "x", Ps)
    log_axis(ax1, "y")
    ax1.set_title(f"volume vs P (S={fmt_tokens(seq_len)})", fontsize=9)
    for ax in (ax0, ax1):
        ax.legend(fontsize=7)
    ax2.axvspan(g.gpus_per_node, Ps[-1] * 1.5, color="0.9")
    ax2.text(
        g.gpus_per_node * 1.1,
        0.98,
        "group spans nodes",
        transform=ax2.get_xaxis_transform(),
        va="top",
        fontsize=7,
    )
    ax2.set(xlabel="P", ylabel="seconds per step (if not overlapped)")
    log_axis(ax2, "x", Ps)
    log_axis(ax2, "y")
    ax2.set_title(
        f"comm time vs P: NVLink {g.intra_bw / 1e9:.0f} GB/s\ninside a node of "
        f"{g.gpus_per_node}, {g.inter_bw / 1e9:.0f} GB/s across",
        fontsize=8,
    )
    ax2.legend(fontsize=7)
    names, comp, exposed = [], [], []
    for m in METHODS:
        p = method_point(shape, seq_len, sp, g, m)
        if p is None:
            continue
        names.append(m)
        comp.append(p.time.compute)
        exposed.append(p.time.comm_exposed)
    ax3.bar(names, comp, color="0.7", label="compute")
    ax3.bar(names, exposed, bottom=comp, color=[colors[n] for n in names], label="exposed comm")
    ax3.set(ylabel="seconds per step")
    ax3.set_title(f"step time at S={fmt_tokens(seq_len)}, P={sp}", fontsize=9)
    ax3.legend(fontsize=7)
    ax3.tick_params(axis="x", labelsize=7)
    fig.suptitle(
        f"{shape.name}: N={shape.n_heads} q heads, K={shape.n_kv_heads} kv heads; {g.name};\n"
        f"attention collectives only (FSDP excluded); simulator",
        fontsize=10,
    )
    return fig


def hybrid_rows(
    model: str = "llama3-8b",
    tokens_per_gpu: int = 32768,
    gpu: str = "h100",
    gpus: Sequence[int] = (4, 8, 16, 32, 64),
) -> list[dict[str, Any]]:
    """Pure Ulysses (``sp = P``) and the planner's Ulysses x Ring split of the same ``P`` GPUs
    (:func:`simulations.planner.hybrid_split`), ``dp = 1``, at ``S = tokens_per_gpu * P``.

    Returns:
        one row per (P, method) that can run: ``{"gpus", "method", "sp", "ring", "a2a_bytes",
        "p2p_bytes", "comm_s", "exposed_s", "tokens_per_s", "fits"}``; bytes per rank per step
        (attention collectives), ``comm_s`` their time if nothing overlapped, ``exposed_s`` the
        step's exposed communication (FSDP included). A method that cannot run a ``P`` (pure
        Ulysses past the q heads) or is not proposed for it (no hybrid where pure Ulysses is
        clean) has no row.
    """
    g = sim.get_gpu(gpu)
    shape = sim.Workload(shape=model, seq_len=1).shape
    rows = []
    for P in gpus:
        split = hybrid_split(shape, P, g.gpus_per_node)
        layouts = [("ulysses", P, 1, {})]
        if split:
            layouts.append(
                ("ulysses x ring", *split, {"attention": "usp", "ulysses_degree": split[0]})
            )
        for method, sp, ring, opts in layouts:
            p = method_point(
                shape,
                tokens_per_gpu * P,
                P,
                g,
                opts.get("attention", "ulysses"),
                **{k: v for k, v in opts.items() if k != "attention"},
            )
            if p is None:
                continue
            rows.append({
                "gpus": P, "method": method, "sp": sp, "ring": ring,
                "a2a_bytes": p.comm.bytes_by_kind["all_to_all"],
                "p2p_bytes": p.comm.bytes_by_kind["p2p"],
                "comm_s": attention_comm(p)["time_s"], "exposed_s": p.time.comm_exposed,
                "tokens_per_s": p.tokens_per_s, "fits": p.fits,
            })  # fmt: skip
    return rows


def hybrid_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """:func:`hybrid_rows` as text, one line per (P, method)."""
    lines = [
        f"{'GPUs':>4} {'method':>15} {'sp x ring':>9} {'a2a GiB':>8} {'p2p GiB':>8} "
        f"{'comm s':>7} {'exposed s':>9} {'tokens/s':>9}"
    ]
    for r in rows:
        lines.append(
            f"{r['gpus']:>4} {r['method']:>15} {r['sp']:>4} x {r['ring']:<2} "
            f"{r['a2a_bytes'] / GiB:>8.1f} {r['p2p_bytes'] / GiB:>8.1f} {r['comm_s']:>7.2f} "
            f"{r['exposed_s']:>9.2f} {r['tokens_per_s']:>9,.0f}" + ("" if r["fits"] else "  OOM")
        )
    return "\n".join(lines)


def plot_hybrid(model: str = "llama3-8b", tokens_per_gpu: int = 32768, gpu: str = "h100"):
    """Pure Ulysses vs Ulysses x Ring as the GPU count grows at ``tokens_per_gpu`` per GPU.

    Left: attention communication per step (dashed: its time if nothing overlapped; solid: the
    step's exposed communication), with the region where an sp group of pure Ulysses spans nodes
    shaded and the kv- and q-head ceilings marked. Right: bytes per rank per step, all-to-all and
    ring p2p. All from the simulator (:func:`hybrid_rows`).
    """
    rows = hybrid_rows(model, tokens_per_gpu, gpu)
    g = sim.get_gpu(gpu)
    shape = sim.Workload(shape=model, seq_len=1).shape
    colors = {"ulysses": "tab:blue", "ulysses x ring": "tab:purple"}
    fig = new_figure(6.4, 7.4)  # one column: as wide as the docs' text at 90 dpi
    ax0, ax1 = fig.subplots(2, 1)
    Ps = sorted({r["gpus"] for r in rows})
    for method, color in colors.items():
        mine = [r for r in rows if r["method"] == method]
        if not mine:
            continue
        xs = [r["gpus"] for r in mine]
        ax0.plot(xs, [r["comm_s"] for r in mine], "--", color=color, lw=1)
        ax0.plot(xs, [r["exposed_s"] for r in mine], "o-", ms=4, color=color, label=method)
        ax1.plot(xs, [r["a2a_bytes"] / GiB for r in mine], "o-", ms=4, color=color,
                 label=f"{method}: all-to-all")  # fmt: skip
        if any(r["p2p_bytes"] for r in mine):
            ax1.plot(xs, [r["p2p_bytes"] / GiB for r in mine], "s:", ms=4, color=color,
                     label=f"{method}: ring p2p")  # fmt: skip
    for ax in (ax0, ax1):
        ax.axvspan(g.gpus_per_node * 1.05, Ps[-1] * 1.3, color="0.93")
        ax.text(g.gpus_per_node * 1.15, 0.02, "pure Ulysses' group spans nodes",
                transform=ax.get_xaxis_transform(), fontsize=7)  # fmt: skip
        for at, what in ((shape.n_kv_heads, "kv heads replicated"), (shape.n_heads, "no q head")):
            ax.axvline(at, color="0.4", lw=0.8, ls=":")
            ax.text(at * 1.04, 0.97, f"P > {at}:\n{what}", transform=ax.get_xaxis_transform(),
                    fontsize=7, va="top")  # fmt: skip
        log_axis(ax, "x", Ps)
        ax.set_xlabel("GPUs (P = sp x ring, dp = 1)")
        ax.legend(fontsize=7, loc="center left")
    log_axis(ax0, "y", [0.1, 0.2, 0.5, 1, 2, 5])
    ax0.set(ylabel="seconds per step")
    ax0.set_title("exposed communication (solid) and if nothing overlapped (dashed)", fontsize=9)
    ax1.set(ylabel="GiB per rank per step")
    ax1.set_title("bytes per rank: all-to-all and ring p2p", fontsize=9)
    fig.suptitle(
        f"{shape.name} ({shape.n_heads} q, {shape.n_kv_heads} kv heads) on {gpu}, "
        f"{fmt_tokens(tokens_per_gpu)} tokens per GPU;\nshaded: beyond a node of "
        f"{g.gpus_per_node}; simulator",
        fontsize=10,
    )
    return fig
