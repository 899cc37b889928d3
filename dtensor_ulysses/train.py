"""Train a Llama-style decoder with FSDP2 + Ulysses sequence parallelism on a ``(dp, sp)`` mesh.

Run (CPU with gloo, or GPUs with NCCL — the same command)::

    # 2 processes, Ulysses over both, the tiny preset on the built-in data (Python's stdlib sources)
    torchrun --standalone --nproc-per-node 2 -m dtensor_ulysses.train --dp 1 --sp 2 --steps 40

    # 8 GPUs: 2 data-parallel groups x 4-way sequence parallelism, 32K tokens per sequence
    torchrun --standalone --nproc-per-node 8 -m dtensor_ulysses.train --dp 2 --sp 4 \\
        --model llama3-1b --seq-len 32768 --batch-size 2 --steps 100 --activation-checkpointing

    # a Hugging Face checkpoint (config.json + safetensors) on chat JSONL, saved for from_pretrained
    torchrun --standalone --nproc-per-node 8 -m dtensor_ulysses.train --dp 1 --sp 8 \\
        --hf-model /models/Qwen3-8B --data sft.jsonl --seq-len 32768 --batch-size 8 \\
        --activation-checkpointing --tiled-loss --eval-data heldout.jsonl --save-hf runs/final

    # multi-node (run on every node; NODE0 is the first node's address)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint NODE0:29500 \\
        -m dtensor_ulysses.train --dp 2 --sp 8 --model llama3-8b --seq-len 131072

``--batch-size`` is the *global* batch: any (dp, sp) with the same global batch, seed and data
trains on the same tokens and gives the same losses (up to floating-point reduction order).

The shape of the trainer: ``parse_args -> validate -> build -> train_step -> train`` (the loop),
and ``main``, the only place that turns a :class:`UsageError` into one ``error:`` line; any other
exception keeps its traceback and ends every rank with a non-zero status. Its parts, each name
re-exported here (import them from ``dtensor_ulysses.train``):

* ``_train_cli.py``: :class:`TrainConfig`, :func:`parse_args` and :class:`UsageError`;
* ``_train_checks.py``: :func:`validate`, every check before a process group exists (the memory
  preflight last);
* ``_train_inputs.py``: the ``--hf-model`` directory (config, weights, tokenizer) and the
  corpora, read while validating and cached for the run;
* ``_train_resume.py``: the checkpoint ``--resume`` loads, whether it fits this run, and saving;
* this file: :func:`build`, :func:`train_step`, the loop (:func:`train`) and :func:`main`.

Per step (:func:`train_step`): each rank reads its ``[b, S/sp]`` slice of the global batch and
the step's sequence layout (``data.get_batch``), the model runs on it (attention through
Ulysses), the loss is the token-weighted cross entropy over the whole global batch (``loss.py``),
FSDP2 reduce-scatters (sums) gradients, the global gradient norm is clipped, and AdamW steps with
a linear-warmup + cosine schedule. The schedule depends on ``--warmup-steps`` and
``--decay-steps`` only, never on ``--steps``, so ``--steps 4`` equals ``--steps 2`` followed by
``--steps 4 --resume``.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ulysses import checkpoint as ckpt
from dtensor_ulysses._exit import exit_process, leave_together
from dtensor_ulysses._train_checks import _local_tokens, validate
from dtensor_ulysses._train_cli import TrainConfig, UsageError, parse_args
from dtensor_ulysses._train_guard import (
    GuardStop,
    RunGuard,
    catch_stop_signals,
    clear_rank_note,
    prepare_cuda_allocator,
)
from dtensor_ulysses._train_inputs import _corpus, _hf_dir, _tokenizer
from dtensor_ulysses._train_inputs import _hf_shape as _hf_shape  # re-exported (the tests use it)
from dtensor_ulysses._train_resume import _checkpoint_meta, _save
from dtensor_ulysses.data import Batch, get_batch
from dtensor_ulysses.loss import global_valid_tokens
from dtensor_ulysses.mesh import default_device_type, flatten_dp_sp, init_mesh
from dtensor_ulysses.metrics import StepLogger
from dtensor_ulysses.model import build_model, model_flops_per_token, set_tiling
from dtensor_ulysses.offload import HostOffloadAdamW
from dtensor_ulysses.parallel import parallelize
from dtensor_ulysses.presets import get_shape
from dtensor_ulysses.weights import init_weights

__all__ = [
    "StepResult",
    "TrainConfig",
    "UsageError",
    "build",
    "forward_backward",
    "main",
    "parse_args",
    "train",
    "train_step",
    "validate",
]


def build(cfg: TrainConfig, mesh: DeviceMesh, device: torch.device, *, init: bool = True):
    """Model on meta -> tiling -> parallelize -> materialize -> init; AdamW and its schedule.

    Args:
        cfg: a validated configuration.
        mesh: the ``("dp", "sp")`` mesh.
        device: where the model computes.
        init: draw the initial weights (``False`` leaves them uninitialized: for memory tracing
            under fake tensors, where values do not matter).

    With ``cfg.hf_model`` this is :func:`dtensor_ulysses.hf.model.build`: the transformers model
    from its directory, each rank loading only its FSDP2 shards.
    """
    if cfg.hf_model is not None:
        from dtensor_ulysses.hf.model import build as build_hf

        return build_hf(cfg, mesh, device)
    shape = get_shape(cfg.model or "tiny")
    local = _local_tokens(cfg)
    model = build_model(shape, device="meta")
    set_tiling(
        model,
        loss_chunk_tokens=(cfg.loss_chunk_tokens or min(2048, local)) if cfg.tiled_loss else None,
        mlp_chunk_tokens=(cfg.mlp_chunk_tokens or min(shape.dim, local)) if cfg.tiled_mlp else None,
    )
    parallelize(
        model,
        mesh,
        activation_checkpointing=cfg.activation_checkpointing,
        offload_activations=cfg.offload_activations,
        offload_params=cfg.offload_params,
        head_chunks=cfg.head_chunks,
        overlap_comm=cfg.overlap_comm,
        compile=cfg.compile or False,
        attention_backend=cfg.attention_backend,
        allow_uneven_heads=cfg.allow_uneven_heads,
    )
    # with FSDP2's CPU offload the sharded parameters live on the host (it copies them over)
    model.to_empty(device="cpu" if cfg.offload_params else device)
    if init:
        init_weights(model, seed=cfg.seed)
    return (model, *make_optimizer(cfg, model))


def make_optimizer(cfg: TrainConfig, model: torch.nn.Module):
    """AdamW (on the host with ``--offload-optimizer``) with weight decay on matrices only, and
    its warmup + cosine schedule; for the built-in model and transformers models alike."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    optimizer_cls = HostOffloadAdamW if cfg.offload_optimizer else torch.optim.AdamW
    optimizer = optimizer_cls(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


def lr_lambda(cfg: TrainConfig):
    """Multiplier of ``cfg.lr`` at a step: linear warmup, then cosine down to ``min_lr_ratio``."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        t = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.decay_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return f


@dataclass
class StepResult:
    """What one training step reports (the same on every rank)."""

    loss: float  # mean cross entropy over the global batch's valid tokens
    tokens: int  # valid tokens in the global batch
    grad_norm: float | None  # global gradient norm before clipping (None: no clipping)
    skipped: bool = False  # non-finite, and not applied (``skip_nonfinite``)


def forward_backward(
    model: torch.nn.Module, batch: Batch, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, int]:
    """Forward and backward of this rank's slice; returns ``(local loss sum, global tokens)``.

    The value differentiated is ``local_sum / global_tokens``: the rank losses add up to the
    global-batch mean and FSDP2 sums their gradients, so the gradients equal the single-device
    ones. ``group``: the ``dp x sp`` ranks that share the batch.
    """
    local_sum = model(batch.input_ids, batch.position_ids, layout=batch.layout, labels=batch.labels)
    n_valid = global_valid_tokens(batch.labels, group)
    (local_sum / n_valid).backward()
    return local_sum.detach(), n_valid


def train_step(
    model: torch.nn.Module,
    batch: Batch,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    group: dist.ProcessGroup | None = None,
    grad_clip: float = 1.0,
    skip_nonfinite: bool = False,
) -> StepResult:
    """One optimizer step on the global batch of which ``batch`` is this rank's slice.

    ``skip_nonfinite``: when the global loss or gradient norm is not finite, apply no update
    (the schedule still advances) and return ``skipped=True``.
    """
    local_sum, n_valid = forward_backward(model, batch, group)
    grad_norm = None
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    loss_sum = local_sum.reshape(1)
    if skip_nonfinite:  # the reduced loss first: every rank decides alike
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(loss_sum, group=group)
        loss = loss_sum.item() / n_valid
        if not (math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))):
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            return StepResult(loss, n_valid, grad_norm, skipped=True)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if not skip_nonfinite and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(loss_sum, group=group)
    return StepResult(loss_sum.item() / n_valid, n_valid, grad_norm)


def train(cfg: TrainConfig) -> list[dict]:
    """Train in this process's group (created here from the torchrun environment if needed).

    Returns the per-step records; every rank returns the same (loss and counts are reduced).
    A step with an evaluation (``--eval-every``, and the last step with ``--eval-data``) also
    holds ``eval_loss``, ``eval_perplexity`` and ``eval_tokens``.
    """
    with catch_stop_signals():  # SIGTERM / SIGUSR1: stop after the step, checkpointed
        return _train(cfg)[0]


def _train(cfg: TrainConfig) -> tuple[list[dict], torch.nn.Module]:
    """:func:`train`, also returning the trained (sharded) model."""
    device_type = cfg.device or default_device_type()
    assert cfg.sp is not None, "call validate(cfg, world_size) first: it resolves sp"
    mesh = init_mesh(
        cfg.dp, cfg.sp, ring=cfg.ring, device_type=device_type, timeout_s=cfg.collective_timeout_s
    )
    rank = dist.get_rank()
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(device_type)
    dp_rank, sp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("sp")
    ring_kw = {"ring": cfg.ring, "ring_rank": mesh.get_local_rank("ring")} if cfg.ring > 1 else {}
    group = flatten_dp_sp(mesh).get_group()

    corpus = _corpus(cfg, cfg.data)
    eval_corpus = _corpus(cfg, cfg.eval_data, what="--eval-data") if cfg.eval_data else None
    batch_fn = get_batch
    if cfg.hf_model is not None:
        from dtensor_ulysses.hf.data import get_batch as batch_fn  # type: ignore[assignment]
    model, optimizer, scheduler = build(cfg, mesh, device)
    meta = _checkpoint_meta(cfg)
    start, path = 0, None
    if cfg.resume:  # validate() chose the newest intact checkpoint
        assert cfg.checkpoint_dir is not None
        if cfg.resume_from:
            path = Path(cfg.resume_from)
        else:  # train() called without validate()'s choice
            path = ckpt.select_resume(cfg.checkpoint_dir)[0]
        if path is None:
            raise UsageError(f"--resume: no intact checkpoint in {cfg.checkpoint_dir!r}")
        try:
            start = ckpt.load(path, model, optimizer, scheduler)["step"]
        except Exception as e:  # damage that verify() cannot see (e.g. bytes overwritten)
            raise UsageError(
                f"--resume: checkpoint {path} cannot be loaded ({type(e).__name__}: "
                f"{' '.join(str(e).split())[:200]}); move it aside to resume from an older one"
            ) from None
    if cfg.hf_model is not None:
        # numel() of an FSDP2 DTensor parameter is its global size; tied weights count once
        n_params = sum(p.numel() for p in model.parameters())
        text = model.config.get_text_config()
        n_heads = int(text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // n_heads)
        n_layers = int(text.num_hidden_layers)
        flops_per_token = 6.0 * n_params + 6.0 * n_layers * n_heads * head_dim * cfg.seq_len
        name = f"{Path(_hf_dir(cfg)).name} (--hf-model, {type(model.hf_model).__name__})"
    else:
        shape = get_shape(cfg.model or "tiny")
        n_params = shape.n_params
        flops_per_token = model_flops_per_token(shape, cfg.seq_len)
        name = shape.name
    if rank == 0:
        print(
            f"model {name} ({n_params / 1e6:.2f}M params) | mesh dp={cfg.dp} x "
            + (f"ring={cfg.ring} x " if cfg.ring > 1 else "")
            + f"sp={cfg.sp} on {device_type} | seq {cfg.seq_len}, global batch {cfg.batch_size} | "
            f"data: {'stdlib sources' if not cfg.data else ', '.join(cfg.data)} "
            f"({corpus.n_tokens / 1e6:.1f}M tokens, {len(corpus)} windows) | pack-docs "
            f"{'on' if cfg.pack_docs else 'off'} | steps {start}->"
            f"{cfg.steps}" + (f" | resumed from {path}" if path else ""),
            flush=True,
        )
    logger = StepLogger(
        total_steps=cfg.steps,
        flops_per_token=flops_per_token,
        n_gpus=mesh.size(),
        device=device,
        metrics_file=cfg.metrics_file,
        is_main=rank == 0,
    )
    records = []
    saved = start if cfg.resume else None
    guard = RunGuard(cfg, rank, device)  # stop signals, non-finite steps, --overwrite
    model.train()
    for step in range(start, cfg.steps):
        guard.before_step(step + 1, model)
        t0 = time.perf_counter()
        batch = batch_fn(
            corpus, step, global_batch_size=cfg.batch_size, dp_rank=dp_rank, dp=cfg.dp,
            sp_rank=sp_rank, sp=cfg.sp, seed=cfg.seed, pack_docs=cfg.pack_docs, uneven=True,
            **ring_kw,
        ).to(device)  # fmt: skip
        result = train_step(
            model, batch, optimizer, scheduler, group=group, grad_clip=cfg.grad_clip,
            skip_nonfinite=cfg.skip_nonfinite,
        )  # fmt: skip
        guard.check_finite(step + 1, result.loss, result.grad_norm, skipped=result.skipped)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        extra: dict = {"lr": scheduler.get_last_lr()[0], **guard.counts()}
        if result.grad_norm is not None:
            extra["grad_norm"] = result.grad_norm
        done = step + 1
        if eval_corpus is not None and (
            done == cfg.steps or (cfg.eval_every and done % cfg.eval_every == 0)
        ):
            extra.update(_evaluate(cfg, model, eval_corpus, dp_rank, sp_rank, group, device))
        records.append(logger.log(done, result.loss, result.tokens, elapsed, **extra))
        guard.heartbeat(records[-1])
        if "eval_loss" in extra and rank == 0:
            print(
                f"eval after step {done} | loss {extra['eval_loss']:.4f} | perplexity "
                f"{extra['eval_perplexity']:.2f} | {extra['eval_tokens']} tokens",
                flush=True,
            )
        if cfg.checkpoint_dir and cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
            _save(cfg, done, model, optimizer, scheduler, meta)
            saved = done
        if done < cfg.steps and guard.stop_requested():  # every rank agrees
            if cfg.checkpoint_dir and saved != done:
                _save(cfg, done, model, optimizer, scheduler, meta)
            raise guard.preempted(done)
    if cfg.checkpoint_dir and saved != cfg.steps:  # always leave a checkpoint of the final step
        _save(cfg, cfg.steps, model, optimizer, scheduler, meta)
    if cfg.save_hf is not None:
        from dtensor_ulysses.hf.model import save_pretrained

        if rank == 0:
            Path(cfg.save_hf).resolve().parent.mkdir(parents=True, exist_ok=True)
        save_pretrained(model, cfg.save_hf, tokenizer=_tokenizer(cfg))
        if rank == 0:
            print(f"saved the transformers model to {cfg.save_hf}", flush=True)
    return records, model


def _evaluate(cfg: TrainConfig, model, corpus, dp_rank: int, sp_rank: int, group, device) -> dict:
    """Held-out loss over every full global batch of ``corpus``, the sequence sharded."""
    from dtensor_ulysses.hf.data import eval_batches, evaluate

    assert cfg.sp is not None
    batches = eval_batches(
        corpus, global_batch_size=cfg.batch_size, dp_rank=dp_rank, dp=cfg.dp, sp_rank=sp_rank,
        sp=cfg.sp, pack_docs=cfg.pack_docs,
    )  # fmt: skip
    out = evaluate(model, batches, group, device)
    return {f"eval_{k}": v for k, v in out.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status: 0 done, 2 bad input, 3 a non-finite
    loss or gradient norm, 75 preempted (SIGTERM or SIGUSR1; checkpointed), 1 anything else.

    Only a :class:`UsageError` becomes one ``error:`` line (from rank 0); any other exception is
    a bug or an environment failure and prints its full traceback on the rank where it happened.
    """
    if "RANK" not in os.environ:  # plain `python -m dtensor_ulysses.train`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))  # fmt: skip
    rank = int(os.environ["RANK"])
    try:
        cfg = validate(prepare_cuda_allocator(parse_args(argv)), int(os.environ["WORLD_SIZE"]))
        train(cfg)  # creates the process group (init_mesh), the one place that does
        code = 0
        clear_rank_note()
    except UsageError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    except GuardStop as e:  # preempted (75) or a non-finite step (3): see _train_guard.py
        e.report(rank)
        code = e.exit_code
    except Exception:
        clear_rank_note()
        traceback.print_exc()
        code = 1
    return leave_together(code, rank)


if __name__ == "__main__":
    exit_process(main())  # not sys.exit: skip the teardown that can abort (see _exit.py)
