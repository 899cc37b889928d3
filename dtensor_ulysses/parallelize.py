"""Apply the parallelisms to the built-in model, in a fixed order.

    1. Ulysses:  each block's attention runs through ``ulysses_attention`` on the ``sp`` axis;
                 everything else is token-wise and runs on the local sequence slice unchanged.
    2. Activation checkpointing (optional): each block recomputes its activations in backward.
    3. FSDP2 ``fully_shard`` on every block, then on the root, over the flattened ``dp x sp``
       ranks: sp ranks hold the same weights but see different tokens, so parameters, gradients
       and optimizer states shard over all ``dp * sp`` ranks.

The model is built on ``meta``, parallelized here, then materialized and initialized::

    model = build_model("llama3-1b")                        # meta: no memory
    parallelize(model, mesh, activation_checkpointing=True)
    model.to_empty(device="cuda"); init_weights(model, seed=0)

Gradients: FSDP2 *averages* gradients over the ``dp x sp`` ranks it shards on (it divides the
reduce-scatter by that world size). The loss in :mod:`dtensor_ulysses.loss` is normalized by the
global token count, whose gradients must be *summed* across ranks, so it is multiplied by
:func:`fsdp_world_size` before backward (see ``loss.loss_for_backward``).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from dtensor_ulysses.mesh import MESH_AXES, flatten_dp_sp
from dtensor_ulysses.model import Transformer

__all__ = ["parallelize", "fsdp_world_size", "default_mixed_precision"]


def default_mixed_precision(device_type: str) -> MixedPrecisionPolicy | None:
    """bf16 compute with fp32 gradient reduction on CUDA; ``None`` (full fp32) elsewhere."""
    if device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def fsdp_world_size(mesh: DeviceMesh) -> int:
    """Ranks FSDP2 shards over (and divides gradients by): ``dp * sp``."""
    return mesh.size()


def parallelize(
    model: Transformer,
    mesh: DeviceMesh,
    *,
    activation_checkpointing: bool = False,
    mixed_precision: MixedPrecisionPolicy | None | str = "auto",
    attention_backend: str = "auto",
    allow_uneven_heads: bool = False,
) -> Transformer:
    """Ulysses -> activation checkpointing -> ``fully_shard(blocks)`` -> ``fully_shard(root)``.

    Args:
        model: a :class:`~dtensor_ulysses.model.Transformer`, ideally still on ``meta``.
        mesh: the ``("dp", "sp")`` mesh from :func:`~dtensor_ulysses.mesh.init_mesh`.
        activation_checkpointing: recompute each block's activations in backward.
        mixed_precision: an FSDP2 ``MixedPrecisionPolicy``, ``None`` for full precision, or
            ``"auto"`` (bf16 compute + fp32 reduce on CUDA, fp32 on CPU).
        attention_backend: ``"auto"``, ``"flash_attn"`` or ``"sdpa"``.
        allow_uneven_heads: accept q heads not divisible by sp (ranks attend with ceil or floor
            of ``N / sp`` heads; a warning reports the imbalance).

    Returns:
        The same model, modified in place.

    Raises:
        ValueError: the mesh is not ``("dp", "sp")``, or the q heads are not divisible by sp
            (without ``allow_uneven_heads``).
    """
    if mesh.mesh_dim_names != MESH_AXES:
        raise ValueError(
            f"parallelize needs the {MESH_AXES} mesh from du.init_mesh, got axes "
            f"{mesh.mesh_dim_names}"
        )
    shape = model.shape
    sp = mesh["sp"].size()
    if shape.n_heads % sp and not allow_uneven_heads:
        raise ValueError(
            f"{shape.n_heads} heads of model {shape.name!r} are not divisible by sp={sp}; "
            f"choose sp in {{{', '.join(map(str, shape.valid_sp()))}}}"
        )

    # 1. Ulysses: attention sees head-sharded, full-length q/k/v (nothing to do when sp == 1).
    for block in model.layers:
        block.attention.sp_mesh = mesh["sp"] if sp > 1 else None
        block.attention.backend = attention_backend

    # 2. Activation checkpointing, per block (parameter names are unchanged).
    for block in model.layers:
        block.checkpoint = activation_checkpointing

    # 3. FSDP2 over the flattened dp x sp ranks: blocks first, then the root (embedding, final
    #    norm, output head; a tied output head stays with the embedding in the root group).
    if mixed_precision == "auto":
        mixed_precision = default_mixed_precision(mesh.device_type)
    fsdp_kwargs = {"mesh": flatten_dp_sp(mesh)}
    if mixed_precision is not None:
        fsdp_kwargs["mp_policy"] = mixed_precision
    for block in model.layers:
        fully_shard(block, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    return model
