"""``hf.with_ulysses``: transformers ``Trainer`` and TRL ``SFTTrainer`` under Ulysses + FSDP2
equal the same stock trainer on one process.

Tiny local Llama / Qwen3 checkpoints and a BPE tokenizer trained on the spot (no downloads).
The references run in this process with the stock classes and stock attention (sdpa); the
Ulysses runs in spawned gloo worlds of 2 and 4 ranks (several runs per world). Global batch 4
rows per step, fp32, 3 steps, compared at rtol 1e-4: logged losses, gradient norms, learning
rates, and exactly the tokens seen (``include_num_input_tokens_seen``); also gradient
accumulation, resume from the trainer's own checkpoint, ``save_model`` -> ``from_pretrained``
logits, LoRA, sharded evaluation and metrics, a slice with no target,
heads that sp does not divide, and the refusals.
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
from tests.hf import trainer_workers as T  # noqa: E402

RTOL = 1e-4
KEYS = ("loss", "grad_norm", "lr", "tokens_seen")
# what each kind trains: (model, data)
MODELS = {"trainer": "llama", "sft_chat": "qwen3", "sft_packed": "llama", "masked": "llama",
          "short_sft": "llama", "short_trainer": "llama"}  # fmt: skip


def _close(got: dict, ref: dict, keys=KEYS, trl: tuple = T.TRL_METRICS, steps: int = 3) -> None:
    """``keys``, and TRL's SFT metrics ``trl`` where the reference logs them."""
    for k in keys + tuple(m for m in trl if ref.get(m)):
        assert len(got[k]) == len(ref[k]) == steps, (k, got[k], ref[k])
        if k in ("tokens_seen", "num_tokens"):  # counts: exact (sp ranks share their rows)
            assert got[k] == ref[k], (k, got[k], ref[k])
        else:
            assert got[k] == pytest.approx(ref[k], rel=RTOL), (k, got[k], ref[k])


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    import transformers as tf

    root = tmp_path_factory.mktemp("hf_trainer")
    dirs = {a: str(W.save_model(a, root / a)) for a in ("llama", "qwen3", "llama_dropout")}
    # 3 q heads, 1 kv head: sp=2 divides neither
    torch.manual_seed(0)
    small = {**W.SMALL, "hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1}
    cfg = tf.LlamaConfig(**small, tie_word_embeddings=False)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "uneven")
    dirs["uneven"] = str(root / "uneven")
    # GPT-2 (loss_type None: the stock Trainer divides by the unshifted label count)
    gpt2 = tf.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                         attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)  # fmt: skip
    tf.AutoModelForCausalLM.from_config(gpt2).save_pretrained(root / "gpt2")
    dirs["gpt2"] = str(root / "gpt2")
    tok = root / "tok"
    W.make_tokenizer(tok, " ".join(T.TEXTS) * 5)
    return {"root": root, "dirs": dirs, "tok": str(tok)}


def _spec(assets, kind: str, name: str, **kw) -> dict:
    model = assets["dirs"][kw.pop("model", MODELS[kind])]
    return dict(kind=kind, model=model, tok=assets["tok"], out=str(assets["root"] / name), **kw)


EVAL = dict(eval=8, metrics=True, eval_first=True)
TILED = {"tiled_loss": True, "loss_chunk_tokens": 5}
# rows shorter than sp (issue 47): SFTTrainer one row a step (6 steps: rows of 1, 2, 3, 5, 6
# and 9 tokens, the 1-token one an empty text row), Trainer two rows a step (3 steps, each
# batch of 2 to 9 columns); both evaluated on 7 rows in batches of 3 (a partial last batch),
# every step's gradients kept
SHORT = {
    "short_sft": dict(batch=1, steps=6, eval=7, eval_batch=3, drop_last=False, grads=True),
    "short_trainer": dict(batch=2, steps=3, eval=7, eval_batch=3, drop_last=False, grads=True),
}


