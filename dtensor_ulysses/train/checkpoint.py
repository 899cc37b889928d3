"""Save and resume training with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory ``step_00000042/`` holding the sharded model and optimizer state
(DCP: each rank writes its own shards, any (dp, sp) can load them), ``trainer.pt`` (scheduler,
step, config) and ``rng_rank{r}.pt`` (each rank's RNG state). It is written to ``*.tmp`` and
renamed when every rank has finished, so a run killed mid-save leaves the previous checkpoint as
the newest one.

Loading a checkpoint never runs code from it (checkpoints are shared between people and
machines): ``trainer.pt`` and ``rng_rank*.pt`` hold only numbers, strings, lists, dicts and
tensors, read with ``torch.load(weights_only=True)``; DCP's ``.metadata`` (a plain pickle, which
DCP reads with ``pickle.load``) is first read by :func:`read_dcp_metadata`, an unpickler that
admits only DCP's own metadata types and the few torch and stdlib types they hold; the small
non-tensor items in the ``.distcp`` files (DCP loads them with ``weights_only=False``) are
loaded with ``weights_only=True`` (:class:`_SafeLoadPlanner`). A file that fails any of these is
damaged, like a truncated one: ``--resume`` falls back to an older intact checkpoint. Checkpoints
of earlier versions hold the same kinds of data and are read the same safe way.

Damage after the fact (a truncated or overwritten file, a disk that filled up) is found before
anything is built: :func:`verify` checks that ``.metadata`` loads, that every file it names exists
and holds every item it points into, and that ``trainer.pt`` and the RNG files load and agree
with the directory's step. :func:`select_resume` picks the newest checkpoint that passes, and
reports the damaged ones it skipped. ``keep_last`` (:func:`save`) deletes older checkpoints only
once the new one is complete (renamed into place).
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = [
    "ENOSPC_HOOK_ENV",
    "EXIT_CHECKPOINT_FAILED",
    "CheckpointWriteError",
    "UnsafeCheckpoint",
    "latest",
    "load",
    "prune",
    "read_dcp_metadata",
    "read_meta",
    "save",
    "select_resume",
    "verify",
]

_STEP_DIR = re.compile(r"^step_(\d{8})$")
EXIT_CHECKPOINT_FAILED = 74  # sysexits.h EX_IOERR
# Test hook (read only here): the save of step N fails on the last rank as on a full disk.
ENOSPC_HOOK_ENV = "DTENSOR_ULYSSES_TEST_ENOSPC_AT_STEP"


class CheckpointWriteError(Exception):
    """A checkpoint could not be written (a full disk, a quota, an I/O error) on some rank.

    Its partial ``*.tmp`` directory is removed, so ``--resume`` sees only intact checkpoints;
    the message names the failed checkpoint, the newest intact one and the fix.
    """

    exit_code = EXIT_CHECKPOINT_FAILED

    def __init__(self, step: int, final: Path, why: str) -> None:
        newest = latest(final.parent)
        if newest is None:
            then = (
                f"no intact checkpoint is left in {str(final.parent)!r}, so the run restarts "
                f"from step 0"
            )
        else:
            then = (
                f"the newest intact checkpoint is {newest} (step {int(newest.name[5:])}): "
                f"continue from it with the same command plus --resume"
            )
        super().__init__(
            f"checkpoint step {step} could not be written to {final} ({why}); its partial "
            f"files were removed. Free space under {str(final.parent)!r} (or choose another "
            f"--checkpoint-dir); {then}"
        )


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(
    ckpt_dir: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    meta: dict,
    *,
    keep_last: int | None = None,
    announce: bool = False,
) -> Path:
    """Write the checkpoint of ``step`` (steps completed) under ``ckpt_dir``; returns its path.

    Args:
        keep_last: once this one is complete, keep only the newest ``keep_last`` checkpoints
            (None: keep all).
        announce: rank 0 prints one line when the checkpoint is complete.
    """
    t0 = time.perf_counter()
    final = Path(ckpt_dir) / f"step_{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    why = None
    try:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        rng = tmp / f"rng_rank{_rank()}.pt"
        _enospc_hook(step, rng)
        torch.save(_rng_state(), rng)
        if _rank() == 0:
            trainer = {"step": step, "scheduler": scheduler.state_dict(), "meta": meta}
            torch.save(trainer, tmp / "trainer.pt")
    except (OSError, RuntimeError, CheckpointException) as e:  # RuntimeError: torch.save's
        why = _write_failure(e)
    whys = [why]
    if dist.is_initialized() and dist.get_world_size() > 1:  # every rank learns of a failure
        whys = [None] * dist.get_world_size()
        dist.all_gather_object(whys, why)
    failed = [(r, w) for r, w in enumerate(whys) if w is not None]
    if failed:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        rank, why = failed[0]
        where = f"rank {rank}: " if len(whys) > 1 else ""
        raise CheckpointWriteError(step, final, where + why)
    if _rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        if keep_last is not None:
            prune(ckpt_dir, keep_last)
        if announce:
            size = sum(f.stat().st_size for f in final.iterdir() if f.is_file())
            print(
                f"checkpoint step {step} written to {final} ({size / 2**20:.1f} MiB, "
                f"{time.perf_counter() - t0:.1f} s)",
                flush=True,
            )
    _barrier()
    return final


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint file asks to load something other than plain data (code could run)."""


