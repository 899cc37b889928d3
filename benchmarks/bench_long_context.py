"""Long-context training on one device: the real step's peak memory next to the trace's prediction.

For each (model, sequence length) it runs a few real training steps of ``dtensor_ulysses.train``
with the chosen memory features on one device (a world of one process), and reports the device
allocator's peak (``torch.cuda.max_memory_allocated``; on CPU the process's peak resident set,
which includes everything, so only the GPU numbers compare), tokens/s and MFU of the last step,
next to what ``python -m simulations trace`` predicts for the same configuration.

GPU run (one H100/H200; the command used when a GPU is lent, see benchmarks/README.md)::

    python -m benchmarks.bench_long_context --models llama3-1b llama3-8b --features all \\
        --seq-lens 131072 --steps 3 --json benchmarks/results/bench_long_context_gpu.json

``--seq-lens max`` takes, per model, the trace's longest fitting sequence (``--find-max``).
``--features all`` adds ``--head-chunks N`` (one q head per stage, UPipe's choice on one GPU).
The MFU sweep (issue #14's >= 50% target for llama3-1b at 32K)::

    python -m benchmarks.bench_long_context --models llama3-1b --features ac --compile \
        --seq-lens 8192 16384 32768 --steps 5 --json benchmarks/results/bench_mfu_gpu.json

All the GPU checks in one command: ``bash benchmarks/gpu.sh`` (see benchmarks/README.md).
A CPU smoke run: ``--models tiny --seq-lens 256 --device cpu --steps 2``.

``--preflight-only --gpu h100 --host-memory 120`` runs nothing: for each row it prints the
trainer's memory preflight (its estimate, ``--memory-headroom`` and all) against that GPU's memory
and that much host memory per rank, and exits 1 if a row would be refused. The CPU dry run of
``gpu.sh`` checks the real shapes of its steps this way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

FEATURE_SETS = {
    "none": [],
    "ac": ["--activation-checkpointing"],
    "all": [
        "--activation-checkpointing",
        "--tiled-loss",
        "--tiled-mlp",
        "--offload-activations",
        "--offload-params",
    ],  # fmt: skip
}
TRAIN_FLAGS = {  # trainer flag -> the simulator's trace flag
    "--activation-checkpointing": ["--ac", "full"],
    "--tiled-loss": ["--tiled-loss"],
    "--tiled-mlp": ["--tiled-mlp"],
    "--offload-activations": ["--offload-activations"],
    "--offload-params": ["--offload-params"],
    "--offload-optimizer": ["--offload-optimizer"],
}


def _head_chunks(model: str, features: str) -> list[str]:
    """With every feature, UPipe's choice on one GPU: one q head per stage."""
    from dtensor_ulysses.plan import get_shape

    return ["--head-chunks", str(get_shape(model).n_heads)] if features.startswith("all") else []


