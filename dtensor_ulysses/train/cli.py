"""The trainer's command line: :class:`TrainConfig`, :func:`parse_args` and :class:`UsageError`
(import them from :mod:`dtensor_ulysses.train`), and the one
``warning:`` line the checks print from rank 0.

torch-free: parsing a command line (and ``--help``) imports nothing heavy.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from dtensor_ulysses.plan import local_tokens
from dtensor_ulysses.plan.recipe import ATTENTION_BACKENDS, TRAINER, ParallelOptions

if TYPE_CHECKING:
    from dtensor_ulysses.attention.kernels import KernelChoice
    from dtensor_ulysses.parallel.mesh import ParallelDims

__all__ = ["ATTENTION_BACKENDS", "TrainConfig", "UsageError", "parse_args"]


class UsageError(ValueError):
    """A bad command line or configuration, found before training; ``main`` prints it as one
    ``error:`` line from rank 0 and exits with status 2."""


@dataclass
class TrainConfig:
    """Everything a run depends on (the command line, parsed)."""

    dp: int = 1
    sp: int | None = None
    ring: int = 1
    model: str | None = None  # a preset; None: "tiny" (validate() fills it in), or --hf-model
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
    loss_chunk_tokens: int | None = None  # None: plan.splits.default_loss_chunk(local tokens)
    tiled_mlp: bool = False
    mlp_chunk_tokens: int | None = None  # None: the model dim (ALST's choice), capped
    head_chunks: int = 1
    overlap_comm: bool = False  # all-to-alls behind compute (k/v during q; head stages)
    compile: str | None = None  # a torch.compile backend, per block (None: eager)
    offload_activations: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False
    device: str | None = None
    collective_timeout_s: float = 600.0
    keep_last: int | None = None  # None: keep every checkpoint
    allow_oversubscribe: bool = False
    memory_headroom: float | None = None  # None: the preflight's default for the device
    overwrite: bool = False  # delete --checkpoint-dir's checkpoints when the run starts
    skip_nonfinite: bool = False  # skip a non-finite step instead of stopping the run
    resume_from: str | None = None  # set by validate(): the checkpoint --resume loads
    hf_model: str | None = None  # a transformers model directory instead of a preset
    tokenizer: str | None = None  # None: the --hf-model directory
    save_hf: str | None = None
    eval_data: list[str] | None = None
    eval_every: int = 0  # steps; 0: only at the end
    parallel_dims: ParallelDims | None = None  # set by validate(): the degrees, built once
    parallel_options: ParallelOptions | None = None  # set by validate(): the recipe, checked once
    kernel_choice: KernelChoice | None = None  # set by validate(): the built-in model's kernel

    def options(self) -> ParallelOptions:
        """The run's :class:`~dtensor_ulysses.plan.ParallelOptions`: the one ``validate`` built
        from the flags and checked (kept in ``parallel_options``); before ``validate``, the
        flags' values as that type (unchecked)."""
        if self.parallel_options is not None:
            return self.parallel_options
        return ParallelOptions(**{name: getattr(self, name) for name in _OPTION_FIELDS})

    def dims(self) -> ParallelDims:
        """The run's :class:`~dtensor_ulysses.parallel.ParallelDims`: the one ``validate``
        built (kept in ``parallel_dims``)."""
        assert self.parallel_dims is not None, "validate() resolves the degrees"
        return self.parallel_dims

    def local_tokens(self) -> int:
        """Tokens of the busiest rank's slice (:func:`dtensor_ulysses.plan.local_tokens`)."""
        assert self.sp is not None, "validate() resolves sp"
        return local_tokens(self.batch_size, self.dp, self.seq_len, self.sp, self.ring)


# the ParallelOptions fields the trainer has as flags (mixed precision: the device's default)
_OPTION_FIELDS = ParallelOptions.fields(TRAINER)


class _HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help once: not when the help already speaks of
    its default, nor for flags (off unless given) and options without a default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or not action.option_strings
            or action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
            or isinstance(action, argparse._HelpAction)
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are :class:`UsageError` (one ``error:`` line from rank 0
    and status 2 on every rank, like every other bad input), and whose ``--help`` is printed by
    rank 0 only."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see --help)")

    def print_help(self, file=None) -> None:
        if os.environ.get("RANK", "0") == "0":
            super().print_help(file)


