"""Debug helpers: :class:`CommCounter` (collectives and bytes per rank) and the layout helpers
(who holds which slice of a placement), as ``torch.distributed.tensor.debug`` keeps
``visualize_sharding``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtensor_ulysses._public import lazy_exports

if TYPE_CHECKING:  # the public names, written once (__all__ and the lazy map read them)
    from dtensor_ulysses.debug.comm_counter import (
        CollectiveCall,
        CommCounter,
    )
    from dtensor_ulysses.debug.layout import (
        Chunk,
        a2a_plan,
        describe,
        describe_placements,
        head_ranges,
        kv_plan,
        layout_notation,
        mesh_ranks,
        ownership,
        parse_layout,
        parse_placement,
        send_matrix,
        shard_range,
        token_ranges,
        ulysses_closed_form,
    )

__getattr__, __dir__, __all__ = lazy_exports(__name__)
