"""The ``("dp", "sp")`` device mesh.

Ulysses needs two process groups: ``sp`` ranks share one sequence (each holds a contiguous slice of
it) and ``dp`` ranks see different sequences. FSDP2 shards parameters over all ``dp x sp`` ranks,
because sp ranks hold the same weights but see different tokens; :func:`flatten_dp_sp` gives that
flattened 1-D view.

Run under torchrun (the process group is created from the ``RANK``/``WORLD_SIZE`` environment);
the demo builds a mesh this way::

    torchrun --nproc-per-node 4 -m dtensor_ulysses.demo --dp 2 --sp 2
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtensor_ulysses._torch_private import flatten_mesh
from dtensor_ulysses.plan import divisors

__all__ = ["init_mesh", "flatten_dp_sp", "default_device_type"]

MESH_AXES = ("dp", "sp")


def default_device_type() -> str:
    """``"cuda"`` when a CUDA device is available, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_degree(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < 1:
        raise ValueError(f"{name}={value} is not a positive degree; use {name} >= 1")


def init_mesh(
    dp: int = 1,
    sp: int | None = None,
    *,
    device_type: str | None = None,
    timeout_s: float | None = None,
) -> DeviceMesh:
    """Create the 2-D device mesh named ``("dp", "sp")``.

    Initializes the default process group from the torchrun environment if needed: NCCL on CUDA
    (with gloo for CPU tensors), gloo on CPU. On CUDA each process is pinned to ``cuda:LOCAL_RANK``.

    Args:
        dp: data-parallel degree (number of different sequences per step).
        sp: sequence-parallel degree; ``None`` means all remaining ranks, ``world_size // dp``.
        device_type: ``"cuda"`` or ``"cpu"``; ``None`` picks CUDA when available.
        timeout_s: collective timeout for a process group created here (``None``: torch's default).

    Returns:
        A :class:`~torch.distributed.device_mesh.DeviceMesh` of shape ``(dp, sp)``; ``mesh["sp"]``
        is the sequence-parallel submesh.

    Raises:
        ValueError: a non-positive degree, or ``dp * sp != world_size``.
    """
    _check_degree("dp", dp)
    if sp is not None:
        _check_degree("sp", sp)
    device_type = device_type or default_device_type()
    if not dist.is_initialized():
        # on CUDA, gloo too for CPU tensors (FSDP2's CPU offload keeps gradients on the host,
        # and gradient clipping reduces them there), as torchtitan does
        backend = "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=timeout)
    world_size = dist.get_world_size()
    if sp is None:
        if world_size % dp:
            raise ValueError(
                f"dp={dp} does not divide world_size={world_size}; choose dp in "
                f"{divisors(world_size)}"
            )
        sp = world_size // dp
    if dp * sp != world_size:
        raise ValueError(
            f"dp * sp = {dp} * {sp} = {dp * sp} but the world size is {world_size}; "
            f"choose dp and sp whose product is {world_size} (e.g. dp=1, sp={world_size})"
        )
    return init_device_mesh(device_type, (dp, sp), mesh_dim_names=MESH_AXES)


def flatten_dp_sp(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D ``dp_sp`` view of a ``("dp", "sp")`` mesh, over which FSDP2 shards parameters."""
    if mesh.mesh_dim_names != MESH_AXES:
        raise ValueError(f"expected a mesh with axes {MESH_AXES}, got {mesh.mesh_dim_names}")
    return flatten_mesh(mesh[MESH_AXES], "dp_sp")  # private torch API, see _torch_private.py
