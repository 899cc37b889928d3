"""The model spec: what the training loop needs of a model family, for the built-in model and
``--hf-model`` alike, so the loop itself never asks which one it trains (torchtitan's
``ModelSpec``).

A spec builds the sharded model with its optimizer and schedule, reads the corpora into what its
``get_batch`` slices, states the model's name, parameter count and training FLOPs per token (one
MFU convention for both, :func:`dtensor_ulysses.plan.training_flops_per_token`), and exports the
trained model at the end (``--save-hf``; nothing for the built-in model).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ulysses.data import PackedCorpus, get_batch
from dtensor_ulysses.memory import HostOffloadAdamW
from dtensor_ulysses.models import build_model, init_weights, model_flops_per_token, set_tiling
from dtensor_ulysses.parallel import parallelize
from dtensor_ulysses.plan import get_shape, training_flops_per_token
from dtensor_ulysses.plan.splits import default_loss_chunk
from dtensor_ulysses.train.cli import TrainConfig
from dtensor_ulysses.train.inputs import hf_dir, run_tokenizer

__all__ = ["ModelSpec", "lr_lambda", "make_optimizer", "model_spec"]


@dataclass(frozen=True)
class ModelSpec:
    """One model family, as the loop sees it.

    Attributes:
        build: ``(cfg, mesh, device, init) -> model``: on meta, memory features, parallelized
            with the run's recipe (``cfg.options()``, the one
            :class:`~dtensor_ulysses.plan.ParallelOptions` ``validate`` checked; its
            ``mixed_precision`` is FSDP2's), materialized, and (``init``) its initial weights.
        corpus: ``(cfg, paths, what) -> corpus`` that ``get_batch`` reads (``what`` names the
            flag in errors).
        get_batch: :func:`dtensor_ulysses.data.get_batch`, the same for both families (each
            corpus gives whole rows, the one slicer cuts them for the rank).
        describe: ``(cfg, model) -> (name, parameters, training FLOPs per token)``.
        export: ``(cfg, model) -> None``, the end-of-run export (``--save-hf``), or ``None``.
    """

    build: Callable[[TrainConfig, DeviceMesh, torch.device, bool], torch.nn.Module]
    corpus: Callable[[TrainConfig, list[str] | None, str], Any]
    describe: Callable[[TrainConfig, torch.nn.Module], tuple[str, int, float]]
    export: Callable[[TrainConfig, torch.nn.Module], None] | None = None
    get_batch: Callable[..., Any] = get_batch


def model_spec(cfg: TrainConfig) -> ModelSpec:
    """The spec of ``cfg``'s model: ``--hf-model DIR`` or a built-in preset."""
    return _HF if cfg.hf_model is not None else _BUILTIN


# ----------------------------------------------------------------------------------------------
# the built-in model
# ----------------------------------------------------------------------------------------------
def _build_builtin(
    cfg: TrainConfig, mesh: DeviceMesh, device: torch.device, init: bool
) -> torch.nn.Module:
    options = cfg.options()
    shape = get_shape(cfg.model or "tiny")
    local = cfg.local_tokens()
    model = build_model(shape, device="meta")
    set_tiling(
        model,
        loss_chunk_tokens=(options.loss_chunk_tokens or default_loss_chunk(local))
        if options.tiled_loss
        else None,
        mlp_chunk_tokens=(options.mlp_chunk_tokens or min(shape.dim, local))
        if options.tiled_mlp
        else None,
    )
    # the kernel validate chose for the model's layer kind (None: chosen by parallelize)
    parallelize(model, mesh, options, kernel=cfg.kernel_choice)
    # with FSDP2's CPU offload the sharded parameters live on the host (it copies them over)
    model.to_empty(device="cpu" if options.offload_params else device)
    if init:
        init_weights(model, seed=cfg.seed)
    return model


def _describe_builtin(cfg: TrainConfig, model: torch.nn.Module) -> tuple[str, int, float]:
    shape = get_shape(cfg.model or "tiny")
    return shape.name, shape.n_params, model_flops_per_token(shape, cfg.seq_len)


