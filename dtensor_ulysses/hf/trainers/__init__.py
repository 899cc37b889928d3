"""The trainer side of the Hugging Face door: ``with_ulysses`` on ``transformers.Trainer`` and TRL.

``wrap`` (``with_ulysses``: the subclass, and the static table of trainer families), ``base``
(the shared mixin: mesh, model, data, the token cross entropy, files), ``refusals``, one module
per TRL trainer family whose loss is not the token cross entropy (``preference``: DPO and KTO;
``reward``; ``rl``: GRPO and RLOO), and ``logps`` (per-token log-probabilities over whole rows,
their shared primitive). The trainers build on :mod:`dtensor_ulysses.hf.models`, never the
reverse; the public names are ``dtensor_ulysses.hf.*``.
"""

from __future__ import annotations

__all__: list[str] = []  # the public names are dtensor_ulysses.hf.*
