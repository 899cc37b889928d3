"""The one parallelize of transformers models: Ulysses -> activation checkpointing ->
``fully_shard(blocks)`` -> ``fully_shard(root)`` over ``dp x sp``, gradients summed (the order
and settings of :func:`dtensor_ulysses.parallelize`). ``--hf-model``, :func:`~dtensor_ulysses.hf.
with_ulysses` and a user's own loop all call it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from transformers import PreTrainedModel

from dtensor_ulysses.hf.models.causal_lm import HFCausalLM
from dtensor_ulysses.hf.models.routing import apply_ulysses, decoder_layers, unwrap
from dtensor_ulysses.parallel.apply import (
    checkpoint_blocks,
    default_mixed_precision,
    shard_blocks,
)
from dtensor_ulysses.parallel.mesh import MESH_AXES, ParallelDims, flatten_dp_sp
from dtensor_ulysses.plan.recipe import ParallelOptions

__all__ = ["parallelize", "parallelize_root"]


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    activation_checkpointing: bool = False,
    offload_activations: bool = False,
    offload_params: bool = False,
    head_chunks: int = 1,
    mixed_precision: MixedPrecisionPolicy | None | str = "auto",
    attention_backend: str = "auto",
    allow_uneven_heads: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Ulysses -> activation checkpointing -> ``fully_shard(layers)`` -> ``fully_shard(root)``.

    The order and FSDP2 settings of :func:`dtensor_ulysses.parallelize` (gradients summed over
    ``dp x sp``, for the token-weighted loss), on a transformers model or an
    :class:`HFCausalLM` (then the root). Options as there; ``compute_dtype`` is the dtype
    attention computes in, for the kernel choice (default: the mixed-precision policy's, else
    the parameters'; ``with_ulysses`` passes autocast's). The one parallelize of transformers
    models: ``--hf-model`` and ``with_ulysses`` both call it.
    """
    if mesh.mesh_dim_names != MESH_AXES:
        raise ValueError(f"parallelize needs the {MESH_AXES} mesh, got {mesh.mesh_dim_names}")
    if isinstance(model, FSDPModule):
        raise ValueError("the model is already parallelized; build a new one (on meta)")
    ParallelOptions(
        activation_checkpointing=activation_checkpointing,
        offload_activations=offload_activations, offload_params=offload_params,
        head_chunks=head_chunks, attention_backend=attention_backend,
        allow_uneven_heads=allow_uneven_heads, mixed_precision=mixed_precision,
    ).check(hf_model=True)  # fmt: skip
    hf = unwrap(model)
    if isinstance(model, HFCausalLM):  # the ranks that share a batch (a router loss's group)
        model.__dict__["_du_loss_group"] = flatten_dp_sp(mesh).get_group()
    return parallelize_root(
        model, hf, mesh, activation_checkpointing=activation_checkpointing,
        offload_activations=offload_activations, offload_params=offload_params,
        head_chunks=head_chunks, mixed_precision=mixed_precision,
        attention_backend=attention_backend, allow_uneven_heads=allow_uneven_heads,
        compute_dtype=compute_dtype,
    )  # fmt: skip


def parallelize_root(
    root: nn.Module,
    hf: PreTrainedModel,
    mesh: DeviceMesh,
    *,
    activation_checkpointing: bool,
    offload_activations: bool,
    offload_params: bool,
    head_chunks: int,
    mixed_precision: MixedPrecisionPolicy | None | str,
    attention_backend: str,
    allow_uneven_heads: bool,
    compute_dtype: torch.dtype | None,
) -> nn.Module:
    """:func:`parallelize`'s steps on ``hf`` inside ``root`` (the module FSDP2 shards last: the
    model itself, an :class:`HFCausalLM`, or a trainer's wrapper such as a PEFT model)."""
    if mixed_precision == "auto":
        mixed_precision = default_mixed_precision(mesh.device_type)
    if compute_dtype is None:
        compute_dtype = getattr(mixed_precision, "param_dtype", None)
    # 1. Ulysses (always, also at sp=1: the engine is where packed documents are handled)
    apply_ulysses(
        hf, ParallelDims.from_mesh(mesh).sp_group(mesh), head_chunks=head_chunks,
        backend=attention_backend, allow_uneven_heads=allow_uneven_heads,
        compute_dtype=compute_dtype,
    )  # fmt: skip
    _, layers = decoder_layers(hf)
    # 2. activation checkpointing, per decoder layer (names unchanged)
    if activation_checkpointing:
        checkpoint_blocks(layers, offload=offload_activations)
    # 3. FSDP2 over dp x sp: layers, then the root (embeddings, final norm, output head),
    #    gradients summed (the built-in model's step, shared)
    shard_blocks(root, layers, mesh, mixed_precision=mixed_precision, offload_params=offload_params)
    return root
