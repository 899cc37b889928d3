"""Per-rank functions for tests/hf/test_vision.py (spawned processes import them by module path),
and the tiny vision-language models and image + text rows they use (random init, no downloads).

Rows: ``G = 4`` rows of ``S = 30`` tokens (uneven over sp=4: [8, 8, 8, 6]), with one or two
images of different sizes each (4 or 8 image tokens: grids (1, 4, 4) and (1, 4, 8) patches,
merged 2 x 2), placed so that images span the sp cuts.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

VOCAB = 96
IMAGE, VIDEO, V_START, V_END = 90, 91, 92, 93
S, G = 30, 4
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            head_dim=8, rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1],
                                         "rope_theta": 10000.0})  # fmt: skip
# per row: (start of the image tokens, grid (t, h, w) in patches)
IMAGES = [
    [(3, (1, 4, 4))],  # 4 tokens
    [(2, (1, 4, 4)), (11, (1, 4, 8))],  # 4 + 8: the second spans the sp=2 / sp=4 cuts
    [(6, (1, 4, 8))],  # 8, spans sp=4's first cut
    [(4, (1, 4, 8)), (20, (1, 4, 4))],
]
FAMILIES = ("qwen2_5_vl", "qwen3_vl")


def make_config(family: str):
    import transformers as tf

    special = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=V_START,
                   vision_end_token_id=V_END)  # fmt: skip
    if family == "qwen2_5_vl":
        return tf.Qwen2_5_VLConfig(
            text_config=dict(TEXT), **special,
            vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2,
                               out_hidden_size=32, patch_size=2, spatial_merge_size=2,
                               temporal_patch_size=1, window_size=8, fullatt_block_indexes=[1],
                               in_channels=3),
        )  # fmt: skip
    if family == "qwen3_vl":
        return tf.Qwen3VLConfig(
            text_config=dict(TEXT), **special,
            vision_config=dict(depth=3, hidden_size=16, intermediate_size=32, num_heads=2,
                               out_hidden_size=32, patch_size=2, spatial_merge_size=2,
                               temporal_patch_size=1, in_channels=3,
                               num_position_embeddings=16, deepstack_visual_indexes=[0, 1]),
        )  # fmt: skip
    raise ValueError(family)


def make_model(family: str, seed: int = 0):
    """A random-init model of ``family``, every weight perturbed (norms and biases non-trivial)."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = make_config(family)
    cls = {"qwen2_5_vl": tf.Qwen2_5_VLForConditionalGeneration,
           "qwen3_vl": tf.Qwen3VLForConditionalGeneration}[family]  # fmt: skip
    model = cls(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def save_model(family: str, directory: Path, seed: int = 0) -> Path:
    make_model(family, seed).save_pretrained(directory)
    return directory


def load_model(directory: str, attn: str = "sdpa"):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32,
                                                       attn_implementation=attn)  # fmt: skip


def patch_dim(family: str) -> int:
    v = make_config(family).vision_config
    return int(v.in_channels * v.temporal_patch_size * v.patch_size**2)


def global_batch(family: str, seed: int = 1, rows: list | None = None) -> dict:
    """``G`` rows of ``S`` tokens with their images: input_ids, labels (-100 on image tokens),
    mm_token_type_ids, pixel_values (patches of every image, in row order), image_grid_thw."""
    g = torch.Generator().manual_seed(seed)
    rows = IMAGES if rows is None else rows
    ids = torch.randint(0, IMAGE, (len(rows), S), generator=g)
    types = torch.zeros_like(ids)
    grids, pixels = [], []
    for b, images in enumerate(rows):
        for start, (t, h, w) in images:
            n = t * h * w // 4
            ids[b, start - 1], ids[b, start + n] = V_START, V_END
            ids[b, start : start + n] = IMAGE
            types[b, start : start + n] = 1
            grids.append([t, h, w])
            pixels.append(torch.randn(t * h * w, patch_dim(family), generator=g))
    labels = ids.clone()
    labels[types == 1] = -100
    return {"input_ids": ids, "labels": labels, "mm_token_type_ids": types,
            "pixel_values": torch.cat(pixels), "image_grid_thw": torch.tensor(grids)}  # fmt: skip


