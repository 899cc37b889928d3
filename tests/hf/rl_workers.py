"""Per-rank functions for tests/hf/test_rl.py: one TRL ``GRPOTrainer`` / ``RLOOTrainer`` run, stock
or under :func:`~dtensor_ulysses.hf.with_ulysses`, on a tiny local checkpoint and tokenizer
(tests/hf_workers.py), with rule rewards and a reward function that counts its calls."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# prompts of unequal lengths (left padding), a rule reward on the completion text
PROMPTS = [
    "the quick brown fox",
    "a long context model reads",
    "sequence parallel attention splits",
    "the heads",
    "the lazy dog sleeps and",
    "every token counts in",
    "ranks hold slices of",
    "quick brown foxes read long",
]
GRAD_PARAMS = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
               "model.layers.1.mlp.down_proj.weight", "lm_head.weight")  # fmt: skip
_LORA = "base_model.model.model.layers.{}.self_attn.{}.lora_{}.default.weight"
LORA_GRAD_PARAMS = (_LORA.format(0, "q_proj", "A"), _LORA.format(1, "v_proj", "B"))
VL_GRAD_PARAMS = ("model.visual.blocks.0.attn.qkv.weight", "lm_head.weight",
                  "model.language_model.layers.0.self_attn.q_proj.weight")  # fmt: skip


def save_reward_model(directory: Path, tok_dir: str) -> str:
    """A tiny random sequence-classification model (one label) with the tokenizer beside it."""
    import transformers as tf

    from tests import hf_workers as W

    torch.manual_seed(3)
    cfg = W.make_config("llama")
    cfg.num_labels, cfg.pad_token_id = 1, 0
    tf.LlamaForSequenceClassification(cfg).save_pretrained(directory)
    tf.AutoTokenizer.from_pretrained(tok_dir).save_pretrained(directory)
    return str(directory)


def reward_the(completions: list, **_: Any) -> list[float]:
    """A rule reward: how often "the" appears, minus a length term."""
    return [c.split().count("the") - 0.1 * len(c.split()) for c in completions]


def reward_counted(completions: list, completion_ids: list, **_: Any) -> list[float]:
    """A second reward (shorter is better) that records each call on its rank: how many
    completions, and the longest in tokens."""
    path = os.environ.get("DU_RL_COUNT")
    if path:
        with open(f"{path}.{os.environ.get('RANK', '0')}", "a") as f:
            f.write(json.dumps([len(completions), max(len(c) for c in completion_ids)]) + "\n")
    return [-len(c) / 10.0 for c in completions]


class _Grads:
    """A trainer callback: the full gradient of a few parameters before each optimizer step."""

    def __new__(cls):
        import transformers as tf

        class Grads(tf.TrainerCallback):
            def __init__(self) -> None:
                self.steps: list[dict] = []

            def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
                from torch.distributed.tensor import DTensor

                named = dict(model.named_parameters())
                row = {}
                if VL_GRAD_PARAMS[0] in named:
                    names = VL_GRAD_PARAMS
                else:
                    names = GRAD_PARAMS if "lm_head.weight" in named else LORA_GRAD_PARAMS
                for name in names:
                    g = named[name].grad
                    if isinstance(g, DTensor):
                        g = g.full_tensor()
                    row[name] = g.detach().clone().cpu()
                self.steps.append(row)

        return Grads()


def reward_chat(completions: list, **_: Any) -> list[float]:
    """A rule reward on conversational completions: the length of their messages' text."""
    return [0.05 * sum(len(m.get("content") or "") for m in c) for c in completions]


SHORT_PROMPTS = ["the", "a", "heads", "every"]  # one token each: prompt + completion < sp=4


def recording(cls: type) -> type:
    """``cls`` that keeps each round's completions, tool masks and advantages (where the trainer
    has them: the distillation trainer has none)."""

    class Recording(cls):  # type: ignore[valid-type, misc]
        def _generate_and_score_completions(self, inputs: Any) -> Any:
            out = super()._generate_and_score_completions(inputs)
            mask = out.get("tool_mask")
            self.__dict__.setdefault("_du_test_rounds", []).append({
                "completion_ids": out["completion_ids"].tolist(),
                "tool_mask": None if mask is None else mask.tolist(),
                **({"advantages": out["advantages"].tolist()} if "advantages" in out else {}),
            })  # fmt: skip
            return out

    Recording.__name__ = f"Recording{cls.__name__}"
    return Recording


