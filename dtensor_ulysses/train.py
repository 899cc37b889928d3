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

The shape of the file: ``parse_args -> validate -> build -> train_step -> train`` (the loop),
and ``main``, the only place that turns a :class:`UsageError` into one ``error:`` line; any other
exception keeps its traceback and ends every rank with a non-zero status.

Per step (:func:`train_step`): each rank reads its ``[b, S/sp]`` slice of the global batch and
the step's sequence layout (``data.get_batch``), the model runs on it (attention through
Ulysses), the loss is the token-weighted cross entropy over the whole global batch (``loss.py``),
FSDP2 reduce-scatters (sums) gradients, the global gradient norm is clipped, and AdamW steps with
a linear-warmup + cosine schedule. The schedule depends on ``--warmup-steps`` and
``--decay-steps`` only, never on ``--steps``, so ``--steps 4`` equals ``--steps 2`` followed by
``--steps 4 --resume``.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ulysses import checkpoint as ckpt
from dtensor_ulysses._exit import exit_process, leave_together
from dtensor_ulysses.data import Batch, PackedCorpus, get_batch
from dtensor_ulysses.loss import global_valid_tokens
from dtensor_ulysses.mesh import default_device_type, flatten_dp_sp, init_mesh
from dtensor_ulysses.metrics import StepLogger
from dtensor_ulysses.model import build_model, model_flops_per_token, set_tiling
from dtensor_ulysses.offload import HostOffloadAdamW
from dtensor_ulysses.parallel import parallelize
from dtensor_ulysses.plan import check_sp_for_heads, nearby_multiples
from dtensor_ulysses.presets import get_shape
from dtensor_ulysses.ulysses import check_head_chunks
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


