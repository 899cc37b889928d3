"""The trainer: ``torchrun ... -m dtensor_ulysses.train`` (FSDP2 + Ulysses on a ``(dp, sp)`` mesh).

``parse_args -> validate -> build -> train_step -> train`` (the loop), with ``main`` the command
line's entry point. The modules, each one concern: ``cli`` (flags), ``checks`` (everything
refused before a process group exists), ``inputs`` (``--hf-model`` and its tokenizer), ``spec``
(the model spec: built-in model or ``--hf-model``; the optimizer and schedule), ``resume`` and
``checkpoint`` (what ``--resume`` loads; atomic writes), ``metrics`` (progress and metrics file),
``loop`` (build, step, loop, main).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtensor_ulysses._public import lazy_exports

# public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "build": "loop",
    "Evaluator": "evaluation",
    "forward_backward": "loop",
    "lr_lambda": "spec",
    "main": "loop",
    "make_optimizer": "spec",
    "model_spec": "spec",
    "ModelSpec": "spec",
    "parse_args": "cli",
    "StepResult": "loop",
    "train": "loop",
    "train_step": "loop",
    "TrainConfig": "cli",
    "UsageError": "cli",
    "validate": "checks",
}

__all__ = [
    "build",
    "forward_backward",
    "lr_lambda",
    "main",
    "make_optimizer",
    "model_spec",
    "ModelSpec",
    "parse_args",
    "StepResult",
    "train",
    "train_step",
    "TrainConfig",
    "UsageError",
    "validate",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs
    from dtensor_ulysses.train.checks import (
        validate,
    )
    from dtensor_ulysses.train.cli import (
        TrainConfig,
        UsageError,
        parse_args,
    )
    from dtensor_ulysses.train.loop import (
        StepResult,
        build,
        forward_backward,
        main,
        train,
        train_step,
    )
    from dtensor_ulysses.train.spec import (
        ModelSpec,
        lr_lambda,
        make_optimizer,
        model_spec,
    )
