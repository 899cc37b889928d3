"""Train a Llama-style decoder with FSDP2 + Ulysses sequence parallelism on a ``(dp, sp)`` mesh.

Run (CPU with gloo, or GPUs with NCCL — the same command)::

    # 2 processes, Ulysses over both, the tiny preset on the built-in data (Python's stdlib sources)
    torchrun --standalone --nproc-per-node 2 -m dtensor_ulysses.train --dp 1 --sp 2 --steps 40

    # 8 GPUs: 2 data-parallel groups x 4-way sequence parallelism, 32K tokens per sequence
    torchrun --standalone --nproc-per-node 8 -m dtensor_ulysses.train --dp 2 --sp 4 \\
        --model llama3-1b --seq-len 32768 --batch-size 2 --steps 100 --activation-checkpointing

    # multi-node (run on every node; NODE0 is the first node's address)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint NODE0:29500 \\
        -m dtensor_ulysses.train --dp 2 --sp 8 --model llama3-8b --seq-len 131072

``--batch-size`` is the *global* batch: any (dp, sp) with the same global batch, seed and data
trains on the same tokens and gives the same losses (up to floating-point reduction order).

Per step: each rank reads its ``[b, S/sp]`` slice of the global batch (``data.get_batch``), the
model runs on it (attention through Ulysses), the loss is the token-weighted cross entropy over the
whole global batch (``loss.py``), FSDP2 reduce-scatters gradients, the global gradient norm is
clipped, and AdamW steps with a linear-warmup + cosine schedule. The schedule depends on
``--warmup-steps`` and ``--decay-steps`` only, never on ``--steps``, so ``--steps 4`` equals
``--steps 2`` followed by ``--steps 4 --resume``.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dtensor_ulysses import checkpoint as ckpt
from dtensor_ulysses._exit import exit_process
from dtensor_ulysses.data import PackedCorpus, get_batch
from dtensor_ulysses.loss import cross_entropy_sum, global_valid_tokens, loss_for_backward
from dtensor_ulysses.mesh import default_device_type, init_mesh
from dtensor_ulysses.metrics import StepLogger
from dtensor_ulysses.model import build_model, init_weights, model_flops_per_token
from dtensor_ulysses.parallelize import fsdp_world_size, parallelize
from dtensor_ulysses.plan import nearby_multiples
from dtensor_ulysses.presets import get_shape

__all__ = ["TrainConfig", "parse_args", "validate", "train", "main"]


@dataclass
class TrainConfig:
    """Everything a run depends on (the command line, parsed)."""

    dp: int = 1
    sp: int | None = None
    model: str = "tiny"
    seq_len: int = 512
    batch_size: int = 8
    steps: int = 40
    seed: int = 0
    data: list[str] | None = None
    metrics_file: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    decay_steps: int = 1000
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    activation_checkpointing: bool = False
    attention_backend: str = "auto"
    pack_docs: bool = False
    strict_seq_len: bool = False
    allow_uneven_heads: bool = False
    device: str | None = None
    collective_timeout_s: float = 600.0


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    p = argparse.ArgumentParser(
        prog="python -m dtensor_ulysses.train",
        description="FSDP2 + Ulysses training (launch with torchrun).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = TrainConfig()
    p.add_argument("--dp", type=int, default=d.dp, help="data-parallel degree")
    p.add_argument("--sp", type=int, default=None, help="sequence-parallel degree (default: rest)")
    p.add_argument("--model", default=d.model, help="preset: tiny, llama3-1b, llama3-8b, ...")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="GLOBAL batch (sequences)")
    p.add_argument(
        "--steps", type=int, default=d.steps, help="train until this many steps are done"
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--data", nargs="+", default=None, help="text or JSONL files (default: stdlib)")
    p.add_argument("--metrics-file", default=None, help="JSONL, one line per step")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps; 0: only at the end")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--decay-steps", type=int, default=d.decay_steps, help="cosine horizon")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="global norm; 0: off")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--attention-backend", default=d.attention_backend,
                   choices=["auto", "flash_attn", "sdpa"])  # fmt: skip
    p.add_argument(
        "--pack-docs",
        action="store_true",
        help="attention and positions restart at each document (packed documents)",
    )
    p.add_argument(
        "--strict-seq-len",
        action="store_true",
        help="refuse a --seq-len not divisible by sp (default: uneven sp slices, exact)",
    )
    p.add_argument(
        "--allow-uneven-heads",
        action="store_true",
        help="accept q heads not divisible by sp (ranks get ceil/floor heads)",
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--collective-timeout-s", type=float, default=d.collective_timeout_s)
    args = p.parse_args(argv)
    return TrainConfig(**{k: v for k, v in vars(args).items()})


def validate(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """Check the configuration before any process group exists; resolve ``sp``.

    Raises:
        ValueError: with the numbers and the fix, for every bad combination.
    """
    for name in ("dp", "seq_len", "batch_size", "steps"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(cfg, name)} must be >= 1")
    if cfg.sp is None:
        if world_size % cfg.dp:
            raise ValueError(f"--dp {cfg.dp} does not divide the world size {world_size}")
        cfg.sp = world_size // cfg.dp
    if cfg.sp < 1:
        raise ValueError(f"--sp={cfg.sp} must be >= 1")
    if cfg.dp * cfg.sp != world_size:
        raise ValueError(
            f"--dp {cfg.dp} x --sp {cfg.sp} = {cfg.dp * cfg.sp} but torchrun started "
            f"{world_size} processes; make dp * sp equal --nproc-per-node x --nnodes"
        )
    shape = get_shape(cfg.model)
    if cfg.sp > shape.n_heads:
        raise ValueError(
            f"sp={cfg.sp} exceeds the {shape.n_heads} heads of model {cfg.model!r}; use sp <= "
            f"{shape.n_heads} (the largest valid sp)"
        )
    if shape.n_heads % cfg.sp and not cfg.allow_uneven_heads:
        valid = ", ".join(str(v) for v in shape.valid_sp())
        raise ValueError(
            f"model {cfg.model!r} has {shape.n_heads} heads, not divisible by sp={cfg.sp}; "
            f"choose sp in {{{valid}}} (or pass --allow-uneven-heads to accept a load imbalance)"
        )
    if cfg.seq_len % cfg.sp and cfg.strict_seq_len:
        raise ValueError(
            f"--seq-len {cfg.seq_len} is not divisible by sp={cfg.sp}; use a multiple of "
            f"{cfg.sp}, e.g. {nearby_multiples(cfg.seq_len, cfg.sp)} (or drop --strict-seq-len)"
        )
    if cfg.batch_size % cfg.dp:
        raise ValueError(
            f"--batch-size {cfg.batch_size} (global) is not divisible by dp={cfg.dp}; use a "
            f"multiple of {cfg.dp}, e.g. {nearby_multiples(cfg.batch_size, cfg.dp)}"
        )
    if cfg.resume and not cfg.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir (where to find the checkpoint)")
    if cfg.resume:
        path = ckpt.latest(cfg.checkpoint_dir)
        if path is None:
            raise ValueError(
                f"--resume: no checkpoint in {cfg.checkpoint_dir!r}; run once without --resume "
                f"(with --checkpoint-dir) to create one"
            )
        _check_resumable(path, cfg)  # before any model is built
    return cfg


def lr_lambda(cfg: TrainConfig):
    """Multiplier of ``cfg.lr`` at a step: linear warmup, then cosine down to ``min_lr_ratio``."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        t = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.decay_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return f


