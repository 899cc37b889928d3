"""Memory preflight: will this run fit on this machine? Answered before anything is allocated.

:func:`estimate_memory` is a closed form (no torch, microseconds) of one rank's peak memory in a
training step, from the model shape, the layout ``(dp, sp)``, the batch and the memory features;
:func:`check_fits` compares it with the capacity of this machine (:func:`device_capacity`,
:func:`host_capacity`) and, when it does not fit, says which of the trainer's memory flags would
make it fit. The trainer runs it in ``validate`` (``--allow-oversubscribe`` skips the refusal).

Why a closed form and not :mod:`dtensor_ulysses.memtrace.trace` (the real step under fake tensors):
the trace of ``llama3-8b`` with 5 and 6 blocks plus its extrapolation takes about 9 s of one CPU
core per rank, every rank would pay it before the run starts, and it traces the CUDA bf16 policy
only. The closed form is meant to catch the runs that cannot fit by a wide margin (an 8B model
on a laptop), not to find the last gigabyte: see ``docs/how-to/troubleshoot.md``.

Per rank, with ``W = dp * sp`` ranks, ``P`` parameters (``n = P / W`` a rank), ``c`` bytes per
compute element (2 with CUDA's bf16 policy, 4 on CPU), ``t = (G / dp) * ceil(S / sp)`` local
tokens, ``L`` blocks, ``V`` vocabulary, ``D`` model dim, ``F`` MLP dim:

* **states** (fp32 shards): parameters ``4n``, gradients ``4n``, AdamW ``8n``;
  ``--offload-optimizer`` moves the AdamW states and a master copy to the host (``16n`` there,
  ``8n`` left on the device); ``--offload-params`` moves all ``16n`` to the host.
* **gathered weights**: two blocks unsharded in compute precision (the one running and FSDP2's
  prefetch of the next), one block's unsharded fp32 gradients in backward, the final norm, and
  (untied) the output head's fp32 reduce-scatter input, which waits for the next one; a tied
  head stays gathered with the embedding for the whole step.
* **activations**: what a block keeps for backward, per token, in compute precision:
  ``4D + 4kv + 4q/K + 4F`` elements (norm inputs and outputs, q/k/v, the attention output and
  its all-to-all, the SwiGLU intermediates), ``q = Nq * H``, ``kv = Nkv * H``, ``K`` the head
  chunks; ``--tiled-mlp`` drops the ``4F``. ``--activation-checkpointing`` keeps only each
  block's input ``D`` (``--offload-activations`` puts those on the host; in a block's backward
  two are on the device, its own and the one before it, brought back meanwhile).
* **the working set of one block's backward** (the peak of a checkpointed step):
  ``3D + 3q`` (its input, the norm's output, q, the gradients of o, q and the residual stream)
  ``+ 4kv'`` (the exchanged k, v and their gradients; ``kv'`` with kv heads replicated when sp
  exceeds them) ``+ 5q/K`` (one head stage: q, d o, o, d q and the kernel's gradients; nothing
  when nothing is exchanged; ``+ 6q/K`` with ``--overlap-comm``, the buffers in flight), or the
  MLP's backward before it (``5D + 2q + 2kv'``, ``+ 7F`` without ``--tiled-mlp``).
* **logits**: ``t * V * (c + 8)`` bytes (the logits, their fp32 log-softmax and its gradient);
  ``--tiled-loss`` computes them a chunk of ``min(2048, t)`` tokens at a time.
* **the peak**: the parameters and optimizer states plus the largest of the loss (kept
  activations, logits, the final hidden states and their gradient), the last block's backward
  (kept activations and the working set) and the end of backward (all gradients and the working
  set). Against the fake-tensor trace of ``llama3-8b`` (sp 1, 4 and 8; 16K to 7.7M tokens;
  with and without checkpointing, tiling, head chunks, overlap and offloading) this is within
  -9% to +6%; ``tests/plan/test_preflight.py`` checks one case against the trace.
* **runtime**: a fixed allowance for what a rank adds beyond importing torch (the data stream,
  allocator slack): :data:`~dtensor_ulysses.plan._preflight_estimate.RUNTIME_BYTES`.

On CPU, device and host are the same memory: the estimate is their sum, compared with the
memory the machine has available, shared by the ranks on it. A run is refused when the estimate
exceeds :data:`HEADROOM` (90%) of the capacity (``--memory-headroom`` changes the fraction): an
estimate within a few percent of the capacity is not a fit, because the estimate errs by up to
-9%, and a real allocator fragments (CUDA's caching allocator keeps freed blocks of other sizes;
the trainer sets ``expandable_segments:True``, which reduces but does not remove this). The same
90% holds on CUDA: a margin of the estimate's error, not a measured fragmentation figure.

On CUDA the device and the host are two limits, each with the headroom. The message names the
one that binds (:attr:`Preflight.binding`): its estimate with the parts, the capacity and where
it comes from, the shortfall, and a fix that helps that memory. For the host that is never a
device flag: an offload flag to drop when the device then holds what it moved, else more ranks
(offloaded states shrink with ``dp * sp``, offloaded checkpoints with ``sp``), fewer ranks per
node (:func:`host_capacity` shares a node's memory among its ranks), a shorter sequence.

**Where the code lives.** This module holds the check (:func:`check_fits`, :class:`Preflight`)
and the trainer's feature lists; the closed form (:func:`estimate_memory`, :class:`MemoryEstimate`,
:func:`format_bytes`, :data:`RUNTIME_BYTES`) is in ``_preflight_estimate.py``, the capacity probes
(:func:`device_capacity`, :func:`host_capacity`, :func:`parse_bytes` and the environment
overrides) in ``_preflight_capacity.py``; import every public name from this module.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

from dtensor_ulysses.plan._preflight_capacity import (
    device_capacity,
    host_capacity,
)
from dtensor_ulysses.plan._preflight_estimate import (
    MemoryEstimate,
    estimate_memory,
    format_bytes,
)
from dtensor_ulysses.plan.presets import ModelShape
from dtensor_ulysses.plan.recipe import MEMORY_OPTIONS, ParallelOptions

__all__ = [
    "check_fits",
    "FEATURE_FLAGS",
    "HEADROOM",
    "MEMORY_FEATURES",
    "Preflight",
]

# A run is refused when the estimate exceeds this fraction of a rank's capacity (the trainer's
# --memory-headroom changes it): the estimate errs by -9% to +6% against the fake-tensor trace,
# and an allocator needs slack beyond what it hands out (see the module docstring).
HEADROOM = 0.90

# The options that change a rank's memory: ParallelOptions fields (the trainer's flags, the
# trace's options), named once in plan/recipe.py.
MEMORY_FEATURES = MEMORY_OPTIONS

# The trainer's memory flags, in the order suggestions list them; the second item says whether
# the flag moves memory to the host (no help on CPU, where the host is the device).
FEATURE_FLAGS: tuple[tuple[str, bool], ...] = (
    ("activation_checkpointing", False),
    ("tiled_loss", False),
    ("tiled_mlp", False),
    ("offload_activations", True),
    ("offload_optimizer", True),
    ("offload_params", True),
)


# ----------------------------------------------------------------------------------------------
# the check
# ----------------------------------------------------------------------------------------------
@dataclass
class Preflight:
    """The outcome: the estimate, the capacities, and (when it does not fit) a message."""

    estimate: MemoryEstimate
    device_type: str
    device_capacity: int | None
    host_capacity: int | None
    capacity_source: str = ""
    suggestion: list[str] = field(default_factory=list)
    problem: str | None = None
    binding: str | None = None  # "device", "host" or "device and host" when it does not fit

    @property
    def fits(self) -> bool:
        return self.problem is None


def _need(est: MemoryEstimate, device_type: str) -> tuple[int, int]:
    """(device bytes, host bytes) to compare with the capacities; on CPU both are one memory."""
    if device_type == "cuda":
        return est.device_bytes, est.host_bytes
    return est.device_bytes + est.host_bytes, 0


def _fits(
    est: MemoryEstimate,
    device_type: str,
    dev_cap: int | None,
    host_cap: int | None,
    headroom: float = HEADROOM,
):
    need_dev, need_host = _need(est, device_type)
    ok_dev = dev_cap is None or need_dev <= dev_cap * headroom
    ok_host = device_type != "cuda" or host_cap is None or need_host <= host_cap * headroom
    return ok_dev and ok_host


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_fits(
    shape: ModelShape,
    options: ParallelOptions | None = None,
    *,
    device_type: str,
    seq_len: int,
    batch_size: int,
    dp: int,
    sp: int,
    device_cap: int | None = None,
    host_cap: int | None = None,
    capacity_source: str = "",
    headroom: float | None = None,
    host_capacity_source: str = "",
) -> Preflight:
    """Estimate this rank's memory and compare it with the capacities given (or probed).

    ``options``: the run's :class:`~dtensor_ulysses.plan.ParallelOptions` (its memory fields:
    ``activation_checkpointing``, ``tiled_loss``, ...; ``None``: all off); ``headroom``: the
    fraction of the capacity an estimate may use (None: :data:`HEADROOM`). When the run does
    not fit, ``binding`` names the memory that does not (``"device"``, ``"host"`` or both; on
    CPU they are one, reported as ``"device"``) and ``problem`` holds a message with that
    memory's estimate, capacity and shortfall, and a fix that helps it: the smallest set of
    flags that fits, or when the host binds the offload flags to drop (if the device then fits)
    or more
    ranks, fewer ranks per node, a shorter sequence.
    """
    host_source = host_capacity_source
    if device_cap is None and host_cap is None:
        device_cap, capacity_source = device_capacity(device_type)
        if device_type == "cuda":
            host_cap, host_source = host_capacity()
        else:
            host_cap = device_cap
    c = 2 if device_type == "cuda" else 4
    kw: dict[str, Any] = dict(seq_len=seq_len, batch_size=batch_size, dp=dp, sp=sp, compute_bytes=c)
    options = ParallelOptions() if options is None else options
    est = estimate_memory(shape, options, **kw)
    out = Preflight(est, device_type, device_cap, host_cap, capacity_source)
    if headroom is None:
        headroom = HEADROOM
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom {headroom} must be a fraction in (0, 1], e.g. {HEADROOM}")
    if _fits(est, device_type, device_cap, host_cap, headroom):
        return out

    # the smallest set of flags (then the smallest estimate) that fits
    candidates = [
        name for name, to_host in FEATURE_FLAGS
        if not getattr(options, name) and (device_type == "cuda" or not to_host)
    ]  # fmt: skip
    best: tuple[int, int, tuple[str, ...]] | None = None
    smallest: tuple[int, tuple[str, ...]] | None = None
    for k in range(1, len(candidates) + 1):
        for combo in itertools.combinations(candidates, k):
            on: dict[str, Any] = {name: True for name in combo}
            f = dataclasses.replace(options, **on)
            if f.offload_activations and not f.activation_checkpointing:
                continue
            if f.offload_optimizer and f.offload_params:
                continue
            e = estimate_memory(shape, f, **kw)
            need = _need(e, device_type)[0]
            if smallest is None or need < smallest[0]:
                smallest = (need, combo)
            if _fits(e, device_type, device_cap, host_cap, headroom):
                key = (k, need, combo)
                if best is None or key[:2] < best[:2]:
                    best = key
        if best is not None:
            break

    need_dev, need_host = _need(est, device_type)
    dev_over = device_cap is not None and need_dev > device_cap * headroom
    host_over = device_type == "cuda" and host_cap is not None and need_host > host_cap * headroom
    out.binding = "device and host" if dev_over and host_over else "host" if host_over else "device"
    lines = []
    if dev_over or not host_over:
        where = "device memory" if device_type == "cuda" else "memory"
        lines.append(
            f"this run needs about {format_bytes(need_dev)} of {where} per rank "
            f"({est.describe('device')}"
            + (f"; host {est.describe('host')}" if device_type != "cuda" and est.host else "")
            + f") but a rank has {format_bytes(device_cap or 0)} ({capacity_source}), of which "
            f"a run may use {headroom:.0%} ({format_bytes((device_cap or 0) * headroom)}; "
            f"--memory-headroom)"
            + (
                f" (the host fits: {format_bytes(need_host)} of "
                f"{format_bytes(host_cap * headroom)})"
                if device_type == "cuda" and host_cap is not None and not host_over
                else ""
            )
        )
    if host_over:
        assert host_cap is not None
        lines.append(
            ("" if dev_over else "host memory is the limit: ")
            + f"this run needs about {format_bytes(need_host)} of host memory per rank "
            f"({est.describe('host')}) but a rank has {format_bytes(host_cap)} of host memory "
            f"({host_source or 'host capacity'}), of which a run may use {headroom:.0%} "
            f"({format_bytes(host_cap * headroom)}; --memory-headroom): "
            f"{format_bytes(need_host - host_cap * headroom)} short"
            + (
                ""
                if dev_over or device_cap is None
                else f" (the device fits: {format_bytes(need_dev)} of "
                f"{format_bytes(device_cap * headroom)})"
            )
        )
    if best is not None:
        flags = " ".join(_flag(n) for n in best[2])
        out.suggestion = [_flag(n) for n in best[2]]
        lines.append(f"add {flags} (about {format_bytes(best[1])} per rank)")
    elif host_over:
        assert host_cap is not None
        lines.append(_host_fix(shape, kw, options, est, device_type, device_cap, host_cap,
                               headroom, dev_over, out))  # fmt: skip
    else:
        n_more = need_dev / max(1, (device_cap or 1) * headroom)
        floor = smallest[0] if smallest else need_dev
        lines.append(
            f"no combination of the memory flags fits (the smallest needs about "
            f"{format_bytes(floor)}); use about {max(2, int(n_more + 0.999))}x the ranks, a "
            f"smaller --model, --seq-len or --batch-size"
            + (", or GPUs" if device_type != "cuda" else "")
        )
    lines.append("or pass --allow-oversubscribe to start anyway")
    out.problem = "; ".join(lines)
    return out


def _host_fix(
    shape: ModelShape,
    kw: dict[str, Any],
    options: ParallelOptions,
    est: MemoryEstimate,
    device_type: str,
    device_cap: int | None,
    host_cap: int,
    headroom: float,
    dev_over: bool,
    out: Preflight,
) -> str:
    """What helps a run whose host memory binds: the offload flags to drop, when the device then
    fits both; otherwise more ranks or fewer ranks per node (the host bytes per rank shrink with
    ``dp * sp``; a node's memory is shared by its ranks), a shorter sequence or a smaller batch."""
    on = [name for name, to_host in FEATURE_FLAGS if to_host and getattr(options, name)]
    for k in range(1, len(on) + 1):
        for combo in itertools.combinations(on, k):
            off: dict[str, Any] = {name: False for name in combo}
            f = dataclasses.replace(options, **off)
            e = estimate_memory(shape, f, **kw)
            if _fits(e, device_type, device_cap, host_cap, headroom):
                out.suggestion = [f"no {_flag(n)}" for n in combo]
                return (
                    f"drop {' '.join(_flag(n) for n in combo)} (about "
                    f"{format_bytes(e.device_bytes)} of device and {format_bytes(e.host_bytes)} "
                    f"of host per rank)"
                )
    n_host = est.host_bytes / max(1, host_cap * headroom)
    per_token = "activation checkpoints" in est.host  # the only host bytes that grow with S
    n_dev = est.device_bytes / max(1, (device_cap or 1) * headroom) if dev_over else 0.0
    n_more = max(2, int(max(n_host, n_dev) + 0.999))
    dropping = (
        f"dropping {' '.join(_flag(n) for n in on)} (any of them) does not fit both memories; "
        if on
        else ""
    )
    return (
        f"{dropping}the offloaded bytes per rank shrink with the ranks: use about {n_more}x the "
        f"ranks on more nodes, or fewer ranks per node (a node's host memory is shared by its "
        f"ranks), "
        + ("a shorter --seq-len, a smaller --batch-size or " if per_token else "")
        + "a smaller --model"
        + ("" if dev_over else "; the memory flags that save device memory cannot help here")
    )
