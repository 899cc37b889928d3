"""GPU profiles: memory, compute ceilings, links and the efficiencies the cost model assumes.

Every number is either a vendor ceiling (memory, dense bf16 FLOP/s and HBM bandwidth come from the
one table, :data:`dtensor_ulysses.plan.GPU_SPECS`; the published anchors' "Hardware ceilings"
rows check them), a published measurement named in the comment, or an explicit *assumption* (marked
as such) that a user with better numbers should override with :meth:`GpuProfile.with_`.

Units: bytes, seconds, FLOP/s, bytes/s. Bandwidths are NCCL *bus* bandwidths (nccl-tests
``doc/PERFORMANCE.md``): the time of a collective is ``wire_bytes / bus_bw`` where ``wire_bytes`` is
what one rank sends (:func:`simulations.comm.wire_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dtensor_ulysses.plan import GPU_SPECS

__all__ = ["GpuProfile", "GPUS", "get_gpu"]

GiB = 2**30


@dataclass(frozen=True)
class GpuProfile:
    """One GPU type inside a node of ``gpus_per_node`` such GPUs.

    Attributes:
        name: profile key (``h100``, ``h200``, ``a100-40gb``, ``a100-80gb``).
        memory_bytes: device memory as the driver reports it (``nvidia-smi`` total).
        reserved_bytes: memory tensors can never use: CUDA context, cuBLAS/NCCL workspaces and
            allocator fragmentation headroom (assumption: 2 GiB).
        peak_flops: dense bf16 tensor-core FLOP/s.
        hbm_bw: HBM bandwidth, bytes/s.
        intra_bw: NCCL bus bandwidth of all-to-all / all-gather / reduce-scatter inside a node.
        intra_latency_s: per-collective latency inside a node (assumption).
        inter_bw: per-GPU bus bandwidth when a collective spans nodes (one NIC's achieved rate).
        inter_latency_s: per-collective latency across nodes (assumption).
        gpus_per_node: GPUs joined by NVLink.
        matmul_efficiency: fraction of ``peak_flops`` large bf16 GEMMs sustain (assumption).
        attention_efficiency: fraction of ``peak_flops`` the attention kernel sustains, forward
            and backward together; kept at or under the FlashAttention-2 ceiling (row T3).
        pcie_bw: host <-> device bandwidth per GPU when all GPUs of a node copy at once.
        cpu_adam_params_per_s: parameters per second one rank's CPU Adam step updates when every
            rank of the node runs one (assumption, used only with optimizer offload).
    """

    name: str
    memory_bytes: int
    reserved_bytes: int
    peak_flops: float
    hbm_bw: float
    intra_bw: float
    intra_latency_s: float
    inter_bw: float
    inter_latency_s: float
    gpus_per_node: int
    matmul_efficiency: float
    attention_efficiency: float
    pcie_bw: float
    cpu_adam_params_per_s: float

    @property
    def usable_bytes(self) -> int:
        """Bytes the caching allocator can hand to tensors: ``memory_bytes - reserved_bytes``."""
        return self.memory_bytes - self.reserved_bytes

    def with_(self, **changes) -> GpuProfile:
        """A copy with some fields changed (e.g. measured bandwidths of your cluster)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


# Shared link assumptions.
# NVLink 4 (H100/H200 SXM): 450 GB/s per direction line rate; NCCL all-to-all / all-gather /
# reduce-scatter bus bandwidth about 370 GB/s on 8x H100 (anchors, "Hardware ceilings").
_NVLINK4_BUS = 370e9
# InfiniBand NDR: 400 Gb/s per GPU NIC, about 48-49 GB/s achieved; an all-to-all across nodes runs
# at about one NIC's rate (anchors, "Hardware ceilings").
_NDR_BUS = 48.5e9
# NVLink 3 (A100 SXM): 300 GB/s per direction line rate (Ring Attention paper's A100 figure, row
# C4); achieved bus bandwidth assumed at the same 82% of line rate as NVLink 4 (370 / 450).
_NVLINK3_BUS = 300e9 * 370 / 450
# HDR InfiniBand (A100 clusters): 200 Gb/s = 25 GB/s per GPU NIC line rate; achieved assumed at the
# same 97% as NDR (48.5 / 50).
_HDR_BUS = 25e9 * 48.5 / 50
# Latencies (assumptions): a few tens of microseconds per NCCL collective launch + handshake.
_INTRA_LAT, _INTER_LAT = 15e-6, 30e-6
# PCIe Gen5 x16 is 64 GB/s per direction; with all 8 GPUs of a node copying at once through two
# host sockets, assume 25 GB/s per GPU (Gen4 A100 nodes: 12 GB/s).
_PCIE5, _PCIE4 = 25e9, 12e9
# CPU Adam (assumption): 1e8 parameters/s per rank with 8 ranks sharing a node's cores. Chosen
# so that the ALST 32K row (row T2: 8B parameters, 8 ranks, optimizer offloaded) spends ~10 s in
# the optimizer step, which is the gap between its 17 s iteration and the GPU compute time.
_CPU_ADAM = 1.0e8


def _profile(name: str, **assumed) -> GpuProfile:
    """A profile with the vendor ceilings of :data:`~dtensor_ulysses.plan.GPU_SPECS`."""
    spec = GPU_SPECS[name]
    return GpuProfile(
        name=name,
        memory_bytes=spec.memory_bytes,
        peak_flops=spec.peak_flops,
        hbm_bw=spec.hbm_bw,
        **assumed,
    )


GPUS: dict[str, GpuProfile] = {
    g.name: g
    for g in [
        _profile(
            "h100",
            reserved_bytes=2 * GiB,
            intra_bw=_NVLINK4_BUS,
            intra_latency_s=_INTRA_LAT,
            inter_bw=_NDR_BUS,
            inter_latency_s=_INTER_LAT,
            gpus_per_node=8,
            matmul_efficiency=0.75,  # assumption: large bf16 GEMMs reach ~740 of 989 TFLOP/s
            # FlashAttention-2 reaches about 335 TFLOP/s on H100 (~35% of peak, row T3).
            attention_efficiency=0.335,
            pcie_bw=_PCIE5,
            cpu_adam_params_per_s=_CPU_ADAM,
        ),
        _profile(
            "h200",
            reserved_bytes=2 * GiB,
            intra_bw=_NVLINK4_BUS,
            intra_latency_s=_INTRA_LAT,
            inter_bw=_NDR_BUS,
            inter_latency_s=_INTER_LAT,
            gpus_per_node=8,
            matmul_efficiency=0.75,
            attention_efficiency=0.335,
            pcie_bw=_PCIE5,
            cpu_adam_params_per_s=_CPU_ADAM,
        ),
        _profile(
            "a100-40gb",
            reserved_bytes=2 * GiB,
            intra_bw=_NVLINK3_BUS,
            intra_latency_s=_INTRA_LAT,
            inter_bw=_HDR_BUS,
            inter_latency_s=_INTER_LAT,
            gpus_per_node=8,
            matmul_efficiency=0.70,  # assumption
            attention_efficiency=0.60,  # assumption: FlashAttention-2 on A100 (its paper: ~70%)
            pcie_bw=_PCIE4,
            cpu_adam_params_per_s=_CPU_ADAM,
        ),
        _profile(
            "a100-80gb",
            reserved_bytes=2 * GiB,
            intra_bw=_NVLINK3_BUS,
            intra_latency_s=_INTRA_LAT,
            inter_bw=_HDR_BUS,
            inter_latency_s=_INTER_LAT,
            gpus_per_node=8,
            matmul_efficiency=0.70,
            attention_efficiency=0.60,
            pcie_bw=_PCIE4,
            cpu_adam_params_per_s=_CPU_ADAM,
        ),
    ]
}


def get_gpu(name: str | GpuProfile) -> GpuProfile:
    """The profile called ``name`` (a :class:`GpuProfile` is returned as is).

    Raises:
        ValueError: unknown name; the message lists the profiles.
    """
    if isinstance(name, GpuProfile):
        return name
    key = str(name).lower().replace("_", "-")
    if key in GPUS:
        return GPUS[key]
    raise ValueError(f"unknown GPU profile {name!r}; choose one of {', '.join(GPUS)}")
