"""Torch-free planning: the parallel recipe's options (ParallelOptions), token and head splits,
the GQA kv plan, the step's sequence layout, closed-form bytes, model presets, the GPU table and
the memory preflight.

Nothing here imports torch at import time: the simulator (``simulations/``) imports only this
subpackage of the library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtensor_ulysses._public import lazy_exports

if TYPE_CHECKING:  # the public names, written once (__all__ and the lazy map read them)
    from dtensor_ulysses.plan._preflight_capacity import (
        CAPACITY_ENV,
        host_capacity,
        parse_bytes,
    )
    from dtensor_ulysses.plan._preflight_estimate import (
        MemoryEstimate,
        estimate_memory,
    )
    from dtensor_ulysses.plan.hardware import (
        GPU_SPECS,
        GpuSpec,
    )
    from dtensor_ulysses.plan.preflight import (
        FEATURE_FLAGS,
        HEADROOM,
        MEMORY_FEATURES,
        Preflight,
        check_fits,
    )
    from dtensor_ulysses.plan.presets import (
        HYBRID_PRESETS,
        PRESETS,
        LinearAttentionShape,
        ModelShape,
        get_shape,
        training_flops_per_token,
    )
    from dtensor_ulysses.plan.recipe import (
        ATTENTION_BACKENDS,
        ParallelOptions,
    )
    from dtensor_ulysses.plan.splits import (
        DP_AXIS,
        HEAD_DIM,
        RING_AXIS,
        SP_AXIS,
        HeadPlan,
        SeqLayout,
        check_ring_mesh,
        check_ring_seq,
        check_sp_for_heads,
        contiguous_stride,
        divisors,
        head_plan,
        head_split,
        kv_head_index,
        local_tokens,
        ring_chunks,
        ring_closed_form,
        ring_seq_sizes,
        seq_split,
        ulysses_bytes_by_rank,
        zigzag_permutation,
        zigzag_positions,
    )

__getattr__, __dir__, __all__ = lazy_exports(__name__)