class UsageError(ValueError):
    """A bad command line or configuration, found before training; ``main`` prints it as one
    ``error:`` line from rank 0 and exits with status 2."""


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
    tiled_loss: bool = False
    loss_chunk_tokens: int | None = None  # None: min(2048, local tokens)
    tiled_mlp: bool = False
    mlp_chunk_tokens: int | None = None  # None: the model dim (ALST's choice), capped
    head_chunks: int = 1
    offload_activations: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False
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
    mem = p.add_argument_group("memory (million-token training; each is exact)")
    mem.add_argument(
        "--tiled-loss",
        action="store_true",
        help="compute the loss in chunks of tokens: no [B, s, V] logits",
    )
    mem.add_argument(
        "--loss-chunk-tokens",
        type=int,
        default=None,
        help="tokens per loss chunk (default: 2048, or all local tokens if fewer)",
    )
    mem.add_argument(
        "--tiled-mlp",
        action="store_true",
        help="run the MLP in chunks of tokens, each recomputed in backward",
    )
    mem.add_argument(
        "--mlp-chunk-tokens",
        type=int,
        default=None,
        help="tokens per MLP chunk (default: the model dim)",
    )
    mem.add_argument(
        "--head-chunks",
        type=int,
        default=1,
        help="attention in K stages of heads (UPipe); K divides the heads per rank",
    )
    mem.add_argument(
        "--offload-activations",
        action="store_true",
        help="keep each checkpointed block's input on the host (needs --activation-checkpointing)",
    )
    mem.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="optimizer states and fp32 master weights on the host; AdamW steps on the CPU",
    )
    mem.add_argument(
        "--offload-params",
        action="store_true",
        help="parameters, gradients and optimizer states on the host (FSDP2 CPU offload)",
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--collective-timeout-s", type=float, default=d.collective_timeout_s)
    args = p.parse_args(argv)
    return TrainConfig(**{k: v for k, v in vars(args).items()})


def validate(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """Check the configuration before any process group exists; resolve ``sp``.

    Raises:
        UsageError: with the numbers and the fix, for every bad combination.
    """
    for name in ("dp", "seq_len", "batch_size", "steps"):
        if getattr(cfg, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(cfg, name)} must be >= 1")
    if cfg.sp is None:
        if world_size % cfg.dp:
            raise UsageError(f"--dp {cfg.dp} does not divide the world size {world_size}")
        cfg.sp = world_size // cfg.dp
    if cfg.sp < 1:
        raise UsageError(f"--sp={cfg.sp} must be >= 1")
    if cfg.dp * cfg.sp != world_size:
        raise UsageError(
            f"--dp {cfg.dp} x --sp {cfg.sp} = {cfg.dp * cfg.sp} but torchrun started "
            f"{world_size} processes; make dp * sp equal --nproc-per-node x --nnodes"
        )
    try:
        shape = get_shape(cfg.model)
        check_sp_for_heads(
            shape.n_heads, cfg.sp, what=f"heads of model {cfg.model!r}",
            allow_uneven=cfg.allow_uneven_heads,
        )  # fmt: skip
    except ValueError as e:
        uneven = cfg.sp <= shape.n_heads if "shape" in locals() else False
        hint = " (or pass --allow-uneven-heads to accept a load imbalance)" if uneven else ""
        raise UsageError(f"{e}{hint}") from None
    if cfg.seq_len % cfg.sp and cfg.strict_seq_len:
        raise UsageError(
            f"--seq-len {cfg.seq_len} is not divisible by sp={cfg.sp}; use a multiple of "
            f"{cfg.sp}, e.g. {nearby_multiples(cfg.seq_len, cfg.sp)} (or drop --strict-seq-len)"
        )
    if cfg.batch_size % cfg.dp:
        raise UsageError(
            f"--batch-size {cfg.batch_size} (global) is not divisible by dp={cfg.dp}; use a "
            f"multiple of {cfg.dp}, e.g. {nearby_multiples(cfg.batch_size, cfg.dp)}"
        )
    _validate_memory_features(cfg, shape)
    try:  # reads and checks the data files now; the packed stream is cached for train()
        PackedCorpus.from_paths(cfg.data, seq_len=cfg.seq_len)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if cfg.resume and not cfg.checkpoint_dir:
        raise UsageError("--resume needs --checkpoint-dir (where to find the checkpoint)")
    if cfg.resume:
        assert cfg.checkpoint_dir is not None
        path = ckpt.latest(cfg.checkpoint_dir)
        if path is None:
            raise UsageError(
                f"--resume: no checkpoint in {cfg.checkpoint_dir!r}; run once without --resume "
                f"(with --checkpoint-dir) to create one"
            )
        try:
            _check_resumable(path, cfg)  # before any model is built
        except ValueError as e:
            raise UsageError(str(e)) from None
    return cfg


def lr_lambda(cfg: TrainConfig):
    """Multiplier of ``cfg.lr`` at a step: linear warmup, then cosine down to ``min_lr_ratio``."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        t = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.decay_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return f


def _local_tokens(cfg: TrainConfig) -> int:
    """Tokens of the busiest rank's slice: ``(G / dp) * ceil(S / sp)``."""
    assert cfg.sp is not None
    return cfg.batch_size // cfg.dp * -(-cfg.seq_len // cfg.sp)


def _validate_memory_features(cfg: TrainConfig, shape) -> None:
    local = _local_tokens(cfg)
    for flag, on, chunk in (
        ("loss", cfg.tiled_loss, cfg.loss_chunk_tokens),
        ("mlp", cfg.tiled_mlp, cfg.mlp_chunk_tokens),
    ):
        if chunk is None:
            continue
        if not on:
            raise UsageError(f"--{flag}-chunk-tokens {chunk} needs --tiled-{flag}")
        if chunk < 1 or chunk > local:
            raise UsageError(
                f"--{flag}-chunk-tokens {chunk} must be between 1 and the {local} tokens a rank "
                f"holds (batch {cfg.batch_size} / dp {cfg.dp} x ceil(seq-len {cfg.seq_len} / "
                f"sp {cfg.sp})); a chunk of all of them is --tiled-{flag} off"
            )
    if cfg.head_chunks != 1:
        if cfg.head_chunks < 1:
            raise UsageError(f"--head-chunks {cfg.head_chunks} must be >= 1 (1: off)")
        assert cfg.sp is not None
        try:
            check_head_chunks(shape.n_heads, cfg.sp, cfg.head_chunks)
        except ValueError as e:
            raise UsageError(str(e).replace("head_chunks=", "--head-chunks ")) from None
    if cfg.offload_activations and not cfg.activation_checkpointing:
        raise UsageError(
            "--offload-activations moves the one input a checkpointed block keeps to the host; "
            "add --activation-checkpointing"
        )
    if cfg.offload_optimizer and cfg.offload_params:
        raise UsageError(
            "--offload-params already keeps the optimizer states on the host; pass one of "
            "--offload-params and --offload-optimizer"
        )


def build(cfg: TrainConfig, mesh: DeviceMesh, device: torch.device, *, init: bool = True):
    """Model on meta -> tiling -> parallelize -> materialize -> init; AdamW and its schedule.

    Args:
        cfg: a validated configuration.
        mesh: the ``("dp", "sp")`` mesh.
        device: where the model computes.
        init: draw the initial weights (``False`` leaves them uninitialized: for memory tracing
            under fake tensors, where values do not matter).
    """
    shape = get_shape(cfg.model)
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
        attention_backend=cfg.attention_backend,
        allow_uneven_heads=cfg.allow_uneven_heads,
    )
    # with FSDP2's CPU offload the sharded parameters live on the host (it copies them over)
    model.to_empty(device="cpu" if cfg.offload_params else device)
    if init:
        init_weights(model, seed=cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    optimizer_cls = HostOffloadAdamW if cfg.offload_optimizer else torch.optim.AdamW
    optimizer = optimizer_cls(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
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


@dataclass
class StepResult:
    """What one training step reports (the same on every rank)."""

    loss: float  # mean cross entropy over the global batch's valid tokens
    tokens: int  # valid tokens in the global batch
    grad_norm: float | None  # global gradient norm before clipping (None: no clipping)


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
) -> StepResult:
    """One optimizer step on the global batch of which ``batch`` is this rank's slice."""
    local_sum, n_valid = forward_backward(model, batch, group)
    grad_norm = None
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    loss_sum = local_sum.reshape(1)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(loss_sum, group=group)
    return StepResult(loss_sum.item() / n_valid, n_valid, grad_norm)


def train(cfg: TrainConfig) -> list[dict]:
    """Train in this process's group (created here from the torchrun environment if needed).

    Returns the per-step records; every rank returns the same (loss and counts are reduced).
    """
    device_type = cfg.device or default_device_type()
    assert cfg.sp is not None, "call validate(cfg, world_size) first: it resolves sp"
    mesh = init_mesh(cfg.dp, cfg.sp, device_type=device_type, timeout_s=cfg.collective_timeout_s)
    rank = dist.get_rank()
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(device_type)
    dp_rank, sp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("sp")
    shape = get_shape(cfg.model)
    group = flatten_dp_sp(mesh).get_group()

    corpus = PackedCorpus.from_paths(cfg.data, seq_len=cfg.seq_len)
    model, optimizer, scheduler = build(cfg, mesh, device)
    start, path = 0, None
    if cfg.resume:  # validate() checked that a checkpoint exists
        assert cfg.checkpoint_dir is not None
        path = ckpt.latest(cfg.checkpoint_dir)
        assert path is not None
        start = ckpt.load(path, model, optimizer, scheduler)["step"]
    if rank == 0:
        print(
            f"model {shape.name} ({shape.n_params / 1e6:.2f}M params) | mesh dp={cfg.dp} x "
            f"sp={cfg.sp} on {device_type} | seq {cfg.seq_len}, global batch {cfg.batch_size} | "
            f"data: {'stdlib sources' if not cfg.data else ', '.join(cfg.data)} "
            f"({corpus.n_tokens / 1e6:.1f}M tokens, {len(corpus)} windows) | steps {start}->"
            f"{cfg.steps}" + (f" | resumed from {path}" if path else ""),
            flush=True,
        )
    logger = StepLogger(
        total_steps=cfg.steps,
        flops_per_token=model_flops_per_token(shape, cfg.seq_len),
        n_gpus=mesh.size(),
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
        result = train_step(
            model, batch, optimizer, scheduler, group=group, grad_clip=cfg.grad_clip
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        extra = {"lr": scheduler.get_last_lr()[0]}
        if result.grad_norm is not None:
            extra["grad_norm"] = result.grad_norm
        elapsed = time.perf_counter() - t0
        records.append(logger.log(step + 1, result.loss, result.tokens, elapsed, **extra))
        done = step + 1
        if cfg.checkpoint_dir and cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
            ckpt.save(cfg.checkpoint_dir, done, model, optimizer, scheduler, _checkpoint_meta(cfg))
            saved = done
    if cfg.checkpoint_dir and saved != cfg.steps:  # always leave a checkpoint of the final step
        ckpt.save(cfg.checkpoint_dir, cfg.steps, model, optimizer, scheduler, _checkpoint_meta(cfg))
    return records


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status: 0 done, 2 bad input, 1 anything else.

    Only a :class:`UsageError` becomes one ``error:`` line (from rank 0); any other exception is
    a bug or an environment failure and prints its full traceback on the rank where it happened.
    """
    if "RANK" not in os.environ:  # plain `python -m dtensor_ulysses.train`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))  # fmt: skip
    rank = int(os.environ["RANK"])
    try:
        cfg = validate(parse_args(argv), int(os.environ["WORLD_SIZE"]))
        train(cfg)  # creates the process group (init_mesh), the one place that does
        code = 0
    except UsageError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    except Exception:
        traceback.print_exc()
        code = 1
    return leave_together(code, rank)


if __name__ == "__main__":
    exit_process(main())  # not sys.exit: skip the teardown that can abort (see _exit.py)
