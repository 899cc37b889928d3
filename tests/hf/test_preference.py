"""``with_ulysses(trl.DPOTrainer | trl.KTOTrainer)`` equals the stock trainer at the same dp.

Tiny local Llama checkpoint, BPE tokenizer trained on the spot, fp32, 3 steps of a global batch
of 4 rows (DPO: 4 pairs, i.e. 8 sequences), uneven completion lengths (padding, slices of
uneven length). References: the stock trainer in this process (dp = 1) and on 2 spawned gloo
ranks (dp = 2, in the same world as the (1, 2) runs); the (2, 2) and (1, 4) runs share one
4-rank world. Compared: every value of every log entry (loss, grad norm, learning rate,
rewards/*, logps/*, logits/*, entropy, token accuracy, token counts, KTO's kl) at rtol 1e-4,
and every parameter's full gradient at the first step (max abs difference).
Also the primitive on a sharded model: ``hf.token_rows`` / ``hf.sequence_logps`` values and the
gradient of a non-linear loss of the sums against full logits on one process, with their one
all-reduce on the sp group in forward and none in backward.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("peft")
pytest.importorskip("datasets")

from dtensor_ulysses.launch import run_local_world  # noqa: E402
from tests import hf_workers as W  # noqa: E402
from tests.hf import preference_workers as P  # noqa: E402
from tests.hf import trainer_workers as T  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5  # ATOL: rewards are exactly 0 at step 1 (policy == reference)
GRAD_ATOL = 1e-5
# case -> (trainer kind, extra spec): the stock dp=1 references and the runs under Ulysses
CASES = {
    "sigmoid": ("dpo", dict(eval=4)),
    "ipo": ("dpo", dict(args={"loss_type": ["ipo"], "beta": 0.5})),
    "combined": ("dpo", dict(args={
        "loss_type": P.ALL_DPO_LOSSES, "label_smoothing": 0.1, "ld_alpha": 0.7,
        "loss_weights": [1.0, 0.5, 0.3, 0.7, 0.2, 0.4, 0.6, 0.01, 0.8, 0.9, 0.25, 0.35, 0.45,
                         1.5, 0.55]})),
    "lora_ga": ("dpo", dict(lora=True, batch=2, ga=2)),
    "kto": ("kto", dict(args={"desirable_weight": 1.3})),
    # rows shorter than sp (an empty completion and prompt among them): DPO one pair a step,
    # KTO two rows a step (preference_workers.SHORT_DPO / SHORT_KTO)
    "dpo_short": ("dpo", dict(short_rows=True, batch=1, steps=6)),
    # (a smaller learning rate: on rows this short Adam's first steps move the weights far, and
    # the rewards, differences of log-probabilities, then show float32 round-off above ATOL)
    "kto_short": ("kto", dict(short_rows=True, batch=2, steps=3, args={"learning_rate": 1e-3})),
}  # fmt: skip


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_preference")
    model = str(W.save_model("llama", root / "llama"))
    W.make_tokenizer(root / "tok", " ".join(T.TEXTS) * 5)
    return {"root": root, "model": model, "tok": str(root / "tok")}


def _spec(assets, case: str, name: str, *, sp=None, dp=1, **kw) -> dict:
    kind, extra = CASES[case]
    extra = {**extra, **kw}
    batch = extra.pop("batch", 4) // dp
    return dict(kind=kind, model=assets["model"], tok=assets["tok"], batch=batch, sp=sp,
                out=str(assets["root"] / name), **extra)  # fmt: skip


@pytest.fixture(scope="module")
def refs(assets):
    """The stock trainers on this process (dp = 1)."""
    torch.set_num_threads(1)
    return {case: P.run(_spec(assets, case, f"ref_{case}")) for case in CASES}


@pytest.fixture(scope="module")
def world2(assets):
    """2 ranks: the stock trainer at dp = 2 (references of the (2, 2) runs), then (1, 2)."""
    specs = {
        "stock_dp2_sigmoid": _spec(assets, "sigmoid", "s_dp2", dp=2),
        "stock_dp2_kto": _spec(assets, "kto", "k_dp2", dp=2),
        **{case: _spec(assets, case, f"u12_{case}", sp=2) for case in CASES if case != "kto_short"},
        # TRL's default gradient_checkpointing=True: checkpointing per decoder layer, in FSDP2
        "ipo": _spec(
            assets,
            "ipo",
            "u12_ipo",
            sp=2,
            count_comm=True,
            args={**CASES["ipo"][1]["args"], "gradient_checkpointing": True},
        ),
        "primitive": dict(kind="primitive", model=assets["model"]),
    }
    out = run_local_world(P.run_specs, 2, list(specs.values()), timeout_s=500)[0]
    return dict(zip(specs, out))


@pytest.fixture(scope="module")
def world4(assets):
    """4 ranks: (2, 2) and (1, 4)."""
    specs = {
        (2, 2, "sigmoid"): _spec(assets, "sigmoid", "u22_sigmoid", sp=2, dp=2),
        (2, 2, "kto"): _spec(assets, "kto", "u22_kto", sp=2, dp=2),
        (1, 4, "combined"): _spec(assets, "combined", "u14_combined", sp=4),
        (1, 4, "lora_ga"): _spec(assets, "lora_ga", "u14_lora_ga", sp=4),
        (1, 4, "kto"): _spec(assets, "kto", "u14_kto", sp=4),
        (1, 4, "dpo_short"): _spec(assets, "dpo_short", "u14_dpo_short", sp=4),
        (1, 4, "kto_short"): _spec(assets, "kto_short", "u14_kto_short", sp=4),
        (2, 2, "precompute"): _spec(
            assets,
            "sigmoid",
            "u22_pre",
            sp=2,
            dp=2,
            on_disk=True,
            args={"precompute_ref_log_probs": True},
        ),
        "primitive_short": dict(kind="primitive", model=assets["model"], short=True),
    }
    out = run_local_world(P.run_specs, 4, list(specs.values()), timeout_s=500)[0]
    return dict(zip(specs, out))


def _close(got: dict, ref: dict, tie_by_round_off: bool = False) -> None:
    """Every logged value, the eval metrics and every parameter's first-step gradient.
    ``tie_by_round_off``: the run's step-1 reference equals its policy only to round-off (a
    precomputed reference, from other batches than the step's), so the step-1
    ``rewards/accuracies``, which compares two equal sums, is left out (the margins are still
    held to ``ATOL``)."""
    skip = {"grads", "eval", "ref_columns", "comm", "tie"}
    keys = set(ref) - skip
    assert set(got) - skip == keys, (sorted(got), sorted(ref))
    steps = len(ref["loss"])
    assert steps in (3, 6), ref["loss"]
    for k in sorted(keys):
        assert len(got[k]) == len(ref[k]) == steps, (k, got[k], ref[k])
        mine, theirs = got[k], ref[k]
        if tie_by_round_off and k == "rewards/accuracies":
            mine, theirs = mine[1:], theirs[1:]
        assert mine == pytest.approx(theirs, rel=RTOL, abs=ATOL), (k, got[k], ref[k])
    if "eval" in ref:
        for k, v in ref["eval"].items():
            if k.endswith(("_runtime", "_per_second")):
                continue
            assert got["eval"][k] == pytest.approx(v, rel=RTOL, abs=ATOL), (k, got["eval"], v)
    assert set(got["grads"]) == set(ref["grads"]) and ref["grads"], sorted(got["grads"])
    for name, g in ref["grads"].items():
        diff = (got["grads"][name] - g).abs().max().item()
        assert diff <= GRAD_ATOL + RTOL * g.abs().max().item(), (name, diff)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", [c for c in CASES if not c.endswith("_short")])
def test_sp2_equals_one_process(world2, refs, case):
    """(dp, sp) = (1, 2): DPO sigmoid (with evaluation), IPO (with TRL's default gradient
    checkpointing, here activation checkpointing per decoder layer), every loss type weighted
    (with the sft term and ld_alpha), LoRA (reference: the adapter disabled) with gradient
    accumulation, KTO."""
    _close(world2[case], refs[case])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case,sp", [("dpo_short", 2), ("dpo_short", 4), ("kto_short", 4)])
def test_rows_shorter_than_sp_equal_one_process(world2, world4, refs, case, sp):
    """Pairs and rows of 1 to 9 tokens (an empty prompt and completion: the end token alone),
    each step's batch cut so that a rank of sp=4 (and, for the first DPO pair, of sp=2) would
    hold nothing: padded at the end, every logged value and the first step's gradients equal
    the stock trainer on one process (KTO's short rows at sp=4 only: no batch of 2 of them is
    shorter than 2)."""
    got = world2[case] if sp == 2 else world4[(1, 4, case)]
    _close(got, refs[case])


@pytest.mark.timeout(900)
def test_dpo_first_step_is_an_exact_tie(world2, world4, refs):
    """At step 1 the policy and the reference have the same weights: every DPO run (sigmoid,
    IPO with activation checkpointing, all loss types weighted, LoRA, short rows; at (1,2),
    (1,4), (2,2)) hands TRL bitwise equal per-token log-probabilities and per-row sums of the
    two, so ``rewards/chosen``, ``rewards/rejected`` and ``rewards/margins`` are exactly 0 and
    ``rewards/accuracies`` is the stock trainer's (0.0), as in the stock run."""
    runs = {
        **{(1, 2, c): r for c, r in world2.items() if isinstance(r, dict) and "tie" in r},
        **{k: r for k, r in world4.items() if isinstance(r, dict) and "tie" in r},
    }
    assert len(runs) == 9, sorted(runs)
    for key, got in runs.items():
        assert got["tie"]["equal"], (key, got["tie"])
        ref = world2["stock_dp2_sigmoid"] if key[0] == 2 else refs[key[-1]]
        for k in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert got[k][0] == 0.0 == ref[k][0], (key, k, got[k][0], ref[k][0])
        assert got["rewards/accuracies"][0] == ref["rewards/accuracies"][0], key


