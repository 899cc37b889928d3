"""Weight init draws only the rows a rank holds, with the values of the full draw."""

from __future__ import annotations

import torch

from dtensor_ulysses.models.weights import _draw_rows, _rows_per_block


def test_init_draws_only_the_rows_asked_for():
    """Any row range of a parameter equals the same rows of the full draw (so FSDP2 shards,
    whatever their number, hold the values of the unsharded model)."""
    shape = (300, 4096)  # 256 rows a block: ranges cross block edges
    assert _rows_per_block(shape) == 256
    full = _draw_rows(shape, 0, 300, 0.02, 5, "w")
    for lo, hi in [(0, 1), (10, 260), (255, 257), (256, 300), (299, 300), (0, 300)]:
        assert torch.equal(_draw_rows(shape, lo, hi, 0.02, 5, "w"), full[lo:hi]), (lo, hi)
    assert not torch.equal(_draw_rows(shape, 0, 300, 0.02, 6, "w"), full)