@pytest.fixture(scope="module")
def refs(assets):
    """The stock trainers on this process (no Ulysses)."""
    r = assets["root"]
    return {
        "trainer": T.run(_spec(assets, "trainer", "ref_t", save_to=str(r / "ref_saved"), **EVAL)),
        "sft_chat": T.run(_spec(assets, "sft_chat", "ref_c")),
        "sft_packed": T.run(_spec(assets, "sft_packed", "ref_p")),
        "lora": T.run(_spec(assets, "sft_chat", "ref_l", lora=True)),
        "masked": T.run(_spec(assets, "masked", "ref_m")),
        "uneven": T.run(_spec(assets, "trainer", "ref_u", model="uneven")),
        "gpt2": T.run(_spec(assets, "trainer", "ref_g", model="gpt2")),
        **{kind: T.run(_spec(assets, kind, f"ref_{kind}", **kw)) for kind, kw in SHORT.items()},
    }


@pytest.fixture(scope="module")
def world2(assets):
    r = assets["root"]
    specs = [
        _spec(
            assets,
            "trainer",
            "t2",
            sp=2,
            save_to=str(r / "sp_saved"),
            count_logit_rows=True,
            **EVAL,
        ),  # fmt: skip
        _spec(assets, "sft_chat", "c2", sp=2),
        _spec(assets, "sft_packed", "p2", sp=2),
        _spec(assets, "trainer", "ga2", sp=2, batch=2, ga=2),
        _spec(assets, "trainer", "ck2", sp=2, save="steps", save_steps=2, steps=4),
        _spec(assets, "trainer", "rs2", sp=2, steps=4, resume=str(r / "ck2" / "checkpoint-2")),
        _spec(assets, "sft_chat", "l2", sp=2, lora=True),
        _spec(assets, "masked", "m2", sp=2),
        _spec(
            assets, "trainer", "u2", sp=2, model="uneven", options={"allow_uneven_heads": True}
        ),  # fmt: skip
        _spec(assets, "trainer", "bad", sp=3, expect_error=True),
        _spec(assets, "sft_chat", "lck2", sp=2, lora=True, save="steps", save_steps=2, steps=4),
        _spec(
            assets,
            "sft_chat",
            "lrs2",
            sp=2,
            lora=True,
            steps=4,
            resume=str(r / "lck2" / "checkpoint-2"),
        ),  # fmt: skip
        _spec(
            assets,
            "trainer",
            "ac2",
            sp=2,
            args={"gradient_checkpointing": True},
            options={"head_chunks": 2},
            capture_stdout=True,
        ),  # fmt: skip
        _spec(assets, "trainer", "tl2", sp=2, options=TILED, count_logit_rows=True, **EVAL),
        _spec(assets, "sft_packed", "tlp2", sp=2, options=TILED),
        _spec(assets, "trainer", "nz2", sp=2, rank_noise=True, capture_stdout=True),
        _spec(assets, "trainer", "g2", sp=2, model="gpt2"),
        _spec(assets, "trainer", "h2", sp=2, model="uneven", expect_error=True),
        *(_spec(assets, kind, f"{kind}2", sp=2, **kw) for kind, kw in SHORT.items()),
    ]
    names = ["trainer", "sft_chat", "sft_packed", "ga", "ckpt", "resume", "lora", "masked",
             "uneven", "sp3", "lora_ckpt", "lora_resume", "checkpointing", "tiled",
             "tiled_packed", "rank_noise", "gpt2", "heads", *SHORT]  # fmt: skip
    ranks = run_local_world(T.run_specs, 2, specs, timeout_s=400)
    out = dict(zip(names, ranks[0]))
    out["checkpointing_rank1"] = ranks[1][names.index("checkpointing")]
    return out