@pytest.mark.timeout(900)
def test_dpo_step_sp_collectives(world2):
    """The sp group's all-reduces of a DPO step at (1, 2): the reference's rows of
    log-probabilities (``B x S`` floats), then the policy's rows with TRL's three token
    statistics (``B x S x 4`` floats), for ``B`` = chosen + rejected rows; none in backward
    (with activation checkpointing recomputing each layer). At dp = 1 the sp group is the
    world's, so the Trainer door's stop agreement at the end of each step (one int32: every
    rank stops after the same step) runs on it too, between the steps."""
    comm = world2["ipo"]["comm"]
    assert len(comm["shapes"]) == 3, comm["shapes"]
    want = []
    for i, (B, S) in enumerate(comm["shapes"]):
        want += [4] * (i > 0) + [B * S * 4, B * S * 4 * 4]  # (the agreement between steps)
    assert comm["sp_all_reduce"] == want, (comm, want)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", ["combined", "lora_ga", "kto"])
def test_sp4_equals_one_process(world4, refs, case):
    """(1, 4): sp = 4 > the 2 kv heads, slices of 2-5 tokens (the combined loss holds the
    sigmoid term)."""
    _close(world4[(1, 4, case)], refs[case])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", ["sigmoid", "kto"])
def test_dp2_sp2_equals_stock_dp2(world2, world4, case):
    """(2, 2) against the stock trainer on 2 processes (KTO's KL pairs are per device batch,
    so a dp = 2 run differs from dp = 1, for the stock trainer too)."""
    _close(world4[(2, 2, case)], world2[f"stock_dp2_{case}"])


