"""A vision-language training step of the built-in model, as the memory tracer runs it.

The step ``du.hf`` runs for a vision-language model (:mod:`dtensor_ulysses.hf.models.vision`),
written on the built-in decoder so that the tracer can take it to any preset and world size:

1. **The vision split.** The step's ``n`` images are assigned to the ranks of the sp group by
   :func:`dtensor_ulysses.hf.models.vision.assign_images` (whole images, balanced by patch
   count: the rule ``du.hf`` uses); this rank encodes only its own images through
   :class:`VisionTower`.
2. **The gather.** The features of every image are all-gathered over the sp group with
   :func:`dtensor_ulysses.comm.all_gather_seq` (autograd: backward reduce-scatters the
   gradients back to the rank that encoded each image), then projected to the decoder's width.
3. **The merge.** The image tokens are the first ``R = sum(r_i)`` positions of the row (the
   images, in order, before the text); each rank adds the projected features of the image
   tokens in its own slice of the sequence to their token embeddings (the model's
   ``embed_fn=`` hook, :meth:`dtensor_ulysses.models.Transformer.forward`), and the decoder
   runs under Ulysses as for text; then the SFT loss (the global token mean), backward,
   clipping and AdamW (the decoder's optimizer and the tower's).

**The tower is an approximation** of a SigLIP / Qwen-VL vision encoder, built from the
library's own blocks: a linear patch embedding (``3 x 14 x 14`` pixel values per patch), ``L``
pre-norm blocks (:class:`~dtensor_ulysses.models.RMSNorm`, multi-head attention that is
bidirectional within each image and never crosses images, through the library's local kernel
:func:`~dtensor_ulysses.attention.local_attention` (flash-attn or SDPA's flash kernel: no
``r x r`` scores are kept), the SwiGLU
:class:`~dtensor_ulysses.models.FeedForward` of width ``4 D_v``), a final norm and a linear
projector to the decoder's width. It leaves out the position encoding (2-D RoPE or learned),
biases, LayerNorm for RMSNorm, SigLIP's GELU MLP for SwiGLU and Qwen-VL's 2 x 2 patch merger
(one feature row per patch here): the memory of a block is that of a ViT block of the same
width to within those small terms, and the split's saving (each image on one rank) is the
same. The tower is not checkpointed (its activations are kept for backward) and is sharded by
FSDP2 over the ``dp x sp`` ranks like the decoder.

Legend: ``n`` images, ``r_i`` patches (= feature rows) of image ``i``, ``R`` all the step's
patches, ``m`` this rank's patches, ``Q`` pixel values per patch, ``E`` the tower's width
``D_v``, ``D`` the decoder's width, ``B`` rows (1), ``s`` this rank's slice of the row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dtensor_ulysses.attention import local_attention
from dtensor_ulysses.comm import all_gather_seq
from dtensor_ulysses.data import Batch
from dtensor_ulysses.hf.models.vision import assign_images
from dtensor_ulysses.models import FeedForward, RMSNorm
from dtensor_ulysses.parallel import global_valid_tokens

__all__ = [
    "PATCH_VALUES",
    "VisionSpec",
    "VisionTower",
    "merge_features",
    "vl_step",
]

PATCH_VALUES = 3 * 14 * 14  # pixel values of one patch (RGB, 14 x 14: SigLIP's and Qwen-VL's)


@dataclass(frozen=True)
class VisionSpec:
    """The images of a vision-language step and the vision tower's shape.

    Attributes:
        images: images per row ``n`` (one row per dp rank).
        image_patches: patches per image ``r`` (every image alike; its feature rows).
        layers: the tower's blocks (SigLIP-so400m: 27; Qwen2.5-VL: 32).
        hidden: the tower's width ``D_v`` (SigLIP-so400m: 1152; Qwen2.5-VL: 1280).
        head_dim: the tower's head dim (heads: ``hidden // head_dim``).
    """

    images: int = 4
    image_patches: int = 1024
    layers: int = 4
    hidden: int = 1024
    head_dim: int = 64

    def __post_init__(self) -> None:
        for name in ("images", "image_patches", "layers", "hidden", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.hidden % self.head_dim:
            raise ValueError(
                f"hidden={self.hidden} must be a multiple of head_dim={self.head_dim} "
                f"(e.g. --vision-hidden {max(1, self.hidden // self.head_dim) * self.head_dim})"
            )

    @property
    def patches(self) -> list[int]:
        """Patches of each image, in image order."""
        return [self.image_patches] * self.images

    @property
    def image_tokens(self) -> int:
        """``R``: the row's image tokens (one per patch)."""
        return self.images * self.image_patches


