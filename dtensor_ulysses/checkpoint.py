"""Save and resume training with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory ``step_00000042/`` holding the sharded model and optimizer state
(DCP: each rank writes its own shards, any (dp, sp) can load them), ``trainer.pt`` (scheduler,
step, config) and ``rng_rank{r}.pt`` (each rank's RNG state). It is written to ``*.tmp`` and
renamed when every rank has finished, so a run killed mid-save leaves the previous checkpoint as
the newest one.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["save", "latest", "load"]

_STEP_DIR = re.compile(r"^step_(\d{8})$")


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
) -> Path:
    """Write the checkpoint of ``step`` (steps completed) under ``ckpt_dir``; returns its path."""
    final = Path(ckpt_dir) / f"step_{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng_rank{_rank()}.pt")
    if _rank() == 0:
        trainer = {"step": step, "scheduler": scheduler.state_dict(), "meta": meta}
        torch.save(trainer, tmp / "trainer.pt")
    _barrier()
    if _rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    _barrier()
    return final


def latest(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``ckpt_dir`` (``*.tmp`` leftovers ignored), or None."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return None
    steps = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    complete = [p for p in steps if (p / "trainer.pt").is_file()]
    return max(complete, key=lambda p: p.name, default=None)


def read_meta(path: Path) -> dict:
    """The trainer metadata (step, config) of a checkpoint, without loading the tensors."""
    return torch.load(path / "trainer.pt", weights_only=False)


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
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}  # loaded in place
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    scheduler.load_state_dict(trainer["scheduler"])
    rng = path / f"rng_rank{_rank()}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=False))
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
