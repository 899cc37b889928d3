"""Every attention layer of a transformers causal LM through the one Ulysses engine.

:func:`apply_ulysses` registers one attention function (``attn_implementation="du_ulysses"``) in
transformers' ``AttentionInterface`` and a mask function of the same name in its
``AttentionMaskInterface`` that builds no mask: causality and document boundaries come from the
engine alone (:class:`~dtensor_ulysses.attention.UlyssesAttention` with the step's
:class:`~dtensor_ulysses.plan.SeqLayout`), so no mask made for the local slice is ever applied, or
silently dropped. The model is then fed this rank's sequence slice with *global* position ids.

A forward pre-hook on the base model (``model.model``) fixes the step's layout once per forward:
from ``ulysses_layout=`` when the caller passes one (the trainer, :func:`~dtensor_ulysses.hf.
shard_batch`), otherwise from the slices themselves (one all-gather of the slice lengths, one of
the position ids when given; without position ids each rank's global positions are filled in).
The layout, with its documents' device tensors built there (varlen bounds, document ids: once
per forward, not per layer), then reaches every attention call as a keyword argument, so
activation checkpointing replays exactly what the forward saw.

Gated DeltaNet layers (Qwen3.5, Qwen3-Next) go through the same exchange, routed by
:mod:`~dtensor_ulysses.hf.linear_attention`. Refused, loudly, naming the layer and the feature
(results would be wrong, not just slow): other layers without attention (Mamba, other linear
attention), sliding-window and
chunked attention, attention sinks, logit softcapping, attention dropout, bidirectional attention,
models whose attention does not go through the ``AttentionInterface``, a KV cache, padding masks
on the model call (use :func:`~dtensor_ulysses.hf.shard_batch`). On the first forward after
:func:`apply_ulysses`, a guard checks that every attention layer went through the engine and raises
:class:`UnroutedAttentionError` naming those that did not (sp would silently be a no-op for them).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from dtensor_ulysses.attention.doc_tensors import with_doc_tensors
from dtensor_ulysses.attention.local import BACKENDS, local_attention
from dtensor_ulysses.attention.ulysses import (
    UlyssesAttention,
    check_head_chunks,
    gather_doc_starts,
    sp_group,
)
from dtensor_ulysses.hf.linear_attention import is_gated_deltanet, route_gated_deltanet
from dtensor_ulysses.plan.splits import SeqLayout, check_sp_for_heads

__all__ = [
    "ATTN_IMPLEMENTATION",
    "UnroutedAttentionError",
    "UnsupportedModelError",
    "apply_ulysses",
    "attention_modules",
    "check_supported",
    "decoder_layers",
    "unwrap",
]

ATTN_IMPLEMENTATION = "du_ulysses"
_STATE = "_du_ulysses_state"
_MISSING = object()
# layer types (config.layer_types) and what they are
_LAYER_FEATURES = {
    "sliding_attention": "sliding-window attention",
    "chunked_attention": "chunked attention",
    "linear_attention": "linear attention (not softmax attention)",
    "mamba": "a Mamba state-space mixer (not attention)",
    "conv": "a convolution mixer (not attention)",
}
# kwargs of flash-attention packing (DataCollatorWithFlattening): they describe the local slice
_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class UnsupportedModelError(ValueError):
    """A model (or a call) the Ulysses engine cannot run exactly; the message names the layer
    and the feature."""


class UnroutedAttentionError(RuntimeError):
    """Attention layers that did not go through the Ulysses engine on the first forward."""


@dataclass(eq=False)
class _State:
    engine: UlyssesAttention
    group: dist.ProcessGroup
    backend: str
    head_chunks: int
    names: dict[int, str]  # id(attention module) -> its name in the model
    calls: dict[int, int] = field(default_factory=dict)
    checked: bool = False
    hooks: list = field(default_factory=list)

    def record(self, module: nn.Module) -> None:
        """Count a routed call of ``module`` (attention or linear attention) for the guard."""
        if not self.checked:
            self.calls[id(module)] = self.calls.get(id(module), 0) + 1


def unwrap(model: nn.Module) -> PreTrainedModel:
    """The transformers model of ``model`` (itself, or what :class:`~dtensor_ulysses.hf.
    HFCausalLM` wraps)."""
    inner = model.__dict__.get("hf_model", model)
    if not isinstance(inner, PreTrainedModel):
        raise TypeError(
            f"expected a transformers PreTrainedModel (e.g. from AutoModelForCausalLM), got "
            f"{type(model).__name__}"
        )
    return inner


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(name, layers)``: the decoder's list of blocks (``model.model.layers`` for Llama)."""
    hf = unwrap(model)
    base = hf.base_model
    n_layers = getattr(hf.config.get_text_config(), "num_hidden_layers", None)
    base_name = "" if base is hf else hf.base_model_prefix
    candidates = [
        (name, m)
        for name, m in base.named_modules()
        if isinstance(m, nn.ModuleList) and (n_layers is None or len(m) == n_layers)
    ]
    preferred = [c for c in candidates if c[0] == "layers"]
    if not (preferred or candidates):
        raise UnsupportedModelError(
            f"{type(hf).__name__}: found no list of {n_layers} decoder layers under "
            f"{type(base).__name__}; only decoder-only causal LMs are supported"
        )
    name, layers = (preferred or candidates)[0]
    return (f"{base_name}.{name}" if base_name else name), layers


