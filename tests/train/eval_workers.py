"""Per-rank functions for the trainer's held-out loss without ``transformers`` (imported by module
path in spawned processes). :func:`train_and_evaluate` first makes ``transformers`` unimportable
in the rank (a meta path finder that raises ``ImportError``; never in the parent pytest process),
so the built-in model's train and eval path is shown to work without it and never to import
:mod:`dtensor_ulysses.hf`."""

from __future__ import annotations

import importlib.abc
import sys

_BLOCKED = "transformers"


class _NoTransformers(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == _BLOCKED or name.startswith(_BLOCKED + "."):
            raise ImportError(f"{name} is made unimportable by tests/train/eval_workers.py")
        return None


def _loaded() -> list[str]:
    return sorted(m for m in sys.modules if m == _BLOCKED or m.startswith("dtensor_ulysses.hf"))


def train_and_evaluate(rank: int, world_size: int, runs: list[dict]) -> dict:
    """Each run: TrainConfig keyword arguments; returns the per-step records of each run, and
    which of ``transformers`` / ``dtensor_ulysses.hf`` were imported (before and after)."""
    before = _loaded()
    sys.meta_path.insert(0, _NoTransformers())
    from dtensor_ulysses import train as du_train

    out = []
    for kw in runs:
        cfg = du_train.validate(du_train.TrainConfig(**kw), world_size)
        out.append(du_train.train(cfg))
    try:
        import transformers  # noqa: F401

        blocked = False
    except ImportError:
        blocked = True
    return {"records": out, "before": before, "loaded": _loaded(), "blocked": blocked}
