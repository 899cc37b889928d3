"""Attention: the local kernels (flash-attn, SDPA, FlexAttention, a blockwise kernel; see
:mod:`~dtensor_ulysses.attention.kernels`), the Ulysses
engine on local tensors, head-chunked stages, ring attention, and the DTensor adapters.

``q[B, S_sp, N, H] -> q[B, S, N_sp, H]`` is ``Shard(1) -> Shard(2)`` on ``sp``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtensor_ulysses._public import lazy_exports

# public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "AttentionBackendError": "kernels",
    "AttnFeatures": "kernels",
    "BACKENDS": "local",
    "build_doc_tensors": "doc_tensors",
    "check_doc_starts": "doc_tensors",
    "check_head_chunks": "ulysses",
    "DeferredQ": "local",
    "DocTensors": "doc_tensors",
    "flash_attn_available": "local",
    "flash_attn_module": "local",
    "force_backend": "local",
    "gather_doc_starts": "ulysses",
    "head_to_seq": "dtensor_api",
    "KERNELS": "kernels",
    "KernelSpec": "kernels",
    "local_attention": "local",
    "LocalAttention": "local",
    "resolve_backend": "local",
    "ring_attention": "ring",
    "RING_AXIS": "ring",
    "ring_group": "ring",
    "RingAttention": "ring",
    "select_backend": "kernels",
    "seq_to_head": "dtensor_api",
    "SP_AXIS": "ulysses",
    "sp_axis": "ulysses",
    "sp_group": "ulysses",
    "starts_from_positions": "local",
    "to_heads": "ulysses",
    "to_seq": "ulysses",
    "ulysses_attention": "dtensor_api",
    "UlyssesAttention": "ulysses",
    "use_flash_attn_module": "local",
    "with_doc_tensors": "doc_tensors",
}

__all__ = [
    "AttentionBackendError",
    "AttnFeatures",
    "BACKENDS",
    "build_doc_tensors",
    "check_doc_starts",
    "check_head_chunks",
    "DeferredQ",
    "DocTensors",
    "flash_attn_available",
    "flash_attn_module",
    "force_backend",
    "gather_doc_starts",
    "head_to_seq",
    "KERNELS",
    "KernelSpec",
    "local_attention",
    "LocalAttention",
    "resolve_backend",
    "ring_attention",
    "RING_AXIS",
    "ring_group",
    "RingAttention",
    "select_backend",
    "seq_to_head",
    "SP_AXIS",
    "sp_axis",
    "sp_group",
    "starts_from_positions",
    "to_heads",
    "to_seq",
    "ulysses_attention",
    "UlyssesAttention",
    "use_flash_attn_module",
    "with_doc_tensors",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs
    from dtensor_ulysses.attention.doc_tensors import (
        DocTensors,
        build_doc_tensors,
        check_doc_starts,
        with_doc_tensors,
    )
    from dtensor_ulysses.attention.dtensor_api import (
        head_to_seq,
        seq_to_head,
        ulysses_attention,
    )
    from dtensor_ulysses.attention.kernels import (
        KERNELS,
        AttentionBackendError,
        AttnFeatures,
        KernelSpec,
        select_backend,
    )
    from dtensor_ulysses.attention.local import (
        BACKENDS,
        DeferredQ,
        LocalAttention,
        flash_attn_available,
        flash_attn_module,
        force_backend,
        local_attention,
        resolve_backend,
        starts_from_positions,
        use_flash_attn_module,
    )
    from dtensor_ulysses.attention.ring import (
        RING_AXIS,
        RingAttention,
        ring_attention,
        ring_group,
    )
    from dtensor_ulysses.attention.ulysses import (
        SP_AXIS,
        UlyssesAttention,
        check_head_chunks,
        gather_doc_starts,
        sp_axis,
        sp_group,
        to_heads,
        to_seq,
    )
