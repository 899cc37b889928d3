"""The longest llama3-8b sequence the real training step fits, traced: the targets and an ablation.

Each row runs ``python -m simulations trace ... --find-max --json`` in a fresh interpreter (the
trace owns a fake process group) and records the longest sequence, the device peak and the host
bytes per rank. The ablation rows drop one feature at a time from the 8x H100 recipe, so the
table says what each feature buys. CPU only; about 4 minutes a row on a 2-core machine.

    python -m benchmarks.trace_max_seq                 # every row
    python -m benchmarks.trace_max_seq --rows targets  # the three target rows only

Writes ``benchmarks/results/trace_max_seq.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

GiB = 2**30
ALL = ["--tiled-loss", "--tiled-mlp", "--offload-activations"]
EIGHT = ["--dp", "1", "--sp", "8", "--gpu", "h100", *ALL, "--head-chunks", "4",
         "--offload-optimizer"]  # fmt: skip
ONE = ["--dp", "1", "--sp", "1", *ALL, "--head-chunks", "32", "--offload-params"]
TARGETS = [
    ("8x H100", EIGHT, 6_000_000),
    ("1x H100", [*ONE, "--gpu", "h100"], 600_000),
    ("1x H200", [*ONE, "--gpu", "h200"], 1_450_000),
]


def _without(flag: str) -> list[str]:
    args = list(EIGHT)
    i = args.index(flag)
    del args[i : i + (2 if flag == "--head-chunks" else 1)]
    return args


ABLATION = [
    (f"8x H100 without {f}", _without(f), None)
    for f in (
        "--tiled-loss",
        "--tiled-mlp",
        "--head-chunks",
        "--offload-activations",
        "--offload-optimizer",
    )  # fmt: skip
]


def run(args: list[str]) -> tuple[dict, float]:
    cmd = [sys.executable, "-m", "simulations", "trace", "--model", "llama3-8b", *args,
           "--layers", "5", "--find-max", "--json"]  # fmt: skip
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", choices=["all", "targets"], default="all")
    ap.add_argument("--out", default="benchmarks/results/trace_max_seq.json")
    a = ap.parse_args(argv)
    rows = TARGETS + (ABLATION if a.rows == "all" else [])
    runs = []
    print(f"{'hardware':<42} {'longest S':>11} {'device peak':>12} {'host/rank':>10} {'target':>9}")
    for name, args, target in rows:
        res, wall = run(args)
        flags = " ".join(args)
        runs.append(dict(hardware=name, command=f"python -m simulations trace --model llama3-8b "
                         f"{flags} --layers 5 --find-max --json", target_seq_len=target,
                         wall_s=round(wall, 1), result=res))  # fmt: skip
        t = f"{target:,}" if target else "-"
        print(f"{name:<42} {res['max_seq_len']:>11,} {res['device_peak_bytes'] / GiB:>10.2f} G "
              f"{res['host_bytes'] / GiB:>8.1f} G {t:>9}  ({wall:.0f} s)", flush=True)  # fmt: skip
    note = (
        "llama3-8b, bf16 params / fp32 reduce, micro-batch 1, the real train_step traced with "
        "fake tensors (python -m simulations trace); capacity = device memory - 2 GiB reserve; "
        "find-max grid 1024*sp tokens"
    )
    meta = dict(torch=torch.__version__, python=platform.python_version(),
                machine=f"{platform.machine()}, {torch.get_num_threads()} CPU threads")  # fmt: skip
    Path(a.out).write_text(json.dumps(dict(note=note, **meta, runs=runs), indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
