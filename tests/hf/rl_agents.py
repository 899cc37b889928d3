"""Agents for tests/hf/test_rl.py: a tokenizer with a Qwen2.5 chat template that renders tool
calls, a tiny policy scripted to call a tool (greedy decoding follows the script), tools and
environments that count their calls per rank, and a ``rollout_func`` that samples each
completion from its own seeded generator.

The script: in every assistant turn, while fewer than ``CALLS`` tool results are in the row, the
policy's logits favour (by ``BIAS``) the next token of ``<tool_call>{"name": "add", ...}
</tool_call><|im_end|>``; after that, of the answer ``5<|im_end|>``. It is a forward hook on the
output head: generation reads the logits, while the trainers' log-probabilities come from the
head's weight (TRL's fused head), so they are the model's own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

CALLS = 2  # tool calls per rollout (each in its own assistant turn)
BIAS = 1e4
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
ANSWER = "5<|im_end|>"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>"]  # fmt: skip
QUESTIONS = ["what is two plus three", "add the numbers", "use the tool please",
             "how much is it"]  # fmt: skip


def log_call(what: str, **info: Any) -> None:
    """One line in this rank's count file (``$DU_RL_COUNT.agent.<rank>``)."""
    path = os.environ.get("DU_RL_COUNT")
    if path:
        with open(f"{path}.agent.{os.environ.get('RANK', '0')}", "a") as f:
            f.write(json.dumps([what, info]) + "\n")


def agent_counts(path: str) -> dict[int, list[list]]:
    """``{rank: [[what, info], ...]}`` of :func:`log_call`'s lines."""
    p = Path(path + ".agent")
    out: dict[int, list[list]] = {}
    for f in sorted(p.parent.glob(p.name + ".*")):
        out[int(f.suffix[1:])] = [json.loads(x) for x in f.read_text().splitlines()]
    return out


# ----------------------------------------------------------------------------------------------
# tools and environments
# ----------------------------------------------------------------------------------------------
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum.
    """
    log_call("tool")
    return a + b


class Calculator:
    """A running total that the policy adds to; its reward is the total."""

    def __init__(self) -> None:
        log_call("make", env="Calculator")
        self.total = 0

    def reset(self, **kwargs: Any) -> str:
        prompt = kwargs["prompt"]
        self.total = len(prompt[-1]["content"]) % 7
        log_call("reset", env="Calculator")
        return f" start at {self.total}"

    def add(self, a: int, b: int) -> int:
        """Add two integers to the running total.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The new total.
        """
        log_call("step", env="Calculator")
        self.total += a + b
        return self.total

    def get_reward(self) -> float:
        log_call("reward", env="Calculator")
        return float(self.total) / 10.0


class Tally(Calculator):
    """A second environment kind (the dict form): the same tool, another reward."""

    def get_reward(self) -> float:
        log_call("reward", env="Tally")
        return -float(self.total) / 20.0


ENVIRONMENTS = {"single": Calculator, "dict": {"calc": Calculator, "tally": Tally}}


# ----------------------------------------------------------------------------------------------
# the tokenizer, the model, the script
# ----------------------------------------------------------------------------------------------
def make_tokenizer(directory: Path) -> Any:
    """A byte-level BPE with Qwen2.5's chat template (TRL recognizes it: tool calls parsed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen2_5_chat_template

    convs = []
    for q in QUESTIONS:
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": q},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function",
                                 "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                {"role": "tool", "name": "add", "content": "5"}]  # fmt: skip
        convs.append(msgs)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[1:])  # fmt: skip
    fast.chat_template = qwen2_5_chat_template
    texts = [fast.apply_chat_template(c, tools=[add, Calculator.add], tokenize=False)
             for c in convs] + [CALL, ANSWER] * 20  # fmt: skip
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[1:])  # fmt: skip
    fast.chat_template = qwen2_5_chat_template
    fast.save_pretrained(directory)
    return fast


def save_model(directory: Path, vocab: int, seed: int = 0) -> str:
    """A tiny Llama over the agent tokenizer's vocabulary, long enough for tool turns."""
    import transformers as tf

    from tests import hf_workers as W

    torch.manual_seed(seed)
    cfg = W.make_config("llama")
    cfg.vocab_size, cfg.max_position_embeddings = vocab, 1024
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)
    return str(directory)


class Script:
    """Greedy decoding of ``model`` follows the script of the module docstring (hooks)."""

    def __init__(self, model: Any, tok: Any) -> None:
        self.rows: list[list[int]] | None = None
        self.start = tok.convert_tokens_to_ids("<|im_start|>")
        self.result = tok.convert_tokens_to_ids("<tool_response>")
        self.header = len(tok("assistant\n", add_special_tokens=False)["input_ids"])
        self.call = tok(CALL, add_special_tokens=False)["input_ids"]
        self.answer = tok(ANSWER, add_special_tokens=False)["input_ids"]
        self.eos = tok.convert_tokens_to_ids("<|im_end|>")
        model.register_forward_pre_hook(self._inputs, with_kwargs=True)
        model.get_output_embeddings().register_forward_hook(self._logits)

    def _inputs(self, module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:  # e.g. TRL's redirected loss
            self.rows = None
        elif ids.shape[1] > 1:  # a prefill (or a training forward: no logits read then)
            self.rows = ids.tolist()
        elif self.rows is not None and len(self.rows) == ids.shape[0]:
            for row, t in zip(self.rows, ids[:, 0].tolist()):
                row.append(t)
        else:
            self.rows = None

    def _logits(self, module: Any, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        if self.rows is None or out.dim() != 3 or out.shape[0] != len(self.rows):
            return None
        out = out.clone()
        for b, row in enumerate(self.rows):
            at = max(i for i, t in enumerate(row) if t == self.start) + 1 + self.header
            turn = self.call if row.count(self.result) < CALLS else self.answer
            done = len(row) - at
            out[b, -1, turn[done] if done < len(turn) else self.eos] += BIAS
        return out


# ----------------------------------------------------------------------------------------------
# a rollout_func: each completion from its own generator
# ----------------------------------------------------------------------------------------------
def seeded_rollout(prompts: list, trainer: Any) -> dict:
    """Sample each row's completion (temperature 1, up to ``max_completion_length`` tokens,
    until an EOS) from a generator seeded by the step, the mode, the process and the row: the
    same rollouts wherever the call runs with the same rows."""
    log_call("rollout_func", rows=len(prompts))
    tok = trainer.processing_class
    model = trainer.model
    texts = [p if isinstance(p, str) else
             tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
             for p in prompts]  # fmt: skip
    prompt_ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    eos = set(trainer.eos_token_ids)
    step = trainer.state.global_step
    mode = int(model.training)
    rank = trainer.accelerator.process_index
    completions = []
    device = next(model.parameters()).device
    with torch.no_grad():
        for i, ids in enumerate(prompt_ids):
            g = torch.Generator().manual_seed(1000003 * step + 7919 * rank + 31 * i + mode)
            row = list(ids)
            out: list[int] = []
            for _ in range(trainer.max_completion_length):
                x = torch.tensor([row], device=device)
                logits = model(input_ids=x).logits[0, -1].float().cpu()
                t = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
                out.append(t)
                row.append(t)
                if t in eos:
                    break
            completions.append(out)
    return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}
