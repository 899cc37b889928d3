"""Communication only: the differentiable all-to-all (uneven pieces, several tensors in one
collective, started and waited), the differentiable all-gather of sequence slices, the
ring's point-to-point k/v passing, the halo exchange of a short convolution (the previous
rank's last positions), and the sum over a group whose gradient passes through unchanged
(sequence-level losses).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtensor_ulysses._public import lazy_exports

if TYPE_CHECKING:  # the public names, written once (__all__ and the lazy map read them)
    from dtensor_ulysses.comm.allgather import (
        all_gather_seq,
        all_gather_seq_bytes,
    )
    from dtensor_ulysses.comm.alltoall import (
        all_to_all,
        dim_order,
        start_exchange,
    )
    from dtensor_ulysses.comm.halo import (
        halo_bytes,
        halo_exchange,
    )
    from dtensor_ulysses.comm.reduce import (
        all_reduce_sum,
    )

__getattr__, __dir__, __all__ = lazy_exports(__name__)
