"""The sequence mixers beside attention that :func:`~dtensor_ulysses.hf.apply_ulysses` routes,
and the ones it refuses, in one table.

Routed (each on this rank's slice, equal to the stock layer on the whole sequence):

* Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo hybrid): head-sharded between two
  all-to-alls, :mod:`~dtensor_ulysses.hf.models.mixers.linear_attention`.
* Mamba-2 (Nemotron-H, Granite 4.0-H, Falcon-H1): head-sharded between two all-to-alls,
  :mod:`~dtensor_ulysses.hf.models.mixers.mamba`.
* LFM2 short convolutions: a halo exchange, :mod:`~dtensor_ulysses.hf.models.mixers.short_conv`.
* Kimi Delta Attention (Kimi Linear's KDA layers): head-sharded between two all-to-alls,
  :mod:`~dtensor_ulysses.hf.models.mixers.kda`.

Refused, naming the layer (:data:`REFUSED_MIXERS`): mixers this package has not reproduced yet.
A mixer left out of both lists is refused by the routing too (a layer without attention or a
routed mixer), never run on the slice alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.distributed as dist
from torch import nn

from dtensor_ulysses.hf.models.mixers._route import SequenceMixerError
from dtensor_ulysses.hf.models.mixers.kda import is_kda, route_kda
from dtensor_ulysses.hf.models.mixers.linear_attention import (
    is_gated_deltanet,
    route_gated_deltanet,
)
from dtensor_ulysses.hf.models.mixers.mamba import is_mamba2, route_mamba2
from dtensor_ulysses.hf.models.mixers.short_conv import is_short_conv, route_short_conv

__all__ = [
    "MIXER_LAYER_TYPES",
    "REFUSED_MIXERS",
    "SequenceMixerError",
    "is_sequence_mixer",
    "refused_mixer",
    "route_mixers",
]

# config.layer_types of layers whose token mixing is a routed mixer ("hybrid": Falcon-H1's
# attention and Mamba-2 side by side in one layer)
MIXER_LAYER_TYPES = ("linear_attention", "mamba", "conv", "hybrid")

# class name -> why it is refused (one place; flip an entry off when its route lands)
REFUSED_MIXERS: dict[str, str] = {}


def refused_mixer(module: nn.Module) -> str | None:
    """Why ``module`` is refused, or ``None``."""
    return REFUSED_MIXERS.get(type(module).__name__)


def is_sequence_mixer(module: nn.Module) -> bool:
    """Whether ``module`` is a mixer :func:`route_mixers` routes."""
    return is_gated_deltanet(module) or is_mamba2(module) or is_short_conv(module) or is_kda(module)


def route_mixers(
    modules: Sequence[tuple[str, nn.Module]],
    group: dist.ProcessGroup,
    on_call: Callable[[nn.Module], None],
    *,
    allow_uneven_heads: bool = False,
) -> None:
    """Route every mixer of ``modules`` (:func:`is_sequence_mixer` true for each) by its kind.

    Raises:
        SequenceMixerError: sp and the mixer's heads do not fit (the message names the valid
            sp).
    """
    gdn = [(n, m) for n, m in modules if is_gated_deltanet(m)]
    mamba = [(n, m) for n, m in modules if is_mamba2(m)]
    conv = [(n, m) for n, m in modules if is_short_conv(m)]
    kda = [(n, m) for n, m in modules if is_kda(m)]
    route_gated_deltanet(gdn, group, on_call, allow_uneven_heads=allow_uneven_heads)
    route_mamba2(mamba, group, on_call, allow_uneven_heads=allow_uneven_heads)
    route_short_conv(conv, group, on_call)
    route_kda(kda, group, on_call, allow_uneven_heads=allow_uneven_heads)
