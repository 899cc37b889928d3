"""Ring attention and Ulysses x Ring: exact against the float64 reference, forward and backward,
p2p and all-to-all counts and bytes equal to closed forms written here independently, balanced
zigzag work, and clear errors. Worlds of 4 and 8 gloo ranks (CPU)."""

from __future__ import annotations

import pytest
import torch

from dtensor_ulysses.attention._ring_kernel import RingPlan
from dtensor_ulysses.launch import run_local_world
from dtensor_ulysses.plan import (
    check_ring_mesh,
    check_ring_seq,
    ring_chunks,
    ring_closed_form,
    ring_seq_sizes,
    zigzag_permutation,
    zigzag_positions,
)
from tests import ring_workers

F64 = dict(dtype=torch.float64)
F32 = dict(dtype=torch.float32)
WORLD4 = [
    dict(api="ring", dp=1, ring=4, sp=1, B=2, S=32, N=4, K=4, H=8, causal=True, **F64),
    dict(api="ring", dp=1, ring=4, sp=1, B=1, S=16, N=4, K=2, H=8, causal=False, **F64),
    dict(api="ring", dp=1, ring=4, sp=1, B=1, S=16, N=4, K=2, H=8, causal=True,
         order="contiguous", **F64),
    dict(api="ring", dp=2, ring=2, sp=1, B=2, S=16, N=4, K=2, H=8, causal=True,
         docs=[[0, 5, 11], [0, 3]], **F32),
    dict(api="usp", dp=1, ring=2, sp=2, B=2, S=16, N=4, K=4, H=8, causal=True, **F64),
    dict(api="usp", dp=1, ring=2, sp=2, B=2, S=16, N=4, K=1, H=8, causal=False, **F64),
    dict(api="usp", dp=1, ring=2, sp=2, B=2, S=16, N=4, K=1, H=8, causal=True,
         docs=[[0, 7], [0, 1, 9]], **F64),
    dict(api="usp", dp=1, ring=2, sp=2, B=1, S=24, N=4, K=2, H=8, causal=True, **F32),
]  # fmt: skip
WORLD8 = [
    dict(api="usp", dp=1, ring=2, sp=4, B=2, S=16, N=8, K=2, H=8, causal=True,
         docs=[[0, 6], [0, 2, 3, 12]], **F64),
    dict(api="usp", dp=1, ring=2, sp=4, B=1, S=16, N=8, K=2, H=8, causal=False, **F64),
    dict(api="usp", dp=1, ring=4, sp=2, B=2, S=32, N=4, K=4, H=8, causal=True, **F64),
    dict(api="usp", dp=1, ring=4, sp=2, B=1, S=16, N=4, K=1, H=8, causal=False, **F64),
    dict(api="usp", dp=1, ring=4, sp=2, B=1, S=16, N=4, K=1, H=8, causal=True,
         docs=[[0, 3, 10]], **F64),
    dict(api="usp", dp=1, ring=8, sp=1, B=1, S=32, N=2, K=1, H=8, causal=True, **F64),
    dict(api="usp", dp=1, ring=8, sp=1, B=1, S=32, N=2, K=1, H=8, causal=False, **F64),
    dict(api="ring", dp=1, ring=8, sp=1, B=2, S=32, N=2, K=2, H=8, causal=True,
         docs=[[0, 13], [0, 1, 2, 30]], **F64),
    dict(api="usp", dp=2, ring=2, sp=2, B=2, S=16, N=4, K=2, H=8, causal=True,
         docs=[[0, 4], [0, 9]], **F64),
    # uneven sp pieces inside a ring rank: L = 10 tokens over sp = 4 -> [3, 3, 3, 1]
    dict(api="usp", dp=1, ring=2, sp=4, B=1, S=20, N=4, K=2, H=8, causal=True, **F32),
]  # fmt: skip


