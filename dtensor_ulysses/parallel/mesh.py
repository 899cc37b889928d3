"""The ``("dp", "sp")`` device mesh, and ``("dp", "ring", "sp")`` for Ulysses x Ring.

Ulysses needs two process groups: ``sp`` ranks share one sequence (each holds a contiguous slice of
it) and ``dp`` ranks see different sequences. FSDP2 shards parameters over all ``dp x sp`` ranks,
because sp ranks hold the same weights but see different tokens; :func:`flatten_dp_sp` gives that
flattened 1-D view.

With ``ring > 1`` (:mod:`dtensor_ulysses.attention.ring`) the mesh has a third axis between them,
``("dp", "ring", "sp")``: ``sp`` innermost, so an sp group is consecutive ranks (keep it within a
node: its all-to-all is the heavy one), and the ring runs across. ``ring = 1`` is the 2-D mesh.
FSDP2, the loss's token count and its all-reduce then span all ``dp x ring x sp`` ranks.

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
from dtensor_ulysses.plan.splits import check_ring_mesh, divisors

__all__ = ["init_mesh", "flatten_dp_sp", "default_device_type", "mesh_ring"]

MESH_AXES = ("dp", "sp")
RING_MESH_AXES = ("dp", "ring", "sp")


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
    ring: int = 1,
    device_type: str | None = None,
    timeout_s: float | None = None,
) -> DeviceMesh:
    """Create the 2-D device mesh named ``("dp", "sp")`` (3-D ``("dp", "ring", "sp")`` with a ring).

    Initializes the default process group from the torchrun environment if needed: NCCL on CUDA
    (with gloo for CPU tensors), gloo on CPU. On CUDA each process is pinned to ``cuda:LOCAL_RANK``.

    Args:
        dp: data-parallel degree (number of different sequences per step).
        sp: sequence-parallel (Ulysses) degree; ``None`` means all remaining ranks,
            ``world_size // (dp * ring)``.
        ring: ring-attention degree (Ulysses x Ring); ``1`` (default) gives the 2-D mesh.
        device_type: ``"cuda"`` or ``"cpu"``; ``None`` picks CUDA when available.
        timeout_s: collective timeout for a process group created here (``None``: torch's default).

    Returns:
        A :class:`~torch.distributed.device_mesh.DeviceMesh` of shape ``(dp, sp)``; ``mesh["sp"]``
        is the sequence-parallel submesh. With ``ring > 1``: shape ``(dp, ring, sp)``, axes
        ``("dp", "ring", "sp")`` (``mesh["ring"]`` the ring submesh).

    Raises:
        ValueError: a non-positive degree, or ``dp * sp != world_size`` (``dp * ring * sp``).
    """
    _check_degree("dp", dp)
    _check_degree("ring", ring)
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
    if ring > 1:
        if sp is None:
            if world_size % (dp * ring):
                raise ValueError(
                    f"dp x ring = {dp} x {ring} = {dp * ring} does not divide world_size="
                    f"{world_size}; choose dp * ring in {divisors(world_size)}"
                )
            sp = world_size // (dp * ring)
        check_ring_mesh(dp, ring, sp, world_size)
        return init_device_mesh(device_type, (dp, ring, sp), mesh_dim_names=RING_MESH_AXES)
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
    """The 1-D view of all ranks of a ``("dp", "sp")`` mesh (``dp_sp``) or a
    ``("dp", "ring", "sp")`` mesh (``dp_ring_sp``): FSDP2 shards parameters over it, and the
    loss counts tokens and sums over its group."""
    names = mesh.mesh_dim_names
    if names not in (MESH_AXES, RING_MESH_AXES):
        raise ValueError(f"expected a mesh with axes {MESH_AXES} or {RING_MESH_AXES}, got {names}")
    # private torch API, see _torch_private.py
    return flatten_mesh(mesh[names], "_".join(names))


def mesh_ring(mesh: DeviceMesh) -> int:
    """The ring degree of a mesh: the size of its ``"ring"`` axis, 1 when it has none."""
    names = mesh.mesh_dim_names or ()
    return mesh["ring"].size() if "ring" in names else 1
