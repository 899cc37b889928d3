"""Full (unsharded) model and optimizer state of an FSDP2 model for the Trainer's files.

The Trainer writes ``model.safetensors`` / ``adapter_model.safetensors``, ``optimizer.pt`` and
``scheduler.pt`` from the main process. Under FSDP2 every rank holds a shard, so the full
tensors are gathered first (a collective on every rank; rank 0 keeps them on the host) with
``torch.distributed.checkpoint.state_dict``; loading reads the full files on every rank and each
keeps its shard. The files are the ones a single-process run writes, so a checkpoint moves
between layouts (and to ``from_pretrained``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = [
    "base_model",
    "full_model_state",
    "is_peft",
    "load_model_files",
    "load_optimizer",
    "load_optimizer_state",
    "optimizer_state",
    "raw_optimizer",
    "start_from_rank0",
]

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)


def is_peft(model: nn.Module) -> bool:
    """A ``peft.PeftModel`` (or FSDP2's class swap of one)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (or ``model`` itself)."""
    return model.get_base_model() if is_peft(model) else model  # type: ignore[operator]


def raw_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer``."""
    return getattr(optimizer, "optimizer", optimizer)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every full tensor on rank 0 (host), ``{}`` elsewhere; call on every rank."""
    return get_model_state_dict(model, options=_GATHER)  # type: ignore[return-value]


def optimizer_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The full optimizer state keyed by parameter names, on rank 0; call on every rank."""
    return get_optimizer_state_dict(model, raw_optimizer(optimizer), options=_GATHER)


def load_optimizer(model: nn.Module, optimizer: Any, path: Path) -> None:
    """Load :func:`optimizer_state`'s file on every rank; each keeps its shard."""
    load_optimizer_state(model, optimizer, torch.load(path, map_location="cpu", weights_only=True))


def load_optimizer_state(model: nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
    """Load a full optimizer state (:func:`optimizer_state`'s) on every rank; each keeps its
    shard."""
    set_optimizer_state_dict(
        model, raw_optimizer(optimizer), state, options=StateDictOptions(full_state_dict=True)
    )


def _read(directory: Path, stem: str) -> dict[str, torch.Tensor] | None:
    index = directory / f"{stem}.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for name in files:
            out.update(load_file(str(directory / name)))
        return out
    single = directory / f"{stem}.safetensors"
    return load_file(str(single)) if single.is_file() else None


def load_model_files(model: nn.Module, directory: str | Path) -> None:
    """Fill the (sharded) ``model`` from a checkpoint the Trainer wrote: ``model.safetensors``
    (or its index), or for a PEFT model ``adapter_model.safetensors``.

    Raises:
        ValueError: no weights there, or a weight of the model missing from them.
    """
    path = Path(directory)
    own = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    if is_peft(model):
        saved = _read(path, "adapter_model")
        if saved is None:
            raise ValueError(f"{str(path)!r} has no adapter_model.safetensors to resume from")
        adapter = getattr(model, "active_adapter", "default")
        full = {}
        for key in own:
            short = key.replace(f".{adapter}.", ".")
            if short in saved:
                full[key] = saved[short]
        if len(full) != len(saved):
            raise ValueError(
                f"{len(saved) - len(full)} of {len(saved)} adapter weights in {str(path)!r} "
                f"match no parameter of the model (another adapter configuration?)"
            )
    else:
        saved = _read(path, "model")
        if saved is None:
            raise ValueError(f"{str(path)!r} has no model.safetensors to resume from")
        full = {k: v for k, v in saved.items() if k in own}
        cfg = getattr(base_model(model), "config", None)
        tied = bool(getattr(cfg.get_text_config(), "tie_word_embeddings", False)) if cfg else False
        missing = [k for k in own if k not in saved and not (tied and "lm_head" in k)]
        if missing:
            raise ValueError(f"{str(path)!r} lacks {len(missing)} weights, e.g. {missing[:3]}")
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, dict(full), options=options)


def _checksums(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Two float64 sums per tensor (plain, and weighted by position mod 7 so that moved values
    count), on ``device``."""
    out = []
    for t in tensors:
        x = t.detach().to(device=device, dtype=torch.float64).flatten()
        w = torch.arange(x.numel(), device=device, dtype=torch.float64).remainder_(7).add_(1)
        out.append(torch.stack([x.sum(), (x * w).sum()]))
    return torch.stack(out) if out else torch.zeros(0, 2, dtype=torch.float64, device=device)


def start_from_rank0(model: nn.Module, group: Any, device: torch.device) -> list[str]:
    """Make every rank of ``group`` hold rank 0's parameters and buffers, as DDP does when it
    wraps a model (``fully_shard`` keeps each rank's own values for its shard).

    Ranks differ when a head is newly initialized on each rank (a sequence-classification
    ``score`` loaded from a causal checkpoint, a value head) by RNG streams that differ. Only the
    tensors whose checksums differ from rank 0's on some rank are broadcast (one all-reduce of
    the checksums otherwise). Collective on ``group``.

    Returns:
        The names of the tensors that were broadcast.
    """
    named = list(model.named_parameters()) + list(model.named_buffers())
    seen: set[int] = set()
    names, tensors = [], []
    for name, t in named:
        if id(t) not in seen:
            seen.add(id(t))
            names.append(name)
            tensors.append(t)
    mine = _checksums(tensors, device)
    ref = mine.clone()
    dist.broadcast(ref, group_src=0, group=group)
    differ = (mine != ref).any(-1).to(torch.int32)  # NaN differs from itself: broadcast too
    dist.all_reduce(differ, op=dist.ReduceOp.MAX, group=group)
    moved = []
    for i in differ.nonzero().flatten().tolist():
        t = tensors[i]
        buf = t.detach().to(device).contiguous()
        dist.broadcast(buf, group_src=0, group=group)
        with torch.no_grad():
            t.copy_(buf.to(t.device))
        moved.append(names[i])
    return moved
