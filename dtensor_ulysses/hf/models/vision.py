"""Vision-language models under Ulysses: the vision work split over sp, the decoder sliced after
the merge.

Legend: ``P`` ranks of the sp group, ``n`` images of the batch (every rank of an sp group holds
the same rows, so the same images), ``r_i`` feature rows of image ``i`` (its merged patches: the
tokens it fills in the sequence), ``R = sum(r_i)``, ``C`` feature channels (every feature kind
of the family side by side: Qwen3-VL's deepstack features beside the main ones), ``B`` rows,
``S`` full length, ``s`` this rank's slice, ``D`` hidden size.

**The vision split** (:func:`encode_split`, any family's vision tower). The images are assigned
to the ranks of the sp group by :func:`assign_images` (whole images, balanced by patch count,
deterministic: every rank computes the same assignment from the batch, no collective); each
rank encodes only its own images, in one call of the vision tower, then

    feats[R_me, C] on each rank  --all-gather (padded to the largest share)-->  feats[R, C]

on every rank, put back in image order. Backward is the adjoint: one reduce-scatter sums, over
the sp ranks, the gradient each rank's slice of the sequence gives every image's features, and
hands each image's sum to the rank that encoded it. Collectives per step: forward one
``all_gather`` of ``m*C`` elements per rank (``m`` the largest share's rows), backward one
``reduce_scatter`` of ``P*m*C`` (:func:`~dtensor_ulysses.comm.all_gather_seq_bytes` with
``B = 1``). A rank with no image of its own still takes part in both, with an empty share, and
its vision parameters get zero gradients (FSDP2 reduces the same parameters on every rank).
Compared with encoding every image on every rank (what verl, prime-rl and ms-swift do), the
vision tower's compute and activation memory per rank fall to about ``1/P``.

**The decoder** (:func:`route_vision`, called by :func:`~dtensor_ulysses.hf.apply_ulysses` for
a vision-language model): the model is called on the *full* rows (``input_ids[B, S]``, its
images, ``ulysses_layout=`` of the batch, as :func:`vision_model_inputs` builds them). Its own
forward embeds the full rows (cheap), merges the gathered image features and computes the
M-RoPE position ids over the full rows (``get_rope_index``); a pre-hook on the language model
then keeps this rank's slice of the embeddings, of the position ids (every row of them: 3 for
M-RoPE, 4 with text positions), of the visual-token mask and of the deepstack features (the
image tokens in the slice), and the decoder layers run under Ulysses as for text. Where the
layout is padded (rows whose cut would leave a rank no token,
:func:`~dtensor_ulysses.hf.shard_batch`), the merged embeddings get the same padding columns
(zeros, positions continuing, never attended to by a real token) after the merge, so the
images and the M-RoPE positions are the stock model's. The vision
tower's own attention stays local (bidirectional, per image, on whole images) and keeps its
implementation; only the text config's attention goes through the engine.

Families: Qwen2.5-VL and Qwen3-VL (images, and videos split the same way: each video whole on
one rank, with all its frames), Gemma 3 (fixed-size SigLIP images) and Gemma 4 (images of any
size; per-layer input embeddings sliced with the embeddings). Gemma's bidirectional image
blocks come from its token types (:mod:`~dtensor_ulysses.hf.models.image_blocks`). Refused in one
line: Gemma's video inputs, Gemma 4's audio inputs, and vision towers this module has no
adapter for (:func:`vision_family`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtensor_ulysses.comm import all_gather_seq
from dtensor_ulysses.plan.splits import SeqLayout, padded_seq_len, seq_split

__all__ = [
    "VIDEO_KEYS",
    "VISION_KEYS",
    "VisionSplitState",
    "assign_images",
    "encode_split",
    "is_vision_language",
    "language_model",
    "refuse_video",
    "route_vision",
    "vision_family",
    "vision_model_inputs",
    "whole_rows",
]

# batch keys of the image inputs the model takes whole (never cut into sequence slices)
VISION_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "mm_token_type_ids",
    "token_type_ids",
    "image_position_ids",
)
# batch keys of video inputs (split like images by the families in _VIDEO_ADAPTERS)
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
_STATE = "_du_vision_state"
# model_type -> what the split needs to know of the family's vision tower
_FAMILIES = {"qwen2_5_vl": "qwen", "qwen3_vl": "qwen", "gemma3": "gemma3", "gemma4": "gemma4"}


def assign_images(costs: Sequence[int], P: int, load: list[int] | None = None) -> tuple[int, ...]:
    """The rank that encodes each image: the largest first (ties: the first), each to the rank
    with the least work so far (ties: the lowest rank). Deterministic, so every rank of a group
    computes the same assignment from the same batch.

    Args:
        costs: the work of each image (its patches), in image order.
        P: ranks in the group.
        load: each rank's work so far (the same step's images, before its videos); updated in
            place. Default: none.

    Returns:
        ``owner[i]`` for each image ``i``.
    """
    if P < 1:
        raise ValueError(f"assign_images needs P >= 1 ranks, got {P}")
    load = [0] * P if load is None else load
    if len(load) != P:
        raise ValueError(f"load has {len(load)} entries for P={P} ranks")
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-int(costs[i]), i)):
        r = min(range(P), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += int(costs[i])
    return tuple(owner)


def encode_split(
    encode: Callable[[list[int]], torch.Tensor],
    rows: Sequence[int],
    costs: Sequence[int],
    group: dist.ProcessGroup,
    channels: int,
    dtype: torch.dtype,
    device: torch.device,
    zero_grad_params: Callable[[], Sequence[torch.Tensor]] | None = None,
    load: list[int] | None = None,
) -> torch.Tensor:
    """Every image's features on every rank of ``group``, each image encoded on one rank.

    Args:
        encode: ``encode(indices) -> feats[sum(rows[i] for i in indices), channels]``: the
            features of those images (in that order) from one call of the vision tower; called
            once, and only when this rank owns an image.
        rows: feature rows of each image (``r_i``), known on every rank before encoding.
        costs: each image's work for :func:`assign_images` (its patches).
        group: the sp group (its ranks hold the same images).
        channels: feature channels (the same on every rank; a rank with no image needs them
            for its empty share).
        dtype: the features' dtype (every rank's share is cast to it).
        device: where a rank with no image allocates its empty share.
        zero_grad_params: on a rank with no image, the vision tower's parameters, tied to the
            result with weight 0 so that they get (zero) gradients as on the other ranks.
        load: each rank's work so far in this step (see :func:`assign_images`; updated).

    Returns:
        ``feats[R, channels]`` in image order, differentiable (the gradient of each image's
        rows flows back to the rank that encoded it, summed over the group's ranks).
    """
    P, me = dist.get_world_size(group), dist.get_rank(group)
    owner = assign_images(costs, P, load)
    mine = [i for i, r in enumerate(owner) if r == me]
    if mine:
        local = encode(mine).to(dtype)
        want = (sum(rows[i] for i in mine), channels)
        if tuple(local.shape) != want:
            raise ValueError(
                f"the vision tower gave features of shape {tuple(local.shape)} for images "
                f"{mine}, expected {want} (rows per image {[rows[i] for i in mine]})"
            )
    else:
        local = torch.zeros(0, channels, dtype=dtype, device=device)
        if zero_grad_params is not None:
            tie = sum((p.reshape(-1)[:1].sum() for p in zero_grad_params()), local.new_zeros(()))
            local = local + 0.0 * tie
    shares = [sum(rows[i] for i, r in enumerate(owner) if r == q) for q in range(P)]
    gathered = all_gather_seq(local.unsqueeze(0), group, shares)[0]  # rank order
    # rank order -> image order
    start, at = [0] * len(rows), 0
    for q in range(P):
        for i, r in enumerate(owner):
            if r == q:
                start[i], at = at, at + rows[i]
    if all(start[i] == sum(rows[:i]) for i in range(len(rows))):
        return gathered
    index = torch.cat([torch.arange(start[i], start[i] + rows[i]) for i in range(len(rows))])
    return gathered.index_select(0, index.to(gathered.device))


# ----------------------------------------------------------------------------------------------
# families
# ----------------------------------------------------------------------------------------------
def is_vision_language(model: nn.Module) -> bool:
    """Whether a transformers model has a vision tower beside its language model (a
    ``vision_config`` and a ``language_model`` under its base model)."""
    cfg = getattr(model, "config", None)
    base = getattr(model, "base_model", model)
    return getattr(cfg, "vision_config", None) is not None and isinstance(
        getattr(base, "language_model", None), nn.Module
    )


def language_model(model: Any) -> tuple[str, Any]:
    """``(name, module)``: the text decoder of a vision-language model
    (``model.language_model``), or the base model of a text model."""
    base = getattr(model, "base_model", model)
    prefix = getattr(model, "base_model_prefix", "") if base is not model else ""
    if is_vision_language(model):
        return (f"{prefix}.language_model" if prefix else "language_model"), base.language_model
    return prefix, base


def vision_family(model: nn.Module) -> str:
    """The adapter this module has for the model's vision tower (``"qwen"``).

    Raises:
        ValueError: a vision-language family without one (named, with the supported ones).
    """
    mt = getattr(model.config, "model_type", "?")
    fam = _FAMILIES.get(mt)
    if fam is None:
        raise ValueError(
            f"{type(model).__name__} (model_type {mt!r}): its vision tower has no adapter for "
            f"the split over sp; supported vision-language families: {sorted(_FAMILIES)}"
        )
    return fam


@dataclass(eq=False)
class VisionSplitState:
    """What :func:`route_vision` installed on a vision-language model.

    Attributes:
        group: the sp group.
        encoded: the indices of the images this rank encoded in the last forward.
        calls: vision tower calls made by the split (one per forward with an image of its own).
        plain: inside :func:`whole_rows` (generation on whole rows, one rank at a time): the
            decoder takes the full rows.
    """

    group: dist.ProcessGroup
    encoded: list[int] = field(default_factory=list)
    calls: int = 0
    plain: bool = False
    hooks: list = field(default_factory=list)
    load: list[int] = field(default_factory=list)  # this forward's work per rank (images first)


def _unsupported(msg: str) -> Exception:
    # routing's UnsupportedModelError sits above this module; a ValueError with its wording
    return ValueError(msg)


def _qwen_image_features(
    base: Any, state: VisionSplitState, kind: str = "image"
) -> Callable[..., Any]:
    """The split ``get_image_features`` of Qwen2.5-VL / Qwen3-VL: ``pixel_values[sum(t*h*w),
    patch]`` (patches of every image, concatenated) and ``image_grid_thw[n, 3]``; with
    ``kind="video"`` the split ``get_video_features`` (``pixel_values_videos``,
    ``video_grid_thw``: each video whole on one rank, all its frames). Both encode with the
    class's own ``get_image_features`` (the same tower call; Qwen3-VL's videos go through it)."""
    original = type(base).get_image_features.__get__(base)
    if kind not in ("image", "video"):
        raise ValueError(f"kind must be 'image' or 'video', got {kind!r}")
    visual: Any = base.visual
    merge = int(visual.spatial_merge_size)
    n_deep = len(getattr(visual, "deepstack_visual_indexes", None) or [])
    width = int(visual.config.out_hidden_size)
    module = inspect.getmodule(type(base))
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    out_cls = getattr(module, "BaseModelOutputWithDeepstackFeatures", BaseModelOutputWithPooling)

    def get_image_features(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                           **kwargs: Any) -> Any:  # fmt: skip
        kwargs.pop("ulysses_layout", None)
        kwargs["return_dict"] = True
        patches = [int(p) for p in image_grid_thw.prod(-1).tolist()]
        rows = [p // merge**2 for p in patches]
        if sum(patches) != pixel_values.shape[0]:
            raise ValueError(
                f"pixel_values has {pixel_values.shape[0]} patch rows but image_grid_thw gives "
                f"{sum(patches)} ({patches} per image)"
            )
        starts = [sum(patches[:i]) for i in range(len(patches))]

        def encode(idx: list[int]) -> torch.Tensor:
            pv = torch.cat([pixel_values[starts[i] : starts[i] + patches[i]] for i in idx])
            grid = image_grid_thw[torch.tensor(idx, device=image_grid_thw.device)]
            out = original(pv, grid, **kwargs)
            state.calls += 1
            state.encoded = list(idx)
            feats = [torch.cat(list(out.pooler_output))]
            feats += [torch.cat(list(f)) for f in (getattr(out, "deepstack_features", None) or [])]
            return torch.cat(feats, dim=-1)

        state.encoded = []
        dev = pixel_values.device.type
        dtype = (torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev)
                 else next(visual.parameters()).dtype)  # fmt: skip
        P = dist.get_world_size(state.group)
        if kind == "image" or len(state.load) != P:  # a step's videos go where its images left room
            state.load = [0] * P
        feats = encode_split(encode, rows, patches, state.group, width * (1 + n_deep), dtype,
                             pixel_values.device, lambda: list(visual.parameters()),
                             load=state.load)  # fmt: skip
        parts = feats.split(width, dim=-1)
        per_image = [tuple(p.split(rows)) for p in parts]
        out = out_cls(pooler_output=per_image[0])  # type: ignore[arg-type]
        if n_deep:
            out.deepstack_features = per_image[1:]
        return out

    return get_image_features


def _gemma3_image_features(base: Any, state: VisionSplitState) -> Callable[..., Any]:
    """The split ``get_image_features`` of Gemma 3: ``pixel_values[n, 3, H, W]`` (fixed-size
    images), each image ``mm_tokens_per_image`` feature rows (SigLIP, then the projector)."""
    original = type(base).get_image_features.__get__(base)
    rows = int(base.config.mm_tokens_per_image)
    width = int(base.config.get_text_config().hidden_size)
    towers = (base.vision_tower, base.multi_modal_projector)
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    def get_image_features(pixel_values: torch.Tensor, **kwargs: Any) -> Any:
        kwargs.pop("ulysses_layout", None)
        kwargs["return_dict"] = True
        n = int(pixel_values.shape[0])

        def encode(idx: list[int]) -> torch.Tensor:
            out = original(pixel_values[torch.tensor(idx, device=pixel_values.device)], **kwargs)
            state.calls += 1
            state.encoded = list(idx)
            return out.pooler_output.reshape(-1, width)

        state.encoded = []
        dev = pixel_values.device.type
        dtype = (torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev)
                 else next(base.vision_tower.parameters()).dtype)  # fmt: skip
        patches = int(pixel_values[0].numel())  # every image the same size: an even split
        feats = encode_split(encode, [rows] * n, [patches] * n, state.group, width, dtype,
                             pixel_values.device,
                             lambda: [p for t in towers for p in t.parameters()])  # fmt: skip
        return BaseModelOutputWithPooling(pooler_output=feats.view(n, rows, width))

    return get_image_features


def _gemma4_image_features(base: Any, state: VisionSplitState) -> Callable[..., Any]:
    """The split ``get_image_features`` of Gemma 4: ``pixel_values[n, p, 3 * patch**2]`` padded
    to ``p`` patches and ``image_position_ids[n, p, 2]`` (``-1``: padding); image ``i`` gives
    its real patches over ``pooling_kernel_size**2`` feature rows (images of any size)."""
    original = type(base).get_image_features.__get__(base)
    width = int(base.config.get_text_config().hidden_size)
    pool = int(base.config.vision_config.pooling_kernel_size) ** 2
    towers = (base.vision_tower, base.embed_vision)
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    def get_image_features(pixel_values: torch.Tensor, image_position_ids: Any = None,
                           **kwargs: Any) -> Any:  # fmt: skip
        kwargs.pop("ulysses_layout", None)
        kwargs["return_dict"] = True
        if image_position_ids is None:
            raise ValueError("Gemma 4's images need image_position_ids (the image processor's)")
        patches = [int(n) for n in (image_position_ids != -1).all(-1).sum(-1).tolist()]
        rows = [n // pool for n in patches]

        def encode(idx: list[int]) -> torch.Tensor:
            sel = torch.tensor(idx, device=pixel_values.device)
            out = original(pixel_values[sel], image_position_ids[sel], **kwargs)
            state.calls += 1
            state.encoded = list(idx)
            return torch.cat(list(out.pooler_output))

        state.encoded = []
        dev = pixel_values.device.type
        dtype = (torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev)
                 else next(base.vision_tower.parameters()).dtype)  # fmt: skip
        feats = encode_split(encode, rows, patches, state.group, width, dtype,
                             pixel_values.device,
                             lambda: [p for t in towers for p in t.parameters()])  # fmt: skip
        per_image: Any = tuple(feats.split(rows))  # what the stock method returns: a tuple
        return BaseModelOutputWithPooling(pooler_output=per_image)

    return get_image_features


# family -> the factory of its split ``get_image_features(pixel_values, ...)`` (built on
# :func:`encode_split`; a family's adapter says how to cut its inputs per image, how many
# feature rows each image gives, and how to rebuild the output its model's forward reads)
_ADAPTERS: dict[str, Callable[[Any, VisionSplitState], Callable[..., Any]]] = {
    "qwen": _qwen_image_features,
    "gemma3": _gemma3_image_features,
    "gemma4": _gemma4_image_features,
}


def _no_audio(*args: Any, **kwargs: Any) -> Any:
    raise _unsupported(
        "audio inputs (input_features) are not supported under Ulysses yet: the audio tower "
        "has no split over sp; train on image + text rows"
    )


# family -> its split ``get_video_features`` (families without one refuse video inputs)
_VIDEO_ADAPTERS: dict[str, Callable[[Any, VisionSplitState], Callable[..., Any]]] = {
    "qwen": lambda base, state: _qwen_image_features(base, state, "video"),
}


def _no_video(*args: Any, **kwargs: Any) -> Any:
    raise _unsupported(
        "video inputs (pixel_values_videos) are not supported under Ulysses yet: pass images, "
        "or frames as images"
    )


# ----------------------------------------------------------------------------------------------
# the decoder: full rows in, this rank's slice to the language model
# ----------------------------------------------------------------------------------------------
def _slice_pre_forward(lm: nn.Module, args: tuple, kwargs: dict, params: list[str]):
    state: VisionSplitState = lm.__dict__[_STATE]
    if state.plain:
        return None
    kwargs = dict(kwargs)
    for name, value in zip(params, args):
        kwargs[name] = value
    x = kwargs.get("inputs_embeds")
    if x is None:
        raise ValueError(
            "the language model of a vision-language model under Ulysses takes inputs_embeds of "
            "the full rows (call the whole model with input_ids)"
        )
    B, S = int(x.shape[0]), int(x.shape[1])
    P, me = dist.get_world_size(state.group), dist.get_rank(state.group)
    layout: SeqLayout | None = kwargs.get("ulysses_layout")
    mask = kwargs.pop("attention_mask", None)
    if layout is None:
        if isinstance(mask, torch.Tensor) and not bool(mask.all()):  # Gemma: a dict of masks
            raise ValueError(
                "an attention_mask with padding needs the batch's layout: pass the rows through "
                "du.hf.shard_batch and call the model with ulysses_layout=sb.layout "
                "(du.hf.vision_model_inputs builds the call)"
            )
        layout = SeqLayout(tuple(seq_split(padded_seq_len(S, P), P)))
    if layout.ring != 1 or layout.sp != P or layout.seq_len not in (S, padded_seq_len(S, P)):
        raise ValueError(
            f"a vision-language model takes the full rows: ulysses_layout covers "
            f"{layout.seq_len} tokens over sp={layout.sp} (ring {layout.ring}), the rows have "
            f"{S} on sp={P}"
        )
    extra = layout.seq_len - S  # shard_batch's padding columns (no rank left empty)
    lo, n = layout.offset(me), layout.seq_sizes[me]
    kwargs["inputs_embeds"] = _pad_seq(x, extra)[:, lo : lo + n]
    pos = kwargs.get("position_ids")
    if pos is None:  # what the text model infers from the full rows
        pos = torch.arange(S, device=x.device).expand(B, S)
    if extra:  # each row of positions (M-RoPE's 3 or 4) continues
        tail = torch.arange(1, extra + 1, device=pos.device, dtype=pos.dtype)
        more = tail - 1 if S == 0 else pos[..., -1:] + tail
        pos = torch.cat([pos, more.expand(*pos.shape[:-1], extra)], -1)
    kwargs["position_ids"] = pos[..., lo : lo + n]
    vis = kwargs.get("visual_pos_masks")
    if vis is not None:
        vis = _pad_seq(vis, extra)
        keep = torch.zeros_like(vis)
        keep[:, lo : lo + n] = True
        sel = keep[vis]  # which of the visual tokens (row-major) are in the slice
        kwargs["visual_pos_masks"] = vis[:, lo : lo + n]
        deep = kwargs.get("deepstack_visual_embeds")
        if deep is not None:
            kwargs["deepstack_visual_embeds"] = [d[sel] for d in deep]
    per_layer = kwargs.get("per_layer_inputs")  # Gemma 4's per-layer token embeddings
    if per_layer is not None:
        kwargs["per_layer_inputs"] = _pad_seq(per_layer, extra)[:, lo : lo + n]
    kwargs["ulysses_layout"] = layout
    state.load = []  # the step's vision work is done: the next one starts from no load
    return (), kwargs


def _pad_seq(x_BS: torch.Tensor, extra: int) -> torch.Tensor:
    """``x[B, S, ...]`` with ``extra`` zero (``False``) rows appended along ``S``."""
    if not extra:
        return x_BS
    return torch.cat([x_BS, x_BS.new_zeros((x_BS.shape[0], extra, *x_BS.shape[2:]))], 1)


def route_vision(model: Any, group: dist.ProcessGroup) -> VisionSplitState:
    """Install the vision split and the decoder's slicing on a vision-language model (see the
    module docstring); idempotent (a second call replaces the first).

    Raises:
        ValueError: a family without an adapter (:func:`vision_family`).
    """
    family = vision_family(model)
    base = model.base_model
    _, lm = language_model(model)
    old: VisionSplitState | None = lm.__dict__.get(_STATE)
    if old is not None:
        for h in old.hooks:
            h.remove()
    state = VisionSplitState(group)
    base.get_image_features = _ADAPTERS[family](base, state)
    video = _VIDEO_ADAPTERS.get(family)
    base.get_video_features = _no_video if video is None else video(base, state)
    if hasattr(type(base), "get_audio_features"):  # Gemma 4
        base.get_audio_features = _no_audio
    params = list(inspect.signature(lm.forward).parameters)
    state.hooks = [
        lm.register_forward_pre_hook(
            lambda mod, args, kwargs: _slice_pre_forward(mod, args, kwargs, params),
            with_kwargs=True,
            prepend=True,
        )
    ]
    lm.__dict__[_STATE] = state
    base.__dict__[_STATE] = state
    return state


@contextlib.contextmanager
def whole_rows(model: Any) -> Iterator[bool]:
    """While inside, a model :func:`route_vision` prepared runs as it did before: its class's
    image / video / audio features (every image of a call encoded here) and its decoder on the
    full rows, with no collective (generation, one rank at a time). Yields whether the model
    was routed."""
    base = getattr(model, "base_model", model)
    state: VisionSplitState | None = base.__dict__.get(_STATE)
    if state is None:
        yield False
        return
    names = ("get_image_features", "get_video_features", "get_audio_features")
    split = {k: base.__dict__.pop(k) for k in names if k in base.__dict__}
    state.plain = True
    try:
        yield True
    finally:
        state.plain = False
        base.__dict__.update(split)


def refuse_video(batch: Mapping[str, Any], model: Any) -> None:
    """Video inputs for a family whose videos are not split (every family but Qwen2.5-VL /
    Qwen3-VL): a ``ValueError`` naming the keys found in ``batch``."""
    videos = [k for k in VIDEO_KEYS if batch.get(k) is not None]
    if videos and vision_family(model) not in _VIDEO_ADAPTERS:
        raise _unsupported(
            f"video inputs ({', '.join(videos)}) are not supported under Ulysses yet: pass "
            f"images, or frames as images"
        )


def vision_model_inputs(batch: Mapping[str, Any], sharded: Any) -> dict[str, Any]:
    """Keyword arguments for a vision-language model prepared by ``apply_ulysses``: the full
    rows (``input_ids``, ``attention_mask`` for the M-RoPE positions, ``position_ids`` if
    given), the image and video inputs (:data:`VISION_KEYS`) and ``ulysses_layout`` of
    ``sharded`` (the :func:`~dtensor_ulysses.hf.shard_batch` of ``batch``); the loss uses
    ``sharded.labels``. A family whose videos are not split refuses video inputs in its
    forward."""
    out: dict[str, Any] = {"input_ids": batch["input_ids"], "ulysses_layout": sharded.layout}
    for key in ("attention_mask", "position_ids", *VISION_KEYS, *VIDEO_KEYS):
        if batch.get(key) is not None:
            out[key] = batch[key]
    return out
