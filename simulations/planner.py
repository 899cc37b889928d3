"""Planner: for a model, a GPU count and a GPU type, rank the (dp, sp) and (dp, ring, sp) layouts.

For every ``sp`` dividing the GPU count (``dp = gpus / sp``) the planner finds the longest sequence
that fits in memory (binary search over multiples of ``sp * 256`` tokens; the peak grows with the
sequence) and the throughput, and says why each layout loses to the best one.

Ulysses x Ring (USP; the library's ``("dp", "ring", "sp")`` mesh). Pure Ulysses over ``P``
sequence-parallel ranks hits a ceiling when ``P`` exceeds the q heads (invalid), when ``P``
replicates kv heads (``K' > K``: more all-to-all bytes, :func:`~simulations.comm.
kv_heads_after_replication`), or when its group spans nodes (the all-to-all runs at one NIC's
rate, ``GpuProfile.inter_bw``, instead of NVLink's). For such a ``P`` the planner also evaluates
the hybrid :func:`hybrid_split` proposes: ``sp`` (the Ulysses degree) the largest divisor of
``P`` that divides the q heads, replicates no kv head and fits in a node, and ``ring = P / sp``.
It is costed as ``attention="usp"`` with ``ulysses_degree=sp`` (:mod:`simulations.comm`: the
ring's p2p bytes are the library's :func:`dtensor_ulysses.plan.ring_closed_form`;
:mod:`simulations.timing`: the p2p hides behind the ring step's attention, the all-to-all does
not). Its row reports ``sp`` and ``ring`` as the library's mesh does (``dp * ring * sp`` GPUs).
No constant is added for it: bandwidths, latencies and efficiencies are the GPU profile's.

Under Ulysses, ``sp`` need not divide the q heads (only ``sp > N`` is invalid): such a layout runs
with an attention load imbalance (``max n_r * P / N``, :attr:`Workload.attention_imbalance`)
that slows its busiest rank (the step) and grows that rank's attention memory; its GQA kv heads may
also be replicated more (more all-to-all bytes). All of it enters its throughput and its longest
sequence, so it ranks lower than a balanced layout unless it trains a longer sequence; its ``why``
names the imbalance and what it costs.

Ranking: with a target ``seq_len``, layouts that fit it come first, fastest first; without one,
the longest trainable sequence wins and throughput at a common reference length breaks ties; the
smaller imbalance breaks any tie left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dtensor_ulysses.plan import ModelShape, check_ring_seq, get_shape
from simulations.comm import kv_heads_after_replication
from simulations.config import Workload, divisors
from simulations.hardware import GpuProfile, get_gpu
from simulations.predict import Prediction, predict

__all__ = ["Layout", "Plan", "hybrid_split", "max_seq_len", "plan"]

GRANULE = 256  # the search moves in steps of sp * GRANULE tokens
MAX_TOKENS = 2**28  # search ceiling (268M tokens)
GiB = 2**30


def max_seq_len(w: Workload) -> int:
    """Longest sequence (a multiple of ``sp * 256``) whose predicted peak fits; 0 if none."""
    step = w.sp * GRANULE

    def fits(k: int) -> bool:
        return predict(w.with_(seq_len=k * step)).fits

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi * step > MAX_TOKENS:
            return lo * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo * step


def hybrid_split(shape: ModelShape, degree: int, gpus_per_node: int) -> tuple[int, int] | None:
    """The Ulysses x Ring split for ``degree`` sequence-parallel ranks: ``(sp, ring)`` with
    ``sp * ring = degree``, or ``None`` when pure Ulysses over ``degree`` ranks hits no ceiling.

    The ceilings of pure Ulysses: ``degree`` above the q heads (a rank would hold no head),
    kv heads replicated (``K' > K``), an all-to-all group wider than a node. The hybrid's ``sp``
    is the largest divisor of ``degree`` that divides the q heads, keeps ``K' = K`` and fits in a
    node (``sp = 1``, a plain ring, always qualifies).

    >>> from dtensor_ulysses.plan.presets import get_shape
    >>> hybrid_split(get_shape("llama3-8b"), 32, 8), hybrid_split(get_shape("llama3-8b"), 8, 8)
    ((8, 4), None)
    """
    N, K = shape.n_heads, shape.n_kv_heads

    def clean(d: int) -> bool:  # an all-to-all over d ranks without a ceiling
        return d <= N and d <= gpus_per_node and kv_heads_after_replication(N, K, d) == K

    if clean(degree):
        return None
    sp = max(d for d in divisors(degree) if N % d == 0 and clean(d))
    return None if sp == degree else (sp, degree // sp)


def _workload(probe: Workload, dp: int, sp: int, ring: int, seq_len: int) -> Workload:
    """The workload of layout ``(dp, ring, sp)``: Ulysses x Ring is ``usp`` over ``sp * ring``."""
    if ring == 1:
        return probe.with_(dp=dp, sp=sp, seq_len=seq_len)
    return probe.with_(dp=dp, sp=sp * ring, seq_len=seq_len, attention="usp", ulysses_degree=sp)


def _layout_note(shape: ModelShape, gpu: GpuProfile, sp: int, ring: int) -> str:
    """What the layout's sequence-parallel group costs: the hybrid's split, or pure Ulysses'
    ceilings (replicated kv heads, an all-to-all across nodes)."""
    node = gpu.gpus_per_node
    if ring > 1:
        where = "in a node" if sp <= node else f"across {-(-sp // node)} nodes"
        hops = "across nodes" if sp * ring > node else "in a node"
        a2a = f"all-to-all over sp={sp} {where}" if sp > 1 else "no all-to-all (sp=1)"
        return f"Ulysses x Ring: {a2a}, ring of {ring} {hops} (its p2p overlaps attention)"
    N, K = shape.n_heads, shape.n_kv_heads
    notes = []
    if 1 < sp <= N and (kp := kv_heads_after_replication(N, K, sp)) > K:
        why = f"sp={sp} > {K} kv heads" if sp > K else "uneven kv groups"
        notes.append(f"kv heads replicated ({why}): {kp} travel, not {K}")
    if sp > node:
        notes.append(
            f"all-to-all across {-(-sp // node)} nodes at {gpu.inter_bw / 1e9:.1f} GB/s "
            f"(NVLink: {gpu.intra_bw / 1e9:.0f})"
        )
    return "; ".join(notes)


@dataclass
class Layout:
    """One (dp, sp) choice, or (dp, ring, sp) for Ulysses x Ring, and what it costs.

    ``ring > 1`` only on the hybrid rows the planner proposes (:func:`hybrid_split`): ``sp`` is
    then the Ulysses degree and ``sp * ring`` the sequence-parallel degree, as in the library's
    ``("dp", "ring", "sp")`` mesh. With ``attention="usp"`` or ``"ring"`` asked for, ``sp`` is
    the whole sequence-parallel degree (as in :func:`~simulations.predict.predict`) and ``ring``
    stays 1.
    """

    dp: int
    sp: int
    valid: bool
    max_seq_len: int = 0
    prediction: Prediction | None = None  # at the evaluation length
    eval_seq_len: int = 0
    fits: bool = False
    why: str = ""
    binding: str = ""  # largest memory component at max_seq_len
    attention_imbalance: float = 1.0  # busiest rank's attention work / mean (uneven heads)
    heads_per_rank: tuple[int, ...] = ()  # q heads per rank of the all-to-all group
    ring: int = 1  # ring degree of a Ulysses x Ring row (then dp * ring * sp GPUs)
    note: str = ""  # what the sequence-parallel group costs (ceilings, the hybrid's split)

    @property
    def seq_degree(self) -> int:
        """Ranks one sequence is split over, ``sp * ring``."""
        return self.sp * self.ring

    @property
    def label(self) -> str:
        """``"sp=8"``, or ``"sp=8 x ring=4"`` for Ulysses x Ring."""
        return f"sp={self.sp}" + (f" x ring={self.ring}" if self.ring > 1 else "")

    @property
    def tokens_per_s(self) -> float:
        return self.prediction.tokens_per_s if self.prediction and self.fits else 0.0

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "dp": self.dp,
            "sp": self.sp,
            "ring": self.ring,
            "valid": self.valid,
            "max_seq_len": self.max_seq_len,
            "eval_seq_len": self.eval_seq_len,
            "fits": self.fits,
            "tokens_per_s": self.tokens_per_s,
            "binding_memory_component": self.binding,
            "attention_imbalance": self.attention_imbalance,
            "why": self.why,
        }
        if self.prediction is not None:
            p = self.prediction
            d.update(
                step_time_s=p.step_time_s,
                mfu=p.mfu,
                tflops_per_gpu=p.tflops_per_gpu,
                peak_memory_bytes=int(p.memory.peak),
                comm_bytes={k: int(v) for k, v in p.comm.bytes_by_kind.items()},
            )
        return d


@dataclass
class Plan:
    """Ranked layouts; ``layouts[0]`` is the best."""

    model: str
    gpus: int
    gpu: str
    seq_len: int | None
    layouts: list[Layout] = field(default_factory=list)

    @property
    def best(self) -> Layout | None:
        return self.layouts[0] if self.layouts and self.layouts[0].valid else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "gpus": self.gpus,
            "gpu": self.gpu,
            "seq_len": self.seq_len,
            "layouts": [x.to_dict() for x in self.layouts],
            "best": self.best.to_dict() if self.best else None,
        }


def _largest_component(p: Prediction) -> str:
    comps = p.memory.components
    return max(comps, key=lambda k: comps[k])


def plan(
    model: str | ModelShape,
    gpus: int,
    gpu: str = "h100",
    *,
    seq_len: int | None = None,
    hybrid: bool = True,
    **options: Any,
) -> Plan:
    """Rank every (dp, sp) with ``dp * sp = gpus``, and the Ulysses x Ring (dp, ring, sp) where
    pure Ulysses hits a ceiling (:func:`hybrid_split`).

    Args:
        model: preset name or shape.
        gpus: total GPUs.
        gpu: GPU profile name.
        seq_len: target sequence length; ``None`` ranks by the longest trainable sequence.
        hybrid: also evaluate Ulysses x Ring rows (only with ``attention="ulysses"``, the default;
            a hybrid the simulator cannot cost with the other options is left out).
        **options: other :class:`~simulations.config.Workload` fields (``ac``, ``tiled_loss``,
            ``attention``, ``offload_optimizer``, ...). ``dp``/``sp`` are chosen here.

    Raises:
        ValueError: bad inputs (unknown model or GPU, ``gpus < 1``, ...).
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus={gpus!r} must be a positive integer")
    for k in ("dp", "sp", "gpus"):
        if k in options:
            raise ValueError(f"plan chooses {k} itself; do not pass {k}=")
    shape = get_shape(model) if isinstance(model, str) else model
    probe = Workload(shape=shape, seq_len=gpus, gpu=get_gpu(gpu), **options)  # validates the rest
    shape, name, node = probe.shape, probe.shape.name, probe.gpu.gpus_per_node
    hybrid = hybrid and probe.attention == "ulysses"
    candidates = [(gpus // sp, sp, 1) for sp in divisors(gpus)]
    if hybrid:
        for degree in divisors(gpus):
            split = hybrid_split(shape, degree, node)
            if split is not None:
                candidates.append((gpus // degree, *split))
    layouts: list[Layout] = []
    for dp, sp, ring in candidates:
        try:
            w = _workload(probe, dp, sp, ring, sp * ring * GRANULE)
        except ValueError as e:
            if ring == 1:
                split = hybrid_split(shape, sp, node) if hybrid and sp > shape.n_heads else None
                runs = f"; Ulysses x Ring runs it: sp={split[0]} x ring={split[1]}" if split else ""
                layouts.append(Layout(dp, sp, valid=False, why=f"{e}{runs}"))
            continue  # a hybrid these options do not allow (packed documents, head chunks)
        lay = Layout(
            dp,
            sp,
            valid=True,
            attention_imbalance=w.attention_imbalance,
            heads_per_rank=w.heads.q_heads,
            ring=ring,
            note=_layout_note(shape, probe.gpu, sp, ring) if probe.attention == "ulysses" else "",
        )
        lay.max_seq_len = max_seq_len(w)
        if lay.max_seq_len:
            lay.binding = _largest_component(predict(w.with_(seq_len=lay.max_seq_len)))
        layouts.append(lay)
    valid = [x for x in layouts if x.valid]
    if seq_len is not None:
        ref = seq_len
    else:
        positive = [x.max_seq_len for x in valid if x.max_seq_len]
        ref = (min(positive) // gpus) * gpus if positive else 0
    for lay in valid:
        target = ref if ref else lay.max_seq_len
        if target and _runs(lay, target, probe.attention):
            try:
                lay.prediction = predict(_workload(probe, lay.dp, lay.sp, lay.ring, target))
                lay.eval_seq_len = target
                lay.fits = lay.prediction.fits
            except ValueError as e:
                lay.why = str(e)
    if seq_len is not None:
        valid.sort(
            key=lambda x: (x.fits, x.tokens_per_s, x.max_seq_len, -x.attention_imbalance),
            reverse=True,
        )
    else:
        valid.sort(
            key=lambda x: (x.max_seq_len, x.tokens_per_s, -x.attention_imbalance), reverse=True
        )
    ordered = valid + [x for x in layouts if not x.valid]
    _explain(ordered, seq_len)
    if seq_len is not None and ordered and ordered[0].valid and not ordered[0].fits:
        ordered[0].why = _nothing_fits(probe, ordered[0], seq_len)
    return Plan(name, gpus, probe.gpu.name, seq_len, ordered)


def _runs(lay: Layout, S: int, attention: str) -> bool:
    """Whether the layout can run ``S`` tokens: Ulysses runs any length (uneven slices); the
    other methods need ``sp | S``; Ulysses x Ring also ``2 * ring | S`` (the zigzag split,
    :func:`dtensor_ulysses.plan.check_ring_seq`)."""
    if lay.ring > 1:
        try:
            check_ring_seq(S, lay.ring)
        except ValueError:
            return False
        return S % lay.seq_degree == 0
    return S % lay.sp == 0 or attention == "ulysses"


# The memory options plan() may suggest, in order, each as its simulator CLI flag.
_MEMORY_OPTIONS = (
    ("ac", "full", "--ac full"),
    ("tiled_loss", True, "--tiled-loss"),
    ("tiled_mlp", True, "--tiled-mlp"),
    ("offload_activations", True, "--offload-activations"),
    ("offload_optimizer", True, "--offload-optimizer"),
)


def _nothing_fits(probe: Workload, lay: Layout, seq_len: int) -> str:
    """The first row's explanation when no layout fits ``seq_len``: the longest it trains, and
    the memory options not on yet with the longest they would reach (or that none is left)."""
    text = (
        f"nothing fits {seq_len:,} tokens; the closest layout trains up to "
        f"{_fmt_tokens(lay.max_seq_len)} tokens"
    )
    w, added = probe, []
    for field_name, value, flag in _MEMORY_OPTIONS:
        if getattr(w, field_name) == value:
            continue
        try:
            w = w.with_(**{field_name: value})
        except ValueError:  # not with the options given (e.g. offloading under DDP)
            continue
        added.append(flag)
    if not added:
        return text + "; every memory option is on: use more GPUs or a shorter --seq-len"
    reach = max_seq_len(_workload(w, lay.dp, lay.sp, lay.ring, lay.sp * lay.ring * GRANULE))
    more = "" if reach >= seq_len else "; beyond that, more GPUs or a shorter --seq-len"
    return text + f"; with {' '.join(added)} it reaches {_fmt_tokens(reach)}{more}"


def _fmt_tokens(n: float) -> str:
    """Tokens with binary prefixes, as the figures write them (``simulations.report``):
    ``131072 -> "128K"``, ``6627328 -> "6.32M"``."""
    if n >= 2**20:
        return f"{n / 2**20:.2f}M"
    if n >= 2**10:
        return f"{n / 2**10:.0f}K"
    return str(int(n))


def _imbalance_note(lay: Layout) -> str:
    """What an uneven head split costs the layout (empty when its heads split evenly)."""
    if lay.attention_imbalance <= 1:
        return ""
    h = lay.heads_per_rank
    note = (
        f"attention load imbalance of {lay.attention_imbalance:.3f}x: ranks attend with {max(h)} "
        f"or {min(h)} of {sum(h)} heads"
    )
    p = lay.prediction
    if p is not None and p.time.imbalance > 0:
        note += (
            f", +{p.time.imbalance:.3g} s per step ({p.time.imbalance / p.step_time_s:.0%} of "
            f"it) on the busiest rank"
        )
    return note


def _explain(layouts: list[Layout], seq_len: int | None) -> None:
    if not layouts or not layouts[0].valid:
        return
    best = layouts[0]
    if not best.why:
        best.why = (
            f"best: trains up to {_fmt_tokens(best.max_seq_len)} tokens "
            f"({_fmt_tokens(best.max_seq_len / best.seq_degree)} per rank)"
        )
        if best.fits and best.prediction:
            best.why += f"; {best.tokens_per_s:,.0f} tokens/s at {_fmt_tokens(best.eval_seq_len)}"
        if _imbalance_note(best):
            best.why += f"; it still pays an {_imbalance_note(best)}"
        if best.note:
            best.why += f"; {best.note}"
    for lay in layouts[1:]:
        if not lay.valid or lay.why:
            continue
        reasons = []
        if seq_len is not None and not lay.fits:
            p = lay.prediction
            if p is not None:
                reasons.append(
                    f"does not fit {_fmt_tokens(seq_len)}: peak {p.memory.peak / GiB:.1f} GiB > "
                    f"{p.memory.capacity / GiB:.1f} GiB (largest: {_largest_component(p)})"
                )
            else:
                need = math.lcm(lay.seq_degree, 2 * lay.ring) if lay.ring > 1 else lay.sp
                reasons.append(
                    f"cannot run {_fmt_tokens(seq_len)} tokens with {lay.label} (S must be a "
                    f"multiple of {need})"
                )
        elif lay.max_seq_len < best.max_seq_len:
            if lay.max_seq_len == 0:
                reasons.append("model states alone do not fit")
            else:
                reasons.append(
                    f"max sequence {_fmt_tokens(lay.max_seq_len)} < "
                    f"{_fmt_tokens(best.max_seq_len)}: each rank holds S/{lay.seq_degree} tokens "
                    f"(limit set by {lay.binding})"
                )
        if lay.fits and best.fits and lay.tokens_per_s < best.tokens_per_s:
            assert lay.prediction and best.prediction  # a layout that fits has a prediction
            slower = 1 - lay.tokens_per_s / best.tokens_per_s
            if not math.isclose(slower, 0.0, abs_tol=5e-4):
                reasons.append(
                    f"{slower:.0%} fewer tokens/s at {_fmt_tokens(lay.eval_seq_len)} "
                    f"(step {lay.prediction.step_time_s:.3g} s vs "
                    f"{best.prediction.step_time_s:.3g} s)"
                )
        if _imbalance_note(lay):
            reasons.append(_imbalance_note(lay))
        if lay.note:
            reasons.append(lay.note)
        lay.why = "; ".join(reasons) or "ties with the best"
