"""The trainer's guards around a run: what is refused before training, and how a run stops.

Before anything is built (called by ``validate``):

* :func:`check_numbers`: every optimizer and schedule number (``--lr``, ``--min-lr-ratio``,
  ``--warmup-steps``, ``--decay-steps``, ``--weight-decay``, ``--grad-clip``,
  ``--collective-timeout-s``, ``--memory-headroom``, ``--checkpoint-every``) finite and in
  range;
* :func:`check_targets`: every path the run writes (``--checkpoint-dir``, ``--metrics-file``,
  ``--save-hf``) can be written; ``--resume`` has steps left to train; a run without
  ``--resume`` does not write into a directory that holds checkpoints (of this run or another)
  unless ``--overwrite`` says to delete them.

While training (called by the loop, every rank alike):

* :meth:`RunGuard.stop_requested`: the stop requests that
  :func:`~dtensor_ulysses._exit.catch_stop_signals` records (SIGTERM, SIGUSR1 and a first
  Ctrl-C only set a flag; a launcher that died raises the same flag; a second Ctrl-C stops at
  once), all-reduced at each step boundary, so every rank stops after the same step, writes
  the checkpoint and leaves with :data:`EXIT_PREEMPTED` (75, ``EX_TEMPFAIL``: try again, with
  ``--resume``); on other nodes the all-reduce stops the ranks whose launcher lives;
* :meth:`RunGuard.check_finite`: a non-finite loss or gradient norm stops the run at that step
  with :data:`EXIT_NONFINITE` (3), naming the newest checkpoint that passes its checks and how
  to resume;
* :meth:`RunGuard.heartbeat`: under torchrun, each rank keeps its last step and peak memory in
  its torchelastic error file, so when a rank dies by a signal (the kernel's OOM killer sends
  SIGKILL) torchrun's failure summary shows the rank, the signal and that peak.

Test hooks (read only here): ``DTENSOR_ULYSSES_TEST_NAN_AT_STEP=N`` fills one parameter with
NaN before step ``N`` (1-based), a real non-finite step through the model;
``DTENSOR_ULYSSES_TEST_SLOW_STOP_S=T`` makes the ranks wait ``T`` seconds once they agree to
stop, before the stop's checkpoint (a long checkpoint write, for a second Ctrl-C to arrive in).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from dtensor_ulysses._exit import (
    EXIT_PREEMPTED,
    LAUNCHER_GONE,
    SINGLE_PROCESS_ENV,
    agreed_stop,
    describe_stop,
    shell_status,
    write_rank_note,
)
from dtensor_ulysses.train import checkpoint as ckpt
from dtensor_ulysses.train.cli import TrainConfig, UsageError
from dtensor_ulysses.train.metrics import _fmt_bytes
from dtensor_ulysses.train.resume import check_resumable

__all__ = [
    "EXIT_NONFINITE",
    "EXIT_PREEMPTED",
    "LAUNCHER_GONE",
    "NAN_HOOK_ENV",
    "SLOW_STOP_ENV",
    "SINGLE_PROCESS_ENV",
    "GuardStop",
    "NonFiniteStep",
    "Preempted",
    "RunGuard",
    "check_compile_backend",
    "check_numbers",
    "check_targets",
    "clear_rank_note",
    "note_building",
    "note_refusal",
    "prepare_cuda_allocator",
]

EXIT_NONFINITE = 3
NAN_HOOK_ENV = "DTENSOR_ULYSSES_TEST_NAN_AT_STEP"
SLOW_STOP_ENV = "DTENSOR_ULYSSES_TEST_SLOW_STOP_S"


# ----------------------------------------------------------------------------------------------
# before training
# ----------------------------------------------------------------------------------------------
def check_numbers(cfg: TrainConfig) -> None:
    """Refuse an optimizer or schedule number that is not finite or out of range.

    Raises:
        UsageError: naming the flag, its value and the range.
    """
    checks = [
        ("--lr", cfg.lr, cfg.lr > 0, "must be > 0 (the peak learning rate)"),
        ("--min-lr-ratio", cfg.min_lr_ratio, 0 <= cfg.min_lr_ratio <= 1,
         "must be between 0 and 1 (the final lr / peak lr)"),
        ("--warmup-steps", cfg.warmup_steps, cfg.warmup_steps >= 0, "must be >= 0"),
        ("--decay-steps", cfg.decay_steps, cfg.decay_steps >= 1,
         "must be >= 1 (the step where the cosine reaches --min-lr-ratio)"),
        ("--weight-decay", cfg.weight_decay, cfg.weight_decay >= 0, "must be >= 0 (0: off)"),
        ("--grad-clip", cfg.grad_clip, cfg.grad_clip >= 0, "must be >= 0 (0: no clipping)"),
        ("--collective-timeout-s", cfg.collective_timeout_s, cfg.collective_timeout_s > 0,
         "must be > 0 seconds"),
        ("--checkpoint-every", cfg.checkpoint_every, cfg.checkpoint_every >= 0,
         "must be >= 0 steps (0: checkpoint only at the end)"),
    ]  # fmt: skip
    if cfg.memory_headroom is not None:
        checks.append(("--memory-headroom", cfg.memory_headroom,
                       0 < cfg.memory_headroom <= 1,
                       "must be a fraction of the capacity in (0, 1], e.g. 0.9"))  # fmt: skip
    for flag, value, ok, rule in checks:
        if not (math.isfinite(value) and ok):
            raise UsageError(f"{flag} {value} {rule}")
    if cfg.checkpoint_every and not cfg.checkpoint_dir:
        raise UsageError(
            f"--checkpoint-every {cfg.checkpoint_every} writes nothing without "
            f"--checkpoint-dir; add --checkpoint-dir DIR (or drop --checkpoint-every)"
        )
    if cfg.compile is not None:
        check_compile_backend(cfg.compile)
    if cfg.warmup_steps > cfg.decay_steps:
        raise UsageError(
            f"--warmup-steps {cfg.warmup_steps} is longer than --decay-steps "
            f"{cfg.decay_steps} (the cosine's end); raise --decay-steps to at least "
            f"{cfg.warmup_steps} or shorten the warmup"
        )


def check_compile_backend(backend: str) -> None:
    """Refuse a ``--compile`` backend that torch does not know (before anything is built)."""
    import torch

    known = sorted(torch.compiler.list_backends(exclude_tags=()))
    if backend not in known:
        raise UsageError(
            f"--compile {backend}: torch.compile has no backend of that name; use one of "
            f"{', '.join(known)} (inductor when --compile is given alone)"
        )


def check_targets(cfg: TrainConfig) -> None:
    """Refuse before training a path the run could not write, a ``--resume`` with nothing left
    to train, and a run that would mix its checkpoints with those already in the directory.

    Writes nothing that stays: a writable directory is proven by creating and deleting one
    empty temporary file in it (or in its nearest existing ancestor).
    """
    if cfg.overwrite and cfg.resume:
        raise UsageError(
            "--overwrite deletes the checkpoints that --resume would continue; pass one of them"
        )
    if cfg.overwrite and not cfg.checkpoint_dir:
        raise UsageError("--overwrite applies to --checkpoint-dir; this run writes no checkpoint")
    if cfg.checkpoint_dir:
        _check_dir_target("--checkpoint-dir", cfg.checkpoint_dir)
    if cfg.metrics_file:
        _check_file_target("--metrics-file", cfg.metrics_file)
    if cfg.save_hf:
        out = Path(cfg.save_hf)
        if out.exists() and not out.is_dir():
            raise UsageError(
                f"--save-hf {cfg.save_hf!r} is a file; name a directory (created, or replaced "
                f"if it exists)"
            )
        _check_dir_target("--save-hf", str(out.resolve().parent), shown=cfg.save_hf)
    if cfg.resume and cfg.resume_from:
        _check_steps_left(cfg)
    elif not cfg.resume and cfg.checkpoint_dir and not cfg.overwrite:
        _check_no_checkpoints(cfg)


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe(flag: str, shown: str, base: Path) -> None:
    if not base.is_dir():
        raise UsageError(
            f"{flag} {shown!r}: {str(base)!r} is a file, so no directory can be created under "
            f"it; choose another path"
        )
    try:
        fd, name = tempfile.mkstemp(prefix=".du-write-check-", dir=base)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise UsageError(
            f"{flag} {shown!r}: cannot write in {str(base)!r} ({e.strerror or e}); choose a "
            f"writable location"
        ) from None


def _check_dir_target(flag: str, path: str, *, shown: str | None = None) -> None:
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(
            f"{flag} {shown or path!r} is a file, not a directory; name a directory (it is "
            f"created if missing)"
        )
    _probe(flag, shown or path, _nearest_existing(p))


def _check_file_target(flag: str, path: str) -> None:
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {path!r} is a directory; name a file (lines are appended)")
    if p.exists():
        try:
            with p.open("a"):
                pass
        except OSError as e:
            raise UsageError(
                f"{flag} {path!r} cannot be appended to ({e.strerror or e}); choose a writable file"
            ) from None
        return
    _probe(flag, path, _nearest_existing(p.parent))


def _check_steps_left(cfg: TrainConfig) -> None:
    assert cfg.resume_from is not None
    step = int(ckpt.read_meta(Path(cfg.resume_from))["step"])
    if step >= cfg.steps:
        raise UsageError(
            f"--resume: checkpoint {cfg.resume_from} has done {step} steps and --steps is "
            f"{cfg.steps}, so there is nothing to train; pass --steps greater than {step} to "
            f"continue it"
        )


def _check_no_checkpoints(cfg: TrainConfig) -> None:
    assert cfg.checkpoint_dir is not None
    newest = ckpt.latest(cfg.checkpoint_dir)
    if newest is None:
        return
    fix = (
        "pass --resume to continue it, another --checkpoint-dir, or --overwrite to delete "
        f"the checkpoints in {cfg.checkpoint_dir!r} when this run starts"
    )
    try:
        check_resumable(newest, cfg)
    except (ValueError, KeyError, TypeError) as e:
        why = str(e).split(";")[0].split(". ")[0]
        raise UsageError(
            f"--checkpoint-dir {cfg.checkpoint_dir!r} holds the checkpoints of another run "
            f"({why}); without --resume this run would mix its checkpoints with them: use "
            f"another --checkpoint-dir, or pass --overwrite to delete them when this run starts"
        ) from None
    step = int(ckpt.read_meta(newest)["step"])
    raise UsageError(
        f"--checkpoint-dir {cfg.checkpoint_dir!r} already holds this run's checkpoints (the "
        f"newest: step {step}); starting again from step 0 would overwrite them: {fix}"
    )


def clear_for_overwrite(cfg: TrainConfig, rank: int) -> None:
    """With ``--overwrite``, rank 0 deletes the checkpoints in ``--checkpoint-dir`` (before the
    first save, whose barrier orders this before any other rank writes)."""
    if not (cfg.overwrite and cfg.checkpoint_dir and rank == 0):
        return
    root = Path(cfg.checkpoint_dir)
    gone = [p for p in root.glob("step_*") if p.is_dir()] if root.is_dir() else []
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    if gone:
        print(f"--overwrite: deleted {len(gone)} checkpoint(s) in {root}", flush=True)


def prepare_cuda_allocator(cfg: TrainConfig) -> TrainConfig:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (less fragmentation) unless the
    run is on the CPU or the user configured the allocator; call before CUDA is initialized."""
    if cfg.device != "cpu" and not (
        os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    ):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return cfg