class _VisionBlock(nn.Module):
    """Pre-norm ViT block: ``h + attn(norm(h))`` (bidirectional within each image), then
    ``h + ffn(norm(h))``."""

    def __init__(self, dim: int, head_dim: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = dim // head_dim, head_dim
        self.attention_norm = RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, 4 * dim)

    def forward(self, h_mE: torch.Tensor, patches: Sequence[int]) -> torch.Tensor:
        N, H = self.n_heads, self.head_dim
        qkv_1m3NH = self.wqkv(self.attention_norm(h_mE)).view(1, -1, 3, N, H)
        outs, lo = [], 0
        for r in patches:  # one image at a time: attention never crosses images
            q, k, v = (qkv_1m3NH[:, lo : lo + r, i] for i in range(3))  # [1, r, N, H]
            o_1rNH = local_attention(q, k, v, causal=False)  # saves o and its log-sum-exp
            outs.append(o_1rNH.reshape(r, -1))
            lo += r
        h_mE = h_mE + self.wo(torch.cat(outs))
        return h_mE + self.feed_forward(self.ffn_norm(h_mE).unsqueeze(0))[0]  # takes [B, s, E]


class VisionTower(nn.Module):
    """A ViT-like vision encoder and its projector (see the module docstring: an approximation
    of a SigLIP / Qwen-VL tower built from the library's blocks).

    Args:
        spec: the tower's shape.
        out_dim: the decoder's width ``D``.
    """

    def __init__(self, spec: VisionSpec, out_dim: int) -> None:
        super().__init__()
        E = spec.hidden
        self.patch_embed = nn.Linear(PATCH_VALUES, E, bias=False)
        self.layers = nn.ModuleList(_VisionBlock(E, spec.head_dim) for _ in range(spec.layers))
        self.norm = RMSNorm(E)
        self.projector = nn.Linear(E, out_dim, bias=False)

    def encode(self, pixels_mQ: torch.Tensor, patches: Sequence[int]) -> torch.Tensor:
        """Features ``[m, E]`` of the images ``pixels[m, Q]`` (``patches`` rows each, in order)."""
        h_mE = self.patch_embed(pixels_mQ)
        for block in self.layers:
            h_mE = block(h_mE, patches)
        return self.norm(h_mE)

    def forward(
        self,
        pixels: Sequence[torch.Tensor],
        group: dist.ProcessGroup | None = None,
    ) -> torch.Tensor:
        """Every image's projected features ``[R, D]``, each image encoded on one rank of
        ``group`` (the sp group; ``None``: this process encodes them all).

        Args:
            pixels: each image's pixel values ``[r_i, Q]`` (every rank holds the batch's images).
            group: the sp group.
        """
        P = dist.get_world_size(group) if group is not None else 1
        me = dist.get_rank(group) if group is not None else 0
        patches = [int(p.shape[0]) for p in pixels]
        owner = assign_images(patches, P)
        mine = [i for i, o in enumerate(owner) if o == me]
        if mine:
            x_mQ = torch.cat([pixels[i] for i in mine])
            feats_mE = self.encode(x_mQ, [patches[i] for i in mine])
        else:  # an empty share (still part of the collectives); every parameter gets a
            # zero gradient, as on the ranks that encode (FSDP2 reduces them all)
            tie = sum(p.sum() for p in self.parameters() if p.requires_grad)
            w = self.patch_embed.weight
            feats_mE = w.new_zeros(0, self.patch_embed.out_features) + 0 * tie
        if P > 1:
            sizes = [sum(patches[i] for i, o in enumerate(owner) if o == r) for r in range(P)]
            gathered_RE = all_gather_seq(feats_mE.unsqueeze(0), group, sizes)[0]  # type: ignore[arg-type]
            order = [i for r in range(P) for i, o in enumerate(owner) if o == r]
        else:
            gathered_RE, order = feats_mE, mine
        pieces, lo = {}, 0
        for i in order:  # back in image order
            pieces[i] = gathered_RE[lo : lo + patches[i]]
            lo += patches[i]
        return self.projector(torch.cat([pieces[i] for i in range(len(patches))]))


