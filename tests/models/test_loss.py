"""loss.py on one process: the sums, the tiled variant, the global token count, the per-token
label log-probabilities (tiled, with TRL's per-token statistics)."""

import pytest
import torch
import torch.nn.functional as F

from dtensor_ulysses.data import IGNORE_INDEX
from dtensor_ulysses.models import (
    TOKEN_STATS,
    cross_entropy_sum,
    tiled_cross_entropy_sum,
    tiled_token_logps,
    token_logps,
)
from dtensor_ulysses.parallel import global_valid_tokens


def _data(seed=0, B=2, s=7, D=5, V=11):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, s, D, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, D, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (B, s), generator=g)
    labels[0, 3] = IGNORE_INDEX
    return h, w, labels


def test_sum_equals_mean_times_count():
    h, w, labels = _data()
    logits = h @ w.t()
    mean = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    total = cross_entropy_sum(logits, labels)
    assert global_valid_tokens(labels) == labels.numel() - 1
    torch.testing.assert_close(total.double() / (labels.numel() - 1), mean, rtol=1e-6, atol=0)


@pytest.mark.parametrize("chunk", [1, 3, 14, 100])
def test_tiled_equals_full_forward_and_backward(chunk):
    h, w, labels = _data()
    full = F.cross_entropy(
        (h @ w.t()).reshape(-1, 11), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    gh, gw = torch.autograd.grad(full, (h, w))
    tiled = tiled_cross_entropy_sum(h, w, labels, chunk_tokens=chunk)
    th, tw = torch.autograd.grad(tiled, (h, w))
    torch.testing.assert_close(tiled.double(), full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(th, gh, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tw, gw, rtol=1e-6, atol=1e-6)


def test_no_valid_labels_and_bad_chunks_are_errors():
    with pytest.raises(ValueError, match="no valid labels"):
        global_valid_tokens(torch.full((2, 3), IGNORE_INDEX))
    with pytest.raises(ValueError, match="chunk_tokens=0 must be >= 1"):
        tiled_cross_entropy_sum(*_data(), chunk_tokens=0)


@pytest.mark.parametrize("chunk", [1, 3, 14, 100])
def test_tiled_token_logps_equal_full_logits(chunk):
    """Per-token label log-probabilities without [B, s, V] logits: values and gradients equal
    log_softmax of the full logits (float64), 0 where the label is IGNORE_INDEX."""
    h, w, labels = _data()
    logp_full = (h @ w.t()).log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    logp_full = logp_full.masked_fill(labels == IGNORE_INDEX, 0.0)
    g = torch.randn(
        logp_full.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    gh, gw = torch.autograd.grad(logp_full, (h, w), g)
    for stats in (False, True):
        out = tiled_token_logps(h, w, labels, chunk_tokens=chunk, stats=stats)
        logp = out[..., 0] if stats else out
        assert out.dtype == torch.float32 and logp.shape == labels.shape
        torch.testing.assert_close(logp.double(), logp_full, rtol=1e-5, atol=1e-5)
        assert logp[0, 3] == 0
        th, tw = torch.autograd.grad(logp, (h, w), g)
        torch.testing.assert_close(th, gh, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tw, gw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        token_logps(h @ w.t(), labels).double(), logp_full, rtol=1e-5, atol=1e-5
    )


def test_tiled_token_stats_are_trl_quantities():
    """stats=True: entropy, mean logit over the vocabulary and argmax == label, per token, no
    gradient, 0 where the label is IGNORE_INDEX (what TRL's fused head logs)."""
    h, w, labels = _data()
    out = tiled_token_logps(h, w, labels, chunk_tokens=3, stats=True)
    assert out.shape == (*labels.shape, 1 + len(TOKEN_STATS))
    logits = (h @ w.t()).detach()
    p = logits.softmax(-1)
    valid = labels != IGNORE_INDEX
    want = {
        "entropy": -(p * p.log()).sum(-1),
        "mean_logits": logits.mean(-1),
        "is_top1": (logits.argmax(-1) == labels).double(),
    }
    for k, name in enumerate(TOKEN_STATS, start=1):
        torch.testing.assert_close(out[..., k].double(), want[name] * valid, rtol=1e-5, atol=1e-5)
    # the statistics carry no gradient into h or w
    gh, gw = torch.autograd.grad(out[..., 1:].sum() + 0 * out[..., 0].sum(), (h, w))
    assert gh.abs().max() == 0 and gw.abs().max() == 0