_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ADMITTED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup of torch's layouts by name
    ("collections", "OrderedDict"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, torch's dtypes and the names in :data:`_ADMITTED`."""

    def find_class(self, module: str, name: str) -> Any:
        obj = None
        if module == _DCP_METADATA_MODULE or (module, name) in _ADMITTED:
            obj = super().find_class(module, name)
            if module == _DCP_METADATA_MODULE and not isinstance(obj, type):
                obj = None
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            obj = getattr(torch, name)
        if obj is None:
            raise UnsafeCheckpoint(f"it names {module}.{name}, which is not checkpoint metadata")
        return obj


def read_dcp_metadata(path: str | os.PathLike) -> Any:
    """DCP's ``Metadata`` of the checkpoint at ``path``, unpickled with only DCP's metadata
    types admitted (plain ``pickle.load``, DCP's own reader, would run any code in the file).

    Raises:
        UnsafeCheckpoint: the file names another class or function.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    with open(Path(path) / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def _load_plain(file: Path) -> Any:
    """A ``torch.save`` file of plain data and tensors; never runs code from it."""
    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        named = re.search(r"(?:unsupported|Unsupported global:) GLOBAL ([\w.]+)", str(e))
        what = f"names {named.group(1)}" if named else "holds more than plain data"
        raise UnsafeCheckpoint(f"it {what}, which a checkpoint never holds") from None


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading the non-tensor items with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)  # refuses anything but plain data
        clean = io.BytesIO()
        torch.save(obj, clean)  # what the default planner then reads is what we wrote
        clean.seek(0)
        super().load_bytes(read_item, clean)


def _write_failure(e: BaseException) -> str:
    """What went wrong in a write, in a few words (the first failure inside DCP's)."""
    if isinstance(e, CheckpointException):
        inner = [exc for exc, _ in e.failures.values()]
        e = next((x for x in inner if isinstance(x, OSError)), inner[0] if inner else e)
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    return f"{type(e).__name__}: {_short(e)}"


def _enospc_hook(step: int, target: Path) -> None:
    hook = os.environ.get(ENOSPC_HOOK_ENV)
    last = dist.get_world_size() - 1 if dist.is_initialized() else 0
    if hook and int(hook) == step and _rank() == last:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))


def _step_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(
        (p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)),
        key=lambda p: p.name,
        reverse=True,
    )


