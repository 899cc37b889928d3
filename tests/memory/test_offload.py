"""Host offload: activation checkpoints, FSDP2's CPU offload, the host AdamW (CPU, gloo)."""

from __future__ import annotations

import gc

import pytest
import torch

from dtensor_ulysses import memory
from dtensor_ulysses.launch import run_local_world
from dtensor_ulysses.memory import (
    activation_offloader,
    checkpoint_module,
    is_checkpointed,
    offload_checkpoints,
)
from dtensor_ulysses.models import build_model
from tests.memory import offload_workers as w

pytestmark = pytest.mark.timeout(180)


# ----------------------------------------------------------------------------------------------
# host memory registry
# ----------------------------------------------------------------------------------------------
def test_to_host_is_a_registered_copy_and_the_registry_forgets_it():
    t = torch.randn(3, 5)
    base = memory.host_bytes()
    h = memory.to_host(t)
    assert torch.equal(h, t) and h.untyped_storage() is not t.untyped_storage()
    assert memory.is_host(h) and not memory.is_host(t)
    assert memory.host_bytes() - base == 60
    assert memory.to_host(t, dtype=torch.float64).dtype == torch.float64
    del h
    gc.collect()
    assert memory.host_bytes() == base


def test_allocating_host_is_true_exactly_inside_host_allocations():
    seen = []

    class Probe(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((func.__name__, memory.allocating_host()))
            return func(*args, **(kwargs or {}))

    with Probe():
        memory.host_empty((4,), torch.float32)
        torch.empty(4)
        with memory.host_compute():
            torch.ones(2) + 1
    assert seen[0][1] is True and seen[1] == ("empty.memory_format", False)
    assert all(flag for _, flag in seen[2:])
    assert not memory.allocating_host()


# ----------------------------------------------------------------------------------------------
# activation checkpoints on the host
# ----------------------------------------------------------------------------------------------
def _tiny_grads(offload_mode):
    model = build_model("tiny", device="cpu")
    for block in model.layers:
        checkpoint_module(block, offload=offload_mode)
    ids = torch.randint(0, 272, (2, 32), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(32).expand(2, 32)
    model(ids, pos).square().mean().backward()
    return model, {n: p.grad for n, p in model.named_parameters()}


def test_offloaded_checkpoints_single_process_bit_identical():
    _, ref = _tiny_grads(False)
    shared = memory.ActivationOffloader()
    model, got = _tiny_grads(shared)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert all(activation_offloader(b) is shared for b in model.layers)
    n = len(model.layers)
    assert vars(shared.stats) == {
        "offloaded_tensors": n,
        "offloaded_bytes": n * 2 * 32 * model.shape.dim * 4,
        "restored_tensors": n,
        "prefetched_tensors": 0,  # CPU: no prefetch
    }
    _, own = _tiny_grads(True)  # an offloader per block
    assert all(torch.equal(ref[k], own[k]) for k in ref)


def test_offload_without_checkpointing_is_a_value_error():
    model = build_model("tiny", device="cpu")
    with pytest.raises(ValueError, match=r"2 of 2 modules .*--activation-checkpointing"):
        offload_checkpoints(model.layers)
    checkpoint_module(model.layers[0])
    with pytest.raises(ValueError, match="1 of 2 modules"):
        offload_checkpoints(model.layers)
    assert is_checkpointed(model.layers[0]) and activation_offloader(model.layers[0]) is None


@pytest.mark.parametrize("dp,sp", [(2, 1), (1, 2)])
def test_offloaded_checkpoints_under_fsdp2_and_ulysses_bit_identical(dp, sp):
    results = run_local_world(w.activation_offload, 2, dp, sp, timeout_s=150)
    for r in results:
        plain, off = r[False], r[True]
        assert plain["grads"].keys() == off["grads"].keys()
        for k in plain["grads"]:
            assert torch.equal(plain["grads"][k], off["grads"][k]), k
        # exactly each block's input h moved, once, not the shared cos/sin tables
        n, h = off["layers"], off["h_bytes"]
        assert off["stats"] == {
            "offloaded_tensors": n,
            "offloaded_bytes": n * h,
            "restored_tensors": n,
            "prefetched_tensors": 0,
        }
        assert off["host_after_forward"] == n * h and off["host_after_backward"] == 0
        assert plain["host_after_forward"] == 0


# ----------------------------------------------------------------------------------------------
# model states on the host
# ----------------------------------------------------------------------------------------------
def _adamw_runs(make, steps=3):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(8, 5), (5,), (3, 4, 2)]]
    opt = make([{"params": params[::2], "weight_decay": 0.1}, {"params": params[1:2]}])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        sched.step()
    return params, opt, sched


@pytest.mark.parametrize("foreach", [True, False])
def test_host_adamw_equals_torch_adamw_bitwise(foreach):
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
    ref, ref_opt, _ = _adamw_runs(lambda g: torch.optim.AdamW(g, foreach=foreach, **kw))
    got, opt, _ = _adamw_runs(lambda g: memory.HostOffloadAdamW(g, foreach=foreach, **kw))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    for a, b in zip(ref, got):
        ra, rb = ref_opt.state[a], opt.state[b]
        assert set(ra) == set(rb) == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(ra[k], rb[k]) for k in ra)
        assert memory.is_host(rb["exp_avg"]) and memory.is_host(rb["exp_avg_sq"])
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]


