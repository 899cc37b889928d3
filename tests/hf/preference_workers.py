"""Per-rank functions for tests/hf/test_preference.py: TRL ``DPOTrainer`` / ``KTOTrainer``
runs, stock or under :func:`~dtensor_ulysses.hf.with_ulysses`, on tiny local checkpoints
(tests/hf_workers.py); each returns every logged value and the first step's full gradients.
Also the primitive on a sharded model (``hf.token_rows`` / ``hf.sequence_logps``)."""

from __future__ import annotations

import math
from typing import Any

import torch

from tests.hf.trainer_workers import TEXTS

# every DPO loss type of TRL 1.16, weighted: the combined loss (with the sft term)
ALL_DPO_LOSSES = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair",
                  "sppo_hard", "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft",
                  "sigmoid_norm"]  # fmt: skip
# values a log entry has that are not training results
_NOT_RESULTS = {"step"}


# rows shorter than sp (issue 47): prompt + completion of 1 ("": the end token alone), 2, 3,
# 5, 6 or 9 tokens, so that each DPO step (one pair) has 1, 3, 5, 6, 9 or 2 columns and each
# KTO batch of 2 rows 1 to 6 (never 4): every cut over sp=4 leaves a rank empty, and the
# first DPO pair (1 column) one over sp=2 too
SHORT_DPO = [("", "", ""), ("a", "", " a"), ("", " foxes", " a"), ("a", " all", " foxes"),
             ("", " all counts", " dog"), ("a", "", "")]  # fmt: skip
SHORT_KTO = [("", "", True), ("a", "", False), ("", " a", True), ("a", " a", False),
             ("", " foxes", True), ("a", " foxes", False)]  # fmt: skip


def _rows(kind: str, short: bool = False) -> list[dict]:
    if short and kind == "dpo":
        return [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in SHORT_DPO]
    if short:
        return [{"prompt": p, "completion": c, "label": y} for p, c, y in SHORT_KTO]
    rows = []
    for i, t in enumerate(TEXTS[:16]):
        words = t.split()
        k = 2 + i % 3  # prompts of 2..4 words, completions of uneven lengths
        prompt, rest = " ".join(words[:k]), words[k:]
        other = TEXTS[(i + 5) % len(TEXTS)].split()[: 1 + i % 4]
        if kind == "dpo":
            rows.append({"prompt": prompt, "chosen": " " + " ".join(rest),
                         "rejected": " " + " ".join(other)})  # fmt: skip
        else:
            good = i % 3 != 1
            rows.append({"prompt": prompt, "completion": " " + " ".join(rest if good else other),
                         "label": good})  # fmt: skip
    return rows


