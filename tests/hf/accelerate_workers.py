"""Per-rank runs for tests/hf/test_accelerate.py: one stock ``accelerate`` training loop, run
with the stock ``Accelerator`` (one process, or ``dp`` processes) or with
``dtensor_ulysses.hf.UlyssesAccelerator`` (``dp x sp`` processes).

The loop is what a user writes: a model, an AdamW optimizer and a warmup/decay scheduler built
before ``prepare``, ``accumulate`` over 2 micro-batches, ``model(**batch).loss`` (or, with
``tokens``, the model's loss over accelerate's documented global token count),
``accelerator.backward``, ``clip_grad_norm_`` at each synchronizing step, evaluation with
``gather_for_metrics`` (an evaluation set whose last batch is short), ``save_state`` after a
step, ``get_state_dict`` and ``unwrap_model(...).save_pretrained`` at the end; optionally a
LoRA adapter (peft) added to the model before ``prepare``. A resumed run
builds everything anew, ``load_state`` and ``skip_first_batches``, and runs the remaining steps.

What each rank returns (its dp group's view, which is what a stock process at the same dp
logs): every micro-batch's loss, the gradient norm and the full gradient of every parameter at
each optimizer step, the learning rate, the evaluation metrics, and the final weights.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests import hf_workers as W

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
S = 19  # uneven over sp = 2 ([10, 9]) and sp = 4 ([5, 5, 5, 4])
ROWS, EVAL_ROWS = 12, 5  # 3 optimizer steps of 4 rows; eval batches of 2: the last one short
GA, LR = 2, 5e-3
STEPS = ROWS // (2 * GA)  # the global micro-batch is 2 rows (per_device * dp)


def lora_config() -> Any:
    """A LoRA adapter on the attention's query and value projections (B not zero: the
    adapter changes the forward from the first step)."""
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0,
                      target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # fmt: skip


def rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``n`` rows of unequal lengths (right padding to ``S``, labels -100 there), some with a
    masked prompt, some packed as two documents (position ids restarting at 0)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(7, S + 1, (1,), generator=g))
        ids = torch.randint(1, W.SMALL["vocab_size"], (S,), generator=g)
        ids[length:] = 0
        mask = (torch.arange(S) < length).long()
        labels = ids.clone()
        labels[length:] = -100
        if i % 3 == 1:  # a prompt without loss
            labels[: length // 2] = -100
        pos = torch.arange(S)
        if i % 4 == 2 and length > 8:  # two packed documents
            cut = length // 2
            pos[cut:] = torch.arange(S - cut)
            labels[cut] = -100
        out.append(dict(input_ids=ids, attention_mask=mask, labels=labels, position_ids=pos))
    return out


def collate(batch: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([r[k] for r in batch]) for k in batch[0]}


def collate_unmasked(batch: list[dict]) -> dict[str, torch.Tensor]:
    """Without ``attention_mask`` (padding-free style): with ``use_cache=False`` the stock
    model keeps the packed documents apart by their position ids."""
    out = collate(batch)
    del out["attention_mask"]
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _grads(model: Any) -> dict[str, list[float]]:
    """The full gradient of every parameter (a collective on every rank under the door)."""
    return {
        n.removeprefix("module."): _full(p.grad).flatten().tolist()
        for n, p in model.named_parameters()
        if p.requires_grad  # a LoRA model's: the adapter's
    }  # DDP (the stock loop) adds "module."


def _evaluate(acc: Any, model: Any, loader: Any, cut: bool = False) -> dict[str, float]:
    """The held-out loss (each batch's, per row; ``cut``: gathered with ``gather`` and cut to
    the dataset's length, as older transformers examples do), and the gathered logits and
    labels as metrics read them (their sums, and the top-1 accuracy)."""
    model.eval()
    losses, logit_sum, logit_abs, label_sum, correct, count = [], 0.0, 0.0, 0, 0, 0
    with torch.no_grad():
        for batch in loader:
            out = model(**batch)
            per_row = out.loss.reshape(1).repeat(len(batch["labels"]))
            losses.append(acc.gather(per_row) if cut else acc.gather_for_metrics(per_row))
            logits, labels, mask = acc.gather_for_metrics(
                (out.logits, batch["labels"], batch["attention_mask"])
            )
            # the real tokens' logits (a padded position's is the stock kernel's own matter)
            real = logits.double()[mask.bool()]
            logit_sum += real.sum().item()
            logit_abs += real.abs().sum().item()
            label_sum += int(labels.sum())
            valid = labels[:, 1:] != -100
            correct += int((logits.argmax(-1)[:, :-1] == labels[:, 1:])[valid].sum())
            count += int(valid.sum())
    model.train()
    per_row = torch.cat(losses)[: len(loader.dataset)]
    return {"loss": per_row.mean().item(), "rows": len(per_row), "logit_sum": logit_sum,
            "logit_abs": logit_abs, "label_sum": label_sum,
            "accuracy": correct / count}  # fmt: skip


def run(spec: dict) -> dict:
    """One loop; ``spec``: ``door`` (the UlyssesAccelerator with ``sp`` / ``config``) or the
    stock one, ``model`` (directory), ``per_device`` rows, ``steps`` to run, ``save_at`` /
    ``ckpt`` (``save_state`` after that step), ``resume`` (a checkpoint: load it and run the
    steps after it), ``tokens`` (the loss over the global token count), ``final`` (a
    directory for ``save_pretrained``), ``lora`` (a LoRA adapter added before ``prepare``)."""
    from accelerate import Accelerator
    from accelerate.utils import ParallelismConfig
    from transformers import AutoModelForCausalLM, get_linear_schedule_with_warmup

    if spec.get("door"):
        from dtensor_ulysses.hf import UlyssesAccelerator

        kw: dict[str, Any] = {}
        if spec.get("cp"):  # the degree as accelerate users give it
            kw["parallelism_config"] = ParallelismConfig(cp_size=spec["cp"])
        elif spec.get("sp"):
            kw["sp"] = spec["sp"]  # else: from the launch's accelerate config
        acc = UlyssesAccelerator(gradient_accumulation_steps=GA, **kw)
    else:  # accelerate's plain multi-process loop (DDP): a launch's FSDP / cp keys are the door's
        names = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG")
        saved = {n: os.environ.pop(n) for n in names if n in os.environ}
        try:
            acc = Accelerator(gradient_accumulation_steps=GA, cpu=True)
        finally:
            os.environ.update(saved)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    if spec.get("lora"):  # a LoRA adapter added before prepare, as peft's examples do
        from peft import get_peft_model

        # initialized from a stream per process: under the door the ranks differ until prepare
        # makes them rank 0's (as DDP does), which is the stock process's
        torch.manual_seed(1 + acc.process_index)
        model = get_peft_model(model, lora_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    # accelerate's scheduler steps once per process per optimizer step: lengths scaled by
    # num_processes, as transformers' no_trainer examples scale them
    n_proc = acc.num_processes
    scheduler = get_linear_schedule_with_warmup(optimizer, n_proc, 4 * STEPS * n_proc)
    per_device = spec["per_device"]
    tokens = spec.get("tokens", False)
    train = torch.utils.data.DataLoader(
        rows(ROWS, 1), batch_size=per_device, collate_fn=collate_unmasked if tokens else collate
    )
    evals = torch.utils.data.DataLoader(rows(EVAL_ROWS, 2), batch_size=2, collate_fn=collate)
    model, optimizer, train, evals, scheduler = acc.prepare(
        model, optimizer, train, evals, scheduler
    )
    out: dict[str, Any] = {"loss": [], "norm": [], "lr": [], "grads": [], "eval": []}
    start = 0
    if spec.get("resume"):
        acc.load_state(spec["resume"])
        start = spec["save_at"]
        train = acc.skip_first_batches(train, start * GA)
    step = start
    for batch in train:
        with acc.accumulate(model):
            if tokens:  # accelerate's recipe: the loss over a token count gathered by hand
                local = (batch["labels"][:, 1:] != -100).sum()
                n = acc.gather(local.reshape(1)).sum() * GA
                out.setdefault("count", []).append(int(n))
                outputs = model(**batch, use_cache=False, num_items_in_batch=n)
                loss = outputs.loss * GA * acc.num_processes
            else:
                outputs = model(**batch)
                loss = outputs.loss
            out["loss"].append(loss.item())
            if outputs.get("aux_loss") is not None:  # a Mixture-of-Experts model's router loss
                out.setdefault("aux", []).append(outputs.aux_loss.item())
            acc.backward(loss)
            if acc.sync_gradients:
                out["grads"].append(_grads(model))
                out["norm"].append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if acc.sync_gradients:
            step += 1
            out["lr"].append(scheduler.get_last_lr()[0])
            if step in spec.get("eval_at", ()):
                out["eval"].append(_evaluate(acc, model, evals, cut=tokens))
            if step == spec.get("save_at") and spec.get("ckpt"):
                acc.save_state(spec["ckpt"])
            if step == spec.get("steps", STEPS):
                break
    state = acc.get_state_dict(model)
    if acc.is_main_process:
        out["weights"] = {k: v.flatten().tolist() for k, v in state.items()}
    if spec.get("final"):
        acc.unwrap_model(model).save_pretrained(spec["final"])
        acc.wait_for_everyone()
    return out


def run_specs(rank: int, world: int, specs: list) -> list:
    """Several loops in one world (a world costs seconds to start); ``{"example": argv}`` runs
    examples/accelerate_loop.py with ``argv`` and returns what it printed."""
    from accelerate.state import AcceleratorState, GradientState

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # the group is up; accelerate reads it
    os.environ.setdefault("MASTER_PORT", "29513")
    results = []
    for spec in specs:
        if spec.get("probe"):
            results.append(probe(spec))
        elif spec.get("example"):
            results.append(run_example(spec["example"]))
        else:
            results.append(run(spec))
        AcceleratorState._reset_state()  # the next loop builds its accelerator anew
        GradientState._reset_state()
        dist.barrier()
    return results


def run_example(argv: list[str]) -> list[str]:
    """examples/accelerate_loop.py with ``argv`` in this process: the lines it printed."""
    import contextlib
    import io
    import runpy
    import sys

    example = EXAMPLES / "accelerate_loop.py"
    saved = sys.argv, list(sys.path)
    sys.argv, out = [str(example), *argv], io.StringIO()
    sys.path.insert(0, str(EXAMPLES))
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(example), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved
    return out.getvalue().splitlines()


def main(argv: list[str]) -> None:
    """``python tests/hf/accelerate_workers.py SPECS.json OUT_DIR`` under a launcher (e.g.
    ``accelerate launch --config_file ...``): the specs' results, one JSON file per rank."""
    specs = json.loads(Path(argv[0]).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = run_specs(rank, world, specs)
    Path(argv[1], f"rank{rank}.json").write_text(json.dumps(results))


def probe(spec: dict) -> dict:
    """At (1, 2): the collectives of one training and one evaluation forward (which, on which
    group, how many bytes), and the refusals of prepare and of the model's forward, as text."""
    from peft import PromptTuningConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from dtensor_ulysses.debug import CommCounter
    from dtensor_ulysses.hf import UlyssesAccelerator

    acc = UlyssesAccelerator()  # the degree from the launch's accelerate config: cp_size 2
    model = acc.prepare(AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32))
    sp_group = acc.torch_device_mesh["sp"].get_group()
    batch = collate(rows(2, 3))
    out: dict[str, Any] = {"mesh": acc.torch_device_mesh.mesh_dim_names}
    with CommCounter() as train:
        model(**batch).loss.backward()
    model.eval()
    with CommCounter() as evaluation, torch.no_grad():
        logits = model(**batch).logits
    model.train()
    out["logits_shape"] = tuple(logits.shape)
    # every collective on the sp group (at dp = 1 FSDP2's group holds the same ranks)
    out["train"] = [(c.kind, c.op, c.bytes) for c in train.calls
                    if c.group_name == sp_group.group_name]  # fmt: skip
    out["eval"] = [(c.kind, c.op, c.bytes) for c in evaluation.calls
                   if c.group_name == sp_group.group_name]  # fmt: skip

    def refused(fn: Any) -> str:
        try:
            fn()
        except ValueError as e:
            return f"{type(e).__name__}: {e}"
        return "not refused"

    left = collate(rows(2, 3))
    left["input_ids"], left["labels"] = left["input_ids"].flip(1), left["labels"].flip(1)
    left["attention_mask"] = left["attention_mask"].flip(1)
    shifted = collate(rows(2, 3))
    shifted["shift_labels"] = torch.full_like(shifted.pop("labels"), 5)  # a last-column target
    cfg = AutoConfig.for_model("llama", **W.SMALL, attention_dropout=0.1)
    classifier = AutoModelForSequenceClassification.from_config(
        AutoConfig.for_model("llama", **W.SMALL, pad_token_id=0)
    )
    iterable = torch.utils.data.DataLoader(_Stream(), batch_size=2)
    virtual = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
    prompt_tuned = get_peft_model(AutoModelForCausalLM.from_pretrained(spec["model"]), virtual)
    out["refusals"] = {
        "batch key": refused(lambda: model(**batch, token_type_ids=batch["input_ids"] * 0)),
        "left padding": refused(lambda: model(**left)),
        "shift_labels": refused(lambda: model(**shifted)),
        "dropout": refused(lambda: acc.prepare(AutoModelForCausalLM.from_config(cfg))),
        "classifier": refused(lambda: acc.prepare(classifier)),
        "dispatch": refused(lambda: acc.prepare(iterable)),
        "prompt tuning": refused(lambda: acc.prepare(prompt_tuned)),
    }
    return out


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(rows(4, 5))


if __name__ == "__main__":  # with the repository root on PYTHONPATH (tests.* by module path)
    main(sys.argv[1:])
