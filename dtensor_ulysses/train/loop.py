"""The training loop: build, one step (:func:`train_step`), the loop and :func:`main`.

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
exception keeps its traceback and ends every rank with a non-zero status. The subpackage's
modules, each with one concern:

* ``cli.py``: :class:`TrainConfig`, :func:`parse_args` and :class:`UsageError`;
* ``checks.py``: :func:`validate`, every check before a process group exists (the memory
  preflight last);
* ``inputs.py``: the ``--hf-model`` directory (config, weights, tokenizer), read while
  validating and cached for the run;
* ``evaluation.py``: the held-out loss (:class:`Evaluator`), any layout the trainer trains;
* ``spec.py``: the model spec (build, corpus, batches, FLOPs, export) of the built-in model and
  of ``--hf-model``, and the optimizer with its schedule;
* ``resume.py`` and ``checkpoint.py``: the checkpoint ``--resume`` loads, whether it fits this
  run, and writing one atomically; ``metrics.py``: the progress line and the metrics file;
* this file: :func:`build`, :func:`train_step`, the loop (:func:`train`) and :func:`main`.

Per step (:func:`train_step`): each rank reads its ``[b, S/sp]`` slice of the global batch and
the step's sequence layout (``data.get_batch``), the model runs on it (attention through
Ulysses), the loss is the token-weighted cross entropy over the whole global batch
(:mod:`dtensor_ulysses.models.loss`),
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

from dtensor_ulysses._exit import (
    catch_stop_signals,
    leave_together,
    protect_output,
    record_exit_status,
    stop_signal_received,
)
from dtensor_ulysses.attention.kernels import describe_kernels, model_kernels
from dtensor_ulysses.data import Batch
from dtensor_ulysses.parallel import global_valid_tokens
from dtensor_ulysses.parallel.mesh import ParallelDims, default_device_type
from dtensor_ulysses.train import checkpoint as ckpt
from dtensor_ulysses.train.checks import validate
from dtensor_ulysses.train.cli import TrainConfig, UsageError, parse_args
from dtensor_ulysses.train.evaluation import Evaluator
from dtensor_ulysses.train.guard import (
    SINGLE_PROCESS_ENV,
    GuardStop,
    RunGuard,
    clear_rank_note,
    note_building,
    note_refusal,
    prepare_cuda_allocator,
)
from dtensor_ulysses.train.metrics import StepLogger, truncate_after
from dtensor_ulysses.train.resume import checkpoint_meta, load_checkpoint, save_checkpoint
from dtensor_ulysses.train.spec import make_optimizer, model_spec

__all__ = [
    "StepResult",
    "build",
    "forward_backward",
    "main",
    "train",
    "train_step",
]


def build(cfg: TrainConfig, mesh: DeviceMesh, device: torch.device, *, init: bool = True):
    """The model of ``cfg`` (its :func:`~dtensor_ulysses.train.model_spec`), sharded and
    materialized, with AdamW and its schedule: ``(model, optimizer, scheduler)``.

    Args:
        cfg: a validated configuration: its recipe (``cfg.options()``, mixed precision
            included: ``"auto"`` lets the mesh's device type decide, bf16 + fp32 reduce on CUDA,
            fp32 elsewhere; the memory trace passes the policy of the run it describes) and
            the built-in model's kernel (``cfg.kernel_choice``).
        mesh: the ``("dp", "sp")`` mesh (``("dp", "ring", "sp")`` with a ring).
        device: where the model computes.
        init: draw the initial weights of the built-in model (``False`` leaves them
            uninitialized: for memory tracing under fake tensors, where values do not matter).
    """
    model = model_spec(cfg).build(cfg, mesh, device, init)
    return (model, *make_optimizer(cfg, model))


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
    with catch_stop_signals():  # SIGTERM / SIGUSR1 / Ctrl-C: stop after the step, checkpointed
        return _train(cfg)[0]


def _train(cfg: TrainConfig) -> tuple[list[dict], torch.nn.Module]:
    """:func:`train`, also returning the trained (sharded) model."""
    device_type = cfg.device or default_device_type()
    # the degrees validate() resolved, bound to their mesh (the groups, this rank's coordinates)
    dims = ParallelDims.from_mesh(
        cfg.dims().build_mesh(device_type, timeout_s=cfg.collective_timeout_s)
    )
    mesh = dims.world_mesh
    rank = dist.get_rank()
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(device_type)
    coords = dims.coords()  # this rank's (dp, ring, sp) coordinates, for the slicer
    group = dims.flat_mesh.get_group()

    spec = model_spec(cfg)
    corpus = spec.corpus(cfg, cfg.data, "--data")
    evaluator = None
    if cfg.eval_data:
        eval_corpus = spec.corpus(cfg, cfg.eval_data, "--eval-data")
        evaluator = Evaluator(cfg, eval_corpus, dims, device)
    model, optimizer, scheduler = build(cfg, mesh, device)
    meta = checkpoint_meta(cfg)
    start, path = 0, None
    if cfg.resume:  # validate() chose the newest intact checkpoint
        assert cfg.checkpoint_dir is not None
        if cfg.resume_from:
            path = Path(cfg.resume_from)
        else:  # train() called without validate()'s choice
            path = ckpt.select_resume(cfg.checkpoint_dir)[0]
        if path is None:
            raise UsageError(f"--resume: no intact checkpoint in {cfg.checkpoint_dir!r}")
        # damage that verify() cannot see (bytes changed, DCP failing): an older one instead
        start, path = load_checkpoint(cfg, path, model, optimizer, scheduler)
    name, n_params, flops_per_token = spec.describe(cfg, model)
    if rank == 0:
        print(
            f"model {name} ({n_params / 1e6:.2f}M params) | mesh {dims.describe()} "
            f"on {device_type} | seq {cfg.seq_len}, global batch {cfg.batch_size} | "
            f"data: {'stdlib sources' if not cfg.data else ', '.join(cfg.data)} "
            f"({corpus.n_tokens / 1e6:.1f}M tokens, {len(corpus)} windows) | pack-docs "
            f"{'on' if cfg.pack_docs else 'off'} | attention kernel "
            f"{describe_kernels(model_kernels(model), cfg.pack_docs)} | steps {start}->"
            f"{cfg.steps}" + (f" | resumed from {path}" if path else ""),
            flush=True,
        )
    if start and cfg.metrics_file and rank == 0:
        dropped = truncate_after(cfg.metrics_file, start)
        if dropped:
            print(
                f"{cfg.metrics_file}: dropped {dropped} row(s) past step {start} (logged after "
                f"the checkpoint, trained again now)",
                flush=True,
            )
    logger = StepLogger(
        total_steps=cfg.steps,
        flops_per_token=flops_per_token,
        n_gpus=dims.world_size,
        device=device,
        metrics_file=cfg.metrics_file,
        is_main=rank == 0,
    )
    records = []
    saved = start if cfg.resume else None
    guard = RunGuard(cfg, rank, device)  # stop signals, non-finite steps, --overwrite
    guard.resumed_from = path
    t_start = time.perf_counter()
    model.train()
    for step in range(start, cfg.steps):
        guard.before_step(step + 1, model)
        t0 = time.perf_counter()
        batch = spec.get_batch(
            corpus, step, global_batch_size=cfg.batch_size, seed=cfg.seed,
            pack_docs=cfg.pack_docs, uneven=True, **coords,
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
        if evaluator is not None and evaluator.due(done):
            extra.update(evaluator(model))
        records.append(logger.log(done, result.loss, result.tokens, elapsed, **extra))
        guard.heartbeat(records[-1])
        if "eval_loss" in extra and rank == 0:
            print(
                f"eval after step {done} | loss {extra['eval_loss']:.4f} | perplexity "
                f"{extra['eval_perplexity']:.2f} | {extra['eval_tokens']} tokens",
                flush=True,
            )
        if cfg.checkpoint_dir and cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
            save_checkpoint(cfg, done, model, optimizer, scheduler, meta)
            saved = done
        if done < cfg.steps and guard.stop_requested():  # every rank agrees
            if cfg.checkpoint_dir and saved != done:
                save_checkpoint(cfg, done, model, optimizer, scheduler, meta)
            raise guard.preempted(done)
    if cfg.checkpoint_dir and saved != cfg.steps:  # always leave a checkpoint of the final step
        save_checkpoint(cfg, cfg.steps, model, optimizer, scheduler, meta)
    if spec.export is not None:
        spec.export(cfg, model)
    if rank == 0:
        print(_closing_line(cfg, start, records, time.perf_counter() - t_start), flush=True)
    return records, model


def _closing_line(cfg: TrainConfig, start: int, records: list[dict], seconds: float) -> str:
    """The run's last line: what it trained and what it wrote where."""
    what = [f"done: steps {start}->{cfg.steps} in {seconds:.0f} s"]
    if records:
        what.append(f"last loss {records[-1]['loss']:.4f}")
    if cfg.checkpoint_dir:
        final = Path(cfg.checkpoint_dir) / f"step_{cfg.steps:08d}"
        what.append(f"checkpoint {final} (continue with --resume and a larger --steps)")
    else:
        what.append("no checkpoint (no --checkpoint-dir)")
    if cfg.metrics_file:
        what.append(f"metrics {cfg.metrics_file} (one JSON row per step)")
    if cfg.save_hf:
        what.append(f"transformers model {cfg.save_hf}")
    return " | ".join(what)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_AFTER_CLOSED_OUTPUT = (
    "its lines are dropped from here on; each step's record still goes to --metrics-file (if "
    "given), and a stop still ends in its checkpoint"
)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status: 0 done, 2 bad input, 3 a non-finite
    loss or gradient norm, 74 a checkpoint could not be written (a full disk), 75 preempted
    (SIGTERM, SIGUSR1, a first Ctrl-C, or the launcher gone; checkpointed), 130 a second Ctrl-C
    (stopped at once), 1 anything else.

    Only a :class:`UsageError` becomes one ``error:`` line (from rank 0); any other exception is
    a bug or an environment failure and prints its full traceback on the rank where it happened.
    """
    if "RANK" not in os.environ:  # plain `python -m dtensor_ulysses.train`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()), **{SINGLE_PROCESS_ENV: "1"})  # fmt: skip
    rank = int(os.environ["RANK"])
    # from the start: a signal while building stops after step 1; a closed stdout or stderr
    # (`| tee` gone) never ends the run
    with catch_stop_signals(), protect_output(_AFTER_CLOSED_OUTPUT):
        code = _main(argv, rank)
    record_exit_status(code, rank)
    # a refusal on a rank that torchrun already told to stop (its SIGTERM, caught above while
    # leaving): no grace wait for rank 0's message, which torchrun would end with SIGKILL
    return leave_together(code, rank, grace=not stop_signal_received())


def _main(argv: list[str] | None, rank: int) -> int:
    try:
        cfg = validate(prepare_cuda_allocator(parse_args(argv)), int(os.environ["WORLD_SIZE"]))
        note_building(rank, cfg.steps)
        train(cfg)  # creates the process group (init_mesh), the one place that does
        code = 0
        clear_rank_note()
    except UsageError as e:
        note_refusal(str(e))  # torchrun's summary shows the reason, not "To enable traceback"
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    except GuardStop as e:  # preempted (75) or a non-finite step (3): see guard.py
        e.report(rank)
        code = e.exit_code
    except ckpt.CheckpointWriteError as e:  # a full disk: every rank stops here, alike (74)
        note_refusal(str(e))
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        code = e.exit_code
    except Exception:
        clear_rank_note()
        traceback.print_exc()
        code = 1
    return code