@pytest.fixture(scope="module")
def world4(assets):
    specs = [
        _spec(assets, kind, f"{kind}_{dp}_{sp}", sp=sp, batch=4 // dp, eval_batch=4 // dp,
              **(EVAL if (kind, dp) == ("trainer", 2) else {}))
        for dp, sp in ((2, 2), (1, 4))
        for kind in ("trainer", "sft_chat", "sft_packed")
    ]  # fmt: skip
    r = assets["root"]
    extra = {  # what the docs claim at (2,2) too: 2 dp ranks of 2 rows each
        "ga": _spec(assets, "trainer", "ga22", sp=2, batch=1, ga=2),
        "ckpt": _spec(assets, "trainer", "ck22", sp=2, batch=2, save="steps", save_steps=2,
                      steps=4),
        "resume": _spec(assets, "trainer", "rs22", sp=2, batch=2, steps=4,
                        resume=str(r / "ck22" / "checkpoint-2")),
        "lora": _spec(assets, "sft_chat", "l22", sp=2, batch=2, lora=True),
        "tiled": _spec(assets, "trainer", "tl22", sp=2, batch=2, options=TILED),
        **{kind: _spec(assets, kind, f"{kind}14", sp=4, **kw) for kind, kw in SHORT.items()},
    }  # fmt: skip
    runs = run_local_world(T.run_specs, 4, [*specs, *extra.values()], timeout_s=500)[0]
    out: dict = {(s["kind"], 4 // s["sp"], s["sp"]): r for s, r in zip(specs, runs)}
    out.update(zip(extra, runs[len(specs) :]))
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["trainer", "sft_chat", "sft_packed"])
def test_sp2_equals_one_process(world2, refs, kind):
    """(dp, sp) = (1, 2): losses, grad norms and learning rates of 3 steps: Trainer on padded
    text, SFTTrainer on chat with assistant-only loss, SFTTrainer packed + padding_free."""
    _close(world2[kind], refs[kind])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [(2, 2), (1, 4)])
@pytest.mark.parametrize("kind", ["trainer", "sft_chat", "sft_packed"])
def test_world4_equals_one_process(world4, refs, kind, layout):
    """(2, 2) and (1, 4) (sp=4 > 2 kv heads: GQA replication): as above."""
    _close(world4[(kind, *layout)], refs[kind])


@pytest.mark.timeout(600)
def test_every_rank_starts_from_rank0_weights(world2, refs):
    """Rank 1 built other weights than rank 0 (as a head initialized per rank would be): the
    run is rank 0's, as under DDP, and the start says which tensors differed."""
    got = world2["rank_noise"]
    _close(got, refs["trainer"])
    assert "tensor(s) differed between ranks" in got["stdout"], got["stdout"]


@pytest.mark.timeout(600)
def test_grad_accumulation_equals_doubled_batch(world2, world4, refs):
    """batch 2 x accumulation 2 at sp=2, and 2 dp ranks x 1 row x accumulation 2 at (2,2),
    == batch 4 on one process."""
    _close(world2["ga"], refs["trainer"])
    _close(world4["ga"], refs["trainer"])


def _resumed(ck: dict, rs: dict) -> None:
    """Steps 3 and 4 after resuming at step 2 == the uninterrupted run's (step 4 needs the
    restored optimizer moments and schedule, step 3 the restored weights)."""
    assert len(ck["loss"]) == len(rs["loss"]) == 4, (ck, rs)
    for k in KEYS:
        assert rs[k][2:] == pytest.approx(ck[k][2:], rel=RTOL), (k, rs[k], ck[k])


@pytest.mark.timeout(600)
def test_resume_continues_same_losses(world2, world4):
    """Checkpoint at step 2 of 4 (full weights, optimizer, scheduler, RNG), a new trainer
    resumes from it; at (1,2) and at (2,2)."""
    _resumed(world2["ckpt"], world2["resume"])
    _resumed(world4["ckpt"], world4["resume"])


@pytest.mark.timeout(600)
def test_lora_resume_continues_same_losses(world2):
    """The same with a LoRA adapter (the checkpoint holds adapter_model.safetensors)."""
    _resumed(world2["lora_ckpt"], world2["lora_resume"])


@pytest.mark.timeout(600)
def test_checkpointing_and_head_chunks(world2, refs):
    """``gradient_checkpointing=True`` (our per-layer checkpointing inside FSDP2) and
    ``head_chunks=2`` change nothing in the losses."""
    _close(world2["checkpointing"], refs["trainer"])


@pytest.mark.timeout(600)
def test_save_model_from_pretrained_logits(world2, assets):
    """``save_model`` at sp=2, then ``from_pretrained`` on one process: the logits of the
    model trained on one process."""
    from transformers import AutoModelForCausalLM

    r = assets["root"]
    ids = torch.randint(0, 90, (2, 17), generator=torch.Generator().manual_seed(3))
    got, ref = (
        AutoModelForCausalLM.from_pretrained(str(r / d), dtype=torch.float32)(input_ids=ids).logits
        for d in ("sp_saved", "ref_saved")
    )
    base = AutoModelForCausalLM.from_pretrained(assets["dirs"]["llama"])(input_ids=ids).logits
    assert not torch.allclose(ref, base, atol=1e-3)  # it did train
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=1e-5)


