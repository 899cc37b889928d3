"""Ulysses inside ``transformers.Trainer``: a stock causal-LM script plus two ``Ulysses`` lines.

On CPU with a tiny model built on the spot (``--model DIR`` for a local checkpoint)::

    torchrun --standalone --nproc-per-node 2 examples/trainer_hf.py --sp 2
    torchrun --standalone --nproc-per-node 4 examples/trainer_hf.py --sp 2 --eval

Padded text batches (``DataCollatorForLanguageModeling``): each rank of an sp group gets the
same rows and feeds its slice of them; evaluation runs sharded at the training length.
"""

from __future__ import annotations

import argparse

from _tiny import TEXTS, tiny_model_and_tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sp", type=int, default=2, help="Ulysses degree (divides the rank count)")
    p.add_argument("--eval", action="store_true", help="evaluate before and after training")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--model", default=None, help="a local model directory (default: tiny)")
    p.add_argument("--out", default="runs/trainer_hf")
    a = p.parse_args()

    import torch
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from dtensor_ulysses.hf import with_ulysses  # Ulysses

    model, tokenizer = tiny_model_and_tokenizer(a.model)
    data = Dataset.from_list([{"input_ids": tokenizer(t)["input_ids"]} for t in TEXTS])
    args = TrainingArguments(
        output_dir=a.out, per_device_train_batch_size=2, per_device_eval_batch_size=2,
        max_steps=a.steps, learning_rate=1e-3, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=not torch.cuda.is_available(),
    )  # fmt: skip
    trainer = with_ulysses(Trainer, sp=a.sp)(  # Ulysses (was: Trainer()
        model=model, args=args, train_dataset=data, eval_dataset=data.select(range(8)),
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )  # fmt: skip
    if a.eval:  # every rank evaluates (its slices); rank 0 prints
        before = trainer.evaluate()
        if trainer.is_world_process_zero():
            print("before:", before)
    trainer.train()
    if a.eval:
        after = trainer.evaluate()
        if trainer.is_world_process_zero():
            print("after:", after)
    trainer.save_model(f"{a.out}/final")


if __name__ == "__main__":
    main()
