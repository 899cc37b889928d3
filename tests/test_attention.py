"""The kernel choice (attention.py) and the GQA kv-head plan (kv_head_index), single process."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dtensor_ulysses as du
from dtensor_ulysses import attention
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
    monkeypatch.setattr(attention, "_flash_attn_problem", lambda q: None)
    assert attention.resolve_backend("auto", torch.randn(1, 4, 2, 8)) == "flash_attn"


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


def _valid_head_layouts():
    def build(kv, group, sp_factor):
        n_q = kv * group
        sps = [d for d in range(1, n_q + 1) if n_q % d == 0]
        return n_q, kv, sps[sp_factor % len(sps)]

    return st.builds(build, st.integers(1, 8), st.integers(1, 8), st.integers(0, 50))


@settings(max_examples=300, deadline=None)
@given(_valid_head_layouts())
def test_kv_head_index_gives_every_rank_its_kv_heads(layout):
    """Local q head j of rank r must use local kv head j // (n / m): that head is kv(r*n + j)."""
    n_q, n_kv, sp = layout
    index = du.kv_head_index(n_q, n_kv, sp)
    n, group = n_q // sp, n_q // n_kv
    if index is None:
        assert n_kv % sp == 0
        index = list(range(n_kv))
    assert len(index) % sp == 0
    m = len(index) // sp
    assert n % m == 0, "q heads per rank must be a multiple of kv heads per rank"
    for r in range(sp):
        for j in range(n):
            assert index[r * m + j // (n // m)] == (r * n + j) // group
    assert len(index) <= max(n_kv, n_q), "never more kv heads than one per q head"
    if sp % n_kv == 0:
        assert len(index) == sp, "sp > K: exactly one kv head per rank"


def test_kv_head_index_examples():
    assert du.kv_head_index(8, 2, 4) == [0, 0, 1, 1]
    assert du.kv_head_index(8, 1, 4) == [0, 0, 0, 0]
    assert du.kv_head_index(8, 4, 2) is None
    assert du.kv_head_index(6, 3, 2) == [0, 0, 1, 1, 2, 2]  # one kv head per q head
    with pytest.raises(ValueError, match="6 q heads are not divisible by sp=4"):
        du.kv_head_index(6, 3, 4)
