"""The built-in Llama-style decoder (it never imports ``torch.distributed``), its token-wise
layers, the cross-entropy sums and the sharding-independent weight init.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtensor_ulysses._public import lazy_exports

# public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "apply_rope": "layers",
    "Attention": "llama",
    "bare_name": "weights",
    "build_model": "llama",
    "copy_full_": "weights",
    "cross_entropy_sum": "loss",
    "FeedForward": "layers",
    "INIT_STD": "weights",
    "init_std": "weights",
    "init_weights": "weights",
    "model_flops_per_token": "llama",
    "OutputHead": "layers",
    "RMSNorm": "layers",
    "rope_cos_sin": "layers",
    "set_tiling": "llama",
    "tiled_cross_entropy_sum": "loss",
    "Transformer": "llama",
    "TransformerBlock": "llama",
}

__all__ = [
    "apply_rope",
    "Attention",
    "bare_name",
    "build_model",
    "copy_full_",
    "cross_entropy_sum",
    "FeedForward",
    "INIT_STD",
    "init_std",
    "init_weights",
    "model_flops_per_token",
    "OutputHead",
    "RMSNorm",
    "rope_cos_sin",
    "set_tiling",
    "tiled_cross_entropy_sum",
    "Transformer",
    "TransformerBlock",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs
    from dtensor_ulysses.models.layers import (
        FeedForward,
        OutputHead,
        RMSNorm,
        apply_rope,
        rope_cos_sin,
    )
    from dtensor_ulysses.models.llama import (
        Attention,
        Transformer,
        TransformerBlock,
        build_model,
        model_flops_per_token,
        set_tiling,
    )
    from dtensor_ulysses.models.loss import (
        cross_entropy_sum,
        tiled_cross_entropy_sum,
    )
    from dtensor_ulysses.models.weights import (
        INIT_STD,
        bare_name,
        copy_full_,
        init_std,
        init_weights,
    )
