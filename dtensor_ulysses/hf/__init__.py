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

The package, by concern (trainers above models, never the reverse):

* :mod:`~dtensor_ulysses.hf.models`: the model side. ``routing`` (``apply_ulysses``: every
  attention layer through the one engine, what each family supports and refuses, the first-step
  guard), ``causal_lm`` (``HFCausalLM``), ``parallelize``, ``pretrained`` (safetensors and
  tokenizers in and out), ``moe``, ``latent_attention``, ``mixers`` (Gated DeltaNet, Mamba-2,
  KDA, short convolutions), ``vision`` and ``image_blocks`` (vision-language models).
* :mod:`~dtensor_ulysses.hf.trainers`: ``with_ulysses`` (``wrap``), the shared base
  (``base``), the refusals (``refusals``), one module per TRL trainer family (``preference``:
  DPO, KTO; ``reward``; ``rl``: GRPO, RLOO), and ``logps`` (per-token label log-probabilities
  of a sharded batch over whole rows, for sequence-level losses).
* Here: :mod:`~dtensor_ulysses.hf.batch` (``shard_batch``) and :mod:`~dtensor_ulysses.hf.data`
  (tokenized and chat corpora, evaluation), which both floors use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtensor_ulysses._public import lazy_exports
from dtensor_ulysses.hf import _deps  # one ImportError line naming the extra without transformers

if TYPE_CHECKING:  # the public names, written once (__all__ and the lazy map read them)
    from dtensor_ulysses.hf.batch import (
        ShardedBatch,
        shard_batch,
    )
    from dtensor_ulysses.hf.data import (
        encode_chat,
        eval_batches,
        evaluate,
        get_batch,
        load_corpus,
    )
    from dtensor_ulysses.hf.models.causal_lm import HFCausalLM
    from dtensor_ulysses.hf.models.moe import load_balancing_loss, router_loss_config
    from dtensor_ulysses.hf.models.parallelize import parallelize
    from dtensor_ulysses.hf.models.pretrained import (
        check_model_dir,
        check_tokenizer,
        load_pretrained,
        load_tokenizer,
        load_weights,
        save_pretrained,
    )
    from dtensor_ulysses.hf.models.routing import (
        UnroutedAttentionError,
        UnsupportedModelError,
        apply_ulysses,
    )
    from dtensor_ulysses.hf.trainers.accelerate_door import UlyssesAccelerator
    from dtensor_ulysses.hf.trainers.logps import (
        logp_head,
        sequence_logps,
        token_rows,
    )
    from dtensor_ulysses.hf.trainers.refusals import UnsupportedTrainerError
    from dtensor_ulysses.hf.trainers.wrap import with_ulysses


__getattr__, __dir__, __all__ = lazy_exports(__name__)
