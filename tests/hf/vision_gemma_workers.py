"""Per-rank functions for tests/hf/test_vision_gemma.py (spawned processes import them by module
path), and the tiny Gemma 3 / Gemma 4 multimodal models and image + text rows they use (random
init, no downloads).

Rows: ``G = 4`` rows of ``S = 29`` tokens (uneven over sp=2: [15, 14], sp=4: [8, 7, 7, 7]). Row 0
has two images, rows 1 and 2 one (row 1's spans the sp=2 cut), row 3 one image and right
padding. Gemma 3's images are all one size: 9 tokens each (12 x 12 pixels, 36 patches pooled
2 x 2), longer than the sliding window of 5, so an image's bidirectional block reaches past it.
Gemma 4's images have different sizes (patch grids of 6 x 6 and 4 x 4 pooled 2 x 2: 9 or 4
tokens, padded to 36 patches); its bidirectional blocks are on its sliding layers only, its
global layers have another head shape (head dim 16, one kv head), per-layer input embeddings,
and its last two layers attend with the keys and values of the first two (KV sharing).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

VOCAB = 96
IMAGE, BOI, EOI = 95, 93, 94
S, G, PAD = 29, 4, 4  # row 3 ends in PAD padding tokens
TOKENS = 9  # per image
WINDOW = 5
IMAGES = [[2, 16], [10], [19], [3]]  # per row, where each image's tokens start
FAMILIES = ("gemma3", "gemma4")
# Gemma 4: per image (in row order) its patch grid (x, y); 36 patches at most
GRIDS = [(6, 6), (4, 4), (6, 6), (4, 4), (6, 6)]
PATCHES, PATCH_DIM = 36, 12


def _tokens(family: str) -> list[int]:
    """Tokens of each image, in row order."""
    if family == "gemma3":
        return [TOKENS] * sum(len(r) for r in IMAGES)
    return [x * y // 4 for x, y in GRIDS]


def make_config(family: str = "gemma3"):
    import transformers as tf

    if family == "gemma4":
        text4 = dict(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_hidden_layers=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
            num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
            hidden_size_per_layer_input=4, vocab_size_per_layer_input=VOCAB,
            use_bidirectional_attention="vision", max_position_embeddings=128, pad_token_id=0,
        )  # fmt: skip
        vision4 = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, head_dim=8, patch_size=2,
                       pooling_kernel_size=2, position_embedding_size=16)  # fmt: skip
        return tf.Gemma4Config(text_config=text4, vision_config=vision4, image_token_id=IMAGE,
                               boi_token_id=BOI, eoi_token_id=EOI, video_token_id=92,
                               audio_token_id=91)  # fmt: skip
    if family != "gemma3":
        raise ValueError(family)
    text = tf.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=WINDOW,
        query_pre_attn_scalar=8, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=128,
    )  # fmt: skip
    vision = tf.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, image_size=12,
                                   patch_size=2)  # fmt: skip
    return tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                           mm_tokens_per_image=TOKENS, image_token_index=IMAGE,
                           boi_token_index=BOI, eoi_token_index=EOI)  # fmt: skip


def make_model(family: str = "gemma3", seed: int = 0):
    """A random-init model, every weight perturbed (norms and biases non-trivial), eager."""
    import transformers as tf

    torch.manual_seed(seed)
    cls = {"gemma3": tf.Gemma3ForConditionalGeneration,
           "gemma4": tf.Gemma4ForConditionalGeneration}[family]  # fmt: skip
    model = cls(make_config(family)).float()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def global_batch(family: str = "gemma3", seed: int = 1) -> dict:
    """``G`` rows with their images: input_ids (each image wrapped in BOI / EOI), labels (-100
    on image tokens and padding), the token types (1 on image tokens: Gemma 3's
    ``token_type_ids``, Gemma 4's ``mm_token_type_ids``), attention_mask, pixel_values (every
    image, in row order; Gemma 4: patches and ``image_position_ids``)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, BOI, (G, S), generator=g)
    types = torch.zeros_like(ids)
    tokens = iter(_tokens(family))
    for b, starts in enumerate(IMAGES):
        for start in starts:
            n = next(tokens)
            ids[b, start - 1], ids[b, start + n] = BOI, EOI
            ids[b, start : start + n] = IMAGE
            types[b, start : start + n] = 1
    mask = torch.ones_like(ids)
    mask[G - 1, S - PAD :] = 0
    labels = ids.clone()
    labels[(types == 1) | (mask == 0)] = -100
    out = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    if family == "gemma3":
        out["token_type_ids"] = types
        out["pixel_values"] = torch.randn(len(_tokens(family)), 3, 12, 12, generator=g)
        return out
    out["mm_token_type_ids"] = types
    out["pixel_values"] = torch.rand(len(GRIDS), PATCHES, PATCH_DIM, generator=g)
    pos = torch.full((len(GRIDS), PATCHES, 2), -1)
    for i, (x, y) in enumerate(GRIDS):
        pos[i, : x * y] = torch.tensor([(a, c) for c in range(y) for a in range(x)])
    out["image_position_ids"] = pos
    return out


