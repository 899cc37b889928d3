"""Memory of the real training step, traced with fake tensors on a fake process group.

No device and no memory are used: the model is built on ``meta`` by
:func:`dtensor_ulysses.train.build` (``parallelize``, every memory feature), materialized as
*fake* tensors (shapes and dtypes only), and :func:`dtensor_ulysses.train.train_step` runs on one
rank's sequence slice of a virtual world of ``dp * sp`` ranks (``torch.distributed``'s fake
process group: collectives return at once). A dispatch mode sees every tensor each op creates and
records a timeline of storage allocations and frees; the peaks are computed from it afterwards.

What is counted, and how it maps to a CUDA run (see ``simulations/README.md``):

* **bf16 compute, fp32 reduce**: FSDP2's CUDA policy (``MixedPrecisionPolicy(bf16, fp32)``) is
  used although the fake tensors are CPU tensors.
* **Steady state**: a warm-up step on a short sequence creates the optimizer states and FSDP2's
  lazy state; the second step, at the requested length, is the one measured. Everything alive
  when it starts (sharded parameters, optimizer states, ...) is in its baseline.
* **Device or host**: every fake tensor is a CPU tensor, so the device is not told apart by
  device type. A storage is *host* memory when (a) an op creates it while
  :func:`dtensor_ulysses.offload.allocating_host` is true (``offload.py``'s one host allocator
  ``host_empty`` and its CPU optimizer math ``host_compute``), (b) it is a sharded parameter,
  gradient or optimizer state while FSDP2's ``CPUOffloadPolicy`` is on (``--offload-params``;
  a gradient stays on the device until the block whose backward produced it is done, as on
  CUDA, where the reduce-scatter output is copied to the host), or (c) the optimizer step of
  ``--offload-params`` creates it (AdamW steps on host tensors there). Everything else is
  device memory. Not seen on CPU: ``CPUOffloadPolicy``'s host-to-device copy of a block's
  parameter shard before its all-gather (``.to(device)`` is a no-op when both are CPU), at most
  one block's fp32 shard, transient.
* ``.item()`` on a fake tensor has no value: the trace returns 1 (token counts, norms); the
  bytes do not depend on it.
* **CUDA's schedule**: the activation offloader's CPU path follows its CUDA path here
  (:func:`dtensor_ulysses.offload.cuda_schedule_on_cpu`): restoring block ``i``'s input brings
  block ``i-1``'s back at once, as the CUDA side stream does, so a block's backward holds two
  block inputs, as on a GPU.

Phases of the measured step: ``forward`` (embedding and blocks), ``loss`` (final norm, loss
forward and backward, until the gradient of the final norm's output exists), ``backward``
(blocks, gradient reduction, clipping) and ``optimizer`` (the step and ``zero_grad``). Each
phase's device peak, with its composition, is reported; the step's peak is their maximum.

Fewer blocks (``layers``): a model with ``L`` blocks holds, in every phase, per-block amounts
(sharded states, checkpoints, gradients) times ``L`` plus amounts that do not depend on ``L``,
and within a phase a block's memory is linear in its index except within two blocks of either
end (FSDP2 prefetches the next block; the first and last have no neighbour). So the peak of
each *segment class* (the two first blocks, the two last, the maximum over the blocks between,
the phase's start) is linear in ``L``: :func:`extrapolate` takes two traces (``L`` and
``L + 1`` blocks, ``L >= 5`` so that every class exists in both) to any depth; tests check that
``L = 5, 6, 7`` give equal differences and that the extrapolation equals a full trace.

Private torch APIs (fake process group, ``FakeTensorMode``, ``TorchDispatchMode``) come from
:mod:`dtensor_ulysses._torch_private`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import traceback
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = [
    "PHASES",
    "PhasePeak",
    "StepTrace",
    "TraceUnavailable",
    "extrapolate",
    "fake_world",
    "trace_train_step",
]

PHASES = ("forward", "loss", "backward", "optimizer")
CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations_and_buffers")


class TraceUnavailable(RuntimeError):
    """This torch lacks a private API the trace needs, or a requested feature does not exist."""


# ----------------------------------------------------------------------------------------------
# the timeline
# ----------------------------------------------------------------------------------------------
class _Timeline:
    """Storage allocations, resizes and frees in order, with phase marks; peaks computed later."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int]] = []  # ("a"|"r"|"f"|"m", uid, bytes or mark)
        self.marks: list[str] = []
        self._uid_of: dict[int, int] = {}  # id(storage) -> uid, live storages only
        self._size: dict[int, int] = {}  # uid -> bytes now
        self._next = 0
        self.host: set[int] = set()  # uids that live in host memory
        self.host_late: set[int] = set()  # on the device until the next mark, then host
        self.category: dict[int, str] = {}
        self.op: dict[int, str] = {}  # uid -> the op that created it (diagnostics)
        self.where: dict[int, str] = {}  # uid -> the library line that allocated it
        self.where_min_bytes: int | None = None  # record ``where`` from this size on (None: off)

    # -- recording --
    def uid(self, t: torch.Tensor) -> int | None:
        st = t.untyped_storage()
        return self._uid_of.get(id(st))

    def add(self, t: torch.Tensor, *, host: bool = False, op: str = "") -> int | None:
        if t.device.type == "meta" or isinstance(t, DTensor):  # no memory of its own: a
            return None  # DTensor's local tensor is counted when the op on it dispatches
        st = t.untyped_storage()
        key = id(st)
        if key in self._uid_of:
            return self._uid_of[key]
        uid = self._next
        self._next += 1
        self._uid_of[key] = uid
        self._size[uid] = st.nbytes()
        if host:
            self.host.add(uid)
        self.events.append(("a", uid, st.nbytes()))
        self.op[uid] = op
        if self.where_min_bytes is not None and st.nbytes() >= self.where_min_bytes:
            self.where[uid] = _library_line()
        weakref.finalize(st, self._free, key, uid)
        return uid

    def _free(self, key: int, uid: int) -> None:
        if self._uid_of.get(key) == uid:
            del self._uid_of[key]
        self.events.append(("f", uid, 0))

    def resized(self, st: Any, nbytes: int) -> None:
        uid = self._uid_of.get(id(st))
        if uid is not None:
            self.events.append(("r", uid, nbytes - self._size[uid]))
            self._size[uid] = nbytes

    def mark(self, phase: str) -> None:
        self.marks.append(phase)
        self.events.append(("m", len(self.marks) - 1, 0))

    def is_host(self, t: torch.Tensor) -> bool:
        u = self.uid(t)
        return u is not None and u in self.host

    def set_host(self, t: torch.Tensor, *, late: bool = False) -> None:
        u = self.uid(t)
        if u is None:
            u = self.add(t)
        if u is None:
            return
        (self.host_late if late else self.host).add(u)

    def set_category(self, t: torch.Tensor, cat: str) -> None:
        u = self.uid(t)
        if u is not None:
            self.category.setdefault(u, cat)

    # -- analysis --
    def live_at_peak(self, start_mark: str, top: int) -> list[dict[str, Any]]:
        """The ``top`` largest device storages alive at the step's device peak (from the mark
        ``start_mark`` on), each with its bytes, category, the op and the library line that
        allocated it (``where`` is recorded for storages of at least ``where_min_bytes``)."""

        def replay(stop: int) -> tuple[int, dict[int, int]]:
            size: dict[int, int] = {}
            now, best, at, started = 0, -1, -1, False
            for i, (kind, uid, n) in enumerate(self.events[:stop]):
                if kind == "m":
                    started = started or self.marks[uid] == start_mark
                    continue
                if kind == "a":
                    size[uid] = n
                elif kind == "r":
                    size[uid] += n
                elif uid in size:
                    n = -size.pop(uid)
                else:
                    continue
                now += 0 if uid in self.host else n
                if started and now > best:
                    best, at = now, i
            return at, size

        at, _ = replay(len(self.events))  # where the device peak is
        _, live = replay(at + 1)  # what is alive there
        rows: list[dict[str, Any]] = [
            dict(bytes=b, category=self.category.get(u, "activations_and_buffers"),
                 op=self.op.get(u, ""), where=self.where.get(u, ""))
            for u, b in live.items() if u not in self.host
        ]  # fmt: skip
        return sorted(rows, key=lambda r: -r["bytes"])[:top]

    def peaks(self, start_mark: str) -> tuple[dict[tuple[str, str], PhasePeak], int]:
        """Device peaks per segment (with the composition at the peak) and the host peak, from
        the mark ``start_mark`` on; the bytes alive before it are the baseline. Segments are
        ``(phase, "start" | block index | "-")``: a phase is cut where each block starts."""
        dev_now: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        host_now = 0
        size: dict[int, int] = {}
        where: dict[int, str] = {}  # uid -> "host" | category
        pending: list[int] = []  # host_late uids still on the device
        phase: tuple[str, str] | None = None
        out: dict[tuple[str, str], PhasePeak] = {}
        host_peak = 0

        def place(uid: int) -> str:
            if uid in self.host:
                return "host"
            return self.category.get(uid, "activations_and_buffers")

        def move(uid: int, to: str) -> None:
            nonlocal host_now
            n = size[uid]
            if where[uid] == "host":
                host_now -= n
            else:
                dev_now[where[uid]] -= n
            where[uid] = to
            if to == "host":
                host_now += n
            else:
                dev_now[to] += n

        def flush_pending() -> None:
            for u in pending:
                if u in size:
                    move(u, "host")
            pending.clear()

        for kind, uid, n in self.events:
            if kind == "m":
                flush_pending()
                name = self.marks[uid]
                if name == start_mark:
                    phase = ("forward", "start")
                elif phase is not None and name != "end":
                    ph, _, where_ = name.partition(":")
                    phase = (ph, where_ or ("start" if ph == "backward" else "-"))
                elif name == "end":
                    phase = None
                continue
            if kind == "a":
                size[uid] = n
                where[uid] = "activations_and_buffers"
                move_to = place(uid)
                where[uid] = move_to
                if move_to == "host":
                    host_now += n
                else:
                    dev_now[move_to] += n
                if uid in self.host_late:
                    pending.append(uid)
            elif kind == "r":
                size[uid] += n
                if where[uid] == "host":
                    host_now += n
                else:
                    dev_now[where[uid]] += n
            else:  # free
                if uid not in size:
                    continue
                move(uid, "host")  # out of the device sums
                host_now -= size.pop(uid)
                where.pop(uid)
            if phase is not None:
                total = sum(dev_now.values())
                cur = out.get(phase)
                if cur is None or total > cur.device:
                    out[phase] = PhasePeak(total, dict(dev_now))
                host_peak = max(host_peak, host_now)
        return out, host_peak


