"""Ulysses inside TRL's ``DistillationTrainer``: a stock on-policy distillation script, plus the two
lines marked ``Ulysses``.

On CPU with a tiny student and a larger tiny teacher built on the spot (``--model DIR`` and
``--teacher DIR`` for local checkpoints with the same vocabulary)::

    torchrun --standalone --nproc-per-node 2 examples/distill_trl.py --sp 2
    torchrun --standalone --nproc-per-node 4 examples/distill_trl.py --sp 2 --beta 0.5
    python examples/distill_trl.py --stock       # the stock trainer on one process: the run
                                                 # --sp 2 on 2 ranks reproduces (losses)

The student generates a completion for each prompt (greedy here, so that every layout decodes
the same tokens; ``--sample`` samples as TRL does by default), and learns to match the
teacher's next-token distribution at every completion token under the generalized
Jensen-Shannon divergence (``--beta``: 0 forward KL, 0.5 JSD, 1 reverse KL, TRL's default).
Under ``with_ulysses`` the teacher sits on the same mesh (Ulysses + FSDP2, frozen), and the
divergence runs on each rank's slice of every prompt + completion row.
"""

from __future__ import annotations

import argparse

from _tiny import TEXTS, tiny_model_and_tokenizer


def tiny_teacher(vocab_size: int):
    """A tiny random Llama, wider and deeper than the student, with its vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sp", type=int, default=2, help="Ulysses degree (divides the rank count)")
    p.add_argument("--beta", type=float, default=1.0, help="0 forward KL, 0.5 JSD, 1 reverse KL")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sample", action="store_true", help="sample the completions (TRL's default)")
    p.add_argument("--model", default=None, help="a local student directory (default: tiny)")
    p.add_argument("--teacher", default=None, help="a local teacher directory (default: tiny)")
    p.add_argument("--out", default="runs/distill_trl")
    p.add_argument("--stock", action="store_true", help="the stock trainer (one process)")
    a = p.parse_args()

    import torch
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    from dtensor_ulysses.hf import with_ulysses  # Ulysses

    model, tokenizer = tiny_model_and_tokenizer(a.model)
    tokenizer.padding_side = "left"
    teacher = a.teacher or tiny_teacher(model.config.vocab_size)  # a path or a model
    prompts = [" ".join(t.split()[: 2 + i % 4]) for i, t in enumerate(TEXTS[:16])]
    args = DistillationConfig(
        output_dir=a.out, per_device_train_batch_size=4, max_steps=a.steps, beta=a.beta,
        max_completion_length=8, learning_rate=1e-3, logging_steps=1, bf16=False, report_to=[],
        save_strategy="no", disable_tqdm=True, gradient_checkpointing=False,
        generation_kwargs=None if a.sample else {"do_sample": False},
        use_cpu=not torch.cuda.is_available(),
    )  # fmt: skip
    trainer_cls = DistillationTrainer
    if not a.stock:
        trainer_cls = with_ulysses(DistillationTrainer, sp=a.sp)  # Ulysses
    trainer = trainer_cls(
        model=model, teacher_model=teacher, args=args,
        train_dataset=Dataset.from_list([{"prompt": q} for q in prompts]),
        processing_class=tokenizer,
    )  # fmt: skip
    trainer.train()
    if trainer.is_world_process_zero():
        hist = [h for h in trainer.state.log_history if "loss" in h]
        print("completion lengths", [h["completions/mean_length"] for h in hist])
        print("losses", [h["loss"] for h in hist])


if __name__ == "__main__":
    main()
