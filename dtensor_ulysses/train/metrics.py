"""Training metrics: tokens/s, MFU, peak memory, a progress line on rank 0, and a JSONL log.

Peak memory is the CUDA allocator's peak (``torch.cuda.max_memory_allocated``) on GPU, and the
process's peak resident set size on CPU. MFU = model FLOPs per token x tokens/s per GPU / the
GPU's dense bf16 peak (:data:`PEAK_FLOPS`, from :mod:`dtensor_ulysses.plan.hardware`); it is
reported on known GPUs only.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import TextIO

import torch

from dtensor_ulysses.plan.hardware import GPU_SPECS, spec_for_device

__all__ = ["PEAK_FLOPS", "peak_flops", "peak_memory_bytes", "StepLogger", "truncate_after"]

# Dense bf16 tensor-core peak per GPU, by profile key (the one table: plan.hardware).
PEAK_FLOPS = {name: g.peak_flops for name, g in GPU_SPECS.items()}


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of ``device`` if it is a known GPU, else None."""
    if device.type != "cuda":
        return None
    spec = spec_for_device(torch.cuda.get_device_name(device))
    return spec.peak_flops if spec else None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a CUDA device; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _fmt_rate(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def truncate_after(metrics_file: str | Path, step: int) -> int:
    """Drop the rows of ``metrics_file`` past ``step`` (and a torn last line), so that a run
    resumed from the checkpoint of ``step`` leaves one row per step; returns how many went.

    A run that crashed (or was killed) after its last checkpoint logged steps that the resumed
    run trains again; their rows are replaced by the resumed run's.
    """
    path = Path(metrics_file)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            keep = isinstance(row, dict) and int(row["step"]) <= step
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        tmp.replace(path)
    return dropped


class StepLogger:
    """One record per step: printed on rank 0 and appended to a JSONL file.

    Args:
        total_steps: steps of the run (for the progress line and ETA).
        flops_per_token: model training FLOPs per token (``model.model_flops_per_token``).
        n_gpus: devices the tokens/s is spread over (for MFU).
        device: the training device.
        metrics_file: JSONL path, or None.
        is_main: print and write only where True (rank 0).
        stream: where the progress goes.
    """

    def __init__(
        self,
        total_steps: int,
        flops_per_token: float,
        n_gpus: int,
        device: torch.device,
        metrics_file: str | None = None,
        is_main: bool = True,
        stream: TextIO | None = None,
    ) -> None:
        self.total_steps = total_steps
        self.flops_per_token = flops_per_token
        self.n_gpus = n_gpus
        self.device = device
        self.peak = peak_flops(device)
        self.is_main = is_main
        self.stream = stream or sys.stdout
        self.path = Path(metrics_file) if metrics_file else None
        if self.path and is_main:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.t_start = time.perf_counter()

    def log(self, step: int, loss: float, tokens: int, step_time_s: float, **extra) -> dict:
        """Record step ``step`` (1-based: steps completed); returns the record."""
        tokens_per_s = tokens / step_time_s if step_time_s > 0 else float("nan")
        mfu = None
        if self.peak:
            mfu = self.flops_per_token * tokens_per_s / self.n_gpus / self.peak
        record = {
            "step": step,
            "loss": loss,
            "tokens": tokens,
            "tokens_per_s": tokens_per_s,
            "step_time_s": step_time_s,
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "mfu": mfu,
            **extra,
        }
        if self.is_main:
            if self.path:
                with self.path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
            self._print(record)
        return record

    def _print(self, r: dict) -> None:
        elapsed = time.perf_counter() - self.t_start
        width = len(str(self.total_steps))
        parts = [
            f"step {r['step']:>{width}}/{self.total_steps}",
            f"loss {r['loss']:.4f}",
            f"{_fmt_rate(r['tokens_per_s'])} tok/s",
            f"peak {_fmt_bytes(r['peak_mem_bytes'])}",
        ]
        if r["mfu"] is not None:
            parts.append(f"MFU {100 * r['mfu']:.1f}%")
        if "grad_norm" in r:
            parts.append(f"|g| {r['grad_norm']:.3f}")
        parts.append(f"{elapsed:.0f}s")
        print(" | ".join(parts), file=self.stream, flush=True)