@pytest.mark.timeout(600)
def test_lora_sp2_equals_one_process(world2, world4, refs):
    """SFTTrainer with a LoRA adapter (peft_config) at (1,2) and (2,2) == one process."""
    _close(world2["lora"], refs["lora"])
    _close(world4["lora"], refs["lora"])


@pytest.mark.timeout(600)
def test_sharded_eval_and_metrics(world2, refs):
    """``evaluate`` before and after training, sharded at sp=2: the one-process eval loss, and
    ``compute_metrics`` sees the full logits and the collator's ``labels`` (same accuracy and
    label count)."""
    got, ref = world2["trainer"], refs["trainer"]
    for when in ("eval", "eval_after"):
        for k in ("eval_loss", "eval_acc", "eval_n_labels"):
            assert got[when][k] == pytest.approx(ref[when][k], rel=RTOL), (when, k)


@pytest.mark.timeout(600)
def test_sharded_eval_and_metrics_dp2(world4, refs):
    """The same at (dp, sp) = (2, 2): eval batches of 2 rows per dp rank, metrics gathered
    over dp only."""
    got, ref = world4[("trainer", 2, 2)], refs["trainer"]
    for when in ("eval", "eval_after"):
        for k in ("eval_loss", "eval_acc", "eval_n_labels"):
            assert got[when][k] == pytest.approx(ref[when][k], rel=RTOL), (when, k)


@pytest.mark.timeout(600)
def test_slice_without_targets_is_finite(world2, refs):
    """Rows whose first 5 of 8 labels are -100: sp rank 0 holds no target (no NaN)."""
    _close(world2["masked"], refs["masked"])


@pytest.mark.timeout(600)
def test_tiled_loss_equals_one_process_without_full_logits(world2, refs):
    """``tiled_loss=True, loss_chunk_tokens=5`` at sp=2, Trainer (with sharded eval and
    metrics, which get full logits) and packed SFT: the one-process losses, grad norms, eval.
    While training, no op makes more than 5 rows of ``[..., V]`` (logits, softmax, their
    gradient); without the tiled loss the same run makes ``[B, s, V]`` (s: this rank's slice)."""
    got, ref = world2["tiled"], refs["trainer"]
    _close(got, ref)
    _close(world2["tiled_packed"], refs["sft_packed"], trl=("num_tokens",))
    for when in ("eval", "eval_after"):
        for k in ("eval_loss", "eval_acc", "eval_n_labels"):
            assert got[when][k] == pytest.approx(ref[when][k], rel=RTOL), (when, k)
    assert got["logit_rows"] == TILED["loss_chunk_tokens"], got["logit_rows"]
    assert world2["trainer"]["logit_rows"] >= 4 * 8, world2["trainer"]["logit_rows"]


@pytest.mark.timeout(600)
def test_tiled_loss_dp2_sp2_equals_one_process(world4, refs):
    """The tiled loss at (2,2): the one-process losses and grad norms."""
    _close(world4["tiled"], refs["trainer"])


@pytest.mark.timeout(600)
def test_heads_not_divisible_by_sp(world2, refs):
    """3 q heads, 1 kv head at sp=2 (allow_uneven_heads)."""
    _close(world2["uneven"], refs["uneven"])


@pytest.mark.timeout(600)
def test_start_line_once_from_rank_0(world2):
    """Construction prints one line from rank 0 that shows sequence parallelism is on: the
    mesh, the kernel, the features (gradient_checkpointing turns on the per-layer checkpoints);
    rank 1 prints nothing."""
    [line] = world2["checkpointing"]["stdout"].splitlines()
    assert line.startswith("with_ulysses: sequence parallelism on: mesh dp=1 x sp=2 (2 ranks, "
                           "cpu), LlamaForCausalLM "), line  # fmt: skip
    assert "attention kernel sdpa, fp32 compute," in line, line
    assert line.endswith("features: activation checkpointing, head chunks 2"), line
    assert world2["checkpointing_rank1"]["stdout"] == ""


