"""Attention: the local kernels (flash-attn, SDPA, FlexAttention, a blockwise kernel; see
:mod:`~dtensor_ulysses.attention.kernels`), the Ulysses
engine on local tensors, head-chunked stages, ring attention, and the DTensor adapters.

``q[B, S_sp, N, H] -> q[B, S, N_sp, H]`` is ``Shard(1) -> Shard(2)`` on ``sp``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtensor_ulysses._public import lazy_exports

if TYPE_CHECKING:  # the public names, written once (__all__ and the lazy map read them)
    from dtensor_ulysses.attention.doc_tensors import (
        DocTensors,
        build_block_ids,
        build_doc_tensors,
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
        Kernel,
        KernelChoice,
        KernelSpec,
        choose_kernel,
        describe_kernels,
        model_kernels,
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
        use_flash_attn_module,
    )
    from dtensor_ulysses.attention.ring import (
        RING_AXIS,
        RingAttention,
        ring_attention,
    )
    from dtensor_ulysses.attention.ulysses import (
        SP_AXIS,
        UlyssesAttention,
        sp_group,
        to_heads,
    )

__getattr__, __dir__, __all__ = lazy_exports(__name__)
