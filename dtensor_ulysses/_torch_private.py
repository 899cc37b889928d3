"""Every private or experimental torch API this project touches, and nothing else.

Checked on torch 2.13.0 (CPU, CI) and torch 2.11 (the GPU machine's version, run here on CPU) for
everything but the fake-tensor tracing, which is checked on 2.13 only. When torch moves one of
these, this file is the only one to change.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

# Dispatcher-level interception: CommCounter sees every collective (c10d and functional) and the
# simulator's memory tracer sees every tensor an op creates. Checked: 2.11, 2.13.
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "TorchDispatchMode",
    "dtensor_like",
    "fake_world_classes",
    "flatten_mesh",
    "fsdp_param_dtype",
    "fsdp_reshards_after_forward",
    "local_shape_and_offset",
    "tree_flatten",
]


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``DeviceMesh._flatten``: one 1-D mesh over all of ``mesh``'s ranks. Checked: 2.11, 2.13."""
    return mesh._flatten(name)


def fake_world_classes():
    """``(FakeTensorMode, FakeStore)`` for tracing at large virtual world sizes without devices.

    ``torch.testing._internal.distributed.fake_pg.FakeStore`` with the ``"fake"`` process-group
    backend, and ``torch._subclasses.fake_tensor.FakeTensorMode``. Checked: 2.13. Imported lazily
    (importing ``torch.testing._internal`` is slow).

    Raises:
        ImportError: this torch lacks them.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeTensorMode, FakeStore


def dtensor_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """A DTensor with ``like``'s mesh, placements, global shape and stride whose local tensor is
    ``local`` itself, wherever it lives (``local``'s dtype; no autograd).

    ``DTensor.from_local`` would copy a host ``local`` to the mesh's device; this is the
    constructor FSDP2 uses for its CPU-offloaded shards (``_from_local_no_grad``):
    ``DTensor(local, DTensorSpec(...), requires_grad=False)``. Used to present host optimizer
    states to ``torch.distributed.checkpoint``. Checked: 2.13 (2.11 has the same constructor and
    ``DTensorSpec``/``TensorMeta`` fields).
    """
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    if local.shape != like.to_local().shape:
        raise ValueError(
            f"local tensor {tuple(local.shape)} is not shaped like the local shard "
            f"{tuple(like.to_local().shape)}"
        )
    meta = TensorMeta(like.shape, like.stride(), local.dtype)
    spec = DTensorSpec(like.device_mesh, tuple(like.placements), tensor_meta=meta)
    return DTensor(local, spec, requires_grad=False)


def functional_all_to_all(
    send: Any, out_splits: list[int], in_splits: list[int], group: Any
) -> Any:
    """``torch.distributed._functional_collectives.all_to_all_single`` (differentiable, traced
    by ``torch.compile`` without a graph break), waited on. Checked: 2.13.
    """
    from torch.distributed import _functional_collectives as funcol

    out = funcol.all_to_all_single_autograd(send, out_splits, in_splits, group)
    return funcol.wait_tensor(out)


def local_shape_and_offset(param: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` of a DTensor:
    this rank's local shape and its offset in the global tensor, or ``None`` when this torch
    lacks the helper. Checked: 2.11, 2.13.
    """
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        return None
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return tuple(shape), tuple(offset)


def fsdp_reshards_after_forward(module: Any) -> bool:
    """Whether an FSDP2 unit frees its gathered parameters after its forward (its param
    group's ``post_forward_mesh_info`` is set; the root's is cleared at its lazy init). The
    public ``set_reshard_after_forward`` sets it; there is no public getter. Checked: 2.11,
    2.13 (``_get_fsdp_state``, ``_fsdp_param_group``)."""
    group = module._get_fsdp_state()._fsdp_param_group
    return group is not None and group.post_forward_mesh_info is not None


def fsdp_param_dtype(model: Any) -> torch.dtype | None:
    """The mixed-precision parameter dtype FSDP2 computes in for ``model`` (a ``fully_shard``
    root), ``None`` when it has no policy dtype or is not FSDP2. Checked: 2.11, 2.13
    (``_get_fsdp_state()._mp_policy``)."""
    get_state = getattr(model, "_get_fsdp_state", None)
    if get_state is None:
        return None
    return get_state()._mp_policy.param_dtype
