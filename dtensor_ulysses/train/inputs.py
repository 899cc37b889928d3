"""The ``--hf-model`` inputs, checked before any process group exists and cached per process
for the run: the directory (config, weights, architecture), the tokenizer, and the shape the
memory preflight reads; and the check that ``--eval-data`` holds a global batch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from dtensor_ulysses.plan import ModelShape, check_sp_for_heads
from dtensor_ulysses.train.cli import TrainConfig, UsageError, _warn

__all__ = ["check_eval_corpus", "hf_dir", "hf_shape", "run_tokenizer", "validate_hf"]

_TOKENIZERS: dict[str, object] = {}  # tokenizer directory -> the one loaded by validate()


def hf_dir(cfg: TrainConfig) -> str:
    """The ``--hf-model`` directory, absolute."""
    assert cfg.hf_model is not None
    return os.path.abspath(cfg.hf_model)


def _tokenizer_dir(cfg: TrainConfig) -> str:
    return os.path.abspath(cfg.tokenizer or hf_dir(cfg))


def run_tokenizer(cfg: TrainConfig) -> Any:
    """The run's tokenizer, loaded once per process (the corpus cache is keyed on it)."""
    key = _tokenizer_dir(cfg)
    if key not in _TOKENIZERS:
        from dtensor_ulysses.hf import load_tokenizer

        _TOKENIZERS[key] = load_tokenizer(key)
    return _TOKENIZERS[key]


def validate_hf(cfg: TrainConfig) -> ModelShape | None:
    """``--hf-model``: the directory, weights, architecture, heads and tokenizer, each refused
    with one message; returns the config's shape for the preflight (None if not Llama-style)."""
    assert cfg.sp is not None
    try:
        from dtensor_ulysses.hf.models.pretrained import check_weights
    except ImportError as e:
        raise UsageError(f"--hf-model: {e}") from None
    if cfg.save_hf is not None:
        out, src = Path(cfg.save_hf).resolve(), Path(hf_dir(cfg))
        if out == src or out in src.parents:
            raise UsageError(
                f"--save-hf {cfg.save_hf!r} would replace the --hf-model directory it is trained "
                f"from; write to another directory"
            )
    try:
        tokenizer = _load_and_check(cfg)
        check_weights(hf_dir(cfg))
    except ValueError as e:
        raise UsageError(str(e)) from None
    _TOKENIZERS[_tokenizer_dir(cfg)] = tokenizer
    return hf_shape(hf_dir(cfg))


def hf_shape(directory: str) -> ModelShape | None:
    """The :class:`ModelShape` of a transformers config (for the memory preflight), or None
    when the config lacks a Llama-style field."""
    from transformers import AutoConfig

    from dtensor_ulysses.hf.models.causal_lm import config_head_dim

    c = AutoConfig.from_pretrained(directory).get_text_config()
    try:
        n_heads = int(c.num_attention_heads)
        dim = int(c.hidden_size)
        return ModelShape(
            name=Path(directory).name,
            n_layers=int(c.num_hidden_layers),
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=int(getattr(c, "num_key_value_heads", None) or n_heads),
            head_dim=config_head_dim(c),
            ffn_dim=int(c.intermediate_size),
            vocab_size=int(c.vocab_size),
            tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            qk_norm=getattr(c, "model_type", "") in ("qwen3",),
        )
    except (AttributeError, TypeError, ValueError):
        return None


def check_eval_corpus(cfg: TrainConfig, corpus: Any) -> None:
    """``--eval-data`` holds at least one global batch of windows.

    Raises:
        ValueError: fewer windows than ``--batch-size``.
    """
    if len(corpus) < cfg.batch_size:
        raise ValueError(
            f"--eval-data holds {len(corpus)} windows of {cfg.seq_len} tokens, fewer than one "
            f"global batch of {cfg.batch_size}; add held-out data or shorten --seq-len"
        )


def _load_and_check(cfg: TrainConfig) -> Any:
    """The trainer's checks of ``--hf-model`` / ``--tokenizer`` before any process group exists
    (rank 0 prints them as one ``error:`` line); returns the tokenizer.

    Raises:
        ValueError: no such directory, no config.json or weights, an unsupported architecture
            (naming the layer and feature), heads not divisible by sp, a tokenizer larger than
            the embedding.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from dtensor_ulysses.hf import check_model_dir, check_tokenizer, load_tokenizer
    from dtensor_ulysses.hf.models.routing import check_supported

    assert cfg.hf_model is not None and cfg.sp is not None
    path = check_model_dir(cfg.hf_model)
    try:
        json.loads((path / "config.json").read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        where = ""
        if isinstance(e, json.JSONDecodeError):
            where = f" (line {e.lineno}, column {e.colno}: {e.msg})"
        raise ValueError(
            f"--hf-model {str(path)!r}: its config.json is not valid JSON{where}; repair it or "
            f"copy the model's original config.json"
        ) from None
    config = AutoConfig.from_pretrained(path)
    text = config.get_text_config()
    limit = getattr(text, "max_position_embeddings", None)
    if isinstance(limit, int) and cfg.seq_len > limit:
        _warn(
            f"--seq-len {cfg.seq_len} is longer than the {limit} positions {path.name} was "
            f"configured for (max_position_embeddings in its config.json): its position "
            f"encoding was not trained that far (use --seq-len <= {limit}, or a model or "
            f"rope scaling made for the length)"
        )
    with torch.device("meta"):
        check_supported(AutoModelForCausalLM.from_config(config))
    check_sp_for_heads(
        config.get_text_config().num_attention_heads, cfg.sp, what=f"q heads of {path.name}",
        allow_uneven=cfg.allow_uneven_heads, uneven_option="--allow-uneven-heads",
    )  # fmt: skip
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.hf_model)
    check_tokenizer(tokenizer, config)
    _warn_other_tokenizer(cfg, tokenizer, text.vocab_size)
    return tokenizer


def _warn_other_tokenizer(cfg: TrainConfig, tokenizer: Any, rows: int) -> None:
    """``--tokenizer`` from elsewhere than the model: warn when its ids differ from those of the
    model's own tokenizer (or, without one, when its size differs from the embedding's)."""
    assert cfg.hf_model is not None
    if not cfg.tokenizer or Path(cfg.tokenizer).resolve() == Path(cfg.hf_model).resolve():
        return
    from dtensor_ulysses.hf import load_tokenizer

    own_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if any((Path(cfg.hf_model) / f).is_file() for f in own_files):
        try:
            own = load_tokenizer(cfg.hf_model).get_vocab()
        except (OSError, ValueError):
            own = None
        if own is not None:
            theirs = tokenizer.get_vocab()
            moved = sum(1 for tok, i in theirs.items() if own.get(tok) != i)
            if moved:
                _warn(
                    f"--tokenizer {cfg.tokenizer!r} gives {moved} of its {len(theirs)} tokens "
                    f"other ids than the model's own tokenizer in {cfg.hf_model!r}: the model "
                    f"would read other tokens than it was trained on; drop --tokenizer to use "
                    f"the model's own"
                )
            return
    if len(tokenizer) != rows:
        _warn(
            f"--tokenizer {cfg.tokenizer!r} has {len(tokenizer)} tokens and the model's "
            f"embedding {rows} rows: if it is not the tokenizer the model was trained with, "
            f"its ids mean other tokens to the model"
        )
