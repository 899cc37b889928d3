"""Per-rank functions for tests/hf/test_vision.py (spawned processes import them by module path),
and the tiny vision-language models and image + text rows they use (random init, no downloads).

Rows: ``G = 4`` rows of ``S = 30`` tokens (uneven over sp=4: [8, 8, 8, 6]), with one or two
images of different sizes each (4, 8 or 12 image tokens: grids of (1, 4, 4) to (1, 8, 6)
patches, merged 2 x 2), placed so that images span the sp cuts.
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
# per row: (start of the image tokens, grid (t, h, w) in patches); every row has 12 image
# tokens (so the same number of targets: any split of the rows over dp ranks gives equal
# halves), in one or two images of different sizes that span the sp cuts
IMAGES = [
    [(3, (1, 4, 12))],  # 12 tokens
    [(2, (1, 4, 4)), (11, (1, 4, 8))],  # 4 + 8
    [(6, (1, 8, 6))],  # 12, another shape
    [(4, (1, 4, 8)), (20, (1, 4, 4))],  # 8 + 4
]
FAMILIES = ("qwen2_5_vl", "qwen3_vl")
# a row with an image and a video (2 frames), a row with a longer video: Qwen's videos are split
# like its images (each video whole on one rank)
VIDEO_ROWS = [
    [(3, (1, 4, 8)), (16, (2, 4, 4), "video")],
    [(5, (2, 4, 8), "video")],
]


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
    vgrids, vpixels = [], []
    for b, images in enumerate(rows):
        for start, (t, h, w), *kind in images:
            n = t * h * w // 4
            video = kind == ["video"]
            # Qwen3-VL: each frame its own group (a timestamp token between frames)
            frames = t if video and family == "qwen3_vl" else 1
            at = start
            for _ in range(frames):
                k = n // frames
                ids[b, at - 1], ids[b, at + k] = V_START, V_END
                ids[b, at : at + k] = VIDEO if video else IMAGE
                types[b, at : at + k] = 2 if video else 1
                at += k + 3  # V_END, a timestamp token, V_START
            (vgrids if video else grids).append([t, h, w])
            patches = torch.randn(t * h * w, patch_dim(family), generator=g)
            (vpixels if video else pixels).append(patches)
    labels = ids.clone()
    labels[types != 0] = -100
    out = {"input_ids": ids, "labels": labels, "mm_token_type_ids": types}
    if grids:
        out.update(pixel_values=torch.cat(pixels), image_grid_thw=torch.tensor(grids))
    if vgrids:
        out.update(pixel_values_videos=torch.cat(vpixels), video_grid_thw=torch.tensor(vgrids))
    return out


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
    from dtensor_ulysses.hf.models.vision import assign_images, route_vision

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


# ----------------------------------------------------------------------------------------------
# the whole model: apply_ulysses / parallelize + shard_batch
# ----------------------------------------------------------------------------------------------
def model_reference(family: str, seed: int = 0, rows: list | None = None) -> dict:
    """The stock model on one process: its own loss (token mean) on the global batch, and
    every gradient."""
    torch.set_num_threads(1)
    model = make_model(family, seed)
    batch = global_batch(family, rows=rows)
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.item(), "grads": grads}


def model_check(rank: int, world: int, family: str, dp: int, sp: int, seed: int = 0,
                rows: list | None = None) -> dict:  # fmt: skip
    """``parallelize`` (Ulysses + FSDP2) and ``shard_batch`` on this dp rank's rows: the global
    loss, every full gradient, and the images the vision tower saw on each rank."""
    from torch.distributed.tensor import DTensor

    from dtensor_ulysses import hf
    from dtensor_ulysses.hf.models.vision import vision_model_inputs
    from dtensor_ulysses.models import cross_entropy_sum
    from dtensor_ulysses.parallel import flatten_dp_sp, init_mesh

    torch.set_num_threads(1)
    mesh = init_mesh(dp, sp, device_type="cpu")
    model = make_model(family, seed)
    seen: list[list[int]] = []
    model.model.visual.register_forward_hook(
        lambda m, args, kwargs, out: seen.append(kwargs["grid_thw"].tolist()), with_kwargs=True
    )
    hf.parallelize(model, mesh)
    batch = global_batch(family, rows=rows)
    b = len(batch["input_ids"]) // dp
    lo = mesh.get_local_rank("dp") * b
    mine = batch if dp == 1 else rows_of(batch, lo, lo + b)
    sb = hf.shard_batch(mine, mesh)
    out = model(**vision_model_inputs(mine, sb))
    local = cross_entropy_sum(out.logits, sb.labels) / sb.n_valid
    local.backward()
    total = local.detach().clone()
    dist.all_reduce(total, group=flatten_dp_sp(mesh).get_group())
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad
        grads[n] = (g.full_tensor() if isinstance(g, DTensor) else g).clone()
    images = mine["image_grid_thw"].tolist() + mine.get("video_grid_thw", torch.zeros(0)).tolist()
    return {"loss": total.item(), "grads": grads, "seen": seen, "images": images,
            "dp_rank": mesh.get_local_rank("dp")}  # fmt: skip


# ----------------------------------------------------------------------------------------------
# the Trainer door
# ----------------------------------------------------------------------------------------------
class RowsDataset(torch.utils.data.Dataset):
    """The global batch's rows, one example each (its own images)."""

    def __init__(self, family: str, copies: int = 2):
        batch = global_batch(family)
        n = len(batch["input_ids"])
        self.rows = [rows_of(batch, i, i + 1) for i in range(n)] * copies

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def collate(rows: list) -> dict:
    """Rows stacked, images concatenated in row order (what a Qwen-VL processor gives)."""
    out = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
    return out