def _library_line() -> str:
    """``file:line (function)`` of the innermost ``dtensor_ulysses`` frame outside this module,
    with its caller in the library, e.g. ``model.py:89 (forward) < _tiling.py:50 (backward)``."""
    frames = [
        f for f in traceback.extract_stack()
        if "dtensor_ulysses" in f.filename and not f.filename.endswith("memtrace.py")
    ]  # fmt: skip
    return " < ".join(
        f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} ({f.name})" for f in frames[::-1][:2]
    )


# ----------------------------------------------------------------------------------------------
# the fake world
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[tuple[Any, Callable[[], Any]]]:
    """A fake process group of ``world_size`` ranks (this process is rank 0), a fake-tensor mode
    and a factory of recording modes (``TorchDispatchMode`` with a ``.timeline``).

    Raises:
        TraceUnavailable: this torch lacks the private APIs.
        RuntimeError: a process group already exists (trace in a fresh process).
    """
    try:
        from dtensor_ulysses._torch_private import (
            TorchDispatchMode,
            fake_world_classes,
            tree_flatten,
        )

        FakeTensorMode, FakeStore = fake_world_classes()
    except ImportError as e:  # a torch without these private modules
        raise TraceUnavailable(f"fake process group / fake tensors unavailable: {e}") from None

    local_scalar = torch.ops.aten._local_scalar_dense.default

    try:
        from dtensor_ulysses.offload import allocating_host
    except ImportError:  # a library without offload.py

        def allocating_host() -> bool:
            return False

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.timeline = _Timeline()
            self.all_host = False  # the CPU optimizer step of --offload-params

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is local_scalar:  # a fake tensor has no value; the bytes do not need one
                (t,) = args
                return 1.0 if t.dtype.is_floating_point else 1
            out = func(*args, **(kwargs or {}))
            host = self.all_host or allocating_host()
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.timeline.add(t, host=host, op=func.__name__)
            return out

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized; trace in a fresh process")
    active: list[Any] = []
    orig_resize = torch.UntypedStorage.resize_

    def resize_(st, nbytes):
        result = orig_resize(st, nbytes)
        for rec in active:
            rec.timeline.resized(st, int(nbytes))
        return result

    def make_recorder() -> Any:
        rec = Recorder()
        active.append(rec)
        return rec

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    try:
        yield FakeTensorMode(allow_non_fake_inputs=True), make_recorder
    finally:
        torch.UntypedStorage.resize_ = orig_resize  # type: ignore[method-assign]
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# results
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PhasePeak:
    """A phase's device peak, bytes, and what was alive at that moment, by category."""

    device: int
    by_category: dict[str, int]

    def scaled(self, other: PhasePeak, k: float) -> PhasePeak:
        """``self + k * (self - other)``, component by component (linear extrapolation)."""
        cats = {
            c: round(self.by_category[c] + k * (self.by_category[c] - other.by_category[c]))
            for c in self.by_category
        }
        return PhasePeak(sum(cats.values()), cats)


