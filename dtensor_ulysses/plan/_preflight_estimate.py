"""The closed-form memory estimate of one rank's training step: :func:`estimate_memory`.

One rank's peak memory in a training step, as device and host bytes with their parts, from the
model shape, the layout, the batch and the memory features; no torch, microseconds. The formulas
and their error against the fake-tensor trace are in the :mod:`dtensor_ulysses.plan.preflight`
docstring, which uses the letters below.

Legend: ``W = dp * sp`` ranks, ``n = P / W`` parameters a rank, ``c`` bytes per compute element,
``t`` local tokens, ``L`` blocks, ``V`` vocabulary, ``D`` model dim, ``F`` MLP dim, ``q``/``kv``
query/kv width (heads * head dim), ``K`` head chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dtensor_ulysses.plan.presets import ModelShape
from dtensor_ulysses.plan.recipe import ParallelOptions
from dtensor_ulysses.plan.splits import default_loss_chunk, local_tokens

__all__ = ["RUNTIME_BYTES", "MemoryEstimate", "estimate_memory", "format_bytes"]

RUNTIME_BYTES = 128 * 2**20


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
    options: ParallelOptions | None = None,
    *,
    seq_len: int,
    batch_size: int,
    dp: int,
    sp: int,
    compute_bytes: int = 4,
) -> MemoryEstimate:
    """One rank's peak memory in a training step (the closed form of the
    :mod:`dtensor_ulysses.plan.preflight` docstring).

    Args:
        shape: the model.
        options: the run's recipe (:class:`~dtensor_ulysses.plan.ParallelOptions`; its memory
            fields and ``overlap_comm`` count); ``None``: every option off.
        seq_len: tokens per sequence.
        batch_size: the *global* batch.
        dp: data-parallel degree.
        sp: sequence-parallel degree.
        compute_bytes: bytes per element of compute (2: bf16 on CUDA; 4: fp32 on CPU).
    """
    o = ParallelOptions() if options is None else options
    W = dp * sp
    c = compute_bytes
    D, F, L, V = shape.dim, shape.ffn_dim, shape.n_layers, shape.vocab_size
    q, kv = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    t = local_tokens(batch_size, dp, seq_len, sp)
    root_params = V * D * (1 if shape.tie_embeddings else 2) + D
    block_params = (shape.n_params - root_params) // max(1, L)
    n = -(-shape.n_params // W)

    host: dict[str, int] = {}
    grads = 4 * n
    base: dict[str, int] = {}
    if o.offload_params:  # gradients reach the host a block at a time
        host["parameters, gradients, optimizer states"] = 16 * n
        base["parameter shards in flight"] = 4 * -(-block_params // W)
        grads = 4 * -(-block_params // W)
    elif o.offload_optimizer:
        base["parameters"] = 4 * n
        host["optimizer states and master weights"] = 16 * n
    else:
        base["parameters"] = 4 * n
        base["optimizer states"] = 8 * n
    untied = not shape.tie_embeddings  # the head is its own FSDP2 unit (du.parallelize)
    head_params = V * D if untied else 0
    gathered = 2 * block_params * c + block_params * 4 + (root_params - head_params) * c
    gathered += head_params * 4  # the head's fp32 reduce-scatter input, until the next one

    K = max(1, o.head_chunks)
    kv_recv = kv * max(1, sp // max(1, shape.n_kv_heads))  # kv heads replicated when sp > K_kv
    saved = 4 * D + 2 * (2 * kv) + 4 * q // K + (0 if o.tiled_mlp else 4 * F)  # what a block keeps
    # the backward of one block (the peak of a checkpointed step): its input, the attention
    # norm's output, q, the gradients of o and q and of the residual stream (3D + 3q); the
    # exchanged k, v and their gradient accumulators (4 kv'); one head stage's q, d o, o, d q,
    # d k, d v (5 q / K; nothing more with no exchange at all: sp = 1, one stage), and with
    # --overlap-comm the send and receive buffers of the next stage's q and d o and of the
    # previous stage's d q, in flight (6 q / K); or, before it, the MLP's backward (without
    # --tiled-mlp: its 4 saved and 3 gradient F-sized tensors)
    exchanged = sp > 1 or K > 1
    in_flight = 6 if o.overlap_comm and K > 1 else 0  # one stage: k, v move in forward only
    stage = 4 * kv_recv + ((5 + in_flight) * q // K if exchanged else 0)
    attn_bwd = 3 * D + 3 * q + stage
    mlp_bwd = 5 * D + 2 * q + 2 * kv_recv + (0 if o.tiled_mlp else 7 * F)
    act: dict[str, int] = {}
    if o.tiled_mlp:  # one chunk's SwiGLU intermediates, recomputed in backward
        chunk = min(t, o.mlp_chunk_tokens or min(D, t))
        act["mlp chunk"] = 4 * F * chunk * c
    if o.activation_checkpointing:
        kept = D * t * c
        if o.offload_activations:  # on the device: the one recomputed and the one before it
            act["checkpoints"] = min(L, 2) * kept
            host["activation checkpoints"] = max(0, L - 1) * kept
        else:
            act["checkpoints"] = L * kept
        work = max(attn_bwd, mlp_bwd) * t * c
    else:
        act["activations"] = (L - 1) * saved * t * c
        work = (saved + max(attn_bwd, mlp_bwd)) * t * c
    loss_tokens = min(t, o.loss_chunk_tokens or default_loss_chunk(t)) if o.tiled_loss else t
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
