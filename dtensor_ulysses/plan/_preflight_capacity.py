"""The capacity side of :mod:`dtensor_ulysses.plan.preflight`: how much memory this rank has.

:func:`host_capacity` is the host memory available now (``MemAvailable``, or the memory cgroup's
remaining limit if lower) divided by the ranks on this machine; :func:`device_capacity` is the
GPU's total memory, or on CPU the host capacity. Two environment variables override them
(:data:`CAPACITY_ENV`, :data:`HOST_CAPACITY_ENV`), as bytes or with a unit (:func:`parse_bytes`).
"""

from __future__ import annotations

import os
import re

__all__ = ["CAPACITY_ENV", "HOST_CAPACITY_ENV", "device_capacity", "host_capacity", "parse_bytes"]

# Per-rank capacity for tests and for machines whose limit the probes cannot see (a container's
# cgroup, a GPU shared with other jobs): bytes, or a number with a unit ("12GiB", "512MB").
CAPACITY_ENV = "DTENSOR_ULYSSES_MEMORY_CAPACITY"
HOST_CAPACITY_ENV = "DTENSOR_ULYSSES_HOST_MEMORY_CAPACITY"

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}  # fmt: skip


def parse_bytes(text: str) -> int:
    """``"12GiB"``, ``"512MB"``, ``"1e9"`` or ``"1000"`` as a number of bytes.

    Raises:
        ValueError: not a non-negative number with an optional unit (B, KB/MB/GB/TB, KiB/...).
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"{text!r} is not a memory size; write bytes or a number with a unit, e.g. 16GiB"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


# ----------------------------------------------------------------------------------------------
# capacity
# ----------------------------------------------------------------------------------------------
def _local_ranks() -> int:
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        try:
            return max(1, int(os.environ[var]))
        except (KeyError, ValueError):
            continue
    return 1


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_available() -> int | None:
    """What the memory cgroup (v2 or v1) of this process still allows, if it sets a limit."""
    v1 = "/sys/fs/cgroup/memory/memory."
    for limit_f, usage_f in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (v1 + "limit_in_bytes", v1 + "usage_in_bytes"),
    ):
        try:
            with open(limit_f) as f:
                raw = f.read().strip()
            if raw == "max" or int(raw) >= 2**60:
                return None
            with open(usage_f) as f:
                return max(0, int(raw) - int(f.read().strip()))
        except (OSError, ValueError):
            continue
    return None


def host_capacity() -> tuple[int | None, str]:
    """This rank's share of the host memory available now, and where the number comes from.

    ``DTENSOR_ULYSSES_HOST_MEMORY_CAPACITY`` (per rank) overrides it; otherwise the smaller of
    ``MemAvailable`` and the cgroup's remaining limit, divided by the ranks on this machine
    (``LOCAL_WORLD_SIZE``). ``None`` when nothing can be read.
    """
    if os.environ.get(HOST_CAPACITY_ENV):
        return parse_bytes(os.environ[HOST_CAPACITY_ENV]), f"${HOST_CAPACITY_ENV}"
    found = [x for x in (_meminfo_available(), _cgroup_available()) if x is not None]
    if not found:
        return None, "unknown"
    ranks = _local_ranks()
    return min(found) // ranks, f"available host memory / {ranks} local rank(s)"


def device_capacity(device_type: str) -> tuple[int | None, str]:
    """This rank's device memory (total memory of its GPU; on CPU, :func:`host_capacity`), and
    where the number comes from. ``DTENSOR_ULYSSES_MEMORY_CAPACITY`` overrides it."""
    if os.environ.get(CAPACITY_ENV):
        return parse_bytes(os.environ[CAPACITY_ENV]), f"${CAPACITY_ENV}"
    if device_type == "cuda":
        import torch

        index = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
        props = torch.cuda.get_device_properties(index)
        return int(props.total_memory), f"total memory of {props.name}"
    return host_capacity()
