"""transformers checkpoints in and out of FSDP2 shards: safetensors, tokenizers.

* :func:`load_pretrained` builds the model on ``meta``, parallelizes it, materializes only the
  shards and fills them from the safetensors files one tensor at a time
  (:func:`~dtensor_ulysses.models.weights.copy_full_`): no rank ever holds the whole model.
* :func:`save_pretrained` gathers one full tensor at a time; rank 0 writes ``config.json`` and
  safetensors shards that ``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from dtensor_ulysses._file_modes import apply_umask
from dtensor_ulysses.hf.models._expert_weights import CheckpointNames, checkpoint_format
from dtensor_ulysses.hf.models.causal_lm import HFCausalLM
from dtensor_ulysses.hf.models.parallelize import parallelize
from dtensor_ulysses.hf.models.routing import unwrap
from dtensor_ulysses.models.weights import bare_name, copy_full_
from dtensor_ulysses.plan.recipe import HF_PARALLELIZE, ParallelOptions

__all__ = [
    "check_model_dir",
    "check_tokenizer",
    "check_weights",
    "load_pretrained",
    "load_tokenizer",
    "load_weights",
    "save_pretrained",
]


# ----------------------------------------------------------------------------------------------
# safetensors in
# ----------------------------------------------------------------------------------------------
def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / n for n in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{str(directory)!r} has no safetensors weights (model.safetensors or an index); "
            f"save the model with save_pretrained(..., safe_serialization=True)"
        )
    return files


def check_model_dir(directory: str | os.PathLike) -> Path:
    """A local model directory with ``config.json`` and safetensors weights, or ValueError."""
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"model directory {str(path)!r} does not exist (a local directory)")
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    _weight_files(path)
    return path


def load_weights(model: nn.Module, directory: str | os.PathLike) -> None:
    """Fill ``model`` (plain or FSDP2-sharded, materialized) from a directory's safetensors,
    one full tensor at a time, each rank keeping its shard.

    Raises:
        ValueError: a missing, unexpected or wrongly shaped tensor (weights that do not match
            the config).
    """
    hf = unwrap(model)
    targets: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        targets[bare_name(name)] = p
    persistent = set(hf.state_dict().keys())
    for name, b in model.named_buffers():
        if bare_name(name) in persistent:
            targets[bare_name(name)] = b

    def copy(file: Path, key: str, names: CheckpointNames, reader: Any) -> list[str]:
        filled = names.add(key, reader.get_tensor(key))  # per-expert pieces fill a fused tensor
        for name, full in filled.items():
            param = targets[name]
            if tuple(full.shape) != tuple(param.shape):
                raise ValueError(
                    f"weights do not match the config: {name} has shape {tuple(full.shape)} "
                    f"in {file.name}, the model built from config.json expects "
                    f"{tuple(param.shape)}"
                )
            copy_full_(param, full.to(param.dtype))
        return list(filled)

    missing, unexpected, names = _walk_weights(Path(directory), hf, targets, copy)
    partial = sorted(t for t, left in names.pieces.items() if left)
    if missing or unexpected:
        raise ValueError(
            f"weights do not match the config of {type(hf).__name__}: "
            + (f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''} " if missing else "")
            + (f"unexpected {unexpected[:5]}" if unexpected else "")
            + (f"; fused from incomplete pieces: {partial[:3]}" if partial else "")
        )


@contextlib.contextmanager
def _reading(file: Path) -> Iterator[None]:
    """A weights file that cannot be read is a ``ValueError`` naming it (safetensors raises its
    own error types too); anything else keeps its traceback."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        raise ValueError(f"cannot read weights file {str(file)!r}: {e}") from None
    except Exception as e:
        if type(e).__name__ != "SafetensorError":
            raise
        raise ValueError(f"cannot read weights file {str(file)!r}: {e}") from None


