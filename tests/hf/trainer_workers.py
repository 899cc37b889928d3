"""Per-rank functions for tests/hf/test_trainer.py: one transformers ``Trainer`` or TRL
``SFTTrainer`` run, with or without :func:`~dtensor_ulysses.hf.with_ulysses`, on tiny local
checkpoints (tests/hf_workers.py) and a tokenizer trained on the spot."""

from __future__ import annotations

import math
from typing import Any

import torch

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "a long context model reads every token of the sequence",
    "sequence parallel attention splits the sequence over ranks",
    "the heads inside attention are split too",
    "the lazy dog sleeps",
    "every token counts in the loss of a long context model",
    "ranks hold slices of the sequence and all heads of it",
    "quick brown foxes read long sequences",
] * 4


# rows shorter than sp, and rows whose cut over sp=4 leaves the last rank empty (issue 47):
# with TRL's end-of-text token 1, 2, 3, 5, 6 and 9 tokens ("": the end token alone); as
# transformers.Trainer rows (no end token) 1, 2, 3, 5, 6 and 9 tokens
SHORT_TEXTS = ["", "a", "all", "foxes", "slices", "all counts"]
SHORT_ROWS = ["a", "all", "a all", "slices", "counts", "every token counts"]
# the 7th row of an evaluation in batches of 3 (a partial last batch)
EVAL_TAIL = "the heads inside attention are split too"


def _conv(*turns: str) -> list[dict]:
    return [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]


CONVS = [
    _conv("the quick fox", "jumps over the lazy dog"),
    _conv("a long context", "model", "reads every", "token of the sequence"),
    _conv("sequence parallel attention", "splits the sequence"),
    _conv("the heads", "inside attention are split too"),
] * 8


def _data(kind: str, tok: Any, n: int | None = None):
    from datasets import Dataset

    if kind == "trainer":
        rows = [{"input_ids": tok(t)["input_ids"]} for t in TEXTS]
    elif kind == "masked":  # 8 tokens, the first 5 without loss: sp rank 0 of 2 has no target
        rows = []
        for t in TEXTS:
            ids = tok(t)["input_ids"][:8]
            assert len(ids) == 8, len(ids)
            rows.append({"input_ids": ids, "labels": [-100] * 5 + ids[5:]})
    elif kind == "sft_chat":
        rows = [{"messages": m} for m in CONVS]
    elif kind == "short_sft":  # text rows, not packed
        rows = [{"text": t} for t in [*SHORT_TEXTS, EVAL_TAIL]]
    elif kind == "short_trainer":
        rows = [{"input_ids": tok(t)["input_ids"]} for t in [*SHORT_ROWS, EVAL_TAIL]]
    else:  # packed text
        rows = [{"text": t} for t in TEXTS]
    if kind.startswith("short") and not n:  # training: the short rows alone
        n = len(rows) - 1
    return Dataset.from_list(rows[:n] if n else rows)


def build(spec: dict) -> Any:
    """A trainer as the spec says (``sp`` None: the stock class, no Ulysses)."""
    import transformers as tf
    import trl

    from dtensor_ulysses.hf import with_ulysses

    tok = tf.AutoTokenizer.from_pretrained(spec["tok"])
    attn = spec.get("attn", "sdpa")
    model = tf.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32,
                                                    attn_implementation=attn)  # fmt: skip
    if spec.get("rank_noise") and torch.distributed.get_rank() != 0:
        with torch.no_grad():  # other weights than rank 0's (a head initialized per rank)
            for p in model.parameters():
                p.add_(0.1)
    kind = spec["kind"]
    common = dict(
        output_dir=spec["out"], per_device_train_batch_size=spec.get("batch", 4),
        per_device_eval_batch_size=spec.get("eval_batch", 4),
        gradient_accumulation_steps=spec.get("ga", 1), max_steps=spec.get("steps", 3),
        learning_rate=1e-2, logging_steps=1, max_grad_norm=1.0, lr_scheduler_type="linear",
        weight_decay=0.1, seed=0, report_to=[], save_strategy=spec.get("save", "no"),
        save_steps=spec.get("save_steps", 2), use_cpu=True, disable_tqdm=True,
        dataloader_drop_last=spec.get("drop_last", True), bf16=False,
        include_num_input_tokens_seen="non_padding", **spec.get("args", {}),
    )  # fmt: skip
    collator = None
    if kind in ("trainer", "masked", "short_trainer"):
        args = tf.TrainingArguments(**common)
        collator = (
            tf.DataCollatorForSeq2Seq(tok, padding=True)
            if kind == "masked"
            else tf.DataCollatorForLanguageModeling(tok, mlm=False)
        )
        cls: Any = tf.Trainer
    elif kind == "sft_chat":
        args = trl.SFTConfig(**common, assistant_only_loss=True, max_length=40)
        cls = trl.SFTTrainer
    elif kind == "short_sft":
        args = trl.SFTConfig(**common, max_length=40)
        cls = trl.SFTTrainer
    else:
        args = trl.SFTConfig(**common, packing=True, padding_free=True, max_length=24)
        cls = trl.SFTTrainer
    if spec.get("sp"):
        cls = with_ulysses(cls, spec["sp"], **spec.get("options", {}))
    kw: dict = {}
    if spec.get("lora"):
        from peft import LoraConfig

        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                          lora_dropout=0.0, task_type="CAUSAL_LM")  # fmt: skip
        if kind == "trainer":
            from peft import get_peft_model

            torch.manual_seed(0)
            model = get_peft_model(model, lora)
        else:
            kw["peft_config"] = lora
    if spec.get("eval"):
        kw["eval_dataset"] = _data(kind, tok, spec["eval"])
    if spec.get("metrics"):
        kw["compute_metrics"] = _label_metrics
    if spec.get("grads"):
        kw["callbacks"] = [_StepGrads()]
    torch.manual_seed(0)
    return cls(model=model, args=args, train_dataset=_data(kind, tok), processing_class=tok,
               data_collator=collator, **kw)  # fmt: skip


