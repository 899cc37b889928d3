"""The million-token memory features, each exact: head-chunked Ulysses attention against the
float64 reference with its bytes in closed form; tiled loss, tiled MLP and offloading in the
trainer against the plain single-process run.

Closed forms are written out here (independent of ``dtensor_ulysses.plan``): with head chunks,
k and v travel once and each stage moves its share of q and o, so forward and backward move
exactly the bytes of one unchunked exchange; the backward also replays each stage's q
all-to-all (the stage is recomputed there).
"""

from __future__ import annotations

import pytest

from dtensor_ulysses.launch import run_local_world
from tests import feature_workers
from tests.test_long_context import _heads, _kv_sent

E = 8  # float64

# (dp, sp, B, S, N, K, H, C): sp > K, uneven S, one head per rank per stage (UPipe's choice)
CHUNK_CASES = [
    dict(dp=1, sp=4, B=2, S=37, N=8, K=2, H=4, C=2, causal=True, docs=True, seed=1),
    dict(dp=1, sp=4, B=1, S=32, N=16, K=4, H=4, C=4, causal=False, docs=False, seed=2),
    dict(dp=2, sp=2, B=2, S=19, N=8, K=8, H=4, C=4, causal=True, docs=True, seed=3),
    dict(dp=4, sp=1, B=4, S=16, N=4, K=2, H=4, C=2, causal=True, docs=False, seed=4),
]


@pytest.mark.timeout(300)
def test_head_chunked_attention_is_exact_with_closed_form_bytes():
    results = run_local_world(feature_workers.head_chunks_worker, 4, CHUNK_CASES)
    for rank, per_rank in enumerate(results):
        for r in per_rank:
            c, label = r["case"], f"rank {rank} {r['case']}"
            for name, err in r["errors"].items():
                assert err <= 1e-10, f"{label}: {name} error {err:.2e}"
            assert r["other"] == 0, f"{label}: collectives other than all-to-all"
            P, C, H, N = c["sp"], c["C"], c["H"], c["N"]
            if P == 1:
                assert r["fwd"] == r["bwd"] == (0, 0), label
                continue
            b, s, S, n = r["local_B"], r["local_S"], c["S"], _heads(N, P)[r["sp_rank"]]
            kv_all, kv_mine = sum(_kv_sent(N, c["K"], P)), _kv_sent(N, c["K"], P)[r["sp_rank"]]
            q = b * s * N * H * E  # the q heads leave from this rank's s tokens
            kv = b * s * 2 * kv_all * H * E  # k, v once (kv heads after GQA replication)
            o = b * S * n * H * E  # o leaves from the full length, this rank's heads
            # forward: kv once + C q stages + C o stages: the bytes of one unchunked exchange
            assert r["fwd"] == (1 + 2 * C, q + kv + o), label
            # backward: per stage d o (from s tokens) and d q (from S); d k, d v once; and each
            # stage's q all-to-all replayed by its recompute (torch's checkpoint stops early,
            # once attention's saved tensors are rebuilt, so o's all-to-all is not replayed)
            d_o, d_q, d_kv = b * s * N * H * E, b * S * n * H * E, b * S * 2 * kv_mine * H * E
            assert r["bwd"] == (1 + 3 * C, d_o + d_q + d_kv + q), label