# ----------------------------------------------------------------------------------------------
# torch-free layout, checks and closed forms
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("S,R,sp", [(16, 2, 2), (32, 4, 2), (40, 2, 4), (48, 8, 1), (20, 2, 4)])
def test_positions_cover_the_sequence_once_in_zigzag_order(S, R, sp):
    held = {(r, p): zigzag_positions(S, R, sp, r, p) for r in range(R) for p in range(sp)}
    assert sorted(t for pos in held.values() for t in pos) == list(range(S))
    c = S // (2 * R)
    for r in range(R):
        local = [t for p in range(sp) for t in held[r, p]]  # what the sp all-to-all gathers
        assert local == [*range(r * c, (r + 1) * c), *range((2 * R - 1 - r) * c, (2 * R - r) * c)]
        assert [len(held[r, p]) for p in range(sp)] == ring_seq_sizes(S, R, sp)
    # one permutation of the global sequence, then plain contiguous pieces over (ring, sp)
    perm, at = zigzag_permutation(S, R, sp), 0
    for r in range(R):
        for p in range(sp):
            assert perm[at : at + len(held[r, p])] == held[r, p]
            at += len(held[r, p])


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    S, R = 64, 4

    def pairs(order):  # attended (query, key) pairs per ring rank under a causal mask
        return [sum(t + 1 for lo, hi in ring_chunks(S, R, r, order) for t in range(lo, hi))
                for r in range(R)]  # fmt: skip

    def computed(order):  # what the kernel actually computes: the blocks' areas per rank
        areas = []
        for r in range(R):
            plan = RingPlan(None, R, r, [ring_chunks(S, R, j, order) for j in range(R)], True,
                            1.0, None, False)  # fmt: skip
            steps = [plan.step(j) for j in range(R)]
            areas.append(sum((a.stop - a.start) * (b.stop - b.start)
                             for a, b, _, _ in filter(None, steps)))  # fmt: skip
        return areas

    assert len(set(pairs("zigzag"))) == 1 and len(set(pairs("contiguous"))) == R
    assert len(set(computed("zigzag"))) == 1
    assert computed("contiguous") == [(S // R) ** 2 * (r + 1) for r in range(R)]


@pytest.mark.parametrize(
    "B,L,m,H,R,e", [(2, 8, 1, 8, 4, 8), (1, 6, 2, 4, 2, 2), (3, 4, 2, 8, 1, 4)]
)
def test_closed_form_matches_the_textbook_count(B, L, m, H, R, e):
    block = B * L * 2 * m * H
    got = ring_closed_form(B, L, m, H, R, elem_bytes=e, grad_bytes=max(e, 4))
    assert got["forward"] == {"count": R - 1, "bytes": (R - 1) * block * e}
    assert got["backward"]["count"] == (2 * R - 1 if R > 1 else 0)
    assert got["backward"]["bytes"] == ((R - 1) * block * e + R * block * max(e, 4) if R > 1 else 0)


def test_bad_lengths_and_meshes_name_the_numbers():
    with pytest.raises(ValueError, match=r"S=6 tokens is shorter than that: use a multiple of 8"):
        check_ring_seq(6, 4)
    with pytest.raises(
        ValueError, match=r"S=20 tokens does not: use a multiple of 8 \(e.g. 16 or 24\)"
    ):
        check_ring_seq(20, 4)
    with pytest.raises(ValueError, match=r"dp x ring x sp = 2 x 2 x 4 = 16, but the world has 8"):
        check_ring_mesh(2, 2, 4, 8)
    with pytest.raises(ValueError, match="ring=0"):
        check_ring_mesh(1, 0, 8, 8)
    with pytest.raises(ValueError, match="order="):
        zigzag_positions(16, 2, 1, 0, 0, order="striped")
    check_ring_mesh(2, 2, 2, 8)


# ----------------------------------------------------------------------------------------------
# worlds of 4 and 8: exactness and communication accounting
# ----------------------------------------------------------------------------------------------
def _expected_comm(case: dict, p: int, tokens: int) -> dict:
    """Sends (= receives) on the ring group and all-to-alls on the sp group, per phase."""
    R, sp, N, K, H = (case[x] for x in ("ring", "sp", "N", "K", "H"))
    B, L = case["B"] // case["dp"], case["S"] // R
    e = torch.empty((), dtype=case["dtype"]).element_size()
    n = N // sp  # q heads per sp rank (every case here has sp | N)

    def kv_used(rank):  # the kv heads that sp rank's q heads read
        return len({h // (N // K) for h in range(rank * n, (rank + 1) * n)})

    m = kv_used(p) if sp > 1 else K
    block = B * L * 2 * m * H
    fwd_p2p = ((R - 1), (R - 1) * block * e)
    bwd_p2p = ((2 * R - 1), (R - 1) * block * e + R * block * max(e, 4))
    if sp == 1:
        fwd_a2a = bwd_a2a = (0, 0)
    else:
        k_sent = sum(kv_used(r) for r in range(sp))
        fwd_a2a = (2, (B * tokens * (N + 2 * k_sent) + B * L * n) * H * e)
        bwd_a2a = (2, (B * L * (n + 2 * m) + B * tokens * N) * H * e)
    if R == 1:
        fwd_p2p = bwd_p2p = (0, 0)
    return {
        "forward": {"p2p": fwd_p2p, "p2p_recv": fwd_p2p, "a2a": fwd_a2a, "other": 0},
        "backward": {"p2p": bwd_p2p, "p2p_recv": bwd_p2p, "a2a": bwd_a2a, "other": 0},
    }


def _check_world(world: int, cases: list[dict]) -> None:
    out = run_local_world(ring_workers.world_worker, world, cases, timeout_s=120)
    for rank, res in enumerate(out):
        for case, got in zip(cases, res["cases"]):
            tol = 1e-10 if case["dtype"] == torch.float64 else 2e-5
            where = f"rank {rank} {got['coord']} case {case}"
            assert max(got["err"].values()) < tol, (where, got["err"])
            # the closed form of the library agrees with the one written above
            R, B, L = case["ring"], case["B"] // case["dp"], case["S"] // case["ring"]
            e = torch.empty((), dtype=case["dtype"]).element_size()
            want = _expected_comm(case, got["coord"][2], got["tokens"])
            assert {ph: got[ph] for ph in ("forward", "backward")} == want, where
            m = want["forward"]["p2p"][1] // max(1, (R - 1) * B * L * 2 * case["H"] * e)
            lib = ring_closed_form(B, L, m, case["H"], R, e, max(e, 4))
            assert (lib["forward"]["count"], lib["forward"]["bytes"]) == want["forward"]["p2p"]
            assert (lib["backward"]["count"], lib["backward"]["bytes"]) == want["backward"]["p2p"]
    bad = out[0]["bad"]
    assert "S=" in bad["short"] and f"multiple of {2 * world}" in bad["short"]
    assert f"each ring rank holds L=1 tokens: S = {world} x 1" in bad["short"]
    assert "global document starts" in bad["docs"]
    assert "no 'ring' axis" in bad["no_ring_axis"]


@pytest.mark.timeout(120)
def test_ring_and_ulysses_x_ring_world_of_4():
    _check_world(4, WORLD4)


@pytest.mark.timeout(120)
def test_ulysses_x_ring_world_of_8():
    _check_world(8, WORLD8)
