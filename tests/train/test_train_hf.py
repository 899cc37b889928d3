"""The trainer with ``--hf-model``: a transformers checkpoint trained under Ulysses + FSDP2.

A small random-init Llama saved locally with ``save_pretrained`` and a BPE tokenizer trained
locally with ``tokenizers`` (``tests/hf_workers.py``; no downloads), on chat and text JSONL:

* ``--hf-model`` at sp=4 (dp=1), sp=1 (dp=4) and sp=2 (dp=2) gives the same losses and the same
  held-out loss (``--eval-data``, ``--eval-every``);
* ``--save-hf`` then ``AutoModelForCausalLM.from_pretrained`` gives the logits of the trained
  FSDP2 model, and the trainer's held-out loss;
* 3 steps straight equal 2 steps + 1 resumed from the checkpoint;
* every bad input is one ``error:`` line from rank 0, a non-zero exit, and nothing written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from dtensor_ulysses import train as du_train  # noqa: E402
from dtensor_ulysses.launch import run_local_world  # noqa: E402
from dtensor_ulysses.train import checkpoint as ckpt  # noqa: E402
from dtensor_ulysses.train.inputs import hf_shape  # noqa: E402
from tests import hf_workers as W  # noqa: E402
from tests.hf.test_hf import TEXT  # noqa: E402
from tests.train import hf_train_workers  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
S, G = 19, 4  # uneven over sp=4 ([5, 5, 5, 4])


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_train")
    model = W.save_model("llama", root / "llama")
    tok = W.make_tokenizer(root / "tokenizer", TEXT)
    tok.save_pretrained(model)  # --tokenizer defaults to the model's directory
    chat = root / "chat.jsonl"
    convs = [
        [{"role": "user", "content": "the quick brown fox"},
         {"role": "assistant", "content": "jumps over the lazy dog"}],
        [{"role": "user", "content": "a long context model"},
         {"role": "assistant", "content": "reads every token"},
         {"role": "user", "content": "sequence parallel attention"},
         {"role": "assistant", "content": "splits the sequence over ranks"}],
    ] * 8  # fmt: skip
    chat.write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs))
    text = root / "text.jsonl"
    text.write_text("".join(json.dumps({"text": TEXT[i * 250 : (i + 1) * 250]}) + "\n"
                            for i in range(6)))  # fmt: skip
    heldout = root / "heldout.txt"
    heldout.write_text(TEXT[3000:4500])
    return {"root": root, "model": str(model), "tok": str(root / "tokenizer"),
            "data": [str(chat), str(text)], "eval": [str(heldout)]}  # fmt: skip


@pytest.fixture(scope="module")
def world4(assets):
    base = dict(hf_model=assets["model"], data=assets["data"], eval_data=assets["eval"],
                seq_len=S, batch_size=G, lr=1e-2, warmup_steps=1, decay_steps=10,
                attention_backend="sdpa", steps=3)  # fmt: skip
    saved, ck = assets["root"] / "saved", assets["root"] / "ck"
    runs = [
        dict(base, dp=1, sp=4, eval_every=2, save_hf=str(saved), probe=True),
        dict(base, dp=4, sp=1, eval_every=2),
        dict(base, dp=2, sp=2),  # (dp, ring, sp) = (2, 1, 2): evaluated after the last step
        dict(base, dp=2, sp=2, eval_data=None, steps=2, checkpoint_dir=str(ck)),
        dict(base, dp=2, sp=2, eval_data=None, checkpoint_dir=str(ck), resume=True),
    ]
    results = run_local_world(hf_train_workers.train_runs, 4, runs, timeout_s=240)
    return {"ranks": results, "saved": saved, "ck": ck}


def _losses(records):
    return [(r["step"], r["loss"]) for r in records]


@pytest.mark.timeout(300)
def test_sp4_sp1_and_sp2_give_the_same_losses_and_eval(world4):
    sp4, sp1, sp2 = (world4["ranks"][0][i]["records"] for i in range(3))
    assert [s for s, _ in _losses(sp4)] == [1, 2, 3]
    for a, b, c in zip(sp4, sp1, sp2):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["loss"] == pytest.approx(c["loss"], rel=1e-5)
        assert a["tokens"] == b["tokens"] == c["tokens"]
    assert sp4[-1]["loss"] < sp4[0]["loss"], "a few steps at lr 1e-2 should lower the loss"
    # --eval-every 2 and at the end; none in between
    assert ["eval_loss" in r for r in sp4] == [False, True, True]
    for a, b in zip(sp4, sp1):
        if "eval_loss" in a:
            assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5)
            assert a["eval_tokens"] == b["eval_tokens"] > 0
    # dp=2 x sp=2 evaluates once, at the end, as sp=4 (equal to one process: the test below)
    assert ["eval_loss" in r for r in sp2] == [False, False, True]
    assert sp2[-1]["eval_loss"] == pytest.approx(sp4[-1]["eval_loss"], rel=1e-5)
    assert sp2[-1]["eval_tokens"] == sp4[-1]["eval_tokens"]
    for rank_runs in world4["ranks"]:  # every rank returns the same records
        assert _losses(rank_runs[0]["records"]) == _losses(sp4)


@pytest.mark.timeout(300)
def test_sp2_eval_equals_sp4(assets, world4):
    """(dp, ring, sp) = (1, 1, 2): the held-out loss after every second step and the last equals
    sp=4's (itself equal to one process, see the ``from_pretrained`` test below)."""
    base = dict(hf_model=assets["model"], data=assets["data"], eval_data=assets["eval"],
                seq_len=S, batch_size=G, lr=1e-2, warmup_steps=1, decay_steps=10,
                attention_backend="sdpa", steps=3, dp=1, sp=2, eval_every=2)  # fmt: skip
    sp2 = run_local_world(hf_train_workers.train_runs, 2, [base], timeout_s=240)[0][0]["records"]
    sp4 = world4["ranks"][0][0]["records"]
    assert ["eval_loss" in r for r in sp2] == [False, True, True]
    for a, b in zip(sp2, sp4):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        if "eval_loss" in a:
            assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5)
            assert a["eval_tokens"] == b["eval_tokens"] > 0


