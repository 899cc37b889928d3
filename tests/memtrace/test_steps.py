"""The DPO, GRPO and distillation steps the tracer runs (``memtrace/steps.py``) are the losses
they claim.

One process, the tiny built-in model in float64 (no parallelism: ``sp_group=None``), the head
tiled in chunks of 7 rows: each step's loss and its update (SGD with lr 1, no clipping: the new
weights are the old ones minus the gradient) against an independent computation from full
``[B, S, V]`` logits in float64 (``log_softmax`` gathered at the labels; for distillation the
student's and the teacher's full distributions and the divergence written out) and autograd.
The library's log-probability primitive and TRL's chunked divergence compute their logits in
float32 (as on a GPU), hence the float32 tolerances.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from dtensor_ulysses.data import full_batch
from dtensor_ulysses.data.batch import IGNORE_INDEX
from dtensor_ulysses.memtrace.steps import (
    StepSpec,
    distill_step,
    dpo_step,
    grpo_step,
    sequence_logps,
)
from dtensor_ulysses.models import build_model, set_tiling

S = 24


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    policy = build_model("tiny", device="cpu").double()
    set_tiling(policy, loss_chunk_tokens=7)  # chunks that straddle the rows
    reference = copy.deepcopy(policy)
    with torch.no_grad():  # a reference that differs from the policy
        for p in reference.parameters():
            p.add_(0.01 * torch.randn_like(p))
    reference.requires_grad_(False)
    return policy, reference


def _batch(rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 200, (rows, S), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[:, :5] = IGNORE_INDEX  # a prompt
    labels[:, -1] = IGNORE_INDEX
    labels[0, -4:] = IGNORE_INDEX  # rows of different lengths
    return full_batch(ids, labels)


def _full_logps(model, batch) -> torch.Tensor:
    """Per-token log-probabilities from full logits, ``[B, S]``, 0 where ignored."""
    logits = model(batch.input_ids, batch.position_ids)
    valid = batch.labels != IGNORE_INDEX
    lp = torch.log_softmax(logits.double(), -1)
    picked = lp.gather(-1, batch.labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked * valid


def _sgd_step(policy, loss_fn):
    """The expected update and loss: ``w - grad`` and the loss's value."""
    ref = copy.deepcopy(policy)
    loss = loss_fn(ref)
    loss.backward()
    return {n: (p - p.grad).detach() for n, p in ref.named_parameters()}, loss.item()


def _optim(model):
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


def _assert_updated(model, expect):
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, expect[n], rtol=1e-5, atol=1e-6, msg=n)


def test_sequence_logps_equal_full_logits(models):
    from dtensor_ulysses.plan import get_shape

    tied = build_model(get_shape("tiny").with_(tie_embeddings=True), device="cpu").double()
    set_tiling(tied, loss_chunk_tokens=5)  # the head_fn path through the embedding weight
    b = _batch(2, 1)
    for model in (models[0], tied):
        got = sequence_logps(model, b)
        want = _full_logps(model, b).sum(1)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)


def test_dpo_step_is_trl_sigmoid_loss(models):
    policy, reference = models
    policy = copy.deepcopy(policy)
    b, beta, dp = _batch(4, 2), 0.1, 2  # two pairs, this rank's share of dp=2

    def loss_fn(m):
        pol = _full_logps(m, b).sum(1).view(-1, 2)
        with torch.no_grad():
            ref = _full_logps(reference, b).sum(1).view(-1, 2)
        chosen, rejected = pol[:, 0] - ref[:, 0], pol[:, 1] - ref[:, 1]
        return -F.logsigmoid(beta * (chosen - rejected)).mean() / dp

    expect, loss = _sgd_step(policy, loss_fn)
    opt, sched = _optim(policy)
    out = dpo_step(policy, reference, b, opt, sched, beta=beta, dp=dp, grad_clip=0)
    assert out.loss == pytest.approx(loss, rel=1e-5)
    _assert_updated(policy, expect)
    with pytest.raises(ValueError, match="pairs"):
        dpo_step(policy, reference, _batch(3, 2), opt, sched)


