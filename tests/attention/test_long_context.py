"""Long-context data: packed documents, any sequence length, any head count — exact or refused.

References are independent: float64 attention run on each document alone; expected bytes come
from the closed form written out here (heads split as evenly as possible, first ranks one more).
"""

from __future__ import annotations

import random

import pytest

from dtensor_ulysses.launch import run_local_world
from tests import workers

E = 8  # float64


def _heads(N: int, P: int) -> list[int]:
    return [N // P + (r < N % P) for r in range(P)]


def _kv_sent(N: int, K: int, P: int) -> list[int]:
    """kv heads each rank receives: its distinct kv heads when each serves equally many of its
    consecutive q heads, else one per q head."""
    out, first = [], 0
    for n in _heads(N, P):
        used = [i // (N // K) for i in range(first, first + n)]
        first += n
        distinct = sorted(set(used))
        per = n // len(distinct)
        ok = n % len(distinct) == 0 and used == [h for h in distinct for _ in range(per)]
        out.append(len(distinct) if ok else n)
    return out


def _expected_bytes(r: dict) -> list[int]:
    """Forward all-to-all input sizes of a rank: q,k,v of its s tokens; o: S tokens, its heads."""
    c = r["case"]
    b, s, H, N, P = r["local_B"], r["local_S"], c["H"], c["N"], c["sp"]
    Ks = sum(_kv_sent(N, c["K"], P))
    return [b * s * (N + 2 * Ks) * H * E, b * c["S"] * _heads(N, P)[r["sp_rank"]] * H * E]


def _random_docs(S: int, rng: random.Random) -> list[int]:
    lengths = [1]  # a one-token document first
    while sum(lengths) < S:
        lengths.append(min(rng.choice([1, 2, 3, 5, 8, 13]), S - sum(lengths)))
    return lengths


def _assert_exact(results, tol=1e-10):
    for rank, per_rank in enumerate(results):
        for r in per_rank:
            assert r["meta_ok"], f"rank {rank} {r['case']}: shape/placements"
            for name, err in r["errors"].items():
                assert err <= tol, f"rank {rank} {r['case']}: {name} error {err:.2e}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_packed_documents_equal_per_document_reference(world_size):
    rng = random.Random(world_size)
    cases = []
    for K, causal, seed in [(2, True, 0), (8, True, 1), (1, True, 2), (2, False, 3)]:
        S = 6 * world_size + 1  # documents straddle shard boundaries; S also uneven
        docs = [_random_docs(S, rng) for _ in range(2)]
        cases.append(dict(dp=1, sp=world_size, B=2, S=S, N=8, K=K, H=4, causal=causal,
                          seed=seed, docs=docs))  # fmt: skip
    results = run_local_world(workers.long_context_worker, world_size, cases)
    _assert_exact(results)
    for per_rank in results:
        for r in per_rank:
            gathers = [c for c in r["fwd"] if c[0] == "all_gather"]
            # the only extra traffic: one all-gather of the int64 ids, padded to ceil(S/P)
            chunk = -(-r["case"]["S"] // world_size)
            assert gathers == [("all_gather", r["case"]["B"] * chunk * 8, True)], r["fwd"]
            assert all(c[0] == "all_to_all" for c in r["bwd"]), r["bwd"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_any_sequence_length_is_exact(world_size):
    P = world_size
    lengths = sorted({P * 3 - 1, P * 3 + 1, 13, P - 1})  # sp*k - 1, sp*k + 1, a prime, S < sp
    cases = [dict(dp=1, sp=P, B=2, S=S, N=8, K=2, H=4, causal=True, seed=S) for S in lengths]
    if P == 4:
        cases.append(dict(dp=2, sp=2, B=2, S=11, N=8, K=2, H=4, causal=True, seed=5))
    results = run_local_world(workers.long_context_worker, world_size, cases)
    _assert_exact(results)
    for per_rank in results:
        for r in per_rank:
            c = r["case"]
            assert sum(1 for x in r["fwd"] if x[0] == "all_to_all") == 2
            # bytes: q,k,v of this rank's own tokens; o of all S tokens for its heads; no padding
            assert [x[1] for x in r["fwd"]] == _expected_bytes(r), (c, r["fwd"])


@pytest.mark.timeout(400)
def test_any_head_count_exact_with_closed_form_bytes():
    cases = [
        dict(dp=1, sp=8, B=1, S=16, N=12, K=4, H=4, causal=True, seed=0),
        dict(dp=1, sp=8, B=1, S=16, N=28, K=4, H=4, causal=True, seed=1),
        dict(dp=2, sp=4, B=2, S=12, N=6, K=2, H=4, causal=True, seed=2),
        dict(dp=1, sp=8, B=1, S=19, N=12, K=4, H=4, causal=False, seed=3),
    ]
    results = run_local_world(workers.long_context_worker, 8, cases, timeout_s=360)
    _assert_exact(results)
    for per_rank in results:
        for r in per_rank:
            c, want = r["case"], _expected_bytes(r)
            assert [x[1] for x in r["fwd"]] == want, (c, r["fwd"], want)
            # backward runs the inverse exchanges: d(o) of its s tokens, then d(q,k,v) of S tokens
            me, kv = r["sp_rank"], _kv_sent(c["N"], c["K"], c["sp"])[r["sp_rank"]]
            H, N, b, s = c["H"], c["N"], r["local_B"], r["local_S"]
            heads = _heads(N, c["sp"])[me]
            want_bwd = [b * s * N * H * E, b * c["S"] * (heads + 2 * kv) * H * E]
            assert [x[1] for x in r["bwd"]] == want_bwd, (c, r["bwd"], want_bwd)
            assert all(x[2] for x in r["fwd"] + r["bwd"]), "a collective left the sp group"


def test_closed_form_kv_plan_examples():
    assert _heads(12, 8) == [2, 2, 2, 2, 1, 1, 1, 1]
    assert _kv_sent(12, 4, 8) == [1, 2, 1, 1, 1, 1, 1, 1]
    assert _kv_sent(8, 2, 4) == [1, 1, 1, 1]
