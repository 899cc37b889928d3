"""A tiny random-init Llama and a BPE tokenizer trained on the spot, for the CPU examples
(no downloads; the same on every rank: seeded, built in memory)."""

from __future__ import annotations

import torch

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "a long context model reads every token of the sequence",
    "sequence parallel attention splits the sequence over ranks",
    "the heads inside attention are split too",
    "every token counts in the loss of a long context model",
    "ranks hold slices of the sequence and all heads of it",
] * 8
CHATS = [
    [{"role": "user", "content": "the quick fox"},
     {"role": "assistant", "content": "jumps over the lazy dog"}],
    [{"role": "user", "content": "a long context"},
     {"role": "assistant", "content": "model reads every token"}],
] * 16  # fmt: skip
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
    "{{ m['content'] }}<|end|>{% endgeneration %}{% else %}<|user|>{{ m['content'] }}<|end|>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_model_and_tokenizer(model_dir: str | None = None, extra_words: tuple | list = ()):
    """``(model, tokenizer)``: from ``model_dir`` (a local directory), else built here (the
    tokenizer also learns ``extra_words``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_dir:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), (
            AutoTokenizer.from_pretrained(model_dir)
        )
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(
        [" ".join([*TEXTS, *extra_words])],
        trainers.BpeTrainer(vocab_size=90, special_tokens=specials),
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<unk>", additional_special_tokens=specials[3:],
    )  # fmt: skip
    tok.chat_template = CHAT_TEMPLATE
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), tok