def _segment_class(phase: str, where: str, layers: int) -> str:
    """``phase/class``: blocks within two of either end keep their position (``first0``,
    ``first1``, ``last1``, ``last0``), the blocks between are ``mid`` (their maximum)."""
    if not where.isdigit():
        return f"{phase}/{where}"
    i = int(where)
    if i < 2:
        return f"{phase}/first{i}"
    if layers - 1 - i < 2:
        return f"{phase}/last{layers - 1 - i}"
    return f"{phase}/mid"


MIN_EXTRAPOLATION_LAYERS = 5


@dataclass(frozen=True)
class StepTrace:
    """One traced training step of rank 0 (the busiest rank: it holds the most tokens and heads).

    Attributes:
        layers: blocks of the model traced (or extrapolated to).
        seq_len, dp, sp: the workload.
        segments: device peak per segment class (``forward/start``, ``forward/first0``, ...,
            ``forward/mid``, ``forward/last0``, ``loss/-``, ``backward/start``, ``backward/...``,
            ``optimizer/-``), each with what was alive at that moment by category.
        host_bytes: largest host memory (offloaded copies) alive at once during the step.
        traced_layers: the depths actually traced (two when extrapolated).
        breakdown: with ``trace_train_step(..., breakdown=n)``, the ``n`` largest device
            storages alive at the step's device peak (bytes, category, op, the library line
            that allocated them); after :func:`extrapolate`, those of the deeper trace.
    """

    layers: int
    seq_len: int
    dp: int
    sp: int
    segments: dict[str, PhasePeak]
    host_bytes: int
    traced_layers: tuple[int, ...] = ()
    features: dict[str, Any] = field(default_factory=dict)
    breakdown: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_segments(
        cls, layers: int, seq_len: int, dp: int, sp: int,
        raw: dict[tuple[str, str], PhasePeak], host: int, **kw: Any,
    ) -> StepTrace:  # fmt: skip
        segs: dict[str, PhasePeak] = {}
        for (phase, where), pk in raw.items():
            key = _segment_class(phase, where, layers)
            if key not in segs or pk.device > segs[key].device:
                segs[key] = pk
        return cls(layers, seq_len, dp, sp, segs, host, **kw)

    @property
    def phases(self) -> dict[str, PhasePeak]:
        """Device peak per phase (the largest of its segments)."""
        out: dict[str, PhasePeak] = {}
        for key, pk in self.segments.items():
            ph = key.split("/")[0]
            if ph not in out or pk.device > out[ph].device:
                out[ph] = pk
        return {p: out[p] for p in PHASES if p in out}

    @property
    def peak_phase(self) -> str:
        ph = self.phases
        return max(ph, key=lambda p: ph[p].device)

    @property
    def device_peak_bytes(self) -> int:
        return self.phases[self.peak_phase].device

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_peak_bytes": self.device_peak_bytes,
            "host_bytes": self.host_bytes,
            "peak_phase": self.peak_phase,
            "phases": {
                p: {"device_peak_bytes": v.device, "by_category": dict(v.by_category)}
                for p, v in self.phases.items()
            },
            "layers": self.layers,
            "traced_layers": list(self.traced_layers),
            **({"breakdown": self.breakdown} if self.breakdown else {}),
        }


