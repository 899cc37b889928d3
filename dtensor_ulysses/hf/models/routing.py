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

Each attention layer's features are read as transformers' eager path applies them
(:func:`layer_features`): a sliding window (per layer, from the module or the config), chunked
attention (Llama 4's ``"chunked_attention"`` layers; chunks restart at each packed document, as
transformers' packed masks make them), the logit softcap the attention function receives,
attention sinks (the module's ``sinks``; the engine gives each rank those of its heads), and
Llama 4's attention temperature on its layers without RoPE (computed by the model from the
row index of its slice; the engine rescales q to the row in the whole sequence). The kernel for
each layer kind is chosen once (:func:`~dtensor_ulysses.attention.choose_kernel`) in
:func:`apply_ulysses`, so a layer no kernel of this device runs exactly is refused before step 1.
After the all-to-all every rank holds the full sequence of its heads, so a window, a chunk or a
softcap is a property of the local kernel and never compared with the local slice length.

Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) and Mamba-2 mixers (Nemotron-H,
Granite 4.0-H, Falcon-H1) go through the same exchange (their heads split over sp, as q heads
are); LFM2's short convolutions through a halo exchange:
:mod:`~dtensor_ulysses.hf.models.mixers` holds the table of routed and refused mixers.

Vision-language models (Qwen2.5-VL, Qwen3-VL): only the text config's attention is routed (the
vision tower keeps its own, on whole images); the pre-hook sits on the language model, after
the slicing hook of :mod:`~dtensor_ulysses.hf.models.vision` (which also splits the vision work over
sp): the model is called on the full rows, and the decoder sees this rank's slice of the
merged embeddings with M-RoPE's rows of position ids (left as they are).

Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash, Kimi) runs through the engine with
v's own head dim; each such layer either exchanges its expanded heads or gathers its kv latent,
whichever moves fewer bytes (:mod:`~dtensor_ulysses.hf.models.latent_attention`). A layer
that attends with an earlier layer's keys and values (Gemma 4's KV sharing) reuses that layer's
exchanged k, v: only q and o move.

Refused, loudly, naming the layer and the feature (results would be wrong, not just slow):
other layers without attention or a routed mixer (and the mixers refused by name), sparse
attention (a top-k indexer: DeepSeek-V3.2), head chunks with latent attention, attention
dropout, bidirectional attention, models whose attention does not go through the
``AttentionInterface``, a KV cache, padding masks on the model call (use
:func:`~dtensor_ulysses.hf.shard_batch`). On the first forward after :func:`apply_ulysses`, a
guard checks that every attention layer and routed mixer went through the engine and raises
:class:`UnroutedAttentionError` naming those that did not (sp would silently be a no-op for
them).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from dtensor_ulysses.attention import AttnFeatures, KernelChoice, choose_kernel
from dtensor_ulysses.attention.doc_tensors import with_doc_tensors
from dtensor_ulysses.attention.kernels import check_backend
from dtensor_ulysses.attention.local import local_attention
from dtensor_ulysses.attention.ulysses import (
    UlyssesAttention,
    check_head_chunks,
    gather_doc_starts,
    sp_group,
)
from dtensor_ulysses.hf.models.image_blocks import image_blocks
from dtensor_ulysses.hf.models.image_blocks import install as install_image_blocks
from dtensor_ulysses.hf.models.latent_attention import (
    is_latent_attention,
    route_latent_attention,
    take_exchanged_kv,
)
from dtensor_ulysses.hf.models.mixers import (
    MIXER_LAYER_TYPES,
    is_sequence_mixer,
    refused_mixer,
    route_mixers,
)
from dtensor_ulysses.hf.models.vision import (
    is_vision_language,
    language_model,
    route_vision,
    vision_family,
    whole_rows,
)
from dtensor_ulysses.plan.splits import SeqLayout, check_sp_for_heads

__all__ = [
    "ATTN_IMPLEMENTATION",
    "LayerFeatures",
    "UnroutedAttentionError",
    "UnsupportedModelError",
    "apply_ulysses",
    "attention_dropout",
    "attention_modules",
    "check_supported",
    "decoder_layers",
    "layer_features",
    "plain_attention",
    "sliced_dropout",
    "unwrap",
]

