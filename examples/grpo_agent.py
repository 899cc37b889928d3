"""An agent in TRL's ``GRPOTrainer`` under Ulysses: a calculator environment whose ``add`` method
the policy calls as a tool, its reward from the environment's state, plus the two lines marked
``Ulysses``.

On CPU with a tiny model built on the spot::

    torchrun --standalone --nproc-per-node 2 examples/grpo_agent.py --sp 2
    torchrun --standalone --nproc-per-node 4 examples/grpo_agent.py --sp 4
    python examples/grpo_agent.py --stock      # the stock trainer on one process: the runs
                                               # above log the same rewards and tool calls

Each prompt asks for a sum; ``Calculator.reset`` starts a running total for the rollout (and
says so in the prompt), the policy's tool calls add to it, and ``get_reward`` scores how close
the total came to the prompt's answer. A tiny random model never writes a tool call by itself,
so by default its output head is biased (``--no-script`` turns that off) to write one
``add(2, 3)`` call and then an answer: greedy decoding, so the stock run and the Ulysses runs
make the same rollouts; each rollout's environment is made, reset, stepped and scored once, by
the rank that owns the rollout.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
ANSWER = "done<|im_end|>"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>"]  # fmt: skip


class Calculator:
    """A running total per rollout: the policy adds to it with ``add``; the reward is how close
    the total came to the target."""

    def __init__(self) -> None:
        self.total = 0
        self.target = 0

    def reset(self, **row: Any) -> str:
        self.total, self.target = row["start"], row["answer"]
        return f" (the total starts at {self.total})"

    def add(self, a: int, b: int) -> int:
        """Add two integers to the running total.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The new total.
        """
        self.total += a + b
        return self.total

    def get_reward(self) -> float:
        return 1.0 / (1.0 + abs(self.target - self.total))


def rows(n: int, seed: int = 0) -> list[dict]:
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        start, a, b = rnd.randint(0, 3), rnd.randint(0, 4), rnd.randint(0, 4)
        out.append({"prompt": [{"role": "system", "content": "use the tool"},
                               {"role": "user", "content": f"add {a} and {b}"}],
                    "start": start, "answer": start + a + b})  # fmt: skip
    return out


def tiny_model_and_tokenizer(directory: Path) -> tuple[Any, Any]:
    """A byte-level BPE with Qwen2.5's chat template (tool calls rendered and parsed) and a tiny
    random Llama over its vocabulary (seeded: the same on every rank)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen2_5_chat_template

    def fast(bpe: Any) -> Any:
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                      pad_token="<|endoftext|>",
                                      additional_special_tokens=SPECIALS[1:])  # fmt: skip
        tok.chat_template = qwen2_5_chat_template
        return tok

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    texts = [fast(bpe).apply_chat_template(r["prompt"], tools=[Calculator.add], tokenize=False)
             for r in rows(8)] + [CALL, ANSWER] * 10  # fmt: skip
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    tok = fast(bpe)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=False)  # fmt: skip
    return LlamaForCausalLM(cfg), tok


def script(model: Any, tok: Any) -> None:
    """Bias the output head (generation only: TRL's log-probabilities read its weight) so that
    greedy decoding writes ``CALL`` in an assistant turn with no tool result yet, else
    ``ANSWER``."""
    start = tok.convert_tokens_to_ids("<|im_start|>")
    result = tok.convert_tokens_to_ids("<tool_response>")
    header = len(tok("assistant\n", add_special_tokens=False)["input_ids"])
    call, answer = (tok(t, add_special_tokens=False)["input_ids"] for t in (CALL, ANSWER))
    seen: dict[str, list[list[int]] | None] = {"rows": None}

    def inputs(module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids")
        rows_ = seen["rows"]
        if ids is None or ids.dim() != 2:
            seen["rows"] = None
        elif ids.shape[1] > 1:  # a prefill
            seen["rows"] = ids.tolist()
        elif rows_ is not None and len(rows_) == ids.shape[0]:
            for row, t in zip(rows_, ids[:, 0].tolist()):
                row.append(t)

    def logits(module: Any, args: tuple, out: Any) -> Any:
        rows_ = seen["rows"]
        if rows_ is None or out.dim() != 3 or out.shape[0] != len(rows_):
            return None
        out = out.clone()
        for b, row in enumerate(rows_):
            at = max(i for i, t in enumerate(row) if t == start) + 1 + header
            turn = call if result not in row else answer
            done = len(row) - at
            out[b, -1, turn[done] if done < len(turn) else tok.eos_token_id] += 1e4
        return out

    model.register_forward_pre_hook(inputs, with_kwargs=True)
    model.get_output_embeddings().register_forward_hook(logits)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sp", type=int, default=2, help="Ulysses degree (divides the rank count)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default="runs/grpo_agent")
    p.add_argument("--stock", action="store_true", help="the stock trainer (one process)")
    p.add_argument(
        "--no-script",
        action="store_true",
        help="no bias toward the tool call (a tiny random model then rarely calls it)",
    )
    a = p.parse_args(argv)

    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from dtensor_ulysses.hf import with_ulysses  # Ulysses

    model, tokenizer = tiny_model_and_tokenizer(Path(a.out))
    tokenizer.padding_side = "left"
    if not a.no_script:
        script(model, tokenizer)
    args = GRPOConfig(
        output_dir=a.out, per_device_train_batch_size=4, num_generations=4, max_steps=a.steps,
        max_completion_length=96, max_tool_calling_iterations=2, learning_rate=1e-3,
        logging_steps=1, bf16=False, report_to=[], save_strategy="no", disable_tqdm=True,
        generation_kwargs={"do_sample": False}, use_cpu=not torch.cuda.is_available(),
    )  # fmt: skip
    trainer_cls = GRPOTrainer
    if not a.stock:
        trainer_cls = with_ulysses(GRPOTrainer, sp=a.sp)  # Ulysses
    trainer = trainer_cls(
        model=model, args=args, train_dataset=Dataset.from_list(rows(16)),
        processing_class=tokenizer, environment_factory=Calculator,
    )  # fmt: skip
    trainer.train()
    hist = [h for h in trainer.state.log_history if "loss" in h]
    out = {k: [h.get(k) for h in hist] for k in ("reward", "tools/call_frequency", "loss")}
    if trainer.is_world_process_zero():
        print("rewards", [round(r, 6) for r in out["reward"]])
        print("tool calls per rollout", out["tools/call_frequency"])
        print("losses", out["loss"])
    return out


if __name__ == "__main__":
    main()