def assert_grads_close(got: list[dict], ref: list[dict], steps: int, rtol: float) -> None:
    """Every step's recorded gradients (:class:`_Grads` rows, as lists) of ``got`` equal
    ``ref``'s: the same parameters, each within ``rtol`` of ``ref``'s largest entry (+ 1e-7)."""
    assert len(got) == len(ref) == steps
    for step, (g, r) in enumerate(zip(got, ref)):
        assert g.keys() == r.keys()
        for name in r:
            x, y = torch.tensor(g[name]), torch.tensor(r[name])
            tol = rtol * y.abs().max().item() + 1e-7
            assert (x - y).abs().max().item() <= tol, (step, name)


MEMBER_WORDS = ("", " please", " now", " in short")


def _members(batch: dict) -> dict:
    """The vision-language rows as a fetched batch holds them (TRL's sampler repeats each prompt
    ``num_generations`` times): its ``j``-th copy of a prompt asks with the ``j``-th word of
    :data:`MEMBER_WORDS` and sees its image turned the ``j``-th way, so that greedy decoding
    differs within a group, and so do the rewards and advantages. Depends on the batch alone:
    the stock rank and each sp rank of its group fetch the same batch."""
    from PIL import Image

    turns = (None, Image.Transpose.FLIP_LEFT_RIGHT, Image.Transpose.ROTATE_90,
             Image.Transpose.ROTATE_270)  # fmt: skip
    seen: dict[str, int] = {}
    prompts, images = [], []
    for prompt, image in zip(batch["prompt"], batch["image"]):
        key = repr(prompt)
        j = seen[key] = seen.get(key, -1) + 1
        last = {**prompt[-1], "content": prompt[-1]["content"] + MEMBER_WORDS[j % 4]}
        prompts.append([*prompt[:-1], last])
        turn = turns[j % 4]
        images.append(image if turn is None else image.transpose(turn))
    return {**batch, "prompt": prompts, "image": images}