@pytest.mark.parametrize("beta,old_shift", [(0.0, None), (0.04, 0.05)])
def test_grpo_step_is_trl_dapo_loss(models, beta, old_shift):
    policy, reference = models
    policy = copy.deepcopy(policy)
    b, eps = _batch(4, 3), 0.2
    adv = torch.tensor([1.0, -0.5, 0.25, -2.0], dtype=torch.float64)
    valid = b.labels != IGNORE_INDEX
    with torch.no_grad():
        ref_lp = _full_logps(reference, b)
    # num_iterations > 1: the old policy is the policy before this step: a policy whose weights
    # moved since (old_shift) makes the ratios differ from 1, so clipping is exercised
    old_model = copy.deepcopy(policy)
    if old_shift is not None:
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(old_shift * torch.randn_like(p))
        old_model_lp = _full_logps(old_model, b).detach()

    def loss_fn(m):
        lp = _full_logps(m, b)
        old = lp.detach() if old_shift is None else old_model_lp
        ratio = torch.exp(lp - old)
        per = -torch.min(ratio * adv[:, None], ratio.clamp(1 - eps, 1 + eps) * adv[:, None])
        if beta:
            d = ref_lp - lp
            per = per + beta * (torch.exp(d) - d - 1)
        return (per * valid).sum() / valid.sum()

    expect, loss = _sgd_step(policy, loss_fn)
    opt, sched = _optim(policy)
    old = None if old_shift is None else old_model_lp
    out = grpo_step(policy, None if beta == 0 else reference, b, adv, opt, sched, beta=beta,
                    epsilon=eps, num_iterations=1 if old is None else 2, old_logps_Bs=old,
                    grad_clip=0)  # fmt: skip
    assert out.loss == pytest.approx(loss, rel=1e-5)
    _assert_updated(policy, expect)


@pytest.mark.parametrize("beta,temperature", [(0.0, 1.0), (0.5, 0.7), (1.0, 1.0)])
def test_distill_step_is_trl_generalized_jsd(models, beta, temperature):
    pytest.importorskip("trl")
    policy, teacher = models
    policy = copy.deepcopy(policy)
    b = _batch(2, 4)
    valid = b.labels != IGNORE_INDEX
    with torch.no_grad():
        t_logp = torch.log_softmax(teacher(b.input_ids, b.position_ids).double() / temperature, -1)

    def loss_fn(m):  # TRL's mixture (1 - beta) p_student + beta p_teacher, per scored position
        s_logp = torch.log_softmax(m(b.input_ids, b.position_ids).double() / temperature, -1)
        kl_t = (t_logp.exp() * (t_logp - s_logp)).sum(-1)  # KL(teacher || student)
        kl_s = (s_logp.exp() * (s_logp - t_logp)).sum(-1)  # KL(student || teacher)
        if beta == 0.0:
            per = kl_t
        elif beta == 1.0:
            per = kl_s
        else:
            log_m = torch.logaddexp(s_logp + torch.log(torch.tensor(1 - beta)),
                                    t_logp + torch.log(torch.tensor(beta)))  # fmt: skip
            per = beta * (t_logp.exp() * (t_logp - log_m)).sum(-1) + (1 - beta) * (
                s_logp.exp() * (s_logp - log_m)
            ).sum(-1)
        return (per * valid).sum() / valid.sum()

    expect, loss = _sgd_step(policy, loss_fn)
    opt, sched = _optim(policy)
    out = distill_step(policy, teacher, b, opt, sched, beta=beta, temperature=temperature,
                       grad_clip=0)  # fmt: skip
    assert out.loss == pytest.approx(loss, rel=1e-5)
    _assert_updated(policy, expect)
    assert not any(p.grad is not None for p in teacher.parameters())