def rows_of(batch: dict, lo: int, hi: int) -> dict:
    """Rows ``lo:hi`` of a batch, with their images."""
    first, last = sum(len(r) for r in IMAGES[:lo]), sum(len(r) for r in IMAGES[:hi])
    per_image = ("pixel_values", "image_position_ids")
    out = {k: v[lo:hi] for k, v in batch.items() if k not in per_image}
    for k in per_image:
        if k in batch:
            out[k] = batch[k][first:last]
    return out


def model_reference(family: str = "gemma3", seed: int = 0, blocks: bool = True) -> dict:
    """The stock model on one process (eager attention): its own loss (token mean) on the
    global batch and every gradient; ``blocks=False``: without token_type_ids (causal over the
    images), to show that the blocks matter."""
    torch.set_num_threads(1)
    model = make_model(family, seed)
    batch = global_batch(family)
    if not blocks:
        batch.pop("token_type_ids" if family == "gemma3" else "mm_token_type_ids")
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.item(), "grads": grads}


PACKED = {0: 14, 2: 8}  # row -> where its second document starts (images inside documents)


def packed_batch(family: str = "gemma3") -> dict:
    """:func:`global_batch` with rows 0 and 2 packed from two documents each: position ids
    restarting at the second document, whose first token is no target."""
    batch = global_batch(family)
    pos = torch.arange(S).repeat(G, 1)
    for b, start in PACKED.items():
        pos[b, start:] -= start
        batch["labels"][b, start] = -100
    return dict(batch, position_ids=pos)


def packed_reference(family: str = "gemma3", seed: int = 0) -> dict:
    """The stock model on each document on its own (its images with it): the token-mean loss
    over every document of the batch, and every gradient."""
    torch.set_num_threads(1)
    model = make_model(family, seed)
    batch = packed_batch(family)
    key = "token_type_ids" if family == "gemma3" else "mm_token_type_ids"
    first = [sum(len(r) for r in IMAGES[:b]) for b in range(G)]
    total, n_valid = torch.zeros(()), 0
    for b in range(G):
        cuts = [0, PACKED[b], S] if b in PACKED else [0, S]
        for lo, hi in zip(cuts, cuts[1:]):
            mine = [i for i, st in enumerate(IMAGES[b]) if lo <= st < hi]
            images = batch["pixel_values"][[first[b] + i for i in mine]]
            labels = batch["labels"][b, lo:hi][None]
            kw = {"input_ids": batch["input_ids"][b, lo:hi][None],
                  key: batch[key][b, lo:hi][None],
                  "attention_mask": batch["attention_mask"][b, lo:hi][None]}  # fmt: skip
            if mine:
                kw["pixel_values"] = images
            logits = model(**kw).logits
            target = labels[:, 1:]
            total = total + torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), target.flatten(), reduction="sum"
            )
            n_valid += int((target != -100).sum())
    loss = total / n_valid
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.item(), "grads": grads}


