"""The kernel choice (attention.py) and the GQA kv-head plan (kv_head_index), single process."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dtensor_ulysses as du
from dtensor_ulysses.attention import local as attention
from dtensor_ulysses.plan import head_plan, seq_split
from tests.reference import reference_attention


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("K", [8, 4, 1])
def test_sdpa_matches_reference(causal, K):
    g = torch.Generator().manual_seed(K)
    q = torch.randn(2, 7, 8, 5, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 7, K, 5, generator=g, dtype=torch.float64) for _ in range(2))
    out = du.local_attention(q, k, v, causal=causal, backend="sdpa", softmax_scale=0.3)
    ref = reference_attention(q, k, v, causal=causal, softmax_scale=0.3)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_auto_picks_sdpa_on_cpu_and_overrides(monkeypatch):
    q = torch.randn(1, 4, 2, 8)
    assert attention.resolve_backend("auto", q) == "sdpa"
    with du.force_backend("sdpa"):
        assert attention.resolve_backend("auto", q) == "sdpa"
    with du.force_backend("flash_attn"), pytest.raises(RuntimeError, match="flash_attn"):
        attention.resolve_backend("auto", q)  # forced but unable: an error, never a switch
    monkeypatch.setenv(attention.ENV_VAR, "nonsense")
    with pytest.raises(ValueError, match="DTENSOR_ULYSSES_ATTENTION='nonsense'"):
        attention.resolve_backend("auto", q)
    monkeypatch.setenv(attention.ENV_VAR, "sdpa")
    assert attention.resolve_backend("auto", q) == "sdpa"
    assert attention.resolve_backend("sdpa", q) == "sdpa"


def test_auto_would_pick_flash_when_usable(monkeypatch):
    """With a (fake) importable flash-attn and CUDA bf16 inputs, auto chooses it."""
    from dtensor_ulysses.attention import kernels

    monkeypatch.setattr(kernels, "flash_problem", lambda *args: None)
    assert attention.resolve_backend("auto", torch.randn(1, 4, 2, 8).bfloat16()) == "flash_attn"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sdpa", "flash_attn"])
def test_cuda_bf16_matches_reference(backend):
    if backend == "flash_attn" and not attention.flash_attn_available():
        pytest.skip("flash-attn not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 256, 8, 64, device="cuda", generator=g)
    k, v = (torch.randn(2, 256, 2, 64, device="cuda", generator=g) for _ in range(2))
    out = du.local_attention(*(t.bfloat16() for t in (q, k, v)), backend=backend)
    ref = reference_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


def _head_layouts():
    def build(kv, group, sp_pick):
        n_q = kv * group
        return n_q, kv, 1 + sp_pick % n_q  # any sp from 1 to n_q, divisible or not

    return st.builds(build, st.integers(1, 8), st.integers(1, 8), st.integers(0, 63))


@settings(max_examples=400, deadline=None)
@given(_head_layouts())
def test_head_plan_gives_every_rank_its_kv_heads(layout):
    """Local q head j of rank r must use local kv head j // (n_r / m_r): that is kv(q head)."""
    n_q, n_kv, sp = layout
    plan = head_plan(n_q, n_kv, sp)
    group = n_q // n_kv
    assert sum(plan.q_heads) == n_q and max(plan.q_heads) - min(plan.q_heads) <= 1
    assert list(plan.q_heads) == sorted(plan.q_heads, reverse=True)
    first = 0
    for n, kv in zip(plan.q_heads, plan.kv_index):
        m = len(kv)
        assert n % m == 0, "q heads per rank must be a multiple of its kv heads"
        for j in range(n):
            assert kv[j // (n // m)] == (first + j) // group
        assert m <= n
        first += n
    if n_kv % sp == 0:
        assert plan.is_plain_shard and du.kv_head_index(n_q, n_kv, sp) is None
    if n_q % sp == 0 and sp % n_kv == 0:
        assert plan.kv_heads == [1] * sp, "sp > K: exactly one kv head per rank"
    assert plan.imbalance == pytest.approx(max(plan.q_heads) * sp / n_q)


def test_uneven_heads_warn_about_imbalance():
    from dtensor_ulysses.attention.ulysses import _warn_imbalance
    from dtensor_ulysses.plan import head_plan, head_split

    assert head_split(12, 8) == [2, 2, 2, 2, 1, 1, 1, 1]
    assert head_plan(12, 4, 8).imbalance == pytest.approx(4 / 3)
    _warn_imbalance.cache_clear()
    with pytest.warns(UserWarning, match=r"12 q heads on sp=8: .* imbalance of 1.33x"):
        _warn_imbalance(12, 8)
    with pytest.raises(ValueError, match=r"sp=16 exceeds the 12 q heads .* use sp <= 12"):
        head_plan(12, 4, 16)


def test_kv_head_index_examples():
    assert du.kv_head_index(8, 2, 4) == [0, 0, 1, 1]
    assert du.kv_head_index(8, 1, 4) == [0, 0, 0, 0]
    assert du.kv_head_index(8, 4, 2) is None
    assert du.kv_head_index(6, 3, 2) == [0, 0, 1, 1, 2, 2]  # one kv head per q head
    assert du.kv_head_index(6, 3, 4) == [0, 1, 2, 2]  # uneven: 2, 2, 1, 1 q heads
    assert seq_split(37, 4) == [10, 10, 10, 7]
    assert seq_split(5, 4) == [2, 2, 1, 0]


@pytest.mark.parametrize("causal", [True, False])
def test_local_attention_never_crosses_documents(causal):
    g = torch.Generator().manual_seed(1)
    docs = [[1, 4, 2], [3, 3, 1]]  # per row, S = 7, one-token documents included
    q = torch.randn(2, 7, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 7, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 7, 2, 3, generator=g, dtype=torch.float64)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])
    out = du.local_attention(q, k, v, causal=causal, backend="sdpa", position_ids=pos)
    for b, row in enumerate(docs):
        lo = 0
        for n in row:
            sl = slice(lo, lo + n)
            ref = reference_attention(q[b : b + 1, sl], k[b : b + 1, sl], v[b : b + 1, sl],
                                      causal=causal)  # fmt: skip
            torch.testing.assert_close(out[b : b + 1, sl], ref, rtol=0, atol=1e-12)
            lo += n
    # no weight crosses a boundary: the first document's outputs ignore every other key
    (dk,) = torch.autograd.grad(out[0, :1].sum(), k)
    assert dk[0, 1:].abs().max() == 0 and dk[1].abs().max() == 0
