"""Ulysses inside TRL's preference trainers: a stock DPO / KTO / reward-model script, plus the
two lines marked ``Ulysses``.

On CPU with a tiny model built on the spot (``--model DIR`` for a local checkpoint)::

    torchrun --standalone --nproc-per-node 2 examples/dpo_trl.py --sp 2
    torchrun --standalone --nproc-per-node 2 examples/dpo_trl.py --sp 2 --trainer reward
    python examples/dpo_trl.py --stock --trainer reward   # the stock trainer on one process:
                                                          # the losses of the run above (dp = 1)
    torchrun --standalone --nproc-per-node 4 examples/dpo_trl.py --sp 2 --trainer kto
    torchrun --standalone --nproc-per-node 2 examples/dpo_trl.py --stock --trainer kto
                                                          # 4 ranks at sp 2 are dp = 2: the
                                                          # stock trainer on 2 processes

``--stock`` launched on ``dp`` processes (one without torchrun) is the stock trainer at the same
data parallelism, which is what a run on ``dp x sp`` ranks equals (2 rows per dp rank; KTO's
KL pairs are drawn per device batch, so its dp = 2 run differs from dp = 1, for the stock
trainer too).

``dpo``: prompt / chosen / rejected pairs against a reference model (a frozen copy of the
initial policy). ``kto``: unpaired completions labelled desirable or not. ``reward``: the same
pairs scored by a sequence-classification head (``num_labels=1``) on the policy's decoder.
"""

from __future__ import annotations

import argparse
import copy

from _tiny import TEXTS, tiny_model_and_tokenizer


def preference_rows(kind: str) -> list[dict]:
    """Text rows in TRL's formats: ``prompt``/``chosen``/``rejected`` (dpo, reward) or
    ``prompt``/``completion``/``label`` (kto); rejected answers are another text's ending."""
    texts = TEXTS[:6]
    rows = []
    for i, t in enumerate(texts):
        words, other = t.split(), texts[(i + 1) % len(texts)].split()
        prompt, chosen, rejected = " ".join(words[:3]), " ".join(words[3:]), " ".join(other[3:])
        if kind == "kto":
            rows.append({"prompt": prompt, "completion": " " + chosen, "label": True})
            rows.append({"prompt": prompt, "completion": " " + rejected, "label": False})
        else:
            rows.append({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected})
    return rows * 4


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainer", choices=["dpo", "kto", "reward"], default="dpo")
    p.add_argument("--sp", type=int, default=2, help="Ulysses degree (divides the rank count)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--model", default=None, help="a local model directory (default: tiny)")
    p.add_argument("--out", default="runs/preference_trl")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (TRL's default)")
    p.add_argument(
        "--stock",
        action="store_true",
        help="the stock trainer (one process, or dp processes under torchrun)",
    )
    a = p.parse_args(argv)

    import torch
    import trl
    from datasets import Dataset

    from dtensor_ulysses.hf import with_ulysses  # Ulysses

    model, tokenizer = tiny_model_and_tokenizer(a.model)
    common = dict(
        output_dir=a.out, per_device_train_batch_size=2, max_steps=a.steps, learning_rate=1e-3,
        logging_steps=1, bf16=a.bf16, report_to=[], save_strategy="no", max_length=48,
        use_cpu=not torch.cuda.is_available(),
    )  # fmt: skip
    extra: dict = {}
    if a.trainer == "dpo":
        cls, args = trl.DPOTrainer, trl.DPOConfig(**common, beta=0.1)
        extra["ref_model"] = copy.deepcopy(model)  # the frozen reference: the initial policy
    elif a.trainer == "kto":
        cls, args = trl.KTOTrainer, trl.KTOConfig(**common, beta=0.1)
        extra["ref_model"] = copy.deepcopy(model)
    else:  # the same decoder under a score head (one number per sequence), seeded
        from transformers import AutoModelForSequenceClassification

        model.config.num_labels = 1
        torch.manual_seed(0)
        scorer = AutoModelForSequenceClassification.from_config(model.config, dtype=torch.float32)
        scorer.model.load_state_dict(model.model.state_dict())
        model = scorer
        cls, args = trl.RewardTrainer, trl.RewardConfig(**common, center_rewards_coefficient=0.01)
    data = Dataset.from_list(preference_rows(a.trainer))
    trainer_cls = cls
    if not a.stock:
        trainer_cls = with_ulysses(cls, sp=a.sp)  # Ulysses
    trainer = trainer_cls(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                          **extra)  # fmt: skip
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        print("losses", losses)
    trainer.save_model(f"{a.out}/final")
    return losses


if __name__ == "__main__":
    main()