def _same_run(got: dict, ref: dict, steps: int) -> None:
    """Every logged value of every step (TRL's metrics where the stock run logs them, token
    counts exactly), the evaluation, and every parameter's gradient at every step."""
    _close(got, ref, steps=steps)
    for k, v in ref["eval_after"].items():
        if not k.endswith(("_runtime", "_per_second")):
            assert got["eval_after"][k] == pytest.approx(v, rel=RTOL), (k, got["eval_after"], v)
    assert len(got["grads"]) == len(ref["grads"]) == steps
    for step, (mine, theirs) in enumerate(zip(got["grads"], ref["grads"])):
        assert set(mine) == set(theirs) and theirs
        for name, g in theirs.items():
            diff = (mine[name] - g).abs().max().item()
            assert diff <= 1e-6 + RTOL * g.abs().max().item(), (step, name, diff)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("kind", list(SHORT))
def test_rows_shorter_than_sp_equal_stock(world2, world4, refs, kind, sp):
    """Rows shorter than sp, an empty text row, and batches whose cut over sp=4 leaves the last
    rank empty (5, 6 or 9 columns): padded at the end so that every rank holds a token, they
    train exactly as the stock trainer on one process (its 0.0 loss for a row without a
    target included): losses, grad norms, TRL's metrics, tokens seen, every gradient of every
    step; and the evaluation of 7 rows in batches of 3 gives the stock ``eval_loss``, each
    batch weighed by its rows (the last one holds 1)."""
    got = world2[kind] if sp == 2 else world4[kind]
    _same_run(got, refs[kind], SHORT[kind]["steps"])


@pytest.mark.timeout(600)
def test_gpt2_counts_as_the_stock_trainer(world2, refs):
    """GPT-2 (``loss_type`` None): the stock Trainer divides the summed loss by the labels that
    are not -100 before the shift (one more per row than the targets); with_ulysses does the
    same, so losses and gradient norms equal the stock run."""
    _close(world2["gpt2"], refs["gpt2"])


@pytest.mark.timeout(600)
def test_heads_not_divisible_names_the_option(world2):
    """3 q heads at sp=2 without allow_uneven_heads: refused with the valid sp and the option
    that accepts them."""
    err = world2["heads"]["error"]
    assert "3 q heads of LlamaForCausalLM are not divisible by sp=2; choose sp in {1, 3}" in err
    assert "(or pass allow_uneven_heads=True to accept a load imbalance)" in err, err


@pytest.mark.timeout(600)
def test_sp_not_dividing_world(world2):
    assert "sp=3 does not divide the 2 ranks" in world2["sp3"]["error"]


# ---------------------------------------------------------------------------------------------
# refusals at construction (this process, no distributed launch needed)
# ---------------------------------------------------------------------------------------------
def test_generation_and_other_loss_trainers_refused():
    import trl
    from trl.experimental.online_dpo import OnlineDPOTrainer

    from dtensor_ulysses.hf import UnsupportedTrainerError, with_ulysses

    with pytest.raises(UnsupportedTrainerError, match="OnlineDPOTrainer.*generation"):
        with_ulysses(OnlineDPOTrainer, sp=2)
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    with pytest.raises(UnsupportedTrainerError, match="AsyncGRPOTrainer.*generation"):
        with_ulysses(AsyncGRPOTrainer, sp=2)
    from trl.experimental.orpo import ORPOTrainer

    with pytest.raises(UnsupportedTrainerError, match="ORPOTrainer computes its own loss"):
        with_ulysses(ORPOTrainer, sp=2)
    # the families with a mixin of their own (tests/hf/test_preference.py, test_reward.py,
    # test_rl.py, test_distill.py)
    for cls, mixin in ((trl.DPOTrainer, "_UlyssesDPO"), (trl.KTOTrainer, "_UlyssesKTO"),
                       (trl.RewardTrainer, "_UlyssesReward"), (trl.GRPOTrainer, "_UlyssesRL"),
                       (trl.RLOOTrainer, "_UlyssesRL"),
                       (trl.DistillationTrainer, "_UlyssesDistillation")):  # fmt: skip
        assert mixin in [c.__name__ for c in with_ulysses(cls, sp=2).__mro__]
    with pytest.raises(ValueError, match=r"unknown with_ulysses option\(s\)"):
        with_ulysses(trl.SFTTrainer, sp=2, tiled=True)
    with pytest.raises(ValueError, match="sp=0"):
        with_ulysses(trl.SFTTrainer, sp=0)
    # the recipe as one object: kept as it is; not with keywords too; nothing it would not apply
    from dtensor_ulysses.plan import ParallelOptions

    opts = ParallelOptions(activation_checkpointing=True, tiled_loss=True)
    assert with_ulysses(trl.SFTTrainer, 2, opts)._du_options is opts
    assert with_ulysses(trl.SFTTrainer, sp=2, tiled_loss=True)._du_options == ParallelOptions(
        tiled_loss=True
    )
    with pytest.raises(ValueError, match=r"not both .*replace\(options, head_chunks=\.\.\.\)"):
        with_ulysses(trl.SFTTrainer, 2, opts, head_chunks=2)
    with pytest.raises(ValueError, match=r"with_ulysses does not apply offload_optimizer=True"):
        with_ulysses(trl.SFTTrainer, 2, ParallelOptions(offload_optimizer=True))


