"""Communication only: the differentiable all-to-all (uneven pieces, several tensors in one
collective, started and waited) and the ring's point-to-point k/v passing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtensor_ulysses._public import lazy_exports

# public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "all_to_all": "alltoall",
    "AllToAllInFlight": "alltoall",
    "dim_order": "alltoall",
    "even_sizes": "alltoall",
    "PendingExchange": "alltoall",
    "ring_shift": "p2p",
    "RingShift": "p2p",
    "start_exchange": "alltoall",
}

__all__ = [
    "all_to_all",
    "AllToAllInFlight",
    "dim_order",
    "even_sizes",
    "PendingExchange",
    "ring_shift",
    "RingShift",
    "start_exchange",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs
    from dtensor_ulysses.comm.alltoall import (
        AllToAllInFlight,
        PendingExchange,
        all_to_all,
        dim_order,
        even_sizes,
        start_exchange,
    )
    from dtensor_ulysses.comm.p2p import (
        RingShift,
        ring_shift,
    )