@pytest.mark.timeout(900)
def test_precomputed_reference_equals_stock_dp2(world2, world4):
    """precompute_ref_log_probs at (2, 2): TRL's precompute pass, run once the model is
    sharded (rows cut over sp, batches over dp), gives the reference of the stock run without
    precompute (the policy before training), for training and evaluation. (Its batches are not
    the training steps' batches, so at step 1 reference and policy agree to round-off, not
    bitwise: the step-1 accuracy, a comparison of the two, is not compared.)"""
    got = world4[(2, 2, "precompute")]
    assert got["ref_columns"] == ["ref_chosen_logps", "ref_rejected_logps"], got["ref_columns"]
    assert world2["stock_dp2_sigmoid"]["ref_columns"] == []
    _close(got, world2["stock_dp2_sigmoid"], tie_by_round_off=True)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["sp2", "sp4_short"])
def test_token_rows_and_sequence_logps_equal_full_logits(world2, world4, assets, layout):
    """The primitive at (1, 2), and at (1, 4) on a batch of 3 columns (fewer than sp: padded
    to sp inside, no rank with an empty slice): the full rows of label log-probabilities and
    token statistics, the per-row sums, and the summed gradient of a non-linear loss of the
    sums equal one process with full logits; forward: one all-reduce of B*S*K floats
    (token_rows) on the sp group; backward: no all-reduce."""
    import transformers as tf

    from dtensor_ulysses.models import token_logps

    short = layout == "sp4_short"
    got = world4["primitive_short"] if short else world2["primitive"]
    model = tf.AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    b = P.primitive_batch(short=short)
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    shifted = torch.full_like(b["labels"], -100)
    shifted[:, :-1] = b["labels"][:, 1:]
    logp = token_logps(logits, shifted)
    loss = P.primitive_loss(logp.sum(1), logp.sum(1))
    loss.backward()
    torch.testing.assert_close(got["rows"][..., 0], logp.detach(), rtol=1e-5, atol=1e-5)
    valid = shifted != -100
    p = logits.detach().float().softmax(-1)
    entropy = -(p * p.log()).sum(-1) * valid
    torch.testing.assert_close(got["rows"][..., 1], entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["sums"], logp.detach().sum(1), rtol=1e-5, atol=1e-5)
    assert got["loss"] == pytest.approx(loss.item(), rel=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(got["grads"][name], param.grad, rtol=1e-4, atol=1e-6)
    B, S = b["input_ids"].shape
    assert got["reduce_fwd"] == [B * S * 4 * 4], got["reduce_fwd"]
    assert got["reduce_bwd"] == 0


def test_refusals_one_line_at_construction(assets, tmp_path):
    """What cannot be made exact is refused before anything runs, naming the option."""
    import transformers as tf
    import trl
    from datasets import Dataset

    from dtensor_ulysses.hf import UnsupportedTrainerError, with_ulysses

    tok = tf.AutoTokenizer.from_pretrained(assets["tok"])
    model = tf.AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    data = Dataset.from_list(P._rows("dpo"))
    cls = with_ulysses(trl.DPOTrainer, sp=2)
    for option, match in (
        ({"use_weighting": True}, "use_weighting=True"),
        ({"activation_offloading": True}, "activation_offloading=True"),
        ({"sync_ref_model": True}, "sync_ref_model=True"),
    ):
        args = trl.DPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], **option)
        with pytest.raises(UnsupportedTrainerError, match=match):
            cls(model=model, args=args, train_dataset=data, processing_class=tok)
