"""The memory trace's fake world and the traced step's setup and bookkeeping.

* :func:`fake_world`: ``torch.distributed``'s fake process group, a ``FakeTensorMode`` and
  recording modes that feed a ``_Timeline`` (``_timeline.py``) with every storage an op creates
  (host when :func:`dtensor_ulysses.memory.allocating_host`).
* The step's setup: a preset with fewer blocks, the recipe (``ParallelOptions``), the
  ``TrainConfig`` that carries it and one rank's batch (the traced device's mixed-precision
  policy and offload schedule are chosen by :func:`dtensor_ulysses.memtrace.trace_train_step`;
  the policy travels in the recipe to the trainer's ``build``).
* The step's bookkeeping: the phase and block marks (:func:`_phase_hooks`) and the sharded
  parameters and optimizer states alive from the warm-up step on (:func:`_classify_states`).

Private torch APIs (fake process group, ``FakeTensorMode``, ``TorchDispatchMode``) come from
:mod:`dtensor_ulysses._torch_private`.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtensor_ulysses._torch_private import TorchDispatchMode, fake_world_classes, tree_flatten
from dtensor_ulysses.data import Batch, full_batch, slice_batch
from dtensor_ulysses.memory import allocating_host, is_host
from dtensor_ulysses.memtrace._results import TraceUnavailable
from dtensor_ulysses.memtrace._timeline import _Timeline
from dtensor_ulysses.parallel import ParallelDims
from dtensor_ulysses.plan import PRESETS, get_shape
from dtensor_ulysses.plan.recipe import TRAINER, ParallelOptions
from dtensor_ulysses.train import TrainConfig

__all__ = ["fake_world", "hybrid_model_dir", "rank0_batch", "trace_config", "trace_options"]


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
        FakeTensorMode, FakeStore = fake_world_classes()
    except ImportError as e:  # a torch without these private modules
        raise TraceUnavailable(f"fake process group / fake tensors unavailable: {e}") from None

    local_scalar = torch.ops.aten._local_scalar_dense.default

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
# the step's setup
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _temporary_preset(name: str, layers: int | None) -> Iterator[str]:
    """A preset with fewer blocks, registered for the duration of the trace."""
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
def hybrid_model_dir(name: str) -> Iterator[str | None]:
    """For a hybrid linear-attention preset (``ModelShape.linear``), a temporary transformers
    model directory holding only its ``config.json``, traced through ``--hf-model`` (the real
    Gated DeltaNet layers, routed by ``du.hf``: their conv, chunked delta-rule intermediates and
    recurrent states, as the torch reference kernels allocate them); ``None`` otherwise."""
    shape = get_shape(name)
    if shape.linear is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="du-hybrid-") as tmp:
        config = {k: v for k, v in shape.hf_config().items() if v is not None}
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        yield tmp


def trace_options(ac: bool, features: dict[str, Any]) -> ParallelOptions:
    """The :class:`~dtensor_ulysses.plan.ParallelOptions` of a traced step given as keywords:
    checkpointing ``ac``, SDPA, uneven heads allowed, and ``features`` (its fields; ``None``
    leaves the default).

    Raises:
        NotImplementedError: a feature the trainer does not have.
    """
    names = ParallelOptions.fields(TRAINER)
    missing = [k for k, v in features.items() if v not in (None, False, 1) and k not in names]
    if missing:
        raise NotImplementedError(
            f"the trainer has no {', '.join(missing)} yet (ParallelOptions lacks the field); "
            f"trace without it"
        )
    kw = {k: v for k, v in features.items() if k in names and v is not None}
    base = dict(activation_checkpointing=ac, attention_backend="sdpa", allow_uneven_heads=True)
    return ParallelOptions(**{**base, **kw})


def trace_config(model: str, seq_len: int, dp: int, sp: int, options: ParallelOptions):
    """The :class:`~dtensor_ulysses.train.TrainConfig` of a traced step (micro-batch 1 per dp
    rank) with the recipe ``options`` (:func:`trace_options` builds one from keywords), kept
    as the configuration's one ``parallel_options`` (its flags follow it)."""
    flags = {name: getattr(options, name) for name in ParallelOptions.fields(TRAINER)}
    return TrainConfig(
        dp=dp, sp=sp, parallel_dims=ParallelDims(dp=dp, sp=sp), model=model, seq_len=seq_len,
        batch_size=dp, steps=1, parallel_options=options, **flags,
    )  # fmt: skip


