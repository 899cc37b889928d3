"""The model side of the Hugging Face door: transformers models through the Ulysses engine.

``routing`` routes every attention layer (and, through ``mixers``, every linear-attention,
state-space or convolution mixer; ``latent_attention`` for MLA) and refuses what it cannot run
exactly; ``causal_lm`` gives a model the trainer's call; ``parallelize`` applies Ulysses ->
checkpointing -> FSDP2; ``pretrained`` reads and writes safetensors shard by shard; ``moe`` the
router loss over the global batch; ``vision`` and ``image_blocks`` the vision-language families.
Nothing here imports the trainers (:mod:`dtensor_ulysses.hf.trainers`); the public names are
``dtensor_ulysses.hf.*``.
"""

from __future__ import annotations

__all__: list[str] = []  # the public names are dtensor_ulysses.hf.*
