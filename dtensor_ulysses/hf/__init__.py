"""Hugging Face ``transformers`` causal LMs under Ulysses + FSDP2 (the optional extra ``hf``).

``pip install -e ".[hf]"`` in a clone (transformers >= 5, safetensors, tokenizers). Importing
this package does not import transformers; its names import it on first use (a clear error names
the extra when it is missing).

For your own training loop::

    from dtensor_ulysses import hf
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    lm = hf.HFCausalLM(model)                      # model(ids, pos, layout=, labels=) -> loss sum
    hf.parallelize(lm, mesh)                       # Ulysses -> checkpointing -> FSDP2
    b = hf.shard_batch({"input_ids": ids, "labels": ids}, mesh)   # this rank's slice
    (lm(b.input_ids, b.position_ids, layout=b.layout, labels=b.labels) / b.n_valid).backward()

For a ``transformers.Trainer`` or TRL ``SFTTrainer`` script (launched with torchrun)::

    Trainer = hf.with_ulysses(trl.SFTTrainer, sp=4)   # then construct and train as before

Pieces: :mod:`~dtensor_ulysses.hf.routing` (``apply_ulysses``: every attention layer through the
one engine, refusals, the first-step guard), :mod:`~dtensor_ulysses.hf.batch` (``shard_batch``),
:mod:`~dtensor_ulysses.hf.model` (``HFCausalLM``, ``parallelize``, safetensors in and out, the
trainer's ``build``), :mod:`~dtensor_ulysses.hf.data` (tokenized and chat corpora, evaluation),
:mod:`~dtensor_ulysses.hf.trainer` (``with_ulysses``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ATTN_IMPLEMENTATION": "routing",
    "UnsupportedModelError": "routing",
    "UnroutedAttentionError": "routing",
    "apply_ulysses": "routing",
    "attention_modules": "routing",
    "check_supported": "routing",
    "ShardedBatch": "batch",
    "shard_batch": "batch",
    "HFCausalLM": "model",
    "check_model_dir": "model",
    "check_weights": "model",
    "check_tokenizer": "model",
    "load_pretrained": "model",
    "load_tokenizer": "model",
    "load_weights": "model",
    "parallelize": "model",
    "save_pretrained": "model",
    "TokenCorpus": "data",
    "encode_chat": "data",
    "eval_batches": "data",
    "evaluate": "data",
    "get_batch": "data",
    "load_corpus": "data",
    "RouterLoss": "moe",
    "load_balancing_loss": "moe",
    "router_loss_config": "moe",
    "UnsupportedTrainerError": "trainer",
    "with_ulysses": "trainer",
}

__all__ = [
    "ATTN_IMPLEMENTATION",
    "HFCausalLM",
    "RouterLoss",
    "ShardedBatch",
    "TokenCorpus",
    "UnroutedAttentionError",
    "UnsupportedModelError",
    "UnsupportedTrainerError",
    "apply_ulysses",
    "attention_modules",
    "check_model_dir",
    "check_weights",
    "check_supported",
    "check_tokenizer",
    "encode_chat",
    "eval_batches",
    "evaluate",
    "get_batch",
    "load_balancing_loss",
    "load_corpus",
    "load_pretrained",
    "load_tokenizer",
    "load_weights",
    "parallelize",
    "router_loss_config",
    "save_pretrained",
    "shard_batch",
    "with_ulysses",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from dtensor_ulysses.hf.batch import ShardedBatch, shard_batch
    from dtensor_ulysses.hf.data import (
        TokenCorpus,
        encode_chat,
        eval_batches,
        evaluate,
        get_batch,
        load_corpus,
    )
    from dtensor_ulysses.hf.model import (
        HFCausalLM,
        check_model_dir,
        check_tokenizer,
        check_weights,
        load_pretrained,
        load_tokenizer,
        load_weights,
        parallelize,
        save_pretrained,
    )
    from dtensor_ulysses.hf.moe import RouterLoss, load_balancing_loss, router_loss_config
    from dtensor_ulysses.hf.routing import (
        ATTN_IMPLEMENTATION,
        UnroutedAttentionError,
        UnsupportedModelError,
        apply_ulysses,
        attention_modules,
        check_supported,
    )
    from dtensor_ulysses.hf.trainer import UnsupportedTrainerError, with_ulysses
