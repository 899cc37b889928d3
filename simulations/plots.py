"""Plots for ``--plot FILE.png``: communication volume vs sequence and sp per method; memory vs
sequence per sp; longest sequence per layout. matplotlib is imported only here, on demand.
"""

from __future__ import annotations

from typing import Any

from simulations.config import METHODS, Workload, divisors
from simulations.predict import predict

__all__ = ["plot_plan", "plot_workload", "require_matplotlib"]

GiB = 2**30


def require_matplotlib():
    """``matplotlib.pyplot`` with the non-interactive backend, or a clear ImportError."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "--plot needs matplotlib, which is not installed; install it with "
            "`pip install matplotlib` (or the project's [notebooks] extra)"
        ) from None
    return plt


def _attn_comm(w: Workload) -> float:
    """Attention-method bytes per rank per step (input buffers), FSDP and loss excluded."""
    p = predict(w)
    return sum(
        c.per_step(w.shape.n_layers)[1]
        for c in p.comm.items
        if c.group not in ("dp_sp", "dp", "world")
    )


def _try(fn, *args):
    try:
        return fn(*args)
    except ValueError:
        return None


def _series(w: Workload, seqs: list[int], key) -> dict[str, list[float | None]]:
    out = {}
    for m in METHODS:
        out[m] = [_try(lambda s, m=m: key(w.with_(attention=m, seq_len=s)), s) for s in seqs]
    return out


def plot_workload(w: Workload, path: str) -> None:
    """Three panels around ``w``: volume vs S (per method), volume vs sp, memory vs S per sp."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(1, 3, figsize=(17, 4.8))
    step = w.sp * 1024
    seqs = sorted({max(step, (w.seq_len * k // 8) // step * step) for k in range(1, 17)})
    for m, ys in _series(w, seqs, _attn_comm).items():
        pts = [(s, y / GiB) for s, y in zip(seqs, ys) if y is not None]
        if pts:
            ax[0].plot(*zip(*pts), marker="o", label=m)
    ax[0].set(
        title=f"attention comm per rank per step, sp={w.sp}",
        xlabel="sequence length",
        ylabel="GiB (input buffers)",
    )
    ax[0].legend()
    sps = [d for d in divisors(max(64, w.sp)) if d > 1]
    for m in METHODS:
        pts = []
        for P in sps:
            y = _try(lambda P=P, m=m: _attn_comm(w.with_(attention=m, sp=P, dp=1)))
            if y is not None:
                pts.append((P, y / GiB))
        if pts:
            ax[1].plot(*zip(*pts), marker="o", label=m)
    ax[1].set(
        title=f"attention comm per rank, S={w.seq_len:,}",
        xlabel="sp degree",
        ylabel="GiB",
        yscale="log",
    )
    ax[1].set_xscale("log", base=2)
    ax[1].set_xticks(sps, [str(P) for P in sps])
    ax[1].minorticks_off()
    ax[1].legend()
    for P in [d for d in divisors(w.shape.n_heads) if d <= max(64, w.sp)]:
        pts = []
        for s in seqs:
            if s % P == 0:
                p = _try(lambda s=s, P=P: predict(w.with_(sp=P, dp=1, seq_len=s)))
                if p is not None:
                    pts.append((s, p.memory.peak / GiB))
        if pts:
            ax[2].plot(*zip(*pts), marker=".", label=f"sp={P}")
    ax[2].axhline(w.gpu.usable_bytes / GiB, color="k", ls="--", label=f"{w.gpu.name} usable")
    ax[2].set(title=f"peak memory per rank ({w.attention})", xlabel="sequence length", ylabel="GiB")
    ax[2].legend(fontsize=7)
    fig.suptitle(f"{w.shape.name}, {w.gpu.name}, ac={w.ac}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_plan(pl, path: str, **options: Any) -> None:
    """Longest trainable sequence per layout, and memory vs sequence per layout (the
    planner's Ulysses x Ring rows included, predicted as USP over ``sp * ring`` ranks)."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    valid = [x for x in pl.layouts if x.valid]
    labels = [f"dp={x.dp}\n{x.label.replace(' x ', chr(10))}" for x in valid]
    ax[0].bar(labels, [x.max_seq_len for x in valid])
    ax[0].set(title=f"longest sequence, {pl.model} on {pl.gpus}x {pl.gpu}", ylabel="tokens")
    for x in valid:
        deg = x.seq_degree  # Ulysses x Ring: usp over sp * ring ranks, Ulysses inside sp
        hybrid = {"attention": "usp", "ulysses_degree": x.sp} if x.ring > 1 else {}
        top = max(x.max_seq_len, 1024 * deg)
        seqs = [top * k // 8 // deg * deg for k in range(1, 11)]
        pts = []
        for s in seqs:
            if s <= 0:
                continue
            p = _try(lambda s=s, x=x, deg=deg, hybrid=hybrid: predict(
                pl.model, s, dp=x.dp, sp=deg, gpu=pl.gpu, **{**options, **hybrid}))  # fmt: skip
            if p is not None:
                pts.append((s, p.memory.peak / GiB))
        if pts:
            ls = "--" if x.ring > 1 else "-"  # a hybrid's memory is its pure twin's: dashed on top
            ax[1].plot(*zip(*pts), marker=".", ls=ls, label=f"dp={x.dp} {x.label}")
    if valid and valid[0].prediction is not None:
        ax[1].axhline(valid[0].prediction.memory.capacity / GiB, color="k", ls="--", label="usable")
    ax[1].set(title="peak memory per rank", xlabel="sequence length", ylabel="GiB", xscale="log")
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
