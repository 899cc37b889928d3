"""loss.py on one process: the sums, the tiled variant, the global token count."""

import pytest
import torch
import torch.nn.functional as F

from dtensor_ulysses.data import IGNORE_INDEX
from dtensor_ulysses.models import cross_entropy_sum, tiled_cross_entropy_sum
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
