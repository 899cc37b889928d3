"""dtensor-ulysses: Ulysses sequence parallelism on PyTorch DTensor.

Sequence-sharded activations ``x[B, S_sp, N, H]`` become head-sharded ``x[B, S, N_sp, H]`` around
attention (``Shard(1) -> Shard(2)`` on the ``sp`` mesh axis) and go back afterwards.

Public names are imported on first use (PEP 562), so the torch-free subpackage
``dtensor_ulysses.plan`` can be imported by the torch-free simulator without importing torch.

The package is a stack of subpackages, each importing only from those below it (the layering
test holds the order): ``plan`` < ``comm``, ``memory``, ``debug`` < ``attention``, ``data`` <
``models`` < ``parallel`` < ``hf`` < ``train`` < the tools ``memtrace``, ``demo``, ``launch``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtensor_ulysses._public import lazy_exports

__version__ = "0.1.0"

if TYPE_CHECKING:  # the public names, written once (__all__ and the lazy map read them)
    from dtensor_ulysses.attention import (
        DeferredQ,
        LocalAttention,
        UlyssesAttention,
        force_backend,
        head_to_seq,
        local_attention,
        seq_to_head,
        ulysses_attention,
    )
    from dtensor_ulysses.debug import CommCounter
    from dtensor_ulysses.models import build_model, init_weights
    from dtensor_ulysses.parallel import flatten_dp_sp, init_mesh, parallelize
    from dtensor_ulysses.plan import SeqLayout, kv_head_index

# the names belong to their subpackages (their __module__ stays the subpackage's)
__getattr__, __dir__, __all__ = lazy_exports(__name__, own_module=False)
