"""One prediction: communication, memory and time of a workload, and the method comparison.

>>> from simulations import predict
>>> p = predict("llama3-8b", seq_len=131072, dp=1, sp=8, gpu="h100")
>>> p.comm.bytes_by_kind["all_to_all"], p.memory.peak, p.time.total, p.mfu  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtensor_ulysses.plan import ModelShape, get_shape
from simulations import comm as _comm
from simulations import flops as _flops
from simulations import memory as _memory
from simulations import timing as _timing
from simulations.config import METHODS, Workload

__all__ = ["Prediction", "compare_methods", "predict"]


@dataclass(frozen=True)
class Prediction:
    """Everything the cost model says about one workload (per rank unless said otherwise)."""

    workload: Workload
    comm: _comm.CommSummary
    memory: _memory.MemoryBreakdown
    flops: _flops.FlopCount
    time: _timing.StepTime

    @property
    def step_time_s(self) -> float:
        return self.time.total

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second over the whole job (``dp * B * S`` tokens per step)."""
        w = self.workload
        return w.dp * w.micro_batch * w.seq_len / self.time.total

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s per GPU (MFU convention, :mod:`simulations.flops`)."""
        return self.flops.model / self.workload.world / self.time.total / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilization against the profile's dense bf16 peak."""
        return self.tflops_per_gpu * 1e12 / self.workload.gpu.peak_flops

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def attention_imbalance(self) -> float:
        """Attention work of the busiest rank over the mean (``max n_r * P / N``; 1.0 even)."""
        return self.workload.attention_imbalance

    def per_sp_rank(self) -> dict[str, Any] | None:
        """Every rank of the Ulysses all-to-all group: tokens, heads, all-to-all bytes of one
        layer, peak memory (``None`` without an all-to-all)."""
        w = self.workload
        if w.a2a_degree == 1:
            return None
        m = w.shape
        plan = w.heads
        tokens = _comm.ulysses_rank_tokens(w)
        a2a = _comm.ulysses_bytes_by_rank(
            m.n_heads, m.n_kv_heads, m.head_dim, w.a2a_degree, tokens, w.e
        )
        return {
            "tokens": tokens,
            "q_heads": list(plan.q_heads),
            "kv_heads": plan.kv_heads,
            "all_to_all_bytes_per_layer": a2a,
            "comm_rank": _comm.ulysses_busiest_rank(w),
            "memory_peak_bytes": [int(b) for b in self.memory.peak_by_rank][: w.a2a_degree],
            "memory_rank": self.memory.rank,
        }

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of ``python -m simulations predict --json``."""
        w = self.workload
        d: dict[str, Any] = {"inputs": w.to_dict()}
        d["attention_imbalance"] = self.attention_imbalance
        d["token_imbalance"] = w.token_imbalance
        d["per_sp_rank"] = self.per_sp_rank()
        d.update(self.comm.to_dict())
        d["memory_bytes"] = self.memory.to_dict()
        d["memory_peak_moment"] = self.memory.peak_moment
        d["memory_capacity_bytes"] = int(self.memory.capacity)
        d["fits"] = self.fits
        d["cpu_memory_bytes"] = int(self.memory.cpu_bytes)
        d["activation_bytes_per_layer"] = {k: int(v) for k, v in self.memory.per_layer.items()}
        d["step_time_s"] = self.step_time_s
        d["time_breakdown"] = self.time.to_dict()
        d["tokens_per_s"] = self.tokens_per_s
        d["tflops_per_gpu"] = self.tflops_per_gpu
        d["tflops_per_gpu_megatron"] = self.flops.megatron / w.world / self.time.total / 1e12
        d["mfu"] = self.mfu
        d["model_flops_per_step"] = self.flops.model
        d["hardware_flops_per_step"] = self.flops.hardware
        return d


def predict(
    model: str | ModelShape | Workload, seq_len: int | None = None, **options: Any
) -> Prediction:
    """Predict communication, memory and step time.

    Args:
        model: a preset name, a :class:`~dtensor_ulysses.plan.ModelShape`, or a ready
            :class:`~simulations.config.Workload` (then no other argument is allowed).
        seq_len: sequence length ``S``.
        **options: any other :class:`~simulations.config.Workload` field (``dp``, ``sp``, ``gpu``,
            ``ac``, ``attention``, ...).

    Raises:
        ValueError: invalid inputs (the message names the numbers and the fix).
    """
    if isinstance(model, Workload):
        if seq_len is not None or options:
            raise ValueError("pass either a Workload or (model, seq_len, **options), not both")
        w = model
    else:
        if seq_len is None:
            raise ValueError("seq_len is required")
        shape = get_shape(model) if isinstance(model, str) else model
        w = Workload(shape=shape, seq_len=seq_len, **options)
    c = _comm.summarize(w)
    mem = _memory.estimate(w)
    fl = _flops.count(
        w.shape, w.seq_len, w.dp * w.micro_batch, recompute=w.ac == "full", causal=True
    )
    t = _timing.step_time(w, fl, c, mem)
    return Prediction(w, c, mem, fl, t)


def compare_methods(w: Workload) -> dict[str, Prediction | str]:
    """The same workload under every attention method; a method that cannot run gives its error."""
    out: dict[str, Prediction | str] = {}
    for method in METHODS:
        try:
            out[method] = predict(w.with_(attention=method))
        except ValueError as e:
            out[method] = str(e)
    return out
