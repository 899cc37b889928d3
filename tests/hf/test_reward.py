"""``hf.with_ulysses(trl.RewardTrainer)``: the reward model's pairwise loss under Ulysses + FSDP2
equals the stock ``RewardTrainer`` at the same data parallelism.

A tiny local Llama read as ``AutoModelForSequenceClassification`` (TRL loads it from its
directory, ``num_labels=1``) and tokenized preference pairs of uneven lengths, rows of 1 and 2
tokens among them (shorter than sp = 4), an evaluation set whose longest row (3 tokens) is
shorter than sp = 4. Three configurations: ``margin`` column + ``center_rewards_coefficient``
+ evaluation, gradient accumulation (2 micro-batches), a LoRA adapter (``task_type="SEQ_CLS"``:
the score head a trainable ``modules_to_save`` copy). Each is run at (dp, sp) = (1, 2) against
the stock trainer on this process and at (2, 2) against the stock trainer on 2 gloo processes
(DDP), and the first at (1, 4) against this process too, with the same global batch: the 3
logged losses, gradient norms and TRL's metrics (``accuracy``, ``margin``,
``min/mean/max_reward``, ``num_tokens``), the evaluation metrics, and the full gradient of every
trainable parameter at every step, fp32, rtol 1e-4.
Two spawned worlds: 2 ranks (stock dp=2 and Ulysses (1, 2)) and 4 ranks ((2, 2) and (1, 4)).
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
from tests.hf import reward_workers as R  # noqa: E402
from tests.hf import trainer_workers as T  # noqa: E402

RTOL = 1e-4
KEYS = ("loss", "grad_norm", *R.METRICS)
# the three configurations; per-device batch (pairs) at dp = 1, halved at dp = 2
CONFIGS = {
    "options": dict(margin=True, center=0.1, eval=True, batch=4),
    "ga": dict(ga=2, batch=2),
    "lora": dict(lora=True, batch=4),
}
LAYOUTS = [(1, 2), (2, 2), (1, 4)]
# every configuration at (1, 2) and (2, 2); at (1, 4) (the rows shorter than sp) the options
# (accumulation and LoRA run the same code at any sp: spared to keep the 4-rank world short)
CASES = [(layout, c) for layout in LAYOUTS for c in CONFIGS
         if layout != (1, 4) or c == "options"]  # fmt: skip
# examples/dpo_trl.py --trainer X: the TRL class it trains
EXAMPLE_TRAINERS = {"dpo": "DPOTrainer", "kto": "KTOTrainer", "reward": "RewardTrainer"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_reward")
    model = W.save_model("llama", root / "llama")
    W.make_tokenizer(root / "tok", " ".join(T.TEXTS) * 5)
    return {"root": root, "model": str(model), "tok": str(root / "tok")}


def _spec(assets, config: str, dp: int, sp: int | None, **kw) -> dict:
    c = dict(CONFIGS[config])
    c["batch"] //= dp
    name = f"{config}_{dp}_{sp}"
    return dict(model=assets["model"], tok=assets["tok"], out=str(assets["root"] / name),
                sp=sp, **c, **kw)  # fmt: skip


@pytest.fixture(scope="module")
def refs(assets):
    """The stock RewardTrainer on this process (dp = 1)."""
    torch.set_num_threads(1)
    return {c: R.run(_spec(assets, c, 1, None)) for c in CONFIGS}


def _refusal(trainer: str) -> str | None:
    """Why ``with_ulysses`` refuses ``trl.<trainer>``, or ``None``."""
    import trl

    from dtensor_ulysses.hf import UnsupportedTrainerError, with_ulysses

    try:
        with_ulysses(getattr(trl, trainer), sp=2)
    except UnsupportedTrainerError as e:
        return str(e)
    return None


def _example_argv(assets, trainer: str, *extra: str) -> list[str]:
    out = assets["root"] / f"example_{trainer}_{'stock' if '--stock' in extra else 'sp2'}"
    return ["--trainer", trainer, "--steps", "2", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def world2(assets):
    """The stock trainer at dp = 2 (DDP over 2 gloo processes), then Ulysses at (1, 2), then
    examples/dpo_trl.py at sp = 2 for each of its trainers that with_ulysses accepts."""
    specs = [_spec(assets, c, 2, None) for c in CONFIGS]
    specs += [_spec(assets, c, 1, 2, comm=c == "options") for c in CONFIGS]
    keys: list = [("stock", c) for c in CONFIGS] + [((1, 2), c) for c in CONFIGS]
    for flag, trainer in EXAMPLE_TRAINERS.items():
        if _refusal(trainer) is None:
            specs.append({"example": _example_argv(assets, flag, "--sp", "2")})
            keys.append(("example", flag))
    runs = run_local_world(R.run_specs, 2, specs, timeout_s=400)[0]
    return dict(zip(keys, runs))


@pytest.fixture(scope="module")
def world4(assets):
    keys = [(layout, c) for layout, c in CASES if layout[0] * layout[1] == 4]
    specs = [_spec(assets, c, dp, sp, comm=c == "options") for (dp, sp), c in keys]
    runs = run_local_world(R.run_specs, 4, specs, timeout_s=400)[0]
    return dict(zip(keys, runs))


def _close(got: dict, ref: dict) -> None:
    for k in KEYS:
        assert len(got[k]) == len(ref[k]) == 3, (k, got[k], ref[k])
        if k == "num_tokens":  # a count: exact
            assert got[k] == ref[k], (k, got[k], ref[k])
        else:
            assert got[k] == pytest.approx(ref[k], rel=RTOL, abs=1e-6), (k, got[k], ref[k])
    if "eval" in ref:
        assert got["eval"].keys() == ref["eval"].keys()
        for k, v in ref["eval"].items():
            assert got["eval"][k] == pytest.approx(v, rel=RTOL, abs=1e-6), (k, got["eval"], v)
    assert len(got["grads"]) == len(ref["grads"]) == 3
    for step, (g, r) in enumerate(zip(got["grads"], ref["grads"])):
        assert g.keys() == r.keys(), (step, sorted(g.keys() ^ r.keys()))
        for name, want in r.items():
            scale = want.abs().max().item()
            assert scale > 0 or step == 0, (step, name, "a gradient that is zero cannot fail")
            atol = 1e-5 * max(scale, 1e-3)  # fp32 rounding of the tensor's largest element
            where = f"step {step} {name}"
            torch.testing.assert_close(g[name], want, rtol=RTOL, atol=atol,
                                       msg=lambda m, w=where: f"{w}: {m}")  # fmt: skip


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("layout", "config"), CASES, ids=[f"dp{dp}-sp{sp}-{c}" for (dp, sp), c in CASES]
)
def test_reward_equals_stock(world2, world4, refs, layout, config):
    """Loss, metrics, evaluation and every gradient of 3 steps equal the stock trainer at the
    same dp (one process for dp = 1; DDP over 2 processes for dp = 2)."""
    got = {**world2, **world4}[(layout, config)]
    ref = refs[config] if layout[0] == 1 else world2[("stock", config)]
    _close(got, ref)


def test_reward_collectives(world2, world4):
    """The reward step's own communication on the sp group: one all-reduce of the ``rows x 1``
    rewards in forward (besides the engine's all-to-alls), none in backward."""
    for layout in ((1, 2), (2, 2), (1, 4)):
        c = {**world2, **world4}[(layout, "options")]["comm"]
        assert c["fwd_all_reduce"] == 1, (layout, c)
        assert c["fwd_all_reduce_bytes"] == c["rows"] * 4, (layout, c)  # fp32, 1 label
        assert c["fwd_all_to_all"] > 0 and c["bwd_all_to_all"] > 0, (layout, c)
        assert c["bwd_all_reduce"] == 0, (layout, c)


def test_last_token_is_the_models_score_position(assets):
    """:func:`~dtensor_ulysses.hf.trainers.reward.last_token` picks the position the stock
    sequence-classification model reads (right and left padding, a row of one token)."""
    import transformers as tf

    from dtensor_ulysses.hf.trainers.reward import last_token

    torch.manual_seed(0)
    model = tf.AutoModelForSequenceClassification.from_pretrained(
        assets["model"], num_labels=1, dtype=torch.float32
    )
    model.config.pad_token_id = R.PAD
    ids = torch.tensor([[5, 6, 7, 0, 0], [0, 0, 8, 9, 10], [11, 0, 0, 0, 0], [1, 2, 3, 4, 5]])
    mask = (ids != R.PAD).long()
    with torch.no_grad():
        pooled = model(input_ids=ids, attention_mask=mask).logits
        per_token = model.score(model.model(input_ids=ids, attention_mask=mask).last_hidden_state)
    index = last_token(ids, R.PAD)
    assert index.tolist() == [2, 4, 0, 4]
    torch.testing.assert_close(per_token[torch.arange(4), index], pooled, rtol=0, atol=0)
    with pytest.raises(ValueError, match="no pad_token_id and the batch has 4 rows"):
        last_token(ids, None)


def test_reward_refusals(assets, tmp_path):
    """At construction, one line each: the tiled loss (a reward model has no vocabulary
    logits), TRL's activation offloading, a model that is not a sequence classifier."""
    import transformers as tf
    import trl

    from dtensor_ulysses.hf import UnsupportedTrainerError, with_ulysses

    args = trl.RewardConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    tok = tf.AutoTokenizer.from_pretrained(assets["tok"])
    cls = with_ulysses(trl.RewardTrainer, sp=2, tiled_loss=True)
    with pytest.raises(UnsupportedTrainerError, match="tiled_loss=True: a reward model"):
        cls(model=assets["model"], args=args, train_dataset=R.pairs(), processing_class=tok)
    offloading = trl.RewardConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                  activation_offloading=True)  # fmt: skip
    with pytest.raises(UnsupportedTrainerError, match="activation_offloading=True .* use "
                       "with_ulysses\\(..., offload_activations=True\\)"):  # fmt: skip
        with_ulysses(trl.RewardTrainer, sp=2)(
            model=assets["model"], args=offloading, train_dataset=R.pairs(), processing_class=tok
        )
    lm = tf.AutoModelForCausalLM.from_pretrained(assets["model"], num_labels=1)
    with pytest.raises(UnsupportedTrainerError, match="LlamaForCausalLM is not a transformers "
                       "sequence-classification model"):  # fmt: skip
        with_ulysses(trl.RewardTrainer, sp=2)(
            model=lm, args=args, train_dataset=R.pairs(), processing_class=tok
        )
    sub = type("MyRewardTrainer", (trl.RewardTrainer,), {})
    assert issubclass(with_ulysses(sub, sp=2), sub)  # a subclass takes the same mixin


