"""Debug helpers: :class:`CommCounter` (collectives and bytes per rank) and the layout helpers
(who holds which slice of a placement), as ``torch.distributed.tensor.debug`` keeps
``visualize_sharding``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtensor_ulysses._public import lazy_exports

# public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "a2a_plan": "layout",
    "Chunk": "layout",
    "CollectiveCall": "comm_counter",
    "CommCounter": "comm_counter",
    "describe": "layout",
    "describe_placements": "layout",
    "head_ranges": "layout",
    "kv_plan": "layout",
    "layout_notation": "layout",
    "local_ranges": "layout",
    "mesh_ranks": "layout",
    "ownership": "layout",
    "parse_layout": "layout",
    "parse_placement": "layout",
    "send_matrix": "layout",
    "shard_range": "layout",
    "token_ranges": "layout",
    "ulysses_closed_form": "layout",
}

__all__ = [
    "a2a_plan",
    "Chunk",
    "CollectiveCall",
    "CommCounter",
    "describe",
    "describe_placements",
    "head_ranges",
    "kv_plan",
    "layout_notation",
    "local_ranges",
    "mesh_ranks",
    "ownership",
    "parse_layout",
    "parse_placement",
    "send_matrix",
    "shard_range",
    "token_ranges",
    "ulysses_closed_form",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs
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
        local_ranges,
        mesh_ranks,
        ownership,
        parse_layout,
        parse_placement,
        send_matrix,
        shard_range,
        token_ranges,
        ulysses_closed_form,
    )