def prune(ckpt_dir: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (and ``*.tmp`` leftovers
    older than the newest complete one); returns what was deleted. Call it only after a new
    checkpoint is complete."""
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1")
    root = Path(ckpt_dir)
    complete = [p for p in _step_dirs(root) if (p / "trainer.pt").is_file()]
    doomed = complete[keep_last:]
    if complete:
        newest = complete[0].name
        doomed += [
            p for p in root.glob("step_*.tmp")
            if p.is_dir() and p.name.removesuffix(".tmp") < newest
        ]  # fmt: skip
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def latest(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``ckpt_dir`` (``*.tmp`` leftovers ignored), or None."""
    complete = [p for p in _step_dirs(Path(ckpt_dir)) if (p / "trainer.pt").is_file()]
    return complete[0] if complete else None


def verify(path: str | os.PathLike) -> str | None:
    """What is wrong with the checkpoint at ``path``, or ``None`` if it looks intact.

    Checks, without loading any tensor: ``.metadata`` loads; every file it names exists and is
    long enough for every item stored in it, and each item starts like a ``torch.save`` archive;
    ``trainer.pt`` loads as plain data, with a ``step`` equal to the directory's, a scheduler
    state and the run's metadata; every ``rng_rank*.pt`` loads as plain data. Fast: reads the
    small files and a few bytes per item.
    """
    path = Path(path)
    if not path.is_dir():
        return f"{path} is not a directory"
    if not (path / ".metadata").is_file():
        return "its .metadata file is missing (the save did not finish)"
    try:
        metadata = read_dcp_metadata(path)
        storage = metadata.storage_data
        if not isinstance(storage, dict) or not storage:
            return ".metadata names no stored data"
    except Exception as e:
        return f".metadata cannot be read ({type(e).__name__}: {_short(e)})"
    ends: dict[str, int] = {}
    starts: dict[str, list[int]] = {}
    for info in storage.values():
        rel = info.relative_path
        ends[rel] = max(ends.get(rel, 0), info.offset + info.length)
        if not getattr(info, "transform_descriptors", None):
            starts.setdefault(rel, []).append(info.offset)
    for rel, end in sorted(ends.items()):
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        size = f.stat().st_size
        if size < end:
            return f"{rel} is truncated ({size} bytes; its items need {end})"
        try:
            with f.open("rb") as fh:
                for offset in starts.get(rel, []):
                    fh.seek(offset)
                    if fh.read(2) != b"PK":
                        return f"{rel} is damaged (no stored item at byte {offset})"
        except OSError as e:
            return f"{rel} cannot be read ({e.strerror or e})"
    try:
        trainer = read_meta(path)
    except Exception as e:
        return f"trainer.pt cannot be read ({type(e).__name__}: {_short(e)})"
    m = _STEP_DIR.match(path.name)
    if not isinstance(trainer, dict) or not {"step", "scheduler", "meta"} <= set(trainer):
        return "trainer.pt does not hold the trainer state (step, scheduler, meta)"
    if m and trainer["step"] != int(m.group(1)):
        return f"trainer.pt says step {trainer['step']} but the directory is {path.name}"
    for rng in sorted(path.glob("rng_rank*.pt")):
        try:
            state = _load_plain(rng)
            if not isinstance(state, dict) or not isinstance(state.get("cpu"), torch.Tensor):
                return f"{rng.name} does not hold an RNG state"
        except Exception as e:
            return f"{rng.name} cannot be read ({type(e).__name__}: {_short(e)})"
    return None


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 120 else text[:117] + "..."


def select_resume(ckpt_dir: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest intact checkpoint in ``ckpt_dir`` (or None), and the newer ones that are
    damaged, each with what is wrong (newest first). Incomplete ``*.tmp`` directories are not
    checkpoints and are ignored."""
    damaged: list[tuple[Path, str]] = []
    for p in _step_dirs(Path(ckpt_dir)):
        problem = verify(p)
        if problem is None:
            return p, damaged
        damaged.append((p, problem))
    return None, damaged


def read_meta(path: Path) -> dict:
    """The trainer metadata (step, config) of a checkpoint, without loading the tensors."""
    return _load_plain(path / "trainer.pt")


def load(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
) -> dict:
    """Load a checkpoint into ``model``, ``optimizer``, ``scheduler`` in place; return trainer data.

    The caller checks the metadata (model shape) first: see :func:`read_meta`.
    """
    trainer = read_meta(path)
    read_dcp_metadata(path)  # refuses a .metadata that names anything but DCP's types
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}  # loaded in place
    dcp.load(state, checkpoint_id=str(path), planner=_SafeLoadPlanner())
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    scheduler.load_state_dict(trainer["scheduler"])
    rng = path / f"rng_rank{_rank()}.pt"
    if rng.is_file():
        _set_rng_state(_load_plain(rng))
    return trainer


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