def test_step_spec_checks_and_defaults():
    assert StepSpec("dpo").rows == 2 and StepSpec("dpo").has_reference
    assert StepSpec("dpo").loss_beta == 0.1 and StepSpec("grpo").loss_beta == 0.0
    g = StepSpec("grpo", generations=4)
    assert g.rows == 4 and not g.has_reference and not g.has_old_policy
    assert StepSpec("grpo", beta=0.04, num_iterations=2).has_old_policy
    d = StepSpec("distill")
    assert d.rows == 1 and d.has_reference and d.loss_beta == 1.0 and not d.has_old_policy
    for bad, match in (({"kind": "ppo"}, "ppo"), ({"kind": "grpo", "generations": 0}, "G >= 1"),
                       ({"kind": "grpo", "num_iterations": 0}, "num_iterations"),
                       ({"kind": "dpo", "beta": -1}, "beta"),
                       ({"kind": "distill", "beta": 1.5}, r"in \[0, 1\]")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            StepSpec(**bad)


def test_cli_trace_step_bad_input(capsys):
    from simulations.cli import main

    base = ["trace", "--model", "llama3-8b", "--seq-len", "8192", "--sp", "8"]
    assert main([*base, "--generations", "4"]) == 2  # --step sft
    assert "--generations" in capsys.readouterr().err
    assert main([*base, "--step", "dpo", "--num-iterations", "2"]) == 2
    assert "GRPO's" in capsys.readouterr().err
    assert main([*base, "--step", "grpo", "--generations", "0"]) == 2
    assert "--generations 0" in capsys.readouterr().err
    assert main([*base, "--step", "dpo", "--beta", "-1"]) == 2
    assert "--beta -1" in capsys.readouterr().err
    assert main([*base, "--step", "distill", "--beta", "2"]) == 2
    assert "in [0, 1]" in capsys.readouterr().err
    assert main([*base, "--step", "distill", "--generations", "4"]) == 2
    assert "GRPO's" in capsys.readouterr().err
    assert main(["trace", "--model", "qwen3.5-9b", "--seq-len", "8192", "--step", "dpo"]) == 2
    assert "hybrid" in capsys.readouterr().err


@pytest.mark.parametrize("gathering", ["round", "layer"])
def test_generation_round_holds_the_gathered_weights_and_the_kv_cache(gathering):
    """The ``generate`` phase traced before a GRPO step (tiny with 4 blocks, CPU, sp=2, G=4,
    S=1024): FSDP2's unsharded weights (every unit once per round; or all but two blocks
    sharded), the KV cache of this rank's ``ceil(G / sp) = 2`` rows at ``S`` tokens and one
    decoding step's logits, in closed form; at most one block more while FSDP2 gathers (its
    all-gather buffer beside the copies)."""
    from dtensor_ulysses.memtrace import trace_train_step
    from dtensor_ulysses.models import build_model as build
    from dtensor_ulysses.plan.presets import get_shape

    shape, L = get_shape("tiny"), 4
    model = build("tiny", device="cpu")
    block = sum(p.numel() for p in model.layers[0].parameters())
    outside = sum(p.numel() for p in model.parameters()) - shape.n_layers * block
    held = outside + (L if gathering == "round" else 2) * block
    rows, S = 2, 1024
    kv = 2 * L * rows * S * shape.n_kv_heads * shape.head_dim * 4
    expect = 4 * held + kv + 4 * rows * shape.vocab_size
    t = trace_train_step("tiny", S, sp=2, device="cpu", layers=L,
                         step=StepSpec("grpo", generations=4, generation=gathering))  # fmt: skip
    got = t.to_dict()["phases"]["generate"]["by_category"]["activations_and_buffers"]
    assert 0 <= got - expect <= 4 * block, (got, expect)
    with pytest.raises(ValueError, match="GRPO step only"):
        StepSpec("dpo", generation="round")
