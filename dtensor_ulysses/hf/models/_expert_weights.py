"""Checkpoint names <-> model names, with transformers' own conversion mapping.

Mixture-of-Experts checkpoints (Mixtral, Qwen3-MoE, GLM-4-MoE, DeepSeek-V3, ...) store one
tensor per expert (``experts.3.w1.weight``), while transformers' models hold the experts fused
(``experts.gate_up_proj[E, 2I, D]``); ``from_pretrained`` converts on load and
``save_pretrained`` converts back, with the model's ``WeightConverter`` / ``WeightRenaming``
list (``transformers.conversion_mapping``). :func:`load_weights` and :func:`save_pretrained`
(hf/models/pretrained.py) read and write these formats with the same list, one fused tensor at a
time: the per-expert pieces of one target are collected (only that target's), converted by the
converter's own operations (e.g. ``MergeModulelist`` then ``Concatenate``), and copied into
this rank's shard; saving splits each gathered full tensor back with the reversed converter.
"""

from __future__ import annotations

from collections.abc import Iterable
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

__all__ = ["CheckpointNames", "checkpoint_format"]


def _conversions(hf: PreTrainedModel, *, saving: bool) -> list:
    from transformers.conversion_mapping import get_model_conversion_mapping

    return list(get_model_conversion_mapping(hf, add_legacy=not saving) or [])


@dataclass
class CheckpointNames:
    """How a checkpoint's keys become the model's tensors.

    Built from every key of the checkpoint (file headers only): ``target[key]`` is the model
    tensor the key fills, ``pattern[key]`` the converter's source pattern when it is a piece
    of a fused tensor (``None``: the key is renamed at most), and ``pieces[target]`` the keys a
    fused target needs.
    """

    hf: PreTrainedModel
    target: dict[str, str] = field(default_factory=dict)
    pattern: dict[str, str | None] = field(default_factory=dict)
    pieces: dict[str, set[str]] = field(default_factory=dict)
    _by_pattern: dict[str, Any] = field(default_factory=dict)
    _pending: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, hf: PreTrainedModel, keys: Iterable[str], model_names: Iterable[str]):
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )

        out = cls(hf)
        mapping = _conversions(hf, saving=False)
        renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        converters = [t for t in mapping if isinstance(t, WeightConverter)]
        out._by_pattern = {p: c for c in converters for p in c.source_patterns}
        meta = dict.fromkeys(model_names, True)
        prefix = hf.base_model_prefix
        for key in keys:
            name, pat = rename_source_key(key, renamings, converters, prefix, meta)
            if name not in meta and key in meta:  # a key that should not have been renamed
                name, pat = key, None
            out.target[key], out.pattern[key] = name, pat
            if pat is not None:
                out.pieces.setdefault(name, set()).add(key)
        return out

    def add(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Take checkpoint tensor ``key``; returns the model tensors it completes (itself,
        renamed; a fused target once all its pieces are in; else nothing)."""
        pat = self.pattern[key]
        name = self.target[key]
        if pat is None:
            return {name: tensor}
        conv = self._pending.get(name)
        if conv is None:
            conv = self._pending[name] = deepcopy(self._by_pattern[pat])
        conv.add_tensor(name, key, pat, tensor)
        self.pieces[name].discard(key)
        if self.pieces[name]:
            return {}
        del self._pending[name]
        done = conv.convert(name, model=self.hf, config=self.hf.config)
        return {k: (v[0] if isinstance(v, list) else v) for k, v in done.items()}


def checkpoint_format(hf: PreTrainedModel):
    """``(name, full) -> {checkpoint key: tensor}``: one full model tensor as the checkpoint
    stores it (per-expert pieces of a fused expert tensor, renamed keys), as transformers'
    ``save_pretrained`` writes it; the identity for a model without conversions."""
    from transformers.core_model_loading import revert_weight_conversion

    if not _conversions(hf, saving=True):
        return lambda name, full: {name: full}
    return lambda name, full: dict(revert_weight_conversion(hf, {name: full}))
