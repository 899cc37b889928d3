"""Activation checkpointing, applied to a module from outside: its activations are recomputed.

:func:`checkpoint_module` makes a module's forward run under non-reentrant
``torch.utils.checkpoint``: in forward only the module's inputs are kept; in backward the
forward is run again to rebuild what the gradients need. Parameter names do not change (the
module is not wrapped in another module), so checkpoints and weight initialization see the
same names with checkpointing on or off. Without grad (evaluation) the plain forward runs.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_module", "is_checkpointed"]

_ATTR = "_du_checkpointed"


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`checkpoint_module` was applied to ``module``."""
    return getattr(module, _ATTR, False)


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Recompute ``module``'s activations in backward; returns the same module, changed in place.

    Applying it twice is an error (it would recompute twice).
    """
    if is_checkpointed(module):
        raise ValueError(f"activation checkpointing is already applied to {type(module).__name__}")
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed_forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed_forward
    setattr(module, _ATTR, True)
    return module
