"""Apply the parallelisms to the built-in model from outside, in a fixed order.

(The module is ``parallel``, not ``parallelize``: a submodule named like the function would
replace ``du.parallelize`` with the module as soon as it is imported.)

    1. Ulysses:  each block's ``attention.inner_attention`` (the local kernel) is wrapped in the
                 Ulysses engine on the ``sp`` group (with ``head_chunks`` stages, if asked);
                 everything else is token-wise and runs on the local sequence slice unchanged.
                 Nothing to do when sp = 1 and there is one stage. On a ``("dp", "ring",
                 "sp")`` mesh (Ulysses x Ring) the kernel the engine wraps is
                 :class:`~dtensor_ulysses.attention.RingAttention` over the ``ring`` group (used
                 directly when sp = 1 and there is one stage); the model passes the step's
                 layout, whose document starts are global.
    2. Activation checkpointing (optional): each block recomputes its activations in backward;
                 with ``offload_activations`` the one input each block keeps lives on the host.
                 After Ulysses, so the recomputed forward also repeats the block's all-to-alls
                 (the checkpoint keeps only the block input, never head-sharded tensors).
    3. ``torch.compile`` per block (optional): after checkpointing, so the recompute is part of
       the compiled region; the all-to-alls run as functional collectives there (no graph break).
    4. FSDP2 ``fully_shard`` on every block, then on the root, over the flattened ``dp x sp``
       ranks (``dp x ring x sp`` with a ring): sp ranks hold the same weights but see different
       tokens, so parameters, gradients and optimizer states shard over all ``dp * sp`` ranks
       (on the host with ``offload_params``). Last, because it must see the final module
       structure (its hooks wrap each block's forward, checkpointing included).

The model is built on ``meta``, parallelized here, then materialized and initialized::

    model = build_model("llama3-1b")                        # meta: no memory
    parallelize(model, mesh, ParallelOptions(activation_checkpointing=True))
    model.to_empty(device="cuda"); init_weights(model, seed=0)

(``parallelize(model, mesh, activation_checkpointing=True)`` is the same: the options as
keywords instead of the object.)

Gradients: the loss (:mod:`dtensor_ulysses.models.loss`) is each rank's token sum divided by the
*global* token count, so the single-device gradient is the *sum* of the rank gradients. FSDP2's
reduce-scatter would average over the ``dp x sp`` ranks; its divide factor is set to 1 so that
it sums (as torchtitan does), and nothing is undone later. Both FSDP2 methods used for that
(``set_gradient_divide_factor``, ``set_force_sum_reduction_for_comms``) are public.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from dtensor_ulysses.attention.kernels import AttnFeatures, KernelChoice, choose_kernel
from dtensor_ulysses.attention.local import LocalAttention
from dtensor_ulysses.attention.ring import RingAttention
from dtensor_ulysses.attention.ulysses import UlyssesAttention
from dtensor_ulysses.memory.offload import fsdp_offload_policy
from dtensor_ulysses.memory.recompute import checkpoint_module, offload_checkpoints
from dtensor_ulysses.models.llama import Attention, Transformer
from dtensor_ulysses.parallel.mesh import MESH_AXES, RING_MESH_AXES, ParallelDims, flatten_dp_sp
from dtensor_ulysses.plan.recipe import PARALLELIZE, ParallelOptions

__all__ = ["checkpoint_blocks", "default_mixed_precision", "parallelize", "shard_blocks"]


def default_mixed_precision(device_type: str) -> MixedPrecisionPolicy | None:
    """bf16 compute with fp32 gradient reduction on CUDA; ``None`` (full fp32) elsewhere."""
    if device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def parallelize(
    model: Transformer,
    mesh: DeviceMesh,
    options: ParallelOptions | None = None,
    *,
    kernel: KernelChoice | None = None,
    **keywords: Any,
) -> Transformer:
    """Ulysses -> activation checkpointing -> ``fully_shard(blocks)`` -> ``fully_shard(root)``.

    The recipe comes as one :class:`~dtensor_ulysses.plan.ParallelOptions` (``options``), or
    as its fields by keyword (``parallelize(model, mesh, activation_checkpointing=True)``), not
    both (a ``ValueError``; change an object's field with ``dataclasses.replace``). Checked once
    here (:meth:`~dtensor_ulysses.plan.ParallelOptions.check`, with the model's heads and the
    mesh's sp). This function applies the fields below; an object's other fields are the
    caller's to apply (the tiled loss and MLP: :func:`~dtensor_ulysses.models.set_tiling`; the
    optimizer's offload: :class:`~dtensor_ulysses.memory.HostOffloadAdamW`), as the trainer's
    model spec does. Keywords other than the fields below are refused.

    Args:
        model: a :class:`~dtensor_ulysses.models.Transformer`, ideally still on ``meta``, not yet
            parallelized.
        mesh: the ``("dp", "sp")`` mesh from :func:`~dtensor_ulysses.parallel.init_mesh`, or its
            ``("dp", "ring", "sp")`` mesh (``init_mesh(dp, sp, ring=R)``) for Ulysses x Ring.
        options: the recipe, whose fields this function reads:

            * ``activation_checkpointing``: recompute each block's activations in backward.
            * ``offload_activations``: with checkpointing, keep each block's input in host
              memory until its recompute (:mod:`dtensor_ulysses.memory.offload`).
            * ``offload_params``: parameters, gradients and optimizer states on the host
              (FSDP2's ``CPUOffloadPolicy``; the optimizer then steps on the CPU).
            * ``head_chunks``: attention in this many stages per block (head-chunked Ulysses,
              see :class:`~dtensor_ulysses.attention.UlyssesAttention`); must divide the heads
              per rank.
            * ``overlap_comm``: hide the all-to-alls behind compute
              (``UlyssesAttention(overlap=True)``): k and v move while q is projected, and with
              ``head_chunks > 1`` each stage's all-to-alls overlap the neighbouring stages'
              attention; same values, more memory in flight.
            * ``compile``: ``torch.compile`` each block (a backend name, e.g. ``"aot_eager"``;
              ``True`` is the default backend, inductor).
            * ``mixed_precision``: an FSDP2 ``MixedPrecisionPolicy``, ``None`` for full
              precision, or ``"auto"`` (bf16 compute + fp32 reduce on CUDA, fp32 on CPU).
            * ``attention_backend``: ``"auto"`` or a kernel name
              (:data:`~dtensor_ulysses.attention.BACKENDS`); chosen here once per layer kind
              (:func:`~dtensor_ulysses.attention.choose_kernel`, packed documents or not) and
              stored on the layer; with a ring, the kernel of its blocks (``"auto"``,
              ``"blockwise"`` or ``"flash_attn"``).
            * ``allow_uneven_heads``: accept q heads not divisible by sp (ranks attend with
              ceil or floor of ``N / sp`` heads; a warning reports the imbalance).
        kernel: the kernel choice already made for the model's one layer kind (the trainer's
            ``validate`` makes it before any process group exists); stored on every layer as
            it is. ``None``: chosen here.
        **keywords: the fields above as keywords, instead of ``options``.

    Returns:
        The same model, modified in place.

    Raises:
        ValueError: the mesh is not ``("dp", "sp")`` or ``("dp", "ring", "sp")``; both an
            object and keywords, or an unknown keyword; the q heads are not divisible by sp
            (without ``allow_uneven_heads``) or fewer than sp; ``head_chunks`` does not divide
            the heads per rank; ``offload_activations`` without checkpointing; the model was
            parallelized before; ``kernel`` chosen for another layer kind; an explicit
            ``attention_backend`` that cannot run the layers
            (:class:`~dtensor_ulysses.attention.AttentionBackendError`).
    """
    if mesh.mesh_dim_names not in (MESH_AXES, RING_MESH_AXES):
        raise ValueError(
            f"parallelize needs the {MESH_AXES} mesh from du.init_mesh (or {RING_MESH_AXES} "
            f"from du.init_mesh(dp, sp, ring=R)), got axes {mesh.mesh_dim_names}"
        )
    if isinstance(model, FSDPModule):
        raise ValueError("the model is already parallelized; build a new one (on meta)")
    opts = ParallelOptions.at_door(options, keywords, door=PARALLELIZE)
    shape = model.shape
    dims = ParallelDims.from_mesh(mesh)
    opts.check(n_heads=shape.n_heads, sp=dims.sp, ring=dims.ring,
               heads_name=f"heads of model {shape.name!r}")  # fmt: skip

    # 1. Ulysses: attention sees head-sharded, full-length q/k/v; with a ring axis the kernel
    #    is ring attention over it (Ulysses x Ring). The kernel is chosen here (or was, by the
    #    caller), once per layer kind, and stored on the layer (an explicit one that cannot run
    #    it is refused now).
    mixed_precision = opts.mixed_precision
    if mixed_precision == "auto":
        mixed_precision = default_mixed_precision(mesh.device_type)
    param = next(iter(model.parameters()), None)
    dtype = getattr(mixed_precision, "param_dtype", None) or (
        param.dtype if param is not None else torch.float32
    )
    choices: dict[AttnFeatures, KernelChoice] = {}
    for block in model.layers:
        attention: Attention = block.attention  # type: ignore[assignment]
        inner = attention.inner_attention
        features = AttnFeatures(causal=getattr(inner, "causal", True))
        if isinstance(inner, LocalAttention):
            features = AttnFeatures.of(causal=inner.causal, window=inner.window,
                                       chunk=inner.chunk, softcap=inner.softcap)  # fmt: skip
        if features not in choices:
            choices[features] = _layer_choice(
                kernel, features, device_type=mesh.device_type, dtype=dtype,
                head_dim=shape.head_dim, requested=opts.attention_backend,
                compiled=opts.compile is not None, ring=dims.ring > 1,
            )  # fmt: skip
        if dims.ring > 1:
            inner = RingAttention(mesh, causal=features.causal, backend=opts.attention_backend)
            attention.inner_attention = inner
        if isinstance(inner, (LocalAttention, RingAttention)):
            inner.backend = opts.attention_backend
            inner.kernel_choice = choices[features]
        if dims.sp > 1 or opts.head_chunks > 1:
            attention.inner_attention = UlyssesAttention(
                inner, dims.sp_mesh, head_chunks=opts.head_chunks, overlap=opts.overlap_comm
            )

    # 2. Activation checkpointing, per block (parameter names are unchanged).
    if opts.activation_checkpointing:
        checkpoint_blocks(model.layers, offload=opts.offload_activations)

    # 3. torch.compile per block (torchtitan's granularity: one graph per block).
    if opts.compile is not None:
        for block in model.layers:
            block.compile(backend=opts.compile, fullgraph=True)

    # 4. FSDP2 over the flattened dp x sp ranks: blocks, the embedding and the output head
    #    each on their own (freed as soon as they are done), then the root (the final norm).
    #    A tied output head is the embedding: it stays in the root's group, unsharded from
    #    the embedding's forward to the loss's backward.
    untied = model.output is not None
    shard_blocks(
        model, model.layers, mesh, mixed_precision=mixed_precision,
        offload_params=opts.offload_params, embedding=model.tok_embeddings if untied else None,
        head=model.output,
    )  # fmt: skip
    return model


def _layer_choice(
    kernel: KernelChoice | None, features: AttnFeatures, *, ring: bool, **choose: Any
) -> KernelChoice:
    """``kernel`` (the caller's choice) when it was made for this layer kind, else the choice
    made here (:func:`~dtensor_ulysses.attention.choose_kernel`)."""
    if kernel is None:
        return choose_kernel(features, ring=ring, **choose)
    if (kernel.label, kernel.ring) != (features.label, ring):
        raise ValueError(
            f"kernel={kernel.describe()!r} was chosen for {kernel.label!r} layers"
            f"{' in a ring' if kernel.ring else ''}, but the model has {features.label!r} layers"
            f"{' in a ring' if ring else ''}; pass kernel=None to choose here"
        )
    return kernel


def checkpoint_blocks(blocks, *, offload: bool = False) -> None:
    """Step 2: activation checkpointing on every block; with ``offload``, one offloader shared
    by the blocks (block ``i``'s backward prefetches block ``i-1``'s input)."""
    for block in blocks:
        checkpoint_module(block)
    if offload:
        offload_checkpoints(blocks)


def shard_blocks(
    model: torch.nn.Module,
    blocks,
    mesh: DeviceMesh,
    *,
    mixed_precision: MixedPrecisionPolicy | None | str = "auto",
    offload_params: bool = False,
    embedding: torch.nn.Module | None = None,
    head: torch.nn.Module | None = None,
) -> None:
    """Step 4: ``fully_shard`` each block, then the root, over the flattened ``dp x sp`` ranks
    (``dp x ring x sp`` on a ring mesh),
    with gradients *summed* (the loss is already normalized by the global token count).

    ``embedding`` and ``head`` (untied only), when given, are units of their own: the
    embedding is freed after its forward and gathered again for its backward (the last of the
    step); the head, whose backward follows its forward at once, stays gathered until its
    backward is done (``reshard_after_forward=False``), then frees its weight and reduces its
    gradient. In the root's group both would stay gathered, with the head's gradient, through
    the whole backward: ``2 V D`` bf16 bytes plus the gradient (3 GiB for llama3-8b).

    Divide factor 1 with sum-only collectives is a plain SUM reduce-scatter (gloo has no
    PREMUL_SUM, and on NCCL a pre-multiply by 1 is wasted work).
    """
    if mixed_precision == "auto":
        mixed_precision = default_mixed_precision(mesh.device_type)
    fsdp_kwargs: dict = {"mesh": flatten_dp_sp(mesh)}
    if mixed_precision is not None:
        fsdp_kwargs["mp_policy"] = mixed_precision
    if offload_params:
        fsdp_kwargs["offload_policy"] = fsdp_offload_policy(mesh)
    for block in blocks:
        fully_shard(block, **fsdp_kwargs)
    if embedding is not None:
        fully_shard(embedding, **fsdp_kwargs)
    if head is not None:
        fully_shard(head, reshard_after_forward=False, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
