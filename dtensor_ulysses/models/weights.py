"""Weights into parameters, whatever the sharding: deterministic init, and full values to shards.

A parameter may be a plain tensor or an FSDP2 ``DTensor`` shard. :func:`copy_full_` puts a full
value into either (each rank keeps its own part, cut without communication), and loads a full
checkpoint tensor into FSDP2 shards. :func:`init_weights` draws only the rows each rank holds,
with values that do not depend on the sharding, so a plain model and a sharded one start equal.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from dtensor_ulysses._torch_private import local_shape_and_offset
from dtensor_ulysses.models.layers import RMSNorm

__all__ = ["INIT_STD", "bare_name", "copy_full_", "init_std", "init_weights"]

INIT_STD = 0.02

# Prefixes that wrappers insert into parameter names (activation checkpointing, FSDP1, compile);
# seeds and checkpoint keys use the bare name.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def bare_name(name: str) -> str:
    """``name`` without the prefixes that wrappers insert (``layers.0._checkpoint_wrapped_module.
    attention.wq.weight -> layers.0.attention.wq.weight``)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@torch.no_grad()
def copy_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full value ``full`` into ``param``: all of it, or this rank's shard of it.

    Raises:
        ValueError: ``full`` does not have the parameter's full shape.
    """
    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(
            f"a value of shape {tuple(full.shape)} cannot fill a parameter of shape "
            f"{tuple(param.shape)}"
        )
    if isinstance(param, DTensor):
        # src_data_rank=None: each rank keeps its own chunk of `full`, no scatter.
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full)


def _generator(seed: int, name: str) -> torch.Generator:
    """CPU generator for one parameter: seeded with CRC-32 of ``name`` started from ``seed``.

    torch's CPU generator (mt19937) keeps only 32 bits of its seed, so ``seed`` and the name are
    combined into 32 bits; for a fixed name, distinct seeds give distinct generator seeds (CRC-32 is
    a bijection of its start value).
    """
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed} must be in [0, 2**32)")
    return torch.Generator(device="cpu").manual_seed(zlib.crc32(name.encode(), seed))


# Rows drawn per generator: about this many elements a block, so a block is a few MiB at most.
ROW_BLOCK_ELEMENTS = 1 << 20


def _rows_per_block(shape: tuple[int, ...]) -> int:
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, ROW_BLOCK_ELEMENTS // max(1, row))


def _draw_rows(
    shape: tuple[int, ...], lo: int, hi: int, std: float, seed: int, name: str
) -> torch.Tensor:
    """Rows ``[lo, hi)`` of the full value of parameter ``name``, drawn block by block.

    Row block ``b`` (rows ``[b*R, (b+1)*R)``, ``R`` from the shape alone) is drawn from a
    generator seeded by ``zlib.crc32(f"{name}#{b}", seed)``: any range of rows gets the values
    the full draw has there, and only the blocks that overlap the range are drawn.
    """
    rows, rest = shape[0], tuple(shape[1:])
    per = _rows_per_block(shape)
    out = torch.empty((hi - lo, *rest), dtype=torch.float32)
    for b in range(lo // per, -(-hi // per)):
        b_lo, b_hi = b * per, min(rows, (b + 1) * per)
        s, e = max(lo, b_lo), min(hi, b_hi)
        gen = _generator(seed, f"{name}#{b}")
        if (s, e) == (b_lo, b_hi):  # the whole block lies in the range: draw in place
            out[s - lo : e - lo].normal_(0.0, std, generator=gen)
        else:
            block = torch.empty((b_hi - b_lo, *rest), dtype=torch.float32)
            block.normal_(0.0, std, generator=gen)
            out[s - lo : e - lo] = block[s - b_lo : e - b_lo]
    return out


def _local_rows(param: torch.Tensor) -> tuple[int, int] | None:
    """The rows ``[lo, hi)`` of the full parameter that this rank holds, when its part is a block
    of whole rows (a plain tensor, or FSDP2's ``Shard(0)``); ``None`` for any other layout."""
    if not isinstance(param, DTensor):
        return (0, param.shape[0]) if param.dim() else None
    found = local_shape_and_offset(param)
    if found is None:  # a torch without the helper: the caller draws the full value
        return None
    shape, offset = found
    if param.dim() == 0 or tuple(shape[1:]) != tuple(param.shape[1:]) or any(offset[1:]):
        return None
    if tuple(param.to_local().shape) != tuple(shape):
        return None
    return offset[0], offset[0] + shape[0]


def init_std(name: str, module: nn.Module, n_layers: int) -> float | None:
    """Std of the normal init of parameter ``name`` of ``module``, or ``None`` for a norm gain.

    Linear and embedding weights are ``N(0, 0.02^2)``; the projections into the residual stream
    (``wo``, ``w2``) use std ``0.02 / sqrt(2 * n_layers)``; norm gains are ones.
    """
    if isinstance(module, RMSNorm):
        return None
    if name.endswith(("wo.weight", "w2.weight")):  # projections into the residual stream
        return INIT_STD / math.sqrt(2 * n_layers)
    return INIT_STD


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0) -> None:
    """Deterministic weights of the built-in model, identical whatever the sharding.

    Each parameter's full value is a float32 draw on CPU from ``normal(0, std)``, made of row
    blocks: block ``b`` of the rows (about :data:`ROW_BLOCK_ELEMENTS` elements; the block size
    depends on the parameter's shape only) comes from a generator seeded by
    ``zlib.crc32(f"{name}#{b}", seed)``, where ``name`` is the parameter's
    ``named_parameters()`` name without wrapper prefixes. Each rank draws only the blocks that
    overlap the rows it holds (FSDP2 shards dim 0), so no rank ever materializes a full
    parameter: the CPU time and the memory are ``O(n_params / ranks)`` per rank (about 3 s per
    1e8 parameters a rank on one core), and the values are the same for any sharding. Stds come
    from :func:`init_std`; norm weights are ones. A sharded layout that is
    not a block of rows falls back to drawing the full value and keeping this rank's part.

    Args:
        model: a materialized :class:`~dtensor_ulysses.models.Transformer` (built on a device, or
            on meta then ``to_empty``), plain or wrapped by ``fully_shard`` / checkpointing.
        seed: base seed in ``[0, 2**32)``.

    Raises:
        RuntimeError: a parameter is still on ``meta``.
        ValueError: ``seed`` outside ``[0, 2**32)``.
    """
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed} must be in [0, 2**32)")
    shape: Any = model.shape  # the built-in model's ModelShape
    n_layers = int(shape.n_layers)
    for module_name, module in model.named_modules():
        for param_name, p in module.named_parameters(recurse=False):
            name = bare_name(f"{module_name}.{param_name}" if module_name else param_name)
            if p.is_meta:
                raise RuntimeError(
                    f"{name} is on meta; materialize the model first, e.g. "
                    f"model.to_empty(device=...)"
                )
            std = init_std(name, module, n_layers)
            local = p.to_local() if isinstance(p, DTensor) else p
            if std is None:
                local.fill_(1.0)
                continue
            rows = _local_rows(p)
            shape = tuple(p.shape)
            if rows is None:
                copy_full_(p, _draw_rows(shape, 0, shape[0], std, seed, name))
            elif rows[1] > rows[0]:
                local.copy_(_draw_rows(shape, rows[0], rows[1], std, seed, name))