def extrapolate(a: StepTrace, b: StepTrace, layers: int) -> StepTrace:
    """The step of a ``layers``-block model from traces of ``a.layers`` and ``b.layers =
    a.layers + 1`` blocks (at least :data:`MIN_EXTRAPOLATION_LAYERS`): every segment's peak
    and component, and the host bytes, linearly in the depth."""
    if b.layers != a.layers + 1 or a.layers < MIN_EXTRAPOLATION_LAYERS:
        raise ValueError(
            f"need traces of L and L + 1 blocks, L >= {MIN_EXTRAPOLATION_LAYERS}; got "
            f"{a.layers} and {b.layers}"
        )
    if set(a.segments) != set(b.segments):
        raise ValueError(f"segments differ: {sorted(set(a.segments) ^ set(b.segments))}")
    k = layers - b.layers
    segs = {key: b.segments[key].scaled(a.segments[key], k) for key in b.segments}
    host = b.host_bytes + k * (b.host_bytes - a.host_bytes)
    return dataclasses.replace(
        b, layers=layers, segments=segs, host_bytes=host, traced_layers=(a.layers, b.layers)
    )


# ----------------------------------------------------------------------------------------------
# the step
# ----------------------------------------------------------------------------------------------
def _cuda_schedule() -> contextlib.AbstractContextManager[Any]:
    """The offloader's CUDA schedule on CPU tensors (its prefetch of the earlier block's input),
    when this library has it."""
    try:
        from dtensor_ulysses.offload import cuda_schedule_on_cpu
    except ImportError:
        return contextlib.nullcontext()
    return cuda_schedule_on_cpu()


