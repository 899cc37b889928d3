"""``hf.with_ulysses`` on TRL's ``GRPOTrainer`` and ``RLOOTrainer`` equals the stock trainer at the
same data parallelism.

A tiny local Llama, a BPE tokenizer trained on the spot, prompts of unequal lengths, two rule
rewards (one counts its calls; RLOO also a reward model), 3 SGD steps (Adam's first steps turn
round-off in near-zero gradients into full-size updates) with transformers generation (the
reward of steps 2 and 3 depends on what the updated policy generates, so the updates are
checked too). The
stock trainer at dp = 1 runs in this process, at dp = 2 on 2 spawned gloo ranks; Ulysses runs at
(dp, sp) = (1, 2) in that same 2-rank world, and at (2, 2) and (1, 4) in one 4-rank world.
Compared at rtol 1e-4: every logged metric (loss, reward and each reward function's column,
KL, entropy, clip ratios, completion lengths, grad norm, tokens), the advantages' statistics,
and the full gradients of four parameters at every step. Many stop tokens make completions of
unequal lengths, so the dp groups of the 4-rank world finish generating at different steps
(FSDP2 all-gathers in every decoding step: no hang, under the world's timeout).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("datasets")

from dtensor_ulysses.launch import run_local_world  # noqa: E402
from tests import hf_workers as W  # noqa: E402
from tests.hf import rl_workers as R  # noqa: E402
from tests.hf import trainer_workers as T  # noqa: E402

RTOL, ATOL = 1e-4, 1e-6
# GRPO with two loss types (one with the KL to a reference model and an entropy bonus), RLOO
# with its KL reward
CASES = {
    "grpo": dict(kind="grpo", loss_type="grpo", beta=0.0),
    "dapo_kl": dict(kind="grpo", loss_type="dapo", beta=0.1, entropy_coef=0.05),
    "rloo": dict(kind="rloo", beta=0.05, reward_model=True),
}
# at (1, 2) only: the options that reduce over sequences or over the batch's tokens, gradient
# accumulation (2 steps per generation), a LoRA adapter (the reference: the adapter disabled),
# and evaluation (its own rollouts) at step 2.
# (Not the top-entropy mask: a step function of each token's entropy, whose ties at the quantile,
# e.g. the first tokens of one prompt's completions, split differently when their entropies
# differ in the last bit, as the sliced forward's round-off makes them; see docs/how-to.)
FEATURES = dict(kind="grpo", loss_type="bnpo", beta=0.1, lora=True, num_iterations=2,
                importance_sampling_level="sequence", mask_truncated_completions=True,
                eval=True, accumulation=2)  # fmt: skip


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_rl")
    model = str(W.save_model("llama", root / "llama"))
    W.make_tokenizer(root / "tok", " ".join(T.TEXTS) * 5)
    rm = R.save_reward_model(root / "reward_model", str(root / "tok"))
    return {"root": root, "model": model, "tok": str(root / "tok"), "reward_model": rm}


def _spec(assets, case: str, name: str, per_device: int = 4, **kw) -> dict:
    out = str(assets["root"] / name)
    spec = dict(model=assets["model"], tok=assets["tok"], out=out, per_device=per_device)
    case_kw = dict(FEATURES if case == "features" else CASES[case])
    if case_kw.get("reward_model"):
        case_kw["reward_model"] = assets["reward_model"]
    return {**spec, **case_kw, "count": out + ".count", **kw}


@pytest.fixture(scope="module")
def refs(assets):
    """The stock trainers at dp = 1, in this process."""
    torch.set_num_threads(1)
    return {case: R.run(_spec(assets, case, f"ref1_{case}")) for case in (*CASES, "features")}


@pytest.fixture(scope="module")
def world2(assets):
    """One 2-rank world: the stock trainers at dp = 2, then Ulysses at (dp, sp) = (1, 2)."""
    specs = [_spec(assets, c, f"ref2_{c}", per_device=2) for c in CASES]
    specs += [_spec(assets, c, f"u12_{c}", sp=2) for c in (*CASES, "features")]
    specs += [_spec(assets, "grpo", "comm", sp=2, comm=True)]
    res = run_local_world(R.run_specs, 2, specs, timeout_s=400)[0]
    n = len(CASES)
    return {
        "stock_dp2": dict(zip(CASES, res[:n])),
        "u12": dict(zip((*CASES, "features"), res[n : 2 * n + 1])),
        "comm": res[-1],
    }


@pytest.fixture(scope="module")
def world4(assets):
    """One 4-rank world: Ulysses at (2, 2), then at (1, 4)."""
    specs = [_spec(assets, c, f"u22_{c}", per_device=2, sp=2) for c in CASES]
    specs += [_spec(assets, c, f"u14_{c}", sp=4) for c in CASES]
    res = run_local_world(R.run_specs, 4, specs, timeout_s=400)[0]
    n = len(CASES)
    return {"u22": dict(zip(CASES, res[:n])), "u14": dict(zip(CASES, res[n:]))}


def _close(got: dict, ref: dict) -> None:
    for k in R.LOGGED + ("advantages",):
        assert len(got[k]) == len(ref[k]) == 3, (k, got[k], ref[k])
        for a, b in zip(got[k], ref[k]):
            if b is None:
                assert a is None, (k, got[k], ref[k])
            else:
                assert a == pytest.approx(b, rel=RTOL, abs=ATOL), (k, got[k], ref[k])
    assert any(x is not None for x in ref["kl"]) == (got["kl"][0] is not None)
    assert len(got["grads"]) == len(ref["grads"]) == 3
    for step, (g, r) in enumerate(zip(got["grads"], ref["grads"])):
        assert g.keys() == r.keys()
        for name in r:
            x, y = torch.tensor(g[name]), torch.tensor(r[name])
            tol = RTOL * y.abs().max().item() + 1e-7
            assert (x - y).abs().max().item() <= tol, (step, name)
    assert len(got["eval"]) == len(ref["eval"])
    for g, r in zip(got["eval"], ref["eval"]):
        assert g.keys() == r.keys()
        for k in r:
            assert g[k] == pytest.approx(r[k], rel=RTOL, abs=ATOL), (k, g, r)


@pytest.mark.parametrize("case", [*CASES, "features"])
def test_sp2_equals_stock_dp1(case, refs, world2):
    _close(world2["u12"][case], refs[case])


@pytest.mark.parametrize("case", list(CASES))
def test_dp2_sp2_equals_stock_dp2(case, world2, world4):
    _close(world4["u22"][case], world2["stock_dp2"][case])


@pytest.mark.parametrize("case", list(CASES))
def test_sp4_equals_stock_dp1(case, refs, world4):
    _close(world4["u14"][case], refs[case])


def test_rewards_once_per_completion_per_dp_group(assets, world2, world4):
    """The counting reward runs on sp rank 0 of each dp group only, once per step, on that
    group's completions: as often as on the stock ranks."""
    for case in CASES:
        stock1 = R.counts(str(assets["root"] / f"ref1_{case}.count"))
        stock2 = R.counts(str(assets["root"] / f"ref2_{case}.count"))
        assert R.counts(str(assets["root"] / f"u12_{case}.count")) == stock1
        assert R.counts(str(assets["root"] / f"u14_{case}.count")) == stock1
        u22 = R.counts(str(assets["root"] / f"u22_{case}.count"))
        assert sorted(u22) == [0, 2]  # sp rank 0 of dp 0 and dp 1
        assert [u22[0], u22[2]] == [stock2[0], stock2[1]]


