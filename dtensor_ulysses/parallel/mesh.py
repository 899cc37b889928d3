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
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypedDict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtensor_ulysses._exit import leave_together_at_exit
from dtensor_ulysses._torch_private import flatten_mesh
from dtensor_ulysses.plan.splits import DP_AXIS as DP
from dtensor_ulysses.plan.splits import RING_AXIS as RING
from dtensor_ulysses.plan.splits import SP_AXIS as SP
from dtensor_ulysses.plan.splits import check_ring_mesh, divisors

__all__ = [
    "ParallelDims",
    "init_mesh",
    "flatten_dp_sp",
    "default_device_type",
    "mesh_ring",
]

MESH_AXES = (DP, SP)
RING_MESH_AXES = (DP, RING, SP)


class RankCut(TypedDict):
    """A rank's sequence degrees and coordinates: the one slicer's keyword arguments."""

    sp: int
    sp_rank: int
    ring: int
    ring_rank: int


class RankCoords(RankCut):
    """:class:`RankCut` with the dp degree and coordinate (``get_batch``'s)."""

    dp: int
    dp_rank: int


@dataclass(frozen=True)
class ParallelDims:
    """The parallel degrees of a run in one object (torchtitan's ``ParallelDims``): ``dp``
    data-parallel groups x ``ring`` ring-attention ranks x ``sp`` Ulysses ranks, the world size
    they make, the mesh's axis names, the checks between them, and (once the mesh exists) this
    rank's groups and coordinates on it.

    Build it once (:meth:`resolve` from the command line or ``with_ulysses``' arguments, before
    any process group exists), then :meth:`build_mesh`; :meth:`from_mesh` gives the degrees
    *bound* to their mesh, which answer the groups (:attr:`sp_mesh`, :attr:`dp_mesh`,
    :attr:`flat_mesh`), this rank's coordinates (:attr:`sp_rank`, :attr:`dp_rank`) and the
    one slicer's arguments (:meth:`cut`, :meth:`coords`). A trainer holds one bound
    ``ParallelDims`` and asks it; nothing else spells an axis name.

    Raises:
        ValueError: a degree that is not a positive int; a mesh whose shape is not the degrees'.
    """

    dp: int = 1
    ring: int = 1
    sp: int = 1
    mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    """The device mesh of these degrees (:meth:`from_mesh`), or ``None`` before it exists."""

    def __post_init__(self) -> None:
        for name in (DP, RING, SP):
            _check_degree(name, getattr(self, name))
        if self.mesh is not None:
            names, shape = self.mesh.mesh_dim_names or (), tuple(self.mesh.shape)
            if (names, shape) != (self.axis_names, self.shape):
                raise ValueError(
                    f"the mesh has axes {names} of sizes {shape}, not the {self.describe()} "
                    f"of these degrees ({self.axis_names} of sizes {self.shape})"
                )

    @classmethod
    def resolve(
        cls,
        world_size: int,
        dp: int | None = 1,
        sp: int | None = None,
        ring: int = 1,
        *,
        spelling: str = "keyword",
        world: str | None = None,
    ) -> ParallelDims:
        """The degrees for ``world_size`` ranks: ``sp=None`` takes the ranks left,
        ``world_size // (dp * ring)``; ``dp=None`` (``with_ulysses(sp=...)``) likewise
        ``world_size // (ring * sp)``. The one place the world arithmetic is written.

        Args:
            world_size: the ranks launched.
            dp: the data-parallel degree (``None``: the ranks left).
            sp: the Ulysses degree (``None``: the ranks left).
            ring: the ring-attention degree.
            spelling: how messages name the degrees: ``"keyword"`` (``dp=2``) or ``"flag"``
                (the trainer's ``--dp 2``).
            world: how messages name the world, e.g. ``"torchrun started 4 processes"``
                (default ``"the world size is N"``).

        Raises:
            ValueError: a degree that is not positive or does not divide the world, or
                ``dp * ring * sp`` is not the world size.
        """
        flag = spelling == "flag"

        def say(name: str, value: int) -> str:
            return f"--{name} {value}" if flag else f"{name}={value}"

        for name, value in ((DP, dp), (SP, sp), (RING, ring)):
            if value is not None:
                _check_degree(name, value, say(name, value) if flag else None)
        if dp is None:
            if sp is None:
                raise ValueError("give dp or sp (or both); the other takes the ranks left")
            if world_size % (sp * ring):
                raise ValueError(
                    f"{say(SP, sp)} does not divide the {world_size} ranks; launch a multiple of "
                    f"{sp} ranks or choose sp among the divisors of {world_size}"
                )
            dp = world_size // (sp * ring)
        if sp is None:
            if world_size % (dp * ring):
                if flag:
                    what = say(DP, dp) + (f" x {say(RING, ring)}" if ring > 1 else "")
                    where = f"the world size {world_size}"
                elif ring > 1:
                    what = f"dp x ring = {dp} x {ring} = {dp * ring}"
                    where = f"world_size={world_size}"
                else:
                    what, where = say(DP, dp), f"world_size={world_size}"
                raise ValueError(
                    f"{what} does not divide {where}; choose "
                    f"dp{' * ring' if ring > 1 else ''} in {divisors(world_size)}"
                )
            sp = world_size // (dp * ring)
        dims = cls(dp, ring, sp)
        if flag and dims.world_size != world_size:
            ring_said = f" x {say(RING, ring)}" if ring > 1 else ""
            raise ValueError(
                f"{say(DP, dp)}{ring_said} x {say(SP, sp)} = {dims.world_size} but "
                f"{world or f'the world size is {world_size}'}; make "
                f"dp{' * ring' if ring > 1 else ''} * sp equal --nproc-per-node x --nnodes"
            )
        dims.check_world(world_size)
        return dims

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> ParallelDims:
        """The degrees of a ``("dp", "sp")`` or ``("dp", "ring", "sp")`` mesh, bound to it."""
        names = mesh.mesh_dim_names or ()
        if names not in (MESH_AXES, RING_MESH_AXES):
            raise ValueError(
                f"expected a mesh with axes {MESH_AXES} or {RING_MESH_AXES}, got {names}"
            )
        dp, ring, sp = (mesh[n].size() if n in names else 1 for n in (DP, RING, SP))
        return cls(dp=dp, ring=ring, sp=sp, mesh=mesh)

    @classmethod
    def of(cls, mesh: DeviceMesh | ParallelDims) -> ParallelDims:
        """``mesh`` itself when it is bound degrees, else :meth:`from_mesh` (for functions that
        take either: a caller holding the degrees passes them, nothing is rebuilt)."""
        if isinstance(mesh, ParallelDims):
            mesh._bound()
            return mesh
        return cls.from_mesh(mesh)

    def check_world(self, world_size: int) -> None:
        """``dp * ring * sp`` must be the world size."""
        if self.ring > 1:
            check_ring_mesh(self.dp, self.ring, self.sp, world_size)
        elif self.world_size != world_size:
            raise ValueError(
                f"dp * sp = {self.dp} * {self.sp} = {self.world_size} but the world size is "
                f"{world_size}; choose dp and sp whose product is {world_size} "
                f"(e.g. dp=1, sp={world_size})"
            )

    @property
    def world_size(self) -> int:
        """``dp * ring * sp``."""
        return self.dp * self.ring * self.sp

    @property
    def axis_names(self) -> tuple[str, ...]:
        """``("dp", "sp")``, or ``("dp", "ring", "sp")`` with a ring."""
        return RING_MESH_AXES if self.ring > 1 else MESH_AXES

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh's shape, in :attr:`axis_names` order."""
        return (self.dp, self.ring, self.sp) if self.ring > 1 else (self.dp, self.sp)

    def build_mesh(
        self, device_type: str | None = None, *, timeout_s: float | None = None
    ) -> DeviceMesh:
        """:func:`init_mesh` with these degrees (bind them to it with :meth:`from_mesh`)."""
        return init_mesh(
            self.dp, self.sp, ring=self.ring, device_type=device_type, timeout_s=timeout_s
        )

    # ------------------------------------------------------------------------------------------
    # bound to the mesh: the groups and this rank's coordinates
    # ------------------------------------------------------------------------------------------
    def _bound(self) -> DeviceMesh:
        if self.mesh is None:
            raise ValueError(
                f"ParallelDims({self.describe()}) has no mesh yet: bind the degrees to their "
                f"mesh with ParallelDims.from_mesh(dims.build_mesh())"
            )
        return self.mesh

    @property
    def world_mesh(self) -> DeviceMesh:
        """The mesh these degrees are bound to (every axis)."""
        return self._bound()

    @property
    def sp_mesh(self) -> DeviceMesh:
        """The ``sp`` submesh (Ulysses' all-to-all group: ``.get_group()``)."""
        return self._bound()[SP]

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The ``dp`` submesh (the ranks that see different rows)."""
        return self._bound()[DP]

    @property
    def flat_mesh(self) -> DeviceMesh:
        """All ``dp x [ring x] sp`` ranks as one axis (:func:`flatten_dp_sp`: FSDP2's mesh, the
        loss's token count and sums)."""
        return flatten_dp_sp(self._bound())

    @property
    def sp_rank(self) -> int:
        """This rank's coordinate on ``sp``."""
        return self._bound().get_local_rank(SP)

    @property
    def dp_rank(self) -> int:
        """This rank's coordinate on ``dp``."""
        return self._bound().get_local_rank(DP)

    def cut(self) -> RankCut:
        """This rank's degrees and coordinates as the slicer's keyword arguments
        (``sp, sp_rank, ring, ring_rank``; dp rows are chosen by the caller)."""
        mesh = self._bound()
        ring_rank = mesh.get_local_rank(RING) if self.ring > 1 else 0
        return RankCut(sp=self.sp, sp_rank=self.sp_rank, ring=self.ring, ring_rank=ring_rank)

    def coords(self) -> RankCoords:
        """:meth:`cut` with the dp degree and coordinate (``get_batch``'s keyword arguments)."""
        return RankCoords(dp=self.dp, dp_rank=self.dp_rank, **self.cut())

    def describe(self) -> str:
        """``dp=2 x ring=2 x sp=2`` (no ring term without one)."""
        return (
            f"dp={self.dp} x "
            + (f"ring={self.ring} x " if self.ring > 1 else "")
            + (f"sp={self.sp}")
        )


def default_device_type() -> str:
    """``"cuda"`` when a CUDA device is available, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_degree(name: str, value: int, said: str | None = None) -> None:
    """A degree is a positive int (``said``: how the caller wrote it, e.g. ``--dp 0``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < 1:
        said = said or f"{name}={value}"
        use = f"--{name}" if said.startswith("--") else name
        raise ValueError(f"{said} is not a positive degree; use {use} >= 1")


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
    At interpreter exit the groups are destroyed while the interpreter is intact and torch's C++
    static destructors are skipped, keeping the script's exit status
    (:func:`~dtensor_ulysses._exit.leave_together_at_exit`): a script that ends normally does
    not abort in gloo's teardown.

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
    _check_degree(DP, dp)
    _check_degree(RING, ring)
    if sp is not None:
        _check_degree(SP, sp)
    device_type = device_type or default_device_type()
    if not dist.is_initialized():
        # on CUDA, gloo too for CPU tensors (FSDP2's CPU offload keeps gradients on the host,
        # and gradient clipping reduces them there), as torchtitan does
        backend = "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=timeout)
    dims = ParallelDims.resolve(dist.get_world_size(), dp, sp, ring)
    leave_together_at_exit(barrier=False)  # the gloo teardown that can abort (see _exit.py)
    return init_device_mesh(device_type, dims.shape, mesh_dim_names=dims.axis_names)


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
    return mesh[RING].size() if RING in names else 1