@pytest.mark.timeout(900)
@pytest.mark.parametrize("flag", list(EXAMPLE_TRAINERS))
def test_example_equals_stock(world2, assets, flag):
    """``examples/dpo_trl.py --trainer X --sp 2`` on 2 ranks logs the losses of the same
    script with ``--stock`` on one process (fp32). A trainer that ``with_ulysses`` still
    refuses is skipped with the refusal."""
    why = _refusal(EXAMPLE_TRAINERS[flag])
    if why is not None:
        pytest.skip(f"with_ulysses(trl.{EXAMPLE_TRAINERS[flag]}) is refused: {why}")
    torch.set_num_threads(1)
    ref = R.run_example(_example_argv(assets, flag, "--stock"))
    got = world2[("example", flag)]
    assert len(got["loss"]) == len(ref["loss"]) == 2, (got, ref)
    assert got["loss"] == pytest.approx(ref["loss"], rel=RTOL), (got, ref)
    # save_model: the files of the stock run (full weights, the same names), trained alike
    from safetensors.torch import load_file

    saved = [load_file(assets["root"] / f"example_{flag}_{run}" / "final" / "model.safetensors")
             for run in ("sp2", "stock")]  # fmt: skip
    assert saved[0].keys() == saved[1].keys()
    for name, want in saved[1].items():
        torch.testing.assert_close(saved[0][name], want, rtol=RTOL, atol=1e-6, msg=name)