def rows_of(batch: dict, lo: int, hi: int) -> dict:
    """Rows ``lo:hi`` of a batch, with their images' patches and grids."""
    grid = batch["image_grid_thw"]
    per_row = [
        (batch["input_ids"][b] == IMAGE).sum().item() for b in range(len(batch["input_ids"]))
    ]
    counts, k = [], 0
    for n in per_row:  # images per row, from their token counts in order
        c = 0
        while n > 0:
            n -= int(grid[k].prod()) // 4
            k, c = k + 1, c + 1
        counts.append(c)
    first, last = sum(counts[:lo]), sum(counts[:hi])
    patches = grid.prod(-1).tolist()
    p0, p1 = sum(patches[:first]), sum(patches[:last])
    out = {k: v[lo:hi] for k, v in batch.items() if k not in ("pixel_values", "image_grid_thw")}
    out["pixel_values"] = batch["pixel_values"][p0:p1]
    out["image_grid_thw"] = grid[first:last]
    return out


# ----------------------------------------------------------------------------------------------
# the vision split alone
# ----------------------------------------------------------------------------------------------
def flat_features(out) -> torch.Tensor:
    """``get_image_features``' output as one ``[R, C]`` tensor (deepstack features beside)."""
    parts = [torch.cat(list(out.pooler_output))]
    parts += [torch.cat(list(f)) for f in (getattr(out, "deepstack_features", None) or [])]
    return torch.cat(parts, dim=-1)


def split_reference(family: str, seed: int = 0, rows: list | None = None) -> dict:
    """The stock vision tower on one process: each image's features (and deepstack features),
    and the vision tower's gradients of ``sum(feats * weights)``."""
    model = make_model(family, seed)
    batch = global_batch(family, rows=rows)
    out = model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"],
                                         return_dict=True)  # fmt: skip
    feats = flat_features(out)
    weights = torch.randn(feats.shape, generator=torch.Generator().manual_seed(7))
    (feats * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.model.visual.named_parameters()}
    return {"feats": feats.detach(), "grads": grads, "grid": batch["image_grid_thw"].tolist()}


def split_check(
    rank: int, world: int, family: str, seed: int = 0, rows: list | None = None
) -> dict:
    """The split ``get_image_features`` on the world's group: each rank's loss takes its own
    rows of the gathered features (so the ranks' losses sum to the reference's), the vision
    gradients summed over ranks; the vision tower's calls (images it saw) and the collectives."""
    from dtensor_ulysses.comm import all_gather_seq_bytes
    from dtensor_ulysses.debug import CommCounter
    from dtensor_ulysses.hf.vision import assign_images, route_vision

    torch.set_num_threads(1)
    group = dist.group.WORLD
    model = make_model(family, seed)
    seen: list[list[int]] = []
    model.model.visual.register_forward_hook(
        lambda m, args, kwargs, out: seen.append(kwargs["grid_thw"].tolist()), with_kwargs=True
    )
    state = route_vision(model, group)
    batch = global_batch(family, rows=rows)
    with CommCounter() as fwd:
        out = model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
        feats = flat_features(out)
    weights = torch.randn(feats.shape, generator=torch.Generator().manual_seed(7))
    mine = (torch.arange(feats.shape[0]) % world == rank).unsqueeze(-1)
    with CommCounter() as bwd:
        (feats * weights * mine).sum().backward()
    grads = {}
    for n, p in model.model.visual.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        grads[n] = g
    grid = batch["image_grid_thw"]
    patches = grid.prod(-1).tolist()
    owner = assign_images(patches, world)
    shares = [sum(p // 4 for p, o in zip(patches, owner) if o == q) for q in range(world)]
    f_bytes, b_bytes = all_gather_seq_bytes(1, shares, feats.shape[1], 4)
    return {
        "feats": feats.detach(), "grads": grads, "seen": seen, "encoded": list(state.encoded),
        "owner": owner, "grid": grid.tolist(),
        "fwd": fwd.by_kind(), "bwd": bwd.by_kind(), "want_bytes": (f_bytes, b_bytes),
    }  # fmt: skip


def run_jobs(rank: int, world: int, jobs: list) -> list:
    """Several cases in one spawned world: ``(function name, args)`` each."""
    out = []
    for name, args in jobs:
        out.append(globals()[name](rank, world, *args))
        dist.barrier()
    return out
