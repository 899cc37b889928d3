"""Memory features that do not know the model: host allocation, activation-checkpoint offload,
AdamW on the host, activation checkpointing from outside, and tiled autograd functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtensor_ulysses._public import lazy_exports

# public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "activation_offloader": "recompute",
    "ActivationOffloader": "offload",
    "allocating_host": "host",
    "checkpoint_module": "recompute",
    "cuda_schedule_on_cpu": "offload",
    "fsdp_offload_policy": "offload",
    "host_bytes": "host",
    "host_compute": "host",
    "host_empty": "host",
    "HostOffloadAdamW": "host_adamw",
    "is_checkpointed": "recompute",
    "is_host": "host",
    "offload_checkpoints": "recompute",
    "tiled": "tiling",
    "to_host": "host",
}

__all__ = [
    "activation_offloader",
    "ActivationOffloader",
    "allocating_host",
    "checkpoint_module",
    "cuda_schedule_on_cpu",
    "fsdp_offload_policy",
    "host_bytes",
    "host_compute",
    "host_empty",
    "HostOffloadAdamW",
    "is_checkpointed",
    "is_host",
    "offload_checkpoints",
    "tiled",
    "to_host",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs
    from dtensor_ulysses.memory.host import (
        allocating_host,
        host_bytes,
        host_compute,
        host_empty,
        is_host,
        to_host,
    )
    from dtensor_ulysses.memory.host_adamw import (
        HostOffloadAdamW,
    )
    from dtensor_ulysses.memory.offload import (
        ActivationOffloader,
        cuda_schedule_on_cpu,
        fsdp_offload_policy,
    )
    from dtensor_ulysses.memory.recompute import (
        activation_offloader,
        checkpoint_module,
        is_checkpointed,
        offload_checkpoints,
    )
    from dtensor_ulysses.memory.tiling import (
        tiled,
    )