def _stock(assets, tmp_path, model="llama", **args):
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(assets["tok"])
    m = tf.AutoModelForCausalLM.from_pretrained(assets["dirs"][model], dtype=torch.float32)
    a = tf.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    for k, v in args.items():
        setattr(a, k, v)
    return m, a, T._data("trainer", tok)


def test_attention_dropout_refused(assets, tmp_path):
    import transformers as tf

    from dtensor_ulysses.hf import UnsupportedModelError, with_ulysses

    m, a, data = _stock(assets, tmp_path, model="llama_dropout")
    refusal = r"has attention dropout \(config\.attention_dropout=0\.1"
    with pytest.raises(UnsupportedModelError, match=refusal):
        with_ulysses(tf.Trainer, sp=2)(model=m, args=a, train_dataset=data)


@pytest.mark.parametrize(
    "args,match",
    [
        ({"deepspeed": {"zero_optimization": {"stage": 3}}}, "DeepSpeed is enabled"),
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor=0.1"),
        ({"save_on_each_node": True}, "save_on_each_node"),
    ],
)
def test_args_refused(assets, tmp_path, args, match):
    import transformers as tf

    from dtensor_ulysses.hf import UnsupportedTrainerError, with_ulysses

    m, a, data = _stock(assets, tmp_path, **args)
    with pytest.raises(UnsupportedTrainerError, match=match):
        with_ulysses(tf.Trainer, sp=2)(model=m, args=a, train_dataset=data)


def test_context_parallel_refused(assets, tmp_path):
    import transformers as tf
    from accelerate.parallelism_config import ParallelismConfig

    from dtensor_ulysses.hf import UnsupportedTrainerError, with_ulysses

    m, a, data = _stock(assets, tmp_path)
    a.parallelism_config = ParallelismConfig(cp_size=2)
    with pytest.raises(UnsupportedTrainerError, match="parallelism_config.cp_size=2"):
        with_ulysses(tf.Trainer, sp=2)(model=m, args=a, train_dataset=data)


def test_loss_and_optimizer_overrides_refused(assets, tmp_path):
    import transformers as tf

    from dtensor_ulysses.hf import UnsupportedTrainerError, with_ulysses

    m, a, data = _stock(assets, tmp_path)
    cls = with_ulysses(tf.Trainer, sp=2)
    with pytest.raises(UnsupportedTrainerError, match="compute_loss_func"):
        cls(model=m, args=a, train_dataset=data, compute_loss_func=lambda *x, **k: 0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(UnsupportedTrainerError, match="optimizers="):
        cls(model=m, args=a, train_dataset=data, optimizers=(opt, None))


def test_an_empty_dataset_is_refused_before_anything_is_built(assets, tmp_path):
    import transformers as tf

    from dtensor_ulysses.hf import with_ulysses

    m, a, data = _stock(assets, tmp_path)
    cls = with_ulysses(tf.Trainer, sp=2)
    empty = r"^train_dataset is empty \(0 rows\): there is nothing to train on; check how"
    with pytest.raises(ValueError, match=empty):
        cls(model=m, args=a, train_dataset=data.select([]))
    with pytest.raises(ValueError, match=r"^eval_dataset is empty \(0 rows\)"):
        cls(model=m, args=a, train_dataset=data, eval_dataset=data.select([]))


def test_tiled_loss_needs_a_plain_head(assets, tmp_path):
    """A head that does more than ``h @ W.T`` (here logit softcapping) is refused."""
    import transformers as tf

    from dtensor_ulysses.hf import with_ulysses

    m, a, data = _stock(assets, tmp_path)
    m.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"does more \(final_logit_softcapping\)"):
        with_ulysses(tf.Trainer, sp=2, tiled_loss=True)(model=m, args=a, train_dataset=data)
    with pytest.raises(ValueError, match="loss_chunk_tokens=64 needs tiled_loss=True"):
        with_ulysses(tf.Trainer, sp=2, loss_chunk_tokens=64)
    with pytest.raises(ValueError, match="loss_chunk_tokens=0 is not a positive int"):
        with_ulysses(tf.Trainer, sp=2, tiled_loss=True, loss_chunk_tokens=0)


