"""Vendor ceilings of the GPUs this project knows: memory, dense bf16 FLOP/s, HBM bandwidth.

The one table of hardware numbers, torch-free: :mod:`dtensor_ulysses.train.metrics` reads the peak
FLOP/s for MFU, and the simulator's GPU profiles (``simulations/hardware.py``) build on it, adding
links and efficiencies. Numbers are the vendors' data sheets for the SXM parts; memory is what
``nvidia-smi`` reports as total.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPU_SPECS", "GpuSpec", "spec_for_device"]

MiB = 2**20


@dataclass(frozen=True)
class GpuSpec:
    """One GPU type's ceilings.

    Attributes:
        name: key (``h100``, ``h200``, ``a100-40gb``, ``a100-80gb``).
        device_names: substrings of ``torch.cuda.get_device_name()`` that identify it; all must
            occur (``("A100", "80GB")``).
        memory_bytes: device memory as the driver reports it (``nvidia-smi`` total).
        peak_flops: dense bf16 tensor-core FLOP/s.
        hbm_bw: HBM bandwidth, bytes/s.
    """

    name: str
    device_names: tuple[str, ...]
    memory_bytes: int
    peak_flops: float
    hbm_bw: float


# Order matters for spec_for_device: the more specific names first.
GPU_SPECS: dict[str, GpuSpec] = {
    g.name: g
    for g in [
        # H100 SXM 80 GB (HBM3): nvidia-smi total 81559 MiB; 989 TFLOP/s dense bf16; 3.35 TB/s
        GpuSpec("h100", ("H100",), 81559 * MiB, 989e12, 3.35e12),
        # H200 SXM 141 GB (HBM3e): nvidia-smi total 143771 MiB; the H100's compute; 4.8 TB/s
        GpuSpec("h200", ("H200",), 143771 * MiB, 989e12, 4.8e12),
        # A100 SXM 80 GB (HBM2e): nvidia-smi total 81920 MiB; 312 TFLOP/s dense bf16; 2.039 TB/s
        GpuSpec("a100-80gb", ("A100", "80GB"), 81920 * MiB, 312e12, 2.039e12),
        # A100 SXM 40 GB (HBM2): nvidia-smi total 40960 MiB; 1.555 TB/s
        GpuSpec("a100-40gb", ("A100",), 40960 * MiB, 312e12, 1.555e12),
    ]
}


def spec_for_device(device_name: str) -> GpuSpec | None:
    """The spec whose ``device_names`` all occur in ``device_name`` (as
    ``torch.cuda.get_device_name`` reports it), or None for an unknown device."""
    return next(
        (g for g in GPU_SPECS.values() if all(n in device_name for n in g.device_names)), None
    )