def _trace(model: str, seq_len: int | None, gpu: str, flags: list[str], chunks: list[str]) -> dict:
    """``python -m simulations trace ... --json`` (``--find-max`` when ``seq_len`` is None)."""
    sim_flags = [x for f in flags for x in TRAIN_FLAGS[f]] + chunks
    if "--ac" not in sim_flags:
        sim_flags += ["--ac", "none"]
    length = ["--find-max"] if seq_len is None else ["--seq-len", str(seq_len)]
    cmd = [sys.executable, "-m", "simulations", "trace", "--model", model, *length, "--dp", "1",
           "--sp", "1", "--gpu", gpu, "--layers", "5", *sim_flags, "--json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:]}
    return json.loads(out.stdout)


def _run(model: str, seq_len: int, flags: list[str], steps: int, device: str) -> dict:
    """Train ``steps`` steps in a one-process world; the last step's record."""
    from dtensor_ulysses import train as du_train

    argv = ["--dp", "1", "--sp", "1", "--model", model, "--seq-len", str(seq_len),
            "--batch-size", "1", "--steps", str(steps), "--warmup-steps", "1", *flags,
            "--device", device]  # fmt: skip
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    cfg = du_train.validate(du_train.parse_args(argv), 1)
    t0 = time.perf_counter()
    records = du_train.train(cfg)
    import torch.distributed as dist

    dist.destroy_process_group()
    last = records[-1]
    return {**last, "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_long_context")
    p.add_argument("--models", nargs="+", default=["llama3-1b", "llama3-8b"])
    p.add_argument("--seq-lens", nargs="+", default=["max"], help="tokens, or 'max' (trace)")
    p.add_argument("--features", choices=sorted(FEATURE_SETS), default="all")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--gpu", default="h100", help="the simulator's GPU profile for the trace")
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="the trainer's --compile per block (default BACKEND inductor)")  # fmt: skip
    p.add_argument("--json", default=None)
    p.add_argument("--preflight-only", action="store_true",
                   help="run nothing: the trainer's memory preflight of each row against --gpu's "
                   "memory and --host-memory, exit 1 if one would be refused")  # fmt: skip
    p.add_argument("--host-memory", type=float, default=None, metavar="GIB",
                   help="with --preflight-only: host memory per rank, GiB")  # fmt: skip
    args = p.parse_args(argv)
    flags = FEATURE_SETS[args.features]
    if args.preflight_only:
        return preflight_rows(args, flags)
    rows: list[dict] = []
    result = {"argv": sys.argv[1:] if argv is None else argv, "environment": _environment(),
              "rows": rows}  # fmt: skip
    for model in args.models:
        for length in args.seq_lens:
            seq_len = None if length == "max" else int(length)
            chunks = _head_chunks(model, args.features)
            predicted = _trace(model, seq_len, args.gpu, flags, chunks)
            if seq_len is None:
                seq_len = predicted.get("max_seq_len")
            row: dict = {"model": model, "seq_len": seq_len, "features": args.features,
                         "compile": args.compile, "predicted": predicted}  # fmt: skip
            if seq_len:
                try:
                    compiled = ["--compile", args.compile] if args.compile else []
                    run_flags = flags + chunks + compiled
                    _reset_peak(args.device)  # each row its own peak, not the largest so far
                    row["measured"] = _run(model, seq_len, run_flags, args.steps, args.device)
                except Exception as e:  # an out-of-memory is a result to report, not a crash
                    row["measured"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append(row)
            m, pr = row.get("measured", {}), row["predicted"]
            print(
                f"{model:>10} S={seq_len} | measured peak "
                f"{m.get('peak_mem_bytes', float('nan')) / 2**30:.2f} GiB | predicted "
                f"{pr.get('device_peak_bytes', float('nan')) / 2**30:.2f} GiB | "
                f"{m.get('tokens_per_s', float('nan')):.0f} tok/s | mfu {m.get('mfu')} | "
                f"{m.get('error', '')}{pr.get('error', '')}",
                flush=True,
            )
            _write(args.json, result)
    return result


def preflight_rows(args: argparse.Namespace, flags: list[str]) -> dict:
    """The trainer's memory preflight of every row, on one ``args.gpu`` with ``args.host_memory``
    GiB of host memory per rank (``check_fits`` with the trainer's config of the row, as
    ``dtensor_ulysses.train`` runs it on CUDA); ``{"rows": [...]}``, a row's ``error`` its
    refusal."""
    from dtensor_ulysses import train as du_train
    from dtensor_ulysses.plan import GPU_SPECS, check_fits, get_shape

    if args.host_memory is None or "max" in args.seq_lens:
        raise SystemExit("--preflight-only needs --host-memory GIB and --seq-lens as numbers")
    device_cap, host_cap = GPU_SPECS[args.gpu].memory_bytes, int(args.host_memory * 2**30)
    rows: list[dict] = []
    for model in args.models:
        for length in args.seq_lens:
            argv = ["--dp", "1", "--sp", "1", "--model", model, "--seq-len", length,
                    "--batch-size", "1", *flags, *_head_chunks(model, args.features)]  # fmt: skip
            cfg = du_train.parse_args(argv)
            res = check_fits(
                get_shape(model), cfg.options(), device_type="cuda", seq_len=cfg.seq_len,
                batch_size=cfg.batch_size, dp=1, sp=1, device_cap=device_cap, host_cap=host_cap,
                capacity_source=f"{args.gpu} total memory", host_capacity_source="--host-memory",
                headroom=cfg.memory_headroom,
            )  # fmt: skip
            est = res.estimate
            row = {"model": model, "seq_len": cfg.seq_len, "device_bytes": est.device_bytes,
                   "host_bytes": est.host_bytes, "fits": res.fits}  # fmt: skip
            if not res.fits:
                row["error"] = f"memory preflight: {res.problem}"
            rows.append(row)
            print(
                f"preflight {model} S={cfg.seq_len} on {args.gpu} + {args.host_memory:g} GiB of "
                f"host: device {est.device_bytes / 2**30:.1f} GiB, host "
                f"{est.host_bytes / 2**30:.1f} GiB: "
                + ("fits" if res.fits else f"REFUSED ({res.problem})"),
                flush=True,
            )
    return {"rows": rows, "preflight_only": True}


def _reset_peak(device: str) -> None:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _environment() -> dict:
    import torch

    from dtensor_ulysses.attention import flash_attn_available

    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "flash_attn": flash_attn_available(),
    }


def _write(path: str | None, result: dict) -> None:
    """The JSON so far (after every row: a time limit or an OOM kill keeps the rows done)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(path + ".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(path)


def failed_rows(result: dict) -> list[dict]:
    """Rows whose run or trace failed, or that never ran."""
    rows = result["rows"]
    if result.get("preflight_only"):
        return [r for r in rows if "error" in r]
    return [r for r in rows if "error" in r.get("measured", {"error": "not run"})
            or "error" in r["predicted"]]  # fmt: skip


if __name__ == "__main__":
    failed = failed_rows(main())
    if failed:
        print(f"{len(failed)} row(s) failed", file=sys.stderr)
    sys.exit(1 if failed else 0)
