"""Memory features that do not know the model: host allocation, activation-checkpoint offload,
AdamW on the host, activation checkpointing from outside, and tiled autograd functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtensor_ulysses._public import lazy_exports

if TYPE_CHECKING:  # the public names, written once (__all__ and the lazy map read them)
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

__getattr__, __dir__, __all__ = lazy_exports(__name__)
