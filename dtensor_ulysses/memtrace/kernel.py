"""The memory of one attention layer's local kernel on packed documents, traced with fake tensors.

Legend: ``B`` batch, ``S`` sequence, ``N`` q heads, ``K`` kv heads, ``H`` head dim.

Compiled code gives the kernel the documents as device tensors (``DocTensors``) and no host
ints; :func:`~dtensor_ulysses.attention.select_backend` with ``compiled=True`` names the kernel
it runs (on a CPU: the blockwise kernel; on CUDA: FlexAttention or flash-attn). Before, that path
was SDPA with a ``[B, 1, S, S]`` boolean mask (16 GiB at 128K tokens). :func:`trace_attention`
runs that kernel's forward and backward on fake tensors (shapes only, no memory) and records
every tensor an op makes: the largest (in elements) and the peak of the bytes alive at once,
so a test can show that no tensor has ``S^2`` elements and that the peak grows linearly in
``S``. The kernel's block temporaries (a block's scores, ``B*N*256*256`` elements) live inside
its one op and are not in the trace; they do not grow with ``S``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtensor_ulysses._torch_private import TorchDispatchMode, fake_world_classes, tree_flatten
from dtensor_ulysses.attention import (
    AttnFeatures,
    build_doc_tensors,
    local_attention,
    select_backend,
)
from dtensor_ulysses.memtrace._timeline import _Timeline

__all__ = ["AttentionTrace", "trace_attention"]


@dataclass(frozen=True)
class AttentionTrace:
    """One traced attention forward and backward.

    Attributes:
        seq_len: ``S``.
        backend: the kernel compiled code runs for these features (``select_backend``).
        peak_bytes: the most bytes alive at once (inputs, output, saved tensors, gradients).
        largest_elements: the most elements of one tensor an op made.
        largest_op: the op that made it.
    """

    seq_len: int
    backend: str
    peak_bytes: int
    largest_elements: int
    largest_op: str


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.timeline = _Timeline()
        self.largest, self.largest_op = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.timeline.add(t, op=func.__name__)
                if t.numel() > self.largest:
                    self.largest, self.largest_op = t.numel(), func.__name__
        return out


def _peak(tl: _Timeline) -> int:
    size: dict[int, int] = {}
    now = best = 0
    for kind, uid, n in tl.events:
        if kind == "a":
            size[uid] = n
        elif kind == "r":
            size[uid] += n
        elif kind == "f" and uid in size:
            n = -size.pop(uid)
        else:
            continue
        now += n
        best = max(best, now)
    return best


def trace_attention(
    seq_len: int,
    *,
    heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 64,
    batch: int = 1,
    doc_len: int | None = None,
    window: tuple[int, int] | None = None,
    dtype: torch.dtype = torch.float32,
    compiled: bool = True,
) -> AttentionTrace:
    """Trace the local kernel on ``batch`` rows of ``seq_len`` tokens packed with documents of
    ``doc_len`` tokens (default ``seq_len // 8``), as a CPU run (compiled by default) selects it.

    Raises:
        TraceUnavailable: this torch lacks fake tensors.
    """
    FakeTensorMode, _ = fake_world_classes()
    S, doc = seq_len, doc_len or max(1, seq_len // 8)
    features = AttnFeatures.of(window=window, docs=True)
    backend = select_backend(features, device_type="cpu", dtype=dtype, head_dim=head_dim,
                             compiled=compiled)  # fmt: skip
    docs = build_doc_tensors([list(range(0, S, doc))] * batch, S, "cpu")  # host ints + ids
    rec = _Recorder()
    with FakeTensorMode(allow_non_fake_inputs=True), rec:
        q_BSNH = torch.empty(batch, S, heads, head_dim, dtype=dtype, requires_grad=True)
        k_BSKH, v_BSKH = (
            torch.empty(batch, S, kv_heads, head_dim, dtype=dtype, requires_grad=True)
            for _ in range(2)
        )
        o_BSNH = local_attention(q_BSNH, k_BSKH, v_BSKH, doc_tensors=docs, window=window,
                                 backend=backend)  # fmt: skip
        o_BSNH.backward(torch.ones_like(o_BSNH))
        del q_BSNH, k_BSKH, v_BSKH, o_BSNH
    return AttentionTrace(S, backend, _peak(rec.timeline), rec.largest, rec.largest_op)
