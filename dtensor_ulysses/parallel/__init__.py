"""Parallelism from outside the model: the ``(dp, [ring,] sp)`` mesh, ``parallelize`` (Ulysses ->
activation checkpointing -> compile -> ``fully_shard``) and the global token count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtensor_ulysses._public import lazy_exports

if TYPE_CHECKING:  # the public names, written once (__all__ and the lazy map read them)
    from dtensor_ulysses.parallel.apply import (
        default_mixed_precision,
        parallelize,
    )
    from dtensor_ulysses.parallel.global_loss import (
        evaluate,
        global_valid_tokens,
    )
    from dtensor_ulysses.parallel.mesh import (
        ParallelDims,
        flatten_dp_sp,
        init_mesh,
        mesh_ring,
    )

__getattr__, __dir__, __all__ = lazy_exports(__name__)
