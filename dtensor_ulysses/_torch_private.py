"""Every private or experimental torch API this project touches, and nothing else.

Checked on torch 2.13.0 (CPU, CI) and torch 2.11 (the GPU machine's version, run here on CPU) for
everything but the fake-tensor tracing, which is checked on 2.13 only. When torch moves one of
these, this file is the only one to change.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

# Dispatcher-level interception: CommCounter sees every collective (c10d and functional) and the
# simulator's memory tracer sees every tensor an op creates. Checked: 2.11, 2.13.
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["TorchDispatchMode", "fake_world_classes", "flatten_mesh", "tree_flatten"]


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
