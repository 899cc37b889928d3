"""Host memory for what the device does not need right now: activation checkpoints, model states.

Three features (the million-token memory issue), each exact:

* **Activation checkpoints on the host** (``--offload-activations``): :class:`ActivationOffloader`,
  used by :func:`dtensor_ulysses.memory.checkpoint_module`. The one tensor a checkpointed
  block keeps for backward, its input ``h[B, s, D]``, is copied to host memory in forward and
  back for that block's recompute. On CUDA the copies run on a side stream (pinned host memory,
  events): device-to-host right after the block's forward is queued, host-to-device of block
  ``i-1``'s input as soon as block ``i``'s recompute starts, so it is ready when needed.
  Cost per step: ``2 * L * B * s * D * bytes`` over the host link (``L`` blocks, ``s`` local
  tokens), overlapped with compute on CUDA; device memory saved: ``(L - 2) * B * s * D * bytes``
  (one block's input is in flight, one is being recomputed).
* **Parameters, gradients and optimizer states on the host** (``--offload-params``):
  :func:`fsdp_offload_policy`, FSDP2's own ``CPUOffloadPolicy``. With ``n = P / W`` parameter
  elements per rank (``P`` parameters, ``W = dp * sp`` ranks, fp32 shards), per step: ``4n``
  bytes host-to-device for every all-gather of the shards (forward, and again in backward for
  the blocks resharded after forward: about ``8n``), ``4n`` bytes device-to-host (the reduced
  fp32 gradient shards), and the optimizer step on the CPU (below, without the master copy).
  Device memory saved: ``16n`` bytes (parameters, gradients, AdamW states).
* **Optimizer states alone on the host** (``--offload-optimizer``): :class:`HostOffloadAdamW`
  (:mod:`dtensor_ulysses.memory.host_adamw`).
  Parameters and gradients stay on the device; per step each rank copies its gradient shards
  device-to-host (``4n`` bytes) and the updated parameter shards back (``4n`` bytes), and runs
  AdamW on the CPU. Host memory ``16n`` bytes per rank (fp32 master, exp_avg, exp_avg_sq,
  gradient buffer); device memory saved ``8n`` bytes.

CPU AdamW time per step (both model-state options): torch's unfused AdamW makes about 8 passes
over each shard, roughly ``12n`` floating-point operations and ``76n`` bytes of host memory
traffic (about 48 read, 28 written per element); it is memory-bound, so about
``76 * n / host_bandwidth`` seconds per rank, plus the copies above over the host link
(``bytes / link_bandwidth``), none of it overlapped with the device's compute.

"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy

from dtensor_ulysses.memory.host import to_host

__all__ = [
    "ActivationOffloader",
    "cuda_schedule_on_cpu",
    "fsdp_offload_policy",
]


# ----------------------------------------------------------------------------------------------
# activation checkpoints on the host
# ----------------------------------------------------------------------------------------------
@dataclass
class OffloadStats:
    """Counters of an :class:`ActivationOffloader` (cumulative; :meth:`reset` them per step)."""

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    restored_tensors: int = 0
    prefetched_tensors: int = 0  # restores whose copy had been started ahead (CUDA)

    def reset(self) -> None:
        self.offloaded_tensors = self.offloaded_bytes = 0
        self.restored_tensors = self.prefetched_tensors = 0


class _Saved:
    """One offloaded block input: its host copy, and (CUDA) the events and the fetched copy."""

    def __init__(self, host: torch.Tensor, device: torch.device, ready: Any) -> None:
        self.host = host
        self.device = device
        self.ready = ready  # CUDA event: the device-to-host copy finished
        self.fetched: torch.Tensor | None = None  # device copy being brought back (CUDA)
        self.fetched_event: Any = None
        self.restored = False


_CUDA_SCHEDULE = [False]


@contextlib.contextmanager
def cuda_schedule_on_cpu() -> Iterator[None]:
    """Within: CPU restores follow the CUDA path's schedule, bringing block ``i-1``'s input back
    when block ``i``'s is used, so that :mod:`dtensor_ulysses.memtrace` (fake CPU tensors) sees
    the device memory a CUDA run holds (one more block input during each block's backward)."""
    _CUDA_SCHEDULE[0] = True
    try:
        yield
    finally:
        _CUDA_SCHEDULE[0] = False


class ActivationOffloader:
    """Moves each checkpointed block's input to host memory and back; shared by a model's blocks.

    :func:`~dtensor_ulysses.memory.checkpoint_module` calls :meth:`hooks` around each block's
    checkpointed forward. Non-reentrant ``torch.utils.checkpoint`` saves the block's tensor
    arguments through saved-tensor hooks (the inner recompute hooks take over inside the
    block), so these hooks see exactly those arguments: the one that *is* the block input ``h``
    is replaced by its host copy; the others (RoPE ``cos``/``sin``, shared by all blocks) are
    kept as they are. Bit-exact: a copy out and back.

    On CUDA the copies use one side stream per device and pinned memory; restoring block ``i``'s
    input also starts bringing back the input of the block before it (forward order), so in a
    backward pass each block's input arrives while the next-later block computes.

    Args:
        pin_memory: pinned host buffers (``None``: when the tensor is on CUDA).
        prefetch: start block ``i-1``'s copy back when block ``i``'s is used (CUDA).
    """

    def __init__(self, *, pin_memory: bool | None = None, prefetch: bool = True) -> None:
        self.pin_memory = pin_memory
        self.prefetch = prefetch
        self.stats = OffloadStats()
        self._order: list[weakref.ref[_Saved]] = []  # live offloaded inputs, forward order
        self._streams: dict[torch.device, Any] = {}

    def hooks(self, h: torch.Tensor) -> torch.autograd.graph.saved_tensors_hooks:
        """Saved-tensor hooks that offload ``h`` (by identity of its storage and view).

        ``h`` is held weakly: autograd keeps the hooks alive with the graph, and a strong
        reference would keep every block's device input alive next to its host copy.
        """
        h_ref = weakref.ref(h)

        def pack(t: torch.Tensor) -> Any:
            h_now = h_ref()
            return self._offload(t) if h_now is not None and _same_tensor(t, h_now) else t

        def unpack(x: Any) -> torch.Tensor:
            return self._restore(x) if isinstance(x, _Saved) else x

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    # -- forward: device -> host -------------------------------------------------------------
    def _offload(self, t: torch.Tensor) -> _Saved:
        pin = self.pin_memory
        ready = None
        if t.device.type == "cuda":
            stream = self._stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))  # t is computed
            with torch.cuda.stream(stream):
                host = to_host(t, pin=pin, non_blocking=True)
                ready = stream.record_event()
            t.record_stream(stream)  # t's memory is not reused before the copy has read it
        else:
            host = to_host(t, pin=pin)
        saved = _Saved(host, t.device, ready)
        self._order = [r for r in self._order if r() is not None]
        self._order.append(weakref.ref(saved))
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += t.numel() * t.element_size()
        return saved

    # -- backward: host -> device ------------------------------------------------------------
    def _restore(self, saved: _Saved) -> torch.Tensor:
        self.stats.restored_tensors += 1
        if saved.device.type != "cuda":  # a device tensor of its own (device == host on CPU)
            self.stats.prefetched_tensors += saved.fetched is not None
            got = saved.fetched if saved.fetched is not None else saved.host.clone()
            saved.fetched, saved.restored = None, True
            # for the memory trace: the earlier block's input comes back now, as the CUDA
            # path's side stream brings it
            if self.prefetch and _CUDA_SCHEDULE[0]:
                earlier = self._earlier(saved)
                if earlier is not None:
                    earlier.fetched = earlier.host.clone()
            return got
        if saved.fetched is None:
            self._fetch(saved)
        else:
            self.stats.prefetched_tensors += 1
        torch.cuda.current_stream(saved.device).wait_event(saved.fetched_event)
        out, saved.fetched, saved.restored = saved.fetched, None, True
        if self.prefetch:
            earlier = self._earlier(saved)
            if earlier is not None:
                self._fetch(earlier)
        assert out is not None
        return out

    def _fetch(self, saved: _Saved) -> None:
        """Queue the host-to-device copy of ``saved`` on the side stream."""
        compute = torch.cuda.current_stream(saved.device)
        out = torch.empty(saved.host.shape, dtype=saved.host.dtype, device=saved.device)
        stream = self._stream(saved.device)
        stream.wait_stream(compute)  # out's memory is free in compute-stream order
        with torch.cuda.stream(stream):
            stream.wait_event(saved.ready)
            out.copy_(saved.host, non_blocking=True)
            saved.fetched_event = stream.record_event()
        out.record_stream(stream)  # if it is dropped unused, not reused before the copy ends
        saved.fetched = out

    def _earlier(self, saved: _Saved) -> _Saved | None:
        """The live offloaded input saved just before ``saved``, not yet restored or fetched."""
        refs = [r() for r in self._order]
        if saved not in refs:
            return None
        for s in reversed(refs[: refs.index(saved)]):
            if s is not None and not s.restored and s.fetched is None:
                return s if s.device == saved.device else None
        return None

    def _stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


