"""The one parallelize of transformers models: Ulysses -> activation checkpointing ->
``fully_shard(blocks)`` -> ``fully_shard(root)`` over ``dp x sp``, gradients summed (the order
and settings of :func:`dtensor_ulysses.parallelize`). ``--hf-model``, :func:`~dtensor_ulysses.hf.
with_ulysses` and a user's own loop all call it.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from transformers import PreTrainedModel

from dtensor_ulysses.hf.models.causal_lm import HFCausalLM
from dtensor_ulysses.hf.models.routing import (
    apply_ulysses,
    decoder_layers,
    sliced_dropout,
    unwrap,
)
from dtensor_ulysses.parallel.apply import (
    checkpoint_blocks,
    default_mixed_precision,
    shard_blocks,
)
from dtensor_ulysses.parallel.mesh import MESH_AXES, ParallelDims, flatten_dp_sp
from dtensor_ulysses.plan.recipe import HF_PARALLELIZE, ParallelOptions

__all__ = ["parallelize", "parallelize_root"]


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    options: ParallelOptions | None = None,
    *,
    compute_dtype: torch.dtype | None = None,
    **keywords: Any,
) -> nn.Module:
    """Ulysses -> activation checkpointing -> ``fully_shard(layers)`` -> ``fully_shard(root)``.

    The order and FSDP2 settings of :func:`dtensor_ulysses.parallelize` (gradients summed over
    ``dp x sp``, for the token-weighted loss), on a transformers model or an
    :class:`HFCausalLM` (then the root). The recipe is a
    :class:`~dtensor_ulysses.plan.ParallelOptions` (``options``) or its fields as keywords, not
    both; this function applies ``activation_checkpointing``, ``offload_activations``,
    ``offload_params``, ``head_chunks``, ``mixed_precision``, ``attention_backend`` and
    ``allow_uneven_heads`` (as :func:`dtensor_ulysses.parallelize` does), and refuses the
    built-in model's own (``overlap_comm``, ``compile``, ``tiled_mlp``); an object's loss and
    optimizer fields are the caller's (``HFCausalLM(loss_chunk_tokens=...)``, the trainer's
    optimizer). ``compute_dtype`` is the dtype attention computes in, for the kernel choice
    (default: the mixed-precision policy's, else the parameters'; ``with_ulysses`` passes
    autocast's). The one parallelize of transformers models: ``--hf-model`` and
    ``with_ulysses`` both call it (``with_ulysses`` through :func:`parallelize_root`).

    Raises:
        ValueError: not the ``("dp", "sp")`` mesh; the model was parallelized before; both an
            object and keywords, an unknown keyword, or a combination
            :meth:`~dtensor_ulysses.plan.ParallelOptions.check` refuses.
    """
    if mesh.mesh_dim_names != MESH_AXES:
        raise ValueError(f"parallelize needs the {MESH_AXES} mesh, got {mesh.mesh_dim_names}")
    if isinstance(model, FSDPModule):
        raise ValueError("the model is already parallelized; build a new one (on meta)")
    opts = ParallelOptions.at_door(options, keywords, door=HF_PARALLELIZE)
    hf = unwrap(model)
    n_heads = hf.config.get_text_config().num_attention_heads
    opts.check(hf_model=True, n_heads=n_heads, sp=ParallelDims.from_mesh(mesh).sp,
               heads_name=f"q heads of {type(hf).__name__}")  # fmt: skip
    if isinstance(model, HFCausalLM):  # the ranks that share a batch (a router loss's group)
        model.__dict__["_du_loss_group"] = flatten_dp_sp(mesh).get_group()
    return parallelize_root(model, hf, mesh, opts, compute_dtype=compute_dtype)


def parallelize_root(
    root: nn.Module,
    hf: PreTrainedModel,
    mesh: DeviceMesh,
    options: ParallelOptions,
    *,
    compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    """:func:`parallelize`'s steps on ``hf`` inside ``root`` (the module FSDP2 shards last: the
    model itself, an :class:`HFCausalLM`, or a trainer's wrapper such as a PEFT model), with
    ``options`` already checked by the caller's front door."""
    # 0. dropout that would train on slices: said once (rank 0), for a model that trains
    dropout = sliced_dropout(root, hf)
    if dropout and any(p.requires_grad for p in root.parameters()) and dist.get_rank() == 0:
        warnings.warn(f"dtensor_ulysses: {dropout}", UserWarning, stacklevel=2)
    mixed_precision = options.mixed_precision
    if mixed_precision == "auto":
        mixed_precision = default_mixed_precision(mesh.device_type)
    if compute_dtype is None:
        compute_dtype = getattr(mixed_precision, "param_dtype", None)
    # 1. Ulysses (always, also at sp=1: the engine is where packed documents are handled)
    apply_ulysses(
        hf, ParallelDims.from_mesh(mesh).sp_mesh, head_chunks=options.head_chunks,
        backend=options.attention_backend, allow_uneven_heads=options.allow_uneven_heads,
        compute_dtype=compute_dtype,
    )  # fmt: skip
    _, layers = decoder_layers(hf)
    # 2. activation checkpointing, per decoder layer (names unchanged)
    if options.activation_checkpointing:
        checkpoint_blocks(layers, offload=options.offload_activations)
    # 3. FSDP2 over dp x sp: layers, then the root (embeddings, final norm, output head),
    #    gradients summed (the built-in model's step, shared)
    shard_blocks(root, layers, mesh, mixed_precision=mixed_precision,
                 offload_params=options.offload_params)  # fmt: skip
    return root