def _builtin_corpus(cfg: TrainConfig, paths: list[str] | None, what: str) -> PackedCorpus:
    try:
        return PackedCorpus.from_paths(paths, seq_len=cfg.seq_len)
    except ValueError as e:
        if paths and str(e).startswith("the corpus"):  # name the flag and its files
            named = ", ".join(map(repr, paths))
            raise ValueError(f"{what} {named}: {e}".replace(": the corpus has", " has")) from None
        raise


_BUILTIN = ModelSpec(
    build=_build_builtin,
    corpus=_builtin_corpus,
    describe=_describe_builtin,
)


# ----------------------------------------------------------------------------------------------
# a transformers checkpoint (--hf-model): imported on use, transformers is an optional extra
# ----------------------------------------------------------------------------------------------
def _build_hf(
    cfg: TrainConfig, mesh: DeviceMesh, device: torch.device, init: bool
) -> torch.nn.Module:
    """The transformers model from ``--hf-model``, each rank loading only its FSDP2 shards
    (the weights are the checkpoint's; ``init=False``, the memory trace: none are read)."""
    from dtensor_ulysses.hf import load_pretrained

    options = cfg.options()
    chunk = None
    if options.tiled_loss:
        chunk = options.loss_chunk_tokens or default_loss_chunk(cfg.local_tokens())
    assert cfg.hf_model is not None
    return load_pretrained(cfg.hf_model, mesh, device, options, loss_chunk_tokens=chunk,
                           weights=init)  # fmt: skip


def _hf_corpus(cfg: TrainConfig, paths: list[str] | None, what: str) -> Any:
    from dtensor_ulysses.hf import load_corpus

    try:
        return load_corpus(paths, run_tokenizer(cfg), cfg.seq_len)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def _describe_hf(cfg: TrainConfig, model: torch.nn.Module) -> tuple[str, int, float]:
    """Name, parameters (tied weights once; ``numel`` of an FSDP2 DTensor is its global size)
    and FLOPs per token under the built-in model's convention: the matrix-multiply weights (every
    weight of two or more dims but the input embedding, plus the output head, which for tied
    embeddings is the embedding matrix) and causal attention."""
    hf: Any = model.hf_model
    n_params = sum(p.numel() for p in model.parameters())
    embedding = hf.get_input_embeddings().weight
    head = hf.get_output_embeddings()
    n_matmul = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and p is not embedding)
    if head is None or head.weight is embedding:  # tied: the head multiplies by the embedding
        n_matmul += embedding.numel()
    from dtensor_ulysses.hf.models.causal_lm import config_head_dim

    text = hf.config.get_text_config()
    n_heads = int(text.num_attention_heads)
    head_dim = config_head_dim(text)
    flops = training_flops_per_token(
        n_matmul=n_matmul,
        n_layers=int(text.num_hidden_layers),
        n_heads=n_heads,
        head_dim=head_dim,
        seq_len=cfg.seq_len,
    )
    return f"{Path(hf_dir(cfg)).name} (--hf-model, {type(hf).__name__})", n_params, flops


def _export_hf(cfg: TrainConfig, model: torch.nn.Module) -> None:
    import torch.distributed as dist

    from dtensor_ulysses.hf import save_pretrained

    if cfg.save_hf is None:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        Path(cfg.save_hf).resolve().parent.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, cfg.save_hf, tokenizer=run_tokenizer(cfg))
    if rank == 0:
        print(f"saved the transformers model to {os.fspath(cfg.save_hf)}", flush=True)


_HF = ModelSpec(
    build=_build_hf,
    corpus=_hf_corpus,
    describe=_describe_hf,
    export=_export_hf,
)


# ----------------------------------------------------------------------------------------------
# optimizer and schedule: the same for every model family
# ----------------------------------------------------------------------------------------------
def make_optimizer(cfg: TrainConfig, model: torch.nn.Module):
    """AdamW (on the host with ``--offload-optimizer``) with weight decay on matrices only, and
    its warmup + cosine schedule; for the built-in model and transformers models alike."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    optimizer_cls = HostOffloadAdamW if cfg.options().offload_optimizer else torch.optim.AdamW
    optimizer = optimizer_cls(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


def lr_lambda(cfg: TrainConfig):
    """Multiplier of ``cfg.lr`` at a step: linear warmup, then cosine down to ``min_lr_ratio``."""
    import math

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        t = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.decay_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return f