@pytest.mark.timeout(300)
def test_resume_equals_straight_run(world4):
    runs = world4["ranks"][0]
    straight, first, resumed = (_losses(runs[i]["records"]) for i in (2, 3, 4))
    assert (world4["ck"] / "step_00000002").is_dir()
    assert first + resumed == straight, "resumed losses differ from the straight run"
    meta = ckpt.read_meta(world4["ck"] / "step_00000003")["meta"]
    assert "shape" not in meta and meta["hf_model"]["architectures"] == ["LlamaForCausalLM"]
    assert len(meta["hf_model"]["config_sha256"]) == 64 and meta["tokenizer_sha256"]


@pytest.mark.timeout(300)
def test_save_hf_then_from_pretrained_gives_the_trained_logits_and_eval(assets, world4):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dtensor_ulysses import hf

    saved = world4["saved"]
    assert not [p for p in saved.parent.iterdir() if p.name.startswith(".saved.")], "temp left"
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    model.config.use_cache = False
    ids, _, _, _ = W.global_batch(packed=False)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    for rank_runs in world4["ranks"]:
        rows, (lo, hi), got = rank_runs[0]["probe"]
        torch.testing.assert_close(got, logits[rows, lo:hi], rtol=1e-4, atol=1e-5)
    # the tokenizer is saved beside it, and the trainer's final eval is this model's
    tok = AutoTokenizer.from_pretrained(saved)
    assert len(tok) == len(hf.load_tokenizer(assets["tok"]))
    corpus = hf.load_corpus(assets["eval"], tok, S)
    total, count = 0.0, 0
    with torch.no_grad():
        for k in range(len(corpus) // G):
            x, y, _, _ = corpus.full_batch(range(k * G, (k + 1) * G), pack_docs=False)
            out = model(input_ids=x).logits
            total += F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum").item()
            count += int((y != -100).sum())
    final = world4["ranks"][0][0]["records"][-1]
    assert final["eval_tokens"] == count
    assert final["eval_loss"] == pytest.approx(total / count, rel=1e-5)


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bad_dirs(assets):
    import transformers as tf

    root = assets["root"] / "bad"
    root.mkdir()
    (root / "no_config").mkdir()
    (root / "no_weights").mkdir()
    shutil.copy(Path(assets["model"]) / "config.json", root / "no_weights")
    mismatch = root / "mismatch"  # the weights of the llama, a config with another MLP size
    shutil.copytree(assets["model"], mismatch)
    cfg = json.loads((mismatch / "config.json").read_text())
    (mismatch / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=48)))
    torch.manual_seed(0)
    small = tf.LlamaForCausalLM(tf.LlamaConfig(**dict(W.SMALL, vocab_size=64)))
    small.save_pretrained(root / "small_vocab")  # 64 rows < the tokenizer's 90 tokens
    W.save_model("gemma3_bidirectional", root / "gemma3_bidirectional")
    broken = root / "broken_json"  # a config.json cut short (an interrupted copy)
    shutil.copytree(assets["model"], broken)
    (broken / "config.json").write_text((broken / "config.json").read_text()[:40])
    return root