def test_host_adamw_state_dict_round_trip_continues_identically():
    kw = {"lr": 1e-2, "weight_decay": 0.1}
    straight, _, _ = _adamw_runs(lambda g: memory.HostOffloadAdamW(g, **kw), steps=5)
    params, opt, sched = _adamw_runs(lambda g: memory.HostOffloadAdamW(g, **kw), steps=3)
    sd, sched_sd = opt.state_dict(), sched.state_dict()
    # a fresh optimizer on other values of the parameters, loaded: the parameters are loaded too
    fresh = [torch.nn.Parameter(p.detach() * 0 + 7) for p in params]
    opt2 = memory.HostOffloadAdamW(
        [{"params": fresh[::2], "weight_decay": 0.1}, {"params": fresh[1:2]}], **kw
    )
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda step: 0.5**step)
    opt2.load_state_dict(sd)  # optimizer first, then the model, as DCP's set_state_dict does
    sched2.load_state_dict(sched_sd)
    with torch.no_grad():
        for f, p in zip(fresh, params):
            f.copy_(p)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # replay the grads of steps 0-2, then use those of steps 3-4
        for p in fresh:
            torch.randn(p.shape, generator=g)
    for _ in range(2):
        for p in fresh:
            p.grad = torch.randn(p.shape, generator=g)
        opt2.step()
        sched2.step()
    assert all(torch.equal(a, b) for a, b in zip(straight, fresh))


def test_host_adamw_rejects_bad_hyperparameters():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="learning rate -1"):
        memory.HostOffloadAdamW(p, lr=-1)
    with pytest.raises(ValueError, match="beta parameter at index 1: 1.0"):
        memory.HostOffloadAdamW(p, betas=(0.9, 1.0))


def test_host_adamw_under_fsdp2_equals_adamw_and_resumes_through_dcp(tmp_path):
    results = run_local_world(w.host_optimizer, 2, str(tmp_path), timeout_s=170)
    for r in results:
        assert r[True]["losses"] == r[False]["losses"]
        for k, v in r[False]["params"].items():
            assert torch.equal(v, r[True]["params"][k]), k
        assert r["states_on_host"] and r["state_dict_is_dtensor"]
        res = r["resume"]
        assert res["straight"] == res["resumed"] and res["params_equal"]
        assert res["lr"][0] == res["lr"][1]


def test_fsdp_offload_policy_runs_on_a_cpu_gloo_mesh():
    """FSDP2's CPUOffloadPolicy works on CPU (torch 2.13): same losses and weights as without."""
    results = run_local_world(w.offload_params, 2, timeout_s=150)
    for r in results:
        assert r[True]["loss"] == r[False]["loss"]
        for k, v in r[False]["params"].items():
            assert torch.equal(v, r[True]["params"][k]), k
        assert r["pin_memory"] is False
    assert memory.fsdp_offload_policy("cuda").pin_memory is True


# ----------------------------------------------------------------------------------------------
# CUDA: side stream, pinned memory, prefetch
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_offloaded_checkpoints_prefetch_and_are_bit_identical():
    grads = {}
    for mode in ("off", "on"):
        torch.manual_seed(0)
        model = build_model("tiny", device="cuda").to(torch.bfloat16)
        offloader = memory.ActivationOffloader() if mode == "on" else False
        for block in model.layers:
            checkpoint_module(block, offload=offloader)
        torch.manual_seed(1)
        ids = torch.randint(0, 272, (2, 256), device="cuda")
        pos = torch.arange(256, device="cuda").expand(2, 256)
        model(ids, pos).float().square().mean().backward()
        torch.cuda.synchronize()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert all(torch.equal(grads["off"][k], grads["on"][k]) for k in grads["off"])
    n = len(model.layers)
    assert offloader.stats.offloaded_tensors == offloader.stats.restored_tensors == n
    assert offloader.stats.prefetched_tensors == n - 1  # every block but the last-run one


@pytest.mark.gpu
def test_cuda_host_adamw_matches_adamw_and_keeps_pinned_states():
    torch.manual_seed(0)
    shapes = [(64, 32), (32,)]
    ref = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
    got = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    kw = {"lr": 1e-2, "weight_decay": 0.1}
    opt_ref, opt = torch.optim.AdamW(ref, **kw), memory.HostOffloadAdamW(got, **kw)
    for _ in range(3):
        for a, b in zip(ref, got):
            a.grad = torch.randn(a.shape, device="cuda")
            b.grad = a.grad.clone()
        opt_ref.step()
        opt.step()
    torch.cuda.synchronize()
    for a, b in zip(ref, got):
        assert b.device.type == "cuda"
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # CUDA vs CPU kernels
        assert opt.state[b]["exp_avg"].is_pinned() and opt.state[b]["exp_avg"].device.type == "cpu"
