"""What the checkpoint manifest costs: CRC-32 time against the checkpoint write and load.

One process writes a checkpoint of at least ``--gib`` GiB (a stack of linear layers and its
AdamW state, fp32: 12 bytes per parameter across the ``.distcp`` file; whole layers, so a
little more) with the trainer's own
:func:`dtensor_ulysses.train.checkpoint.save` (DCP, the small files, then the manifest, then
the rename), then loads it with :func:`~dtensor_ulysses.train.checkpoint.load` (every byte
checked against the manifest, then DCP reads through the safe reader). Separately, over the same
files: the manifest's checksums (:func:`dtensor_ulysses.train.manifest.checksum`, what ``save``
adds) and their verification (:func:`dtensor_ulysses.train.manifest.check`, what ``load``
adds), and the CRC throughput. The files were just written, so they are read from the page
cache: the CRC cost here is CPU time, the lower bound; on a cold cache the verification reads
the checkpoint from disk once more (the DCP load reads it too).

    python -m benchmarks.bench_checkpoint --json benchmarks/results/bench_checkpoint_cpu.json
    python -m benchmarks.bench_checkpoint --gib 0.05                  # a quick look

Each timing is the median of ``--repeats``. Writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from dtensor_ulysses.train import checkpoint as ckpt
from dtensor_ulysses.train import manifest


def _model(gib: float) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    params = math.ceil(gib * 2**30 / 12)  # weights + two AdamW moments, fp32
    width = min(2048, int((params / 4) ** 0.5))  # at least 4 layers
    layers = max(1, math.ceil(params / (width * width)))  # whole layers: at least gib
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(gib: float, repeats: int, where: str) -> dict:
    model, opt, sched = _model(gib)
    root = Path(tempfile.mkdtemp(prefix="du-bench-ckpt-", dir=where))
    try:
        step = [0]

        def save() -> None:
            step[0] += 1
            ckpt.save(root, step[0], model, opt, sched, {"bench": True}, keep_last=1)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP: "assuming ... a single process"
            save_s = _median(save, repeats)
            path = ckpt.latest(root)
            assert path is not None
            names = manifest.files_of(path)
            size = sum((path / n).stat().st_size for n in names)
            files = manifest.read(path)
            assert files is not None
            checksum_s = _median(lambda: manifest.checksum(path, names), repeats)
            verify_s = _median(lambda: manifest.check(path, files), repeats)
            load_s = _median(lambda: ckpt.load(path, model, opt, sched), repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_s = save_s - checksum_s  # the save without its manifest
    return {
        "bytes": size,
        "requested_gib": gib,
        "gib": round(size / 2**30, 3),
        "save_s": round(save_s, 3),
        "write_without_manifest_s": round(write_s, 3),
        "manifest_checksum_s": round(checksum_s, 3),
        "manifest_vs_write": round(checksum_s / write_s, 3),
        "load_s": round(load_s, 3),
        "verify_s": round(verify_s, 3),
        "verify_vs_load_without_verify": round(verify_s / (load_s - verify_s), 3),
        "crc_gb_per_s": round(size / checksum_s / 1e9, 2),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size (GiB), at least")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    row = measure(args.gib, args.repeats, args.dir or tempfile.gettempdir())
    cols = ["gib", "save_s", "write_without_manifest_s", "manifest_checksum_s",
            "manifest_vs_write", "load_s", "verify_s", "verify_vs_load_without_verify",
            "crc_gb_per_s"]  # fmt: skip
    print(" | ".join(cols))
    print(" | ".join(str(row[c]) for c in cols))
    out = {
        "argv": sys.argv[1:] if argv is None else argv,
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu_model": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0],
        },
        "rows": [row],
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
