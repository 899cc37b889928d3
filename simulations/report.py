"""Simulator results as rows and text: memory sweeps, out-of-memory walls, method and plan tables.

Torch-free, like the rest of ``simulations`` outside its measurement modules. The tutorial
notebooks (``notebooks/tutorial/figures.py``) plot these rows; each function is also usable on
its own::

    >>> from simulations import report
    >>> print(report.methods_table("llama3-8b", seq_len=131072, sp=8, gpu="h100"))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from simulations.config import METHODS, Workload
from simulations.hardware import get_gpu
from simulations.planner import max_seq_len
from simulations.planner import plan as _plan
from simulations.predict import Prediction, predict

__all__ = [
    "MEMORY_GROUPS",
    "activation_table",
    "attention_comm",
    "fmt_tokens",
    "format_plan",
    "gpu_with_links",
    "memory_groups",
    "memory_sweep",
    "method_point",
    "methods_table",
    "oom_walls",
    "plan_report",
    "predicted_block_activations",
    "valid_sps",
]

GiB = 2**30

# simulator memory components -> the groups the notebooks show
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

# collectives of these groups are not the attention method's (FSDP, data parallel, loss)
_NOT_ATTENTION_GROUPS = ("dp_sp", "dp", "world")


def fmt_tokens(n: float) -> str:
    """Tokens with binary prefixes: ``131072 -> "128K"``, ``33280 -> "32.5K"``."""
    for unit, k in (("M", 2**20), ("K", 2**10)):
        if n >= k:
            return f"{n / k:.1f}".rstrip("0").rstrip(".") + unit
    return f"{n:.0f}"


# ----------------------------------------------------------------------------------------------
# memory
# ----------------------------------------------------------------------------------------------
def memory_groups(components: Mapping[str, float]) -> dict[str, float]:
    """Simulator memory components (bytes) summed into :data:`MEMORY_GROUPS`.

    A component the mapping does not name is counted under ``"other"``, so the groups always add
    up to the simulator's peak.
    """
    out = dict.fromkeys(MEMORY_GROUPS, 0.0)
    known = {c: g for g, cs in MEMORY_GROUPS.items() for c in cs}
    for comp, v in components.items():
        if comp != "peak":
            out[known.get(comp, "other")] += float(v)
    return out


def valid_sps(model: Any, gpus: int) -> list[int]:
    """The sp degrees that divide ``gpus`` and that the model's heads allow."""
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
    """Per-rank memory by group for every (sp, S) on ``gpus`` GPUs (``dp = gpus / sp``).

    Model states are sharded over the same ``gpus`` ranks (FSDP2 over dp x sp) for every sp, so
    only what depends on tokens changes.

    Returns:
        rows ``{"sp", "dp", "seq_len", "peak", "capacity", "fits", "groups": {group: bytes}}``;
        combinations the simulator rejects are left out.
    """
    sps = list(sps) if sps is not None else valid_sps(model, gpus)
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
    sps = list(sps) if sps is not None else valid_sps(model, gpus)
    return {
        sp: max_seq_len(Workload(shape=model, seq_len=sp, dp=gpus // sp, sp=sp, gpu=gpu, **options))
        for sp in sps
    }


def predicted_block_activations(
    model: Any, seq_len: int, dp: int, sp: int, dtype: str = "fp32", micro_batch: int = 1
) -> float:
    """Bytes the transformer blocks save for backward on one rank, without checkpointing.

    ``n_layers x`` the simulator's per-layer activation bytes (``memory.per_layer["no_ac"]``).
    """
    p = predict(model, seq_len, dp=dp, sp=sp, dtype=dtype, ac="none", micro_batch=micro_batch)
    return float(p.memory.per_layer["no_ac"] * p.workload.shape.n_layers)


def activation_table(measured: Sequence[Mapping[str, Any]], model: str = "tiny") -> str:
    """Measured vs predicted saved-activation bytes per rank, one line per (sp, S).

    Args:
        measured: rows ``{"dp", "sp", "seq_len", "local_tokens", "blocks_bytes",
            "other_bytes"}`` (what notebook 3 measures on the real model).
    """
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


# ----------------------------------------------------------------------------------------------
# communication
# ----------------------------------------------------------------------------------------------
def attention_comm(prediction: Prediction) -> dict[str, float]:
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


def gpu_with_links(
    gpu: Any,
    intra_gbps: float | None = None,
    inter_gbps: float | None = None,
    gpus_per_node: int | None = None,
):
    """A GPU profile with its links overridden (GB/s inside and across nodes, GPUs per node)."""
    g = get_gpu(gpu)
    changes: dict[str, Any] = {}
    if intra_gbps:
        changes["intra_bw"] = intra_gbps * 1e9
    if inter_gbps:
        changes["inter_bw"] = inter_gbps * 1e9
    if gpus_per_node:
        changes["gpus_per_node"] = gpus_per_node
    return g.with_(**changes) if changes else g


def method_point(
    model: Any, seq_len: int, sp: int, gpu: Any, method: str, **options: Any
) -> Prediction | None:
    """``predict`` on ``dp=1`` with one attention method, or ``None`` where it cannot run."""
    try:
        return predict(model, seq_len, dp=1, sp=sp, gpu=gpu, attention=method, **options)
    except ValueError:
        return None


def methods_table(
    model: str = "llama3-8b", seq_len: int = 131072, sp: int = 8, gpu: str = "h100", **options: Any
) -> str:
    """Every attention method at one (S, P): attention bytes, time, step time, tokens/s."""
    lines = [
        f"{model}, S={seq_len:,}, P={sp}, {gpu} (per rank per step, attention collectives only)",
        f"{'method':>12} {'GiB in':>8} {'GiB sent':>9} {'comm s':>8} {'exposed*':>10} "
        f"{'step s':>8} {'tokens/s':>10}",
    ]
    for m in METHODS:
        p = method_point(model, seq_len, sp, gpu, m, **options)
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


# ----------------------------------------------------------------------------------------------
# the planner
# ----------------------------------------------------------------------------------------------
def plan_report(
    model: str = "llama3-8b",
    gpus: int = 8,
    gpu: str = "h100",
    seq_len: int | None = None,
    ac: str = "full",
    tiled_loss: bool = False,
) -> str:
    """The planner's ranking of (dp, sp) layouts as text (``simulations.plan``)."""
    return format_plan(_plan(model, gpus, gpu, seq_len=seq_len, ac=ac, tiled_loss=tiled_loss))


def format_plan(plan: Any) -> str:
    """A planner result (``simulations.plan``) as a text table, best layout first."""
    lines = [
        f"{plan.model} on {plan.gpus}x {plan.gpu}"
        + (f", target S={plan.seq_len:,}" if plan.seq_len else ""),
        f"{'dp':>3} {'ring':>4} {'sp':>3} {'max seq':>10} {'tokens/s':>12}  why",
    ]
    for x in plan.layouts:
        ring = getattr(x, "ring", 1)
        if not x.valid:
            lines.append(f"{x.dp:>3} {ring:>4} {x.sp:>3} {'-':>10} {'-':>12}  invalid: {x.why}")
            continue
        lines.append(
            f"{x.dp:>3} {ring:>4} {x.sp:>3} {x.max_seq_len:>10,} {x.tokens_per_s:>12,.0f}  {x.why}"
        )
    if plan.best is not None:
        ring = getattr(plan.best, "ring", 1)
        layout = f"dp={plan.best.dp}" + (f", ring={ring}" if ring > 1 else "")
        lines.append(f"recommendation: {layout}, sp={plan.best.sp}")
    return "\n".join(lines)
