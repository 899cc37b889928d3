"""The built-in Llama-style decoder (it never imports ``torch.distributed``), its token-wise
layers, the cross-entropy sums and the sharding-independent weight init.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtensor_ulysses._public import lazy_exports

if TYPE_CHECKING:  # the public names, written once (__all__ and the lazy map read them)
    from dtensor_ulysses.models.layers import (
        FeedForward,
        RMSNorm,
        apply_rope,
        rope_cos_sin,
    )
    from dtensor_ulysses.models.llama import (
        Attention,
        Transformer,
        build_model,
        model_flops_per_token,
        set_tiling,
    )
    from dtensor_ulysses.models.loss import (
        TOKEN_STATS,
        cross_entropy_sum,
        tiled_cross_entropy_sum,
        tiled_token_logps,
        token_logps,
    )
    from dtensor_ulysses.models.weights import (
        init_weights,
    )

__getattr__, __dir__, __all__ = lazy_exports(__name__)
