"""The trainer's cost of sequence parallelism on CPU: sp = P vs sp = 1 at equal tokens per rank.

One rank at ``sp = 1`` trains on sequences of ``T`` tokens; ``P`` gloo ranks at ``sp = P`` train
on sequences of ``P * T`` tokens, each rank holding ``T`` of them. Everything token-wise (the
projections, the MLP, the norms, the loss) is then the same work per rank; attention is not: at
``P * T`` tokens every causal score matrix is ``P`` times as long, so a rank's share of attention
FLOPs grows ``P``-fold. The table reports the measured step time of both, their ratio, and the
ratio the FLOPs alone predict (``model_flops_per_token`` at both lengths, the attention term
included); the difference is what Ulysses costs beyond the FLOPs: the all-to-alls, the packing,
the rank synchronization.

    python -m benchmarks.bench_trainer_overhead --json benchmarks/results/trainer_overhead_cpu.json
    python -m benchmarks.bench_trainer_overhead --tokens 128 --steps 2   # a quick look

The default model is the ``tiny`` preset (the only one whose AdamW states fit several CPU
processes on a 24 GiB machine), at 4096 tokens per rank so that compute, not latency, dominates.
At ``sp = P`` the trainer also shards the weights over ``P`` ranks (FSDP2 all-gathers and
reduce-scatters each step), which ``sp = 1`` does not: that is part of the measured cost.

Each configuration runs ``--warmup`` untimed and ``--steps`` timed training steps (forward,
backward, optimizer); the time per step is the median of the slowest rank. Writes JSON with
``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from dtensor_ulysses.launch import run_local_world
from dtensor_ulysses.models import model_flops_per_token


def _worker(rank: int, world_size: int, cfg: dict) -> dict:
    torch.set_num_threads(cfg["threads"])
    from dtensor_ulysses import train as du_train
    from dtensor_ulysses.data import PackedCorpus, get_batch
    from dtensor_ulysses.parallel import flatten_dp_sp, init_mesh

    P = world_size
    tc = du_train.TrainConfig(
        dp=1, sp=P, model=cfg["model"], seq_len=cfg["tokens"] * P, batch_size=1,
        steps=cfg["steps"] + cfg["warmup"], attention_backend="sdpa",
    )  # fmt: skip
    tc = du_train.validate(tc, world_size)
    mesh = init_mesh(1, P, device_type="cpu")
    model, optimizer, scheduler = du_train.build(tc, mesh, torch.device("cpu"))
    corpus = PackedCorpus.from_paths(tc.data, seq_len=tc.seq_len)
    group = flatten_dp_sp(mesh).get_group()
    times = []
    for step in range(cfg["warmup"] + cfg["steps"]):
        batch = get_batch(corpus, step, global_batch_size=1, dp_rank=0, dp=1, sp_rank=rank,
                          sp=P, seed=0)  # fmt: skip
        torch.distributed.barrier()
        t0 = time.perf_counter()
        du_train.train_step(model, batch, optimizer, scheduler, group=group)
        times.append(time.perf_counter() - t0)
    return {"times": times[cfg["warmup"] :]}


def measure(model: str, tokens: int, P: int, steps: int, warmup: int, threads: int) -> dict:
    cfg = dict(model=model, tokens=tokens, steps=steps, warmup=warmup, threads=threads)
    per_rank = run_local_world(_worker, P, cfg, timeout_s=1800)
    slowest = [max(r["times"][i] for r in per_rank) for i in range(steps)]
    return {"P": P, "seq_len": tokens * P, "ms_per_step": 1e3 * statistics.median(slowest),
            "ms_per_step_each": [round(1e3 * t, 2) for t in slowest]}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank, T")
    ap.add_argument("--sp", type=int, nargs="+", default=[2])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    load_at_start = os.getloadavg()
    base = measure(a.model, a.tokens, 1, a.steps, a.warmup, a.threads)
    rows = [dict(base, ratio=1.0, flops_ratio=1.0)]
    f1 = model_flops_per_token(a.model, a.tokens)
    for P in a.sp:
        r = measure(a.model, a.tokens, P, a.steps, a.warmup, a.threads)
        r["ratio"] = r["ms_per_step"] / base["ms_per_step"]
        r["flops_ratio"] = model_flops_per_token(a.model, a.tokens * P) / f1
        rows.append(r)
    print(f"model {a.model}, {a.tokens} tokens per rank, {a.threads} thread(s) per rank")
    print(f"{'sp':>3} {'S':>8} {'ms/step':>9} {'vs sp=1':>8} {'FLOPs say':>10} {'overhead':>9}")
    for r in rows:
        over = r["ratio"] / r["flops_ratio"] - 1
        r["overhead_beyond_flops"] = over
        print(f"{r['P']:>3} {r['seq_len']:>8} {r['ms_per_step']:>9.1f} {r['ratio']:>7.3f}x "
              f"{r['flops_ratio']:>9.3f}x {over:>+8.1%}")  # fmt: skip
    out = dict(
        command=" ".join(["python -m benchmarks.bench_trainer_overhead", *argv]),
        environment=dict(torch=torch.__version__, python=platform.python_version(),
                         cpus=os.cpu_count(), load_avg_at_start=load_at_start),  # fmt: skip
        settings=vars(a), rows=rows,
    )  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {a.json}")
    return out


if __name__ == "__main__":
    main()
