"""Trace the real model's memory with fake tensors on a fake process group (no GPU, no memory).

``dtensor_ulysses/model.py`` is built on ``meta``, parallelized by ``du.parallelize`` (Ulysses,
activation checkpointing, FSDP2 with bf16 parameters / fp32 reduction) over a *virtual* world of
``dp * sp`` ranks, materialized as fake tensors, and run forward + backward on one rank's
sequence slice. A dispatch mode counts the bytes of every live storage (parameters included) and
keeps the peak; saved-tensor hooks count what one block keeps for backward. Both are compared with
:mod:`simulations.memory`.

Private torch APIs (fake process group, ``FakeTensorMode``) come from
``dtensor_ulysses._torch_private``, the one place for them, and are used only in
:func:`_fake_world`.

The trace has no optimizer: the compared prediction drops ``optimizer_states`` and ``fixed``
(framework buffers the trace does not allocate). CPU kernels stand in for CUDA ones (PyTorch's
SDPA flash kernel for CPU saves the same q, k, v, o, logsumexp as FlashAttention).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from simulations import memory
from simulations.config import Workload
from simulations.hardware import get_gpu

__all__ = ["CASES", "TraceCase", "TraceUnavailable", "check", "trace"]

GiB = 2**30
TOLERANCE = 0.10


class TraceUnavailable(RuntimeError):
    """The real model or a torch API the trace needs is missing."""


@dataclass(frozen=True)
class TraceCase:
    """One virtual-world trace: model, sequence, layout, checkpointing."""

    model: str
    seq_len: int
    dp: int
    sp: int
    ac: str = "full"
    n_layers: int | None = None  # fewer blocks than the preset (quick tests); None: all

    def label(self) -> str:
        layers = f" ({self.n_layers} layers)" if self.n_layers else ""
        return f"{self.model}{layers} S={self.seq_len:,} dp={self.dp} sp={self.sp} ac={self.ac}"

    def workload(self) -> Workload:
        from dtensor_ulysses.presets import get_shape

        shape = get_shape(self.model)
        if self.n_layers:
            shape = shape.with_(n_layers=self.n_layers)
        return Workload(
            shape, self.seq_len, dp=self.dp, sp=self.sp, ac=self.ac, gpu=get_gpu("h100")
        )


CASES = [
    TraceCase("llama3-8b", 131072, 1, 8),
    TraceCase("llama3-8b", 262144, 1, 16),
    TraceCase("llama3-8b", 524288, 1, 32),
    TraceCase("llama3-8b", 32768, 1, 8, ac="none"),
    TraceCase("qwen3-4b", 65536, 1, 4),
]


@contextlib.contextmanager
def _fake_world(world_size: int) -> Iterator[tuple[Any, Callable[[int], Any]]]:
    """A fake process group of ``world_size`` ranks (this process is rank 0), a fake-tensor mode
    and a live-bytes tracker class.

    The private torch APIs it needs (fake process group, ``FakeTensorMode``,
    ``TorchDispatchMode``) come from ``dtensor_ulysses._torch_private``, the project's one place
    for them. The tracker counts each storage an op creates once, until it is freed
    or ``resize_``-d (FSDP2 frees gathered parameters with ``untyped_storage().resize_(0)``), and
    keeps the peak.
    """
    try:
        import weakref

        import torch
        import torch.distributed as dist

        from dtensor_ulysses._torch_private import (
            TorchDispatchMode,
            fake_world_classes,
            tree_flatten,
        )

        FakeTensorMode, FakeStore = fake_world_classes()
    except ImportError as e:  # a torch without these private modules
        raise TraceUnavailable(f"fake process group / fake tensors unavailable: {e}") from None

    class Tracker(TorchDispatchMode):
        def __init__(self, base: int) -> None:
            super().__init__()
            self.current = self.peak = base
            self._size: dict[int, int] = {}

        def _free(self, key: int) -> None:
            self.current -= self._size.pop(key, 0)

        def track(self, t: object) -> None:
            """Count a tensor made outside the mode (the parameters) until it is freed."""
            self._add(t)

        def _add(self, t: object) -> None:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if id(st) not in self._size:
                    self._size[id(st)] = st.nbytes()
                    self.current += st.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(st, self._free, id(st))

        def resized(self, st: object, nbytes: int) -> None:
            if id(st) in self._size:
                self.current += nbytes - self._size[id(st)]
                self._size[id(st)] = nbytes
                self.peak = max(self.peak, self.current)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                self._add(t)
            return out

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized; trace in a fresh process")
    active: list[Tracker] = []
    orig_resize = torch.UntypedStorage.resize_

    def resize_(st, nbytes):
        result = orig_resize(st, nbytes)
        for tr in active:
            tr.resized(st, int(nbytes))
        return result

    def make_tracker(base: int) -> Tracker:
        tr = Tracker(base)
        active.append(tr)
        return tr

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    try:
        yield FakeTensorMode(allow_non_fake_inputs=True), make_tracker
    finally:
        torch.UntypedStorage.resize_ = orig_resize  # type: ignore[method-assign]
        dist.destroy_process_group()


@dataclass(frozen=True)
class TraceResult:
    """What the trace measured, bytes."""

    peak: int
    block_saved: int  # what one block keeps for backward, checkpointing off
    tokens: int


def trace(case: TraceCase) -> TraceResult:
    """Run the real model on fake tensors and measure (see module docstring)."""
    try:
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from torch.distributed.tensor import DTensor

        import dtensor_ulysses as du
        from dtensor_ulysses.loss import cross_entropy_sum
        from dtensor_ulysses.model import build_model
        from dtensor_ulysses.parallelize import parallelize
    except ImportError as e:
        raise TraceUnavailable(f"the real model cannot be imported: {e}") from None
    w = case.workload()
    s = w.local_seq
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with _fake_world(w.world) as (fake_mode, make_tracker):
        mesh = du.init_mesh(case.dp, case.sp, device_type="cpu")
        model = build_model(w.shape)
        parallelize(
            model,
            mesh,
            activation_checkpointing=case.ac == "full",
            mixed_precision=mp,
            attention_backend="sdpa",
        )
        with fake_mode:
            model.to_empty(device="cpu")
            ids = torch.zeros(w.micro_batch, s, dtype=torch.long)
            pos = (torch.arange(s) + s * 0).expand(w.micro_batch, s)
            tracker = make_tracker(0)
            for p in model.parameters():  # FSDP2 may re-create them at lazy init: track frees
                tracker.track(p.to_local() if isinstance(p, DTensor) else p)
            with tracker:
                logits = model(ids, pos)
                loss = cross_entropy_sum(logits, ids)
                loss.backward()
                del logits, loss
            # one block's saved tensors, checkpointing off, in bf16 (the FSDP2 compute dtype):
            # measured at s and s/2 tokens, the difference is per token (parameters and other
            # constants cancel)
            per_half = [_block_saved(model.layers[0], w, n) for n in (s, s // 2)]
            block_saved = (per_half[0] - per_half[1]) * 2
    return TraceResult(int(tracker.peak), int(max(block_saved, 0)), w.micro_batch * s)


def _block_saved(block, w: Workload, s: int) -> int:
    """Bytes of the distinct storages one block saves for backward on ``s`` local tokens."""
    import torch

    from dtensor_ulysses.model import rope_cos_sin

    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        saved.setdefault(id(st), st.nbytes())
        return t

    pos = torch.arange(s).expand(w.micro_batch, s)
    cos, sin = rope_cos_sin(pos, w.shape.head_dim, w.shape.rope_theta)
    h = torch.zeros(w.micro_batch, s, w.shape.dim, dtype=torch.bfloat16, requires_grad=True)
    # checkpointing off: dtensor_ulysses.recompute keeps the plain forward as ``__wrapped__``;
    # calling the module (not the forward) keeps FSDP2's hooks that gather the parameters
    checkpointed = block.forward
    block.forward = getattr(checkpointed, "__wrapped__", checkpointed)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = block(h, cos, sin)
    finally:
        block.forward = checkpointed
    shared = {id(cos.untyped_storage()), id(sin.untyped_storage())}  # rope tables: per model
    del out
    return sum(n for k, n in saved.items() if k not in shared)


@dataclass(frozen=True)
class Item:
    what: str
    status: str
    detail: str


def check(case: TraceCase) -> list[Item]:
    """Trace ``case`` and compare with the prediction (peak within 10%; block saved bytes)."""
    res = trace(case)
    w = case.workload()
    mem = memory.estimate(w)
    comps = mem.components
    pred_peak = mem.peak - comps["optimizer_states"] - comps["fixed"]
    pred_block = sum(memory.block_activation_bytes(w).values()) * res.tokens
    out = []
    for what, pred, meas in (
        ("peak (no optimizer)", pred_peak, res.peak),
        ("one block's saved activations", pred_block, res.block_saved),
    ):
        dev = pred / meas - 1 if meas else float("inf")
        out.append(
            Item(
                what,
                "pass" if abs(dev) <= TOLERANCE else "fail",
                f"predicted {pred / GiB:.3f} GiB, traced {meas / GiB:.3f} GiB ({dev:+.1%})",
            )
        )
    return out