# ----------------------------------------------------------------------------------------------
# while training
# ----------------------------------------------------------------------------------------------
class GuardStop(Exception):
    """The run stopped on purpose; ``main`` reports it and exits with :attr:`exit_code`."""

    exit_code = 1

    def report(self, rank: int) -> None:
        """Rank 0 prints the message; every rank leaves it in its torchelastic error file."""
        write_rank_note(str(self))
        if rank == 0:  # the checkpoint is written: a closed stderr (a launcher gone) is no error
            with contextlib.suppress(OSError):
                print(f"{self.prefix}: {self}", file=sys.stderr, flush=True)

    prefix = "error"


class Preempted(GuardStop):
    """A stop signal: the checkpoint of the last step is written (when checkpointing)."""

    exit_code = EXIT_PREEMPTED
    prefix = "preempted"


class NonFiniteStep(GuardStop):
    """A non-finite loss or gradient norm."""

    exit_code = EXIT_NONFINITE


class RunGuard:
    """The loop's per-step checks, on every rank.

    Args:
        cfg: the run's configuration.
        rank: this process's global rank.
        device: where a collective's tensor lives (the training device).
    """

    def __init__(self, cfg: TrainConfig, rank: int, device) -> None:
        self.cfg, self.rank, self.device = cfg, rank, device
        hook = os.environ.get(NAN_HOOK_ENV)
        self.nan_at = int(hook) if hook else None
        self.stop_signal: str | None = None
        self.resumed_from: Path | None = None  # the checkpoint this run loaded (set by the loop)
        self.skipped = 0  # steps skipped as non-finite (--skip-nonfinite)
        self.nan_backup: tuple | None = None  # the hook's poisoned tensor and its values
        clear_for_overwrite(cfg, rank)

    def counts(self) -> dict:
        """What the metrics record of the guard: ``skipped_nonfinite`` (with the flag)."""
        return {"skipped_nonfinite": self.skipped} if self.cfg.skip_nonfinite else {}

    def before_step(self, step: int, model) -> None:
        """The test hook: fill the first parameter with NaN for step ``step`` (1-based); with
        ``--skip-nonfinite`` the fault is transient (the values come back after the step)."""
        if self.nan_at is None or step != self.nan_at:
            return
        import torch

        with torch.no_grad():
            p = next(model.parameters())
            local = p.to_local() if hasattr(p, "to_local") else p
            if self.cfg.skip_nonfinite:
                self.nan_backup = (local, local.detach().clone())
            local.fill_(float("nan"))

    def check_finite(
        self, step: int, loss: float, grad_norm: float | None, *, skipped: bool = False
    ) -> None:
        """Stop the run at ``step`` when its loss or gradient norm is not finite (every rank
        sees the same reduced values, so every rank stops); with ``--skip-nonfinite`` the step
        was skipped (``skipped``): count it and say so instead."""
        bad = not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm))
        if self.nan_backup is not None:  # the hook's fault is transient: put the weights back
            self.nan_backup[0].copy_(self.nan_backup[1])
            self.nan_backup = None
        if not bad:
            return
        norm = "" if grad_norm is None else f", gradient norm {grad_norm}"
        if skipped:
            self.skipped += 1
            if self.rank == 0:
                print(
                    f"warning: step {step}: non-finite loss {loss}{norm}; skipped (no update; "
                    f"{self.skipped} so far, --skip-nonfinite)",
                    file=sys.stderr,
                    flush=True,
                )
            return
        raise NonFiniteStep(
            f"step {step}: non-finite loss {loss}{norm}; the run stopped before saving this "
            f"step. {self._resume_hint()}; lower --lr (or raise --warmup-steps) or check the "
            f"data of step {step} first"
        )

    def _resume_hint(self) -> str:
        if not self.cfg.checkpoint_dir:
            return "No checkpoint was written (no --checkpoint-dir): the run restarts from step 0"
        path, _ = ckpt.select_resume(self.cfg.checkpoint_dir)
        if path is None:
            return (
                f"No checkpoint in {self.cfg.checkpoint_dir!r} passes its checks: the run "
                f"restarts from step 0"
            )
        step = int(ckpt.read_meta(path)["step"])
        hint = (
            f"The newest checkpoint that passes its checks (files, sizes, checksums) is {path} "
            f"(step {step}): continue from it with the same command plus --resume"
        )
        if self.resumed_from is not None and Path(self.resumed_from) == path:
            hint += (
                f" (this run started from it: if the step fails again after it, its weights may "
                f"be the cause, since a checkpoint changed and resealed passes the checks too; "
                f"move {path} aside to resume from an older one)"
            )
        return hint

    def stop_requested(self) -> bool:
        """Whether any rank received a stop signal (or lost its launcher); a collective over all
        ranks (:func:`~dtensor_ulysses._exit.agreed_stop`: every rank names the same stop), so
        call it on every rank at every step boundary."""
        self.stop_signal = agreed_stop(self.device)
        if self.stop_signal is not None and os.environ.get(SLOW_STOP_ENV):
            time.sleep(float(os.environ[SLOW_STOP_ENV]))  # the test hook: a long checkpoint
        return self.stop_signal is not None

    def preempted(self, step: int) -> Preempted:
        """The stop after ``step``, its checkpoint written (when the run checkpoints)."""
        if self.cfg.checkpoint_dir:
            where = Path(self.cfg.checkpoint_dir) / f"step_{step:08d}"
            saved = f"checkpoint {where} written; continue with the same command plus --resume"
        else:
            saved = "no --checkpoint-dir, so nothing was saved"
        return Preempted(
            f"{describe_stop(self.stop_signal)}: stopped after step {step} of {self.cfg.steps}; "
            f"{saved} ({shell_status(EXIT_PREEMPTED)})"
        )

    def heartbeat(self, record: dict) -> None:
        """Keep this rank's last step and peak memory where torchrun reports a dead worker."""
        write_rank_note(
            f"rank {self.rank} (pid {os.getpid()}) had finished step {record['step']} of "
            f"{self.cfg.steps}, peak memory {_fmt_bytes(record['peak_mem_bytes'])}; a rank "
            f"ended by a signal leaves no message of its own (SIGKILL: often the kernel's "
            f"out-of-memory killer, see `dmesg`; lower the memory per rank, see "
            f"--memory-headroom)"
        )


