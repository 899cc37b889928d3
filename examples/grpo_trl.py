"""Ulysses inside TRL's ``GRPOTrainer``: a stock GRPO script with a rule reward, plus the two lines
marked ``Ulysses``.

On CPU with a tiny model built on the spot (``--model DIR`` for a local checkpoint)::

    torchrun --standalone --nproc-per-node 2 examples/grpo_trl.py --sp 2
    torchrun --standalone --nproc-per-node 4 examples/grpo_trl.py --sp 2 --beta 0.04
    python examples/grpo_trl.py --stock          # the stock trainer on one process
    torchrun --standalone --nproc-per-node 2 examples/grpo_trl.py --sp 2 --greedy
    python examples/grpo_trl.py --stock --greedy # the run above reproduces it (rewards, loss)

With sampling (the default), ``with_ulysses`` draws each completion from its own seeded
generator (the same rollouts at every sp) where the stock trainer draws a rank's rows from one
stream: the samples differ, the distribution is the same; greedy decoding gives both the same
rollouts.

The prompts are little sums ("2 + 3 ="); the reward is a math-style rule: 1 when the first
number of the completion is the right answer, plus a small bonus for a short completion. A
tiny random model will not learn arithmetic in a few steps; the point is the mechanics: the
completions are generated on whole prompts, the rewards computed once per completion, and the
policy, old-policy and reference log-probabilities on each rank's slice of the sequence.
"""

from __future__ import annotations

import argparse
import os
import random
import re

from _tiny import tiny_model_and_tokenizer

DIGITS = [str(i) for i in range(10)]


def sum_prompts(n: int, seed: int = 0) -> list[dict]:
    rnd = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rnd.randint(0, 4), rnd.randint(0, 4)
        rows.append({"prompt": f"{a} + {b} =", "answer": str(a + b)})
    return rows


def correct_sum(completions: list[str], answer: list[str], **_: object) -> list[float]:
    """1.0 when the first number in the completion is the answer, else 0.0."""
    out = []
    for text, want in zip(completions, answer):
        found = re.search(r"\d+", text)
        out.append(1.0 if found is not None and found.group() == want else 0.0)
    return out


def short(completions: list[str], **_: object) -> list[float]:
    """A small bonus for short completions."""
    return [0.1 / (1 + len(c.split())) for c in completions]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sp", type=int, default=2, help="Ulysses degree (divides the rank count)")
    p.add_argument("--beta", type=float, default=0.0, help="KL weight (> 0: a reference model)")
    p.add_argument("--loss-type", default="dapo", help="GRPO's loss_type")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--model", default=None, help="a local model directory (default: tiny)")
    p.add_argument("--out", default="runs/grpo_trl")
    p.add_argument("--stock", action="store_true", help="the stock trainer (one process)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (no sampling)")
    a = p.parse_args()

    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from dtensor_ulysses.hf import with_ulysses  # Ulysses

    model, tokenizer = tiny_model_and_tokenizer(a.model, extra_words=DIGITS + ["+", "="])
    tokenizer.padding_side = "left"
    if a.beta > 0 and a.model is None:  # TRL loads the reference model from the policy's path
        path = f"{a.out}/tiny-rank{os.environ.get('RANK', '0')}"  # (each rank its own copy)
        model.save_pretrained(path)
        model = path
    args = GRPOConfig(
        output_dir=a.out, per_device_train_batch_size=4, num_generations=4, max_steps=a.steps,
        max_completion_length=8, learning_rate=1e-3, beta=a.beta, loss_type=a.loss_type,
        logging_steps=1, bf16=False, report_to=[], save_strategy="no", disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        generation_kwargs={"do_sample": False} if a.greedy else None,
    )  # fmt: skip
    trainer_cls = GRPOTrainer
    if not a.stock:
        trainer_cls = with_ulysses(GRPOTrainer, sp=a.sp)  # Ulysses
    trainer = trainer_cls(
        model=model, reward_funcs=[correct_sum, short], args=args,
        train_dataset=Dataset.from_list(sum_prompts(32)), processing_class=tokenizer,
    )  # fmt: skip
    trainer.train()
    if trainer.is_world_process_zero():
        hist = [h for h in trainer.state.log_history if "loss" in h]
        print("rewards", [round(h["reward"], 6) for h in hist])
        print("losses", [h["loss"] for h in hist])


if __name__ == "__main__":
    main()
