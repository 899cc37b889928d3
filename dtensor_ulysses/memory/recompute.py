"""Activation checkpointing, applied to a module from outside: its activations are recomputed.

:func:`checkpoint_module` makes a module's forward run under non-reentrant
``torch.utils.checkpoint``: in forward only the module's inputs are kept; in backward the
forward is run again to rebuild what the gradients need. Parameter names do not change (the
module is not wrapped in another module), so checkpoints and weight initialization see the
same names with checkpointing on or off. Without grad (evaluation) the plain forward runs.

With an :class:`~dtensor_ulysses.memory.ActivationOffloader` (``offload=``, or
:func:`offload_checkpoints` on modules already checkpointed, before or after ``fully_shard``),
the one input a checkpointed block keeps that is its own, the first positional argument (the
hidden state ``h``), lives in host memory between the block's forward and its recompute; the
other tensor arguments (RoPE tables shared by every block) stay where they are.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dtensor_ulysses.memory.offload import ActivationOffloader

__all__ = ["activation_offloader", "checkpoint_module", "is_checkpointed", "offload_checkpoints"]

_ATTR = "_du_checkpointed"
_OFFLOADER = "_du_activation_offloader"


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`checkpoint_module` was applied to ``module``."""
    return getattr(module, _ATTR, False)


def activation_offloader(module: nn.Module) -> ActivationOffloader | None:
    """The offloader a checkpointed ``module`` uses for its input, or None."""
    return getattr(module, _OFFLOADER, None)


def checkpoint_module(
    module: nn.Module, *, offload: bool | ActivationOffloader = False
) -> nn.Module:
    """Recompute ``module``'s activations in backward; returns the same module, changed in place.

    Args:
        module: called as ``module(h, *other_args, **kwargs)``.
        offload: keep ``h`` (the first positional argument) in host memory until the recompute:
            ``True`` for an offloader of its own, or one :class:`ActivationOffloader` shared by
            a model's blocks (so that block ``i``'s backward prefetches block ``i-1``'s input).

    Applying it twice is an error (it would recompute twice).
    """
    if is_checkpointed(module):
        raise ValueError(f"activation checkpointing is already applied to {type(module).__name__}")
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed_forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        offloader = activation_offloader(module)
        if offloader is None or not args or not isinstance(args[0], torch.Tensor):
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        with offloader.hooks(args[0]):  # sees exactly the inputs the checkpoint saves
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed_forward
    setattr(module, _ATTR, True)
    if offload is not False:
        offload_checkpoints([module], offload if offload is not True else None)
    return module


def offload_checkpoints(
    modules: Iterable[nn.Module], offloader: ActivationOffloader | None = None
) -> ActivationOffloader:
    """Offload the kept input of every module (each already checkpointed) to host memory.

    Returns the offloader they share (a new one when ``offloader`` is None); its ``stats``
    count the bytes moved.

    Raises:
        ValueError: a module is not checkpointed (offloading needs activation checkpointing:
            without it a block keeps all its activations, not just its input).
    """
    modules = list(modules)
    bare = [type(m).__name__ for m in modules if not is_checkpointed(m)]
    if bare:
        raise ValueError(
            f"activation offloading moves the input that a checkpointed block keeps, but "
            f"{len(bare)} of {len(modules)} modules ({bare[0]}, ...) are not checkpointed; "
            f"enable activation checkpointing (--activation-checkpointing) with "
            f"--offload-activations"
        )
    offloader = offloader or ActivationOffloader()
    for m in modules:
        setattr(m, _OFFLOADER, offloader)
    return offloader