def _walk_weights(
    directory: Path,
    hf: PreTrainedModel,
    expected: Collection[str],
    visit: Callable[[Path, str, CheckpointNames, Any], list[str]],
) -> tuple[list[str], list[str], CheckpointNames]:
    """The one walk over a model directory's safetensors keys (``load_weights`` copies,
    ``check_weights`` compares shapes). Checkpoint keys are mapped to the model's names first
    (``CheckpointNames``: per-expert pieces name the fused parameter they fill, transformers'
    own mapping); then ``visit(file, key, names, reader)`` runs for each tensor the model
    expects, in file order, one at a time, and returns the model names it filled.

    Returns:
        ``(missing, unexpected, names)``: expected names nothing filled (tied parameters
        excepted), checkpoint keys the model does not have (those it ignores on load
        excepted), and the key mapping.
    """
    ignore = list(getattr(hf, "_keys_to_ignore_on_load_unexpected", None) or [])
    files = _weight_files(directory)
    keys: list[str] = []
    for file in files:
        if not file.is_file():
            raise ValueError(f"weights file {str(file)!r} (named by the index) does not exist")
        with _reading(file), safe_open(str(file), framework="pt", device="cpu") as f:
            keys += list(f.keys())
    names = CheckpointNames.of(hf, keys, expected)
    seen: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with contextlib.ExitStack() as stack:
            with _reading(file):
                reader = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
                file_keys = list(reader.keys())
            for key in file_keys:
                if names.target[key] not in expected:
                    if not any(re.search(p, key) for p in ignore):
                        unexpected.append(key)
                    continue
                seen.update(visit(file, key, names, reader))
    tied = _tied_names(hf)
    missing = sorted(k for k in expected if k not in seen and k not in tied)
    return missing, unexpected, names


def _tied_names(hf: PreTrainedModel) -> set[str]:
    """Names of parameters that are the same tensor as an earlier one (tied embeddings)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, p in hf.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.setdefault(id(p), name)
    return tied


@torch.no_grad()
def _init_buffers(hf: PreTrainedModel, check: bool = True) -> None:
    """Recompute the non-persistent buffers that ``to_empty`` left blank (RoPE frequencies,
    Gemma's embedding scale) with the model's own ``_init_weights``, as transformers does when
    it loads from ``meta`` (parameters it also resets are loaded from the checkpoint after).

    Raises:
        ValueError: a floating-point buffer that ``_init_weights`` did not set (checked with a
            NaN sentinel).
    """
    persistent = set(hf.state_dict().keys())
    for mname, module in hf.named_modules():
        own = dict(module.named_buffers(recurse=False))
        blank = [n for n in own if (f"{mname}.{n}" if mname else n) not in persistent]
        if not blank:
            continue
        for n in blank:
            if own[n].is_floating_point():
                own[n].fill_(float("nan"))
        hf._init_weights(module)
        if not check:  # fake tensors (the memory trace) hold no values to check
            continue
        unset = [n for n in blank if getattr(module, n).isnan().any()]
        if unset:
            raise ValueError(
                f"{mname} ({type(module).__name__}) has buffers {unset} that are not in the "
                f"checkpoint and that its _init_weights does not recompute"
            )


def load_pretrained(
    directory: str | os.PathLike,
    mesh: DeviceMesh,
    device: torch.device | str,
    options: ParallelOptions | None = None,
    *,
    loss_chunk_tokens: int | None = None,
    weights: bool = True,
    **keywords: Any,
) -> HFCausalLM:
    """``config.json`` + safetensors -> an FSDP2-sharded, Ulysses-routed :class:`HFCausalLM`.

    Built on ``meta``, parallelized by :func:`parallelize` with ``options`` (a
    :class:`~dtensor_ulysses.plan.ParallelOptions`, or its fields as ``keywords``), then only
    this rank's shards are allocated (on the host with ``offload_params``) and filled;
    ``weights=False``: left unfilled, and only ``config.json`` is read (the memory tracer).
    ``loss_chunk_tokens``: the tiled loss's rows per chunk (``None``: the full logits).
    """
    opts = ParallelOptions.at_door(options, keywords, door=HF_PARALLELIZE)
    path = check_model_dir(directory) if weights else Path(directory)
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = HFCausalLM(hf, loss_chunk_tokens=loss_chunk_tokens)
    parallelize(model, mesh, opts)
    model.to_empty(device="cpu" if opts.offload_params else device)
    _init_buffers(hf, check=weights)
    if weights:
        load_weights(model, path)
    return model


# ----------------------------------------------------------------------------------------------
# safetensors out
# ----------------------------------------------------------------------------------------------
def save_pretrained(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    tokenizer: Any = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write a directory that ``AutoModelForCausalLM.from_pretrained`` loads; call on every rank.

    Each full tensor is gathered in turn (one all-gather per sharded tensor); rank 0 keeps
    them on the host until a shard file of ``max_shard_bytes`` is full, then writes it. The
    directory appears complete or not at all (written beside it, then renamed).

    Args:
        model: a (parallelized) transformers model or :class:`HFCausalLM`.
        directory: the output directory (replaced if it exists).
        tokenizer: also saved, when given.
        dtype: the saved dtype (default: the config's ``dtype``, else the parameters').
    """
    hf = unwrap(model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = Path(directory)
    if dtype is None:
        dtype = getattr(hf.config, "dtype", None)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    tied = _tied_names(hf)
    persistent = set(hf.state_dict().keys())
    tensors = [
        (bare_name(n), t)
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if bare_name(n) in persistent and bare_name(n) not in tied
    ]
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent)) if rank == 0 else None
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    as_saved = checkpoint_format(hf)  # fused experts -> per-expert tensors, as transformers saves
    for name, t in tensors:
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if rank != 0:
            continue
        full = full.detach().to("cpu", dtype if dtype and full.is_floating_point() else None)
        n = full.numel() * full.element_size()
        if size and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        for key, piece in as_saved(name, full).items():
            shards[-1][key] = piece.contiguous()
        size += n
    if rank == 0:
        assert tmp is not None
        names = (
            ["model.safetensors"]
            if len(shards) == 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        for fname, shard in zip(names, shards):
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {}, "weight_map": {k: f for f, s in zip(names, shards) for k in s}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        hf.config.save_pretrained(tmp)  # _attn_implementation is not written
        if getattr(hf, "generation_config", None) is not None:
            hf.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        apply_umask(tmp)  # mkdtemp makes it 0700: readable by the group, as checkpoints are
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    if dist.is_initialized():
        dist.barrier()


# ----------------------------------------------------------------------------------------------
# tokenizer and the trainer's build
# ----------------------------------------------------------------------------------------------
def load_tokenizer(directory: str | os.PathLike) -> Any:
    """``AutoTokenizer.from_pretrained`` of a local directory, or ValueError."""
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"tokenizer directory {str(path)!r} does not exist")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {str(path)!r}: {e}") from None


