"""``hf.with_ulysses`` on TRL's ``DistillationTrainer`` equals the stock trainer at the same data
parallelism.

A tiny local Llama student, the RL tests' BPE tokenizer and prompts of unequal lengths, greedy
decoding with many stop tokens (completions of unequal lengths, and steps 2 and 3 generate with
the updated student, so the updates are checked too), SGD. Three cases, one per divergence:
forward KL (``beta`` 0) from a larger Qwen3 teacher given as a path, with gradient
accumulation; the JSD (``beta`` 0.5, ``temperature`` 0.7) from the larger teacher given as a
model, into a LoRA student, with evaluation at step 2 and TRL's ``LogCompletionsCallback``
(sampled completions from the gathered student); reverse KL (``beta`` 1) from a Llama teacher
of the student's size. The stock trainer at dp = 1 runs in this process, at dp = 2 on 2 spawned
gloo ranks; Ulysses runs at (dp, sp) = (1, 2) in that 2-rank world, and at (2, 2) and (1, 4) in
one 4-rank world, where rows shorter than sp (one-token prompts, completions of at most two
tokens: padded so that no rank holds an empty slice) are trained too. A fourth case, over 2
steps at all three layouts, calls a tool: the RL tests' agent (tests/hf/rl_agents.py: a
chat-template tokenizer, a student scripted to call the counting ``add`` tool twice per
rollout) with a teacher of its size. Compared at rtol 1e-4: every logged metric (loss, entropy,
completion lengths and clipped ratio, tool-call and failure frequencies, grad norm, tokens),
every round's completions and tool masks (exactly) and the full gradients of four parameters
(two LoRA matrices) at every step; each tool call runs once per rollout per dp group; the
teacher is sharded, frozen and outside the optimizer; the collectives on the sp group are
counted.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("datasets")

from dtensor_ulysses.launch import run_local_world  # noqa: E402
from tests import hf_workers as W  # noqa: E402
from tests.hf import distill_workers as D  # noqa: E402
from tests.hf import rl_agents as A  # noqa: E402
from tests.hf import rl_workers as R  # noqa: E402
from tests.hf import trainer_workers as T  # noqa: E402

RTOL, ATOL = 1e-4, 1e-6
STEPS = 3
CASES = {
    "forward_kl": dict(beta=0.0, teacher="large", accumulation=2),
    "jsd": dict(
        beta=0.5, temperature=0.7, teacher="large", teacher_as_model=True, lora=True, eval=True
    ),  # fmt: skip
    "reverse_kl": dict(beta=1.0, teacher="same"),
}
# tool calling (TRL's tool loop, inside the shared rollouts): the RL tests' agent, a student
# scripted to call the counting `add` tool twice per rollout, 2 steps; at (1, 2), (2, 2), (1, 4)
TOOL = dict(beta=0.5, tools=3, max_completion_length=96, steps=2)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_distill")
    W.make_tokenizer(root / "tok", " ".join(T.TEXTS) * 5)
    vocab = len(A.make_tokenizer(root / "agent_tok"))
    return {
        "agent": A.save_model(root / "agent", vocab),
        "agent_teacher": A.save_model(root / "agent_teacher", vocab, seed=1),
        "agent_tok": str(root / "agent_tok"),
        "root": root,
        "model": str(W.save_model("llama", root / "llama")),
        "large": D.save_teacher(root / "teacher_qwen3"),
        "same": str(W.save_model("llama", root / "teacher_llama", seed=1)),
        "tok": str(root / "tok"),
    }


def _spec(assets, case: str, name: str, per_device: int = 4, **kw) -> dict:
    spec = dict(model=assets["model"], tok=assets["tok"], out=str(assets["root"] / name),
                per_device=per_device, steps=STEPS)  # fmt: skip
    if case == "tool":
        spec.update(TOOL, model=assets["agent"], tok=assets["agent_tok"],
                    teacher=assets["agent_teacher"], count=spec["out"] + ".count")  # fmt: skip
    elif case == "short":  # rows shorter than sp = 4
        spec.update(beta=0.5, teacher=assets["large"], prompts=D.SHORT_PROMPTS,
                    max_completion_length=2)  # fmt: skip
    else:
        case_kw = dict(CASES[case])
        spec.update(case_kw, teacher=assets[case_kw["teacher"]])
    return {**spec, **kw}


@pytest.fixture(scope="module")
def refs(assets):
    """The stock trainer at dp = 1, in this process."""
    torch.set_num_threads(1)
    return {case: D.run(_spec(assets, case, f"ref1_{case}")) for case in (*CASES, "short", "tool")}


@pytest.fixture(scope="module")
def world2(assets):
    """One 2-rank world: the stock trainer at dp = 2, then Ulysses at (dp, sp) = (1, 2)."""
    cases = (*CASES, "tool")
    specs = [_spec(assets, c, f"ref2_{c}", per_device=2) for c in cases]
    specs += [_spec(assets, c, f"u12_{c}", sp=2) for c in cases]
    specs += [_spec(assets, "jsd", "comm", sp=2, comm=True),
              _spec(assets, "tool", "refused", sp=2, capacity="1000", refused=True)]  # fmt: skip
    res = run_local_world(D.run_specs, 2, specs, timeout_s=400)[0]
    n = len(cases)
    return {
        "stock_dp2": dict(zip(cases, res[:n])),
        "u12": dict(zip(cases, res[n : 2 * n])),
        "comm": res[-2],
        "refused": res[-1],
    }


@pytest.fixture(scope="module")
def world4(assets):
    """One 4-rank world: Ulysses at (2, 2), then at (1, 4) (also the rows shorter than sp)."""
    at22 = (*CASES, "tool")
    specs = [_spec(assets, c, f"u22_{c}", per_device=2, sp=2) for c in at22]
    at14 = (*CASES, "short", "tool")
    specs += [_spec(assets, c, f"u14_{c}", sp=4) for c in at14]
    res = run_local_world(D.run_specs, 4, specs, timeout_s=400)[0]
    n = len(at22)
    return {"u22": dict(zip(at22, res[:n])), "u14": dict(zip(at14, res[n:]))}


def _close(got: dict, ref: dict, steps: int = STEPS) -> None:
    tools = D.TOOL_LOGGED if ref["tools/call_frequency"][0] is not None else ()
    for k in D.LOGGED + tools:
        assert len(got[k]) == len(ref[k]) == steps, (k, got[k], ref[k])
        for a, b in zip(got[k], ref[k]):
            assert b is not None, (k, ref[k])
            assert a == pytest.approx(b, rel=RTOL, abs=ATOL), (k, got[k], ref[k])
    assert got["tokens_seen"] == ref["tokens_seen"]
    assert got["rounds"] == ref["rounds"]  # every round's completions and tool masks, exactly
    # TRL's LogCompletionsCallback (the evaluation case): its sampled completions, exactly
    assert got["logged_completions"] == ref["logged_completions"]
    R.assert_grads_close(got["grads"], ref["grads"], steps, RTOL)
    assert len(got["eval"]) == len(ref["eval"])
    for g, r in zip(got["eval"], ref["eval"]):
        assert g.keys() == r.keys() == set(D.EVAL_LOGGED), (g, r)
        for k in r:
            assert g[k] == pytest.approx(r[k], rel=RTOL, abs=ATOL), (k, g, r)
    teacher = got["teacher"]
    assert teacher["sharded"] and teacher["frozen"] and not teacher["optimized"], teacher


@pytest.mark.parametrize("case", list(CASES))
def test_sp2_equals_stock_dp1(case, refs, world2):
    _close(world2["u12"][case], refs[case])


@pytest.mark.parametrize("case", list(CASES))
def test_dp2_sp2_equals_stock_dp2(case, world2, world4):
    _close(world4["u22"][case], world2["stock_dp2"][case])


@pytest.mark.parametrize("case", [*CASES, "short"])
def test_sp4_equals_stock_dp1(case, refs, world4):
    _close(world4["u14"][case], refs[case])


def test_tools_sp2_equals_stock_dp1(refs, world2):
    _close(world2["u12"]["tool"], refs["tool"], steps=TOOL["steps"])


def test_tools_dp2_sp2_equals_stock_dp2(world2, world4):
    _close(world4["u22"]["tool"], world2["stock_dp2"]["tool"], steps=TOOL["steps"])


def test_tools_sp4_equals_stock_dp1(refs, world4):
    _close(world4["u14"]["tool"], refs["tool"], steps=TOOL["steps"])


def test_tools_called_once_per_rollout_per_dp_group(assets, refs, world2, world4):
    """The student calls the tool ``A.CALLS`` times per rollout, the results are masked out of
    the loss (TRL's tool mask), and each call runs once per dp group: on the sp rank that owns
    the rollout, each rank its share of the group's rollouts."""
    ref = refs["tool"]
    assert ref["tools/call_frequency"] == [A.CALLS] * TOOL["steps"], ref
    for rnd in ref["rounds"]:
        assert all(m.count(0) > 0 and m[0] == 1 for m in rnd["tool_mask"]), rnd

    def calls(name: str) -> dict[int, int]:
        counts = A.agent_counts(str(assets["root"] / f"{name}.count"))
        return {rank: sum(what == "tool" for what, _ in lines) for rank, lines in counts.items()}

    rollouts = TOOL["steps"] * 4  # 4 prompts per step and dp group (per_device 4, or 2 x dp 2)
    assert calls("ref1_tool") == {0: rollouts * A.CALLS}
    assert calls("u12_tool") == {0: rollouts * A.CALLS // 2, 1: rollouts * A.CALLS // 2}
    stock2 = calls("ref2_tool")
    assert stock2 == {0: rollouts * A.CALLS // 2, 1: rollouts * A.CALLS // 2}, stock2
    for name in ("u22_tool", "u14_tool"):  # (2, 2): dp rank 0 on ranks 0, 1; 1 on 2, 3
        got = calls(name)
        assert got == dict.fromkeys(range(4), rollouts * A.CALLS // 4), (name, got)


def test_the_cases_differ(refs, world2):
    """Each case trains on what it claims: the three divergences give different losses; the
    larger teacher is a Qwen3, the other a Llama; the rows of the short case are shorter than
    sp = 4; completions differ in length within a step, and between the steps (the updated
    student generates)."""
    losses = {c: refs[c]["loss"][0] for c in CASES}
    assert len({round(v, 6) for v in losses.values()}) == 3, losses
    u12 = world2["u12"]
    assert u12["forward_kl"]["teacher"]["class"] == "Qwen3Config"
    assert u12["reverse_kl"]["teacher"]["class"] == "LlamaConfig"
    assert max(refs["short"]["completions/max_length"]) <= 2
    logged = refs["jsd"]["logged_completions"]  # LogCompletionsCallback at the step-2 eval
    assert len(logged) == 3 and {row[0] for row in logged} == {"2"}, logged
    assert all(row[2] for row in logged), logged
    for c in CASES:
        ref = refs[c]
        assert any(a < b for a, b in zip(ref["completions/min_length"],
                                         ref["completions/max_length"])), ref  # fmt: skip
        assert len(set(ref["completions/mean_length"])) > 1, ref


def test_collectives_on_the_sp_group(world2):
    """Per rollout round (after the first): on the sp group, the exchange of each rank's share
    of the completions (one ``all_gather_object``: two all-gathers) and nothing else (no
    all-to-all: generation runs the model's own attention on whole prompts); per loss: the
    attention's all-to-alls and one all-reduce of three float64 sums (divergence, entropy,
    token count), none in backward."""
    c = world2["comm"]
    # (at dp = 1 the sp group is the world's, as FSDP2's group is: the round's one all-gather
    # of each FSDP2 unit, the weights gathered once, runs on it too; none per decoding step)
    n = 2 + c["fsdp_units"]
    assert c["rollout_sp"] == [n, n] and "all_to_all" not in c["rollout_sp_kinds"], c
    assert c["loss_all_reduce"] == [1, 3 * 8], c
    assert c["loss_sp_kinds"] == ["all_reduce", "all_to_all"], c
    assert c["backward_all_reduce"] == 0, c


def test_tools_need_the_weights_gathered_once(world2):
    """Tool calling makes multi-turn rollouts (each sp rank its own number of generation
    calls): with a memory capacity too small to gather the weights once per round, the trainer
    is refused at construction, with the numbers."""
    refused = world2["refused"]["error"]
    assert "multi-turn rollouts" in refused and "per rank" in refused, refused


def test_refusals(assets, tmp_path):
    import transformers as tf
    import trl
    from datasets import Dataset

    from dtensor_ulysses.hf import UnsupportedTrainerError, with_ulysses

    tok = tf.AutoTokenizer.from_pretrained(assets["tok"])
    data = Dataset.from_list([{"prompt": p} for p in D.SHORT_PROMPTS])
    args = trl.DistillationConfig(str(tmp_path), use_cpu=True, report_to=[],
                                  per_device_train_batch_size=2)  # fmt: skip
    cls = with_ulysses(trl.DistillationTrainer, sp=2)
    with pytest.raises(UnsupportedTrainerError, match="teacher_model=None"):
        cls(model=assets["model"], teacher_model=None, args=args, train_dataset=data,
            processing_class=tok)  # fmt: skip

    class OwnLoss(trl.DistillationTrainer):
        def _compute_loss(self, *args, **kwargs):
            return super()._compute_loss(*args, **kwargs)

    own = with_ulysses(OwnLoss, sp=2)
    with pytest.raises(UnsupportedTrainerError, match="OwnLoss._compute_loss"):
        own(model=assets["model"], teacher_model=assets["same"], args=args, train_dataset=data,
            processing_class=tok)  # fmt: skip
    vllm = trl.DistillationConfig(str(tmp_path), use_cpu=True, report_to=[], use_vllm=True)
    with pytest.raises(UnsupportedTrainerError, match="use_vllm=True"):
        cls(model=assets["model"], teacher_model=assets["same"], args=vllm, train_dataset=data,
            processing_class=tok)  # fmt: skip
