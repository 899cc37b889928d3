"""Per-rank functions for tests/hf/test_distill.py: one TRL ``DistillationTrainer`` run, stock or
under :func:`~dtensor_ulysses.hf.with_ulysses`, on tiny local checkpoints (a Llama student, a
larger Qwen3 teacher or a Llama teacher of the student's size) and the RL tests' prompts and
tokenizer (tests/hf/rl_workers.py, tests/hf_workers.py), with greedy decoding."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from tests.hf import rl_workers as R

# one-token prompts: with completions of at most 2 tokens every row is shorter than sp = 4
SHORT_PROMPTS = ["the", "a", "heads", "ranks"]
LOGGED = ("loss", "entropy", "completions/mean_length", "completions/min_length",
          "completions/max_length", "completions/clipped_ratio",
          "completions/mean_terminated_length", "completions/min_terminated_length",
          "completions/max_terminated_length", "grad_norm", "num_tokens")  # fmt: skip
TOOL_LOGGED = ("tools/call_frequency", "tools/failure_frequency")
EVAL_LOGGED = ("eval_loss", "eval_entropy", "eval_completions/mean_length",
               "eval_completions/max_length")  # fmt: skip


def save_teacher(directory: Path, seed: int = 5) -> str:
    """A tiny Qwen3 larger than the student (wider, deeper, its own head dim) with the
    student's vocabulary, every weight perturbed."""
    import transformers as tf

    from tests import hf_workers as W

    torch.manual_seed(seed)
    small = W.SMALL
    cfg = tf.Qwen3Config(
        vocab_size=small["vocab_size"], hidden_size=48, intermediate_size=96,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
        max_position_embeddings=small["max_position_embeddings"], tie_word_embeddings=False,
    )  # fmt: skip
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)
    return str(directory)


