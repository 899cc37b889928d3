"""Forward+backward of Ulysses attention on gloo: time, collectives and bytes per rank.

Kept in one file (~580 lines): a benchmark script anyone can copy and run on its own.

What it measures. For each world size ``P`` (one local gloo world of ``P`` CPU processes), each
head configuration (MHA ``N = K``, and GQA ``K = --gqa-kv-heads``) and each variant below, one
iteration is: sequence-sharded local ``q, k, v[B, S/P, heads, H]`` -> head-sharded
``[B, S, heads/P, H]`` -> causal SDPA (``dtensor_ulysses.attention.local_attention``,
``backend="sdpa"``) -> back to sequence-sharded ``o[B, S/P, N, H]`` -> ``o.backward(grad)`` with a
fixed random ``grad``. The variants do the same math and differ only in how they move data:

* ``ulysses_fused``: ``du.ulysses_attention(q, k, v, backend="sdpa")`` (q, k, v in one all-to-all);
* ``ulysses_unfused``: the same with ``fuse_qkv=False`` (one all-to-all each for q, k and v);
* ``redistribute``: ``DTensor.redistribute`` ``(Shard(1),) -> (Shard(2),)`` on the 1-D ``sp`` mesh
  for q, k, v, attention on ``.to_local()``, then ``DTensor.from_local(o, [Shard(2)])``
  redistributed back to ``Shard(1)``. On CPU/gloo torch 2.13 turns this into all_gather + chunk
  (every rank receives ``P`` times the bytes); the table and the JSON show what it really issued;
* ``hand_a2a``: a deliberately plain baseline written here, independent of the library: one
  ``torch.distributed.all_to_all_single`` per tensor (chunk / stack / cat), inside a minimal
  ``autograd.Function`` whose backward is the all-to-all with the dims swapped.

The GQA configuration runs the two Ulysses variants only (the fused/unfused comparison);
``redistribute`` and ``hand_a2a`` need ``P`` to divide the kv heads and are skipped otherwise.

Per row: time of forward+backward (``dist.barrier()`` before each iteration, ``time.perf_counter``
around forward+backward; per iteration the slowest rank; the median over ``--iters`` timed
iterations after ``--warmup`` untimed ones; the timed iterations go round-robin over the variants
so that load drift on a shared machine hits them alike), collectives and input bytes per rank from
``du.CommCounter`` over one untimed iteration, forward and backward separately, whether every rank
passed the same bytes, and the closed form computed here independently of the library::

    s = S / P, e = bytes per element, K' = kv heads after replication
        (K' = K if P divides K; P if K divides P; else N, one kv head per q head)
    forward, fused:   all-to-all B*s*(N + 2*K')*H*e  +  all-to-all B*s*N*H*e
    forward, 3+1:     all-to-alls B*s*N*H*e, B*s*K'*H*e, B*s*K'*H*e  +  B*s*N*H*e
    backward:         the same as forward

("closed form ok" means exactly these all-to-alls and nothing else). At the first (untimed)
iteration the output and the gradients of q, k, v of every variant are compared with those of the
first variant; the run fails if the max abs difference exceeds ``--tol`` (default 1e-5).

Command (from the repository root; the lead's reference run)::

    python benchmarks/bench_ulysses.py --world-sizes 2 4 --seq-len 8192 --heads 16 \\
        --kv-heads 16 --head-dim 64 --batch 1 --dtype float32 --iters 3 \\
        --json benchmarks/results/bench_ulysses_cpu.json

(``python -m benchmarks.bench_ulysses ...`` is the same.) It prints progress lines, then a Markdown
table, and writes JSON with the environment, the command line and every row.

Caveats. This is CPU + gloo, typically on a small machine (the reference one has 2 cores, so at
``P = 4`` the ranks share cores): the time is dominated by attention compute and memcpy in shared
memory, not by a GPU interconnect, so it says little about NVLink/InfiniBand speed. What carries
over to GPUs is the collective count and the bytes per rank. Timings on a busy machine are noisy:
the JSON records the load average at the start.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import dtensor_ulysses as du
from dtensor_ulysses.attention import local_attention
from dtensor_ulysses.launch import run_local_world

__all__ = ["VARIANTS", "closed_form", "kv_heads_after_replication", "main"]

VARIANTS = ("ulysses_fused", "ulysses_unfused", "redistribute", "hand_a2a")
GQA_VARIANTS = ("ulysses_fused", "ulysses_unfused")
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
SEQ, HEAD = 1, 2  # dims of [B, S, N, H]


# ----------------------------------------------------------------------------------------------
# hand-written baseline: plain all_to_all_single, nothing from the library
# ----------------------------------------------------------------------------------------------
def _hand_exchange(x: torch.Tensor, split_dim: int, cat_dim: int, group) -> torch.Tensor:
    """Chunk ``x`` along ``split_dim`` (chunk ``j`` to rank ``j``); concatenate what arrives,
    in rank order, along ``cat_dim``."""
    P = dist.get_world_size(group)
    send = torch.stack(x.chunk(P, dim=split_dim))  # [P, *chunk], contiguous
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=cat_dim)


class _HandAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split_dim, cat_dim, group):
        ctx.dims_group = (split_dim, cat_dim, group)
        return _hand_exchange(x, split_dim, cat_dim, group)

    @staticmethod
    def backward(ctx, grad):
        split_dim, cat_dim, group = ctx.dims_group
        return _hand_exchange(grad, cat_dim, split_dim, group), None, None, None


# ----------------------------------------------------------------------------------------------
# the variants: local sequence shards in, local sequence shard of o out (autograd graph attached)
# ----------------------------------------------------------------------------------------------
def _seq_sharded(t: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    return DTensor.from_local(t, mesh, [Shard(SEQ)], run_check=False)


def _ulysses(q, k, v, mesh: DeviceMesh, fuse: bool) -> torch.Tensor:
    dq, dk, dv = (_seq_sharded(t, mesh) for t in (q, k, v))
    o = du.ulysses_attention(dq, dk, dv, causal=True, backend="sdpa", fuse_qkv=fuse)
    return o.to_local()


def _redistribute(q, k, v, mesh: DeviceMesh) -> torch.Tensor:
    heads = [_seq_sharded(t, mesh).redistribute(mesh, [Shard(HEAD)]).to_local() for t in (q, k, v)]
    o = local_attention(*heads, causal=True, backend="sdpa")
    o = DTensor.from_local(o, mesh, [Shard(HEAD)], run_check=False)
    return o.redistribute(mesh, [Shard(SEQ)]).to_local()


def _hand(q, k, v, mesh: DeviceMesh) -> torch.Tensor:
    group = mesh.get_group("sp")
    heads = [_HandAllToAll.apply(t, HEAD, SEQ, group) for t in (q, k, v)]
    o = local_attention(*heads, causal=True, backend="sdpa")
    return _HandAllToAll.apply(o, SEQ, HEAD, group)


_VARIANT_FNS: dict[str, Callable[..., torch.Tensor]] = {
    "ulysses_fused": lambda q, k, v, mesh: _ulysses(q, k, v, mesh, fuse=True),
    "ulysses_unfused": lambda q, k, v, mesh: _ulysses(q, k, v, mesh, fuse=False),
    "redistribute": _redistribute,
    "hand_a2a": _hand,
}


def _skip_reason(variant: str, K: int, P: int) -> str | None:
    if variant in ("redistribute", "hand_a2a") and K % P:
        return f"needs sp={P} to divide the {K} kv heads; this baseline does not replicate kv heads"
    return None


# ----------------------------------------------------------------------------------------------
# closed form (independent of the library)
# ----------------------------------------------------------------------------------------------
def kv_heads_after_replication(N: int, K: int, P: int) -> int:
    """Kv heads summed over the ranks after the exchange: ``K`` when ``P`` divides it; ``P`` (one
    per rank) when ``K`` divides ``P``; otherwise one kv head per q head, ``N``."""
    if K % P == 0:
        return K
    if P % K == 0:
        return P
    return N


def closed_form(variant: str, B: int, S: int, N: int, K: int, H: int, P: int, e: int) -> dict:
    """Expected ``{kind: {"count", "bytes"}}`` per rank for the forward (the backward is equal)."""
    s, Kp = S // P, kv_heads_after_replication(N, K, P)
    q_b, kv_b, o_b = B * s * N * H * e, B * s * Kp * H * e, B * s * N * H * e
    calls = [q_b + 2 * kv_b, o_b] if variant == "ulysses_fused" else [q_b, kv_b, kv_b, o_b]
    return {"all_to_all": {"count": len(calls), "bytes": sum(calls)}}


# ----------------------------------------------------------------------------------------------
# per-rank worker
# ----------------------------------------------------------------------------------------------
def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def _calls(counter: du.CommCounter) -> list[list]:
    return [[c.kind, c.op, c.bytes] for c in counter.calls]


def _first_iteration(fn, q, k, v, grad, mesh) -> tuple[list, list, list[torch.Tensor]]:
    """Untimed: collectives of forward and backward, and the output and gradients."""
    dist.barrier()
    with du.CommCounter() as c_fwd:
        o = fn(q, k, v, mesh)
    with du.CommCounter() as c_bwd:
        o.backward(grad)
    result = [o.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()]
    return _calls(c_fwd), _calls(c_bwd), result


def _step(fn, q, k, v, grad, mesh) -> float:
    """One forward+backward after a barrier; returns its wall time in seconds."""
    for t in (q, k, v):
        t.grad = None
    dist.barrier()
    t0 = time.perf_counter()
    fn(q, k, v, mesh).backward(grad)
    return time.perf_counter() - t0


def _worker(rank: int, world_size: int, cfg: dict) -> dict:
    """Run every configuration and variant on this rank; return plain data for the parent.

    Per configuration: each variant's first iteration (counted, cross-checked) and warm-up, then
    the timed iterations round-robin over the variants, so that load on a shared machine drifts
    into every variant alike rather than into whichever ran last.
    """
    P = world_size
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("sp",))
    dtype = DTYPES[cfg["dtype"]]
    B, S, H = cfg["batch"], cfg["seq_len"], cfg["head_dim"]
    out: dict[str, Any] = {"threads": torch.get_num_threads(), "rows": []}
    for ci, (config, N, K, variants) in enumerate(cfg["configs"]):
        g = torch.Generator().manual_seed(1234 + ci)
        full = [
            torch.randn(B, S, n, H, generator=g, dtype=torch.float32).to(dtype)
            for n in (N, K, K, N)
        ]
        q0, k0, v0, grad = (t.chunk(P, dim=SEQ)[rank].contiguous() for t in full)
        del full
        tag = f"[P={P}] {config} N={N} K={K}"
        ref: tuple[str, list[torch.Tensor]] | None = None
        rows: dict[str, dict] = {}
        leaves: dict[str, tuple[torch.Tensor, ...]] = {}
        for variant in variants:
            reason = _skip_reason(variant, K, P)
            if reason:
                _log(rank, f"{tag} {variant}: skipped ({reason})")
                rows[variant] = dict(config=config, N=N, K=K, variant=variant, skipped=reason)
                continue
            fn = _VARIANT_FNS[variant]
            q, k, v = leaves[variant] = tuple(t.clone().requires_grad_() for t in (q0, k0, v0))
            calls_fwd, calls_bwd, result = _first_iteration(fn, q, k, v, grad, mesh)
            if ref is None:
                ref = (variant, result)
            diffs = {
                name: (a.double() - b.double()).abs().max().item()
                for name, a, b in zip(("o", "dq", "dk", "dv"), result, ref[1])
            }
            del result
            for _ in range(cfg["warmup"] - 1):
                _step(fn, q, k, v, grad, mesh)
            rows[variant] = dict(
                config=config,
                N=N,
                K=K,
                variant=variant,
                times_s=[],
                calls_fwd=calls_fwd,
                calls_bwd=calls_bwd,
                reference=ref[0],
                max_abs_diff=diffs,
            )
            _log(
                rank, f"{tag} {variant}: counted, checked (max abs diff {max(diffs.values()):.1e})"
            )
        for it in range(cfg["iters"]):
            for variant, (q, k, v) in leaves.items():
                rows[variant]["times_s"].append(_step(_VARIANT_FNS[variant], q, k, v, grad, mesh))
            line = ", ".join(f"{v} {1e3 * rows[v]['times_s'][-1]:.1f}" for v in leaves)
            _log(rank, f"{tag} iter {it + 1}/{cfg['iters']} ms (rank 0): {line}")
        out["rows"] += [rows[v] for v in variants]
    return out


# ----------------------------------------------------------------------------------------------
# parent: aggregate, print, write
# ----------------------------------------------------------------------------------------------
def _by_kind(calls: Sequence[Sequence]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for kind, _op, nbytes in calls:
        d = out.setdefault(kind, {"count": 0, "bytes": 0})
        d["count"] += 1
        d["bytes"] += nbytes
    return out


def _received(calls: Sequence[Sequence], P: int) -> int:
    """Bytes a rank receives: an all-to-all returns as much as it sends, an all-gather P times."""
    return sum(nbytes * (P if kind == "all_gather" else 1) for kind, _op, nbytes in calls)


def _ops_note(calls: Sequence[Sequence]) -> str:
    by_op: dict[str, int] = {}
    for _kind, op, _ in calls:
        by_op[op] = by_op.get(op, 0) + 1
    return ", ".join(f"{n} x {op}" for op, n in by_op.items()) or "none"


def _aggregate(P: int, per_rank: list[dict], args: argparse.Namespace, e: int) -> list[dict]:
    rows = []
    for i, r0 in enumerate(per_rank[0]["rows"]):
        N, K, variant = r0["N"], r0["K"], r0["variant"]
        base = dict(
            variant=variant,
            config=r0["config"],
            P=P,
            B=args.batch,
            S=args.seq_len,
            N=N,
            K=K,
            H=args.head_dim,
            dtype=args.dtype,
        )
        if "skipped" in r0:
            rows.append({**base, "skipped": r0["skipped"]})
            continue
        ranks = [pr["rows"][i] for pr in per_rank]
        iter_max = [max(ts) for ts in zip(*(r["times_s"] for r in ranks))]
        fwd, bwd = _by_kind(r0["calls_fwd"]), _by_kind(r0["calls_bwd"])
        expected = closed_form(variant, args.batch, args.seq_len, N, K, args.head_dim, P, e)
        diffs = {name: max(r["max_abs_diff"][name] for r in ranks) for name in r0["max_abs_diff"]}
        note = f"fwd: {_ops_note(r0['calls_fwd'])}; bwd: {_ops_note(r0['calls_bwd'])}"
        if "all_gather" in fwd or "all_gather" in bwd:
            note += f" (all_gather + chunk: each rank receives {P}x the bytes of an all-to-all)"
        rows.append(
            {
                **base,
                "K_after_replication": kv_heads_after_replication(N, K, P),
                "ms_fwd_bwd": 1e3 * statistics.median(iter_max),
                "ms_fwd_bwd_min": 1e3 * min(iter_max),
                "ms_fwd_bwd_mean": 1e3 * statistics.fmean(iter_max),
                "ms_per_iter_max_over_ranks": [1e3 * t for t in iter_max],
                "ms_per_iter_per_rank": [[1e3 * t for t in r["times_s"]] for r in ranks],
                "collectives_fwd": fwd,
                "collectives_bwd": bwd,
                "a2a_count_fwd": fwd.get("all_to_all", {}).get("count", 0),
                "a2a_count_bwd": bwd.get("all_to_all", {}).get("count", 0),
                "all_gather_count_fwd": fwd.get("all_gather", {}).get("count", 0),
                "all_gather_count_bwd": bwd.get("all_gather", {}).get("count", 0),
                "bytes_per_rank_fwd": sum(d["bytes"] for d in fwd.values()),
                "bytes_per_rank_bwd": sum(d["bytes"] for d in bwd.values()),
                "received_bytes_per_rank_fwd": _received(r0["calls_fwd"], P),
                "received_bytes_per_rank_bwd": _received(r0["calls_bwd"], P),
                "bytes_equal_across_ranks": all(
                    (r["calls_fwd"], r["calls_bwd"]) == (r0["calls_fwd"], r0["calls_bwd"])
                    for r in ranks
                ),
                "closed_form_fwd": expected,
                "closed_form_bwd": expected,
                "closed_form_ok": fwd == expected and bwd == expected,
                "reference_variant": r0["reference"],
                "max_abs_diff_vs_reference": diffs,
                "equivalent": max(diffs.values()) <= args.tol,
                "collectives_note": note,
            }
        )
    return rows


def _fmt_bytes(n: int) -> str:
    return f"{n:,}"


def _table(rows: list[dict]) -> str:
    head = [
        "variant",
        "P",
        "S",
        "N",
        "K",
        "ms fwd+bwd",
        "a2a (f/b)",
        "all_gather (f/b)",
        "bytes/rank fwd",
        "bytes/rank bwd",
        "closed form ok",
        "max abs diff",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        if "skipped" in r:
            cells = [r["variant"], r["P"], r["S"], r["N"], r["K"], "skipped", *["-"] * 6]
        else:
            diff = max(r["max_abs_diff_vs_reference"].values())
            cells = [
                r["variant"],
                r["P"],
                r["S"],
                r["N"],
                r["K"],
                f"{r['ms_fwd_bwd']:.1f}",
                f"{r['a2a_count_fwd']}/{r['a2a_count_bwd']}",
                f"{r['all_gather_count_fwd']}/{r['all_gather_count_bwd']}",
                _fmt_bytes(r["bytes_per_rank_fwd"]),
                _fmt_bytes(r["bytes_per_rank_bwd"]),
                "yes" if r["closed_form_ok"] else "no",
                f"{diff:.1e}",
            ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _environment() -> dict:
    affinity = getattr(os, "sched_getaffinity", None)
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "os": platform.system(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(affinity(0)) if affinity else os.cpu_count(),
        "load_average_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "process_group_backend": "gloo",
        "attention_backend": "sdpa",
    }


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_ulysses",
        description="Time forward+backward of Ulysses attention on gloo against "
        "DTensor.redistribute and a hand-written all_to_all_single baseline.",
    )
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16, help="q heads N")
    p.add_argument("--kv-heads", type=int, default=None, help="kv heads K (default: N, MHA)")
    p.add_argument(
        "--gqa-kv-heads",
        type=int,
        default=4,
        help="kv heads of the extra GQA configuration (fused/unfused only); 0 to skip it",
    )
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--iters", type=int, default=3, help="timed iterations")
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed iterations (>= 1; the first is counted and cross-checked)",
    )
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--tol", type=float, default=1e-5, help="max abs diff allowed between variants")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--timeout", type=float, default=7200.0, help="deadline per world size, seconds")
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    args.warmup = max(1, args.warmup)
    problems = []
    for P in args.world_sizes:
        if P < 2:
            problems.append(f"world size {P}: use >= 2 (sp=1 issues no collectives)")
        for what, n in (("--heads", args.heads), ("--seq-len", args.seq_len)):
            if n % P:
                problems.append(f"{what}={n} is not divisible by world size {P}")
    for K in (args.kv_heads, args.gqa_kv_heads):
        if K and args.heads % K:
            problems.append(f"kv heads {K} do not divide --heads={args.heads}")
    if args.iters < 1:
        problems.append(f"--iters={args.iters}: use >= 1")
    if problems:
        p.error("; ".join(problems))
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark; print the table; write JSON if ``--json``; return the JSON object.

    Raises:
        AssertionError: some variant's output or gradients differ from the reference by more
            than ``--tol`` (after the table and JSON are written).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    configs = [
        (
            "mha" if args.kv_heads == args.heads else "gqa",
            args.heads,
            args.kv_heads,
            list(args.variants),
        )
    ]
    if args.gqa_kv_heads and args.gqa_kv_heads != args.kv_heads:
        gqa = [v for v in args.variants if v in GQA_VARIANTS]
        if gqa:
            configs.append(("gqa", args.heads, args.gqa_kv_heads, gqa))
    cfg = dict(
        batch=args.batch,
        seq_len=args.seq_len,
        head_dim=args.head_dim,
        dtype=args.dtype,
        iters=args.iters,
        warmup=args.warmup,
        configs=configs,
    )
    e = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    env = _environment()
    print(
        f"bench_ulysses: torch {env['torch']}, {env['cpu_model']} x {env['cpus_usable']}, "
        f"B={args.batch} S={args.seq_len} N={args.heads} H={args.head_dim} {args.dtype}, "
        f"configs {[(c[0], c[2]) for c in configs]}",
        flush=True,
    )
    rows, threads = [], {}
    for P in args.world_sizes:
        print(f"world size {P}: starting {P} gloo ranks", flush=True)
        t0 = time.perf_counter()
        per_rank = run_local_world(
            _worker, P, cfg, timeout_s=args.timeout, collective_timeout_s=args.timeout
        )
        threads[P] = per_rank[0]["threads"]
        rows += _aggregate(P, per_rank, args, e)
        print(f"world size {P}: done in {time.perf_counter() - t0:.1f} s", flush=True)
    table = _table(rows)
    print()
    print(table)
    notes = {
        f"- {r['variant']} (P={r['P']}): {r['collectives_note']}"
        for r in rows
        if r["variant"] == "redistribute" and "collectives_note" in r
    }
    if notes:
        print("\n" + "\n".join(sorted(notes)))
    measured = [r for r in rows if "skipped" not in r]
    result = {
        "benchmark": "bench_ulysses",
        "command": "python -m benchmarks.bench_ulysses " + shlex.join(argv),
        "argv": argv,
        "timestamp_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "environment": {**env, "torch_threads_per_rank": threads},
        "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("json",)},
            "causal": True,
            "timing": "median over timed iterations of the slowest rank's forward+backward",
            "bytes": "input bytes a rank passes into its collectives (du.CommCounter)",
        },
        "tolerance": args.tol,
        "all_equivalent": all(r["equivalent"] for r in measured),
        "all_bytes_equal_across_ranks": all(r["bytes_equal_across_ranks"] for r in measured),
        "table_markdown": table,
        "rows": rows,
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}", flush=True)
    bad = [
        f"{r['variant']} P={r['P']} N={r['N']} K={r['K']}: {r['max_abs_diff_vs_reference']}"
        for r in measured
        if not r["equivalent"]
    ]
    assert not bad, f"variants differ from the reference by more than {args.tol}: {bad}"
    return result


if __name__ == "__main__":
    # As a script, import this file as ``benchmarks.bench_ulysses`` so the spawned ranks can
    # unpickle the worker by module path (not ``__main__``).
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.bench_ulysses import main as _main

    _main()