def merge_features(h_BsD: torch.Tensor, feats_RD: torch.Tensor, offset: int) -> torch.Tensor:
    """``h`` with the image features added at the image tokens of this slice: the row's
    positions ``[0, R)`` are image tokens, this slice starts at ``offset`` (host ints only: no
    data-dependent shape)."""
    R, s = feats_RD.shape[0], h_BsD.shape[1]
    k = max(0, min(s, R - offset))
    if k == 0:
        return h_BsD
    add_BkD = feats_RD[offset : offset + k].to(h_BsD.dtype).unsqueeze(0)
    return torch.cat([h_BsD[:, :k] + add_BkD, h_BsD[:, k:]], dim=1)


def vl_step(
    policy: nn.Module,
    tower: nn.Module,
    batch: Batch,
    pixels: Sequence[torch.Tensor],
    optimizers: Sequence[torch.optim.Optimizer],
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    sp_group: dist.ProcessGroup | None = None,
    sp_rank: int = 0,
    group: dist.ProcessGroup | None = None,
    grad_clip: float = 1.0,
) -> float:
    """One vision-language SFT step on this rank's slice ``batch`` (see the module docstring).

    Args:
        policy: the decoder (built-in model).
        tower: the :class:`VisionTower` (possibly FSDP2-sharded).
        batch: this rank's slice of the row (micro-batch 1); its first ``R`` global positions
            are the image tokens.
        pixels: each image's pixel values ``[r_i, Q]``.
        optimizers: the decoder's and the tower's optimizers (stepped in order).
        scheduler: the decoder's schedule.
        sp_group: the sp group (``None``: one process encodes every image).
        sp_rank: this rank's index in the sp group (its slice's offset in the row).
        group: the ``dp x sp`` ranks (the valid-token count).
        grad_clip: clip the norm of every gradient (decoder and tower) to this; 0: off.

    Returns:
        This rank's loss term (its share of the global token mean).

    Raises:
        ValueError: the images' tokens do not fit in the row.
    """
    S = batch.layout.seq_len
    R = sum(int(p.shape[0]) for p in pixels)
    if R > S:
        raise ValueError(
            f"{len(pixels)} images of {R} patches in all do not fit a row of {S} tokens: "
            f"raise --seq-len to at least {R} or pass fewer --images / --image-patches"
        )
    if batch.input_ids.shape[0] != 1:
        raise ValueError(
            f"the vision-language step takes one row per rank, got {batch.input_ids.shape[0]}"
        )
    offset = sum(batch.layout.seq_sizes[:sp_rank])
    feats_RD = tower(pixels, sp_group)
    local_sum = policy(
        batch.input_ids, batch.position_ids, layout=batch.layout, labels=batch.labels,
        embed_fn=lambda h: merge_features(h, feats_RD, offset),
    )  # fmt: skip
    n_valid = global_valid_tokens(batch.labels, group)
    loss = local_sum / n_valid
    loss.backward()
    if grad_clip > 0:
        params = [*policy.parameters(), *tower.parameters()]
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    for opt in optimizers:
        opt.step()
    scheduler.step()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    return float(loss.detach())
