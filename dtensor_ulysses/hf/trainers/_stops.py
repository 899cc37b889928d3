"""How a ``with_ulysses`` trainer stops when asked: the trainer CLI's stops, through the
Trainer's own checkpointing.

While ``train()`` runs (:func:`train_until_stopped`), SIGTERM, SIGUSR1 and a first Ctrl-C only
set a flag, and so does a launcher that died (plain ``torchrun`` ended by SIGUSR1 or SIGKILL:
its workers' parent changes); a second Ctrl-C stops at once
(:func:`~dtensor_ulysses._exit.catch_stop_signals`). At the end of every optimizer step the
ranks agree on the flag (:class:`_AgreedStop`: one all-reduce of a 4-byte int32 over the
world), so every rank stops after the same step; that step is logged and saved as the Trainer
saves (``output_dir/checkpoint-N``: model, optimizer, scheduler, RNG states, trainer state,
whatever ``save_strategy`` says), training ends, and the process leaves with status 75 and one
``preempted:`` line from rank 0, without returning into the script (whose code after
``train()`` would take the stopped run for a finished one). ``train(resume_from_checkpoint=...)``
then continues exactly. A closed stdout or stderr (``| tee`` gone) never ends the run
(:func:`~dtensor_ulysses._exit.protect_output`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from dtensor_ulysses._exit import (
    EXIT_PREEMPTED,
    agreed_stop,
    catch_stop_signals,
    describe_stop,
    leave_with_message,
    protect_output,
    shell_status,
)

__all__: list[str] = []  # placed by the shared mixin (base.py)


class _AgreedStop(TrainerCallback):
    """At each optimizer step's end, every rank learns whether any rank was asked to stop; if
    so (and steps are left), the Trainer logs and saves this step and ends training."""

    def __init__(self) -> None:
        self.stop: str | None = None  # what stopped the run
        self.step = 0  # the step it stopped after

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.max_steps and state.global_step >= state.max_steps:
            return control  # the last step: the run ends anyway (every rank alike)
        stop = agreed_stop(args.device)
        if stop is not None:
            self.stop, self.step = stop, state.global_step
            control.should_log = True
            control.should_save = True
            control.should_training_stop = True
        return control


def train_until_stopped(trainer: Any, train: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``train(*args, **kwargs)`` (the stock ``Trainer.train``) with the stops above; returns
    its result, or ends the process after a stop's checkpoint."""
    callback = _AgreedStop()
    trainer.add_callback(callback)
    try:
        with catch_stop_signals(), protect_output():
            result = train(*args, **kwargs)
    finally:
        trainer.remove_callback(callback)
    if callback.stop is None:
        return result
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    where = os.path.join(trainer.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{callback.step}")
    leave_with_message(
        EXIT_PREEMPTED,
        f"{describe_stop(callback.stop)}: stopped after step {callback.step} of "
        f"{trainer.state.max_steps}; the Trainer's checkpoint {where} is written: continue "
        f"with trainer.train(resume_from_checkpoint={where!r}) (or True: the newest in "
        f"output_dir) ({shell_status(EXIT_PREEMPTED)})",
        prefix="preempted",
    )
