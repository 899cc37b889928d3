"""Memory preflight: will this run fit on this machine? Answered before anything is allocated.

:func:`estimate_memory` is a closed form (no torch, microseconds) of one rank's peak memory in a
training step, from the model shape, the layout ``(dp, sp)``, the batch and the memory features;
:func:`check_fits` compares it with the capacity of this machine (:func:`device_capacity`,
:func:`host_capacity`) and, when it does not fit, says which of the trainer's memory flags would
make it fit. The trainer runs it in ``validate`` (``--allow-oversubscribe`` skips the refusal).

Why a closed form and not :mod:`dtensor_ulysses.memtrace` (the real step under fake tensors):
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
  -9% to +6%; ``tests/test_faults.py`` checks one case against the trace.
* **runtime**: a fixed allowance for what a rank adds beyond importing torch (the data stream,
  allocator slack): :data:`RUNTIME_BYTES`.

On CPU, device and host are the same memory: the estimate is their sum, compared with the
memory the machine has available, shared by the ranks on it. A run is refused when the estimate
exceeds the capacity by more than :data:`TOLERANCE` (5%, the estimate's error).
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass, field
from typing import Any

from dtensor_ulysses.presets import ModelShape

__all__ = [
    "CAPACITY_ENV",
    "FEATURE_FLAGS",
    "MEMORY_FEATURES",
    "MemoryEstimate",
    "Preflight",
    "check_fits",
    "device_capacity",
    "estimate_memory",
    "format_bytes",
    "host_capacity",
    "parse_bytes",
]

# Per-rank capacity for tests and for machines whose limit the probes cannot see (a container's
# cgroup, a GPU shared with other jobs): bytes, or a number with a unit ("12GiB", "512MB").
CAPACITY_ENV = "DTENSOR_ULYSSES_MEMORY_CAPACITY"
HOST_CAPACITY_ENV = "DTENSOR_ULYSSES_HOST_MEMORY_CAPACITY"

RUNTIME_BYTES = 128 * 2**20

# A run is refused only when the estimate exceeds the capacity by more than this fraction (the
# estimate's error against the fake-tensor trace): the preflight stops runs that cannot fit, and
# leaves the last few percent to the allocator.
TOLERANCE = 0.05

# The trainer's memory flags, in the order suggestions list them; the second item says whether
# the flag moves memory to the host (no help on CPU, where the host is the device).
# The trainer's memory features: TrainConfig fields, also the trace's options (one list).
MEMORY_FEATURES = (
    "activation_checkpointing",
    "tiled_loss",
    "loss_chunk_tokens",
    "tiled_mlp",
    "mlp_chunk_tokens",
    "head_chunks",
    "offload_activations",
    "offload_optimizer",
    "offload_params",
)

FEATURE_FLAGS: tuple[tuple[str, bool], ...] = (
    ("activation_checkpointing", False),
    ("tiled_loss", False),
    ("tiled_mlp", False),
    ("offload_activations", True),
    ("offload_optimizer", True),
    ("offload_params", True),
)

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}  # fmt: skip


def parse_bytes(text: str) -> int:
    """``"12GiB"``, ``"512MB"``, ``"1e9"`` or ``"1000"`` as a number of bytes.

    Raises:
        ValueError: not a non-negative number with an optional unit (B, KB/MB/GB/TB, KiB/...).
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"{text!r} is not a memory size; write bytes or a number with a unit, e.g. 16GiB"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    """``n`` bytes in GiB (or MiB below 1 GiB), one decimal."""
    return f"{n / 2**30:.1f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.0f} MiB"


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's estimated peak: device and host bytes, each with its parts."""

    device: dict[str, int]
    host: dict[str, int]
    details: dict[str, int] = field(default_factory=dict)  # the workspace's parts

    @property
    def device_bytes(self) -> int:
        return sum(self.device.values())

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    def describe(self, part: str = "device") -> str:
        items = {"device": self.device, "host": self.host, "details": self.details}[part]
        return ", ".join(f"{k} {format_bytes(v)}" for k, v in items.items() if v)


