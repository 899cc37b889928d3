"""Ulysses inside TRL's ``SFTTrainer``: a stock SFT script, plus the two lines marked ``Ulysses``.

On CPU with a tiny model built on the spot (``--model DIR`` for a local checkpoint)::

    torchrun --standalone --nproc-per-node 2 examples/sft_trl.py --sp 2
    python examples/sft_trl.py --stock           # the stock trainer on one process: the losses
                                                 # of the run above (dp = 1; add --bf16 to both
                                                 # for TRL's default precision: close, not equal)
    torchrun --standalone --nproc-per-node 4 examples/sft_trl.py --sp 2 --packing --tiled-loss
    torchrun --standalone --nproc-per-node 2 examples/sft_trl.py --stock --packing
                                                 # 4 ranks at sp 2 are dp = 2: 2 rows per dp
                                                 # rank, a global batch of 4; the stock trainer
                                                 # on 2 processes gives the losses of that run

``--stock`` launched on ``dp`` processes (one without torchrun) is the stock trainer at the same
data parallelism, so the same global batch (``per_device_train_batch_size=2`` rows per dp rank).

Chat data with the loss on assistant tokens only, or (``--packing``) packed text without
padding (``padding_free``: documents kept apart by position ids restarting at 0).
"""

from __future__ import annotations

import argparse

from _tiny import CHATS, TEXTS, tiny_model_and_tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sp", type=int, default=2, help="Ulysses degree (divides the rank count)")
    p.add_argument("--packing", action="store_true", help="packed text, padding_free")
    p.add_argument("--tiled-loss", action="store_true", help="the loss without [B, s, V] logits")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--model", default=None, help="a local model directory (default: tiny)")
    p.add_argument("--out", default="runs/sft_trl")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (TRL's default)")
    p.add_argument(
        "--stock",
        action="store_true",
        help="the stock trainer (one process, or dp processes under torchrun)",
    )
    a = p.parse_args()

    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from dtensor_ulysses.hf import with_ulysses  # Ulysses

    model, tokenizer = tiny_model_and_tokenizer(a.model)
    if a.packing:
        data = Dataset.from_list([{"text": t} for t in TEXTS])
        extra = dict(packing=True, padding_free=True, max_length=32)
    else:
        data = Dataset.from_list([{"messages": m} for m in CHATS])
        extra = dict(assistant_only_loss=True, max_length=48)
    args = SFTConfig(
        output_dir=a.out, per_device_train_batch_size=2, max_steps=a.steps, learning_rate=1e-3,
        logging_steps=1, bf16=a.bf16, report_to=[], save_strategy="no",
        use_cpu=not torch.cuda.is_available(), **extra,
    )  # fmt: skip
    trainer_cls = SFTTrainer
    if not a.stock:
        trainer_cls = with_ulysses(SFTTrainer, sp=a.sp, tiled_loss=a.tiled_loss)  # Ulysses
    trainer = trainer_cls(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    if trainer.is_world_process_zero():
        print("losses", [h["loss"] for h in trainer.state.log_history if "loss" in h])
    trainer.save_model(f"{a.out}/final")


if __name__ == "__main__":
    main()
