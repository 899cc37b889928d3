"""Torch-free planning: token and head splits, the GQA kv plan, the step's sequence layout,
closed-form bytes, model presets, the GPU table and the memory preflight.

Nothing here imports torch at import time: the simulator (``simulations/``) imports only this
subpackage of the library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtensor_ulysses._public import lazy_exports

# public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "CAPACITY_ENV": "_preflight_capacity",
    "check_fits": "preflight",
    "check_ring_mesh": "splits",
    "check_ring_seq": "splits",
    "check_sp_for_heads": "splits",
    "contiguous_stride": "splits",
    "default_loss_chunk": "splits",
    "DEFAULT_LOSS_CHUNK_TOKENS": "splits",
    "device_capacity": "_preflight_capacity",
    "divisors": "splits",
    "estimate_memory": "_preflight_estimate",
    "FEATURE_FLAGS": "preflight",
    "format_bytes": "_preflight_estimate",
    "get_shape": "presets",
    "GPU_SPECS": "hardware",
    "GpuSpec": "hardware",
    "HEAD_DIM": "splits",
    "head_plan": "splits",
    "head_split": "splits",
    "HeadPlan": "splits",
    "HEADROOM": "preflight",
    "host_capacity": "_preflight_capacity",
    "HOST_CAPACITY_ENV": "_preflight_capacity",
    "kv_head_index": "splits",
    "local_tokens": "splits",
    "MEMORY_FEATURES": "preflight",
    "MemoryEstimate": "_preflight_estimate",
    "ModelShape": "presets",
    "nearby_multiples": "splits",
    "parse_bytes": "_preflight_capacity",
    "Preflight": "preflight",
    "PRESETS": "presets",
    "ring_chunks": "splits",
    "ring_closed_form": "splits",
    "RING_ORDERS": "splits",
    "ring_seq_sizes": "splits",
    "RUNTIME_BYTES": "_preflight_estimate",
    "SEQ_DIM": "splits",
    "seq_split": "splits",
    "SeqLayout": "splits",
    "spec_for_device": "hardware",
    "training_flops_per_token": "presets",
    "ulysses_bytes_by_rank": "splits",
    "zigzag_permutation": "splits",
    "zigzag_positions": "splits",
}

__all__ = [
    "CAPACITY_ENV",
    "check_fits",
    "check_ring_mesh",
    "check_ring_seq",
    "check_sp_for_heads",
    "contiguous_stride",
    "default_loss_chunk",
    "DEFAULT_LOSS_CHUNK_TOKENS",
    "device_capacity",
    "divisors",
    "estimate_memory",
    "FEATURE_FLAGS",
    "format_bytes",
    "get_shape",
    "GPU_SPECS",
    "GpuSpec",
    "HEAD_DIM",
    "head_plan",
    "head_split",
    "HeadPlan",
    "HEADROOM",
    "host_capacity",
    "HOST_CAPACITY_ENV",
    "kv_head_index",
    "local_tokens",
    "MEMORY_FEATURES",
    "MemoryEstimate",
    "ModelShape",
    "nearby_multiples",
    "parse_bytes",
    "Preflight",
    "PRESETS",
    "ring_chunks",
    "ring_closed_form",
    "RING_ORDERS",
    "ring_seq_sizes",
    "RUNTIME_BYTES",
    "SEQ_DIM",
    "seq_split",
    "SeqLayout",
    "spec_for_device",
    "training_flops_per_token",
    "ulysses_bytes_by_rank",
    "zigzag_permutation",
    "zigzag_positions",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs
    from dtensor_ulysses.plan._preflight_capacity import (
        CAPACITY_ENV,
        HOST_CAPACITY_ENV,
        device_capacity,
        host_capacity,
        parse_bytes,
    )
    from dtensor_ulysses.plan._preflight_estimate import (
        RUNTIME_BYTES,
        MemoryEstimate,
        estimate_memory,
        format_bytes,
    )
    from dtensor_ulysses.plan.hardware import (
        GPU_SPECS,
        GpuSpec,
        spec_for_device,
    )
    from dtensor_ulysses.plan.preflight import (
        FEATURE_FLAGS,
        HEADROOM,
        MEMORY_FEATURES,
        Preflight,
        check_fits,
    )
    from dtensor_ulysses.plan.presets import (
        PRESETS,
        ModelShape,
        get_shape,
        training_flops_per_token,
    )
    from dtensor_ulysses.plan.splits import (
        DEFAULT_LOSS_CHUNK_TOKENS,
        HEAD_DIM,
        RING_ORDERS,
        SEQ_DIM,
        HeadPlan,
        SeqLayout,
        check_ring_mesh,
        check_ring_seq,
        check_sp_for_heads,
        contiguous_stride,
        default_loss_chunk,
        divisors,
        head_plan,
        head_split,
        kv_head_index,
        local_tokens,
        nearby_multiples,
        ring_chunks,
        ring_closed_form,
        ring_seq_sizes,
        seq_split,
        ulysses_bytes_by_rank,
        zigzag_permutation,
        zigzag_positions,
    )