def _main(monkeypatch, capsys, argv, world_size=1):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # never used: validation fails first
    code = du_train.main(argv)
    return code, capsys.readouterr().err


BAD = [
    (["--model", "tiny"], "{model}", 1, r"--hf-model and --model are exclusive"),
    ([], "{bad}/no_config", 1, r"has no config\.json"),
    ([], "{bad}/nowhere", 1, r"does not exist"),
    ([], "{bad}/no_weights", 1, r"has no safetensors weights"),
    ([], "{bad}/mismatch", 1,
     r"do not match its config\.json .*gate_proj\.weight \(64, 32\) \(config: \(48, 32\)\)"),
    (["--tokenizer", "{tok}"], "{bad}/small_vocab", 1,
     r"the tokenizer has 90 tokens but the model's embedding has 64 rows"),
    (["--tokenizer", "{tok}"], "{bad}/gemma3_bidirectional", 1,
     r"Gemma3ForCausalLM .*model\.layers\.0\.self_attn.*bidirectional \(non-causal\)"),
    (["--sp", "3"], "{model}", 3,
     r"4 q heads of llama are not divisible by sp=3; .*--allow-uneven-heads"),
    (["--tiled-mlp"], "{model}", 1, r"--tiled-mlp applies to the built-in model only"),
    ([], "{bad}/broken_json", 1,
     r"--hf-model '.*broken_json': its config\.json is not valid JSON \(line \d+, column \d+"),
    (["--compile", "nosuchbackend"], "{model}", 1,
     r"--compile nosuchbackend: torch\.compile has no backend of that name; use one of"),
    (["--eval-data", "{root}/none.txt"], "{model}", 1, r"--eval-data: .*none\.txt"),
]  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra, model, world, pattern", BAD, ids=[b[3][:30] for b in BAD])
def test_bad_input_one_error_line_nothing_written(
    assets, bad_dirs, tmp_path, monkeypatch, capsys, extra, model, world, pattern
):
    import re

    def fill(a):
        return a.format(model=assets["model"], bad=bad_dirs, tok=assets["tok"],
                        root=assets["root"])  # fmt: skip

    out = tmp_path / "out"
    argv = ["--hf-model", fill(model), *map(fill, extra), "--data", *assets["data"],
            "--seq-len", str(S), "--batch-size", str(G), "--steps", "1",
            "--checkpoint-dir", str(out / "ck"), "--save-hf", str(out / "hf"),
            "--metrics-file", str(out / "m.jsonl")]  # fmt: skip
    code, err = _main(monkeypatch, capsys, argv, world)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1, err
    assert re.search(pattern, errors[0]), errors[0]
    assert not out.exists(), "a refused run wrote to its output directory"


