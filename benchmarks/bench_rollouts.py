"""One GRPO step's generation under ``with_ulysses(GRPOTrainer, sp=P)`` at P = 1, 2, 4: time and
memory per rank, with the same completions (count and lengths) at every P.

A random-init Llama (``--hidden`` x ``--layers``, a byte-level BPE of ``--vocab`` tokens),
``--rows`` completions of one prompt per step (``num_generations = rows``), each exactly
``--new-tokens`` tokens (greedy, ``min_new_tokens = max_completion_length``), ``beta = 0`` and
one iteration (no reference or old-policy pass: the round is the generation and the rewards).
On ``P`` gloo ranks (dp = 1, sp = P, one torch thread each), ``--steps`` GRPO steps; the first
is a warm-up (FSDP2's set-up), the others are timed:

* **round s**: wall time of ``_generate_and_score_completions`` (the generation round, the
  exchange of the shares, the rewards); the slowest rank's, the median over the timed steps.
* **round cpu s**: the same round's CPU time (``time.process_time``), the busiest rank's: the
  work a rank does, apart from waiting for a core (P ranks share this machine's cores).
* **decode s**: wall time inside the policy's ``generate`` on a rank (the slowest rank's).
* **step s**: the whole optimizer step (round, log-probabilities, backward, SGD).
* **rows / rank**: the completions a rank decodes; **KV MiB / rank**: their KV cache at full
  length (``2 x layers x kv heads x head dim x 4 bytes x rows x (prompt + new tokens)``);
  **gathered MiB / rank**: the weights a rank holds gathered while decoding (the whole model
  once per round, or, before, the root and two decoder layers at a time). The script tells the
  two from the library it imports (``rollouts.rollout_shares``).

Run it on this checkout (``--label after``) and on another (``--label before``, e.g. main at
63db0bb in a scratch worktree: ``PYTHONPATH=/tmp/before python benchmarks/bench_rollouts.py
--label before``); rows are merged into ``--json`` by label, and the table prints the ratio
after / before at each P::

    python -m benchmarks.bench_rollouts --json benchmarks/results/bench_rollouts_cpu.json
    python -m benchmarks.bench_rollouts --sp 1 2 --steps 2 --new-tokens 8   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dtensor_ulysses.launch import run_local_world

PROMPT = "the quick brown fox jumps over the lazy dog and reads every token of a long context"


def _tokenizer(directory: Path, vocab: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([PROMPT] * 50, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(directory)
    return fast


def _model(directory: Path, cfg: dict, vocab: int) -> None:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=vocab, hidden_size=cfg["hidden"],
                            intermediate_size=4 * cfg["hidden"], num_hidden_layers=cfg["layers"],
                            num_attention_heads=cfg["heads"], num_key_value_heads=cfg["heads"],
                            max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip
    tf.LlamaForCausalLM(config).save_pretrained(directory)


def _worker(rank: int, world: int, cfg: dict) -> dict:
    import transformers as tf
    import trl
    from datasets import Dataset  # type: ignore[import-untyped]

    from dtensor_ulysses.hf import with_ulysses

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    torch.set_num_threads(cfg["threads"])
    tok = tf.AutoTokenizer.from_pretrained(cfg["dir"] + "/tok")
    tok.padding_side = "left"
    model = tf.AutoModelForCausalLM.from_pretrained(cfg["dir"] + "/model", dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    timing: dict[str, list[float]] = {"round": [], "round_cpu": [], "decode": [], "step": []}
    generate = model.generate

    def timed_generate(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            timing["decode"][-1] += time.perf_counter() - t0

    model.generate = timed_generate

    class Timed(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs: Any) -> Any:
            timing["decode"].append(0.0)
            t0, c0 = time.perf_counter(), time.process_time()
            out = super()._generate_and_score_completions(inputs)
            timing["round"].append(time.perf_counter() - t0)
            timing["round_cpu"].append(time.process_time() - c0)
            return out

    class Steps(tf.TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            torch.distributed.barrier()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            timing["step"].append(time.perf_counter() - self.t0)

    L = cfg["new_tokens"]
    args = trl.GRPOConfig(
        output_dir=cfg["dir"] + f"/out{world}", use_cpu=True, report_to=[], bf16=False,
        max_steps=cfg["steps"], logging_steps=1, save_strategy="no", learning_rate=1e-3,
        optim="sgd", seed=0, per_device_train_batch_size=cfg["rows"],
        num_generations=cfg["rows"], max_completion_length=L, beta=0.0, disable_tqdm=True,
        generation_kwargs={"do_sample": False, "min_new_tokens": L},
    )  # fmt: skip
    data = Dataset.from_list([{"prompt": PROMPT}] * 4)
    cls = with_ulysses(Timed, sp=world)
    trainer = cls(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                  args=args, train_dataset=data, processing_class=tok,
                  callbacks=[Steps()])  # fmt: skip
    trainer.train()
    prompt_tokens = len(tok(PROMPT)["input_ids"])
    return {**timing, "prompt_tokens": prompt_tokens}


def measure(cfg: dict, P: int) -> dict:
    per_rank = run_local_world(_worker, P, cfg, timeout_s=3600)
    timed = range(1, cfg["steps"])  # step 0: FSDP2's set-up
    row: dict[str, Any] = {"P": P}
    for key, how in (("round", max), ("round_cpu", max), ("decode", max), ("step", max)):
        row[f"{key}_s"] = statistics.median(how(r[key][i] for r in per_rank) for i in timed)
    rows = -(-cfg["rows"] // P)
    tokens = per_rank[0]["prompt_tokens"] + cfg["new_tokens"]
    h, n = cfg["hidden"], cfg["layers"]
    layer = 12 * h * h  # q, k, v, o (4 h^2) and the MLP (8 h^2 at 4h)
    root = 2 * cfg["vocab"] * h
    # this checkout splits a round over the sp group (and gathers the weights once) or not
    row["rows_per_rank"] = rows if cfg["split"] else cfg["rows"]
    kv = 2 * n * h * 4 * row["rows_per_rank"] * tokens
    gathered = (n * layer + root) * 4 if cfg["split"] else (2 * layer + root) * 4
    row["kv_mib_per_rank"] = round(kv / 2**20, 3)
    row["gathered_mib_per_rank"] = round(gathered / 2**20, 3)
    return row


def _table(results: dict) -> str:
    labels = sorted(results["rows"])
    lines = [
        "| label | P | rows / rank | round s | round cpu s | decode s | step s | KV MiB / rank "
        "| gathered MiB / rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label in labels:
        for r in results["rows"][label]:
            lines.append(
                f"| {label} | {r['P']} | {r['rows_per_rank']} | {r['round_s']:.3f} | "
                f"{r['round_cpu_s']:.3f} | {r['decode_s']:.3f} | {r['step_s']:.3f} | "
                f"{r['kv_mib_per_rank']} | {r['gathered_mib_per_rank']} |"
            )
    if {"before", "after"} <= set(labels):
        before = {r["P"]: r for r in results["rows"]["before"]}
        lines.append("")
        lines.append(
            "| P | round s after / before | round cpu s after / before | step s after / before |"
        )
        lines.append("|---|---|---|---|")
        for r in results["rows"]["after"]:
            b = before.get(r["P"])
            if b:
                lines.append(f"| {r['P']} | {r['round_s'] / b['round_s']:.2f} | "
                             f"{r['round_cpu_s'] / b['round_cpu_s']:.2f} | "
                             f"{r['step_s'] / b['step_s']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="after", help="this checkout's rows (before / after)")
    ap.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rows", type=int, default=32, help="completions per step")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens per completion")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps (the first untimed)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--json", default=None, help="merge this label's rows into this JSON file")
    a = ap.parse_args(argv)
    if a.steps < 2:
        ap.error("--steps must be >= 2 (the first step is not timed)")
    import dtensor_ulysses
    from dtensor_ulysses.hf.trainers import rollouts

    split = hasattr(rollouts, "rollout_shares")  # one generation per sp group (not before)
    with tempfile.TemporaryDirectory() as d:
        tok = _tokenizer(Path(d) / "tok", a.vocab)
        cfg = dict(dir=d, rows=a.rows, new_tokens=a.new_tokens, hidden=a.hidden,
                   layers=a.layers, heads=a.heads, vocab=len(tok), steps=a.steps,
                   threads=a.threads, split=split)  # fmt: skip
        _model(Path(d) / "model", cfg, len(tok))
        rows = [measure(cfg, P) for P in a.sp]
    results: dict[str, Any] = {"rows": {}, "runs": {}}
    if a.json and os.path.exists(a.json):
        with open(a.json) as f:
            results = json.load(f)
    results["rows"][a.label] = rows
    results["runs"][a.label] = {
        "config": {k: v for k, v in cfg.items() if k != "dir"},
        "library": os.path.dirname(dtensor_ulysses.__file__),
        "torch": torch.__version__, "platform": platform.platform(),
        "cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg(),
    }  # fmt: skip
    print(_table(results))
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