def _data(spec: dict) -> Any:
    from datasets import Dataset

    from tests.hf import rl_agents as A

    if spec.get("vl"):
        from tests.hf.vision_workers import vl_dataset

        rows = []
        for i, r in enumerate(vl_dataset(4)):  # one image each: its first
            q = ["what is this", "describe it", "what color", "name it"][i]
            rows.append({"image": r["images"][0],
                         "prompt": [{"role": "user", "content": q}]})  # fmt: skip
        return Dataset.from_list(rows * 2).with_transform(_members)
    if spec.get("tools") or spec.get("env") or spec.get("rollout") == "chat":
        rows = [{"prompt": [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": q}]} for q in A.QUESTIONS] * 2  # fmt: skip
        if spec.get("env") == "dict":
            for i, r in enumerate(rows):
                r["environment"] = "calc" if i % 2 == 0 else "tally"
        return Dataset.from_list(rows)
    prompts = SHORT_PROMPTS * 2 if spec.get("short") else PROMPTS
    return Dataset.from_list([{"prompt": p} for p in prompts])


def build(spec: dict) -> Any:
    """A trainer as the spec says (``sp`` None: the stock class)."""
    import transformers as tf
    import trl

    from dtensor_ulysses.hf import with_ulysses
    from tests.hf import rl_agents as A

    kind = spec["kind"]  # "grpo" or "rloo"
    agent = bool(spec.get("tools") or spec.get("env"))
    if spec.get("vl"):
        from tests.hf import vision_workers as V

        processing = V.make_processor(spec["tok"])
        processing.tokenizer.padding_side = "left"
        tok = processing.tokenizer
        model = V.load_model(spec["model"])
    else:
        tok = processing = tf.AutoTokenizer.from_pretrained(spec["tok"])
        tok.padding_side = "left"
        model = tf.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    if agent:
        A.Script(model, tok)
    elif not spec.get("vl"):
        # many stop tokens: completions of unequal lengths, dp groups that end at different steps
        model.generation_config.eos_token_id = [tok.eos_token_id, *range(10, 40)]
    generate = model.generate

    def counted_generate(*args: Any, **kwargs: Any) -> Any:  # rows decoded on this rank
        rows = kwargs["input_ids"].shape[0] if "input_ids" in kwargs else args[0].shape[0]
        A.log_call("generate", rows=int(rows))
        return generate(*args, **kwargs)

    model.generate = counted_generate
    common = dict(
        output_dir=spec["out"], use_cpu=True, report_to=[], max_steps=spec.get("steps", 3),
        logging_steps=1, save_strategy="no", learning_rate=spec.get("lr", 0.5), optim="sgd",
        bf16=False, seed=0, per_device_train_batch_size=spec["per_device"], num_generations=4,
        max_completion_length=spec.get("max_completion_length", 6), temperature=1.0,
        beta=spec.get("beta", 0.0), disable_tqdm=True,
    )  # fmt: skip
    if spec.get("greedy"):
        common["generation_kwargs"] = {"do_sample": False}
    if kind == "grpo":
        cls, cfg_cls = trl.GRPOTrainer, trl.GRPOConfig
        common["loss_type"] = spec.get("loss_type", "grpo")
        for k in ("importance_sampling_level", "num_iterations", "mask_truncated_completions",
                  "top_entropy_quantile", "steps_per_generation", "entropy_coef",
                  "max_tool_calling_iterations", "shuffle_dataset"):  # fmt: skip
            if k in spec:
                common[k] = spec[k]
    else:
        cls, cfg_cls = trl.RLOOTrainer, trl.RLOOConfig
    if spec.get("accumulation"):
        common["gradient_accumulation_steps"] = spec["accumulation"]
    if spec.get("eval"):  # evaluation at step 2, on the prompts
        common.update(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    args = cfg_cls(**common)
    cls = recording(cls)
    if spec.get("sp"):
        cls = with_ulysses(cls, sp=spec["sp"])
    data = _data(spec)
    grads = _Grads()
    chat = agent or spec.get("rollout") == "chat" or bool(spec.get("vl"))
    rewards: list = [reward_chat if chat else reward_the, reward_counted]
    if spec.get("reward_model"):  # a sequence-classification reward model, from its directory
        rewards.append(spec["reward_model"])
    extra: dict[str, Any] = {}
    if spec.get("tools"):
        extra["tools"] = [A.add]
    if spec.get("env"):
        extra["environment_factory"] = A.ENVIRONMENTS[spec["env"]]
    if spec.get("rollout"):
        extra["rollout_func"] = A.seeded_rollout
    trainer = cls(model=model, reward_funcs=rewards, args=args,
                  train_dataset=data, processing_class=processing, callbacks=[grads],
                  eval_dataset=data if spec.get("eval") else None,
                  peft_config=_lora() if spec.get("lora") else None, **extra)  # fmt: skip
    trainer._du_test_grads = grads
    return trainer


def _lora() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                      init_lora_weights=False)  # fmt: skip


LOGGED = ("loss", "reward", "reward_std", "rewards/reward_the/mean", "rewards/reward_the/std",
          "rewards/reward_counted/mean", "kl", "entropy", "clip_ratio/region_mean",
          "clip_ratio/low_mean", "clip_ratio/high_mean", "completions/mean_length",
          "completions/max_length", "completions/min_length", "frac_reward_zero_std",
          "grad_norm", "num_tokens")  # fmt: skip


AGENT_LOGGED = ("tools/call_frequency", "tools/failure_frequency", "rewards/Calculator/mean",
                "rewards/Tally/mean", "rewards/reward_chat/mean")  # fmt: skip

EVAL_LOGGED = ("eval_loss", "eval_reward", "eval_rewards/reward_the/mean", "eval_entropy",
               "eval_completions/mean_length")  # fmt: skip


def run(spec: dict) -> dict:
    """Train ``steps`` steps (default 3); the logged history, the advantages' stats, a few full
    gradients, each round's completions, tool masks and advantages. ``capacity``: the memory
    preflight's capacity override (a small one: the weights gathered layer by layer)."""
    from dtensor_ulysses.plan import CAPACITY_ENV

    if spec.get("count"):
        os.environ["DU_RL_COUNT"] = spec["count"]
    if spec.get("capacity"):
        os.environ[CAPACITY_ENV] = spec["capacity"]
    try:
        trainer = build(spec)
        trainer.train()
    finally:
        os.environ.pop("DU_RL_COUNT", None)
        os.environ.pop(CAPACITY_ENV, None)
    hist = [h for h in trainer.state.log_history if "loss" in h]
    out: dict = {k: [h.get(k) for h in hist] for k in LOGGED}
    adv = list(trainer._logs["advantages"])
    out["advantages"] = [sum(adv) / len(adv), max(adv), min(adv)] if adv else []
    out["grads"] = [{k: v.tolist() for k, v in row.items()} for row in trainer._du_test_grads.steps]
    out["eval"] = [{k: v for k, v in h.items() if k in EVAL_LOGGED}
                   for h in trainer.state.log_history if "eval_loss" in h]  # fmt: skip
    out["rounds"] = trainer.__dict__.get("_du_test_rounds", [])
    for k in AGENT_LOGGED:
        out[k] = [h.get(k) for h in hist]
    assert all(math.isfinite(x) for x in out["loss"]), out["loss"]
    return out


def comm(spec: dict) -> dict:
    """The collectives of a round (rollouts, rewards; the second round: FSDP2 has set up in the
    first) and of one log-prob pass (:class:`~dtensor_ulysses.debug.CommCounter`), and the
    closed form of the round's weight gathers: one all-gather per FSDP2 unit of its padded
    shard (``ceil(rows / world)`` rows of each parameter, float32)."""
    from torch.distributed.fsdp import FSDPModule

    from dtensor_ulysses.debug import CommCounter

    trainer = build(spec)
    trainer.model.train()
    batches = iter(trainer.get_train_dataloader())
    sp_group = trainer._du_dims.sp_mesh.get_group()
    dp_group = trainer._du_dims.dp_mesh.get_group()
    flat = trainer._du_dims.flat_mesh.get_group()
    trainer._generate_and_score_completions(next(batches))
    with CommCounter() as rnd:
        out = trainer._generate_and_score_completions(next(batches))
    units = [m for m in trainer.model.modules() if isinstance(m, FSDPModule)]
    world = dist.get_world_size()
    shard_bytes = 0
    for u in units:
        own = {id(p) for m in u.modules() if m is not u and isinstance(m, FSDPModule)
               for p in m.parameters()}  # fmt: skip
        for p in u.parameters():
            if id(p) not in own:
                shard_bytes += -(-p.shape[0] // world) * (p.numel() // p.shape[0]) * 4
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    C = out["completion_ids"].shape[1]
    with CommCounter() as logps:
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C,
                                                   compute_entropy=True)  # fmt: skip
    return {
        "rows": list(ids.shape),
        "round_sp": [rnd.count("all_gather", sp_group), rnd.count(None, sp_group)],
        "round_flat": [rnd.count("all_gather", flat), rnd.bytes("all_gather", flat),
                       rnd.count(None, flat)],
        "round_other": rnd.count() - sum(rnd.count(None, g) for g in (sp_group, dp_group, flat)),
        "units": len(units),
        "unit_bytes": shard_bytes,
        "logps_all_reduce": [logps.count("all_reduce", sp_group),
                             logps.bytes("all_reduce", sp_group)],
    }  # fmt: skip


def refused(spec: dict, make: Any = None) -> dict:
    """The message of the refusal that building the trainer (``make``, this module's
    :func:`build` by default) raises under the spec's memory capacity."""
    from dtensor_ulysses.hf import UnsupportedTrainerError
    from dtensor_ulysses.plan import CAPACITY_ENV

    os.environ[CAPACITY_ENV] = spec["capacity"]
    try:
        (make or build)(spec)
    except UnsupportedTrainerError as e:
        return {"error": str(e)}
    finally:
        os.environ.pop(CAPACITY_ENV, None)
    raise AssertionError("the trainer was built")


def run_specs(rank: int, world: int, specs: list) -> list:
    """Several runs in one spawned world; rank 0's results."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29513")
    os.environ["RANK"] = str(rank)
    torch.set_num_threads(1)
    results = []
    for spec in specs:
        t = time.perf_counter()
        if spec.get("refused"):
            results.append(refused(spec))
        else:
            results.append(comm(spec) if spec.get("comm") else run(spec))
        results[-1]["seconds"] = time.perf_counter() - t
    return results if rank == 0 else [None] * len(results)


def counts(path: str) -> dict[int, list[list[int]]]:
    """The counting reward's calls per rank: ``{rank: [[completions, longest], ...]}``."""
    p = Path(path)
    out: dict[int, list[list[int]]] = {}
    for f in sorted(p.parent.glob(p.name + ".[0-9]*")):  # not the agents' files (.agent.*)
        out[int(f.suffix[1:])] = [json.loads(x) for x in f.read_text().splitlines()]
    return out
