"""Which collectives run, how many, on which group and how many bytes, against the closed form.

Closed form (per rank, per call; a rank's bytes are the buffer it passes into the collective):
  seq_to_head / head_to_seq: one all-to-all of the local tensor, forward and backward.
  ulysses_attention, fused: forward all-to-all(q,k,v) of B*s*(N + 2*K')*H*e and all-to-all(o) of
  B*s*N*H*e; backward the same two. Unfused: q, k, v each in its own all-to-all.
  K' = K when sp divides K, else sp (each rank receives the one kv head its q heads use).
"""

from __future__ import annotations

import pytest

from dtensor_ulysses.launch import run_local_world
from tests import workers

E = 4  # float32


def _kv_after_replication(K: int, P: int) -> int:
    assert K % P == 0 or P % K == 0, "closed form below covers these cases"
    return max(K, P)


def _cases(world_size: int) -> list[dict]:
    layouts = {2: [(1, 2)], 4: [(1, 4), (2, 2)]}[world_size]
    cases = []
    for dp, sp in layouts:
        base = dict(dp=dp, sp=sp, B=2 * dp, S=8 * sp, N=8, H=4, seed=0)
        for K in (8, 2, 1):
            for fuse in (True, False):
                cases.append({**base, "K": K, "op": "attention", "fuse": fuse})
        cases.append({**base, "K": 8, "op": "seq_to_head"})
        cases.append({**base, "K": 8, "op": "head_to_seq"})
    return cases


def _expected(case: dict, local_B: int) -> list[int]:
    """Sizes, in bytes, of the all-to-alls one rank issues in forward (backward is the same)."""
    P, N, K, H = case["sp"], case["N"], case["K"], case["H"]
    s = case["S"] // P
    x = local_B * s * H * E  # bytes of one head for one rank's tokens
    if case["op"] != "attention":
        return [x * N]
    Kp = _kv_after_replication(K, P)
    qkv = [x * (N + 2 * Kp)] if case["fuse"] else [x * N, x * Kp, x * Kp]
    return qkv + [x * N]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_counts_and_bytes(world_size):
    results = run_local_world(workers.comm_worker, world_size, _cases(world_size))
    for rank, per_rank in enumerate(results):
        for r in per_rank:
            case, label = r["case"], f"rank {rank} {r['case']}"
            expected = _expected(case, r["local_B"])
            for phase in ("fwd", "bwd"):
                got = r[phase]
                # only all-to-alls, all on the sp group, exactly the closed-form sizes
                assert set(got["kinds"]) == {"all_to_all"}, f"{label} {phase}: {got['kinds']}"
                assert got["on_sp"] == len(got["all"]), f"{label} {phase}: collective off sp"
                sizes = [b for _, b in got["all"]]
                if phase == "bwd":  # backward runs the o exchange first, then q, k, v
                    assert sorted(sizes) == sorted(expected), f"{label} {phase}: {sizes}"
                else:
                    assert sizes == expected, f"{label} {phase}: {sizes} != {expected}"
                assert got["sp_bytes"] == sum(expected)
                # torch's own CommDebugMode agrees on the count, and sees no all-gather
                debug = r[f"{phase}_debug"]
                assert debug == {"c10d.alltoall_base_": len(expected)}, f"{label}: {debug}"


def test_closed_form_matches_design_volume():
    """The per-rank forward volume for MHA is 4*B*(S/P)*N*H*e (docs/design.md section 1)."""
    case = dict(sp=4, S=64, N=8, K=8, H=4, op="attention", fuse=True)
    assert sum(_expected(case, 2)) == 4 * 2 * (64 // 4) * 8 * 4 * E


def test_single_rank_issues_no_collective():
    results = run_local_world(
        workers.comm_worker, 1,
        [dict(dp=1, sp=1, B=2, S=8, N=8, K=2, H=4, seed=0, op="attention", fuse=True)],
    )  # fmt: skip
    r = results[0][0]
    assert r["fwd"]["all"] == [] and r["bwd"]["all"] == []