def build(spec: dict) -> Any:
    """A trainer as the spec says (``sp`` None: the stock class). ``tools``: the RL tests'
    agent (tests/hf/rl_agents.py: its tokenizer, a student scripted to call the counting ``add``
    tool, chat prompts)."""
    import transformers as tf
    import trl
    from datasets import Dataset

    from dtensor_ulysses.hf import with_ulysses
    from tests.hf import rl_agents as A

    tok = tf.AutoTokenizer.from_pretrained(spec["tok"])
    tok.padding_side = "left"
    model = tf.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    extra: dict = {}
    if spec.get("tools"):
        A.Script(model, tok)
        extra.update(tools=[A.add])
        kw_tools = {"max_tool_calling_iterations": spec["tools"]}
        rows = [{"prompt": [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": q}]} for q in A.QUESTIONS]  # fmt: skip
    else:
        # many stop tokens: completions of unequal lengths
        model.generation_config.eos_token_id = [tok.eos_token_id, *range(10, 40)]
        kw_tools = {}
        rows = [{"prompt": p} for p in spec.get("prompts", R.PROMPTS)]
    teacher: Any = spec["teacher"]
    kw: dict = {}
    if spec.get("teacher_as_model"):
        teacher = tf.AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    else:
        kw["teacher_model_init_kwargs"] = {"dtype": "float32"}
    common = dict(
        output_dir=spec["out"], use_cpu=True, report_to=[], max_steps=spec.get("steps", 3),
        logging_steps=1, save_strategy="no", learning_rate=spec.get("lr", 0.5), optim="sgd",
        bf16=False, seed=0, per_device_train_batch_size=spec["per_device"],
        max_completion_length=spec.get("max_completion_length", 6),
        temperature=spec.get("temperature", 1.0), beta=spec["beta"], disable_tqdm=True,
        gradient_checkpointing=False, generation_kwargs={"do_sample": False},
        gradient_accumulation_steps=spec.get("accumulation", 1), **kw, **kw_tools,
    )  # fmt: skip
    if spec.get("eval"):  # evaluation at step 2, on the prompts
        common.update(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    args = trl.DistillationConfig(**common)
    cls: Any = R.recording(trl.DistillationTrainer)
    if spec.get("sp"):
        cls = with_ulysses(cls, sp=spec["sp"])
    data = Dataset.from_list(rows)
    grads = R._Grads()
    trainer = cls(model=model, teacher_model=teacher, args=args, train_dataset=data,
                  processing_class=tok, callbacks=[grads],
                  eval_dataset=data if spec.get("eval") else None,
                  peft_config=R._lora() if spec.get("lora") else None, **extra)  # fmt: skip
    trainer._du_test_grads = grads
    if spec.get("eval"):  # TRL's LogCompletionsCallback: sampled completions at every eval step
        gen = tf.GenerationConfig(max_new_tokens=4, do_sample=True, temperature=0.7)
        trainer._du_test_logged = trl.LogCompletionsCallback(trainer, gen, num_prompts=3)
        trainer.add_callback(trainer._du_test_logged)
    return trainer


def run(spec: dict) -> dict:
    """Train; the logged history, every step's full gradients of a few parameters, and (under
    with_ulysses) what the teacher holds."""
    if spec.get("count"):  # the agent's tool counts its calls per rank
        os.environ["DU_RL_COUNT"] = spec["count"]
    try:
        trainer = build(spec)
        trainer.train()
    finally:
        os.environ.pop("DU_RL_COUNT", None)
    hist = [h for h in trainer.state.log_history if "loss" in h]
    out: dict = {k: [h.get(k) for h in hist] for k in LOGGED}
    out["grads"] = [{k: v.tolist() for k, v in row.items()} for row in trainer._du_test_grads.steps]
    out["eval"] = [{k: v for k, v in h.items() if k in EVAL_LOGGED}
                   for h in trainer.state.log_history if "eval_loss" in h]  # fmt: skip
    out["tokens_seen"] = trainer.state.num_input_tokens_seen
    logged = trainer.__dict__.get("_du_test_logged")
    out["logged_completions"] = None if logged is None else [list(r) for r in logged.table]
    out["rounds"] = trainer.__dict__.get("_du_test_rounds", [])
    for k in TOOL_LOGGED:
        out[k] = [h.get(k) for h in hist]
    assert all(math.isfinite(x) for x in out["loss"]), out["loss"]
    if spec.get("sp"):
        from torch.distributed.fsdp import FSDPModule

        teacher = trainer.teacher_model
        optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
        out["teacher"] = {
            "sharded": isinstance(teacher, FSDPModule),
            "frozen": not any(p.requires_grad or p.grad is not None for p in teacher.parameters()),
            "optimized": any(id(p) in optimized for p in teacher.parameters()),
            "class": type(teacher.config).__name__,
        }
    return out


def comm(spec: dict) -> dict:
    """The collectives of one rollout and of one loss (forward, backward) on the sp group."""
    from torch.distributed.fsdp import FSDPModule

    from dtensor_ulysses.debug import CommCounter

    trainer = build(spec)
    trainer.model.train()
    group = trainer._du_dims.sp_mesh.get_group()
    sp = group.group_name
    batches = iter(trainer.get_train_dataloader())
    trainer._prepare_inputs(next(batches))  # the first round (FSDP2's lazy initialization)
    with CommCounter() as rollout:
        inputs = trainer._generate_and_score_completions(next(batches))
    with CommCounter() as forward:
        loss = trainer.compute_loss(trainer.model, inputs)
    with CommCounter() as backward:
        loss.backward()
    return {
        "rollout_sp": [rollout.count("all_gather", group), rollout.count(None, group)],
        "fsdp_units": sum(isinstance(m, FSDPModule) for m in trainer.model.modules()),
        "rollout_sp_kinds": _kinds(rollout, sp),
        "loss_all_reduce": [forward.count("all_reduce", group), forward.bytes("all_reduce", group)],
        "loss_sp_kinds": _kinds(forward, sp),
        "backward_all_reduce": backward.count("all_reduce", group),
    }


def _kinds(counter: Any, group_name: str) -> list[str]:
    """The kinds of collective on the group, FSDP2's weight all-gathers left out (at dp = 1
    the sp group spans the world, as FSDP2's does)."""
    return sorted({c.kind for c in counter.calls if c.group_name == group_name} - {"all_gather"})


def run_specs(rank: int, world: int, specs: list) -> list:
    """Several runs in one spawned world; rank 0's results."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ["RANK"] = str(rank)
    torch.set_num_threads(1)
    results = [R.refused(spec, build) if spec.get("refused") else comm(spec) if spec.get("comm")
               else run(spec) for spec in specs]  # fmt: skip
    return results if rank == 0 else [None] * len(results)