def build(cfg: TrainConfig, mesh, device: torch.device):
    """Model on meta -> parallelize -> materialize -> init; AdamW and its schedule."""
    model = build_model(cfg.model, device="meta")
    parallelize(
        model,
        mesh,
        activation_checkpointing=cfg.activation_checkpointing,
        attention_backend=cfg.attention_backend,
        allow_uneven_heads=cfg.allow_uneven_heads,
    )
    model.to_empty(device=device)
    init_weights(model, seed=cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    return model, optimizer, scheduler


def _checkpoint_meta(cfg: TrainConfig) -> dict:
    return {
        "shape": get_shape(cfg.model).to_dict(),
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "data": cfg.data,
        "pack_docs": cfg.pack_docs,
    }


def _check_resumable(path, cfg: TrainConfig) -> None:
    meta = ckpt.read_meta(path)["meta"]
    want = get_shape(cfg.model).to_dict()
    if meta["shape"] != want:
        diff = {k: (meta["shape"].get(k), v) for k, v in want.items() if meta["shape"].get(k) != v}
        raise ValueError(
            f"checkpoint {path} holds model {meta['shape']['name']!r} but this run builds "
            f"{cfg.model!r}; differing (checkpoint, run): {diff}. Use --model "
            f"{meta['shape']['name']} or another --checkpoint-dir"
        )
    data_keys = ("seq_len", "batch_size", "seed", "data", "pack_docs")
    run = _checkpoint_meta(cfg)
    changed = [k for k in data_keys if meta.get(k) != run[k]]
    if changed:
        raise ValueError(
            f"checkpoint {path} was trained with "
            f"{', '.join(f'{k}={meta.get(k)!r}' for k in changed)}; resuming with other values "
            f"would not continue the same run. Pass the same values or use another "
            f"--checkpoint-dir"
        )


def _global_norm(norm) -> float:
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def train(cfg: TrainConfig) -> list[dict]:
    """Run training in an initialized (or to-be-initialized) process group; returns the records.

    Every rank returns the same records (loss and counts are all-reduced).
    """
    device_type = cfg.device or default_device_type()
    mesh = init_mesh(cfg.dp, cfg.sp, device_type=device_type, timeout_s=cfg.collective_timeout_s)
    rank = dist.get_rank()
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(device_type)
    dp_rank, sp_rank = mesh.get_coordinate()
    shape = get_shape(cfg.model)
    world = fsdp_world_size(mesh)

    corpus = PackedCorpus.from_paths(cfg.data, seq_len=cfg.seq_len)
    model, optimizer, scheduler = build(cfg, mesh, device)
    start = 0
    if cfg.resume:
        path = ckpt.latest(cfg.checkpoint_dir)
        start = ckpt.load(path, model, optimizer, scheduler)["step"]
    if rank == 0:
        print(
            f"model {shape.name} ({shape.n_params / 1e6:.2f}M params) | mesh dp={cfg.dp} x "
            f"sp={cfg.sp} on {device_type} | seq {cfg.seq_len}, global batch {cfg.batch_size} | "
            f"data: {'stdlib sources' if not cfg.data else ', '.join(cfg.data)} "
            f"({corpus.n_tokens / 1e6:.1f}M tokens, {len(corpus)} windows) | steps {start}->"
            f"{cfg.steps}" + (f" | resumed from {path}" if cfg.resume else ""),
            flush=True,
        )
    logger = StepLogger(
        total_steps=cfg.steps,
        flops_per_token=model_flops_per_token(shape, cfg.seq_len),
        n_gpus=world,
        device=device,
        metrics_file=cfg.metrics_file,
        is_main=rank == 0,
    )
    records = []
    saved = start if cfg.resume else None
    model.train()
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        batch = get_batch(
            corpus, step, global_batch_size=cfg.batch_size, dp_rank=dp_rank, dp=cfg.dp,
            sp_rank=sp_rank, sp=cfg.sp, seed=cfg.seed, pack_docs=cfg.pack_docs, uneven=True,
        ).to(device)  # fmt: skip
        logits = model(batch.input_ids, batch.position_ids, seq_len=cfg.seq_len,
                       document_masking=cfg.pack_docs)  # fmt: skip
        local_sum = cross_entropy_sum(logits, batch.labels)
        n_valid = global_valid_tokens(batch.labels)
        loss_for_backward(local_sum, n_valid, world).backward()
        grad_norm = None
        if cfg.grad_clip > 0:
            grad_norm = _global_norm(
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            )
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum = local_sum.detach().reshape(1)
        dist.all_reduce(loss_sum)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        extra = {"lr": scheduler.get_last_lr()[0]}
        if grad_norm is not None:
            extra["grad_norm"] = grad_norm
        records.append(
            logger.log(
                step + 1, loss_sum.item() / n_valid, n_valid, time.perf_counter() - t0, **extra
            )
        )
        done = step + 1
        if cfg.checkpoint_dir and cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
            ckpt.save(cfg.checkpoint_dir, done, model, optimizer, scheduler, _checkpoint_meta(cfg))
            saved = done
    if cfg.checkpoint_dir and saved != cfg.steps:  # always leave a checkpoint of the final step
        ckpt.save(cfg.checkpoint_dir, cfg.steps, model, optimizer, scheduler, _checkpoint_meta(cfg))
    return records


_ERROR_GRACE_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code (0 ok, 2 bad input)."""
    if "RANK" not in os.environ:  # plain `python -m dtensor_ulysses.train`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))  # fmt: skip
    rank = int(os.environ["RANK"])
    try:
        cfg = validate(parse_args(argv), int(os.environ["WORLD_SIZE"]))
        if not dist.is_initialized():
            device_type = cfg.device or default_device_type()
            if device_type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(
                "nccl" if device_type == "cuda" else "gloo",
                timeout=timedelta(seconds=cfg.collective_timeout_s),
            )
        train(cfg)
        # every rank leaves together: tearing down gloo while a peer is still in its last
        # collective can abort the process ("terminate called without an active exception")
        dist.barrier()
        return 0
    except ValueError as e:
        # Bad input is found alike on every rank; rank 0 says it once. The other ranks linger a
        # moment before exiting: torchrun stops all workers as soon as one fails, and rank 0
        # must get to print first.
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            time.sleep(_ERROR_GRACE_S)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    exit_process(main())  # not sys.exit: skip the teardown that can abort (see _exit.py)
