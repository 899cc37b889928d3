"""The real training step's memory, traced with fake tensors; the simulator checked against it.

The tracing engine is the library's :mod:`dtensor_ulysses.memtrace`: the model is built on meta by
``dtensor_ulysses.train.build`` (``du.parallelize`` and every memory feature), and
``train.train_step`` (forward with the loss, backward, clipping, the optimizer step) runs on fake
tensors on a fake process group of ``dp * sp`` ranks, bf16 parameters with fp32 gradient
reduction (``TraceCase.device == "cpu"``: fp32, as the trainer on a CPU), micro-batch 1. This
module adds what the simulator needs around it:

* :func:`trace` - one :class:`TraceCase` (``n_layers`` blocks traced, or two depths traced and
  extrapolated to the preset's; per-block cost is exactly linear, a test checks it);
* :func:`report` - the ``python -m simulations trace`` JSON object (device peak, host bytes,
  capacity, fits, phases, the simulator's prediction beside it);
* :func:`find_max` - the longest sequence that fits, on a grid of ``granularity`` tokens;
* :func:`check` - trace vs :func:`simulations.memory.estimate` (peak and host bytes within
  :data:`TOLERANCE`; one block's saved activations).

Capacity: the GPU's memory less :attr:`simulations.hardware.GpuProfile.reserved_bytes` (2 GiB:
CUDA context, NCCL and cuBLAS workspaces), the same ``usable_bytes`` as the simulator's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dtensor_ulysses.plan import HEADROOM as TRAINER_HEADROOM  # noqa: F401  (cli's default)
from dtensor_ulysses.plan import MEMORY_FEATURES
from simulations import memory
from simulations.config import Workload
from simulations.hardware import get_gpu

__all__ = [
    "CASES",
    "FEATURE_FLAGS",
    "TOLERANCE",
    "TraceCase",
    "TraceUnavailable",
    "check",
    "find_max",
    "report",
    "trace",
]

GiB = 2**30
TOLERANCE = 0.10
# TrainConfig field -> Workload field (same meaning; checkpointing is Workload's ``ac``)
FEATURE_FLAGS = tuple(f for f in MEMORY_FEATURES if f != "activation_checkpointing")


class TraceUnavailable(RuntimeError):
    """The real model or a torch API the trace needs is missing."""


@dataclass(frozen=True)
class TraceCase:
    """One virtual-world trace: model, sequence, layout, checkpointing, memory features.

    ``n_layers``: trace a model of this many blocks (quick tests); ``None``: the preset's.
    ``extrapolate_from``: trace ``L`` and ``L + 1`` blocks and extrapolate to ``n_layers`` (or
    the preset's depth).
    """

    model: str
    seq_len: int
    dp: int
    sp: int
    ac: str = "full"
    n_layers: int | None = None
    features: tuple[tuple[str, Any], ...] = ()
    extrapolate_from: int | None = None
    gpu: str = "h100"
    device: str = "cuda"  # "cpu": the step as the trainer runs it on a CPU (fp32, gloo)
    # the step traced: "sft" (the trainer's), "dpo", "grpo" or "distill"
    # (dtensor_ulysses.memtrace.steps)
    # or "vl" (memtrace.vision_step), with its options (beta, generations, num_iterations:
    # StepSpec's fields; images, image_patches, vision_layers, vision_hidden for "vl")
    step: str = "sft"
    step_options: tuple[tuple[str, Any], ...] = ()

    def feature_dict(self) -> dict[str, Any]:
        return dict(self.features)

    @property
    def rows(self) -> int:
        """Rows of one dp rank's micro-batch: 1 (SFT, distillation), 2 (a DPO pair), ``G``
        (GRPO)."""
        if self.step == "dpo":
            return 2
        if self.step == "grpo":
            return int(dict(self.step_options).get("generations", 8))
        return 1

    def label(self) -> str:
        layers = f" ({self.n_layers} layers)" if self.n_layers else ""
        feats = "".join(
            f" +{k}" if v is True else f" {k}={v}" for k, v in self.features if v not in (None,)
        )
        on = " on cpu" if self.device == "cpu" else ""
        step = (
            ""
            if self.step == "sft"
            else f" step={self.step}" + "".join(f" {k}={v}" for k, v in self.step_options)
        )
        return (
            f"{self.model}{layers} S={self.seq_len:,} dp={self.dp} sp={self.sp} ac={self.ac}"
            + feats
            + step
            + on
        )

    @property
    def depth(self) -> int:
        from dtensor_ulysses.plan import get_shape

        return self.n_layers or get_shape(self.model).n_layers

    def workload(self) -> Workload:
        from dtensor_ulysses.plan import get_shape

        shape = get_shape(self.model)
        if self.n_layers:
            shape = shape.with_(n_layers=self.n_layers)
        opts = {k: v for k, v in self.features if v is not None}
        if self.device == "cpu":  # the CPU trainer: fp32 compute and reduction
            opts.update(dtype="fp32", reduce_dtype="fp32")
        return Workload(
            shape, self.seq_len, dp=self.dp, sp=self.sp, ac=self.ac, gpu=get_gpu(self.gpu),
            micro_batch=self.rows, **opts,
        )  # fmt: skip


CASES = [
    TraceCase("llama3-8b", 131072, 1, 8, extrapolate_from=5),
    TraceCase("llama3-8b", 262144, 1, 16, extrapolate_from=5),
    TraceCase("llama3-8b", 524288, 1, 32, extrapolate_from=5),
    TraceCase("llama3-8b", 32768, 1, 8, ac="none", extrapolate_from=5),
    TraceCase("qwen3-4b", 65536, 1, 4, extrapolate_from=5),
    # the 8x H100 million-token recipe: every memory feature, head chunks, optimizer offload
    TraceCase(
        "llama3-8b",
        6160384,
        1,
        8,
        features=(
            ("tiled_loss", True),
            ("tiled_mlp", True),
            ("offload_activations", True),
            ("head_chunks", 4),
            ("offload_optimizer", True),
        ),
        extrapolate_from=5,
    ),
]


def _memtrace():
    try:
        from dtensor_ulysses import memtrace
    except ImportError as e:
        raise TraceUnavailable(f"the real model cannot be imported: {e}") from None
    return memtrace


def vision_spec(case: TraceCase, *, check_len: bool = True) -> Any:
    """``--step vl``'s images and tower (a :class:`dtensor_ulysses.memtrace.vision_step.
    VisionSpec`) from ``case.step_options``.

    Raises:
        ValueError: the tower's width is not a multiple of its head dim (64), or (with
            ``check_len``) the images' tokens do not fit in ``case.seq_len``.
    """
    from dtensor_ulysses.memtrace.vision_step import VisionSpec

    names = {"vision_layers": "layers", "vision_hidden": "hidden"}
    v = VisionSpec(**{names.get(k, k): x for k, x in case.step_options})
    if check_len and v.image_tokens > case.seq_len:
        raise ValueError(
            f"{v.images} images of {v.image_patches} patches are {v.image_tokens:,} image tokens, "
            f"more than --seq-len {case.seq_len:,}: raise --seq-len or pass fewer --images / "
            f"--image-patches"
        )
    return v


def trace(case: TraceCase, *, breakdown: int = 0) -> Any:
    """The traced step of ``case`` (a :class:`dtensor_ulysses.memtrace.StepTrace`); with
    ``breakdown=n``, the ``n`` largest storages alive at its device peak as well."""
    mt = _memtrace()
    kw: dict[str, Any] = dict(dp=case.dp, sp=case.sp, ac=case.ac == "full", **case.feature_dict())
    if case.device != "cuda":
        kw["device"] = case.device
    if case.step != "sft":
        from dtensor_ulysses.memtrace.steps import StepSpec

        if case.step == "vl":
            kw["step"] = StepSpec("vl", vision=vision_spec(case))
        else:
            kw["step"] = StepSpec(case.step, **dict(case.step_options))
    if breakdown:
        kw["breakdown"] = breakdown
    try:
        L0 = case.extrapolate_from
        if L0 is not None and case.depth > L0 + 1:  # else: the whole model is traced
            a = mt.trace_train_step(case.model, case.seq_len, layers=L0, **kw)
            b = mt.trace_train_step(case.model, case.seq_len, layers=L0 + 1, **kw)
            return mt.extrapolate(a, b, case.depth)
        return mt.trace_train_step(case.model, case.seq_len, layers=case.n_layers, **kw)
    except mt.TraceUnavailable as e:
        raise TraceUnavailable(str(e)) from None


def report(case: TraceCase, *, traced: Any = None, breakdown: int = 0) -> dict[str, Any]:
    """The ``simulations trace --json`` object of one case."""
    t = traced if traced is not None else trace(case, breakdown=breakdown)
    gpu = get_gpu(case.gpu)
    w = case.workload()
    pred = memory.estimate(w)
    out: dict[str, Any] = {
        "model": case.model,
        "seq_len": case.seq_len,
        "dp": case.dp,
        "sp": case.sp,
        "gpus": case.dp * case.sp,
        "gpu": gpu.name,
        "micro_batch": case.rows,
        "ac": case.ac,
        "features": {k: v for k, v in case.features},
        "device_peak_bytes": t.device_peak_bytes,
        "host_bytes": t.host_bytes,
        "capacity_bytes": gpu.usable_bytes,
        "device_memory_bytes": gpu.memory_bytes,
        "reserve_bytes": gpu.reserved_bytes,
        "fits": t.device_peak_bytes <= gpu.usable_bytes,
    }
    if case.device == "cpu":  # a CPU run: no GPU, host and device are one memory
        out.update(gpu=None, device="cpu", dtype="fp32", capacity_bytes=None,
                   device_memory_bytes=None, reserve_bytes=None, fits=None)  # fmt: skip
    out.update({k: v for k, v in t.to_dict().items() if k not in out})
    out["extrapolated"] = len(t.traced_layers) == 2
    out["predicted"] = {
        "device_peak_bytes": int(pred.peak - pred.components["fixed"]),
        "host_bytes": int(pred.cpu_bytes),
        "peak_moment": pred.peak_moment,
        "note": "simulations.memory.estimate without its fixed buffers (not allocated here)",
    }
    if case.step != "sft":
        out["predicted"]["note"] = (
            f"simulations.memory.estimate of an SFT step of {case.rows} rows (the simulator "
            f"has no {case.step.upper()} model: "
            + (
                "no vision tower"
                if case.step == "vl"
                else "no teacher weights, no frozen forward, no divergence"
                if case.step == "distill"
                else "no reference weights, no frozen forwards"
            )
            + "); "
            "the trace is the figure"
        )
    return out


def find_max(
    case: TraceCase,
    *,
    granularity: int | None = None,
    start: int | None = None,
    log: Callable[[str], None] | None = None,
    capacity: int | None = None,
    host_capacity: int | None = None,
) -> tuple[int, list[dict[str, Any]], dict[str, Any] | None]:
    """The longest ``seq_len`` (a multiple of ``granularity``, default ``1024 * sp``) whose traced
    device peak fits the GPU, and whose host bytes fit ``host_capacity`` when one is given;
    ``(max_seq_len, probes, report at max_seq_len)``.

    Both grow (nearly) linearly with the sequence: the search runs on the larger of the two
    loads (device peak / capacity, host bytes / host capacity), a secant through two probes
    proposes where it crosses 1, and a bisection on the grid settles it (every step is a real
    trace). ``capacity``: the bytes the peak may reach (default: the GPU's usable bytes; less
    for a search with headroom). ``host_capacity``: the host bytes a rank may hold (None: the
    host is not a limit). The report says which one binds (``binding``: ``"device"`` or
    ``"host"``, the resource the next length on the grid exceeds).
    """
    g = granularity or 1024 * case.sp
    cap = capacity if capacity is not None else get_gpu(case.gpu).usable_bytes
    hcap = host_capacity
    probes: list[dict[str, Any]] = []
    cache: dict[int, Any] = {}

    def loads(t: Any) -> tuple[float, float]:
        return t.device_peak_bytes / cap, (t.host_bytes / hcap if hcap else 0.0)

    def load(n_units: int) -> float:
        if n_units not in cache:
            c = _with_seq(case, n_units * g)
            t = trace(c)
            cache[n_units] = (t, c)
            dev, host = loads(t)
            probe = {"seq_len": n_units * g, "device_peak_bytes": t.device_peak_bytes,
                     "host_bytes": t.host_bytes, "fits": max(dev, host) <= 1}  # fmt: skip
            if hcap:
                probe["device_fits"], probe["host_fits"] = dev <= 1, host <= 1
            probes.append(probe)
            if log:
                host_note = (
                    f" ({'fits' if host <= 1 else 'does not fit'} {hcap / GiB:.2f})" if hcap else ""
                )
                log(
                    f"  S={n_units * g:>10,}: device {t.device_peak_bytes / GiB:8.2f} GiB "
                    f"({'fits' if dev <= 1 else 'does not fit'}), host "
                    f"{t.host_bytes / GiB:.2f} GiB{host_note}"
                )
        return max(loads(cache[n_units][0]))

    # two probes for the secant: the simulator's guess and half of it
    if start is None:
        start = _predicted_max(case, g, capacity=cap, host_capacity=hcap)
    # a vision-language row holds its image tokens: no shorter length is probed
    least = -(-vision_spec(case, check_len=False).image_tokens // g) if case.step == "vl" else 1
    least = max(1, least)
    u1 = max(2, start // g, least + 1)
    u0 = max(least, u1 // 2)
    known = {u0: load(u0), u1: load(u1)}

    def secant(a: int, b: int) -> int:
        pa, pb = known[a], known[b]
        if pb == pa:
            return b + (b - a)
        return a + math.floor((1.0 - pa) * (b - a) / (pb - pa))

    fits = [u for u, p in known.items() if p <= 1]
    over = [u for u, p in known.items() if p > 1]
    lo, hi = (max(fits) if fits else 0), (min(over) if over else None)
    # bracket: grow past the last fitting length, or shrink below the first that does not fit
    while hi is None:
        u = max(secant(u0, u1), lo + 1, 2 * lo - u0 if lo > u0 else lo + 1)
        known[u] = load(u)
        u0, u1 = lo, u
        if known[u] <= 1:
            lo = u
        else:
            hi = u
    while lo == 0:
        u = max(least, min(hi - 1, secant(u0, u1) if u0 != u1 else hi // 2, hi // 2))
        known[u] = load(u)
        if known[u] <= 1:
            lo = u
        elif u == least:
            return 0, sorted(probes, key=lambda x: x["seq_len"]), None
        else:
            hi = u
    # bisect on the grid, proposing the secant's crossing first
    use_secant = True
    while hi - lo > 1:
        u = secant(lo, hi) if use_secant else (lo + hi) // 2
        u = min(max(u, lo + 1), hi - 1)
        width = hi - lo
        known[u] = load(u)
        if known[u] <= 1:
            lo = u
        else:
            hi = u
        use_secant = hi - lo < width // 2 or not use_secant  # alternate when it stalls
        if not use_secant and hi - lo <= 1:
            break
    t, c = cache[lo]
    out = report(c, traced=t)
    dev_next, host_next = loads(cache[hi][0])
    out["binding"] = "host" if host_next > 1 and host_next >= dev_next else "device"
    if hcap:
        out["host_capacity_bytes"] = hcap
        out["host_fits"] = t.host_bytes <= hcap
    return lo * g, sorted(probes, key=lambda x: x["seq_len"]), out


def _with_seq(case: TraceCase, seq_len: int) -> TraceCase:
    from dataclasses import replace

    return replace(case, seq_len=seq_len)


def _predicted_max(
    case: TraceCase, g: int, *, capacity: int | None = None, host_capacity: int | None = None
) -> int:
    """The simulator's longest fitting sequence on the grid (a starting point only): its device
    peak within ``capacity`` (default: the simulator's own fit), its host bytes within
    ``host_capacity`` (None: no host limit)."""
    w0 = _with_seq(case, g).workload()

    def fits(seq_len: int) -> bool:
        m = memory.estimate(w0.with_(seq_len=seq_len))
        dev_ok = m.fits if capacity is None else m.peak - m.components["fixed"] <= capacity
        return dev_ok and (host_capacity is None or m.cpu_bytes <= host_capacity)

    lo, hi = g, g
    if not fits(g):
        return g
    while fits(hi) and hi < 2**31:
        lo, hi = hi, hi * 2
    while hi - lo > g:
        mid = (lo + hi) // 2 // g * g
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


# ----------------------------------------------------------------------------------------------
# the check against the simulator
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Item:
    what: str
    status: str
    detail: str


@dataclass(frozen=True)
class TraceResult:
    peak: int
    host: int
    block_saved: int
    extra: dict[str, Any] = field(default_factory=dict)


def block_saved(case: TraceCase) -> int:
    """Bytes one block saves for backward, checkpointing off, in bf16, per rank, on the case's
    local tokens (measured at ``s`` and ``s / 2`` tokens: the difference is per token)."""
    mt = _memtrace()
    import torch

    import dtensor_ulysses as du
    from dtensor_ulysses.models import build_model
    from dtensor_ulysses.parallel import default_mixed_precision, parallelize

    w = case.workload()
    s = w.local_seq
    with mt.fake_world(w.world) as (fake_mode, make_recorder):
        mesh = du.init_mesh(case.dp, case.sp, device_type="cpu")
        model = build_model(w.shape)
        parallelize(
            model, mesh, mixed_precision=default_mixed_precision("cuda"),
            attention_backend="sdpa", allow_uneven_heads=True,
        )  # fmt: skip
        with fake_mode:
            model.to_empty(device="cpu")
            per = [_block_saved(model.layers[0], w, n, torch) for n in (s, s // 2)]
    return max(0, (per[0] - per[1]) * 2)


def _block_saved(block, w: Workload, s: int, torch) -> int:
    from dtensor_ulysses.models import rope_cos_sin

    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        saved.setdefault(id(st), st.nbytes())
        return t

    pos = torch.arange(s).expand(w.micro_batch, s)
    cos, sin = rope_cos_sin(pos, w.shape.head_dim, w.shape.rope_theta)
    h = torch.zeros(w.micro_batch, s, w.shape.dim, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(h, cos, sin)
    shared = {id(cos.untyped_storage()), id(sin.untyped_storage())}  # rope tables: per model
    del out
    return sum(n for k, n in saved.items() if k not in shared)


def check(case: TraceCase, *, with_block: bool = True) -> list[Item]:
    """Trace ``case`` and compare with :func:`simulations.memory.estimate`: the device peak and
    the host bytes within :data:`TOLERANCE`; one block's saved activations (no checkpointing,
    no memory features: :func:`block_saved` measures a plain block)."""
    t = trace(case)
    w = case.workload()
    mem = memory.estimate(w)
    rows = [("device peak", mem.peak - mem.components["fixed"], t.device_peak_bytes)]
    if mem.cpu_bytes or t.host_bytes:
        rows.append(("host bytes", mem.cpu_bytes, t.host_bytes))
    if with_block and not case.features:  # block_saved parallelizes a plain block
        g = memory.rank_geometries(w)[0]
        pred_block = sum(memory.block_saved_bytes(w, g).values())
        rows.append(("one block's saved activations", pred_block, block_saved(case)))
    out = []
    for what, pred, meas in rows:
        dev = pred / meas - 1 if meas else (0.0 if not pred else math.inf)
        out.append(
            Item(
                what,
                "pass" if abs(dev) <= TOLERANCE else "fail",
                f"predicted {pred / GiB:.3f} GiB, traced {meas / GiB:.3f} GiB ({dev:+.1%})",
            )
        )
    return out