def model_check(rank: int, world: int, family: str, dp: int, sp: int, seed: int = 0,
                packed: bool = False) -> dict:  # fmt: skip
    """``parallelize`` (Ulysses + FSDP2) and ``shard_batch`` on this dp rank's rows (packed:
    :func:`packed_batch`): the global loss, every full gradient, the images each rank encoded
    and the kernels chosen."""
    from torch.distributed.tensor import DTensor

    from dtensor_ulysses import hf
    from dtensor_ulysses.attention import model_kernels
    from dtensor_ulysses.hf.models.vision import vision_model_inputs
    from dtensor_ulysses.models import cross_entropy_sum
    from dtensor_ulysses.parallel import flatten_dp_sp, init_mesh

    torch.set_num_threads(1)
    mesh = init_mesh(dp, sp, device_type="cpu")
    model = make_model(family, seed)
    calls: list[int] = []
    model.model.vision_tower.register_forward_hook(
        lambda m, args, kwargs, out: calls.append(int(kwargs["pixel_values"].shape[0])),
        with_kwargs=True,
    )
    hf.parallelize(model, mesh)
    batch = packed_batch(family) if packed else global_batch(family)
    b = G // dp
    lo = mesh.get_local_rank("dp") * b
    mine = rows_of(batch, lo, lo + b)
    sb = hf.shard_batch(mine, mesh)
    out = model(**vision_model_inputs(mine, sb))
    local = cross_entropy_sum(out.logits, sb.labels) / sb.n_valid
    local.backward()
    total = local.detach().clone()
    dist.all_reduce(total, group=flatten_dp_sp(mesh).get_group())
    grads = {}
    for n, p in model.named_parameters():
        g = torch.zeros(p.shape) if p.grad is None else p.grad  # unused by the stock model too
        grads[n] = (g.full_tensor() if isinstance(g, DTensor) else g).clone()
    state = model.model.__dict__["_du_vision_state"]
    return {"loss": total.item(), "grads": grads, "encoded": list(state.encoded),
            "calls": calls, "images": len(mine["pixel_values"]),
            "dp_rank": mesh.get_local_rank("dp"), "sp_rank": mesh.get_local_rank("sp"),
            "kernels": [(c.label, c.describe()) for c in model_kernels(model)]}  # fmt: skip


def run_jobs(rank: int, world: int, jobs: list) -> list:
    """Several cases in one spawned world: ``(function name, args)`` each."""
    out = []
    for name, args in jobs:
        out.append(globals()[name](rank, world, *args))
        dist.barrier()
    return out


def refusal_check(rank: int, world: int) -> dict:
    """Gemma 4 under ``apply_ulysses``: the one-line refusals of video and audio inputs, and of
    a padding mask without the batch's layout; Gemma 3 with ``backend="sdpa"`` (its image
    blocks): refused when the model is prepared."""
    from dtensor_ulysses import hf
    from dtensor_ulysses.parallel import init_mesh

    torch.set_num_threads(1)
    mesh = init_mesh(1, world, device_type="cpu")
    model = make_model("gemma4")
    hf.apply_ulysses(model, mesh)
    batch = global_batch("gemma4")
    ids = batch["input_ids"][:1]
    calls = {
        "video": dict(input_ids=ids, pixel_values_videos=torch.rand(1, PATCHES, PATCH_DIM),
                      video_position_ids=batch["image_position_ids"][:1],
                      num_frames_per_video=torch.tensor([1])),
        "audio": dict(input_ids=ids, input_features=torch.rand(1, 8, 4),
                      input_features_mask=torch.ones(1, 8, dtype=torch.bool)),
        "padding": {k: v[-1:] for k, v in rows_of(batch, G - 1, G).items() if k != "labels"},
    }  # fmt: skip
    out = {}
    try:
        hf.apply_ulysses(make_model("gemma3"), mesh, backend="sdpa")
        out["sdpa"] = None
    except ValueError as e:
        out["sdpa"] = str(e)
    for name, kwargs in calls.items():
        try:
            model(**kwargs)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


