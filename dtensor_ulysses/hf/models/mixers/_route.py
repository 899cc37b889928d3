"""What every routed sequence mixer (Gated DeltaNet, Mamba-2, KDA, short convolution) shares: its
error, the sp-vs-heads check, the install on the instance, the checks of a call, the model file's
own kernels, and packed documents run one by one.

Legend: ``B`` batch, ``S`` sequence, ``s`` this rank's slice of it, ``L`` a piece's length.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtensor_ulysses.plan.splits import SeqLayout, check_sp_for_heads, head_split

__all__ = [
    "MixerRoute",
    "SequenceMixerError",
    "check_call",
    "install",
    "model_kernels",
    "per_document",
    "split_heads",
]

ROUTED = "_du_mixer_route"


class SequenceMixerError(ValueError):
    """A sequence mixer (Gated DeltaNet, Mamba-2, KDA, short convolution), or a call of one, that
    cannot run under Ulysses exactly."""


@dataclass(frozen=True)
class MixerRoute:
    """What a routed mixer needs at call time."""

    group: dist.ProcessGroup
    heads: tuple[int, ...]  # (key) heads per sp rank (contiguous, in rank order); () for a halo
    on_call: Callable[[nn.Module], None]  # the guard's record of this call


def split_heads(
    name: str, m: nn.Module, heads: int, sp: int, *, what: str, allow_uneven: bool
) -> tuple[int, ...]:
    """The heads of mixer ``name`` per sp rank (contiguous, in rank order), after the one
    sp-vs-heads check (:func:`~dtensor_ulysses.plan.check_sp_for_heads`).

    Args:
        name: the mixer's name in the model.
        m: the mixer.
        heads: how many heads it splits.
        sp: the sp degree.
        what: how the message names the heads (``"Mamba heads"``).
        allow_uneven: accept ``sp`` not dividing ``heads`` (``ceil`` or ``floor`` per rank).

    Raises:
        SequenceMixerError: sp and the heads do not fit (the message names the valid sp).
    """
    try:
        check_sp_for_heads(
            heads, sp, what=f"{what} of {name} ({type(m).__name__})",
            allow_uneven=allow_uneven, uneven_option="allow_uneven_heads=True",
        )  # fmt: skip
    except ValueError as e:
        raise SequenceMixerError(str(e)) from None
    return tuple(head_split(heads, sp))


def install(m: nn.Module, route: MixerRoute, forward: Callable) -> None:
    """Replace ``m.forward`` on the instance (the class and its code are untouched)."""
    m.__dict__[ROUTED] = route
    # an instance attribute: nn.Module.__call__ finds it before the class's forward
    m.forward = forward.__get__(m, type(m))


def check_call(
    m: nn.Module, x_BsD: torch.Tensor, cache: Any, attention_mask: Any, kwargs: dict
) -> tuple[MixerRoute, SeqLayout, int, int]:
    """The refusals every routed mixer makes on a call; returns ``(route, layout, P, me)``."""
    route: MixerRoute = m.__dict__[ROUTED]
    name = type(m).__name__
    if cache is not None or kwargs.get("cache_params") is not None:
        raise SequenceMixerError(
            f"{name}: a cache (conv and recurrent state) cannot be used under Ulysses; generate "
            f"on one device with the saved checkpoint"
        )
    if attention_mask is not None and not bool(attention_mask.all()):
        raise SequenceMixerError(
            f"{name}: a padding attention_mask cannot be applied to one sequence slice; pass the "
            f"padded batch through du.hf.shard_batch and call the model without attention_mask"
        )
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("seq_idx") is not None:
        raise SequenceMixerError(
            f"{name}: flash-attention packing kwargs (cu_seq_lens_q, seq_idx) describe the local "
            f"slice; pass packed documents as position ids restarting at 0, or as ulysses_layout"
        )
    layout: SeqLayout | None = kwargs.get("ulysses_layout")
    if layout is None:
        raise SequenceMixerError(
            f"{name} is routed through Ulysses but got no ulysses_layout: call the model whose "
            f"apply_ulysses routed it (its pre-hook passes the step's layout)"
        )
    if layout.ring != 1:
        raise SequenceMixerError(
            f"{name}: a sequence mixer under ring={layout.ring} would need its state and the "
            f"convolution's last inputs passed along the ring; use ring=1"
        )
    P, me = dist.get_world_size(route.group), dist.get_rank(route.group)
    s = x_BsD.shape[1]
    if len(layout.seq_sizes) != P or layout.seq_sizes[me] != s:
        raise ValueError(
            f"{name}: sp rank {me} holds {s} tokens but the layout gives "
            f"{list(layout.seq_sizes)} for sp={P}"
        )
    return route, layout, P, me


def model_kernels(m: nn.Module, *names: str) -> tuple[Callable, ...]:
    """The functions ``names`` of ``m``'s own modeling file, looked up on each call (a native
    kernel there when transformers bound one, its PyTorch reference otherwise)."""
    mod = sys.modules[type(m).__module__]
    return tuple(getattr(mod, n) for n in names)


def per_document(
    fn: Callable[..., torch.Tensor], xs: Sequence[torch.Tensor], layout: SeqLayout
) -> torch.Tensor:
    """``fn(*xs)`` on full-length tensors ``[B, S, ...]``, restarted at every packed document of
    ``layout`` (each document's piece ``[1, L, ...]`` on its own: zero conv padding, zero state)."""
    docs = layout.doc_starts
    if docs is None or all(len(row) == 1 for row in docs):
        return fn(*xs)
    S = xs[0].shape[1]
    rows = []
    for i, starts in enumerate(docs):
        ends = [*starts[1:], S]
        rows.append(torch.cat(
            [fn(*(t[i : i + 1, lo:hi] for t in xs)) for lo, hi in zip(starts, ends)], dim=1
        ))  # fmt: skip
    return torch.cat(rows, dim=0)
