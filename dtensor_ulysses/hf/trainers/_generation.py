"""Generation with a model that ``with_ulysses`` sharded: its weights gathered, its own attention.

A trainer's model is FSDP2-sharded over ``dp x sp`` and its attention routed for sequence
slices. Generating from it (a rollout round; TRL's ``LogCompletionsCallback`` /
``WinRateCallback``, which call ``unwrap_model_for_generation`` and ``generate`` themselves)
needs every FSDP2 unit all-gathered (``generate`` calls the inner transformers model, past the
root's hooks) and the model's own attention over whole prompts
(:func:`~dtensor_ulysses.hf.models.routing.plain_attention`).

* :func:`all_gathered`: every FSDP2 unit of a model all-gathered once, kept until the block
  ends, then resharded (each unit's own reshard setting restored).
* :func:`tracked_generation_callbacks`: while a trainer trains or evaluates, TRL's callbacks
  module generates through :func:`_unwrap_for_generation` (the gathered model, its own
  attention, no gradients) and gathers the completions over dp (``gather_object``); with the
  accelerator's ``split_between_processes`` splitting over dp (:mod:`._accel`), each rank of an
  sp group generates its dp rank's prompts as the stock rank does, from the same random stream.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from dtensor_ulysses._torch_private import fsdp_reshards_after_forward
from dtensor_ulysses.hf.models.routing import plain_attention
from dtensor_ulysses.hf.trainers import _state
from dtensor_ulysses.hf.trainers._accel import dp_gather_object

__all__ = ["all_gathered", "patched", "set_up", "synced_steps", "tracked_generation_callbacks"]

# the TRL module whose callbacks generate, and the names it imported that are replaced
_CALLBACKS_MODULE = "trl.trainer.callbacks"


def set_up(root: Any, device: torch.device) -> None:
    """FSDP2 sets a model up in the root's first forward: a model that has run none runs one
    token (every rank together; inside ``plain_attention``, so nothing is routed)."""
    if not root.__dict__.get("_du_generation_ready", False):
        with torch.no_grad():
            root(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device))
        root.__dict__["_du_generation_ready"] = True


@contextlib.contextmanager
def synced_steps(hf: Any, synced: bool) -> Iterator[None]:
    """transformers' ``generate`` steps every rank in sync (``synced_gpus``) for a model
    ``fully_shard`` marked as managed: on for the block when layers are gathered per decoding
    step (every rank must step), off when the weights are held (each rank stops when done)."""
    managed = hf.__dict__.get("_is_fsdp_managed_module")
    hf._is_fsdp_managed_module = synced
    try:
        yield
    finally:
        if managed is None:
            del hf._is_fsdp_managed_module
        else:
            hf._is_fsdp_managed_module = managed


@contextlib.contextmanager
def all_gathered(root: Any, hf: Any, device: torch.device) -> Iterator[None]:
    """Every FSDP2 unit of ``root`` (``hf``: its transformers model) all-gathered for the
    block (a collective: every rank enters together), then resharded with its own setting
    restored; decoding steps unsynced. Entered inside
    :func:`~dtensor_ulysses.hf.models.routing.plain_attention` (see :func:`set_up`)."""
    set_up(root, device)
    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    reshard = {}
    for m in units:
        reshard[m] = fsdp_reshards_after_forward(m)
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        with synced_steps(hf, False):
            yield
    finally:
        for m in units:
            m.reshard()
            m.set_reshard_after_forward(reshard[m], recurse=False)


@contextlib.contextmanager
def _unwrap_for_generation(
    model: Any,
    accelerator: Any,
    gather_deepspeed3_params: bool = True,
    generation_kwargs: dict | None = None,
    gradient_checkpointing_kwargs: dict | None = None,
) -> Iterator[Any]:
    """TRL's ``unwrap_model_for_generation`` for a model ``with_ulysses`` sharded: the model
    itself (no DDP wrapper), its units gathered, its own attention, no gradients, and
    ``generation_kwargs`` over its generation config for the block, as TRL's does."""
    hf: Any = _state.base_model(model)
    with (
        plain_attention(hf),
        torch.no_grad(),
        all_gathered(model, hf, accelerator.device),
        _generation_config(hf, generation_kwargs),
    ):
        yield model


@contextlib.contextmanager
def _generation_config(hf: Any, overrides: dict | None) -> Iterator[None]:
    if not overrides:
        yield
        return
    original = hf.generation_config
    hf.generation_config = copy.deepcopy(original)
    hf.generation_config.update(**overrides)
    try:
        yield
    finally:
        hf.generation_config = original


@contextlib.contextmanager
def tracked_generation_callbacks(trainer: Any) -> Iterator[None]:
    """While the block runs (the trainer's ``train`` / ``evaluate``), TRL's generation
    callbacks generate from the gathered model and gather their completions over dp."""
    module = sys.modules.get(_CALLBACKS_MODULE)
    if module is None or not hasattr(module, "unwrap_model_for_generation"):
        yield
        return
    group = trainer._du_dims.dp_mesh.get_group()
    with (
        patched(module, "unwrap_model_for_generation", _unwrap_for_generation),
        patched(module, "gather_object", lambda obj: dp_gather_object(obj, group)),
    ):
        yield


@contextlib.contextmanager
def patched(module: Any, name: str, value: Any) -> Iterator[None]:
    """``module.name`` is ``value`` for the block (a name the module imported from elsewhere:
    a TRL module's ``gather``, ``unwrap_model_for_generation``); nothing when the module does
    not have the name (distillation's imports no ``gather``)."""
    if not hasattr(module, name):
        yield
        return
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)
