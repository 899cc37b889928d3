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


def _single_process_launch(who: str, sp: int) -> str:
    """The one-line refusal of a degree ``sp > 1`` in a process that is not part of a
    multi-process launch, naming the fix; ``who`` names the door (``"with_ulysses(sp=2)"``).

    ``accelerate launch`` runs the script once (its single-process launcher) on a machine
    without GPUs, or with ``--cpu``, or from a config whose ``distributed_type`` is ``NO`` or
    ``MULTI_CPU``, whatever ``--num_processes`` says; ``--multi_gpu`` starts the processes with
    torchrun, on CPU too."""
    if "ACCELERATE_MIXED_PRECISION" in os.environ:  # set by accelerate launch
        return (
            f"{who} needs {sp} processes or a multiple, but accelerate launch started one (its "
            f"single-process launcher: on a machine without GPUs --num_processes alone starts "
            f"one); add --multi_gpu (it starts the processes with torchrun, on CPU too): "
            f"accelerate launch --multi_gpu --num_processes {sp} ..., or torchrun "
            f"--nproc-per-node {sp} ..."
        )
    return (
        f"{who} needs a distributed launch: torchrun --nproc-per-node {sp} ... (or accelerate "
        f"launch --multi_gpu --num_processes {sp} ...), {sp} processes or a multiple; this is "
        f"one process"
    )


def _refuse_batch_keys(inputs: dict, read: set[str], dropped: set[str], who: str) -> None:
    """Refuse the batch's tensors that a step neither reads (``read``) nor replaces
    (``dropped``): with_ulysses could not cut them into sequence slices. ``who`` names the step
    in the message ("it", "the reward step")."""
    extra = sorted(
        k for k, v in inputs.items() if k not in read | dropped and isinstance(v, torch.Tensor)
    )
    if extra:
        raise UnsupportedTrainerError(
            f"batch keys {extra} cannot be cut into sequence slices under Ulysses ({who} "
            f"reads {sorted(read)}); remove them from the collator's output"
        )


# TRL's SFTTrainer, tokenizing with assistant_only_loss=True a row that has no assistant token
_TRL_NO_ASSISTANT = "assistant_only_loss=True`, but at least one example has no assistant tokens"


def _chat_rows_without_assistant(datasets: dict[str, Any]) -> tuple[list[str], int, bool]:
    """``(the first 5 named, how many, whether a chat dataset was read)``: the rows of
    ``datasets`` (``{"train_dataset": ..., "eval_dataset": ...}``, an eval dict included) whose
    ``messages`` have no assistant turn; a dataset TRL does not tokenize (it has
    ``input_ids``) is not read. Read in batches of the ``messages`` column alone."""
    found: list[str] = []
    total, looked = 0, False
    for key, data in datasets.items():
        parts = data.items() if isinstance(data, dict) else [("", data)]
        for sub, ds in parts:
            columns = getattr(ds, "column_names", None) or ()
            if "messages" not in columns or "input_ids" in columns or not hasattr(ds, "iter"):
                continue
            where, looked, i = (f"{key}[{sub!r}]" if sub else key), True, 0
            for batch in ds.select_columns(["messages"]).iter(batch_size=1024):
                for messages in batch["messages"]:
                    roles = [m.get("role") for m in messages or () if isinstance(m, dict)]
                    if "assistant" not in roles:
                        total += 1
                        if len(found) < 5:
                            found.append(f"{where} row {i}")
                    i += 1
    return found, total, looked


def _no_assistant_refusal(found: list[str], total: int) -> UnsupportedTrainerError:
    more = f" and {total - len(found)} more" if total > len(found) else ""
    return UnsupportedTrainerError(
        f"assistant_only_loss=True trains on assistant tokens only, and {total} chat row(s) "
        f"have no assistant turn ({', '.join(found)}{more}): there is nothing to learn in "
        f"them; drop them (dataset.filter) or set assistant_only_loss=False"
    )


def _refuse_rows_without_assistant(args: Any, datasets: dict[str, Any]) -> None:
    """Refuse chat rows without an assistant turn under ``assistant_only_loss=True`` before
    TRL tokenizes them. TRL raises a ``RuntimeError`` for them while rank 0 tokenizes first and
    the other ranks wait at a barrier, so a refusal raised there by rank 0 alone would leave
    the others a connection-closed traceback; here every rank reads the same rows and refuses
    alike, naming them."""
    if not getattr(args, "assistant_only_loss", False):
        return
    found, total, _ = _chat_rows_without_assistant(datasets)
    if total:
        raise _no_assistant_refusal(found, total)


# TRL's SFTTrainer, tokenizing with assistant_only_loss=True a row that has no assistant token
_TRL_NO_ASSISTANT = "assistant_only_loss=True`, but at least one example has no assistant tokens"


def _rows_without_assistant(
    error: RuntimeError, datasets: dict[str, Any]
) -> UnsupportedTrainerError | None:
    """TRL's ``RuntimeError`` for chat rows without an assistant token, when the rows were not
    read before (:func:`_refuse_rows_without_assistant`) or all have an assistant turn, as one
    refusal with the reason; ``None`` for any other error (raise it as it is)."""
    if _TRL_NO_ASSISTANT not in str(error):
        return None
    found, total, looked = _chat_rows_without_assistant(datasets)
    if total:
        return _no_assistant_refusal(found, total)
    if looked:
        return UnsupportedTrainerError(
            "assistant_only_loss=True: every chat row has an assistant turn, but the "
            "tokenizer's chat template gives no assistant mask (no {% generation %} markers); "
            "add them to the template or set assistant_only_loss=False"
        )
    return UnsupportedTrainerError(
        "assistant_only_loss=True: a chat row has no assistant token (no assistant turn, or a "
        "chat template without {% generation %} markers); drop such rows or set "
        "assistant_only_loss=False"
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
