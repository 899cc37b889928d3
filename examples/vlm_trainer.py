"""Ulysses for a vision-language model inside ``transformers.Trainer`` (Qwen2.5-VL / Qwen3-VL).

On CPU with a tiny random Qwen2.5-VL built on the spot (``--model DIR``: a local Qwen2.5-VL or
Qwen3-VL checkpoint; the synthetic rows below are then built from its config: its image token
ids, patch size, merge size and vocabulary)::

    torchrun --standalone --nproc-per-node 2 examples/vlm_trainer.py --sp 2
    python examples/vlm_trainer.py --stock       # the stock Trainer on one process: the losses
                                                 # of the run above (dp = 1)
    torchrun --standalone --nproc-per-node 4 examples/vlm_trainer.py --sp 2
    torchrun --standalone --nproc-per-node 2 examples/vlm_trainer.py --stock
                                                 # 4 ranks at sp 2 are dp = 2: the stock
                                                 # Trainer on 2 processes (Qwen-VL averages the
                                                 # loss per dp rank; with_ulysses does the same)

Each row is image + text: ``input_ids`` with the image's placeholder tokens, ``labels``,
``mm_token_type_ids`` (1 on image tokens: the M-RoPE positions), and the image's patches
(``pixel_values``) and grid (``image_grid_thw``), as a Qwen-VL processor gives them. The
collator stacks the rows and concatenates the images. Under Ulysses every rank of an sp group
reads the same rows; each image is encoded on one of its ranks, the features gathered, and the
decoder runs on this rank's slice of the merged sequence.
"""

from __future__ import annotations

import argparse

import torch

IMAGE, VIDEO, V_START, V_END = 90, 91, 92, 93  # the tiny model's special token ids


def tiny_model():
    """A small random Qwen2.5-VL (2 decoder layers, a 2-block vision tower)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=96, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2],
                                          "rope_theta": 10000.0}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64, patch_size=2, spatial_merge_size=2,
                           temporal_patch_size=1, window_size=8, fullatt_block_indexes=[1]),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=V_START,
        vision_end_token_id=V_END,
    )  # fmt: skip
    return Qwen2_5_VLForConditionalGeneration(cfg).float()


def rows(config, n: int, length: int = 48, seed: int = 0) -> list[dict]:
    """``n`` image + text rows of ``length`` tokens, one or two images of different sizes, in
    the format of a Qwen-VL processor for the model ``config`` (its image and vision start /
    end token ids; patches of ``in_channels x temporal_patch_size x patch_size^2`` values;
    ``spatial_merge_size^2`` patches per image token); the text tokens are random ids below
    the special ones."""
    vision = config.vision_config
    merge = vision.spatial_merge_size
    dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    special = (config.image_token_id, config.video_token_id, config.vision_start_token_id,
               config.vision_end_token_id)  # fmt: skip
    text_ids = min(*special, config.get_text_config().vocab_size)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        # (t, h, w) in patches: h and w multiples of the merge size
        grids = (
            [(1, 2 * merge, 4 * merge)]
            if i % 2 == 0
            else [(1, 2 * merge, 2 * merge), (1, 4 * merge, 2 * merge)]
        )
        ids = torch.randint(0, text_ids, (1, length), generator=g)
        types = torch.zeros_like(ids)
        at = 3
        start, end = config.vision_start_token_id, config.vision_end_token_id
        for t, h, w in grids:
            k = t * h * w // merge**2  # image tokens: patches merged merge x merge
            ids[0, at - 1], ids[0, at + k] = start, end
            ids[0, at : at + k] = config.image_token_id
            types[0, at : at + k] = 1
            at += k + 6
        labels = ids.masked_fill(types == 1, -100)
        pixels = torch.cat([torch.randn(t * h * w, dim, generator=g) for t, h, w in grids])
        out.append({"input_ids": ids, "labels": labels, "mm_token_type_ids": types,
                    "pixel_values": pixels, "image_grid_thw": torch.tensor(grids)})  # fmt: skip
    return out


def collate(batch: list[dict]) -> dict:
    """Rows stacked along the batch, images concatenated in row order."""
    return {k: torch.cat([r[k] for r in batch]) for k in batch[0]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sp", type=int, default=2, help="Ulysses degree (divides the rank count)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--model", default=None, help="a local model directory (default: tiny)")
    p.add_argument("--out", default="runs/vlm_trainer")
    p.add_argument(
        "--stock",
        action="store_true",
        help="the stock Trainer (one process, or dp processes under torchrun)",
    )
    a = p.parse_args(argv)

    from transformers import AutoModelForImageTextToText, Trainer, TrainingArguments

    from dtensor_ulysses.hf import with_ulysses  # Ulysses

    model = (
        AutoModelForImageTextToText.from_pretrained(a.model, dtype=torch.float32)
        if a.model
        else tiny_model()
    )
    args = TrainingArguments(
        output_dir=a.out, per_device_train_batch_size=2, max_steps=a.steps, learning_rate=1e-3,
        logging_steps=1, report_to=[], save_strategy="no", remove_unused_columns=False,
        use_cpu=not torch.cuda.is_available(),
    )  # fmt: skip
    trainer_cls = Trainer if a.stock else with_ulysses(Trainer, sp=a.sp)  # Ulysses
    trainer = trainer_cls(
        model=model, args=args, train_dataset=rows(model.config, 16), data_collator=collate,
    )  # fmt: skip
    result = trainer.train()
    if trainer.is_world_process_zero():
        print("losses", [h["loss"] for h in trainer.state.log_history if "loss" in h])
        print(result.metrics)
    return result.metrics


if __name__ == "__main__":
    main()
