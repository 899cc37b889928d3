"""How each implementation stores things: the accounting profiles the memory model reads.

A profile says what one RMSNorm and one SwiGLU keep for backward, what the loss keeps, how many
bytes per parameter the model states take (on the GPU and, offloaded, on the CPU) and which buffers
are fixed. ``dtensor-ulysses`` is this project (FSDP2 + ``dtensor_ulysses/models/llama.py``); the
others reproduce the setups of the published Hugging Face / DeepSpeed rows. Used by
:mod:`simulations.activations` and :mod:`simulations.memory`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["IMPL_PROFILES", "ImplProfile"]

GiB = 2**30


@dataclass(frozen=True)
class ImplProfile:
    """How an implementation stores things; the profiles differ only where the code differs.

    Attributes:
        name: profile key.
        norm_saved: bytes one RMSNorm keeps per hidden element, its output (the next matmul's
            saved input) included: eager with an fp32 upcast (HF ``LlamaRMSNorm``, PyTorch's
            composite ``rms_norm``) keeps the fp32 input (4), the normalized bf16 tensor for the
            weight gradient (2) and the output (2) = 8; a fused kernel keeps input and output = 4.
            ``None``: input and output in the activation dtype, ``2 e`` (this project's norm).
        mlp_saved: F-sized tensors the SwiGLU keeps: eager gate, up, silu(gate), product = 4; a
            fused SwiGLU keeps gate and up, the down projection its input = 3.
        mlp_bwd: F-sized gradients alive at once in the SwiGLU backward.
        loss_kept: bytes per vocab entry per token the caller keeps alive through backward
            (HF's model output holds the fp32 logits: 4; this project's loss returns a scalar: 0).
        gpu_state_bytes: bytes per parameter on the GPU (before sharding), ``(params, grads,
            optimizer)``, keyed by offload mode ``none``/``optimizer``/``params``.
        cpu_state_bytes: bytes per parameter on the CPU, same keys.
        loss_tile_bytes: fp32 logits of one loss tile (tiled loss).
        loss_tile_tokens: tokens of one loss tile, when the implementation fixes it instead.
        persistent_grads: gradient partitions stay allocated between steps (DeepSpeed ZeRO-3
            preallocates them); else they exist from backward to ``zero_grad(set_to_none=True)``.
        optimizer_temp: bytes per owned parameter of optimizer-step temporaries (torch AdamW
            ``foreach``: one fp32 gradient-sized buffer, assumption; DeepSpeed's fused Adam: 0).
        fixed_bytes: allocator-visible buffers that scale with neither the model nor the sequence
            (communication buckets, workspaces).
        head_unit: an untied embedding and output head are FSDP2 units of their own (this
            project's ``parallelize``): the head is gathered for the loss and freed with its
            backward, the embedding gathered only around its own forward and backward; else
            both sit in the root's unit, gathered from the start of forward to the end of
            backward. Such a model is sharded by FSDP2 on any number of ranks (one included,
            where the gathered copy is a cast without an all-gather buffer).
        staged_backward: a block's backward frees what each stage used before the next one
            runs, as this project's autograd functions do (traced): the MLP's saved tensors
            and its gradients before the attention's backward, the kernel's before the
            exchange of d(q, k, v); a replayed block's input is its checkpoint (counted once);
            the kernel's backward holds d o, d q, d k, d v in the activation dtype (the traced
            SDPA kernel; FlashAttention-2's fp32 d q accumulator and per-q-head d k, d v under
            GQA are a GPU kernel's own, :func:`simulations.activations.block_backward_stages`).
            The memory model then also evaluates the first block's backward (every other
            block's sharded gradient exists by then) besides the last block's, and counts the
            offloaded checkpoints and the host optimizer's temporaries at different moments
            (:func:`simulations.memory.estimate`). Else a replayed block's saved set stays
            whole through its backward, with the largest transient of
            :func:`~simulations.activations.block_backward_transients`.
        cast_block_inputs: FSDP2 casts each block's floating-point inputs to the compute dtype,
            so every block keeps its own copy of the RoPE tables (``cos``, ``sin``, ``[s, H/2]``
            each: ``e * H`` bytes per token), which the checkpoint keeps on the device (only
            the block input is offloaded); the float32 tables live during forward only.
    """

    name: str
    norm_saved: int | None
    mlp_saved: int
    mlp_bwd: int
    loss_kept: int
    gpu_state_bytes: dict[str, tuple[int, int, int]]
    cpu_state_bytes: dict[str, tuple[int, int, int]]
    loss_tile_bytes: int
    fixed_bytes: int
    loss_tile_tokens: int | None = None
    persistent_grads: bool = False
    optimizer_temp: int = 4
    head_unit: bool = False
    staged_backward: bool = False
    cast_block_inputs: bool = False


# FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) and AdamW: sharded fp32
# parameters (4), their fp32 gradients (4), Adam exp_avg + exp_avg_sq (8) = 16 bytes/param.
# --offload-optimizer (dtensor_ulysses.memory.HostOffloadAdamW) moves Adam's 8 to the host and
# keeps there an fp32 master copy (4) and a gradient buffer (4) as well: 16 host bytes/param;
# --offload-params (CPUOffloadPolicy) puts all 16 on the host. Traced: 16 + the CPU step's
# temporaries (optimizer_temp), to 0.1%.
_FSDP2_GPU = {"none": (4, 4, 8), "optimizer": (4, 4, 0), "params": (0, 0, 0)}
_FSDP2_CPU = {"none": (0, 0, 0), "optimizer": (4, 4, 8), "params": (4, 4, 8)}
# DeepSpeed ZeRO-3 bf16 (ALST's 18 bytes/param, row M2): bf16 parameters (2), fp32 gradients (4),
# fp32 master weights + Adam (12). With offload_optimizer the GPU keeps the bf16 parameter partition
# (2) and a bf16 gradient partition (2); fp32 gradients, master weights and Adam (16) go to the CPU.
_ZERO3_GPU = {"none": (2, 4, 12), "optimizer": (2, 2, 0), "params": (0, 0, 0)}
_ZERO3_CPU = {"none": (0, 0, 0), "optimizer": (0, 4, 12), "params": (2, 4, 12)}

IMPL_PROFILES: dict[str, ImplProfile] = {
    # This project: FSDP2 + dtensor_ulysses/models/llama.py. RMSNorm is a small autograd function
    # that keeps its input in its own dtype (e) and one fp32 scale per row (4/D per element, left
    # out), recomputing the rest over row chunks in backward (no [s, D] fp32 temporaries); its
    # output is the next matmul's input (e): 2e, 4 at bf16 as a fused kernel (traced; it was 10
    # with F.rms_norm on an fp32 upcast). Eager SwiGLU (4). The loss is computed inside the
    # model's forward and returns a scalar: the caller keeps no logits (loss_kept 0; traced).
    # The tiled MLP and loss (memory/tiling.py) keep their input only and write the input's gradient
    # chunk by chunk into one tensor; head-chunked attention (_head_stages.py) keeps q and the
    # exchanged k, v. Backward frees stage by stage (staged_backward); FSDP2 casts the RoPE
    # tables per block (cast_block_inputs).
    "dtensor-ulysses": ImplProfile(
        name="dtensor-ulysses", norm_saved=None, mlp_saved=4, mlp_bwd=3, loss_kept=0,
        gpu_state_bytes=_FSDP2_GPU, cpu_state_bytes=_FSDP2_CPU,
        loss_tile_bytes=GiB, fixed_bytes=256 * 2**20, loss_tile_tokens=2048, head_unit=True,
        staged_backward=True, cast_block_inputs=True,
    ),
    # Hugging Face Transformers eager modules + DeepSpeed ZeRO-3 (the Hugging Face blog, row M4);
    # the loss upcasts inside the loss function, the caller keeps no logits. DeepSpeed's buckets
    # ("auto": ~hidden^2 elements each) and live-parameter cache: 1 GiB (assumption).
    "hf-deepspeed": ImplProfile(
        name="hf-deepspeed", norm_saved=8, mlp_saved=4, mlp_bwd=3, loss_kept=0,
        gpu_state_bytes=_ZERO3_GPU, cpu_state_bytes=_ZERO3_CPU,
        loss_tile_bytes=GiB, fixed_bytes=GiB, persistent_grads=True, optimizer_temp=0,
    ),
    # As "hf-deepspeed" with fused RMSNorm and SwiGLU kernels (bf16 saved tensors only) and the
    # model output holding fp32 logits through backward: the storage that reproduces ALST's
    # Table 1 (row M3); see simulations/README.md.
    "hf-deepspeed-fused": ImplProfile(
        name="hf-deepspeed-fused", norm_saved=4, mlp_saved=3, mlp_bwd=3, loss_kept=4,
        gpu_state_bytes=_ZERO3_GPU, cpu_state_bytes=_ZERO3_CPU,
        loss_tile_bytes=GiB, fixed_bytes=GiB, persistent_grads=True, optimizer_temp=0,
    ),
    # Hugging Face eager modules on one GPU without DeepSpeed: fp32 parameters and gradients,
    # AdamW states on the GPU (16 bytes/param), autocast bf16 activations (row M4's 1-GPU figure).
    "hf": ImplProfile(
        name="hf", norm_saved=8, mlp_saved=4, mlp_bwd=3, loss_kept=0,
        gpu_state_bytes=_FSDP2_GPU, cpu_state_bytes=_FSDP2_CPU,
        loss_tile_bytes=GiB, fixed_bytes=256 * 2**20,
    ),
}  # fmt: skip
