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

if TYPE_CHECKING:  # the public names, written once (__all__ and the lazy map read them)
    from dtensor_ulysses.train.checks import (
        validate,
    )
    from dtensor_ulysses.train.cli import (
        TrainConfig,
        UsageError,
        parse_args,
    )
    from dtensor_ulysses.train.evaluation import (
        Evaluator,
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
        lr_lambda,
        make_optimizer,
        model_spec,
    )

__getattr__, __dir__, __all__ = lazy_exports(__name__)
