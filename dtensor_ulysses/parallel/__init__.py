"""Parallelism from outside the model: the ``(dp, [ring,] sp)`` mesh, ``parallelize`` (Ulysses ->
activation checkpointing -> compile -> ``fully_shard``) and the global token count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtensor_ulysses._public import lazy_exports

# public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "checkpoint_blocks": "compose",
    "default_device_type": "mesh",
    "default_mixed_precision": "compose",
    "evaluate": "tokens",
    "ParallelDims": "mesh",
    "flatten_dp_sp": "mesh",
    "global_valid_tokens": "tokens",
    "init_mesh": "mesh",
    "mesh_ring": "mesh",
    "parallelize": "compose",
    "shard_blocks": "compose",
}

__all__ = [
    "checkpoint_blocks",
    "default_device_type",
    "default_mixed_precision",
    "flatten_dp_sp",
    "global_valid_tokens",
    "init_mesh",
    "mesh_ring",
    "parallelize",
    "shard_blocks",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs
    from dtensor_ulysses.parallel.compose import (
        checkpoint_blocks,
        default_mixed_precision,
        parallelize,
        shard_blocks,
    )
    from dtensor_ulysses.parallel.mesh import (
        default_device_type,
        flatten_dp_sp,
        init_mesh,
        mesh_ring,
    )
    from dtensor_ulysses.parallel.tokens import (
        global_valid_tokens,
    )