def check_tokenizer(tokenizer: Any, config: Any) -> None:
    """The tokenizer's ids must fit the model's embedding (ValueError otherwise)."""
    vocab = config.get_text_config().vocab_size
    if len(tokenizer) > vocab:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's embedding has "
            f"{vocab} rows; use the model's own tokenizer (--tokenizer)"
        )


def check_weights(directory: str | os.PathLike) -> None:
    """The safetensors tensors (names and shapes, read from the file headers) are those of the
    model that ``config.json`` builds.

    Raises:
        ValueError: naming the first differences (shapes, missing, unexpected tensors), or a
            weights file that cannot be read.
    """
    directory = Path(directory)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    want = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    wrong: list[str] = []

    def compare(file: Path, key: str, names: CheckpointNames, reader: Any) -> list[str]:
        name = names.target[key]
        if names.pattern[key] is not None:  # a per-expert piece: checked once fused, on load
            return [name]
        with _reading(file):
            got = tuple(reader.get_slice(key).get_shape())
        if got != want[name]:
            wrong.append(f"{key} {got} (config: {want[name]})")
        return [name]

    missing, unexpected, _ = _walk_weights(directory, hf, want, compare)
    if wrong or missing or unexpected:
        parts = [
            f"{label} {items[:3]}{' ...' if len(items) > 3 else ''}"
            for label, items in (
                ("shapes differ:", wrong),
                ("missing", missing),
                ("unexpected", unexpected),
            )  # fmt: skip
            if items
        ]
        raise ValueError(
            f"the weights in {str(directory)!r} do not match its config.json "
            f"({type(hf).__name__}): {'; '.join(parts)}"
        )