@pytest.mark.timeout(120)
def test_what_a_new_user_gets_wrong_with_hf_model(assets, tmp_path, capsys, monkeypatch):
    """Chat JSONL without an assistant turn: one error naming the fix (it used to fail inside
    step 1). Another model's tokenizer (ids that differ from the model's own) and a --seq-len
    past max_position_embeddings: one warning line each, before anything is built."""
    from dtensor_ulysses.train import validate
    from dtensor_ulysses.train.cli import TrainConfig, UsageError

    monkeypatch.setenv("RANK", "0")
    base = dict(hf_model=assets["model"], data=assets["data"], seq_len=S, batch_size=G, steps=1,
                device="cpu", sp=1)  # fmt: skip
    chat = tmp_path / "no_assistant.jsonl"
    turns = [[{"role": "user", "content": TEXT[i : i + 80]}] for i in range(0, 2000, 80)]
    chat.write_text("".join(json.dumps({"messages": m}) + "\n" for m in turns))
    no_target = r"has no token to learn: chat records are trained on their assistant turns only"
    with pytest.raises(UsageError, match=no_target):
        validate(TrainConfig(**{**base, "data": [str(chat)]}), 1)
    capsys.readouterr()
    short = tmp_path / "short_ctx"  # the same model, configured for 16 positions
    shutil.copytree(assets["model"], short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=16)))
    other = W.make_tokenizer(tmp_path / "other_tok", TEXT[::-1], vocab_size=80)
    assert len(other) <= config["vocab_size"]  # fits the embedding: not refused, but wrong
    validate(
        TrainConfig(**{**base, "hf_model": str(short), "tokenizer": str(tmp_path / "other_tok")}), 1
    )
    warnings = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning: ")]
    assert any(re.search(rf"--seq-len {S} is longer than the 16 positions short_ctx was "
                         r"configured for", w) for w in warnings), warnings  # fmt: skip
    assert any(re.search(r"--tokenizer '.*other_tok' gives \d+ of its \d+ tokens other ids than "
                         r"the model's own tokenizer", w) for w in warnings), warnings  # fmt: skip
    assert len(warnings) == 2, warnings
    validate(TrainConfig(**base), 1)  # the model's own tokenizer, within its positions: silent
    assert "warning:" not in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_save_hf_and_tokenizer_need_hf_model(monkeypatch, capsys, tmp_path):
    for flag in ("--save-hf", "--tokenizer"):
        code, err = _main(monkeypatch, capsys, [flag, str(tmp_path / "x"), "--steps", "1"])
        assert code == 2 and f"error: {flag} applies to --hf-model only" in err
    code, err = _main(monkeypatch, capsys, ["--eval-every", "2", "--steps", "1"])
    assert code == 2 and "error: --eval-every needs --eval-data" in err


@pytest.mark.timeout(200)
def test_bad_input_under_torchrun_rank0_speaks_once(assets, bad_dirs, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "dtensor_ulysses.train", "--hf-model", str(bad_dirs / "small_vocab"),
           "--tokenizer", assets["tok"], "--data", *assets["data"], "--seq-len", str(S),
           "--batch-size", str(G), "--steps", "1", "--save-hf", str(out / "hf")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert res.returncode != 0 and len(errors) == 1, res.stderr[-3000:]
    assert "embedding has 64 rows" in errors[0]
    assert "dtensor_ulysses/" not in res.stderr, "a worker traceback leaked"
    # every rank leaves promptly: none ignores torchrun's SIGTERM until its SIGKILL
    assert "via 9" not in res.stderr and not re.search(r"exitcode\s*: -9", res.stderr)
    assert not out.exists()


@pytest.mark.timeout(120)
def test_resume_with_another_model_is_refused(assets, world4, monkeypatch, capsys):
    other = assets["root"] / "other_llama"  # the same weights and tokenizer, another config
    shutil.copytree(assets["model"], other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(cfg, rms_norm_eps=1e-5)))
    common = ["--seq-len", str(S), "--batch-size", str(G), "--steps", "4", "--dp", "2",
              "--sp", "2", "--resume", "--checkpoint-dir", str(world4["ck"])]  # fmt: skip
    argv = ["--hf-model", str(other), "--data", *assets["data"], *common]
    code, err = _main(monkeypatch, capsys, argv, 4)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1, err
    assert "whose config.json differs" in errors[0]
    code, err = _main(monkeypatch, capsys,
                      ["--model", "tiny", "--data", assets["data"][1], *common], 4)  # fmt: skip
    assert code == 2 and "holds --hf-model" in err and "builds model 'tiny'" in err, err


@pytest.mark.timeout(120)
def test_preflight_uses_the_config_shape(assets, monkeypatch, capsys, tmp_path):
    from transformers import AutoModelForCausalLM

    from dtensor_ulysses.plan import CAPACITY_ENV

    shape = hf_shape(assets["model"])
    assert shape is not None
    assert (shape.n_layers, shape.dim, shape.n_heads, shape.n_kv_heads, shape.head_dim) == (
        2, 32, 4, 2, 8,
    )  # fmt: skip
    hf_model = AutoModelForCausalLM.from_pretrained(assets["model"])
    assert shape.n_params == sum(p.numel() for p in hf_model.parameters())
    monkeypatch.setenv(CAPACITY_ENV, "1MiB")
    out = tmp_path / "out"
    argv = ["--hf-model", assets["model"], "--data", *assets["data"], "--seq-len", str(S),
            "--steps", "1", "--batch-size", str(G), "--save-hf", str(out)]  # fmt: skip
    code, err = _main(monkeypatch, capsys, argv)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "memory preflight" in errors[0], err
    assert not out.exists()
