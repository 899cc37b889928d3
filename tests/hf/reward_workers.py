"""Per-rank functions for tests/hf/test_reward.py: one TRL ``RewardTrainer`` run, stock or under
:func:`~dtensor_ulysses.hf.with_ulysses`, on a tiny local Llama read as a sequence classifier
(tests/hf_workers.py's checkpoint and tokenizer) and tokenized preference pairs of uneven
lengths. Each run returns its logged losses and metrics and the full gradient of every trainable
parameter at every optimizer step."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

# (chosen, rejected) lengths: uneven, and rows of 1 and 2 tokens (shorter than sp = 4); the
# longest row of a step's batch is what the collator pads to
LENGTHS = [(9, 5), (1, 7), (13, 2), (6, 6), (3, 11), (8, 1), (2, 12), (10, 4),
           (5, 9), (7, 3), (11, 2), (4, 8), (1, 6), (12, 5), (6, 10), (3, 2)]  # fmt: skip
# evaluation pairs: the longest row has 3 tokens, fewer than sp = 4
EVAL_LENGTHS = [(1, 2), (3, 1), (2, 2), (1, 3)]
PAD = 0  # the tokenizer's pad token ("<unk>"): no row contains it
METRICS = ("accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens")


def pairs(lengths: list = LENGTHS, seed: int = 3, margin: bool = False):
    """Tokenized preference pairs (TRL's processed columns ``chosen_ids`` / ``rejected_ids``,
    and ``margin`` if asked)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, (c, r) in enumerate(lengths):
        row: dict[str, Any] = {
            "chosen_ids": torch.randint(1, 90, (c,), generator=g).tolist(),
            "rejected_ids": torch.randint(1, 90, (r,), generator=g).tolist(),
        }
        if margin:
            row["margin"] = 0.25 * (i % 3)
        rows.append(row)
    return Dataset.from_list(rows)


class _Grads:
    """A callback keeping the full gradient of every trainable parameter before each optimizer
    step (FSDP2's DTensor shards gathered: a collective on every rank)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def callback(self) -> Any:
        from transformers import TrainerCallback

        outer = self

        class Keep(TrainerCallback):
            def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any):
                from torch.distributed.tensor import DTensor

                grads = {}
                for name, p in kw["model"].named_parameters():
                    if p.requires_grad and p.grad is not None:
                        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                        grads[name] = g.detach().cpu().clone()
                outer.steps.append(grads)

        return Keep()


def build(spec: dict, grads: _Grads | None = None) -> Any:
    """A ``RewardTrainer`` as the spec says (``sp`` None: the stock class)."""
    import transformers as tf
    import trl

    from dtensor_ulysses.hf import with_ulysses

    tok = tf.AutoTokenizer.from_pretrained(spec["tok"])
    args = trl.RewardConfig(
        output_dir=spec["out"], per_device_train_batch_size=spec.get("batch", 4),
        per_device_eval_batch_size=spec.get("batch", 4),
        gradient_accumulation_steps=spec.get("ga", 1), max_steps=3, learning_rate=1e-2,
        logging_steps=1, max_grad_norm=1e6, lr_scheduler_type="linear", weight_decay=0.1,
        seed=0, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
        dataloader_drop_last=True, bf16=False, disable_dropout=True,
        center_rewards_coefficient=spec.get("center"),
    )  # fmt: skip
    cls: Any = trl.RewardTrainer
    if spec.get("sp"):
        cls = with_ulysses(cls, spec["sp"], **spec.get("options", {}))
    kw: dict = {}
    if spec.get("lora"):
        from peft import LoraConfig

        kw["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                       lora_dropout=0.0, task_type="SEQ_CLS")  # fmt: skip
    if spec.get("eval"):
        kw["eval_dataset"] = pairs(EVAL_LENGTHS, seed=5, margin=spec.get("margin", False))
    if grads is not None:
        kw["callbacks"] = [grads.callback()]
    # a model name: TRL loads it as AutoModelForSequenceClassification (num_labels=1, a score
    # head initialized after its set_seed(args.seed), so every process has the same one)
    return cls(model=spec["model"], args=args, processing_class=tok,
               train_dataset=pairs(margin=spec.get("margin", False)), **kw)  # fmt: skip


def run(spec: dict) -> dict:
    """Train 3 steps (and evaluate as the spec says); plain data back."""
    grads = _Grads()
    trainer = build(spec, grads)
    trainer.train()
    h = trainer.state.log_history
    out: dict = {
        "loss": [e["loss"] for e in h if "loss" in e],
        "grad_norm": [e["grad_norm"] for e in h if "grad_norm" in e],
        **{k: [e[k] for e in h if "loss" in e] for k in METRICS},
        "grads": grads.steps,
    }
    if spec.get("eval"):
        out["eval"] = {k: v for k, v in trainer.evaluate().items() if "runtime" not in k
                       and "per_second" not in k}  # fmt: skip
    if spec.get("comm"):
        out["comm"] = _comm(trainer)
    assert len(out["loss"]) == 3 and all(math.isfinite(x) for x in out["loss"]), out["loss"]
    return out


def _comm(trainer: Any) -> dict:
    """The collectives of one more reward step on the sp group: forward (the step's
    all-to-alls and the one all-reduce of the rewards) and backward (no all-reduce: each rank
    keeps the gradient of its own piece)."""
    from dtensor_ulysses.debug import CommCounter

    sp_group = trainer._du_dims.sp_group(trainer._du_mesh).get_group()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    trainer.model.train()
    with CommCounter() as fwd:
        loss = trainer.compute_loss(trainer.model, batch)
    with CommCounter() as bwd:
        loss.backward()
    trainer.model.zero_grad(set_to_none=True)
    return {
        "rows": int(batch["input_ids"].shape[0]),
        "fwd_all_reduce": fwd.count("all_reduce", sp_group),
        "fwd_all_reduce_bytes": fwd.bytes("all_reduce", sp_group),
        "fwd_all_to_all": fwd.count("all_to_all", sp_group),
        "bwd_all_reduce": bwd.count("all_reduce", sp_group),
        "bwd_all_to_all": bwd.count("all_to_all", sp_group),
    }


def run_example(argv: list[str]) -> dict:
    """``examples/dpo_trl.py``'s ``main(argv)`` in this process (the example's directory on the
    path, as when it runs as a script): its logged losses."""
    import importlib.util
    import sys
    from pathlib import Path

    examples = Path(__file__).resolve().parents[2] / "examples"
    if str(examples) not in sys.path:
        sys.path.insert(0, str(examples))
    spec = importlib.util.spec_from_file_location("dpo_trl_example", examples / "dpo_trl.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {"loss": module.main(argv)}


def run_specs(rank: int, world: int, specs: list) -> list | None:
    """Several runs in one spawned world; rank 0's results back."""
    import os

    # the group is up already (launch.run_local_world); accelerate still reads these
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    torch.set_num_threads(1)
    results = []
    for spec in specs:
        start = time.perf_counter()
        results.append(run_example(spec["example"]) if "example" in spec else run(spec))
        results[-1]["seconds"] = time.perf_counter() - start
    return results if rank == 0 else None
