"""The trainer's evaluation component (as torchtitan keeps its validator beside the trainer): the
held-out loss of ``--eval-data`` every ``--eval-every`` steps and after the last one.

Any layout the trainer trains evaluates, ``--ring`` included: the held-out windows go through the
one slicer (:func:`dtensor_ulysses.data.eval_batches`, :func:`~dtensor_ulysses.data.slice_batch`)
with the run's :class:`~dtensor_ulysses.parallel.ParallelDims`, and
:func:`~dtensor_ulysses.parallel.evaluate` sums the loss and counts the tokens over all ranks, so
the eval loss is a single process's on the same rows. Nothing here imports
:mod:`dtensor_ulysses.hf`: the built-in model evaluates without ``transformers`` installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dtensor_ulysses.data import eval_batches
from dtensor_ulysses.parallel import ParallelDims, evaluate
from dtensor_ulysses.train.cli import TrainConfig

__all__ = ["Evaluator", "evaluate"]


@dataclass
class Evaluator:
    """Held-out loss for the training loop.

    Attributes:
        cfg: the resolved configuration (``batch_size``, ``pack_docs``, ``eval_every``, ``steps``).
        corpus: the ``--eval-data`` corpus (either model family's).
        dims: the run's parallel degrees, bound to its mesh (this rank's coordinates; the
            sums and counts over all its ranks).
        device: where the model computes.
    """

    cfg: TrainConfig
    corpus: Any
    dims: ParallelDims
    device: torch.device

    def due(self, done: int) -> bool:
        """Whether to evaluate after step ``done``: every ``--eval-every`` and after the last."""
        every = self.cfg.eval_every
        return done == self.cfg.steps or bool(every and done % every == 0)

    def __call__(self, model: torch.nn.Module) -> dict[str, float]:
        """``{"eval_loss", "eval_perplexity", "eval_tokens"}`` over every full global batch."""
        batches = eval_batches(
            self.corpus, global_batch_size=self.cfg.batch_size, pack_docs=self.cfg.pack_docs,
            **self.dims.coords(),
        )  # fmt: skip
        out = evaluate(model, batches, self.dims.flat_mesh.get_group(), self.device)
        return {f"eval_{k}": v for k, v in out.items()}