ATTN_IMPLEMENTATION = "du_ulysses"
_STATE = "_du_ulysses_state"
_MISSING = object()
# layer types (config.layer_types) the engine runs, and what the others are
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
_LAYER_FEATURES = {
    "linear_attention": "linear attention (not softmax attention)",
    "mamba": "a Mamba state-space mixer (not attention)",
    "conv": "a convolution mixer (not attention)",
}
# layer types without token mixing (Nemotron-H's MLP and MoE blocks)
_TOKENWISE_LAYER_TYPES = ("mlp", "moe")
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
    features: dict[int, LayerFeatures] = field(default_factory=dict)  # id(module) -> features
    calls: dict[int, int] = field(default_factory=dict)
    chunked: dict[int, tuple[SeqLayout, SeqLayout]] = field(default_factory=dict)
    causal_only: tuple[SeqLayout, SeqLayout] | None = None  # the layout without image blocks
    latent: dict[str, str] = field(default_factory=dict)  # MLA layer -> "latent" / "heads"
    shares_kv: bool = False  # some layer attends with an earlier layer's k, v (Gemma 4)
    kv_shared: dict[int, tuple] = field(default_factory=dict)  # id(k) -> (k, v, k_ex, v_ex)
    checked: bool = False
    hooks: list = field(default_factory=list)
    original: str | None = None  # the attention implementation before apply_ulysses
    plain: bool = False  # inside plain_attention: the hooks do nothing

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
    base_name, base = language_model(hf)  # a vision-language model: its text decoder
    n_layers = getattr(hf.config.get_text_config(), "num_hidden_layers", None)
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
    for owner in (type(hf), type(hf.base_model), type(language_model(hf)[1])):
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
    "non_causal": "bidirectional (non-causal) attention",
    "dropout": "attention dropout",
}


def _refused(kind: str, setting: str | None = None) -> str:
    """The refusal of feature ``kind``, with the setting that turned it on."""
    return _REFUSED[kind] + (f" ({setting})" if setting else "")


@dataclass(frozen=True)
class LayerFeatures:
    """What one attention layer does beyond plain causal attention, as transformers' eager path
    applies it (its mask and its ``eager_attention_forward``).

    Attributes:
        sliding_window: transformers' ``sliding_window`` ``W``: a query sees itself and the
            ``W - 1`` keys before it (``masking_utils.sliding_window_overlay``:
            ``kv_idx > q_idx - W``), i.e. the kernel's ``window=(W - 1, 0)``.
        chunk: ``attention_chunk_size`` ``C`` of a ``"chunked_attention"`` layer: key ``j``
            visible to query ``i`` iff ``j // C == i // C`` (positions within a document).
        softcap: ``attn_logit_softcapping`` ``c`` (scores become ``c * tanh(score / c)``) as the
            module declares it, for the kernel choice before step 1; each call applies the
            ``softcap`` its attention function receives, as the eager function does (Gemma 2
            passes it; Gemma 3's attention passes none, whatever its config says).
        sinks: the module has learned per-head sink logits (gpt-oss ``sinks``, passed as
            ``s_aux``).
        nope_temperature: Llama 4's attention temperature on a layer without RoPE: its q scale
            depends on the token's row index, which the model computes on the local slice.
        blocks: the tokens of one image attend to each other both ways (Gemma 3 on every
            layer, Gemma 4 on its sliding layers): the kernel feature of bidirectional blocks,
            from the step layout's ``blocks``. transformers' sliding mask is then
            ``(causal or same image) and kv_idx > q_idx - W``: the window bounds the left side
            only.
    """

    sliding_window: int | None = None
    chunk: int | None = None
    softcap: float | None = None
    sinks: bool = False
    nope_temperature: bool = False
    blocks: bool = False

    @property
    def window(self) -> tuple[int, int] | None:
        """The kernel's ``(left, right)`` window (flash-attn convention), or ``None``."""
        if self.sliding_window is None:
            return None
        return (self.sliding_window - 1, -1 if self.blocks else 0)

    def describe(self) -> str:
        """A short description (``"window 8, softcap 50.0"``), ``"plain"`` when none."""
        parts = []
        if self.sliding_window is not None:
            parts.append(f"sliding_window={self.sliding_window}")
        if self.chunk is not None:
            parts.append(f"attention_chunk_size={self.chunk}")
        if self.softcap is not None:
            parts.append(f"softcap={self.softcap}")
        if self.sinks:
            parts.append("sinks")
        if self.blocks:
            parts.append("bidirectional image blocks")
        return ", ".join(parts) or "plain"


