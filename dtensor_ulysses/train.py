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
import hashlib
import json
import math
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ulysses import checkpoint as ckpt
from dtensor_ulysses._exit import exit_process, leave_together
from dtensor_ulysses.attention import flash_attn_available
from dtensor_ulysses.data import Batch, PackedCorpus, get_batch
from dtensor_ulysses.loss import global_valid_tokens
from dtensor_ulysses.mesh import default_device_type, flatten_dp_sp, init_mesh
from dtensor_ulysses.metrics import StepLogger
from dtensor_ulysses.model import build_model, model_flops_per_token, set_tiling
from dtensor_ulysses.offload import HostOffloadAdamW
from dtensor_ulysses.parallel import parallelize
from dtensor_ulysses.plan import check_ring_seq, check_sp_for_heads, nearby_multiples
from dtensor_ulysses.preflight import MEMORY_FEATURES, check_fits
from dtensor_ulysses.presets import ModelShape, get_shape
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
    loss_chunk_tokens: int | None = None  # None: min(2048, local tokens)
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
    resume_from: str | None = None  # set by validate(): the checkpoint --resume loads
    hf_model: str | None = None  # a transformers model directory instead of a preset
    tokenizer: str | None = None  # None: the --hf-model directory
    save_hf: str | None = None
    eval_data: list[str] | None = None
    eval_every: int = 0  # steps; 0: only at the end


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


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    p = _Parser(
        prog="python -m dtensor_ulysses.train",
        description="FSDP2 + Ulysses training (launch with torchrun).",
        formatter_class=_HelpFormatter,
    )
    d = TrainConfig()
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
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr / peak lr")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear warmup")
    p.add_argument("--decay-steps", type=int, default=d.decay_steps, help="cosine horizon")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW")
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="global norm; 0: off")
    p.add_argument(
        "--activation-checkpointing", action="store_true", help="recompute each block in backward"
    )
    p.add_argument("--attention-backend", default=d.attention_backend,
                   choices=["auto", "flash_attn", "sdpa"],
                   help="flash_attn needs CUDA and the flash-attn package; auto: flash_attn "
                        "when it can run, else sdpa")  # fmt: skip
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
        "in-flight buffers: ~13%% shorter longest sequence with head chunks)",
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
    hf = p.add_argument_group(
        "Hugging Face models (pip install 'dtensor-ulysses[hf]')",
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
    p.add_argument(
        "--allow-oversubscribe",
        action="store_true",
        help="start even when the memory preflight estimates that the run does not fit",
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
    args = p.parse_args(argv)
    return TrainConfig(**{k: v for k, v in vars(args).items()})


def validate(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """Check the configuration before any process group exists; resolve ``sp`` (and ``model``:
    ``"tiny"`` unless ``--hf-model`` is given).

    Raises:
        UsageError: with the numbers and the fix, for every bad combination.
    """
    if cfg.hf_model is not None and cfg.model is not None:
        raise UsageError(
            f"--hf-model and --model are exclusive: train the transformers model in "
            f"{cfg.hf_model!r} or the preset {cfg.model!r}, not both"
        )
    if cfg.hf_model is None:
        for flag, value in (("--tokenizer", cfg.tokenizer), ("--save-hf", cfg.save_hf)):
            if value is not None:
                raise UsageError(
                    f"{flag} applies to --hf-model only; this run trains the built-in model"
                )
        cfg.model = cfg.model or "tiny"
    for name in ("dp", "ring", "seq_len", "batch_size", "steps"):
        if getattr(cfg, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(cfg, name)} must be >= 1")
    if cfg.keep_last is not None and cfg.keep_last < 1:
        raise UsageError(f"--keep-last {cfg.keep_last} must be >= 1 (omit it to keep all)")
    if cfg.eval_every < 0:
        raise UsageError(f"--eval-every {cfg.eval_every} must be >= 0 (0: only at the end)")
    if cfg.eval_every and not cfg.eval_data:
        raise UsageError("--eval-every needs --eval-data (the held-out files)")
    if cfg.sp is None:
        if world_size % (cfg.dp * cfg.ring):
            what = f"--dp {cfg.dp}" + (f" x --ring {cfg.ring}" if cfg.ring > 1 else "")
            raise UsageError(f"{what} does not divide the world size {world_size}")
        cfg.sp = world_size // (cfg.dp * cfg.ring)
    if cfg.sp < 1:
        raise UsageError(f"--sp={cfg.sp} must be >= 1")
    if cfg.ring > 1:
        if cfg.dp * cfg.ring * cfg.sp != world_size:
            raise UsageError(
                f"--dp {cfg.dp} x --ring {cfg.ring} x --sp {cfg.sp} = "
                f"{cfg.dp * cfg.ring * cfg.sp} but torchrun started {world_size} processes; "
                f"make dp * ring * sp equal --nproc-per-node x --nnodes"
            )
        if cfg.hf_model is not None or cfg.eval_data:
            raise UsageError("--ring applies to the built-in model without --eval-data for now")
        try:
            check_ring_seq(cfg.seq_len, cfg.ring)
        except ValueError as e:
            raise UsageError(f"--seq-len: {e}") from None
    elif cfg.dp * cfg.sp != world_size:
        raise UsageError(
            f"--dp {cfg.dp} x --sp {cfg.sp} = {cfg.dp * cfg.sp} but torchrun started "
            f"{world_size} processes; make dp * sp equal --nproc-per-node x --nnodes"
        )
    shape = _validate_hf(cfg) if cfg.hf_model is not None else _validate_preset(cfg)
    device_type = _validate_device(cfg, shape)
    if (cfg.seq_len // cfg.ring) % cfg.sp and cfg.strict_seq_len:
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
    if cfg.resume and not cfg.checkpoint_dir:
        raise UsageError("--resume needs --checkpoint-dir (where to find the checkpoint)")
    try:  # reads and checks the data files now; the corpora are cached for train()
        _corpus(cfg, cfg.data)
        if cfg.eval_data:
            _check_eval_corpus(cfg, _corpus(cfg, cfg.eval_data, what="--eval-data"))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if cfg.resume:
        assert cfg.checkpoint_dir is not None
        cfg.resume_from = str(_select_checkpoint(cfg.checkpoint_dir))
        try:
            _check_resumable(Path(cfg.resume_from), cfg)  # before any model is built
        except ValueError as e:
            raise UsageError(str(e)) from None
    if shape is None:
        _warn(
            f"memory preflight skipped: the config of {cfg.hf_model!r} is not a Llama-style "
            f"decoder shape the estimate knows"
        )
    else:
        _preflight(cfg, shape, device_type)  # last: the run is otherwise valid
    return cfg


def _validate_preset(cfg: TrainConfig) -> ModelShape:
    assert cfg.model is not None and cfg.sp is not None
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
    return shape


# ----------------------------------------------------------------------------------------------
# --hf-model: checks before any process group, the tokenizer, the corpora
# ----------------------------------------------------------------------------------------------
_TOKENIZERS: dict[str, object] = {}  # tokenizer directory -> the one loaded by validate()


def _hf_dir(cfg: TrainConfig) -> str:
    assert cfg.hf_model is not None
    return os.path.abspath(cfg.hf_model)


def _tokenizer_dir(cfg: TrainConfig) -> str:
    return os.path.abspath(cfg.tokenizer or _hf_dir(cfg))


def _tokenizer(cfg: TrainConfig):
    """The run's tokenizer, loaded once per process (the corpus cache is keyed on it)."""
    key = _tokenizer_dir(cfg)
    if key not in _TOKENIZERS:
        from dtensor_ulysses.hf.model import load_tokenizer

        _TOKENIZERS[key] = load_tokenizer(key)
    return _TOKENIZERS[key]


def _validate_hf(cfg: TrainConfig) -> ModelShape | None:
    """``--hf-model``: the directory, weights, architecture, heads and tokenizer, each refused
    with one message; returns the config's shape for the preflight (None if not Llama-style)."""
    assert cfg.sp is not None
    try:
        from dtensor_ulysses.hf.model import validate_config
    except ImportError as e:
        raise UsageError(f"--hf-model: {e}") from None
    if cfg.tiled_mlp:
        raise UsageError("--tiled-mlp applies to the built-in model only, not to --hf-model")
    if cfg.save_hf is not None:
        out, src = Path(cfg.save_hf).resolve(), Path(_hf_dir(cfg))
        if out == src or out in src.parents:
            raise UsageError(
                f"--save-hf {cfg.save_hf!r} would replace the --hf-model directory it is trained "
                f"from; write to another directory"
            )
    try:
        tokenizer = validate_config(cfg)
        _check_weights_match(Path(_hf_dir(cfg)))
    except ValueError as e:
        msg = str(e)
        if "not divisible by sp" in msg and not cfg.allow_uneven_heads:
            msg += " (or pass --allow-uneven-heads to accept a load imbalance)"
        raise UsageError(msg) from None
    _TOKENIZERS[_tokenizer_dir(cfg)] = tokenizer
    return _hf_shape(_hf_dir(cfg))


def _hf_config(directory: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory)


def _hf_shape(directory: str) -> ModelShape | None:
    """The :class:`ModelShape` of a transformers config (for the memory preflight), or None
    when the config lacks a Llama-style field."""
    c = _hf_config(directory).get_text_config()
    try:
        n_heads = int(c.num_attention_heads)
        dim = int(c.hidden_size)
        return ModelShape(
            name=Path(directory).name,
            n_layers=int(c.num_hidden_layers),
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=int(getattr(c, "num_key_value_heads", None) or n_heads),
            head_dim=int(getattr(c, "head_dim", None) or dim // n_heads),
            ffn_dim=int(c.intermediate_size),
            vocab_size=int(c.vocab_size),
            tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            qk_norm=getattr(c, "model_type", "") in ("qwen3",),
        )
    except (AttributeError, TypeError, ValueError):
        return None


def _check_weights_match(directory: Path) -> None:
    """The safetensors tensors (names and shapes, read from the file headers) are those of the
    model that ``config.json`` builds; ValueError naming the first differences otherwise."""
    import re

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from dtensor_ulysses.hf.model import _tied_names, _weight_files

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(_hf_config(str(directory)))
    want = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    ignore = list(getattr(hf, "_keys_to_ignore_on_load_unexpected", None) or [])
    seen, wrong, unexpected = set(), [], []
    for file in _weight_files(directory):
        if not file.is_file():
            raise ValueError(f"weights file {str(file)!r} (named by the index) does not exist")
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if key not in want:
                        if not any(re.search(p, key) for p in ignore):
                            unexpected.append(key)
                        continue
                    got = tuple(f.get_slice(key).get_shape())
                    if got != want[key]:
                        wrong.append(f"{key} {got} (config: {want[key]})")
                    seen.add(key)
        except (OSError, RuntimeError) as e:  # safetensors raises its own error types too
            raise ValueError(f"cannot read weights file {str(file)!r}: {e}") from None
        except Exception as e:
            if type(e).__name__ != "SafetensorError":
                raise
            raise ValueError(f"cannot read weights file {str(file)!r}: {e}") from None
    tied = _tied_names(hf)
    missing = sorted(k for k in want if k not in seen and k not in tied)
    if wrong or missing or unexpected:
        parts = [
            f"{label} {items[:3]}{' ...' if len(items) > 3 else ''}"
            for label, items in (
                ("shapes differ:", wrong),
                ("missing", missing),
                ("unexpected", unexpected),
            )  # fmt: skip
            if items
        ]
        raise ValueError(
            f"the weights in {str(directory)!r} do not match its config.json "
            f"({type(hf).__name__}): {'; '.join(parts)}"
        )


def _corpus(cfg: TrainConfig, paths: list[str] | None, what: str = "--data"):
    """The training or evaluation corpus (cached per process): bytes for the built-in model,
    the tokenizer's ids (text and chat) for ``--hf-model``."""
    if cfg.hf_model is None:
        return PackedCorpus.from_paths(paths, seq_len=cfg.seq_len)
    from dtensor_ulysses.hf.data import load_corpus

    try:
        return load_corpus(paths, _tokenizer(cfg), cfg.seq_len)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def _check_eval_corpus(cfg: TrainConfig, corpus) -> None:
    if len(corpus) < cfg.batch_size:
        raise ValueError(
            f"--eval-data holds {len(corpus)} windows of {cfg.seq_len} tokens, fewer than one "
            f"global batch of {cfg.batch_size}; add held-out data or shorten --seq-len"
        )


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _warn(message: str) -> None:
    """One ``warning:`` line on stderr, from rank 0 (before the process group exists)."""
    if _is_rank0():
        print(f"warning: {message}", file=sys.stderr, flush=True)


def _validate_device(cfg: TrainConfig, shape: ModelShape | None) -> str:
    """The device type the run uses; refuses a device or kernel this machine lacks."""
    device_type = cfg.device or default_device_type()
    if device_type == "cuda" and not torch.cuda.is_available():
        why = (
            "this PyTorch is built without CUDA"
            if torch.version.cuda is None
            else "no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)"
        )
        raise UsageError(f"--device cuda: {why}; drop --device cuda to train on the CPU")
    if cfg.attention_backend == "flash_attn":
        if device_type != "cuda":
            raise UsageError(
                "--attention-backend flash_attn runs on CUDA only and this run is on the CPU; "
                "use --attention-backend sdpa (or auto)"
            )
        if not flash_attn_available():
            raise UsageError(
                "--attention-backend flash_attn: the flash-attn package is not importable; "
                "pip install 'dtensor-ulysses[flash]', or use --attention-backend sdpa (or auto)"
            )
        head_dim = shape.head_dim if shape is not None else 0
        if head_dim > 256:
            raise UsageError(
                f"--attention-backend flash_attn supports head dim <= 256; model "
                f"{cfg.model or cfg.hf_model!r} "
                f"has {head_dim}; use --attention-backend sdpa"
            )
    return device_type


def _preflight(cfg: TrainConfig, shape, device_type: str) -> None:
    """Refuse a run whose estimated per-rank memory exceeds this machine's (``preflight.py``)."""
    assert cfg.sp is not None
    features = {name: getattr(cfg, name) for name in MEMORY_FEATURES}
    features["overlap_comm"] = cfg.overlap_comm  # not a memory feature, but it costs memory
    try:
        result = check_fits(
            shape, device_type=device_type, features=features,
            seq_len=cfg.seq_len // cfg.ring,  # a ring rank's sp group sees S / ring tokens
            batch_size=cfg.batch_size, dp=cfg.dp, sp=cfg.sp,
        )  # fmt: skip
    except ValueError as e:  # a bad capacity override
        raise UsageError(f"memory preflight: {e}") from None
    if result.fits:
        return
    if cfg.allow_oversubscribe:
        _warn(f"memory preflight: {result.problem} (starting anyway: --allow-oversubscribe)")
        return
    raise UsageError(f"memory preflight: {result.problem}")


def _select_checkpoint(ckpt_dir: str) -> Path:
    """The newest intact checkpoint; warns about each damaged newer one it skips."""
    path, damaged = ckpt.select_resume(ckpt_dir)
    if path is None and not damaged:
        raise UsageError(
            f"--resume: no checkpoint in {ckpt_dir!r}; run once without --resume "
            f"(with --checkpoint-dir) to create one"
        )
    if path is None:
        bad, problem = damaged[0]
        more = f" (and {len(damaged) - 1} older, also damaged)" if len(damaged) > 1 else ""
        raise UsageError(
            f"--resume: checkpoint {bad} is damaged: {problem}{more}; no intact checkpoint "
            f"in {ckpt_dir!r}. Delete the damaged directories to start over without --resume, "
            f"or restore them from a copy"
        )
    for bad, problem in damaged:
        _warn(f"checkpoint {bad} is damaged ({problem}); resuming from {path} instead")
    return path


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
    return cfg.batch_size // cfg.dp * -(-cfg.seq_len // (cfg.ring * cfg.sp))


def _validate_memory_features(cfg: TrainConfig, shape: ModelShape | None) -> None:
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
            if shape is not None:  # else the engine checks it when the model is built
                check_head_chunks(shape.n_heads, cfg.sp, cfg.head_chunks)
        except ValueError as e:
            raise UsageError(str(e).replace("head_chunks=", "--head-chunks ")) from None
    if cfg.overlap_comm and cfg.hf_model:
        raise UsageError("--overlap-comm applies to the built-in model only, not to --hf-model")
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


def _checkpoint_meta(cfg: TrainConfig) -> dict:
    """What a checkpoint records of its run: the model (a preset's shape, or a transformers
    model's directory and config hash), and everything that decides the tokens of each step."""
    meta: dict = {
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "data": cfg.data,
        "pack_docs": cfg.pack_docs,
    }
    if cfg.hf_model is None:
        return {"shape": get_shape(cfg.model or "tiny").to_dict(), **meta}
    config = json.loads((Path(_hf_dir(cfg)) / "config.json").read_text())
    for volatile in ("transformers_version", "_name_or_path"):
        config.pop(volatile, None)
    tok = _tokenizer(cfg)
    vocab = json.dumps([sorted(tok.get_vocab().items()), getattr(tok, "chat_template", None)])
    return {
        "hf_model": {
            "path": _hf_dir(cfg),
            "architectures": config.get("architectures"),
            "config_sha256": _sha256(json.dumps(config, sort_keys=True)),
        },
        "tokenizer_sha256": _sha256(vocab),
        **meta,
    }


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _check_resumable(path, cfg: TrainConfig) -> None:
    meta = ckpt.read_meta(path)["meta"]
    run = _checkpoint_meta(cfg)
    held = (
        f"--hf-model {meta['hf_model']['path']!r}"
        if "hf_model" in meta
        else f"model {meta['shape']['name']!r}"
    )
    if "hf_model" in meta or "hf_model" in run:
        if "hf_model" not in meta or "hf_model" not in run:
            builds = f"--hf-model {cfg.hf_model!r}" if cfg.hf_model else f"model {cfg.model!r}"
            raise ValueError(
                f"checkpoint {path} holds {held} but this run builds {builds}; resume with the "
                f"checkpoint's model or use another --checkpoint-dir"
            )
        if meta["hf_model"]["config_sha256"] != run["hf_model"]["config_sha256"]:
            raise ValueError(
                f"checkpoint {path} holds --hf-model {meta['hf_model']['path']!r} "
                f"({meta['hf_model']['architectures']}), whose config.json differs from that of "
                f"{run['hf_model']['path']!r}; resume with the same model or use another "
                f"--checkpoint-dir"
            )
    else:
        want = run["shape"]
        if meta["shape"] != want:
            diff = {
                k: (meta["shape"].get(k), v) for k, v in want.items() if meta["shape"].get(k) != v
            }
            raise ValueError(
                f"checkpoint {path} holds model {meta['shape']['name']!r} but this run builds "
                f"{cfg.model!r}; differing (checkpoint, run): {diff}. Use --model "
                f"{meta['shape']['name']} or another --checkpoint-dir"
            )
    data_keys = ["seq_len", "batch_size", "seed", "data", "pack_docs"]
    if "tokenizer_sha256" in run:
        data_keys.append("tokenizer_sha256")
    changed = [k for k in data_keys if meta.get(k) != run[k]]
    if changed:
        what = ", ".join(
            "another tokenizer" if k == "tokenizer_sha256" else f"{k}={meta.get(k)!r}"
            for k in changed
        )
        raise ValueError(
            f"checkpoint {path} was trained with {what}; resuming with other values would not "
            f"continue the same run. Pass the same values or use another --checkpoint-dir"
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
    A step with an evaluation (``--eval-every``, and the last step with ``--eval-data``) also
    holds ``eval_loss``, ``eval_perplexity`` and ``eval_tokens``.
    """
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
    model.train()
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        batch = batch_fn(
            corpus, step, global_batch_size=cfg.batch_size, dp_rank=dp_rank, dp=cfg.dp,
            sp_rank=sp_rank, sp=cfg.sp, seed=cfg.seed, pack_docs=cfg.pack_docs, uneven=True,
            **ring_kw,
        ).to(device)  # fmt: skip
        result = train_step(
            model, batch, optimizer, scheduler, group=group, grad_clip=cfg.grad_clip
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        extra: dict = {"lr": scheduler.get_last_lr()[0]}
        if result.grad_norm is not None:
            extra["grad_norm"] = result.grad_norm
        done = step + 1
        if eval_corpus is not None and (
            done == cfg.steps or (cfg.eval_every and done % cfg.eval_every == 0)
        ):
            extra.update(_evaluate(cfg, model, eval_corpus, dp_rank, sp_rank, group, device))
        records.append(logger.log(done, result.loss, result.tokens, elapsed, **extra))
        if "eval_loss" in extra and rank == 0:
            print(
                f"eval after step {done} | loss {extra['eval_loss']:.4f} | perplexity "
                f"{extra['eval_perplexity']:.2f} | {extra['eval_tokens']} tokens",
                flush=True,
            )
        if cfg.checkpoint_dir and cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
            _save(cfg, done, model, optimizer, scheduler, meta)
            saved = done
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


def _save(cfg: TrainConfig, step: int, model, optimizer, scheduler, meta: dict) -> None:
    assert cfg.checkpoint_dir is not None
    ckpt.save(
        cfg.checkpoint_dir, step, model, optimizer, scheduler, meta,
        keep_last=cfg.keep_last, announce=True,
    )  # fmt: skip


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