def _attention_classes(hf: PreTrainedModel) -> tuple[type, ...]:
    classes: list[type] = []
    for owner in (type(hf), type(hf.base_model)):
        rec = getattr(owner, "_can_record_outputs", None) or {}
        found = rec.get("attentions")
        for item in found if isinstance(found, (list, tuple)) else [found]:
            cls = getattr(item, "target_class", item)
            if isinstance(cls, type):
                classes.append(cls)
    return tuple(classes)


def _is_attention(module: nn.Module, classes: tuple[type, ...]) -> bool:
    if classes:
        return isinstance(module, classes)
    return type(module).__name__.endswith("Attention")


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every attention module of the decoder, in layer order."""
    hf = unwrap(model)
    classes = _attention_classes(hf)
    prefix, layers = decoder_layers(hf)
    return [
        (f"{prefix}.{i}.{n}", m)
        for i, layer in enumerate(layers)
        for n, m in layer.named_modules()
        if _is_attention(m, classes)
    ]


# What the engine refuses, one wording each, for the model's attributes at construction
# (check_supported) and for the attention call's arguments (_ulysses_attention).
_REFUSED = {
    "sliding_window": "sliding-window attention",
    "chunk": "chunked attention",
    "softcap": "attention logit softcapping",
    "sinks": "attention sinks (learned per-head sink logits)",
    "non_causal": "bidirectional (non-causal) attention",
    "dropout": "attention dropout",
}


def _refused(kind: str, setting: str | None = None) -> str:
    """The refusal of feature ``kind``, with the setting that turned it on."""
    return _REFUSED[kind] + (f" ({setting})" if setting else "")


def _features(module: nn.Module, cfg: Any, layer_type: str | None) -> list[str]:
    """What ``module`` does that the engine cannot do exactly."""
    out = []
    window = getattr(module, "sliding_window", _MISSING)
    if window is _MISSING:  # e.g. Mistral reads config.sliding_window at call time
        window = getattr(cfg, "sliding_window", None) if layer_type is None else None
    if window is not None:
        out.append(_refused("sliding_window", f"sliding_window={window}"))
    chunk = getattr(cfg, "attention_chunk_size", None) or getattr(
        module, "attention_chunk_size", None
    )
    if chunk:
        out.append(_refused("chunk", f"attention_chunk_size={chunk}"))
    cap = getattr(cfg, "attn_logit_softcapping", None) or getattr(
        module, "attn_logit_softcapping", None
    )
    if cap:
        out.append(_refused("softcap", f"attn_logit_softcapping={cap}"))
    if getattr(module, "sinks", None) is not None:
        out.append(_refused("sinks"))
    if getattr(module, "is_causal", True) is False:
        out.append(_refused("non_causal"))
    if float(getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0:
        out.append(_refused("dropout", f"attention_dropout={cfg.attention_dropout}"))
    return out


def check_supported(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Refuse a model the engine cannot run exactly; returns its attention modules.

    Raises:
        UnsupportedModelError: every problem found, each naming the layer and the feature.
    """
    hf = unwrap(model)
    cfg = hf.config.get_text_config()
    what = f"{type(hf).__name__} (model_type {getattr(cfg, 'model_type', '?')!r})"
    routable = getattr(hf, "_supports_attention_backend", False) or any(
        is_gated_deltanet(m) for m in hf.modules()
    )  # the hybrids leave the flag off, yet call the interface (the first-forward guard checks)
    if not (routable and hf._can_set_attn_implementation()):
        raise UnsupportedModelError(
            f"{what} does not route its attention through transformers' AttentionInterface, "
            f"so its attention layers cannot be replaced by the Ulysses engine"
        )
    classes = _attention_classes(hf)
    prefix, layers = decoder_layers(hf)
    layer_types = getattr(cfg, "layer_types", None)
    problems, found = [], []
    for i, layer in enumerate(layers):
        lt = layer_types[i] if layer_types and i < len(layer_types) else None
        where = f"{prefix}.{i} ({type(layer).__name__})"
        mixers = [(n, m) for n, m in layer.named_modules() if is_gated_deltanet(m)]
        if lt == "linear_attention" and mixers:  # routed by hf/linear_attention.py
            found += [(f"{prefix}.{i}.{n}", m) for n, m in mixers]
        elif lt is not None and lt != "full_attention":
            problems.append(f"{where}: {_LAYER_FEATURES.get(lt, repr(lt))}")
        attns = [(n, m) for n, m in layer.named_modules() if _is_attention(m, classes)]
        if not attns and not mixers:
            kinds = sorted({type(m).__name__ for m in layer.children()})
            problems.append(
                f"{where}: no attention module (it has {', '.join(kinds)}); layers that do not "
                f"go through attention (linear attention, Mamba / GatedDeltaNet hybrids) cannot "
                f"be sequence-parallel with Ulysses"
            )
        for n, m in attns:
            name = f"{prefix}.{i}.{n}"
            problems += [f"{name} ({type(m).__name__}): {f}" for f in _features(m, cfg, lt)]
            found.append((name, m))
    if problems:
        more = f"; and {len(problems) - 6} more" if len(problems) > 6 else ""
        raise UnsupportedModelError(
            f"{what} cannot run under Ulysses exactly: " + "; ".join(problems[:6]) + more
        )
    return found