# ----------------------------------------------------------------------------------------------
# the Trainer door
# ----------------------------------------------------------------------------------------------
class RowsDataset(torch.utils.data.Dataset):
    """The global batch's rows, one example each (its own images)."""

    def __init__(self, family: str):
        batch = global_batch(family)
        self.rows = [rows_of(batch, i, i + 1) for i in range(G)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def collate(rows: list) -> dict:
    """Rows stacked, images concatenated in row order (what Gemma's processor gives)."""
    return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}


def trainer_run(rank: int, world: int, family: str, out_dir: str, sp: int | None,
                batch: int = 2, steps: int = 2) -> dict:  # fmt: skip
    """``transformers.Trainer`` (``sp`` None: the stock class) on the image + text rows: the
    logged losses and gradient norms, and the images the vision tower encoded per step."""
    import os

    import transformers as tf

    from dtensor_ulysses.hf import with_ulysses

    # the group is up already (launch.run_local_world); accelerate still reads these
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.set_num_threads(1)
    model = make_model(family)
    encoded: list[int] = []
    model.model.vision_tower.register_forward_hook(
        lambda m, args, kwargs, out: encoded.append(int(kwargs["pixel_values"].shape[0])),
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
    trainer.train()
    h = trainer.state.log_history
    return {"loss": [e["loss"] for e in h if "loss" in e],
            "grad_norm": [e["grad_norm"] for e in h if "grad_norm" in e],
            "encoded": encoded}  # fmt: skip


# ----------------------------------------------------------------------------------------------
# the SFTTrainer door: a Gemma 3 processor and TRL's vision-language format (images + messages)
# ----------------------------------------------------------------------------------------------
SPECIALS = ["<f0>", "<f1>", "<f2>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}<|end|>{% endgeneration %}{% else %}<|user|>{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_tokenizer(directory, text: str) -> str:
    """The tests' small tokenizer (90 tokens) with Gemma 3's image tokens at the ids the tiny
    config uses (BOI 93, EOI 94, image 95), saved to ``directory``."""
    from tests import hf_workers as W

    tok = W.make_tokenizer(directory, text)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS},
                           replace_extra_special_tokens=False)  # fmt: skip
    assert tok.convert_tokens_to_ids(SPECIALS[3:]) == [BOI, EOI, IMAGE]
    tok.save_pretrained(directory)
    return str(directory)


def make_processor(tok_dir: str):
    """A Gemma 3 processor: the tokenizer above and a PIL image processor (12 x 12 images,
    ``mm_tokens_per_image`` = 9 tokens each)."""
    from unittest import mock

    import transformers as tf

    named = dict(boi_token=SPECIALS[3], eoi_token=SPECIALS[4], image_token=SPECIALS[5])
    tok = tf.AutoTokenizer.from_pretrained(tok_dir, extra_special_tokens=named)
    ip = tf.Gemma3ImageProcessorPil(size={"height": 12, "width": 12})
    with mock.patch.object(tf.ProcessorMixin, "check_argument_for_proper_class",
                           lambda self, name, arg: None):  # fmt: skip
        return tf.Gemma3Processor(image_processor=ip, tokenizer=tok, chat_template=TEMPLATE,
                                  image_seq_length=TOKENS)  # fmt: skip


def sft_run(rank: int, world: int, tok_dir: str, out_dir: str, sp: int | None,
            batch: int = 4, steps: int = 2) -> dict:  # fmt: skip
    """``trl.SFTTrainer`` (``sp`` None: the stock class) on Gemma 3 with the processor and TRL's
    vision-language rows: logged losses, gradient norms and TRL's metrics."""
    import os

    import trl

    from dtensor_ulysses.hf import with_ulysses
    from tests.hf.vision_workers import vl_dataset

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29518")
    torch.set_num_threads(1)
    model = make_model("gemma3")
    image_tokens: list[int] = []  # the token types the model is called with (its image blocks)
    model.model.register_forward_pre_hook(
        lambda m, args, kwargs: image_tokens.append(int(kwargs["token_type_ids"].sum())),
        with_kwargs=True,
    )
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
    out = {k: [e[k] for e in h if "loss" in e and k in e] for k in keys}
    return dict(out, image_tokens=image_tokens)
