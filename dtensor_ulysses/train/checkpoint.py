"""Save and resume training with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory ``step_00000042/`` holding the sharded model and optimizer state
(DCP: each rank writes its own shards, any (dp, sp) can load them), ``trainer.pt`` (scheduler,
step, config), ``rng_rank{r}.pt`` (each rank's RNG state) and, written last,
``manifest.json`` (:mod:`~dtensor_ulysses.train.manifest`: every file's size and CRC-32s). It
is written to ``*.tmp`` and renamed when every rank has finished, so a run killed mid-save
leaves the previous checkpoint as the newest one.

Loading a checkpoint never runs code from it (checkpoints are shared between people and
machines). Every file a resume reads, and how:

* ``.metadata`` (a plain pickle, which DCP itself would read with ``pickle.load``): by
  :func:`read_dcp_metadata`, an unpickler that admits only an explicit set of classes by exact
  module and name (:data:`ADMITTED`; ``dtensor_ulysses._safe_pickle``), both when it is checked
  and when DCP loads (:class:`_SafeReader` replaces DCP's reader);
* the ``.distcp`` files: their tensors are read by DCP with ``torch.load(weights_only=True)``;
  their non-tensor items (DCP reads them with ``weights_only=False``) with
  ``weights_only=True`` (:class:`_SafeLoadPlanner`);
* ``trainer.pt`` and ``rng_rank*.pt``: ``torch.load(weights_only=True)`` (numbers, strings,
  lists, dicts and tensors only);
* ``manifest.json``: JSON.

A file that fails any of these is damaged, like a truncated one. Damage after the fact is found
before anything is loaded: :func:`verify` (each process, before the model is built) checks that
``.metadata`` loads, that every file it names exists and holds every item it points into, that
``trainer.pt`` and the RNG files load and agree with the directory's step, and that the files
and their sizes are the manifest's; :func:`load` then checks every byte against the manifest
(the ranks share the reading) before DCP reads anything, and treats any failure while loading
(DCP's ``CheckpointException`` included, a ``BaseException``) as damage on every rank alike
(:class:`DamagedCheckpoint`). :func:`select_resume` picks the newest checkpoint that passes
:func:`verify`, and reports the damaged ones it skipped. ``keep_last`` (:func:`save`) deletes
older checkpoints only once the new one is complete (renamed into place).
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
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from dtensor_ulysses._safe_pickle import SafeUnpickler, UnsafePickle
from dtensor_ulysses.train import manifest

__all__ = [
    "ADMITTED",
    "DamagedCheckpoint",
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
    _raise_if_failed(whys, step, final, tmp)
    # the manifest, last: each rank checksums its share of the files, rank 0 writes it
    why, entries = None, {}
    rank, world = _rank(), _world()
    try:
        entries = manifest.checksum(tmp, manifest.files_of(tmp)[rank::world])
    except OSError as e:
        why = _write_failure(e)
    gathered = [(why, entries)]
    if world > 1:
        gathered = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(gathered, (why, entries))
    whys = [w for w, _ in gathered]
    _raise_if_failed(whys, step, final, tmp)
    why = None
    if _rank() == 0:
        try:
            manifest.write(tmp, {k: v for _, part in gathered for k, v in part.items()})
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
        except OSError as e:
            why = _write_failure(e)
    whys = [why]
    if world > 1:
        dist.broadcast_object_list(whys, src=0)
    _raise_if_failed([whys[0]], step, final, tmp)
    if _rank() == 0:
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


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _raise_if_failed(whys: list, step: int, final: Path, tmp: Path) -> None:
    """Every rank raises the same :class:`CheckpointWriteError` when any rank failed."""
    failed = [(r, w) for r, w in enumerate(whys) if w is not None]
    if not failed:
        return
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    rank, why = failed[0]
    where = f"rank {rank}: " if len(whys) > 1 else ""
    raise CheckpointWriteError(step, final, where + why)


class UnsafeCheckpoint(UnsafePickle):
    """A checkpoint file asks to load something other than plain data (code could run)."""


class DamagedCheckpoint(Exception):
    """A checkpoint failed while it was being loaded (on any rank; every rank raises it)."""


# DCP's metadata and what it holds, by exact module and qualified name: the only globals a
# .metadata file may name (torch's dtypes are admitted as the exact objects, see _CONSTANTS)
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
ADMITTED: frozenset[tuple[str, str]] = frozenset({
    *((_DCP_METADATA_MODULE, name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    )),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup of torch's layouts by name
    ("collections", "OrderedDict"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
})  # fmt: skip
# TensorProperties.__setstate__ only unpacks a tuple into attributes (its memory format from
# the enum above)
_SETSTATE_OK = frozenset({(_DCP_METADATA_MODULE, "TensorProperties")})
_CONSTANTS = {("torch", k): v for k, v in vars(torch).items() if isinstance(v, torch.dtype)}


def _pathlib_fix() -> frozenset[tuple[str, str]]:
    """pathlib's classes live in ``pathlib._local`` on Python >= 3.13 but pickle as
    ``pathlib.X``; admit each under the module its ``__module__`` names too."""
    import pathlib

    out = set()
    for module, name in ADMITTED:
        if module == "pathlib":
            cls = getattr(pathlib, name, None)
            if cls is not None and cls.__module__ != "pathlib":
                out.add((cls.__module__, name))
    return frozenset(out)


class _MetadataUnpickler(SafeUnpickler):
    """Admits exactly :data:`ADMITTED` (and torch's dtypes)."""

    def __init__(self, file) -> None:
        super().__init__(
            file, ADMITTED | _pathlib_fix(), constants=_CONSTANTS, setstate_ok=_SETSTATE_OK
        )

    def find_class(self, module: str, name: str) -> Any:
        if module == "pathlib" and (module, name) in ADMITTED:
            import pathlib

            cls = vars(pathlib).get(name)
            if isinstance(cls, type) and (cls.__module__, name) in self._admitted:
                module = cls.__module__  # resolved and checked under its own module
        return super().find_class(module, name)


def read_dcp_metadata(path: str | os.PathLike) -> Any:
    """DCP's ``Metadata`` of the checkpoint at ``path``, unpickled with only :data:`ADMITTED`
    (plain ``pickle.load``, DCP's own reader, would run any code in the file).

    Raises:
        UnsafeCheckpoint: the file names or calls anything else.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    with open(Path(path) / ".metadata", "rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except UnsafeCheckpoint:
            raise
        except UnsafePickle as e:
            raise UnsafeCheckpoint(str(e)) from None
    if type(metadata) is not Metadata:
        raise UnsafeCheckpoint(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class _SafeReader(FileSystemReader):
    """DCP's file reader, reading ``.metadata`` with :func:`read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = read_dcp_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
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
    state and the run's metadata; every ``rng_rank*.pt`` loads as plain data; the files and
    their sizes are those of ``manifest.json`` when there is one. Fast: reads the small files
    and a few bytes per item (:func:`load` checks every byte).
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
    try:
        files = manifest.read(path)
    except ValueError as e:
        return str(e)
    if files is not None:  # the files and their sizes (the bytes: in load(), on every rank)
        return manifest.check(path, files, checksums=False)
    return None


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 120 else text[:117] + "..."


def select_resume(
    ckpt_dir: str | os.PathLike, *, older_than: Path | None = None
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest intact checkpoint in ``ckpt_dir`` (or None), and the newer ones that are
    damaged, each with what is wrong (newest first). Incomplete ``*.tmp`` directories are not
    checkpoints and are ignored; ``older_than``: only checkpoints older than that one."""
    damaged: list[tuple[Path, str]] = []
    for p in _step_dirs(Path(ckpt_dir)):
        if older_than is not None and p.name >= Path(older_than).name:
            continue
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

    Call on every rank. First every byte is checked against ``manifest.json`` (each rank its
    share of the files), then the small files are read, then DCP loads the tensors through
    :class:`_SafeReader` and :class:`_SafeLoadPlanner`. The caller checks the metadata (model
    shape) first: see :func:`read_meta`.

    Raises:
        DamagedCheckpoint: on every rank alike, when any step failed on any rank (a checksum
            mismatch, a file that does not load, DCP's ``CheckpointException``); the model and
            optimizer may then hold part of it, the scheduler and RNG are untouched.
    """
    problem = None
    try:
        files = manifest.read(path)
        if files is not None:
            problem = manifest.check(path, files, rank=_rank(), world=_world())
        if problem is None:
            trainer = read_meta(path)
            read_dcp_metadata(path)  # refuses a .metadata that names anything but ADMITTED
            rng_file = path / f"rng_rank{_rank()}.pt"
            rng = _load_plain(rng_file) if rng_file.is_file() else None
    except Exception as e:
        problem = _failure(e)
    _agree(problem)
    try:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}  # loaded in place
        dcp.load(state, storage_reader=_SafeReader(path), planner=_SafeLoadPlanner())
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        problem = _failure(e)
    _agree(problem)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    scheduler.load_state_dict(trainer["scheduler"])
    if rng is not None:
        _set_rng_state(rng)
    return trainer


def _failure(e: BaseException) -> str:
    """A load failure in a few words (the first failure inside DCP's, with its rank)."""
    if isinstance(e, CheckpointException):
        failures = sorted(e.failures.items())
        if failures:
            rank, (inner, _) = failures[0][0], failures[0][1]
            return f"rank {rank}: {type(inner).__name__}: {_short(inner)}"
    return f"{type(e).__name__}: {_short(e)}"


def _agree(problem: str | None) -> None:
    """Raise :class:`DamagedCheckpoint` on every rank when ``problem`` is set on any."""
    problems = [problem]
    if _world() > 1:
        problems = [None] * _world()
        dist.all_gather_object(problems, problem)
    failed = [(r, p) for r, p in enumerate(problems) if p is not None]
    if failed:
        rank, what = failed[0]
        if len(problems) > 1 and not what.startswith("rank "):
            what = f"rank {rank}: {what}"
        raise DamagedCheckpoint(what)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