def layer_features(
    module: nn.Module, cfg: Any, layer_type: str | None, blocks: bool = False
) -> LayerFeatures:
    """The features of attention ``module`` (see :class:`LayerFeatures`).

    Read as each family's code applies them: a module's own ``sliding_window`` attribute
    (Qwen2, Qwen3-MoE, Gemma 2/3, gpt-oss, OLMo 3 set it per layer from ``layer_types``), else
    the config's (Mistral and Mixtral read ``config.sliding_window`` at call time for every
    layer); ``attention_chunk_size`` on ``"chunked_attention"`` layers (Llama 4);
    ``attn_logit_softcapping``; a ``sinks`` parameter; ``blocks``, the model's bidirectional
    image blocks on this layer (:func:`~dtensor_ulysses.hf.models.image_blocks.block_layers`). The
    attention call's own arguments are checked against these on every call
    (:func:`_ulysses_attention`).

    Raises:
        UnsupportedModelError: a setting these rules cannot place (a window or chunk size that
            is not a positive int, a chunk size without ``layer_types``).
    """
    window = getattr(module, "sliding_window", _MISSING)
    if window is _MISSING:  # Mistral / Mixtral: config.sliding_window, every layer
        window = getattr(cfg, "sliding_window", None)
    if layer_type == "sliding_attention" and window is None:
        window = getattr(cfg, "sliding_window", None)
    chunk = None
    chunk_cfg = getattr(cfg, "attention_chunk_size", None)
    if layer_type == "chunked_attention":
        chunk = chunk_cfg
        if chunk is None:
            raise UnsupportedModelError(
                "a 'chunked_attention' layer without config.attention_chunk_size"
            )
    elif chunk_cfg and layer_type is None:
        raise UnsupportedModelError(
            f"attention_chunk_size={chunk_cfg} without config.layer_types: which layers are "
            f"chunked is unknown; set layer_types ('chunked_attention' / 'full_attention')"
        )
    for name, v in (("sliding_window", window), ("attention_chunk_size", chunk)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise UnsupportedModelError(f"{name}={v!r} is not a positive int")
    cap = getattr(module, "attn_logit_softcapping", None)
    if cap is None:
        cap = getattr(cfg, "attn_logit_softcapping", None)
    sinks = isinstance(getattr(module, "sinks", None), torch.Tensor)
    nope_t = bool(getattr(module, "attn_temperature_tuning", False)) and (
        getattr(module, "use_rope", True) in (False, 0)
    )
    return LayerFeatures(window, chunk, float(cap) if cap else None, sinks, nope_t, blocks)  # type: ignore[arg-type]


# the config keys that turn attention dropout on across families, and a module's own attributes
_DROPOUT_CONFIG = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")
_DROPOUT_MODULE = ("attention_dropout", "attn_dropout", "dropout")


def attention_dropout(
    config: Any, module: nn.Module | None = None, overrides: dict | None = None
) -> dict[str, float]:
    """The one detector of attention dropout (``apply_ulysses``, ``--hf-model``,
    ``with_ulysses``): the positive probabilities, by where they were found, of a text config's
    keys (``overrides``, e.g. ``model_init_kwargs``, win) and of an attention module's own
    attributes (a float or an ``nn.Dropout``). Empty: no attention dropout."""
    found: dict[str, float] = {}
    for key in _DROPOUT_CONFIG:
        value = (overrides or {}).get(key, getattr(config, key, None))
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            found[key] = float(value)
    if module is not None:
        for key in _DROPOUT_MODULE:
            value = getattr(module, key, None)
            value = value.p if isinstance(value, nn.Dropout) else value
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                found[f"module.{key}"] = float(value)
    return found


# config keys of dropout on the hidden states (residual, embeddings) that families apply with
# ``F.dropout`` rather than an ``nn.Dropout`` module
_HIDDEN_DROPOUT_CONFIG = ("hidden_dropout", "resid_pdrop", "embd_pdrop", "hidden_dropout_prob")
_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                    nn.FeatureAlphaDropout)  # fmt: skip