def _add_layout_args(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The flags of the mesh degrees, the model, the sequence, the batch and the data."""
    p.add_argument("--dp", type=int, default=d.dp, help="data-parallel degree")
    p.add_argument(
        "--sp", type=int, default=None, help="Ulysses degree (default: world / (dp x ring))"
    )
    p.add_argument(
        "--ring",
        type=int,
        default=d.ring,
        help="ring-attention degree: Ulysses x Ring, ring across, sp inside a node (1: off)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="preset: tiny (the default), llama3-1b, llama3-8b, ...; not with --hf-model",
    )
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="GLOBAL batch (sequences)")
    p.add_argument(
        "--steps", type=int, default=d.steps, help="train until this many steps are done"
    )
    p.add_argument("--seed", type=int, default=d.seed, help="weights and data order")
    p.add_argument(
        "--data",
        nargs="+",
        default=None,
        help="UTF-8 text or JSONL files (default: the Python standard library's sources)",
    )


def _add_checkpoints_args(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The flags of metrics, checkpoints and resuming."""
    p.add_argument("--metrics-file", default=None, help="JSONL, one line per step")
    p.add_argument("--checkpoint-dir", default=None, help="where checkpoints are written and read")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps; 0: only at the end")
    p.add_argument(
        "--keep-last",
        type=int,
        default=None,
        help="keep the newest N checkpoints, deleting older ones once a newer one is complete "
        "(default: keep all)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest intact checkpoint in --checkpoint-dir",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start from step 0 in a --checkpoint-dir that holds checkpoints, deleting them "
        "when the run starts (without it such a run is refused)",
    )


def _add_optimizer_args(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The flags of AdamW, its schedule, clipping and non-finite steps."""
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr / peak lr")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear warmup")
    p.add_argument("--decay-steps", type=int, default=d.decay_steps, help="cosine horizon")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW")
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="global norm; 0: off")
    p.add_argument(
        "--skip-nonfinite",
        action="store_true",
        help="skip a step whose loss or gradient norm is not finite (no update; counted as "
        "skipped_nonfinite in the metrics) instead of stopping the run",
    )


def _add_model_args(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """How the model runs: checkpointing, the attention kernel, documents, uneven splits."""
    p.add_argument(
        "--activation-checkpointing", action="store_true", help="recompute each block in backward"
    )
    p.add_argument("--attention-backend", default=d.attention_backend,
                   choices=ATTENTION_BACKENDS,
                   help="the local attention kernel (docs: concepts/attention-kernels); "
                        "flash_attn needs CUDA and the flash-attn package; auto: the first of "
                        "flash_attn, sdpa, flex (CUDA), blockwise that runs the run's features; "
                        "an explicit one that cannot is refused before step 1")  # fmt: skip
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


def _add_memory_args(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The memory features (million-token training; each is exact), and ``--compile``."""
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
    p.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="torch.compile each block (fullgraph; BACKEND: inductor when omitted, or e.g. "
        "aot_eager)",
    )
    mem.add_argument(
        "--head-chunks",
        type=int,
        default=d.head_chunks,
        help="attention in K stages of heads (UPipe); K divides the heads per rank",
    )
    mem.add_argument(
        "--overlap-comm",
        action="store_true",
        help="hide all-to-alls behind compute: k, v move while q is projected; with "
        "--head-chunks, stage c+1 moves while stage c attends (same values; costs the "
        "in-flight buffers, which shortens the longest sequence that fits)",
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


def _add_eval_args(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The flags of the held-out loss."""
    p.add_argument(
        "--eval-data",
        nargs="+",
        default=None,
        help="held-out text or JSONL files: loss and perplexity with the sequence sharded",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=d.eval_every,
        help="evaluate every N steps (needs --eval-data; default 0: only after the last step)",
    )


def _add_hf_args(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The flags of ``--hf-model`` and its tokenizer."""
    hf = p.add_argument_group(
        "Hugging Face models (from a clone: pip install -e '.[hf]')",
        '--data also takes chat JSONL ({"messages": [...]}, loss on assistant tokens only); '
        "the memory preflight estimates a Llama-style decoder of the config's shape",
    )
    hf.add_argument(
        "--hf-model",
        default=None,
        metavar="DIR",
        help="a local transformers model directory (config.json + safetensors) to fine-tune, "
        "loaded straight into the FSDP2 shards; not with --model",
    )
    hf.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="the tokenizer's directory (default: the --hf-model directory)",
    )
    hf.add_argument(
        "--save-hf",
        default=None,
        metavar="DIR",
        help="at the end, write the trained model (and tokenizer) for from_pretrained",
    )


def _add_run_args(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The flags of the memory preflight, the device and the collective timeout."""
    p.add_argument(
        "--allow-oversubscribe",
        action="store_true",
        help="start even when the memory preflight estimates that the run does not fit",
    )
    p.add_argument(
        "--memory-headroom",
        type=float,
        default=None,
        metavar="FRACTION",
        help="the memory preflight refuses a run whose estimate exceeds this fraction of a "
        "rank's capacity (default: 0.9; the rest is the estimate's error and the allocator's "
        "fragmentation)",
    )
    p.add_argument(
        "--device", default=None, choices=["cuda", "cpu"], help="default: cuda if available"
    )
    p.add_argument(
        "--collective-timeout-s",
        type=float,
        default=d.collective_timeout_s,
        help="a collective waiting longer fails the run",
    )


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The command line as a :class:`TrainConfig`, unresolved (the checks of
    :func:`~dtensor_ulysses.train.validate` return it resolved); one helper per argument group.

    Raises:
        UsageError: an unknown flag or a bad value.
    """
    p = _Parser(
        prog="python -m dtensor_ulysses.train",
        description="FSDP2 + Ulysses training (launch with torchrun).",
        formatter_class=_HelpFormatter,
    )
    d = TrainConfig()
    _add_layout_args(p, d)
    _add_checkpoints_args(p, d)
    _add_optimizer_args(p, d)
    _add_model_args(p, d)
    _add_memory_args(p, d)
    _add_eval_args(p, d)
    _add_hf_args(p, d)
    _add_run_args(p, d)
    args = p.parse_args(argv)
    return TrainConfig(**{k: v for k, v in vars(args).items()})


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _warn(message: str) -> None:
    """One ``warning:`` line on stderr, from rank 0 (before the process group exists)."""
    if _is_rank0():
        print(f"warning: {message}", file=sys.stderr, flush=True)
