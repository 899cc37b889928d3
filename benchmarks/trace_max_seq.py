"""The longest llama3-8b sequence the real training step fits, traced: the documented figures.

Each row runs ``python -m simulations trace ... --find-max --json`` in a fresh interpreter (the
trace owns a fake process group) and records the longest sequence with zero slack and with the
trainer's 10% headroom, the device peak and the host bytes per rank. The target rows are the
recipes of docs/how-to/million-tokens.md; the ablation rows drop one feature at a time from the
8x H100 recipe, so the table says what each feature buys; the host row bounds the 8x H100
recipe by 128 GiB of host memory per rank; the post-training rows trace the DPO, GRPO and
distillation steps (``--step dpo|grpo|distill``, ``dtensor_ulysses/memtrace/steps.py``) on the
same recipe, the length per row. CPU only; 4 to 12 minutes a row on a 2-core machine (the
post-training rows: more).

    python -m benchmarks.trace_max_seq                      # every row
    python -m benchmarks.trace_max_seq --rows targets       # the three target rows only
    python -m benchmarks.trace_max_seq --rows h100x8 host   # rows or groups by name
    python -m benchmarks.trace_max_seq --rows post          # the DPO, GRPO, distillation rows

Writes ``benchmarks/results/trace_max_seq.json`` after every row (rows run again replace their
old entry; the others are kept), with ``figures``: every documented number by name. The docs
quote them through ``<!-- fig: NAME -->`` markers, and ``tests/docs/test_figures.py`` checks each
marked number against this file, and re-traces one row to check that the file is current.
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
from typing import Any

GiB = 2**30
ALL = ["--tiled-loss", "--tiled-mlp", "--offload-activations"]
EIGHT = ["--dp", "1", "--sp", "8", "--gpu", "h100", *ALL, "--head-chunks", "4",
         "--offload-optimizer"]  # fmt: skip
ONE = ["--dp", "1", "--sp", "1", *ALL, "--head-chunks", "32", "--offload-params"]
ABLATED = ("--tiled-loss", "--tiled-mlp", "--head-chunks", "--offload-activations",
           "--offload-optimizer")  # fmt: skip


def _without(flag: str) -> list[str]:
    args = list(EIGHT)
    i = args.index(flag)
    del args[i : i + (2 if flag == "--head-chunks" else 1)]
    return args


# name -> (what it is, the trace's flags, the target length or None)
ROWS: dict[str, tuple[str, list[str], int | None]] = {
    "h100x8": ("8x H100", EIGHT, 6_000_000),
    "h100x1": ("1x H100", [*ONE, "--gpu", "h100"], 600_000),
    "h200x1": ("1x H200", [*ONE, "--gpu", "h200"], 1_450_000),
    **{
        f"h100x8_without_{f[2:].replace('-', '_')}": (f"8x H100 without {f}", _without(f), None)
        for f in ABLATED
    },
    "h100x8_host128": ("8x H100, 128 GiB of host per rank", [*EIGHT, "--host-memory", "128"], None),
    # post-training steps on the 8x H100 recipe (memtrace/steps.py): the length is per row
    "h100x8_dpo": ("8x H100, DPO (a chosen and a rejected row, frozen reference, beta 0.1)",
                   [*EIGHT, "--step", "dpo", "--beta", "0.1"], None),
    "h100x8_grpo": ("8x H100, GRPO (G = 8 rollouts of one prompt, frozen reference, beta 0.04)",
                    [*EIGHT, "--step", "grpo", "--generations", "8", "--beta", "0.04"], None),
    "h100x8_distill": ("8x H100, on-policy distillation (one row, a frozen teacher of the same "
                       "size, beta 1: reverse KL)", [*EIGHT, "--step", "distill", "--beta", "1"],
                       None),
}  # fmt: skip
GROUPS = {
    "all": list(ROWS),
    "targets": ["h100x8", "h100x1", "h200x1"],
    "ablation": [n for n in ROWS if "_without_" in n],
    "host": ["h100x8_host128"],
    "post": ["h100x8_dpo", "h100x8_grpo", "h100x8_distill"],
}


# One cheap trace of the 8x H100 recipe (its tiled loss and MLP run a chunk at a time, so a trace
# costs in proportion to the sequence: this one takes seconds, a row's probes minutes): recorded
# with the rows, traced again by tests/docs/test_figures.py to tell whether the file is current.
FINGERPRINT = ["python", "-m", "simulations", "trace", "--model", "llama3-8b", *EIGHT, "--layers",
               "5", "--seq-len", "131072", "--json"]  # fmt: skip


def fingerprint() -> dict[str, Any]:
    """The device peak and host bytes of :data:`FINGERPRINT`, with its command."""
    out = subprocess.run([sys.executable, *FINGERPRINT[1:]], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    res = json.loads(out)
    return dict(command=" ".join(FINGERPRINT), device_peak_bytes=res["device_peak_bytes"],
                host_bytes=res["host_bytes"])  # fmt: skip


def command(args: list[str]) -> list[str]:
    """The ``simulations trace --find-max`` command line of one row."""
    return ["python", "-m", "simulations", "trace", "--model", "llama3-8b", *args, "--layers",
            "5", "--find-max", "--json"]  # fmt: skip


def run(args: list[str]) -> tuple[dict, float]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, *command(args)[1:]], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    return json.loads(out), time.perf_counter() - t0


def figures(runs: list[dict[str, Any]]) -> dict[str, float | int]:
    """Every documented number, by name: ``ROW.max_seq_len`` (zero slack),
    ``ROW.max_seq_len_headroom`` (the trainer's 10%), ``ROW.device_gib`` / ``ROW.host_gib`` at
    the first and ``ROW.device_gib_headroom`` / ``ROW.host_gib_headroom`` at the second, and
    ``ROW.vs_all`` (an ablation row's length over the full recipe's)."""
    out: dict[str, float | int] = {}
    for r in runs:
        res, name = r["result"], r["name"]
        out[f"{name}.max_seq_len"] = res["max_seq_len"]
        out[f"{name}.device_gib"] = res["device_peak_bytes"] / GiB
        out[f"{name}.host_gib"] = res["host_bytes"] / GiB
        out[f"{name}.host_node_gib"] = res["host_bytes"] / GiB * res["gpus"]
        if "max_seq_len_with_headroom" in res:
            out[f"{name}.max_seq_len_headroom"] = res["max_seq_len_with_headroom"]
        if "device_peak_bytes_with_headroom" in res:
            out[f"{name}.device_gib_headroom"] = res["device_peak_bytes_with_headroom"] / GiB
            out[f"{name}.host_gib_headroom"] = res["host_bytes_with_headroom"] / GiB
            out[f"{name}.host_node_gib_headroom"] = (
                res["host_bytes_with_headroom"] / GiB * res["gpus"]
            )
    full = out.get("h100x8.max_seq_len")
    for r in runs:
        if "_without_" in r["name"] and full:
            out[f"{r['name']}.vs_all"] = r["result"]["max_seq_len"] / full
    return dict(sorted(out.items()))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="+", default=["all"], choices=[*GROUPS, *ROWS],
                    help="rows or groups of rows to trace (default: all)")  # fmt: skip
    ap.add_argument("--out", default="benchmarks/results/trace_max_seq.json")
    a = ap.parse_args(argv)
    import torch  # only to record the version the traces ran with

    names = list(dict.fromkeys(n for g in a.rows for n in GROUPS.get(g, [g])))
    out = Path(a.out)
    old = json.loads(out.read_text()) if out.is_file() else {}
    kept = {r["name"]: r for r in old.get("runs", []) if "name" in r and r["name"] in ROWS}
    meta: dict[str, Any] = dict(
        note="llama3-8b, bf16 params / fp32 reduce, micro-batch 1, the real train_step traced "
        "with fake tensors (python -m simulations trace); capacity = device memory - 2 GiB "
        "reserve; headroom: the trainer's 90% of it; find-max grid 1024*sp tokens",
        torch=torch.__version__, python=platform.python_version(),
        machine=f"{platform.machine()}, {torch.get_num_threads()} CPU threads",
    )  # fmt: skip
    meta["fingerprint"] = fingerprint()  # the library that traces the rows below
    print(f"{'row':<42} {'longest S':>11} {'10% headroom':>13} {'device peak':>12} "
          f"{'host/rank':>10}")  # fmt: skip
    for name in names:
        hardware, args, target = ROWS[name]
        load = round(os.getloadavg()[0], 1)  # wall_s is this machine's share, not the work
        res, wall = run(args)
        kept[name] = dict(name=name, hardware=hardware, command=" ".join(command(args)),
                          target_seq_len=target, wall_s=round(wall, 1),
                          load_average_at_start=load, result=res)  # fmt: skip
        runs = [kept[n] for n in ROWS if n in kept]
        out.write_text(json.dumps(dict(**meta, figures=figures(runs), runs=runs), indent=1) + "\n")
        within = res.get("max_seq_len_with_headroom", 0)
        print(f"{name:<42} {res['max_seq_len']:>11,} {within:>13,} "
              f"{res['device_peak_bytes'] / GiB:>10.2f} G {res['host_bytes'] / GiB:>8.1f} G  "
              f"({wall:.0f} s)", flush=True)  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