def build(spec: dict, grads: Any = None) -> Any:
    """A DPO or KTO trainer as the spec says (``sp`` None: the stock class)."""
    import transformers as tf
    import trl

    from dtensor_ulysses.hf import with_ulysses

    tok = tf.AutoTokenizer.from_pretrained(spec["tok"])
    model = tf.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32,
                                                    attn_implementation="sdpa")  # fmt: skip
    common = dict(
        output_dir=spec["out"], per_device_train_batch_size=spec.get("batch", 4),
        gradient_accumulation_steps=spec.get("ga", 1), max_steps=spec.get("steps", 3),
        learning_rate=1e-2, logging_steps=1, max_grad_norm=100.0, seed=0, report_to=[],
        save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_drop_last=True,
        bf16=False, gradient_checkpointing=False, max_length=None,
    )  # fmt: skip
    common.update(spec.get("args", {}))  # the case's arguments win
    if spec["kind"] == "dpo":
        args: Any = trl.DPOConfig(**common)
        cls: Any = trl.DPOTrainer
    else:
        args = trl.KTOConfig(**common)
        cls = trl.KTOTrainer
    if spec.get("sp"):
        cls = with_ulysses(cls, spec["sp"], **spec.get("options", {}))
    kw: dict = {"callbacks": [grads]} if grads is not None else {}
    if spec.get("lora"):
        from peft import LoraConfig

        kw["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                       lora_dropout=0.0, task_type="CAUSAL_LM")  # fmt: skip
    if spec.get("eval"):
        kw["eval_dataset"] = _dataset(spec, "eval", _rows(spec["kind"])[: spec["eval"]])
    torch.manual_seed(0)
    rows = _rows(spec["kind"], short=spec.get("short_rows", False))
    return cls(model=model, args=args, train_dataset=_dataset(spec, "train", rows),
               processing_class=tok, **kw)  # fmt: skip


def _dataset(spec: dict, name: str, rows: list) -> Any:
    """The rows as a ``datasets.Dataset``; with ``on_disk`` saved by rank 0 and loaded by every
    rank, so that its cache files (TRL's precomputed reference log-probabilities) are shared."""
    from datasets import Dataset, load_from_disk

    data = Dataset.from_list(rows)
    if not spec.get("on_disk"):
        return data
    import torch.distributed as dist

    path = f"{spec['out']}_data_{name}"
    if not dist.is_initialized() or dist.get_rank() == 0:
        data.save_to_disk(path)
    if dist.is_initialized():
        dist.barrier()
    return load_from_disk(path)


def _grads_callback() -> Any:
    from torch.distributed.tensor import DTensor
    from transformers import TrainerCallback

    class FirstGrads(TrainerCallback):
        """The full gradient of every parameter at the first optimizer step (max_grad_norm is
        above every norm here: no clipping, so a scale error shows in every gradient)."""

        grads: dict | None = None

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            if self.grads is not None:
                return
            out = {}
            for name, p in model.named_parameters():
                if p.grad is not None:
                    g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    out[name] = g.detach().clone()
            self.grads = out

    return FirstGrads()


def _record_first_logps() -> list:
    """Under with_ulysses, keep the per-token log-probabilities the stand-in model hands TRL's
    DPO code in the first step (the reference's call, then the policy's), as TRL receives
    them; a no-op for the stock trainer."""
    from dtensor_ulysses.hf.trainers import preference

    calls: list = []
    stand_in = preference._SlicedLM
    if getattr(stand_in, "_recording", None) is not None:
        stand_in._recording = calls
        return calls
    original = stand_in.__call__

    def recording(self: Any, **kw: Any) -> Any:
        out = original(self, **kw)
        if len(stand_in._recording) < 2:
            stand_in._recording.append((self.stats, out.log_probs.detach().clone()))
        return out

    stand_in.__call__ = recording
    stand_in._recording = calls
    return calls


def _tie(calls: list) -> dict:
    """Per row, the sums TRL takes of the reference's and the policy's log-probabilities at the
    first step (``per_token_logps.sum(dim=1)``), and whether they are bitwise equal."""
    (ref_stats, ref), (pol_stats, pol) = calls
    assert (ref_stats, pol_stats) == (False, True)  # the reference first, then the policy
    ref_sums, pol_sums = ref.sum(dim=1), pol.sum(dim=1)
    return {"equal": bool(torch.equal(ref_sums, pol_sums)) and bool(torch.equal(ref, pol)),
            "max_diff": (ref_sums - pol_sums).abs().max().item()}  # fmt: skip


def run(spec: dict) -> dict:
    """Train; every value of every log entry with a loss, and the first step's gradients."""
    grads = _grads_callback()
    trainer = build(spec, grads)
    tie = spec.get("sp") and spec["kind"] == "dpo" and not spec.get("args", {}).get(
        "precompute_ref_log_probs")  # fmt: skip
    calls = _record_first_logps() if tie else None
    if spec.get("count_comm"):  # the sp group's all-reduces, and the rows of each step
        out_comm = _train_counting(trainer)
    else:
        trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    keys = sorted({k for e in logs for k in e} - _NOT_RESULTS)
    out: dict = {k: [e.get(k) for e in logs] for k in keys}
    out["grads"] = grads.grads
    if calls is not None:
        out["tie"] = _tie(calls)
    if spec.get("count_comm"):
        out["comm"] = out_comm
    out["ref_columns"] = sorted(c for c in trainer.train_dataset.column_names if "ref_" in c)
    if spec.get("eval"):
        out["eval"] = trainer.evaluate()
    assert all(math.isfinite(x) for x in out["loss"]), out["loss"]
    return out


def _train_counting(trainer: Any) -> dict:
    """Train with every collective recorded: the bytes of each all-reduce on the sp group, in
    order, and the ``[B, S]`` shape of each step's batch."""
    from dtensor_ulysses.debug import CommCounter

    shapes: list = []
    compute_loss = trainer.compute_loss

    def recording(model: Any, inputs: dict, *a: Any, **kw: Any) -> Any:
        shapes.append(tuple(inputs["input_ids"].shape))
        return compute_loss(model, inputs, *a, **kw)

    trainer.compute_loss = recording
    sp_group = trainer._du_dims.sp_mesh.get_group().group_name
    with CommCounter() as comm:
        trainer.train()
    sp_reduces = [
        c.bytes for c in comm.calls if c.kind == "all_reduce" and c.group_name == sp_group
    ]
    return {"shapes": shapes, "sp_all_reduce": sp_reduces}


def primitive(spec: dict) -> dict:
    """``hf.token_rows`` / ``hf.sequence_logps`` on a model parallelized at (1, world): values,
    the gradient of a non-linear loss of the sums (full tensors), and the collectives."""
    import torch.distributed as dist
    import transformers as tf
    from torch.distributed.tensor import DTensor

    from dtensor_ulysses import hf, init_mesh
    from dtensor_ulysses.debug import CommCounter

    world = dist.get_world_size()
    mesh = init_mesh(1, world, device_type="cpu")
    model = tf.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    hf.parallelize(model, mesh, mixed_precision=None)
    batch = primitive_batch(short=spec.get("short", False))
    sp_group = mesh["sp"].get_group()
    with CommCounter() as fwd:
        rows, _ = hf.token_rows(model, batch, mesh, chunk_tokens=3, stats=True)
    sums = hf.sequence_logps(model, batch, mesh, chunk_tokens=4)
    loss = primitive_loss(rows[..., 0].sum(1), sums)
    with CommCounter() as bwd:
        loss.backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for n, p in model.named_parameters()}  # fmt: skip
    reduce_fwd = [c.bytes for c in fwd.calls if c.kind == "all_reduce"
                  and c.group_name == sp_group.group_name]  # fmt: skip
    reduce_bwd = [c for c in bwd.calls if c.kind == "all_reduce"]
    return {"rows": rows.detach(), "sums": sums.detach(), "loss": loss.item(), "grads": grads,
            "reduce_fwd": reduce_fwd, "reduce_bwd": len(reduce_bwd)}  # fmt: skip


def primitive_batch(short: bool = False) -> dict:
    """2 rows of 11 tokens, the second right-padded to 7, labels only on a completion; or
    (``short``) of 3 tokens, the second padded to 2: fewer columns than sp = 4."""
    g = torch.Generator().manual_seed(3)
    S, real, prompt = (3, 2, 1) if short else (11, 7, 3)
    ids = torch.randint(3, 90, (2, S), generator=g)
    mask = torch.ones(2, S, dtype=torch.int64)
    mask[1, real:] = 0
    labels = ids.clone()
    labels[:, :prompt] = -100
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def primitive_loss(row_sums: torch.Tensor, seq_sums: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    return -F.logsigmoid(0.3 * (row_sums[0] - seq_sums[1])) + (seq_sums / 20).pow(2).sum()


def run_specs(rank: int, world: int, specs: list) -> list:
    """Several runs in one spawned world; rank 0's results."""
    import os

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    results = []
    for spec in specs:
        if spec.get("world") not in (None, world):
            results.append(None)
            continue
        results.append(primitive(spec) if spec["kind"] == "primitive" else run(spec))
    return results if rank == 0 else []
