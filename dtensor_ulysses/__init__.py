"""dtensor-ulysses: Ulysses sequence parallelism on PyTorch DTensor.

Sequence-sharded activations ``x[B, S_sp, N, H]`` become head-sharded ``x[B, S, N_sp, H]`` around
attention (``Shard(1) -> Shard(2)`` on the ``sp`` mesh axis) and go back afterwards.

Public names are imported on first use (PEP 562), so the torch-free subpackage
``dtensor_ulysses.plan`` can be imported by the torch-free simulator without importing torch.

The package is a stack of subpackages, each importing only from those below it (the layering
test holds the order): ``plan`` < ``comm``, ``memory``, ``debug`` < ``attention``, ``data`` <
``models`` < ``parallel`` < ``hf`` < ``train`` < the tools ``memtrace``, ``demo``, ``launch``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> submodule that defines it
_EXPORTS = {
    "CommCounter": "debug",
    "UlyssesAttention": "attention",
    "build_model": "models",
    "init_weights": "models",
    "parallelize": "parallel",
    "flatten_dp_sp": "parallel",
    "force_backend": "attention",
    "head_to_seq": "attention",
    "init_mesh": "parallel",
    "kv_head_index": "plan",
    "LocalAttention": "attention",
    "DeferredQ": "attention",
    "SeqLayout": "plan",
    "local_attention": "attention",
    "seq_to_head": "attention",
    "ulysses_attention": "attention",
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
        UlyssesAttention,
        force_backend,
        head_to_seq,
        local_attention,
        seq_to_head,
        ulysses_attention,
    )
    from dtensor_ulysses.debug import CommCounter
    from dtensor_ulysses.models import build_model, init_weights
    from dtensor_ulysses.parallel import flatten_dp_sp, init_mesh, parallelize
    from dtensor_ulysses.plan import SeqLayout, kv_head_index