def trainer_run(rank: int, world: int, model_dir: str, out_dir: str, sp: int | None,
                batch: int, steps: int = 2) -> dict:  # fmt: skip
    """``transformers.Trainer`` (``sp`` None: the stock class) on the image + text rows: the
    logged losses and gradient norms, and the images the vision tower saw."""
    import os

    import transformers as tf

    from dtensor_ulysses.hf import with_ulysses

    # the group is up already (launch.run_local_world); accelerate still reads these
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29513")
    torch.set_num_threads(1)
    model = load_model(model_dir)
    family = model.config.model_type
    seen: list = []  # (step, image grids) of each vision tower call
    held: dict = {}
    model.model.visual.register_forward_hook(
        lambda m, args, kwargs, out: seen.append(
            (held["trainer"].state.global_step, kwargs["grid_thw"].tolist())
        ),
        with_kwargs=True,
    )
    args = tf.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=batch, max_steps=steps,
        learning_rate=1e-2, logging_steps=1, max_grad_norm=1.0, lr_scheduler_type="linear",
        weight_decay=0.1, seed=0, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, dataloader_drop_last=True, remove_unused_columns=False,
    )  # fmt: skip
    cls = tf.Trainer if sp is None else with_ulysses(tf.Trainer, sp)
    torch.manual_seed(0)
    trainer = cls(model=model, args=args, train_dataset=RowsDataset(family),
                  data_collator=collate)  # fmt: skip
    held["trainer"] = trainer
    trainer.train()
    h = trainer.state.log_history
    return {"loss": [e["loss"] for e in h if "loss" in e],
            "grad_norm": [e["grad_norm"] for e in h if "grad_norm" in e], "seen": seen}  # fmt: skip


# ----------------------------------------------------------------------------------------------
# the SFTTrainer door: a processor and TRL's vision-language format (images + messages)
# ----------------------------------------------------------------------------------------------
VL_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}<|end|>{% endgeneration %}{% else %}<|user|>{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VL_SPECIALS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]


def make_processor(tok_dir: str):
    """A Qwen2.5-VL processor around the tests' small tokenizer (its 90 tokens, then the
    vision tokens at the ids the tiny configs use) and a PIL image processor (2x2 patches,
    merged 2x2). No video processor (torchvision is not installed), hence the class check
    skipped while constructing it."""
    from unittest import mock

    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    tok.add_special_tokens({"additional_special_tokens": VL_SPECIALS},
                           replace_extra_special_tokens=False)  # fmt: skip
    assert tok.convert_tokens_to_ids(VL_SPECIALS) == [IMAGE, VIDEO, V_START, V_END]
    ip = tf.Qwen2VLImageProcessorPil(patch_size=2, merge_size=2, temporal_patch_size=1,
                                     min_pixels=16, max_pixels=4096)  # fmt: skip
    with mock.patch.object(tf.ProcessorMixin, "check_argument_for_proper_class",
                           lambda self, name, arg: None):  # fmt: skip
        return tf.Qwen2_5_VLProcessor(image_processor=ip, tokenizer=tok, video_processor=None,
                                      chat_template=VL_TEMPLATE)  # fmt: skip


def vl_dataset(n: int = 8):
    """TRL's vision-language format: ``images`` (PIL, sizes 8x8 and 8x16) and ``messages``
    (user turns with one or two images, assistant answers of different lengths)."""
    import numpy as np
    from datasets import Dataset
    from PIL import Image

    rng = np.random.default_rng(0)

    def image(h: int, w: int):
        return Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))

    answers = ["a cat", "two dogs on a mat", "the sun", "a red car and a tree"]
    rows = []
    for i in range(n):
        two = i % 2 == 1
        images = [image(8, 16), image(8, 8)] if two else [image(8, 8 + 8 * (i % 3 == 0))]
        content = [{"type": "image"}, {"type": "text", "text": "what is this"}]
        if two:
            content += [{"type": "text", "text": "and"}, {"type": "image"}]
        rows.append({"images": images, "messages": [
            {"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": answers[i % 4]}]},
        ]})  # fmt: skip
    return Dataset.from_list(rows)


def sft_run(rank: int, world: int, model_dir: str, tok_dir: str, out_dir: str, sp: int | None,
            batch: int, steps: int = 2) -> dict:  # fmt: skip
    """``trl.SFTTrainer`` (``sp`` None: the stock class) with the processor and the
    vision-language rows: logged losses, gradient norms and TRL's metrics."""
    import os

    import trl

    from dtensor_ulysses.hf import with_ulysses

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29514")
    torch.set_num_threads(1)
    model = load_model(model_dir)
    args = trl.SFTConfig(
        output_dir=out_dir, per_device_train_batch_size=batch, max_steps=steps,
        learning_rate=1e-2, logging_steps=1, max_grad_norm=1.0, lr_scheduler_type="linear",
        weight_decay=0.1, seed=0, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, dataloader_drop_last=True, max_length=None, bf16=False,
    )  # fmt: skip
    cls = trl.SFTTrainer if sp is None else with_ulysses(trl.SFTTrainer, sp)
    torch.manual_seed(0)
    trainer = cls(model=model, args=args, train_dataset=vl_dataset(),
                  processing_class=make_processor(tok_dir))  # fmt: skip
    trainer.train()
    h = trainer.state.log_history
    keys = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens")
    return {k: [e[k] for e in h if "loss" in e and k in e] for k in keys}


def example_run(rank: int, world: int, out_dir: str) -> dict:
    """examples/vlm_trainer.py's ``main`` on this world (what torchrun would launch)."""
    import importlib.util
    import os

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29515")
    path = Path(__file__).resolve().parents[2] / "examples" / "vlm_trainer.py"
    spec = importlib.util.spec_from_file_location("vlm_trainer_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(["--sp", str(world), "--steps", "2", "--out", out_dir])
