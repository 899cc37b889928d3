"""dtensor-ulysses: Ulysses sequence parallelism on PyTorch DTensor.

Sequence-sharded activations ``x[B, S_sp, N, H]`` become head-sharded ``x[B, S, N_sp, H]`` around
attention (``Shard(1) -> Shard(2)`` on the ``sp`` mesh axis) and go back afterwards.
"""

from dtensor_ulysses.attention import force_backend, local_attention
from dtensor_ulysses.comm import CommCounter
from dtensor_ulysses.mesh import flatten_dp_sp, init_mesh
from dtensor_ulysses.ulysses import (
    UlyssesAttention,
    head_to_seq,
    kv_head_index,
    seq_to_head,
    ulysses_attention,
)

__version__ = "0.1.0"

__all__ = [
    "CommCounter",
    "UlyssesAttention",
    "flatten_dp_sp",
    "force_backend",
    "head_to_seq",
    "init_mesh",
    "kv_head_index",
    "local_attention",
    "seq_to_head",
    "ulysses_attention",
]