def _same_tensor(t: torch.Tensor, h: torch.Tensor) -> bool:
    if t is h:
        return True
    return (
        t.untyped_storage() is h.untyped_storage()
        and t.shape == h.shape
        and t.stride() == h.stride()
        and t.storage_offset() == h.storage_offset()
    )


# ----------------------------------------------------------------------------------------------
# model states on the host
# ----------------------------------------------------------------------------------------------
def fsdp_offload_policy(
    mesh: DeviceMesh | str, *, pin_memory: bool | None = None
) -> CPUOffloadPolicy:
    """FSDP2's ``CPUOffloadPolicy`` for ``--offload-params``: pass it to every ``fully_shard``.

    Parameters, gradients and the optimizer states (a plain ``torch.optim.AdamW`` then steps on
    the CPU) live on the host; FSDP2 copies each shard to the device before its all-gather and
    each reduced gradient shard back (see the module docstring for the traffic). Works on CPU
    meshes too (gloo, torch 2.13; pinning needs CUDA).

    Args:
        mesh: the FSDP mesh, or its device type.
        pin_memory: pinned host memory (``None``: on CUDA).
    """
    device_type = mesh if isinstance(mesh, str) else mesh.device_type
    if pin_memory is None:
        pin_memory = device_type == "cuda"
    return CPUOffloadPolicy(pin_memory=pin_memory)