def estimate_memory(
    shape: ModelShape,
    *,
    seq_len: int,
    batch_size: int,
    dp: int,
    sp: int,
    compute_bytes: int = 4,
    activation_checkpointing: bool = False,
    tiled_loss: bool = False,
    loss_chunk_tokens: int | None = None,
    tiled_mlp: bool = False,
    mlp_chunk_tokens: int | None = None,
    head_chunks: int = 1,
    offload_activations: bool = False,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    overlap_comm: bool = False,
) -> MemoryEstimate:
    """One rank's peak memory in a training step (the closed form of the module docstring).

    Args:
        shape: the model.
        seq_len, batch_size: tokens per sequence and the *global* batch.
        dp, sp: the layout.
        compute_bytes: bytes per element of compute (2: bf16 on CUDA; 4: fp32 on CPU).
        the rest: the trainer's memory features, as in
            :class:`~dtensor_ulysses.train.TrainConfig`.
    """
    W = dp * sp
    c = compute_bytes
    D, F, L, V = shape.dim, shape.ffn_dim, shape.n_layers, shape.vocab_size
    q, kv = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    t = (batch_size // dp) * -(-seq_len // sp)
    root_params = V * D * (1 if shape.tie_embeddings else 2) + D
    block_params = (shape.n_params - root_params) // max(1, L)
    n = -(-shape.n_params // W)

    host: dict[str, int] = {}
    grads = 4 * n
    base: dict[str, int] = {}
    if offload_params:  # gradients reach the host a block at a time
        host["parameters, gradients, optimizer states"] = 16 * n
        base["parameter shards in flight"] = 4 * -(-block_params // W)
        grads = 4 * -(-block_params // W)
    elif offload_optimizer:
        base["parameters"] = 4 * n
        host["optimizer states and master weights"] = 16 * n
    else:
        base["parameters"] = 4 * n
        base["optimizer states"] = 8 * n
    untied = not shape.tie_embeddings  # the head is its own FSDP2 unit (du.parallelize)
    head_params = V * D if untied else 0
    gathered = 2 * block_params * c + block_params * 4 + (root_params - head_params) * c
    gathered += head_params * 4  # the head's fp32 reduce-scatter input, until the next one

    K = max(1, head_chunks)
    kv_recv = kv * max(1, sp // max(1, shape.n_kv_heads))  # kv heads replicated when sp > K_kv
    saved = 4 * D + 2 * (2 * kv) + 4 * q // K + (0 if tiled_mlp else 4 * F)  # what a block keeps
    # the backward of one block (the peak of a checkpointed step): its input, the attention
    # norm's output, q, the gradients of o and q and of the residual stream (3D + 3q); the
    # exchanged k, v and their gradient accumulators (4 kv'); one head stage's q, d o, o, d q,
    # d k, d v (5 q / K; nothing more with no exchange at all: sp = 1, one stage), and with
    # --overlap-comm the send and receive buffers of the next stage's q and d o and of the
    # previous stage's d q, in flight (6 q / K); or, before it, the MLP's backward (without
    # --tiled-mlp: its 4 saved and 3 gradient F-sized tensors)
    exchanged = sp > 1 or K > 1
    in_flight = 6 if overlap_comm and K > 1 else 0  # one stage: k, v move in forward only
    stage = 4 * kv_recv + ((5 + in_flight) * q // K if exchanged else 0)
    attn_bwd = 3 * D + 3 * q + stage
    mlp_bwd = 5 * D + 2 * q + 2 * kv_recv + (0 if tiled_mlp else 7 * F)
    act: dict[str, int] = {}
    if tiled_mlp:  # one chunk's SwiGLU intermediates, recomputed in backward
        chunk = min(t, mlp_chunk_tokens or min(D, t))
        act["mlp chunk"] = 4 * F * chunk * c
    if activation_checkpointing:
        kept = D * t * c
        if offload_activations:  # on the device: the one recomputed and the one before it
            act["checkpoints"] = min(L, 2) * kept
            host["activation checkpoints"] = max(0, L - 1) * kept
        else:
            act["checkpoints"] = L * kept
        work = max(attn_bwd, mlp_bwd) * t * c
    else:
        act["activations"] = (L - 1) * saved * t * c
        work = (saved + max(attn_bwd, mlp_bwd)) * t * c
    loss_tokens = min(t, loss_chunk_tokens or min(2048, t)) if tiled_loss else t
    logits = loss_tokens * V * (c + 8)
    # Gradients fill up in backward as activations are freed: the step's peak is the larger of
    # the loss (all kept activations, the logits, the final hidden states and their gradient),
    # the backward of the last block (all kept activations, its working set) and the end of
    # backward (all gradients, a block's working set).
    at_loss = gathered + sum(act.values()) + logits + 2 * D * t * c
    at_block = gathered + sum(act.values()) + work
    at_end = grads + gathered + work
    fwd = max(at_loss, at_block)
    bwd = at_end
    act["logits"] = logits
    device = dict(base)
    if fwd >= bwd:
        device["activations and workspace"] = fwd
    else:
        device["gradients and workspace"] = bwd
    details = {"gradients": grads, "gathered weights": gathered, **act}
    host["runtime"] = RUNTIME_BYTES
    return MemoryEstimate(device, host, details)


# ----------------------------------------------------------------------------------------------
# capacity
# ----------------------------------------------------------------------------------------------
def _local_ranks() -> int:
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        try:
            return max(1, int(os.environ[var]))
        except (KeyError, ValueError):
            continue
    return 1


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_available() -> int | None:
    """What the memory cgroup (v2 or v1) of this process still allows, if it sets a limit."""
    v1 = "/sys/fs/cgroup/memory/memory."
    for limit_f, usage_f in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (v1 + "limit_in_bytes", v1 + "usage_in_bytes"),
    ):
        try:
            with open(limit_f) as f:
                raw = f.read().strip()
            if raw == "max" or int(raw) >= 2**60:
                return None
            with open(usage_f) as f:
                return max(0, int(raw) - int(f.read().strip()))
        except (OSError, ValueError):
            continue
    return None


def host_capacity() -> tuple[int | None, str]:
    """This rank's share of the host memory available now, and where the number comes from.

    ``DTENSOR_ULYSSES_HOST_MEMORY_CAPACITY`` (per rank) overrides it; otherwise the smaller of
    ``MemAvailable`` and the cgroup's remaining limit, divided by the ranks on this machine
    (``LOCAL_WORLD_SIZE``). ``None`` when nothing can be read.
    """
    if os.environ.get(HOST_CAPACITY_ENV):
        return parse_bytes(os.environ[HOST_CAPACITY_ENV]), f"${HOST_CAPACITY_ENV}"
    found = [x for x in (_meminfo_available(), _cgroup_available()) if x is not None]
    if not found:
        return None, "unknown"
    ranks = _local_ranks()
    return min(found) // ranks, f"available host memory / {ranks} local rank(s)"


def device_capacity(device_type: str) -> tuple[int | None, str]:
    """This rank's device memory (total memory of its GPU; on CPU, :func:`host_capacity`), and
    where the number comes from. ``DTENSOR_ULYSSES_MEMORY_CAPACITY`` overrides it."""
    if os.environ.get(CAPACITY_ENV):
        return parse_bytes(os.environ[CAPACITY_ENV]), f"${CAPACITY_ENV}"
    if device_type == "cuda":
        import torch

        index = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
        props = torch.cuda.get_device_properties(index)
        return int(props.total_memory), f"total memory of {props.name}"
    return host_capacity()


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

    @property
    def fits(self) -> bool:
        return self.problem is None


def _need(est: MemoryEstimate, device_type: str) -> tuple[int, int]:
    """(device bytes, host bytes) to compare with the capacities; on CPU both are one memory."""
    if device_type == "cuda":
        return est.device_bytes, est.host_bytes
    return est.device_bytes + est.host_bytes, 0


def _fits(est: MemoryEstimate, device_type: str, dev_cap: int | None, host_cap: int | None):
    need_dev, need_host = _need(est, device_type)
    ok_dev = dev_cap is None or need_dev <= dev_cap * (1 + TOLERANCE)
    ok_host = device_type != "cuda" or host_cap is None or need_host <= host_cap * (1 + TOLERANCE)
    return ok_dev and ok_host


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_fits(
    shape: ModelShape,
    *,
    device_type: str,
    features: dict,
    seq_len: int,
    batch_size: int,
    dp: int,
    sp: int,
    device_cap: int | None = None,
    host_cap: int | None = None,
    capacity_source: str = "",
) -> Preflight:
    """Estimate this rank's memory and compare it with the capacities given (or probed).

    ``features``: the memory fields of a :class:`~dtensor_ulysses.train.TrainConfig`
    (``activation_checkpointing``, ``tiled_loss``, ...). When the run does not fit, ``problem``
    holds a message with the estimate, the capacity and the smallest set of flags that fits (or
    that none does, and by how much the best falls short).
    """
    if device_cap is None and host_cap is None:
        device_cap, capacity_source = device_capacity(device_type)
        host_cap = host_capacity()[0] if device_type == "cuda" else device_cap
    c = 2 if device_type == "cuda" else 4
    kw: dict[str, Any] = dict(seq_len=seq_len, batch_size=batch_size, dp=dp, sp=sp, compute_bytes=c)
    est = estimate_memory(shape, **kw, **features)
    out = Preflight(est, device_type, device_cap, host_cap, capacity_source)
    if _fits(est, device_type, device_cap, host_cap):
        return out

    # the smallest set of flags (then the smallest estimate) that fits
    candidates = [
        name for name, to_host in FEATURE_FLAGS
        if not features.get(name) and (device_type == "cuda" or not to_host)
    ]  # fmt: skip
    best: tuple[int, int, tuple[str, ...]] | None = None
    smallest: tuple[int, tuple[str, ...]] | None = None
    for k in range(1, len(candidates) + 1):
        for combo in itertools.combinations(candidates, k):
            f = dict(features, **{name: True for name in combo})
            if f.get("offload_activations") and not f.get("activation_checkpointing"):
                continue
            if f.get("offload_optimizer") and f.get("offload_params"):
                continue
            e = estimate_memory(shape, **kw, **f)
            need = _need(e, device_type)[0]
            if smallest is None or need < smallest[0]:
                smallest = (need, combo)
            if _fits(e, device_type, device_cap, host_cap):
                key = (k, need, combo)
                if best is None or key[:2] < best[:2]:
                    best = key
        if best is not None:
            break

    need_dev, need_host = _need(est, device_type)
    where = "device" if device_type == "cuda" else "memory"
    lines = [
        f"this run needs about {format_bytes(need_dev)} of {where} per rank "
        f"({est.describe('device')}"
        + (f"; host {est.describe('host')}" if device_type != "cuda" and est.host else "")
        + f") but a rank has {format_bytes(device_cap or 0)} ({capacity_source})"
    ]
    if device_type == "cuda" and host_cap is not None and need_host > host_cap:
        lines[0] += (
            f", and about {format_bytes(need_host)} of host memory per rank "
            f"({est.describe('host')}) against {format_bytes(host_cap)}"
        )
    if best is not None:
        flags = " ".join(_flag(n) for n in best[2])
        out.suggestion = [_flag(n) for n in best[2]]
        lines.append(f"add {flags} (about {format_bytes(best[1])} per rank)")
    else:
        n_more = need_dev / max(1, device_cap or 1)
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
