"""transformers models under Ulysses + FSDP2 (``du.hf``) equal the same model on one process.

Small random-init Llama, Qwen2 (q/k/v bias, tied embeddings), Qwen3 (q/k norm) and Mistral (no
sliding window) configs are saved locally (no downloads). For (dp, sp) in {(1,2), (2,2), (1,4)},
with uneven S (19) and GQA with sp > kv heads: the step-1 loss and every gradient, and three steps
of losses, equal plain single-process training with transformers' stock attention; packed
documents equal each document run on its own. Also: refused architectures, the first-step guard,
the plain ``apply_ulysses`` path, save/load round trip, a locally trained BPE tokenizer with a chat
template, and evaluation under sp.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from dtensor_ulysses.launch import run_local_world  # noqa: E402
from tests import hf_workers as W  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-6)
TEXT = (
    "the quick brown fox jumps over the lazy dog. a long context model reads every token. "
    "sequence parallel attention splits the sequence over ranks and the heads inside attention. "
) * 40


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    refused = ("llama_dropout", "gemma3_bidirectional")
    dirs = {a: str(W.save_model(a, root / a)) for a in (*W.SUPPORTED, *refused)}
    tok_dir = root / "tokenizer"
    W.make_tokenizer(tok_dir, TEXT)
    chat = root / "chat.jsonl"
    convs = [
        [{"role": "user", "content": "the quick fox"}, {"role": "assistant", "content": "jumps"}],
        [{"role": "user", "content": "a long context"}, {"role": "assistant", "content": "model"},
         {"role": "user", "content": "reads every"}, {"role": "assistant", "content": "token"}],
    ] * 6  # fmt: skip
    chat.write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs))
    text = root / "text.jsonl"
    text.write_text(json.dumps({"text": TEXT[:400]}) + "\n")
    data = {"chat": str(chat), "text": str(text)}
    return {"root": root, "dirs": dirs, "tok_dir": str(tok_dir), "data": data}


@pytest.fixture(scope="module")
def references(assets):
    return {
        (arch, packed): W.reference_three_steps(assets["dirs"][arch], packed)
        for arch in W.SUPPORTED
        for packed in (False, True)
    }


@pytest.fixture(scope="module")
def world2(assets):
    dirs = {a: assets["dirs"][a] for a in W.SUPPORTED}
    out = assets["root"] / "saved"
    runs = run_local_world(W.run_jobs, 2, [
        ("train_three_steps", (dirs, [(1, 2)], False, {})),
        ("train_three_steps", (dirs, [(1, 2)], True, {})),
        ("hf_features", (assets["dirs"], str(out), assets["tok_dir"], assets["data"])),
    ], timeout_s=300)  # fmt: skip
    return {
        "plain": runs[0][0],
        "packed": runs[0][1],
        "features": [r[2] for r in runs],
        "saved": str(out),
    }


@pytest.fixture(scope="module")
def world4(assets):
    dirs = {a: assets["dirs"][a] for a in W.SUPPORTED}
    runs = run_local_world(W.run_jobs, 4, [
        ("train_three_steps", (dirs, [(2, 2)], False, {})),
        ("train_three_steps", (dirs, [(1, 4)], True, {})),
    ], timeout_s=300)  # fmt: skip
    return {"plain": runs[0][0], "packed": runs[0][1]}


def _check(result, ref):
    assert result["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert set(result["grads"]) == set(ref["grads"])
    for name, g in ref["grads"].items():
        torch.testing.assert_close(result["grads"][name], g, **TOL, msg=name)


@pytest.mark.parametrize("arch", W.SUPPORTED)
@pytest.mark.parametrize("packed", [False, True], ids=["padded-free", "packed"])
def test_sp2_equals_single_device(world2, references, arch, packed):
    _check(world2["packed" if packed else "plain"][(arch, 1, 2)], references[(arch, packed)])


@pytest.mark.parametrize("arch", W.SUPPORTED)
def test_dp2_sp2_and_sp4_equal_single_device(world4, references, arch):
    _check(world4["plain"][(arch, 2, 2)], references[(arch, False)])
    _check(world4["packed"][(arch, 1, 4)], references[(arch, True)])  # 4 ranks > 2 kv heads


def test_refused_architectures_name_layer_and_feature(world2):
    refused = world2["features"][0]["refused"]
    assert "model.layers.0.self_attn" in refused["llama_dropout"]
    assert "attention dropout (attention_dropout=0.1" in refused["llama_dropout"]
    bidi = refused["gemma3_bidirectional"]
    assert "bidirectional (non-causal) attention" in bidi and "model.layers.1.self_attn" in bidi


def test_dropout_on_slices_is_said_once_from_rank_0(world2):
    """A LoRA adapter's dropout runs with masks drawn per slice: ``hf.parallelize`` says so in
    one warning on rank 0 (naming the modules and the fix); without dropout, nothing."""
    ranks = [f["dropout_warnings"] for f in world2["features"]]
    (said,) = ranks[0][0.05]
    assert "lora_dropout.default p=0.05" in said and "and 2 more" in said, said
    assert "not bit for bit" in said and "--lora_dropout 0" in said, said
    assert ranks[1][0.05] == [] and ranks[0][0.0] == [] == ranks[1][0.0]


def test_sliced_dropout_finds_modules_and_config_keys():
    """The detector: ``nn.Dropout`` modules with ``p > 0`` and a config's hidden-dropout keys
    (GPT-2's ``resid_pdrop`` / ``embd_pdrop``); nothing once TRL's ``disable_dropout_in_model``
    (``disable_dropout=True``) has set the modules to 0 and the config has none."""
    import transformers as tf
    from trl.trainer.utils import disable_dropout_in_model

    from dtensor_ulysses.hf.models.routing import sliced_dropout

    cfg = tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, attn_pdrop=0.0)
    gpt2 = tf.GPT2LMHeadModel(cfg)
    said = sliced_dropout(gpt2, gpt2)
    assert said is not None and "transformer.drop p=0.1" in said, said
    assert "config.resid_pdrop p=0.1" in said or "more" in said, said
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(**W.SMALL))
    assert sliced_dropout(llama, llama) is None
    cfg = tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, attn_pdrop=0.0,
                        resid_pdrop=0.0, embd_pdrop=0.0, summary_first_dropout=0.0)  # fmt: skip
    quiet = tf.GPT2LMHeadModel(cfg)
    assert sliced_dropout(quiet, quiet) is None
    disable_dropout_in_model(gpt2)
    said = sliced_dropout(gpt2, gpt2)  # the modules are off; the config keys still say 0.1
    assert said is not None and "transformer.drop" not in said and "config.resid_pdrop" in said


def test_guard_names_the_unrouted_layer(world2):
    msg = world2["features"][0]["guard"]
    assert msg.startswith("1 of 2 attention layers") and "model.layers.1.self_attn" in msg
    assert "model.layers.0" not in msg


def test_plain_apply_ulysses_path_gives_the_single_device_slice(assets, world2):
    from transformers import AutoModelForCausalLM

    ids, _, pos, _ = W.global_batch(packed=True)
    model = AutoModelForCausalLM.from_pretrained(assets["dirs"]["llama"], dtype=torch.float32)
    model.config.use_cache = False  # with a cache, transformers ignores packed position ids
    with torch.no_grad():
        full = model(input_ids=ids).logits
        packed = model(input_ids=ids, position_ids=pos).logits  # HF's own packed-sequence mask
    for rank_result in world2["features"]:
        lo, hi = rank_result["slice"]
        torch.testing.assert_close(rank_result["plain"], full[:, lo:hi], **TOL)
        torch.testing.assert_close(rank_result["plain_packed"], packed[:, lo:hi], **TOL)


def test_save_then_from_pretrained_gives_the_trained_logits(world2):
    from transformers import AutoModelForCausalLM

    ids, _, pos, _ = W.global_batch(packed=True)
    model = AutoModelForCausalLM.from_pretrained(world2["saved"], dtype=torch.float32)
    assert model.config._attn_implementation != "du_ulysses"
    model.config.use_cache = False
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos).logits
    for rank_result in world2["features"]:
        lo, hi = rank_result["slice"]
        torch.testing.assert_close(rank_result["trained_logits"], logits[:, lo:hi], **TOL)


def test_chat_and_text_evaluation_under_sp_equals_one_process(assets, world2):
    from transformers import AutoModelForCausalLM

    from dtensor_ulysses import hf

    tok = hf.load_tokenizer(assets["tok_dir"])
    corpus = hf.load_corpus([assets["data"]["chat"], assets["data"]["text"]], tok, 16)
    model = AutoModelForCausalLM.from_pretrained(world2["saved"], dtype=torch.float32)
    model.config.use_cache = False
    total, count = 0.0, 0
    with torch.no_grad():
        for k in range(len(corpus) // 2):
            ids, labels, pos, _ = corpus.full_batch([2 * k, 2 * k + 1], pack_docs=True)
            logits = model(input_ids=ids, position_ids=pos).logits
            total += F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").item()
            count += int((labels != -100).sum())
    for rank_result in world2["features"]:
        assert rank_result["eval"]["tokens"] == count
        assert rank_result["eval"]["loss"] == pytest.approx(total / count, rel=1e-5)


def test_chat_template_targets_assistant_tokens_only(assets):
    from dtensor_ulysses import hf

    tok = hf.load_tokenizer(assets["tok_dir"])
    msgs = [
        {"role": "user", "content": "the quick fox"},
        {"role": "assistant", "content": "jumps"},
        {"role": "user", "content": "reads"},
        {"role": "assistant", "content": "every token"},
    ]
    ids, mask = hf.encode_chat(tok, msgs)
    said = tok.decode([t for t, m in zip(ids, mask) if m])
    assert said.replace(" ", "") == "jumps<|end|>everytoken<|end|>"
    tok.chat_template = tok.chat_template.replace("{% generation %}", "").replace(
        "{% endgeneration %}", ""
    )  # no markers: found from the template's prefixes instead
    assert hf.encode_chat(tok, msgs) == (ids, mask)
    corpus = hf.load_corpus([assets["data"]["chat"]], tok, 8)
    targets = corpus.ids[corpus.target]
    assert set(tok.convert_ids_to_tokens(targets.tolist())) <= set(
        tok.convert_ids_to_tokens(tok("jumps model token <|end|>")["input_ids"])
    )


def test_tokenizer_larger_than_embedding_is_refused(assets):
    from transformers import AutoConfig

    from dtensor_ulysses import hf

    tok = hf.load_tokenizer(assets["tok_dir"])
    cfg = AutoConfig.from_pretrained(assets["dirs"]["llama"])
    hf.check_tokenizer(tok, cfg)
    cfg.vocab_size = len(tok) - 1
    with pytest.raises(ValueError, match="embedding has"):
        hf.check_tokenizer(tok, cfg)


def test_bad_model_directories(tmp_path, assets):
    from dtensor_ulysses.hf import check_model_dir

    with pytest.raises(ValueError, match="does not exist"):
        check_model_dir(tmp_path / "nope")
    with pytest.raises(ValueError, match="no config.json"):
        check_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no safetensors"):
        check_model_dir(tmp_path)