def _StepGrads() -> Any:
    """A callback keeping every parameter's full gradient at every optimizer step (before
    clipping), by parameter name (a PEFT or FSDP2 prefix is the same on both sides)."""
    from torch.distributed.tensor import DTensor
    from transformers import TrainerCallback

    class StepGrads(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[dict] = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            grads = {}
            for name, p in model.named_parameters():
                if p.grad is not None:
                    g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    grads[name] = g.detach().clone()
            self.steps.append(grads)

    return StepGrads()


def _label_metrics(pred: Any) -> dict:
    """Token accuracy of the next-token argmax against ``labels`` (what metrics see)."""
    logits, labels = pred.predictions, pred.label_ids
    logits = logits[0] if isinstance(logits, tuple) else logits
    import numpy as np

    guess = np.asarray(logits)[:, :-1].argmax(-1)
    target = np.asarray(labels)[:, 1:]
    valid = target != -100
    return {"acc": float((guess == target)[valid].mean()), "n_labels": float(valid.sum())}


def _history(trainer: Any) -> dict:
    h = trainer.state.log_history
    return {
        "loss": [e["loss"] for e in h if "loss" in e],
        "grad_norm": [e["grad_norm"] for e in h if "grad_norm" in e],
        "lr": [e["learning_rate"] for e in h if "learning_rate" in e],
        "tokens_seen": [e["num_input_tokens_seen"] for e in h if "loss" in e],
        # TRL's SFT metrics (absent for transformers.Trainer)
        **{k: [e[k] for e in h if "loss" in e and k in e] for k in TRL_METRICS},
    }


TRL_METRICS = ("entropy", "mean_token_accuracy", "num_tokens")


def _logit_rows(vocab: int, hidden: int):
    """A dispatch mode recording the most rows of any ``[..., vocab]`` tensor an op makes (the
    logits, their softmax and gradient): the tiled loss keeps it at its chunk. The output
    weight's transpose and its gradient, ``[hidden, vocab]``, are not logits."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Rows(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if (
                    isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == vocab
                    and tuple(t.shape) != (hidden, vocab)
                ):  # fmt: skip
                    Rows.most = max(Rows.most, t.numel() // vocab)
            return out

    return Rows()


def run(spec: dict) -> dict:
    """Train (and evaluate / save / resume as the spec says); plain data back."""
    out: dict = {}
    if spec.get("capture_stdout"):  # what construction prints (with_ulysses' start line)
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            trainer = build(spec)
        out["stdout"] = buf.getvalue()
    else:
        trainer = build(spec)
    if spec.get("eval_first"):
        out["eval"] = trainer.evaluate()
    if spec.get("count_logit_rows"):
        cfg = trainer.model.config
        rows = _logit_rows(cfg.vocab_size, cfg.hidden_size)
        with rows:
            trainer.train(resume_from_checkpoint=spec.get("resume"))
        out["logit_rows"] = rows.most
    else:
        trainer.train(resume_from_checkpoint=spec.get("resume"))
    out.update(_history(trainer))
    if spec.get("grads"):
        out["grads"] = next(c for c in trainer.callback_handler.callbacks
                            if hasattr(c, "steps")).steps  # fmt: skip
    if spec.get("eval"):
        out["eval_after"] = trainer.evaluate()
    if spec.get("save_to"):
        trainer.save_model(spec["save_to"])
    assert all(math.isfinite(x) for x in out["loss"]), out["loss"]
    return out


def run_specs(rank: int, world: int, specs: list) -> list:
    """Several runs in one spawned world (a world costs seconds to start)."""
    import os

    # the group is up already (launch.run_local_world); accelerate still reads these
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    import time

    results = []
    for spec in specs:
        start = time.perf_counter()
        try:
            results.append(run(spec))
            results[-1]["seconds"] = time.perf_counter() - start
        except Exception as e:  # refusals and failures come back as text, in order
            if not spec.get("expect_error"):
                raise
            results.append({"error": f"{type(e).__name__}: {e}"})
    if rank == 0:
        return results
    # the other ranks: only what construction printed, where it was captured
    return [{"stdout": r["stdout"]} if "stdout" in r else None for r in results]
