"""ulysses_attention and UlyssesAttention equal an independent float64 reference, forward and
backward, on gloo worlds of 1, 2 and 4 ranks (1-D and 2-D meshes, MHA/GQA/MQA, sp > kv heads)."""

from __future__ import annotations

import itertools

import pytest
import torch

from dtensor_ulysses.launch import run_local_world
from tests import workers


def _cases(world_size: int) -> list[dict]:
    layouts = {1: [(1, 1)], 2: [(1, 2), (2, 1)], 4: [(1, 4), (2, 2)]}[world_size]
    cases = []
    for (dp, sp), causal, K, seed in itertools.product(
        layouts, (True, False), (8, 4, 2, 1), (0, 1)
    ):
        cases.append(
            dict(dp=dp, sp=sp, B=2, S=4 * sp, N=8, K=K, H=4, causal=causal, seed=seed,
                 dtype=torch.float64, api="dtensor")
        )  # fmt: skip
    base = dict(dp=1, sp=world_size, B=2, S=4 * world_size, N=8, H=4, seed=3)
    cases += [
        # the 1-D "sp" submesh
        {**base, "K": 2, "causal": True, "dtype": torch.float64, "api": "dtensor", "one_d": True},
        # replicated batch on a 2-D mesh
        {**base, "K": 4, "causal": True, "dtype": torch.float64, "api": "dtensor",
         "batch_on_dp": False},
        # float32 end to end (SDPA in fp32), against the float64 reference
        {**base, "K": 2, "causal": True, "dtype": torch.float32, "api": "dtensor"},
        # the nn.Module wrapper around a user kernel, MHA and MQA
        {**base, "K": 8, "causal": True, "dtype": torch.float64, "api": "module"},
        {**base, "K": 1, "causal": False, "dtype": torch.float64, "api": "module"},
    ]  # fmt: skip
    return cases


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_forward_backward_equal_reference(world_size):
    results = run_local_world(workers.equivalence_worker, world_size, _cases(world_size))
    for rank, per_rank in enumerate(results):
        for r in per_rank:
            tol = 1e-10 if r["case"]["dtype"] == torch.float64 else 2e-5
            label = f"rank {rank} case {r['case']}"
            assert r["meta_ok"], f"{label}: output shape/placements differ from q"
            for name, err in r["errors"].items():
                assert r["scale"][name] > 0 or world_size == 1, f"{label}: {name} is all zeros"
                assert err <= tol * max(1.0, r["scale"][name]), f"{label}: {name} error {err:.3e}"
    n = len(_cases(world_size))
    assert all(len(per_rank) == n for per_rank in results)
