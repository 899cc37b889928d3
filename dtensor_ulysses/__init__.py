"""dtensor-ulysses: Ulysses sequence parallelism on PyTorch DTensor.

Sequence-sharded activations ``x[B, S_sp, N, H]`` become head-sharded ``x[B, S, N_sp, H]`` around
attention (``Shard(1) -> Shard(2)`` on the ``sp`` mesh axis) and go back afterwards.

Public names are imported on first use (PEP 562), so torch-free submodules such as
``dtensor_ulysses.presets`` can be imported by the torch-free simulator without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> submodule that defines it
_EXPORTS = {
    "CommCounter": "debug",
    "UlyssesAttention": "ulysses",
    "build_model": "model",
    "init_weights": "weights",
    "parallelize": "parallel",
    "flatten_dp_sp": "mesh",
    "force_backend": "attention",
    "head_to_seq": "dtensor_api",
    "init_mesh": "mesh",
    "kv_head_index": "plan",
    "LocalAttention": "attention",
    "DeferredQ": "attention",
    "SeqLayout": "plan",
    "local_attention": "attention",
    "seq_to_head": "dtensor_api",
    "ulysses_attention": "dtensor_api",
}

__all__ = [
    "CommCounter",
    "DeferredQ",
    "LocalAttention",
    "SeqLayout",
    "UlyssesAttention",
    "build_model",
    "flatten_dp_sp",
    "force_backend",
    "head_to_seq",
    "init_mesh",
    "init_weights",
    "kv_head_index",
    "local_attention",
    "parallelize",
    "seq_to_head",
    "ulysses_attention",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs
    from dtensor_ulysses.attention import (
        DeferredQ,
        LocalAttention,
        force_backend,
        local_attention,
    )
    from dtensor_ulysses.debug import CommCounter
    from dtensor_ulysses.dtensor_api import head_to_seq, seq_to_head, ulysses_attention
    from dtensor_ulysses.mesh import flatten_dp_sp, init_mesh
    from dtensor_ulysses.model import build_model
    from dtensor_ulysses.parallel import parallelize
    from dtensor_ulysses.plan import SeqLayout, kv_head_index
    from dtensor_ulysses.ulysses import UlyssesAttention
    from dtensor_ulysses.weights import init_weights
