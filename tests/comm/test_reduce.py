"""``comm.all_reduce_sum``: a sum over the group whose gradient passes through unchanged.

Every rank holds its part ``x_r = a_r @ w`` of per-row sums (``a_r`` differs per rank, ``w`` is
the shared parameter), takes ``X = all_reduce_sum(x_r)`` and computes the same non-linear loss
``L(X)``; the ranks' gradients of ``w``, summed (what FSDP2 does), equal the gradient of one
process computing ``L(sum_r a_r @ w)``. Communication: forward one all-reduce of ``x``'s bytes,
backward none.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dtensor_ulysses.launch import run_local_world

B, D = 3, 5


def _parts(world: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a = [torch.randn(B, D, generator=g, dtype=torch.float64) for _ in range(world)]
    return a, torch.randn(D, generator=g, dtype=torch.float64)


def _loss(X: torch.Tensor) -> torch.Tensor:  # non-linear in the sums, as DPO's
    return -F.logsigmoid(X[0] - X[1]) + (X / 4).tanh().pow(2).sum()


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from dtensor_ulysses.comm import all_reduce_sum
    from dtensor_ulysses.debug import CommCounter

    a, w0 = _parts(world)
    w = w0.clone().requires_grad_()
    with CommCounter() as fwd:
        X = all_reduce_sum(a[rank] @ w, dist.group.WORLD)
    loss = _loss(X)
    with CommCounter() as bwd:
        loss.backward()
    grad = w.grad.clone()
    dist.all_reduce(grad)  # what FSDP2 does with the ranks' gradients (summed)
    return {"loss": loss.item(), "grad": grad, "fwd": fwd.by_kind(), "bwd": bwd.by_kind()}


@pytest.mark.timeout(120)
def test_sum_with_passthrough_gradient_equals_one_process():
    out = run_local_world(_worker, 2, timeout_s=100)
    a, w0 = _parts(2)
    w = w0.clone().requires_grad_()
    ref = _loss(sum(ar @ w for ar in a))
    ref.backward()
    for r in out:
        assert r["loss"] == pytest.approx(ref.item(), rel=1e-12)
        torch.testing.assert_close(r["grad"], w.grad, rtol=1e-12, atol=1e-12)
        assert r["fwd"] == {"all_reduce": {"count": 1, "bytes": B * 8}}, r["fwd"]
        assert r["bwd"] == {}, r["bwd"]
