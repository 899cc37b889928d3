"""dtensor-ulysses vs DeepSpeed's ``DistributedAttention``, side by side, same kernel, same ranks.

Forward + backward of one causal attention call on sequence-sharded ``q, k, v [B, S/P, N, H]``
on a local gloo world of ``P`` CPU processes:

* ``dtensor_ulysses``: ``du.UlyssesAttention(kernel, group)`` (q, k, v in one all-to-all);
* ``deepspeed``: ``deepspeed.sequence.layer.DistributedAttention(kernel, group, scatter_idx=2,
  gather_idx=1)`` (DeepSpeed-Ulysses; needs ``pip install deepspeed`` and ``DS_ACCELERATOR=cpu``
  on a CPU machine, set here; skipped with a message when it does not import).

Both wrap the same ``kernel``: ``F.scaled_dot_product_attention`` on ``[B, S, heads, H]``. The
kernel declares the memory layout SDPA reads (``input_dim_order``: ``[B, N, S, H]``), which the
dtensor_ulysses engine writes its received pieces into; DeepSpeed hands it contiguous
``[B, S, N, H]``. A third row, ``kernel``, times the kernel alone on one rank's head-sharded,
full-length tensors (no communication): the floor both engines stand on, so ``engine - kernel``
is each engine's cost around the kernel (packing, all-to-alls, unpacking, autograd). A fourth,
``collectives``, times the bare ``all_to_all_single`` calls of one call's exchanges (q, k, v and
o forward, their gradients backward: the same bytes, contiguous buffers, nothing packed): the
communication no implementation of these exchanges avoids, so ``(kernel + collectives) /
deepspeed`` bounds the ratio any engine around this kernel can reach on this machine.

The variants run interleaved (round robin per iteration), so load drift hits all alike; per
iteration the slowest rank counts; the table shows medians over ``--iters``, and the median of
the per-iteration ratios (each iteration's two engine times side by side, so drift cancels);
the outputs and gradients of the two engines are compared at the first iteration. Run::

    python -m benchmarks.bench_vs_deepspeed --world-sizes 2 4 --seq-lens 2048 8192 \\
        --heads 16 --head-dim 64 --iters 15 --json benchmarks/results/bench_vs_deepspeed_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

VARIANTS = ("dtensor_ulysses", "deepspeed", "kernel", "collectives")


class _Kernel:
    """Causal SDPA on ``[B, S, heads, H]``; reads ``[B, heads, S, H]`` memory without a copy."""

    def __call__(self, q, k, v, **_):
        import torch.nn.functional as F

        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return o.transpose(1, 2)

    def input_dim_order(self, q) -> tuple[int, ...]:
        return (0, 2, 1, 3)


_kernel = _Kernel()


def _deepspeed(group):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention

        # DeepSpeed's comm layer over the process group that already exists
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    except Exception as e:  # not installed, or no accelerator it accepts
        return None, f"{type(e).__name__}: {e}"
    return DistributedAttention(_kernel, group, scatter_idx=2, gather_idx=1), None


def worker(rank: int, world_size: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    import dtensor_ulysses as du

    torch.set_num_threads(1)
    group = dist.group.WORLD
    assert group is not None
    ds, ds_problem = _deepspeed(group)
    engines: dict[str, Callable[..., Any]] = {
        "dtensor_ulysses": du.UlyssesAttention(_kernel, group)
    }
    if ds is not None:
        engines["deepspeed"] = lambda q, k, v: ds(q, k, v, 0)  # batch_dim_idx=0
    B, S, N, H = cfg["B"], cfg["S"], cfg["N"], cfg["H"]
    g = torch.Generator().manual_seed(cfg["seed"] + rank)
    s, n = S // world_size, N // world_size
    q, k, v, go = (torch.randn(B, s, N, H, generator=g) for _ in range(4))
    # the floor: the kernel alone on this rank's heads, full length, laid out as it reads them
    full = [torch.randn(B, n, S, H, generator=g).transpose(1, 2) for _ in range(4)]
    engines["kernel"] = _kernel
    # the exchanges alone: q, k, v and o forward, d o and d q, d k, d v backward
    bufs = [(torch.randn(m * B * s * N * H, generator=g), torch.empty(m * B * s * N * H))
            for m in (3, 1, 1, 3)]  # fmt: skip
    engines["collectives"] = lambda: [dist.all_to_all_single(r, x, group=group) for x, r in bufs]
    times: dict[str, list[float]] = {n: [] for n in engines}
    first: dict[str, list] = {}
    for it in range(cfg["warmup"] + cfg["iters"]):
        for name, fn in engines.items():
            inputs, grad = (full[:3], full[3]) if name == "kernel" else ((q, k, v), go)
            qi, ki, vi = (t.clone().requires_grad_() for t in inputs)
            dist.barrier()
            t0 = time.perf_counter()
            if name == "collectives":
                fn()
            else:
                o = fn(qi, ki, vi)
                o.backward(grad)
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank
            if it >= cfg["warmup"]:
                times[name].append(elapsed.item() * 1e3)
            if name not in first and name in ("dtensor_ulysses", "deepspeed"):
                first[name] = [o.detach(), qi.grad, ki.grad, vi.grad]
    diff = paired = None
    if "deepspeed" in first:
        diff = max((a - b).abs().max().item() for a, b in zip(*first.values()))
        ratios = [a / b for a, b in zip(times["dtensor_ulysses"], times["deepspeed"])]
        paired = statistics.median(ratios)
    return {"ms": {n: statistics.median(t) for n, t in times.items()}, "max_abs_diff": diff,
            "paired_ratio": paired, "deepspeed_problem": ds_problem}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    from dtensor_ulysses.launch import run_local_world

    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_vs_deepspeed")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = []
    print("| P | S | dtensor_ulysses ms | deepspeed ms | kernel alone ms | collectives alone ms "
          "| ratio | paired ratio | bound | around the kernel: ours / DeepSpeed's ms "
          "| max abs diff |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for P in args.world_sizes:
        for S in args.seq_lens:
            cfg = dict(B=args.batch, S=S, N=args.heads, H=args.head_dim, seed=0,
                       iters=args.iters, warmup=args.warmup)  # fmt: skip
            r = run_local_world(worker, P, cfg, timeout_s=args.timeout)[0]
            ms = r["ms"]
            ratio = bound = None
            if "deepspeed" in ms:
                ratio = ms["dtensor_ulysses"] / ms["deepspeed"]
                bound = (ms["kernel"] + ms["collectives"]) / ms["deepspeed"]
            rows.append({"P": P, "S": S, **cfg, **r, "ratio": ratio, "bound": bound})
            ds = f"{ms['deepspeed']:.1f}" if "deepspeed" in ms else "skipped"
            shown = "" if ratio is None else f"{ratio:.3f}"
            pr = "" if r["paired_ratio"] is None else f"{r['paired_ratio']:.3f}"
            ours = ms["dtensor_ulysses"] - ms["kernel"]
            theirs = f" / {ms['deepspeed'] - ms['kernel']:.1f}" if "deepspeed" in ms else ""
            bd = "" if bound is None else f"{bound:.3f}"
            line = f"| {P} | {S} | {ms['dtensor_ulysses']:.1f} | {ds} | {ms['kernel']:.1f} |"
            line += f" {ms['collectives']:.1f} | {shown} | {pr} | {bd} |"
            print(f"{line} {ours:.1f}{theirs} | {r['max_abs_diff']} |", flush=True)
            if r["deepspeed_problem"]:
                print(f"  deepspeed skipped: {r['deepspeed_problem']}", file=sys.stderr)
    import torch

    result = {
        "argv": sys.argv[1:] if argv is None else argv,
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "loadavg_start": os.getloadavg(),
        },  # fmt: skip
        "rows": rows,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