def test_router_aux_loss_accepted(assets, tmp_path):
    """A Mixture-of-Experts model whose stock trainer adds the router loss is no longer refused
    (tests/hf/test_families.py checks it equals one process): SFTTrainer by default (the
    config's coefficient), Trainer with ``output_router_logits``; construction gets as far as
    the distributed launch it needs."""
    import transformers as tf
    import trl

    from dtensor_ulysses.hf import with_ulysses

    small = {k: v for k, v in W.SMALL.items() if k != "intermediate_size"}
    moe = tf.AutoModelForCausalLM.from_config(
        tf.Qwen3MoeConfig(**small, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    )
    tok = tf.AutoTokenizer.from_pretrained(assets["tok"])
    sft = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="needs a distributed launch"):
        with_ulysses(trl.SFTTrainer, sp=2)(
            model=moe, args=sft, train_dataset=T._data("sft_chat", tok), processing_class=tok
        )
    _, a, data = _stock(assets, tmp_path)
    moe.config.output_router_logits = True
    with pytest.raises(ValueError, match="needs a distributed launch"):
        with_ulysses(tf.Trainer, sp=2)(model=moe, args=a, train_dataset=data)


def test_chat_rows_without_an_assistant_turn_refused_naming_them(assets, tmp_path):
    """assistant_only_loss=True on chat rows of which some have no assistant turn: instead of
    TRL's tokenization error (rank 0 tokenizes first while the others wait at a barrier: a
    traceback on every rank under a launch), every rank reads the rows before TRL does and
    refuses alike, naming them and the fix (under torchrun: one ``error:`` line from rank 0, as
    test_refusal_under_torchrun_is_one_line_from_rank_0 checks for any refusal)."""
    import transformers as tf
    import trl
    from datasets import Dataset

    from dtensor_ulysses.hf import UnsupportedTrainerError, with_ulysses
    from dtensor_ulysses.hf.trainers.refusals import _is_refusal

    tok = tf.AutoTokenizer.from_pretrained(assets["tok"])
    m = tf.AutoModelForCausalLM.from_pretrained(assets["dirs"]["llama"], dtype=torch.float32)
    lone = [{"role": "user", "content": "the quick fox"}]
    rows = [{"messages": c} for c in T.CONVS[:3]] + [{"messages": lone}] * 7
    args = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                         assistant_only_loss=True, max_length=40)  # fmt: skip
    cls = with_ulysses(trl.SFTTrainer, sp=2)
    with pytest.raises(UnsupportedTrainerError) as e:
        cls(model=m, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    assert str(e.value) == (
        "assistant_only_loss=True trains on assistant tokens only, and 7 chat row(s) have no "
        "assistant turn (train_dataset row 3, train_dataset row 4, train_dataset row 5, "
        "train_dataset row 6, train_dataset row 7 and 2 more): there is nothing to learn in "
        "them; drop them (dataset.filter) or set assistant_only_loss=False"
    ), e.value
    assert _is_refusal(e.value)


def test_needs_distributed_launch(assets, tmp_path):
    import transformers as tf

    from dtensor_ulysses.hf import with_ulysses

    m, a, data = _stock(assets, tmp_path)
    with pytest.raises(ValueError, match="needs a distributed launch: torchrun"):
        with_ulysses(tf.Trainer, sp=2)(model=m, args=a, train_dataset=data)


def test_attention_dropout_refused_at_construction_with_the_fix(assets, tmp_path, monkeypatch):
    """Attention dropout is refused when the trainer is built, once, with the fix: in the
    config, on the attention modules alone (what the kernel would get in training), and for a
    model TRL loads from its name, before it is loaded (from its config file)."""
    import transformers as tf
    import trl

    from dtensor_ulysses.hf import UnsupportedModelError, with_ulysses

    fix = r"set attention_dropout=0\.0 in the model config"
    m, a, data = _stock(assets, tmp_path)
    m.config.attention_dropout = 0.1
    with pytest.raises(UnsupportedModelError, match=r"config\.attention_dropout=0\.1\): .*" + fix):
        with_ulysses(tf.Trainer, sp=2)(model=m, args=a, train_dataset=data)
    m.config.attention_dropout = 0.0
    for layer in m.model.layers:  # the modules only: the config says 0
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(UnsupportedModelError, match=r"self_attn\.attention_dropout=0\.1 and 0 "
                       "more|self_attn\\.attention_dropout=0\\.1\\): .*" + fix):  # fmt: skip
        with_ulysses(tf.Trainer, sp=2)(model=m, args=a, train_dataset=data)

    saved = tmp_path / "dropout_model"
    m.config.attention_dropout = 0.1
    m.save_pretrained(saved)
    loads = []
    monkeypatch.setattr(tf.PreTrainedModel, "from_pretrained",
                        classmethod(lambda cls, *x, **k: loads.append(x) or 1 / 0))  # fmt: skip
    tok = tf.AutoTokenizer.from_pretrained(assets["tok"])
    sft = trl.SFTConfig(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[])
    chats = T._data("sft_chat", tok)
    with pytest.raises(UnsupportedModelError, match=r"has attention dropout \(attention_dropout"):
        with_ulysses(trl.SFTTrainer, sp=2)(model=str(saved), args=sft, train_dataset=chats,
                                           processing_class=tok)  # fmt: skip
    assert loads == []  # refused before loading
    sft.model_init_kwargs = {"attention_dropout": 0.0}  # the fix given to TRL's loading: passes
    with pytest.raises(ZeroDivisionError):  # ... and reaches the (stubbed) loading
        with_ulysses(trl.SFTTrainer, sp=2)(model=str(saved), args=sft, train_dataset=chats,
                                           processing_class=tok)  # fmt: skip
    assert len(loads) == 1


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["sp3", "chat_rows"])
def test_refusal_under_torchrun_is_one_line_from_rank_0(tmp_path, assets, case):
    """A refusal at construction under torchrun (2 ranks): one ``error:`` line from rank 0, no
    worker traceback, the reason in torchrun's failure summary, exit status 2. ``sp3``:
    examples/sft_trl.py at sp=3 (after the process group exists); ``chat_rows``: chat rows
    without an assistant turn (tests/hf/chat_refusal.py), refused before TRL tokenizes (TRL
    tokenizes on rank 0 first, the other ranks waiting at a barrier)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    if case == "sp3":
        script = ["examples/sft_trl.py", "--sp", "3", "--steps", "1", "--out", str(tmp_path)]
        reason = "sp=3 does not divide the 2 ranks"
        line = f"error: {reason}; launch a multiple of 3 ranks"
    else:
        script = ["tests/hf/chat_refusal.py", assets["dirs"]["llama"], assets["tok"],
                  str(tmp_path)]  # fmt: skip
        reason = "assistant_only_loss=True trains on assistant tokens only"
        line = (f"error: {reason}, and 2 chat row(s) have no assistant turn (train_dataset row "
                f"4, train_dataset row 5): there is nothing to learn in them; drop them "
                f"(dataset.filter) or set assistant_only_loss=False")  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", *script]  # fmt: skip
    res = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=170)
    err = res.stderr
    assert res.returncode != 0, err[-3000:]
    # (rank 1's progress bars may share its line: they end with a carriage return)
    assert err.count("error:") == 1 and line in err, err[-3000:]
    # no worker traceback: the one traceback is torchrun's own (its ChildFailedError)
    assert "hf/trainers/" not in err.split("Root Cause")[0], err[-3000:]
    assert err.count("Traceback (most recent call last)") == 1, err[-3000:]
    assert "exitcode  : 2" in err and reason in err.split("Root Cause")[-1], err[-3000:]
    assert "To enable traceback see" not in err.split("Root Cause")[-1], err[-3000:]
