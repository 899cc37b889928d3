"""``hf.with_ulysses`` on TRL's ``GRPOTrainer`` and ``RLOOTrainer`` equals the stock trainer at the
same data parallelism, with rollouts made once per sp group.

Tiny local models (a Llama over a BPE trained on the spot; a Llama over a byte-level BPE with
Qwen2.5's chat template for the agents; Qwen2.5-VL and Qwen3-VL with image prompts), 2 SGD steps
(Adam's first steps turn round-off in near-zero gradients into full-size updates; the second
step's rollouts come from the updated policy, so the updates are checked too). Decoding that
does not depend on how a round's rollouts are split over the sp group: greedy, or a
``rollout_func`` that samples each completion from its own seeded generator (it runs once per
dp group with the stock rank's prompts). The agents' policy is scripted to call a tool twice
per rollout (``rl_agents.Script``: greedy decoding follows the script). The image prompts vary
within a group (``rl_workers.MEMBER_WORDS``: each copy of a prompt in a batch asks with its own
word and sees its image turned its own way), so greedy completions, rewards and advantages
differ within a group and the policy gradient is not zero.

The stock trainer at dp = 1 runs in this process, at dp = 2 on 2 spawned gloo ranks; Ulysses
runs at (dp, sp) = (1, 2) in that 2-rank world, at (2, 2) and (1, 4) in one 4-rank world.
Compared at rtol 1e-4: every logged metric (loss, rewards and each reward's column, KL,
entropy, clip ratios, completion lengths, tool-call frequencies, environment rewards, grad
norm, tokens), every round's completions and tool masks (exactly) and advantages, and the full
gradients of a few parameters at every step (the vision tower's among them).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("datasets")

from dtensor_ulysses.launch import run_local_world  # noqa: E402
from tests import hf_workers as W  # noqa: E402
from tests.hf import rl_agents as A  # noqa: E402
from tests.hf import rl_workers as R  # noqa: E402
from tests.hf import trainer_workers as T  # noqa: E402

RTOL, ATOL = 1e-4, 1e-6
AGENT = dict(agent=True, greedy=True, entropy_coef=0.05, max_completion_length=96,
             max_tool_calling_iterations=3)  # fmt: skip
# image prompts that vary within a group (advantages not zero); a small step: at lr 0.5 the tiny
# models' second-step greedy completions collapse to one
VL = dict(greedy=True, beta=0.05, max_completion_length=4, lr=0.005)
# compared at (1, 2), (2, 2) and (1, 4)
CASES = {
    # a rollout_func sampling each completion from its own generator (advantages not zero)
    "grpo": dict(kind="grpo", loss_type="grpo", beta=0.0, rollout="text"),
    # transformers generation, split over the sp group: greedy; a reference KL, an entropy bonus
    "dapo_kl": dict(kind="grpo", loss_type="dapo", beta=0.1, entropy_coef=0.05, greedy=True),
    "rloo": dict(kind="rloo", beta=0.05, reward_model=True, greedy=True),
    "tool": dict(kind="grpo", tools=True, **AGENT),
    # two environment kinds, their own rewards (in order: one kind per step)
    "env": dict(kind="grpo", env="dict", shuffle_dataset=False, **AGENT),
    "vl": dict(kind="grpo", vl="qwen2_5_vl", entropy_coef=0.05, **VL),
    "vl_rloo": dict(kind="rloo", vl="qwen3_vl", **VL),
}
# at (1, 2) only: the options that reduce over sequences or over the batch's tokens, gradient
# accumulation (2 steps per generation), a LoRA adapter (the reference: the adapter disabled),
# evaluation (its own rollouts) at step 2 and the top-entropy token mask; one environment kind;
# the weights gathered layer by layer (a small memory capacity)
FEATURES = dict(kind="grpo", loss_type="bnpo", beta=0.1, lora=True, num_iterations=2,
                importance_sampling_level="sequence", mask_truncated_completions=True,
                eval=True, accumulation=2, rollout="text", top_entropy_quantile=0.5)  # fmt: skip
AT_12 = {
    "features": FEATURES,
    "env_single": dict(kind="grpo", env="single", **AGENT),
    "layer": dict(CASES["dapo_kl"], capacity="1000", rows=8),  # 2 prompts: unequal shares
}
# at (1, 4) only: prompt + completion rows of 2 tokens, shorter than sp
AT_14 = {"short": dict(kind="grpo", short=True, max_completion_length=1, greedy=True,
                       entropy_coef=0.05, beta=0.1)}  # fmt: skip
# transformers' sampling (temperature 1): the same rollouts at every sp
SAMPLED = dict(kind="grpo", loss_type="grpo", beta=0.0)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from tests.hf import vision_workers as V

    root = tmp_path_factory.mktemp("hf_rl")
    W.save_model("llama", root / "llama")
    W.make_tokenizer(root / "tok", " ".join(T.TEXTS) * 5)
    agent_tok = A.make_tokenizer(root / "agent_tok")
    A.save_model(root / "agent", len(agent_tok))
    for family in ("qwen2_5_vl", "qwen3_vl"):
        V.save_model(family, root / family)
    rm = R.save_reward_model(root / "reward_model", str(root / "tok"))
    return {"root": root, "reward_model": rm}


def _spec(assets, case: str, name: str, per_device: int = 4, **kw) -> dict:
    root = assets["root"]
    out = str(root / name)
    case_kw = dict({**CASES, **AT_12, **AT_14, "sampled": SAMPLED}[case])
    per_device = case_kw.pop("rows", 4) // (4 // per_device)
    if case_kw.pop("agent", False):
        model, tok = root / "agent", root / "agent_tok"
    else:
        model, tok = root / case_kw.get("vl", "llama"), root / "tok"
    if case_kw.get("reward_model"):
        case_kw["reward_model"] = assets["reward_model"]
    spec = dict(model=str(model), tok=str(tok), out=out, per_device=per_device, steps=2)
    return {**spec, **case_kw, "count": out + ".count", **kw}


@pytest.fixture(scope="module")
def refs(assets):
    """The stock trainers at dp = 1, in this process."""
    torch.set_num_threads(1)
    cases = [*CASES, *AT_12, *AT_14]
    return {c: R.run(_spec(assets, c, f"ref1_{c}")) for c in cases}


@pytest.fixture(scope="module")
def world2(assets):
    """One 2-rank world: the stock trainers at dp = 2, then Ulysses at (dp, sp) = (1, 2);
    built-in sampling at (2, 1) and (1, 2); a refusal."""
    specs = [_spec(assets, c, f"ref2_{c}", per_device=2) for c in CASES]
    specs += [_spec(assets, c, f"u12_{c}", sp=2) for c in (*CASES, *AT_12)]
    specs += [_spec(assets, "sampled", "sampled21", per_device=2, sp=1),
              _spec(assets, "sampled", "sampled12", sp=2),
              _spec(assets, "tool", "refused", sp=2, capacity="1000", refused=True)]  # fmt: skip
    res = run_local_world(R.run_specs, 2, specs, timeout_s=900)[0]
    n, m = len(CASES), len(CASES) + len(AT_12)
    return {
        "stock_dp2": dict(zip(CASES, res[:n])),
        "u12": dict(zip((*CASES, *AT_12), res[n : n + m])),
        "sampled21": res[-3], "sampled12": res[-2], "refused": res[-1],
    }  # fmt: skip


@pytest.fixture(scope="module")
def world4(assets):
    """One 4-rank world: Ulysses at (2, 2), then at (1, 4); built-in sampling at both; the
    collectives of a round at (2, 2)."""
    specs = [_spec(assets, c, f"u22_{c}", per_device=2, sp=2) for c in CASES]
    specs += [_spec(assets, c, f"u14_{c}", sp=4) for c in (*CASES, *AT_14)]
    specs += [_spec(assets, "sampled", "sampled22", per_device=2, sp=2),
              _spec(assets, "sampled", "sampled14", sp=4),
              _spec(assets, "sampled", "comm", per_device=2, sp=2, comm=True)]  # fmt: skip
    res = run_local_world(R.run_specs, 4, specs, timeout_s=900)[0]
    n = len(CASES)
    return {
        "u22": dict(zip(CASES, res[:n])),
        "u14": dict(zip((*CASES, *AT_14), res[n : 2 * n + len(AT_14)])),
        "sampled22": res[-3], "sampled14": res[-2], "comm": res[-1],
    }  # fmt: skip


def _close(got: dict, ref: dict) -> None:
    steps = len(ref["loss"])
    for k in R.LOGGED + R.AGENT_LOGGED + ("advantages",):
        assert len(got[k]) == len(ref[k]), (k, got[k], ref[k])
        for a, b in zip(got[k], ref[k]):
            if b is None:
                assert a is None, (k, got[k], ref[k])
            else:
                assert a == pytest.approx(b, rel=RTOL, abs=ATOL), (k, got[k], ref[k])
    assert any(x is not None for x in ref["kl"]) == (got["kl"][0] is not None)
    assert len(got["rounds"]) == len(ref["rounds"]) >= steps
    for g, r in zip(got["rounds"], ref["rounds"]):
        assert g["completion_ids"] == r["completion_ids"]
        assert g["tool_mask"] == r["tool_mask"]
        assert g["advantages"] == pytest.approx(r["advantages"], rel=RTOL, abs=ATOL)
    R.assert_grads_close(got["grads"], ref["grads"], steps, RTOL)
    assert len(got["eval"]) == len(ref["eval"])
    for g, r in zip(got["eval"], ref["eval"]):
        assert g.keys() == r.keys()
        for k in r:
            assert g[k] == pytest.approx(r[k], rel=RTOL, abs=ATOL), (k, g, r)


@pytest.mark.parametrize("case", [*CASES, *AT_12])
def test_sp2_equals_stock_dp1(case, refs, world2):
    _close(world2["u12"][case], refs[case])


@pytest.mark.parametrize("case", list(CASES))
def test_dp2_sp2_equals_stock_dp2(case, world2, world4):
    _close(world4["u22"][case], world2["stock_dp2"][case])


@pytest.mark.parametrize("case", [*CASES, *AT_14])
def test_sp4_equals_stock_dp1(case, refs, world4):
    _close(world4["u14"][case], refs[case])


def test_the_cases_exercise_what_they_claim(refs, world2):
    """Tool calls made and masked, environment rewards logged, advantages that are not zero
    (the sampling rollout_func; the image prompts in every round, at dp = 1 and 2), rows
    shorter than sp=4."""
    tool = refs["tool"]
    assert tool["tools/call_frequency"] == [A.CALLS] * 2
    for rnd in tool["rounds"] + refs["env"]["rounds"]:
        assert all(0 in m and m[0] == 1 for m in rnd["tool_mask"])  # results masked out
    for kind in ("Calculator", "Tally"):  # a step of each kind
        assert any(r is not None for r in refs["env"][f"rewards/{kind}/mean"]), kind
    assert any(abs(a) > 0.1 for rnd in refs["grpo"]["rounds"] for a in rnd["advantages"])
    for case in ("vl", "vl_rloo"):
        for run in (refs[case], world2["stock_dp2"][case]):
            assert all(any(abs(a) > 0.05 for a in rnd["advantages"]) for rnd in run["rounds"])
            assert any(abs(a) > 0.1 for rnd in run["rounds"] for a in rnd["advantages"]), case
    for rnd in refs["short"]["rounds"]:
        assert len(rnd["completion_ids"][0]) == 1  # + a one-token prompt: 2 < sp = 4


def test_rollouts_once_per_dp_group(assets, refs, world2, world4):
    """Every rollout is generated, its tools called and its environment made, reset, stepped
    and scored, and its rewards computed, once per dp group: over the sp ranks of a group the
    counts are the stock rank's. Generation rows are split over the group (each rank decodes
    its share); a rollout_func is called once per dp group (by sp rank 0)."""

    def per_rank(name: str) -> dict[int, dict]:
        out = {}
        for rank, lines in A.agent_counts(str(assets["root"] / f"{name}.count")).items():
            tally: dict = {}
            for what, info in lines:
                key = what if what != "generate" else "rows"
                tally[key] = tally.get(key, 0) + info.get("rows", 1)
            out[rank] = tally
        return out

    def summed(counts: dict[int, dict], ranks: list[int]) -> dict:
        total: dict = {}
        for r in ranks:
            for k, v in counts.get(r, {}).items():
                total[k] = total.get(k, 0) + v
        return total

    def same(got: dict, stock: dict, sp: int) -> None:
        # constructions: as many as on the stock rank, plus TRL's probe of each environment
        # kind (made at construction on every rank) on a rank that owns none of its rollouts
        made = got.pop("make", 0) - stock.get("make", 0)
        assert 0 <= made <= (sp - 1) * (2 if case == "env" else 0), (case, made)
        assert got == {k: v for k, v in stock.items() if k != "make"}, case

    for case in CASES:
        stock1 = per_rank(f"ref1_{case}")[0]
        stock2 = per_rank(f"ref2_{case}")
        same(summed(per_rank(f"u12_{case}"), [0, 1]), stock1, 2)
        u14 = per_rank(f"u14_{case}")
        same(summed(u14, [0, 1, 2, 3]), stock1, 4)
        u22 = per_rank(f"u22_{case}")
        same(summed(u22, [0, 1]), stock2[0], 2)
        same(summed(u22, [2, 3]), stock2[1], 2)
        if case == "grpo":  # the rollout_func: sp rank 0 of each dp group
            assert sorted(u14) == [0] and sorted(u22) == [0, 2]
        else:  # the decoding split: every rank decoded a share
            assert all(u14[r]["rows"] < stock1["rows"] for r in range(4)), (case, u14)
    assert per_rank("ref1_tool")[0]["tool"] == 2 * 4 * A.CALLS  # 2 steps x 4 rollouts
    env = per_rank("ref1_env")[0]
    assert env["reset"] == env["step"] // A.CALLS == env["reward"] == 2 * 4
    # the counting reward: once per completion per dp group, on the rollout's owner
    for case in CASES:
        stock = R.counts(str(assets["root"] / f"ref1_{case}.count"))
        u14 = R.counts(str(assets["root"] / f"u14_{case}.count"))
        scored = sum(c for calls in u14.values() for c, _ in calls)
        assert scored == sum(c for c, _ in stock[0]), case


def test_built_in_sampling_is_the_same_at_every_sp(world2, world4):
    """transformers' sampling (temperature 1) draws each rollout from its own generator: the
    same rollouts, rewards, loss and gradients at sp = 1, 2 (dp = 2) and sp = 2, 4 (dp = 1)."""
    _close(world4["sampled22"], world2["sampled21"])
    _close(world4["sampled14"], world2["sampled12"])
    adv = [a for rnd in world2["sampled12"]["rounds"] for a in rnd["advantages"]]
    assert any(abs(a) > 0.1 for a in adv)  # the rollouts differ within a group


def test_collectives_of_a_round(world4):
    """A round at (2, 2): the weights all-gathered once (one all-gather per FSDP2 unit of its
    padded shard over the 4 ranks, nothing else on that group: nothing per decoding step); on
    the sp group, the rollouts' exchange and the rewards' exchange (each one
    ``all_gather_object``: two all-gathers) and nothing else; besides, only the stock step's
    gathers over dp. A log-prob pass: one all-reduce of the ``[B, S]`` float32 rows per
    quantity on the sp group."""
    c = world4["comm"]
    assert c["round_flat"] == [c["units"], c["unit_bytes"], c["units"]], c
    assert c["round_sp"] == [4, 4], c
    assert c["round_other"] == 0, c
    B, S = c["rows"]
    assert c["logps_all_reduce"] == [2, 2 * B * S * 4], c


def test_layer_by_layer_gathering(assets, world2):
    """A small memory capacity: the weights gathered layer by layer (every rank steps until the
    slowest share ends; the shares here end at different steps) and the run equals stock (see
    test_sp2_equals_stock_dp1[layer]); multi-turn rollouts are refused then (their ranks make
    different numbers of generation calls), with the numbers."""
    calls = R.counts(str(assets["root"] / "u12_layer.count"))
    assert any(a[1] != b[1] for a, b in zip(calls[0], calls[1])), calls
    refused = world2["refused"]["error"]
    assert "multi-turn rollouts" in refused and "per rank" in refused, refused


def test_refusals(assets, tmp_path):
    import transformers as tf
    import trl
    from datasets import Dataset

    from dtensor_ulysses.hf import UnsupportedTrainerError, with_ulysses

    tok = tf.AutoTokenizer.from_pretrained(str(assets["root"] / "tok"))
    data = Dataset.from_list([{"prompt": p} for p in R.PROMPTS])
    model = str(assets["root"] / "llama")
    cases = {
        "use_vllm=True": dict(use_vllm=True),
        "use_adaptive_entropy=True": dict(use_adaptive_entropy=True),
        "sync_ref_model=True": dict(sync_ref_model=True, beta=0.1),
        "use_transformers_continuous_batching=True": dict(use_transformers_paged=True),
    }
    for match, kw in cases.items():
        args = trl.GRPOConfig(str(tmp_path), use_cpu=True, report_to=[], num_generations=4,
                              per_device_train_batch_size=4, **kw)  # fmt: skip
        with pytest.raises(UnsupportedTrainerError, match=match.split("=")[0]) as e:
            with_ulysses(trl.GRPOTrainer, sp=2)(
                model=model, reward_funcs=R.reward_the, args=args, train_dataset=data,
                processing_class=tok,
            )  # fmt: skip
        assert "with_ulysses(GRPOTrainer)" in str(e.value)  # the user's class, not ours
    # the generation batch over dp (here 1 process: world 1, sp 1) must hold whole groups
    args = trl.GRPOConfig(str(tmp_path), use_cpu=True, report_to=[], num_generations=4,
                          per_device_train_batch_size=2, steps_per_generation=2)  # fmt: skip
    args.steps_per_generation = 1  # as a config resolved over 2 processes would have it
    with pytest.raises(ValueError, match=r"2 x 1 x 1 = 2 rows does not hold whole groups"):
        with_ulysses(trl.GRPOTrainer, sp=1)(
            model=model, reward_funcs=R.reward_the, args=args, train_dataset=data,
            processing_class=tok,
        )  # fmt: skip
