"""head_to_seq(seq_to_head(x)) == x on hypothesis-drawn shapes, layouts and placements."""

import pytest

from dtensor_ulysses.launch import run_local_world
from tests import workers


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 4])
def test_round_trip_property(world_size):
    counts = run_local_world(workers.roundtrip_worker, world_size, 30)
    assert counts == [30] * world_size
