"""The trainer's inputs, read while validating and cached per process for the run: the
``--hf-model`` directory (config, weights, tokenizer; each checked before any process group
exists) and the training and evaluation corpora of either model.

Used by :mod:`dtensor_ulysses._train_checks` (``validate``), :mod:`dtensor_ulysses._train_resume`
(what a checkpoint records) and :mod:`dtensor_ulysses.train` (the loop).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from dtensor_ulysses._train_cli import TrainConfig, UsageError
from dtensor_ulysses.data import PackedCorpus
from dtensor_ulysses.presets import ModelShape

_TOKENIZERS: dict[str, object] = {}  # tokenizer directory -> the one loaded by validate()


def _hf_dir(cfg: TrainConfig) -> str:
    assert cfg.hf_model is not None
    return os.path.abspath(cfg.hf_model)


def _tokenizer_dir(cfg: TrainConfig) -> str:
    return os.path.abspath(cfg.tokenizer or _hf_dir(cfg))


def _tokenizer(cfg: TrainConfig):
    """The run's tokenizer, loaded once per process (the corpus cache is keyed on it)."""
    key = _tokenizer_dir(cfg)
    if key not in _TOKENIZERS:
        from dtensor_ulysses.hf.model import load_tokenizer

        _TOKENIZERS[key] = load_tokenizer(key)
    return _TOKENIZERS[key]


def _validate_hf(cfg: TrainConfig) -> ModelShape | None:
    """``--hf-model``: the directory, weights, architecture, heads and tokenizer, each refused
    with one message; returns the config's shape for the preflight (None if not Llama-style)."""
    assert cfg.sp is not None
    try:
        from dtensor_ulysses.hf.model import validate_config
    except ImportError as e:
        raise UsageError(f"--hf-model: {e}") from None
    if cfg.tiled_mlp:
        raise UsageError("--tiled-mlp applies to the built-in model only, not to --hf-model")
    if cfg.save_hf is not None:
        out, src = Path(cfg.save_hf).resolve(), Path(_hf_dir(cfg))
        if out == src or out in src.parents:
            raise UsageError(
                f"--save-hf {cfg.save_hf!r} would replace the --hf-model directory it is trained "
                f"from; write to another directory"
            )
    try:
        tokenizer = validate_config(cfg)
        _check_weights_match(Path(_hf_dir(cfg)))
    except ValueError as e:
        msg = str(e)
        if "not divisible by sp" in msg and not cfg.allow_uneven_heads:
            msg += " (or pass --allow-uneven-heads to accept a load imbalance)"
        raise UsageError(msg) from None
    _TOKENIZERS[_tokenizer_dir(cfg)] = tokenizer
    return _hf_shape(_hf_dir(cfg))


def _hf_config(directory: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory)


def _hf_shape(directory: str) -> ModelShape | None:
    """The :class:`ModelShape` of a transformers config (for the memory preflight), or None
    when the config lacks a Llama-style field."""
    c = _hf_config(directory).get_text_config()
    try:
        n_heads = int(c.num_attention_heads)
        dim = int(c.hidden_size)
        return ModelShape(
            name=Path(directory).name,
            n_layers=int(c.num_hidden_layers),
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=int(getattr(c, "num_key_value_heads", None) or n_heads),
            head_dim=int(getattr(c, "head_dim", None) or dim // n_heads),
            ffn_dim=int(c.intermediate_size),
            vocab_size=int(c.vocab_size),
            tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            qk_norm=getattr(c, "model_type", "") in ("qwen3",),
        )
    except (AttributeError, TypeError, ValueError):
        return None


def _check_weights_match(directory: Path) -> None:
    """The safetensors tensors (names and shapes, read from the file headers) are those of the
    model that ``config.json`` builds; ValueError naming the first differences otherwise."""
    import re

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from dtensor_ulysses.hf.model import _tied_names, _weight_files

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(_hf_config(str(directory)))
    want = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    ignore = list(getattr(hf, "_keys_to_ignore_on_load_unexpected", None) or [])
    seen, wrong, unexpected = set(), [], []
    for file in _weight_files(directory):
        if not file.is_file():
            raise ValueError(f"weights file {str(file)!r} (named by the index) does not exist")
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if key not in want:
                        if not any(re.search(p, key) for p in ignore):
                            unexpected.append(key)
                        continue
                    got = tuple(f.get_slice(key).get_shape())
                    if got != want[key]:
                        wrong.append(f"{key} {got} (config: {want[key]})")
                    seen.add(key)
        except (OSError, RuntimeError) as e:  # safetensors raises its own error types too
            raise ValueError(f"cannot read weights file {str(file)!r}: {e}") from None
        except Exception as e:
            if type(e).__name__ != "SafetensorError":
                raise
            raise ValueError(f"cannot read weights file {str(file)!r}: {e}") from None
    tied = _tied_names(hf)
    missing = sorted(k for k in want if k not in seen and k not in tied)
    if wrong or missing or unexpected:
        parts = [
            f"{label} {items[:3]}{' ...' if len(items) > 3 else ''}"
            for label, items in (
                ("shapes differ:", wrong),
                ("missing", missing),
                ("unexpected", unexpected),
            )  # fmt: skip
            if items
        ]
        raise ValueError(
            f"the weights in {str(directory)!r} do not match its config.json "
            f"({type(hf).__name__}): {'; '.join(parts)}"
        )


def _corpus(cfg: TrainConfig, paths: list[str] | None, what: str = "--data"):
    """The training or evaluation corpus (cached per process): bytes for the built-in model,
    the tokenizer's ids (text and chat) for ``--hf-model``."""
    if cfg.hf_model is None:
        return PackedCorpus.from_paths(paths, seq_len=cfg.seq_len)
    from dtensor_ulysses.hf.data import load_corpus

    try:
        return load_corpus(paths, _tokenizer(cfg), cfg.seq_len)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def _check_eval_corpus(cfg: TrainConfig, corpus) -> None:
    if len(corpus) < cfg.batch_size:
        raise ValueError(
            f"--eval-data holds {len(corpus)} windows of {cfg.seq_len} tokens, fewer than one "
            f"global batch of {cfg.batch_size}; add held-out data or shorten --seq-len"
        )