def clear_rank_note() -> None:
    """Remove this worker's note (a run that ends normally, or with its own traceback)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError):
            Path(path).unlink()


def note_building(rank: int, steps: int) -> None:
    """Leave the note of a rank that has not finished a step yet (building the model, loading
    a checkpoint, or inside step 1), replaced by :meth:`RunGuard.heartbeat` after each step."""
    write_rank_note(
        f"rank {rank} (pid {os.getpid()}) had not finished step 1 of {steps} (it was building "
        f"the model, loading data or a checkpoint, or running step 1); a rank ended by a signal "
        f"leaves no message of its own (SIGKILL: often the kernel's out-of-memory killer, see "
        f"`dmesg`; lower the memory per rank, see --memory-headroom)"
    )


def note_refusal(message: str) -> None:
    """Leave a refusal's reason where torchrun's failure summary shows it."""
    write_rank_note(f"error: {message}")


def record_exit_status(code: int, rank: int) -> None:
    """Under ``python -m dtensor_ulysses.launch``: leave this rank's exit status for the
    launcher, which exits with the workers' status when they agree."""
    where = os.environ.get("DTENSOR_ULYSSES_EXIT_DIR")
    if where:
        with contextlib.suppress(OSError):
            Path(where, f"rank{rank}").write_text(str(code))