def test_collectives_on_the_sp_group(world2):
    """Per rollout: one object broadcast of sp rank 0's completions (its size, then its bytes)
    and one of the rewards, nothing else on the sp group; per log-prob pass: one all-reduce of
    the ``[B, S]`` float32 rows per quantity (log-probabilities, entropies)."""
    c = world2["comm"]
    B, S = c["rows"]
    assert c["score_broadcasts"] == 3, c
    assert c["logps_all_reduce"] == [2, 2 * B * S * 4], c


def test_unequal_generation_lengths_across_dp_groups(assets, world4):
    """The two dp groups of the 4-rank world generated completions of different longest
    lengths in some step (so one group stopped decoding first) and the world finished."""
    longest = {
        rank: [m for _, m in calls]
        for case in CASES
        for rank, calls in R.counts(str(assets["root"] / f"u22_{case}.count")).items()
    }
    assert longest[0] != longest[2], longest


def test_refusals(assets, tmp_path):
    import transformers as tf
    import trl
    from datasets import Dataset

    from dtensor_ulysses.hf import UnsupportedTrainerError, with_ulysses

    tok = tf.AutoTokenizer.from_pretrained(assets["tok"])
    data = Dataset.from_list([{"prompt": p} for p in R.PROMPTS])
    cases = {
        "use_vllm=True": dict(use_vllm=True),
        "use_adaptive_entropy=True": dict(use_adaptive_entropy=True),
        "sync_ref_model=True": dict(sync_ref_model=True, beta=0.1),
    }
    for match, kw in cases.items():
        args = trl.GRPOConfig(str(tmp_path), use_cpu=True, report_to=[], num_generations=4,
                              per_device_train_batch_size=4, **kw)  # fmt: skip
        with pytest.raises(UnsupportedTrainerError, match=match.split("=")[0]):
            with_ulysses(trl.GRPOTrainer, sp=2)(
                model=assets["model"], reward_funcs=R.reward_the, args=args,
                train_dataset=data, processing_class=tok,
            )  # fmt: skip
    # the generation batch over dp (here 1 process: world 1, sp 1) must hold whole groups
    args = trl.GRPOConfig(str(tmp_path), use_cpu=True, report_to=[], num_generations=4,
                          per_device_train_batch_size=2, steps_per_generation=2)  # fmt: skip
    args.steps_per_generation = 1  # as a config resolved over 2 processes would have it
    with pytest.raises(ValueError, match=r"2 x 1 x 1 = 2 rows does not hold whole groups"):
        with_ulysses(trl.GRPOTrainer, sp=1)(
            model=assets["model"], reward_funcs=R.reward_the, args=args, train_dataset=data,
            processing_class=tok,
        )  # fmt: skip
    args = trl.GRPOConfig(str(tmp_path), use_cpu=True, report_to=[], num_generations=4,
                          per_device_train_batch_size=4)  # fmt: skip
    with pytest.raises(UnsupportedTrainerError, match="tools: tool calling"):
        with_ulysses(trl.GRPOTrainer, sp=2)(
            model=assets["model"], reward_funcs=R.reward_the, args=args, train_dataset=data,
            processing_class=tok, tools=[len],
        )  # fmt: skip