def apply_ulysses(
    model: nn.Module,
    mesh: Any,
    *,
    head_chunks: int = 1,
    backend: str = "auto",
    allow_uneven_heads: bool = False,
) -> nn.Module:
    """Route every attention layer of a transformers causal LM through the Ulysses engine.

    The model is then called on this rank's sequence slice ``input_ids[B, s]``; pass the
    *global* ``position_ids`` of the slice (or none: they are filled in), and for packed
    documents either position ids restarting at 0 per document or ``ulysses_layout=`` (a
    :class:`~dtensor_ulysses.plan.SeqLayout`, as :func:`~dtensor_ulysses.hf.shard_batch` gives).
    Its outputs are this rank's slice of the single-device outputs. Idempotent: a second call
    with the same mesh and options changes nothing (other options replace the first ones).

    Args:
        model: a transformers ``PreTrainedModel`` (or :class:`~dtensor_ulysses.hf.HFCausalLM`).
        mesh: a device mesh with an ``"sp"`` axis (or the sp process group).
        head_chunks: attention in this many stages of heads (see ``UlyssesAttention``).
        backend: the local kernel: ``"auto"``, ``"flash_attn"`` or ``"sdpa"``.
        allow_uneven_heads: accept q heads not divisible by sp.

    Returns:
        ``model``, changed in place.

    Raises:
        UnsupportedModelError: the model has a layer or feature the engine cannot run exactly.
        ValueError: heads and sp do not fit (the message names the valid sp).
    """
    hf = unwrap(model)
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    found = check_supported(hf)
    group = sp_group(mesh)
    sp = dist.get_world_size(group)
    cfg = hf.config.get_text_config()
    n_heads = cfg.num_attention_heads
    check_sp_for_heads(
        n_heads, sp, what=f"q heads of {type(hf).__name__}", allow_uneven=allow_uneven_heads
    )
    if head_chunks != 1:
        check_head_chunks(n_heads, sp, head_chunks)
    base = hf.base_model
    old: _State | None = base.__dict__.get(_STATE)
    if old is not None:
        if (old.group, old.backend, old.head_chunks) == (group, backend, head_chunks):
            return model
        for handle in old.hooks:
            handle.remove()
    engine = UlyssesAttention(local_attention, group, head_chunks=head_chunks)
    state = _State(engine, group, backend, head_chunks, {id(m): n for n, m in found})
    route_gated_deltanet(  # Gated DeltaNet layers: hf/linear_attention.py
        [(n, m) for n, m in found if is_gated_deltanet(m)], group, state.record,
        allow_uneven_heads=allow_uneven_heads,
    )  # fmt: skip
    base.__dict__[_STATE] = state
    for _, m in found:
        m.__dict__[_STATE] = state
    AttentionInterface.register(ATTN_IMPLEMENTATION, _ulysses_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    hf.set_attn_implementation(ATTN_IMPLEMENTATION)
    params = list(inspect.signature(base.forward).parameters)
    state.hooks = [
        base.register_forward_pre_hook(
            lambda mod, args, kwargs: _pre_forward(mod, args, kwargs, params), with_kwargs=True
        ),
        base.register_forward_hook(_post_forward),
    ]
    return model


# ----------------------------------------------------------------------------------------------
# per forward: the layout in, the guard out
# ----------------------------------------------------------------------------------------------
def _pre_forward(base: nn.Module, args: tuple, kwargs: dict, params: list[str]):
    state: _State = base.__dict__[_STATE]
    kwargs = dict(kwargs)
    for name, value in zip(params, args):  # positional -> keyword (HF passes keywords anyway)
        kwargs[name] = value
    if kwargs.get("past_key_values") is not None:
        raise UnsupportedModelError(
            "a KV cache (past_key_values) cannot be used under Ulysses: the model sees one "
            "sequence slice per rank; generate on one device with the saved checkpoint"
        )
    kwargs["use_cache"] = False
    x = kwargs.get("input_ids")
    if x is None:
        x = kwargs.get("inputs_embeds")
    if x is None:
        raise ValueError("pass input_ids or inputs_embeds")
    B, s = int(x.shape[0]), int(x.shape[1])
    layout: SeqLayout | None = kwargs.pop("ulysses_layout", None)
    pos = kwargs.get("position_ids")
    if pos is not None:
        pos = pos.expand(B, s) if pos.dim() == 2 else pos.reshape(1, s).expand(B, s)
    me = dist.get_rank(state.group)
    if layout is None:
        layout = _layout_from_slices(pos, B, s, x.device, state.group)
    elif layout.sp != dist.get_world_size(state.group) or layout.seq_sizes[me] != s:
        raise ValueError(
            f"ulysses_layout gives sp rank {me} {layout.seq_sizes[me] if me < layout.sp else 0} "
            f"tokens of {layout.seq_sizes}, but it holds {s}; pass the layout of this batch"
        )
    if pos is None:
        lo = layout.offset(me)
        pos = torch.arange(lo, lo + s, device=x.device).expand(B, s)
    kwargs["position_ids"] = pos
    # the documents' device tensors (varlen bounds, ids) once per forward, not per layer
    kwargs["ulysses_layout"] = with_doc_tensors(layout, x.device)
    if not state.checked:
        state.calls = {}
    return (), kwargs


def _layout_from_slices(
    pos: torch.Tensor | None, B: int, s: int, device: torch.device, group: dist.ProcessGroup
) -> SeqLayout:
    P = dist.get_world_size(group)
    mine = torch.tensor([s], dtype=torch.int64, device=device)
    sizes_t = [torch.empty_like(mine) for _ in range(P)]
    dist.all_gather(sizes_t, mine, group=group)
    sizes = [int(t.item()) for t in sizes_t]
    if pos is None:
        return SeqLayout(tuple(sizes))
    starts = gather_doc_starts(pos.to(device=device, dtype=torch.int64), sizes, group)
    if all(len(row) == 1 for row in starts):
        return SeqLayout(tuple(sizes))
    return SeqLayout(tuple(sizes), tuple(tuple(row) for row in starts))


def _post_forward(base: nn.Module, args: tuple, output: Any) -> None:
    state: _State = base.__dict__[_STATE]
    if state.checked:
        return
    state.checked = True
    missing = [name for key, name in state.names.items() if not state.calls.get(key)]
    if missing:
        raise UnroutedAttentionError(
            f"{len(missing)} of {len(state.names)} attention layers did not go through the "
            f"Ulysses engine on the first forward: {', '.join(missing)}. They attended over this "
            f"rank's sequence slice only (wrong results, and sp does not lower their memory). "
            f"Each attention module must read config._attn_implementation == "
            f"{ATTN_IMPLEMENTATION!r} (a layer given its own config, or a model whose attention "
            f"does not call transformers' AttentionInterface, is not routed)"
        )


# ----------------------------------------------------------------------------------------------
# the registered functions
# ----------------------------------------------------------------------------------------------
def _no_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> None:
    """The mask entry of ``du_ulysses``: no mask; causality and documents are the engine's."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise UnsupportedModelError(
            "an attention_mask with padding cannot be applied to one sequence slice; pass the "
            "padded batch through du.hf.shard_batch (padding becomes labels=-100 and document "
            "starts) and call the model without attention_mask"
        )
    return None


def _ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry: ``q[B, N, s, H]``, ``k/v[B, K, s, H]`` of this rank's slice
    -> ``o[B, s, N, H]`` through the Ulysses engine."""
    state: _State | None = module.__dict__.get(_STATE)
    if state is None:
        raise UnroutedAttentionError(
            f"{type(module).__name__} uses attn_implementation {ATTN_IMPLEMENTATION!r} but was "
            f"not prepared by du.hf.apply_ulysses (its model, or this layer, has no engine)"
        )
    name = f"{state.names.get(id(module), type(module).__name__)} ({type(module).__name__})"
    problems = []
    if kwargs.get("sliding_window") is not None:
        problems.append(_refused("sliding_window", f"sliding_window={kwargs['sliding_window']}"))
    if kwargs.get("softcap") is not None:
        problems.append(_refused("softcap", f"softcap={kwargs['softcap']}"))
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        problems.append(_refused("sinks"))
    if dropout:
        problems.append(_refused("dropout", f"dropout={dropout}"))
    if kwargs.get("is_causal") is False:
        problems.append(_refused("non_causal"))
    if attention_mask is not None:
        problems.append(
            "an explicit attention mask (built for one slice; pass padding and documents "
            "through du.hf.shard_batch instead)"
        )
    if any(kwargs.get(k) is not None for k in _VARLEN_KWARGS):
        problems.append(
            "flash-attention packing kwargs (cu_seq_lens_*) of the local slice (pass packed "
            "documents as position ids restarting at 0, or as ulysses_layout)"
        )
    if query.shape[2] != key.shape[2]:
        problems.append(f"{query.shape[2]} queries for {key.shape[2]} keys (a KV cache)")
    if problems:
        raise UnsupportedModelError(f"{name}: " + "; ".join(problems))
    layout = kwargs.get("ulysses_layout")
    if not query.dtype == key.dtype == value.dtype:  # autocast: RoPE promoted q, k to fp32
        dev = query.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else value.dtype
        query, key, value = (t.to(dtype) for t in (query, key, value))
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    extra = {}
    if layout is None and kwargs.get("position_ids") is not None:
        extra["position_ids"] = kwargs["position_ids"].expand(q.shape[0], q.shape[1])
    o = state.engine(
        q, k, v, layout=layout, causal=True, softmax_scale=scaling, backend=state.backend, **extra
    )
    state.record(module)
    return o, None