def sliced_dropout(root: nn.Module, hf: Any) -> str | None:
    """What dropout a training step of ``root`` draws on sequence slices, in one line; ``None``
    when there is none. Dropout on the hidden states (an ``nn.Dropout`` module with ``p > 0``
    anywhere in ``root``, a PEFT adapter's ``lora_dropout`` among them, or a text config's
    hidden-dropout key) runs under Ulysses, but each rank draws the masks of its own slice from
    the stock rank's random stream, so the step equals the single-process step in distribution,
    not bit for bit, and its masks change with sp. (Attention dropout is refused:
    :func:`attention_dropout`.)"""
    found = {name or "(root)": float(m.p) for name, m in root.named_modules()
             if isinstance(m, _DROPOUT_MODULES) and m.p > 0}  # fmt: skip
    cfg = hf.config.get_text_config()
    for key in _HIDDEN_DROPOUT_CONFIG:
        value = getattr(cfg, key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            found[f"config.{key}"] = float(value)
    if not found:
        return None
    items = [f"{k} p={v:g}" for k, v in found.items()]
    more = f" and {len(items) - 2} more" if len(items) > 2 else ""
    return (
        f"dropout on sequence slices ({', '.join(items[:2])}{more}): each rank draws the masks "
        f"of its own slice, so training equals the single-process run in distribution, not bit "
        f"for bit, and the masks change with sp; for the exact run set the dropout to 0.0 "
        f"(LoraConfig(lora_dropout=0.0), TRL's --lora_dropout 0, disable_dropout=True, or the "
        f"model config's)"
    )


def _problems(module: nn.Module, cfg: Any) -> list[str]:
    """What ``module`` does that the engine cannot do exactly."""
    out = []
    if getattr(module, "is_causal", True) is False or getattr(cfg, "is_causal", True) is False:
        out.append(_refused("non_causal"))
    bidirectional = getattr(cfg, "use_bidirectional_attention", False)
    if bidirectional and bidirectional != "vision":  # "vision": Gemma 4's image blocks
        out.append(_refused("non_causal", f"use_bidirectional_attention={bidirectional!r}"))
    dropout = attention_dropout(cfg) or attention_dropout(None, module)  # the config's first
    if dropout:
        out.append(_refused("dropout", ", ".join(f"{k}={v}" for k, v in dropout.items())))
    if isinstance(getattr(module, "indexer", None), nn.Module):  # DeepSeek-V3.2, GLM-5
        out.append(
            "sparse attention (a top-k indexer picks each query's keys: the engine runs dense "
            "attention)"
        )
    return out


def check_supported(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Refuse a model the engine cannot run exactly; returns its attention modules.

    Raises:
        UnsupportedModelError: every problem found, each naming the layer and the feature.
    """
    return [(name, m) for name, m, _ in _supported(model)]


def _supported(model: nn.Module) -> list[tuple[str, nn.Module, LayerFeatures | None]]:
    """``(name, module, features)`` of every attention module (features ``None``: a sequence
    mixer, routed by hf/models/mixers/)."""
    hf = unwrap(model)
    cfg = hf.config.get_text_config()
    what = f"{type(hf).__name__} (model_type {getattr(cfg, 'model_type', '?')!r})"
    routable = getattr(hf, "_supports_attention_backend", False) or any(
        is_sequence_mixer(m) or refused_mixer(m) for m in hf.modules()
    )  # the hybrids leave the flag off, yet call the interface (the first-forward guard checks;
    # a refused mixer is named below, layer by layer)
    if is_vision_language(hf):
        try:
            vision_family(hf)
        except ValueError as e:
            raise UnsupportedModelError(str(e)) from None
    if not (routable and hf._can_set_attn_implementation()):
        raise UnsupportedModelError(
            f"{what} does not route its attention through transformers' AttentionInterface, "
            f"so its attention layers cannot be replaced by the Ulysses engine"
        )
    classes = _attention_classes(hf)
    prefix, layers = decoder_layers(hf)
    layer_types = getattr(cfg, "layer_types", None)
    blocks = image_blocks(hf)  # Gemma 3/4 multimodal: an image's tokens see each other
    problems: list[str] = []
    found: list[tuple[str, nn.Module, LayerFeatures | None]] = []
    for i, layer in enumerate(layers):
        lt = layer_types[i] if layer_types and i < len(layer_types) else None
        where = f"{prefix}.{i} ({type(layer).__name__})"
        mixers = [(n, m) for n, m in layer.named_modules() if is_sequence_mixer(m)]
        refused = [(n, m, refused_mixer(m)) for n, m in layer.named_modules() if refused_mixer(m)]
        problems += [f"{prefix}.{i}.{n} ({type(m).__name__}): {why}" for n, m, why in refused]
        if lt in MIXER_LAYER_TYPES and mixers:  # routed by hf/models/mixers/
            found += [(f"{prefix}.{i}.{n}", m, None) for n, m in mixers]
        elif refused or lt in _TOKENWISE_LAYER_TYPES:
            pass
        elif lt is not None and lt not in _ATTENTION_LAYER_TYPES:
            problems.append(f"{where}: {_LAYER_FEATURES.get(lt, repr(lt))}")
        attns = [(n, m) for n, m in layer.named_modules()
                 if _is_attention(m, classes) and not refused_mixer(m)]  # fmt: skip
        if not attns and not mixers and not refused and lt not in _TOKENWISE_LAYER_TYPES:
            kinds = sorted({type(m).__name__ for m in layer.children()})
            problems.append(
                f"{where}: no attention module (it has {', '.join(kinds)}); layers that do not "
                f"go through attention (linear attention, Mamba / GatedDeltaNet hybrids) cannot "
                f"be sequence-parallel with Ulysses"
            )
        for n, m in attns:
            name = f"{prefix}.{i}.{n}"
            found_problems = [f"{name} ({type(m).__name__}): {f}" for f in _problems(m, cfg)]
            try:
                feats = layer_features(m, cfg, lt, blocks is not None and blocks.on_layer(lt))
            except UnsupportedModelError as e:
                found_problems.append(f"{name} ({type(m).__name__}): {e}")
                feats = LayerFeatures()
            problems += found_problems
            found.append((name, m, feats))
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
    compute_dtype: torch.dtype | None = None,
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
        backend: the local kernel: ``"auto"`` or a name of
            :data:`~dtensor_ulysses.attention.BACKENDS`; chosen here once per layer kind and
            stored on the layer (``kernel_choice``).
        allow_uneven_heads: accept q heads not divisible by sp.
        compute_dtype: the dtype attention computes in (autocast's or the mixed-precision
            policy's; default: the parameters'), for the kernel choice.

    Returns:
        ``model``, changed in place.

    Raises:
        UnsupportedModelError: the model has a layer or feature the engine cannot run exactly.
        ValueError: heads and sp do not fit (the message names the valid sp).
    """
    hf = unwrap(model)
    check_backend(backend)
    found = _supported(hf)
    group = sp_group(mesh)
    sp = dist.get_world_size(group)
    cfg = hf.config.get_text_config()
    n_heads = cfg.num_attention_heads
    check_sp_for_heads(
        n_heads, sp, what=f"q heads of {type(hf).__name__}", allow_uneven=allow_uneven_heads,
        uneven_option="allow_uneven_heads=True",  # apply_ulysses', parallelize's, with_ulysses'
    )  # fmt: skip
    if head_chunks != 1:
        latent = [(n, m) for n, m, f in found if f is not None and is_latent_attention(m)]
        if latent:
            raise UnsupportedModelError(
                f"{latent[0][0]} ({type(latent[0][1]).__name__}): head_chunks={head_chunks} "
                f"with multi-head latent attention (its value head dim differs from q/k's; the "
                f"head stages need one head dim): use head_chunks=1"
            )
        check_head_chunks(n_heads, sp, head_chunks)
    _choose_kernels(hf, [(n, m, f) for n, m, f in found if f is not None], mesh, backend,
                    compute_dtype)  # fmt: skip
    _, base = language_model(hf)  # the decoder's sequence (after a VLM's image merge)
    old: _State | None = base.__dict__.get(_STATE)
    if old is not None:
        if (old.group, old.backend, old.head_chunks) == (group, backend, head_chunks):
            return model
        for handle in old.hooks:
            handle.remove()
    engine = UlyssesAttention(local_attention, group, head_chunks=head_chunks)
    feats = {id(m): f for _, m, f in found if f is not None}
    state = _State(engine, group, backend, head_chunks, {id(m): n for n, m, _ in found},
                   feats)  # fmt: skip
    state.original = old.original if old is not None else hf.config._attn_implementation
    route_mixers(  # Gated DeltaNet, Mamba-2, short convolutions: hf/models/mixers/
        [(n, m) for n, m, f in found if f is None], group, state.record,
        allow_uneven_heads=allow_uneven_heads,
    )  # fmt: skip
    # multi-head latent attention: the latent gathered where that moves fewer bytes
    state.latent = route_latent_attention(
        [(n, m) for n, m, f in found if f is not None and is_latent_attention(m)], group
    )
    state.shares_kv = any(getattr(m, "is_kv_shared_layer", False) for _, m, _ in found)
    install_image_blocks(hf, group)  # the step's image blocks from the model's token types
    base.__dict__[_STATE] = state
    for _, m, _ in found:
        m.__dict__[_STATE] = state
    AttentionInterface.register(ATTN_IMPLEMENTATION, _ulysses_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    if is_vision_language(hf):  # the vision tower keeps its own attention (whole images)
        route_vision(hf, group)
        hf.set_attn_implementation({"text_config": ATTN_IMPLEMENTATION})
    else:
        hf.set_attn_implementation(ATTN_IMPLEMENTATION)
    params = list(inspect.signature(base.forward).parameters)
    state.hooks = [
        base.register_forward_pre_hook(
            lambda mod, args, kwargs: _pre_forward(mod, args, kwargs, params), with_kwargs=True
        ),
        base.register_forward_hook(_post_forward),
    ]
    return model


def _attn_features(feats: LayerFeatures, docs: bool) -> AttnFeatures:
    return AttnFeatures.of(causal=True, window=feats.window, chunk=feats.chunk,
                           softcap=feats.softcap, sinks=True if feats.sinks else None,
                           docs=docs, blocks=True if feats.blocks else None)  # fmt: skip


def _choose_kernels(
    hf: PreTrainedModel,
    found: list[tuple[str, nn.Module, LayerFeatures]],
    mesh: Any,
    backend: str,
    compute_dtype: torch.dtype | None,
) -> None:
    """Choose the kernel once per distinct layer kind (its features and head dim) on this
    device and compute dtype (:func:`~dtensor_ulysses.attention.choose_kernel`), refuse a layer
    no kernel runs before step 1, and store the choice on each layer (``kernel_choice``: the
    call path looks it up for its documents, the start line prints it)."""
    device_type = getattr(mesh, "device_type", None)
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    param = next(iter(hf.parameters()), None)
    dtype = compute_dtype or (param.dtype if param is not None else torch.float32)
    cfg = hf.config.get_text_config()
    seen: dict[tuple, KernelChoice] = {}
    for name, m, feats in found:
        head_dim = int(getattr(m, "qk_head_dim", 0) or getattr(m, "head_dim", 0) or
                       getattr(cfg, "head_dim", 0) or
                       cfg.hidden_size // cfg.num_attention_heads)  # fmt: skip
        key = (feats, head_dim)
        if key not in seen:
            try:
                seen[key] = choose_kernel(_attn_features(feats, docs=False),
                                          device_type=device_type, dtype=dtype,
                                          head_dim=head_dim, requested=backend)  # fmt: skip
            except ValueError as e:
                raise UnsupportedModelError(
                    f"{name} ({type(m).__name__}, {feats.describe()}): no attention kernel runs "
                    f"it exactly on {device_type} in {dtype}: {e}"
                ) from None
        m.__dict__["kernel_choice"] = seen[key]


# ----------------------------------------------------------------------------------------------
# per forward: the layout in, the guard out
# ----------------------------------------------------------------------------------------------
def _pre_forward(base: nn.Module, args: tuple, kwargs: dict, params: list[str]):
    state: _State = base.__dict__[_STATE]
    if state.plain:
        return None
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
    if pos is not None and pos.dim() <= 2:  # M-RoPE's [3 or 4, B, s] rows stay as they are
        pos = pos.expand(B, s) if pos.dim() == 2 else pos.reshape(1, s).expand(B, s)
    me = dist.get_rank(state.group)
    if layout is None:
        flat = pos if pos is None or pos.dim() == 2 else None
        layout = _layout_from_slices(flat, B, s, x.device, state.group)
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
    state.chunked = {}
    state.kv_shared = {}
    return (), kwargs


@contextlib.contextmanager
def plain_attention(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, a model prepared by :func:`apply_ulysses` attends with its own
    implementation again (the one it had before), over whole sequences on every rank, a KV cache
    allowed: what generation needs (every rank holds the full prompt; nothing is exchanged).

    Raises:
        UnsupportedModelError: routed sequence mixers or latent attention (their layers were
            changed for slices).
    """
    hf = unwrap(model)
    state: _State | None = language_model(hf)[1].__dict__.get(_STATE)  # a VLM's: its decoder's
    if state is None:
        yield model
        return
    mixers = [name for key, name in state.names.items() if key not in state.features]
    if mixers or state.latent:
        raise UnsupportedModelError(
            f"{mixers[0] if mixers else next(iter(state.latent))}: whole-sequence calls (e.g. "
            f"generation) of a model whose sequence mixers or latent attention were routed for "
            f"slices are not supported; generate with the saved checkpoint on one device"
        )
    # a vision-language model: only its text config was routed (the tower keeps its attention)
    vl = is_vision_language(hf)
    hf.set_attn_implementation({"text_config": state.original or "sdpa"} if vl
                               else state.original or "sdpa")  # fmt: skip
    state.plain = True
    try:
        with whole_rows(hf):  # a VLM's images encoded here, its decoder on the full rows
            yield model
    finally:
        state.plain = False
        hf.set_attn_implementation({"text_config": ATTN_IMPLEMENTATION} if vl
                                   else ATTN_IMPLEMENTATION)  # fmt: skip


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
    if state.checked or state.plain:
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
    feats = state.features.get(id(module), LayerFeatures())
    problems = []
    # the call's own arguments must be what the layer's features say (a window read under
    # another name, or set after apply_ulysses, must not be dropped)
    window = kwargs.get("sliding_window")
    if window is not None and window != feats.sliding_window:
        problems.append(
            f"the call passes sliding_window={window} but apply_ulysses read "
            f"{feats.sliding_window} from the model; call apply_ulysses again after changing "
            f"the config"
        )
    cap = kwargs.get("softcap")  # the eager function applies the call's softcap, if any
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    if (sinks is not None) != feats.sinks:
        problems.append(
            f"the call {'passes' if sinks is not None else 'does not pass'} attention sinks but "
            f"apply_ulysses found {'a' if feats.sinks else 'no'} sinks parameter"
        )
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
    # k, v already this rank's full-length heads: the latent gathered and expanded by the
    # layer (hf/models/latent_attention.py), or an earlier layer's exchanged k, v (KV sharing)
    exchanged = _exchanged_kv(state, module, key, value)
    key0, value0 = key, value  # as the model passed them (the key of the KV-sharing cache)
    if exchanged is None and query.shape[2] != key.shape[2]:
        problems.append(f"{query.shape[2]} queries for {key.shape[2]} keys (a KV cache)")
    if problems:
        raise UnsupportedModelError(f"{name}: " + "; ".join(problems))
    layout = kwargs.get("ulysses_layout")
    if not query.dtype == key.dtype == value.dtype:  # autocast: RoPE promoted q, k to fp32
        dev = query.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else value.dtype
        query, key, value = (t.to(dtype) for t in (query, key, value))
    if layout is not None and layout.blocks is not None and not feats.blocks:
        layout = _without_blocks(state, layout)  # a layer that stays causal over images
    if feats.nope_temperature:
        query = _global_temperature(module, query, layout, state.group)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    extra: dict[str, Any] = {}
    if layout is None and kwargs.get("position_ids") is not None:
        extra["position_ids"] = kwargs["position_ids"].expand(q.shape[0], q.shape[1])
    if feats.window is not None:
        extra["window"] = feats.window
    if feats.chunk is not None:
        if layout is not None and layout.doc_starts is not None:
            layout = _chunk_layout(state, layout, feats.chunk)  # chunks restart per document
        else:
            extra["chunk"] = feats.chunk
    if cap:
        extra["softcap"] = float(cap)
    if feats.sinks:  # the eager function reads the module's own parameter
        extra["sinks"] = module.sinks
    if exchanged is not None:
        k, v = (t.to(q.dtype) for t in exchanged[:2])
        extra["kv_exchanged"] = exchanged[2]
    elif layout is not None and getattr(module, "store_full_length_kv", False) and state.shares_kv:
        k, v = state.engine.exchange_kv(k, v, q.shape[2], layout=layout)
        state.kv_shared[id(key0)] = (key0, value0, k, v)  # later layers attend with these
        extra["kv_exchanged"] = key.shape[1]
    kernel = module.__dict__.get("kernel_choice") or state.backend  # chosen once, looked up
    o = state.engine(
        q, k, v, layout=layout, causal=True, softmax_scale=scaling, backend=kernel, **extra
    )
    state.record(module)
    return o, None


def _exchanged_kv(state: _State, module: nn.Module, key: torch.Tensor, value: torch.Tensor):
    """``(k, v, K)`` (``[B, S, m, .]`` each, ``K`` the layer's kv heads) when the call's key and
    value are already exchanged: expanded from the gathered latent by the layer (``K = N``), or
    an earlier layer's (KV sharing: the same tensors that layer attended with); else ``None``."""
    if take_exchanged_kv(module, key, value):
        return key.transpose(1, 2), value.transpose(1, 2), int(module.num_heads)  # type: ignore[arg-type]
    shared = state.kv_shared.get(id(key))
    if shared is not None and shared[0] is key and shared[1] is value:
        return shared[2], shared[3], key.shape[1]
    return None


def _nope_scale(rows: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """Llama 4's attention temperature of the tokens at ``rows`` (float32)."""
    floor_scale, attn_scale = float(module.floor_scale), float(module.attn_scale)  # type: ignore[arg-type]
    return torch.log1p(torch.floor((rows.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def _global_temperature(
    module: nn.Module, query: torch.Tensor, layout: SeqLayout | None, group: dist.ProcessGroup
) -> torch.Tensor:
    """``q[B, N, s, H]`` scaled by the temperature of each token's row in the full sequence.

    Llama 4's layers without RoPE scale q by ``1 + attn_scale * log1p(floor((row + 1) /
    floor_scale))`` with ``row`` the index in the sequence it sees, ``0..s-1`` on a slice; the
    single-process model uses the row in the whole sequence, ``offset + 0..s-1``. The ratio of
    the two is applied here (exactly 1 on sp rank 0)."""
    me = dist.get_rank(group)
    if layout is None:
        raise UnsupportedModelError(
            f"{type(module).__name__}: the attention temperature needs the step's layout"
        )
    offset = layout.offset(me)
    if offset == 0:
        return query
    rows = torch.arange(query.shape[2], device=query.device)
    ratio = _nope_scale(rows + offset, module) / _nope_scale(rows, module)
    return (query * ratio.view(1, 1, -1, 1)).to(query.dtype)


def _without_blocks(state: _State, layout: SeqLayout) -> SeqLayout:
    """``layout`` without its bidirectional image blocks (Gemma 4's global layers), once per
    forward."""
    cached = state.causal_only
    if cached is not None and cached[0] is layout:
        return cached[1]
    plain = replace(layout, blocks=None, block_ids=None)
    state.causal_only = (layout, plain)
    return plain


def _chunk_layout(state: _State, layout: SeqLayout, chunk: int) -> SeqLayout:
    """``layout`` with each document cut into chunks of ``chunk`` tokens from its own start.

    transformers' chunked mask on packed documents counts chunks from each document's start
    (``masking_utils`` remaps positions to the position ids, which restart per document), not
    from the row's start; and a chunk is exactly a document of its own (no key outside it is
    visible). So a chunked layer with documents attends over these finer documents, with no
    chunk argument. Built once per forward and chunk size (device tensors included)."""
    key = chunk
    cached = state.chunked.get(key)
    if cached is not None and cached[0] is layout:
        return cached[1]
    assert layout.doc_starts is not None
    S = layout.seq_len
    rows = []
    for starts in layout.doc_starts:
        ends = [*starts[1:], S]
        rows.append(tuple(p for a, b in zip(starts, ends) for p in range(a, b, chunk)))
    device = layout.doc_tensors.doc_ids.device if layout.doc_tensors is not None else None
    finer = replace(layout, doc_starts=tuple(rows), doc_tensors=None)
    if device is not None:
        finer = with_doc_tensors(finer, device)
    state.chunked[key] = (layout, finer)
    return finer