def rank0_batch(seq_len: int, sp: int, micro_batch: int = 1) -> Batch:
    """Rank 0's slice of a ``[micro_batch, seq_len]`` batch of zeros split over ``sp`` ranks
    by the one slicer (token values do not change the memory)."""
    ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
    return slice_batch(full_batch(ids, ids.clone()), sp=sp, sp_rank=0)


def _n_layers(model: str) -> int:
    return get_shape(model).n_layers


# ----------------------------------------------------------------------------------------------
# the step's bookkeeping
# ----------------------------------------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _classify_states(net, optimizer, tl: _Timeline, offload_params: bool) -> None:
    """Sharded parameters and optimizer states (alive from the warm-up step on);
    ``optimizer=None``: parameters only (a reference model)."""
    for p in net.parameters():
        t = _local(p)
        tl.add(t)
        tl.set_category(t, "parameters")
        if offload_params or is_host(t):
            tl.set_host(t)
    if optimizer is None:
        return
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                t = _local(v)
                tl.add(t)
                tl.set_category(t, "optimizer_states")
                if offload_params or is_host(t):
                    tl.set_host(t)


def _norm_and_blocks(net) -> tuple[Any, Any]:
    """The final norm and the blocks: the built-in model's, or a transformers model's."""
    hf = net.__dict__.get("hf_model")
    if hf is None:
        return net.norm, net.layers
    return hf.base_model.norm, hf.base_model.layers


def _phase_hooks(
    net, optimizer, rec: Any, offload_params: bool, no_grad_phase: str = "old_policy"
) -> list[Any]:
    """Marks: ``loss`` when the final norm starts and again when the backward reaches the
    model's output (the head's backward is the loss phase's too), ``backward`` when the
    gradient of the final norm's output exists, ``optimizer`` before the optimizer step
    (gradients classified there), and one mark per block where its forward starts and where
    the gradient of its output exists (its backward starts; gradients offloaded by FSDP2 leave
    the device there). A forward without
    gradients (a reference model, GRPO's old policy) marks ``no_grad_phase:i`` per block and
    ``no_grad_phase:head`` at its final norm instead. ``optimizer=None``: a model without one
    (the reference)."""
    tl: _Timeline = rec.timeline
    hooks: list[Any] = []

    def norm_pre(_m, _args):
        tl.mark("loss" if torch.is_grad_enabled() else f"{no_grad_phase}:head")

    def norm_post(_m, _args, out):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: tl.mark("backward"))

    def root_post(_m, _args, out):
        # the backward starts at the output head (its chunks recomputed, their gradients): the
        # loss phase's memory, as the head's forward; marked again here because a forward
        # without gradients (DPO's reference, after the policy's) may have marked in between
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: tl.mark("loss"))

    def block_pre(i):
        def hook(_m, _args):
            tl.mark(f"forward:{i}" if torch.is_grad_enabled() else f"{no_grad_phase}:{i}")

        return hook

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

    norm, layers = _norm_and_blocks(net)
    hooks.append(net.register_forward_hook(root_post))
    hooks.append(norm.register_forward_pre_hook(norm_pre))
    hooks.append(norm.register_forward_hook(norm_post))
    for i, block in enumerate(layers):
        hooks.append(block.register_forward_pre_hook(block_pre(i), prepend=True))
        hooks.append(block.register_forward_hook(block_post(i)))
    if optimizer is not None:
        hooks.append(optimizer.register_step_pre_hook(step_pre))
        hooks.append(optimizer.register_step_post_hook(step_post))
    return hooks
