"""What :func:`~dtensor_ulysses.hf.with_ulysses` refuses, and how a refusal leaves a launch.

Every refusal is an :class:`UnsupportedTrainerError` (or the model routing's
:class:`~dtensor_ulysses.hf.UnsupportedModelError`) whose message names the setting and the fix;
under a launch it ends the process with one ``error:`` line from rank 0 instead of a traceback
from every rank: this module decides what is a refusal (:func:`_refusals_in_one_line`), and
:func:`dtensor_ulysses._exit.mark_refusal` how the process then leaves.
"""

from __future__ import annotations

import functools
import linecache
import os
from typing import Any

import torch
from torch import nn

from dtensor_ulysses._exit import mark_refusal
from dtensor_ulysses.hf.models.routing import (
    UnsupportedModelError,
    attention_dropout,
    attention_modules,
)
from dtensor_ulysses.hf.trainers import _state

__all__ = ["UnsupportedTrainerError"]


class UnsupportedTrainerError(ValueError):
    """A trainer, argument or model that :func:`with_ulysses` cannot make exact; the message
    names it and the reason."""


# ----------------------------------------------------------------------------------------------
# a refusal under a launch: one line, from rank 0 (the exception itself is unchanged)
# ----------------------------------------------------------------------------------------------
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _is_refusal(e: BaseException) -> bool:
    """An exception the library raised on purpose for bad input: the engine's and the trainer's
    refusals, or a ``ValueError`` from a ``raise`` statement in this package (a ``ValueError``
    a builtin raised inside it is a bug, and keeps its traceback)."""
    if isinstance(e, (UnsupportedTrainerError, UnsupportedModelError)):
        return True
    if not isinstance(e, ValueError) or e.__traceback__ is None:
        return False
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename
    line = linecache.getline(filename, tb.tb_lineno).strip()
    return os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep) and line.startswith("raise")


def _refusals_in_one_line(fn: Any) -> Any:
    """Decorate ``fn`` so that a refusal it raises, if nothing catches it, ends the process with
    one ``error:`` line printed by rank 0 alone (status 2 on every rank, the message also in
    torchrun's failure summary; the shell sees 1 under plain torchrun, 2 under
    ``python -m dtensor_ulysses.launch``) instead of a traceback from every rank. The exception
    itself is unchanged: a caller may catch it."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            if _is_refusal(e):
                mark_refusal(e)  # left uncaught: one line, status 2 (see _exit.py)
            raise

    return wrapper


def _refuse_batch_keys(inputs: dict, read: set[str], dropped: set[str], who: str) -> None:
    """Refuse the batch's tensors that a step neither reads (``read``) nor replaces
    (``dropped``): with_ulysses could not cut them into sequence slices. ``who`` names the step
    in the message ("it", "the reward step")."""
    extra = sorted(
        k for k, v in inputs.items() if k not in read | dropped and isinstance(v, torch.Tensor)
    )
    if extra:
        raise UnsupportedTrainerError(
            f"batch keys {extra} cannot be cut into sequence slices by with_ulysses ({who} "
            f"reads {sorted(read)}); remove them from the collator's output"
        )


def _refuse_args(args: Any, sp: int, *, own_loss: bool = False) -> None:
    """The training arguments with_ulysses cannot make exact; ``own_loss``: a trainer family
    whose mixin checks its own ``loss_type``."""
    from transformers import Trainer

    problems = []
    if getattr(args, "deepspeed", None):
        problems.append(
            "DeepSpeed is enabled (args.deepspeed): it shards and reduces the model itself; "
            "with_ulysses shards with FSDP2 - drop the DeepSpeed config"
        )
    if getattr(args, "fsdp", None):
        problems.append(
            "accelerate's FSDP is enabled (args.fsdp): with_ulysses applies FSDP2 itself over "
            "dp x sp with summed gradients - drop args.fsdp / fsdp_config"
        )
    pc = getattr(args, "parallelism_config", None)
    for name in ("cp_size", "sp_size", "tp_size"):
        size = getattr(pc, name, 1) or 1
        if pc is not None and size > 1:
            problems.append(
                f"parallelism_config.{name}={size}: a second sequence / tensor parallelism "
                f"cannot run with Ulysses (sp={sp}) here; set {name}=1"
            )
    if float(getattr(args, "label_smoothing_factor", 0.0) or 0.0) > 0:
        problems.append(
            f"label_smoothing_factor={args.label_smoothing_factor}: the sharded loss is the "
            f"plain token cross entropy; set it to 0"
        )
    loss_type = getattr(args, "loss_type", None)
    if loss_type not in (None, "nll") and not own_loss:
        problems.append(f"loss_type={loss_type!r}: only 'nll' is made exact; set loss_type='nll'")
    tokens_seen = getattr(args, "include_num_input_tokens_seen", "no")
    if tokens_seen not in ("no", False, None) and not hasattr(Trainer, "_track_num_input_tokens"):
        problems.append(
            f"include_num_input_tokens_seen={tokens_seen!r}: this transformers version counts "
            f"tokens where with_ulysses cannot undo the sp-fold count; set it to 'no'"
        )
    if getattr(args, "save_on_each_node", False):
        problems.append("save_on_each_node=True: the full weights are gathered to rank 0 only")
    if problems:
        raise UnsupportedTrainerError(
            "with_ulysses cannot run this exactly: " + "; ".join(problems)
        )


def _refuse_attention_dropout(model: Any, args: Any) -> None:
    """Refuse attention dropout at construction, before the model is loaded when TRL loads it
    from a name (its config, with ``model_init_kwargs``), and on the modules of a loaded model
    (the probability each attention layer would pass to the kernel in training): the one
    detector, :func:`~dtensor_ulysses.hf.models.routing.attention_dropout`."""
    found: dict[str, float] = {}
    if isinstance(model, str):
        try:
            from transformers import AutoConfig

            cfg: Any = AutoConfig.from_pretrained(model).get_text_config()
        except Exception:  # not readable here: the loaded model is checked after loading
            return
        overrides = getattr(args, "model_init_kwargs", None) or {}
        found = attention_dropout(cfg, overrides=overrides)
        what = repr(model)
    elif isinstance(model, nn.Module):
        hf: Any = _state.base_model(model)
        cfg = hf.config.get_text_config()
        found = {f"config.{k}": v for k, v in attention_dropout(cfg).items()}
        for name, m in attention_modules(hf):
            for key, v in attention_dropout(None, m).items():
                found[f"{name}.{key.removeprefix('module.')}"] = v
        what = type(hf).__name__
    else:
        return
    if found:
        items = [f"{k}={v}" for k, v in found.items()]
        more = f" and {len(items) - 2} more" if len(items) > 2 else ""
        raise UnsupportedModelError(
            f"{what} has attention dropout ({', '.join(items[:2])}{more}): each rank would draw "
            f"its own mask for its heads and slice, so training cannot equal the single-process "
            f"run; set attention_dropout=0.0 in the model config (from_pretrained(..., "
            f"attention_dropout=0.0), or SFTConfig(model_init_kwargs={{'attention_dropout': "
            f"0.0}}))"
        )
