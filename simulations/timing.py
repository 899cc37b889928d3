"""Step time: compute, communication, offload traffic, and what overlaps with what.

Compute (per GPU = step FLOPs / ``W``, :mod:`simulations.flops`):

    t_matmul    = matmul hardware FLOPs / (peak * matmul_efficiency) * token imbalance
    t_attention = attention hardware FLOPs / (peak * attention_efficiency) * attention imbalance
                  (efficiency <= FA2 ceiling, T3)
    t_memory    = elementwise traffic / HBM bandwidth; each saved activation byte is written
                  once in forward (and recompute) and read twice in backward (assumption)

The step is as slow as its slowest rank. Uneven Ulysses layouts give rank 0 both the most
tokens (``ceil(S/P)``: matmuls scale with ``token_imbalance = ceil(S/P) P / S``) and the most
heads (``ceil(N/P)``: attention scales with ``attention_imbalance = max n_r P / N``), so rank 0
sets the pace; ``imbalance_s`` is what the imbalance adds over an even split of the same work.

Communication (per call): ``latency + wire_bytes / bus_bw`` (alpha-beta model; NCCL bus factors,
row C3); the bus bandwidth is NVLink's when the group's consecutive ranks fit in one node, else
one NIC's (anchors, "Hardware ceilings").

Overlap assumptions (stated, not measured):

* Ulysses all-to-alls and Megatron all-gathers / reduce-scatters sit on the critical path (the
  next kernel needs their output): fully exposed.
* Ring attention p2p overlaps its own block attention (Liu et al.): exposed only where a step's
  transfer outlasts a step's compute (row C4's condition).
* FSDP2 all-gathers / reduce-scatters are prefetched and overlap compute; exposed: the first
  all-gather, the last reduce-scatter, and any excess of the total over compute.
* Optimizer offload: gradients down, CPU Adam, parameters up after backward - exposed.
  Activation offload: the copies overlap compute; only an excess is exposed. Parameter offload:
  every all-gather needs its shard uploaded first - exposed.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulations.comm import CommSummary
from simulations.config import Workload
from simulations.flops import FlopCount
from simulations.memory import MemoryBreakdown

__all__ = ["StepTime", "step_time"]


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step on one rank, by part; ``total`` is the step time."""

    matmul: float
    attention: float
    memory_bound: float
    comm_exposed: float
    comm_total: float
    offload_exposed: float
    by_group: dict[str, float]
    imbalance: float = 0.0

    @property
    def compute(self) -> float:
        return self.matmul + self.attention + self.memory_bound

    @property
    def total(self) -> float:
        return self.compute + self.comm_exposed + self.offload_exposed

    def to_dict(self) -> dict:
        return {
            "compute_s": self.compute,
            "matmul_s": self.matmul,
            "attention_s": self.attention,
            "memory_bound_s": self.memory_bound,
            "comm_total_s": self.comm_total,
            "comm_exposed_s": self.comm_exposed,
            "offload_exposed_s": self.offload_exposed,
            "comm_s_by_group": dict(self.by_group),
            "imbalance_s": self.imbalance,
        }


def _bw_lat(w: Workload, span: int) -> tuple[float, float]:
    g = w.gpu
    if span <= g.gpus_per_node:
        return g.intra_bw, g.intra_latency_s
    return g.inter_bw, g.inter_latency_s


def step_time(w: Workload, flops: FlopCount, comm: CommSummary, mem: MemoryBreakdown) -> StepTime:
    """Step time of workload ``w`` from its FLOPs, communication and memory (see module doc)."""
    g = w.gpu
    W = w.world
    # the busiest rank: the most tokens (matmuls) and the most heads (attention), both rank 0
    t_mm_even = flops.matmul_hw / W / (g.peak_flops * g.matmul_efficiency)
    t_att_even = flops.attention_hw / W / (g.peak_flops * g.attention_efficiency)
    t_mm = t_mm_even * w.token_imbalance
    t_att = t_att_even * w.attention_imbalance
    imbalance = (t_mm - t_mm_even) + (t_att - t_att_even)
    # elementwise traffic: saved activations written in forward (+ recompute), read 2x in backward
    saved = mem.per_layer["no_ac"] * w.shape.n_layers
    passes = (2 if w.ac == "full" else 1) + 2
    t_mem = saved * passes / g.hbm_bw
    compute = t_mm + t_att + t_mem

    L = w.shape.n_layers
    by_group: dict[str, float] = {}
    crit = ring = fsdp = 0.0
    ring_steps = 0
    for c in comm.items:
        calls, _, wire = c.per_step(L)
        if calls == 0:
            continue
        bw, lat = _bw_lat(w, c.span)
        t = calls * lat + wire / bw
        by_group[c.group] = by_group.get(c.group, 0.0) + t
        if c.group in ("dp_sp", "dp"):
            fsdp += t
        elif c.kind == "p2p":
            ring += t
            ring_steps += calls
        else:
            crit += t
    total_comm = sum(by_group.values())
    exposed = crit
    if ring:
        # each ring step's transfer hides behind that step's block attention (row C4)
        att_per_step = t_att / max(ring_steps, 1)
        exposed += max(0.0, ring - att_per_step * ring_steps) + ring / max(ring_steps, 1)
    if fsdp:
        units = 2 * L + 2
        exposed += 2 * fsdp / units + max(0.0, fsdp - compute)

    # offload traffic over PCIe and CPU Adam
    off = 0.0
    owned = w.shape.n_params / w.shard_degree
    if w.offload_optimizer or w.offload_params:
        # grads down (fp32), Adam on the CPU, parameters up (bf16)
        off += owned * (4 + w.e) / g.pcie_bw + owned / g.cpu_adam_params_per_s
    if w.offload_params:
        # each all-gather (forward and backward) uploads the shard first
        off += 2 * owned * w.e / g.pcie_bw
    if w.offload_activations:
        moved = 2 * mem.per_layer["ac_full"] * w.shape.n_layers  # down in fwd, up in bwd
        off += max(0.0, moved / g.pcie_bw - compute)
    return StepTime(t_mm, t_att, t_mem, exposed, total_comm, off, by_group, imbalance)