def _offload_registry() -> Callable[[torch.Tensor], bool] | None:
    """``is_host(tensor)`` from :mod:`dtensor_ulysses.offload`, when that module exists."""
    try:
        from dtensor_ulysses import offload
    except ImportError:
        return None
    fn = getattr(offload, "is_host", None)
    return fn if callable(fn) else None


@contextlib.contextmanager
def _temporary_preset(name: str, layers: int | None) -> Iterator[str]:
    """A preset with fewer blocks, registered for the duration of the trace."""
    from dtensor_ulysses.presets import PRESETS, get_shape

    shape = get_shape(name)
    if layers is None or layers == shape.n_layers:
        yield name
        return
    tmp = f"{name}@{layers}L"
    PRESETS[tmp] = shape.with_(name=tmp, n_layers=layers)
    try:
        yield tmp
    finally:
        PRESETS.pop(tmp, None)


@contextlib.contextmanager
def _bf16_policy() -> Iterator[None]:
    """FSDP2's CUDA mixed precision (bf16 params, fp32 reduce) for the CPU fake world."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import dtensor_ulysses as du

    par: Any = importlib.import_module(du.parallelize.__module__)  # where parallelize looks it up
    orig = par.default_mixed_precision
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    par.default_mixed_precision = lambda device_type: policy
    try:
        yield
    finally:
        par.default_mixed_precision = orig


FEATURES = (
    "tiled_loss",
    "tiled_mlp",
    "head_chunks",
    "offload_activations",
    "offload_optimizer",
    "offload_params",
)


def _config(model: str, seq_len: int, dp: int, sp: int, ac: bool, features: dict[str, Any]):
    from dtensor_ulysses.train import TrainConfig

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    missing = [k for k, v in features.items() if v not in (None, False, 1) and k not in names]
    if missing:
        raise NotImplementedError(
            f"the trainer has no {', '.join(missing)} yet (TrainConfig lacks the field); "
            f"trace without it"
        )
    kw = {k: v for k, v in features.items() if k in names and v is not None}
    return TrainConfig(
        dp=dp, sp=sp, model=model, seq_len=seq_len, batch_size=dp, steps=1,
        activation_checkpointing=ac, attention_backend="sdpa", allow_uneven_heads=True, **kw,
    )  # fmt: skip


def _batch(seq_len: int, sp: int, micro_batch: int = 1):
    from dtensor_ulysses.data import Batch
    from dtensor_ulysses.plan import SeqLayout

    layout = SeqLayout.split(seq_len, sp)
    s = layout.seq_sizes[0]
    ids = torch.zeros(micro_batch, s, dtype=torch.long)
    pos = torch.arange(s).expand(micro_batch, s)
    return Batch(ids, ids.clone(), pos, layout)


def trace_train_step(
    model: str,
    seq_len: int,
    *,
    dp: int = 1,
    sp: int = 1,
    ac: bool = True,
    layers: int | None = None,
    warmup_seq_len: int | None = None,
    breakdown: int = 0,
    **features: Any,
) -> StepTrace:
    """Trace one steady-state training step of rank 0 (see the module docstring).

    Args:
        model: preset name.
        seq_len: tokens per sequence ``S`` (micro-batch 1 per dp rank).
        dp, sp: the layout; ``dp * sp`` fake ranks.
        ac: activation checkpointing (every block).
        layers: trace a model with this many blocks instead of the preset's.
        warmup_seq_len: the warm-up step's length (default: the smallest that every feature
            accepts, ``sp * 64``).
        breakdown: list this many of the largest storages alive at the device peak (each
            storage of at least 1 MiB records the library line that allocated it).
        **features: :class:`~dtensor_ulysses.train.TrainConfig` fields (``tiled_loss``,
            ``tiled_mlp``, ``head_chunks``, ``offload_*``, chunk sizes).

    Raises:
        NotImplementedError: a requested feature is not in the trainer.
        TraceUnavailable: this torch lacks the private APIs.
    """
    from dtensor_ulysses import train
    from dtensor_ulysses.mesh import flatten_dp_sp, init_mesh

    is_host_tensor = _offload_registry()
    offload_params = bool(features.get("offload_params"))
    warm = warmup_seq_len or sp * 64
    with _temporary_preset(model, layers) as name, _bf16_policy():
        cfg = _config(name, seq_len, dp, sp, ac, features)
        n_layers = (layers if layers is not None else None) or _n_layers(model)
        with fake_world(dp * sp) as (fake_mode, make_recorder):
            rec = make_recorder()
            tl = rec.timeline
            tl.where_min_bytes = 2**20 if breakdown else None
            mesh = init_mesh(dp, sp, device_type="cpu")
            group = flatten_dp_sp(mesh).get_group()
            with fake_mode, rec, _cuda_schedule():
                try:
                    built = train.build(cfg, mesh, torch.device("cpu"), init=False)
                except TypeError:  # a trainer without init=: initialize (fake, costs nothing)
                    built = train.build(cfg, mesh, torch.device("cpu"))
                net, optimizer, scheduler = built
                hooks = _phase_hooks(net, optimizer, rec, offload_params)
                step = dict(group=group, grad_clip=cfg.grad_clip)
                train.train_step(net, _batch(warm, sp), optimizer, scheduler, **step)
                _classify_states(net, optimizer, tl, offload_params, is_host_tensor)
                batch = _batch(seq_len, sp)
                tl.mark("step")
                train.train_step(net, batch, optimizer, scheduler, **step)
                tl.mark("end")
                for h in hooks:
                    h.remove()
            segments, host_peak = tl.peaks("step")
            top = tl.live_at_peak("step", breakdown) if breakdown else []
    used = {k: v for k, v in features.items() if v not in (None, False)}
    return StepTrace.from_segments(
        n_layers, seq_len, dp, sp, segments, host_peak, traced_layers=(n_layers,), features=used,
        breakdown=top,
    )  # fmt: skip


def _n_layers(model: str) -> int:
    from dtensor_ulysses.presets import get_shape

    return get_shape(model).n_layers


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _classify_states(net, optimizer, tl: _Timeline, offload_params: bool, is_host) -> None:
    """Sharded parameters and optimizer states (alive from the warm-up step on)."""
    for p in net.parameters():
        t = _local(p)
        tl.add(t)
        tl.set_category(t, "parameters")
        if offload_params or (is_host is not None and is_host(t)):
            tl.set_host(t)
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                t = _local(v)
                tl.add(t)
                tl.set_category(t, "optimizer_states")
                if offload_params or (is_host is not None and is_host(t)):
                    tl.set_host(t)


def _phase_hooks(net, optimizer, rec: Any, offload_params: bool) -> list[Any]:
    """Marks: ``loss`` when the final norm starts, ``backward`` when the gradient of its output
    exists, ``optimizer`` before the optimizer step (gradients classified there), and one mark
    per block where its forward starts and where the gradient of its output exists (its
    backward starts; gradients offloaded by FSDP2 leave the device there)."""
    tl: _Timeline = rec.timeline
    hooks: list[Any] = []

    def norm_pre(_m, _args):
        tl.mark("loss")

    def norm_post(_m, _args, out):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: tl.mark("backward"))

    def block_pre(i):
        return lambda _m, _args: tl.mark(f"forward:{i}")

    def block_post(i):
        def hook(_m, _args, out):
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: tl.mark(f"backward:{i}"))

        return hook

    def step_pre(_opt, _args, _kwargs):
        for p in net.parameters():
            if p.grad is not None:
                g = _local(p.grad)
                tl.add(g)
                tl.set_category(g, "gradients")
                if offload_params:
                    tl.set_host(g, late=True)
        tl.mark("optimizer")
        rec.all_host = offload_params  # CPUOffloadPolicy: AdamW steps on host tensors

    def step_post(_opt, _args, _kwargs):
        rec.all_host = False

    hooks.append(net.norm.register_forward_pre_hook(norm_pre))
    hooks.append(net.norm.register_forward_hook(norm_post))
    for i, block in enumerate(net.layers):
        hooks.append(block.register_forward_pre_hook(block_pre(i), prepend=True))
        hooks.append(block.register_forward_hook(block_post(i)))
    hooks.append(optimizer.register_step_pre_hook(step_pre))
    hooks.append(optimizer.register_step_post_hook(step_post))
    return hooks
