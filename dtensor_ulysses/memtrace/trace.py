"""Memory of the real training step, traced with fake tensors on a fake process group.

No device and no memory are used: the model is built on ``meta`` by
:func:`dtensor_ulysses.train.build` (``parallelize``, every memory feature), materialized as
*fake* tensors (shapes and dtypes only), and :func:`dtensor_ulysses.train.train_step` runs on one
rank's sequence slice of a virtual world of ``dp * sp`` ranks (``torch.distributed``'s fake
process group: collectives return at once). A dispatch mode sees every tensor each op creates and
records a timeline of storage allocations and frees; the peaks are computed from it afterwards.

What is counted, and how it maps to a CUDA run (see ``simulations/README.md``):

* **bf16 compute, fp32 reduce**: FSDP2's CUDA policy (``MixedPrecisionPolicy(bf16, fp32)``) is
  used although the fake tensors are CPU tensors (passed to ``train.build``, nothing patched).
* **Or the CPU run** (``device="cpu"``): the step as the trainer runs it on a CPU (fp32, no
  mixed-precision policy, the offloader's CPU schedule), so that a real CPU run checks the trace
  (``simulations/trace_check.py``). Host and device are one memory there: ``peak_bytes`` is
  the largest device + host total alive at once, what the process's resident set grows by.
* **Steady state**: a warm-up step on a short sequence creates the optimizer states and FSDP2's
  lazy state; the second step, at the requested length, is the one measured. Everything alive
  when it starts (sharded parameters, optimizer states, ...) is in its baseline.
* **Device or host**: every fake tensor is a CPU tensor, so the device is not told apart by
  device type. A storage is *host* memory when (a) an op creates it while
  :func:`dtensor_ulysses.memory.allocating_host` is true (``memory/host.py``'s one host allocator
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
  (:func:`dtensor_ulysses.memory.cuda_schedule_on_cpu`): restoring block ``i``'s input brings
  block ``i-1``'s back at once, as the CUDA side stream does, so a block's backward holds two
  block inputs, as on a GPU.

Phases of the measured step: ``forward`` (embedding and blocks), ``loss`` (final norm, loss
forward and backward, until the gradient of the final norm's output exists), ``backward``
(blocks, gradient reduction, clipping) and ``optimizer`` (the step and ``zero_grad``). Each
phase's device peak, with its composition, is reported; the step's peak is their maximum.

**Post-training steps** (``step="dpo"``, ``"grpo"`` or ``"distill"``,
:mod:`dtensor_ulysses.memtrace.steps`): the same model and features, with the DPO, GRPO or
distillation step in place of ``train_step`` (a chosen and a rejected row, ``G`` rollouts, or
one prompt+completion row, per dp rank). A reference model (distillation's teacher), when the
step has one, is built by the same ``build`` (sharded alike), frozen, its shards in bf16 on
CUDA; its weights are in ``parameters`` from the start. Forwards without gradients add phases:
``reference`` (its blocks, ``reference/head`` its output head), ``teacher`` (the same for
distillation's teacher, which runs inside the student's ``loss`` phase; the divergence after
it is ``loss`` again) and ``old_policy`` (GRPO with ``num_iterations > 1``: the policy without
gradients), each cut per block like ``forward``, so the extrapolation in depth holds for them
too. The policy's output head is ``loss``, its forward and its backward (which starts the
step's backward): in a DPO step the reference runs between the two, and what is alive while the
head's chunks are recomputed is the loss phase's.

**The vision-language step** (``step="vl"`` with a
:class:`~dtensor_ulysses.memtrace.vision_step.VisionSpec`,
:mod:`dtensor_ulysses.memtrace.vision_step`): before the decoder, this rank's share of the
images (whole images, ``du.hf``'s assignment) runs through a ViT-like tower (FSDP2 over
``dp x sp``, its own AdamW; its states count in ``parameters`` and ``optimizer_states``), the
features are all-gathered over sp and merged at the image tokens of this rank's slice. Phase
``vision``: the tower's forward, the gather and the projection (the vision encoder's share per
rank); the decoder's ``forward`` starts with its embedding (segment ``forward/embed``); the
tower's backward is part of ``backward``.

Fewer blocks (``layers``): a model with ``L`` blocks holds, in every phase, per-block amounts
(sharded states, checkpoints, gradients) times ``L`` plus amounts that do not depend on ``L``,
and within a phase a block's memory is linear in its index except within two blocks of either
end (FSDP2 prefetches the next block; the first and last have no neighbour). So the peak of
each *segment class* (the two first blocks, the two last, the maximum over the blocks between,
the phase's start) is linear in ``L``: :func:`extrapolate` takes two traces (``L`` and
``L + 1`` blocks, ``L >= 5`` so that every class exists in both) to any depth; tests check that
``L = 5, 6, 7`` give equal differences and that the extrapolation equals a full trace.

Where the parts live: this module has the step's results (:class:`StepTrace`,
:func:`extrapolate`) and :func:`trace_train_step`; the per-phase peak (:class:`PhasePeak`), the
categories and :class:`TraceUnavailable` are in ``_results.py``, under everything else. The
timeline of storage events and its peak replay are in ``_timeline.py``; :func:`fake_world`, its
recording mode, the step's setup and its phase marks in :mod:`dtensor_ulysses.memtrace._setup`.
Private torch APIs (fake process group, ``FakeTensorMode``, ``TorchDispatchMode``) come from
:mod:`dtensor_ulysses._torch_private`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from dtensor_ulysses.memory import cuda_schedule_on_cpu, fsdp_offload_policy
from dtensor_ulysses.memtrace._results import PhasePeak
from dtensor_ulysses.memtrace._setup import (
    _classify_states,
    _local,
    _n_layers,
    _phase_hooks,
    _temporary_preset,
    fake_world,
    hybrid_model_dir,
    rank0_batch,
    trace_config,
    trace_options,
)
from dtensor_ulysses.memtrace.steps import StepSpec, reference_model, step_runner
from dtensor_ulysses.memtrace.vision_step import VisionSpec, VisionTower, vl_step
from dtensor_ulysses.parallel import ParallelDims, default_mixed_precision
from dtensor_ulysses.plan.recipe import MEMORY_OPTIONS, ParallelOptions
from dtensor_ulysses.train import build

__all__ = [
    "extrapolate",
    "PHASES",
    "StepTrace",
    "TRACE_DEVICES",
    "trace_train_step",
]

# every phase a traced step can have (a GRPO step's rollout round, ``generate``, first; GRPO's
# old policy and the reference model run without
# gradients; a DPO step runs its reference after the policy's forward, TRL's order; a
# distillation step runs its teacher inside the student's loss; a vision-language step encodes
# its share of the images, ``vision``, before the decoder)
PHASES = ("generate", "old_policy", "reference", "vision", "forward", "loss", "teacher", "backward",
          "optimizer")  # fmt: skip
TRACE_DEVICES = ("cuda", "cpu")


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
    device: str = "cuda"
    peak_bytes: int = 0
    step: dict[str, Any] = field(default_factory=lambda: {"kind": "sft", "rows_per_dp_rank": 1})

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
        """Device peak per phase (the largest of its segments), in the order they first ran."""
        out: dict[str, PhasePeak] = {}
        for key, pk in self.segments.items():
            ph = key.split("/")[0]
            if ph not in out or pk.device > out[ph].device:
                out[ph] = pk
        return out

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
            "peak_bytes": self.peak_bytes,
            "traced_device": self.device,
            "peak_phase": self.peak_phase,
            "phases": {
                p: {"device_peak_bytes": v.device, "by_category": dict(v.by_category)}
                for p, v in self.phases.items()
            },
            "layers": self.layers,
            "traced_layers": list(self.traced_layers),
            "step": dict(self.step),
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
    both = b.peak_bytes + k * (b.peak_bytes - a.peak_bytes)
    return dataclasses.replace(
        b, layers=layers, segments=segs, host_bytes=host, traced_layers=(a.layers, b.layers),
        peak_bytes=both,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# the step
# ----------------------------------------------------------------------------------------------
# the memory options the trace takes as keywords (ParallelOptions' memory fields; checkpointing
# is ``ac``, the chunk sizes are the defaults)
FEATURES = tuple(
    f for f in MEMORY_OPTIONS
    if f not in ("activation_checkpointing", "loss_chunk_tokens", "mlp_chunk_tokens")
)  # fmt: skip


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
    device: str = "cuda",
    step: StepSpec | str = "sft",
    options: ParallelOptions | None = None,
    **features: Any,
) -> StepTrace:
    """Trace one steady-state training step of rank 0 (see the module docstring).

    Args:
        model: preset name.
        seq_len: tokens per sequence ``S`` (micro-batch 1 per dp rank).
        dp: data-parallel degree (``dp * sp`` fake ranks).
        sp: sequence-parallel degree.
        ac: activation checkpointing (every block), with the keyword features.
        layers: trace a model with this many blocks instead of the preset's.
        warmup_seq_len: the warm-up step's length (default: the smallest that every feature
            accepts, ``sp * 64``).
        breakdown: list this many of the largest storages alive at the device peak (each
            storage of at least 1 MiB records the library line that allocated it).
        device: the run to trace: ``"cuda"`` (FSDP2's bf16 compute with fp32 reduction, the
            activation offloader's CUDA schedule) or ``"cpu"`` (as the trainer runs on a CPU
            with gloo: fp32, no mixed-precision policy, the offloader's CPU schedule).
        step: the step traced (a :class:`~dtensor_ulysses.memtrace.steps.StepSpec` or its
            kind): ``"sft"`` (the trainer's :func:`~dtensor_ulysses.train.train_step`, one row
            per dp rank), ``"dpo"`` (:func:`~dtensor_ulysses.memtrace.steps.dpo_step`: a
            chosen and a rejected row of ``seq_len`` tokens each, a reference model) or
            ``"grpo"`` (:func:`~dtensor_ulysses.memtrace.steps.grpo_step`: ``G``
            prompt+completion rows of ``seq_len`` tokens, a reference when ``beta > 0``),
            ``"distill"`` (:func:`~dtensor_ulysses.memtrace.steps.distill_step`: one
            prompt+completion row of ``seq_len`` tokens, a teacher of the same preset) or
            ``"vl"`` (:func:`~dtensor_ulysses.memtrace.vision_step.vl_step`: one row whose
            first ``images x image_patches`` tokens are image tokens, a vision tower).
        options: the recipe traced, as one :class:`~dtensor_ulysses.plan.ParallelOptions`
            (its ``mixed_precision`` is replaced by the traced device's policy); ``None``: built
            from ``ac`` and ``features`` (:func:`~dtensor_ulysses.memtrace.trace_options`:
            SDPA, uneven heads allowed).
        **features: :class:`~dtensor_ulysses.plan.ParallelOptions` fields as keywords
            (``tiled_loss``, ``tiled_mlp``, ``head_chunks``, ``offload_*``, chunk sizes),
            instead of ``options``.

    Raises:
        NotImplementedError: a requested feature is not in the trainer.
        TraceUnavailable: this torch lacks the private APIs.
        ValueError: ``device`` is neither ``"cuda"`` nor ``"cpu"``; a post-training step of a
            preset the built-in model does not build (a hybrid); both ``options`` and keyword
            features.
    """
    if device not in TRACE_DEVICES:
        raise ValueError(f"device={device!r}: trace one of {', '.join(TRACE_DEVICES)}")
    spec = step if isinstance(step, StepSpec) else StepSpec(step)
    policy = default_mixed_precision(device)  # the trainer's policy on that device
    if options is None:
        options = trace_options(ac, features)
        used = {k: v for k, v in features.items() if v not in (None, False)}
    elif features:
        raise ValueError(
            f"trace_train_step: pass the options as a ParallelOptions or as keywords, not both "
            f"(got the object and {sorted(features)})"
        )
    else:
        off = ParallelOptions()
        used = {k: getattr(options, k) for k in FEATURES if getattr(options, k) != getattr(off, k)}
    options = dataclasses.replace(options, mixed_precision=policy)  # the traced device's
    schedule = cuda_schedule_on_cpu() if device == "cuda" else contextlib.nullcontext()
    offload_params = options.offload_params
    warm = warmup_seq_len or sp * 64
    with _temporary_preset(model, layers) as name, hybrid_model_dir(name) as hf_dir:
        cfg = trace_config(name, seq_len, dp, sp, options)
        if hf_dir is not None:  # a hybrid: the real transformers model, Gated DeltaNet routed
            if spec.kind != "sft":
                raise ValueError(
                    f"step={spec.kind!r}: the {spec.kind.upper()} step is traced on the built-in "
                    f"model; {model} is a hybrid (a transformers model): trace it with step='sft'"
                )
            cfg = dataclasses.replace(cfg, hf_model=hf_dir)
        n_layers = (layers if layers is not None else None) or _n_layers(model)
        with fake_world(cfg.dims().world_size) as (fake_mode, make_recorder):
            rec = make_recorder()
            tl = rec.timeline
            tl.where_min_bytes = 2**20 if breakdown else None
            # the degrees built once with the configuration, bound to their mesh
            dims = ParallelDims.from_mesh(cfg.dims().build_mesh("cpu"))
            mesh = dims.world_mesh
            _ = dims.flat_mesh  # made on real tensors, before the fake mode (steps reuse it)
            with fake_mode, rec, schedule:
                cpu = torch.device("cpu")
                net, optimizer, scheduler = build(cfg, mesh, cpu, init=False)
                hooks = _phase_hooks(net, optimizer, rec, offload_params)
                reference = None
                if spec.has_reference:  # sharded like the policy; no gradients, no optimizer
                    frozen = torch.bfloat16 if device == "cuda" else None  # no master copy
                    ref_net = build(cfg, mesh, cpu, init=False)[0]
                    reference = reference_model(ref_net, frozen)
                    phase = "teacher" if spec.kind == "distill" else "reference"
                    hooks += _phase_hooks(reference, None, rec, offload_params, phase)
                    if spec.kind == "distill":  # back in the student's loss: the divergence
                        hooks.append(reference.register_forward_hook(
                            lambda _m, _a, _o: tl.mark("loss")))  # fmt: skip
                tower = None
                if spec.vision is not None:  # the vision-language step
                    tower, run, more = _vision_runner(spec.vision, cfg, dims, net, optimizer,
                                                      scheduler, rec, policy)  # fmt: skip
                    hooks += more
                    warm = max(warm, -(-spec.vision.image_tokens // sp) * sp)
                else:
                    run = step_runner(spec, net, reference, optimizer, scheduler, dims,
                                      grad_clip=cfg.grad_clip, cuda=device == "cuda",
                                      mark=tl.mark)  # fmt: skip
                run(rank0_batch(warm, sp, spec.rows))
                _classify_states(net, optimizer, tl, offload_params)
                if tower is not None:
                    _classify_states(tower[0], tower[1], tl, offload_params)
                if reference is not None:
                    _classify_states(reference, None, tl, offload_params)
                batch = rank0_batch(seq_len, sp, spec.rows)
                tl.mark("step")
                run(batch)
                tl.mark("end")
                for h in hooks:
                    h.remove()
            segments, host_peak = tl.peaks("step")
            both = tl.total_peak
            top = tl.live_at_peak("step", breakdown) if breakdown else []
    return StepTrace.from_segments(
        n_layers, seq_len, dp, sp, segments, host_peak, traced_layers=(n_layers,), features=used,
        breakdown=top, device=device, peak_bytes=both, step=spec.describe(),
    )  # fmt: skip


def _vision_runner(vision: VisionSpec, cfg, dims, net, optimizer, scheduler, rec, policy):
    """The vision-language step's tower (FSDP2 over ``dp x sp`` like the decoder, its own
    AdamW), its ``vision`` mark and ``run(batch)``: ``((tower, tower_optimizer), run, hooks)``."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    tower = VisionTower(vision, net.shape.dim)
    kw: dict[str, Any] = {"mesh": dims.flat_mesh}
    if policy is not None:
        kw["mp_policy"] = policy
    if cfg.offload_params:  # as the decoder: FSDP2's CPU offload, AdamW on the host
        kw["offload_policy"] = fsdp_offload_policy(dims.world_mesh)
    for block in tower.layers:
        fully_shard(block, **kw)
    fully_shard(tower, **kw)
    for m in tower.modules():
        if isinstance(m, FSDPModule):  # the decoder's reduction: a sum (the loss is a mean)
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    tower_opt = torch.optim.AdamW(tower.parameters(), lr=cfg.lr)
    tl = rec.timeline
    # ``vision``: the tower's forward, the gather and the projection; the decoder's forward
    # (its embedding, the merge) starts where the tower's forward ends
    hooks = [
        tower.register_forward_pre_hook(lambda _m, _a: tl.mark("vision"), prepend=True),
        tower.register_forward_hook(lambda _m, _a, _o: tl.mark("forward:embed")),
    ]
    offload = bool(cfg.offload_params)

    def step_pre(_opt, _args, _kwargs):  # after the decoder's step: the same bookkeeping
        for p in tower.parameters():
            if p.grad is not None:
                g = _local(p.grad)
                tl.add(g)
                tl.set_category(g, "gradients")
                if offload:
                    tl.set_host(g, late=True)
        rec.all_host = offload  # CPUOffloadPolicy: AdamW steps on host tensors

    def step_post(_opt, _args, _kwargs):
        rec.all_host = False

    hooks += [tower_opt.register_step_pre_hook(step_pre),
              tower_opt.register_step_post_hook(step_post)]  # fmt: skip
    pixels = [torch.zeros(r, 3 * 14 * 14) for r in vision.patches]  # the batch's images
    sp_group, group = dims.sp_mesh.get_group(), dims.flat_mesh.get_group()
    sp_rank = dims.sp_rank

    def run(batch):
        return vl_step(net, tower, batch, pixels, (optimizer, tower_opt), scheduler,
                       sp_group=sp_group, sp_rank=sp_rank, group=group,
                       grad_clip=cfg.grad_clip)  # fmt: skip

    return (tower, tower_opt), run, hooks
