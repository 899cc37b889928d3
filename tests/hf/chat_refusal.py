"""A with_ulysses(SFTTrainer) script on chat rows of which two have no assistant turn, with
``assistant_only_loss=True`` (tests/hf/test_trainer.py launches it under torchrun):
``python chat_refusal.py MODEL_DIR TOKENIZER_DIR OUT_DIR``."""

from __future__ import annotations

import sys


def main(model_dir: str, tok_dir: str, out: str) -> None:
    import torch
    import transformers as tf
    import trl
    from datasets import Dataset

    from dtensor_ulysses.hf import with_ulysses
    from tests.hf.trainer_workers import CONVS

    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lone = [{"role": "user", "content": "the quick fox"}]
    rows = [{"messages": c} for c in CONVS[:4]] + [{"messages": lone}] * 2
    args = trl.SFTConfig(output_dir=out, per_device_train_batch_size=2, max_steps=1,
                         report_to=[], use_cpu=True, assistant_only_loss=True, max_length=40,
                         bf16=False)  # fmt: skip
    trainer = with_ulysses(trl.SFTTrainer, sp=2)(
        model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok
    )
    trainer.train()


if __name__ == "__main__":
    main(*sys.argv[1:4])
