"""The trainer's :func:`validate`: every check of a configuration before any process group
exists, each bad combination refused as one :class:`~dtensor_ulysses.train.UsageError` with
the numbers and the fix; the memory preflight comes last.

The ``--hf-model`` checks and the corpora are in :mod:`dtensor_ulysses.train.inputs`, the
``--resume`` checks in :mod:`dtensor_ulysses.train.resume`.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from dtensor_ulysses.attention.kernels import (
    AttentionBackendError,
    AttnFeatures,
    KernelChoice,
    choose_kernel,
)
from dtensor_ulysses.parallel import apply as parallel_apply
from dtensor_ulysses.parallel.mesh import ParallelDims, default_device_type
from dtensor_ulysses.plan.preflight import check_fits
from dtensor_ulysses.plan.presets import ModelShape, get_shape
from dtensor_ulysses.plan.recipe import ParallelOptions
from dtensor_ulysses.plan.splits import check_ring_seq, nearby_multiples
from dtensor_ulysses.train.cli import TrainConfig, UsageError, _warn
from dtensor_ulysses.train.guard import SINGLE_PROCESS_ENV, check_numbers, check_targets
from dtensor_ulysses.train.inputs import check_eval_corpus, validate_hf
from dtensor_ulysses.train.resume import check_resumable, select_checkpoint
from dtensor_ulysses.train.spec import model_spec

__all__ = ["validate"]


def _started(world_size: int) -> str:
    """How many processes run, and how to start more when none came from a launcher."""
    if os.environ.get(SINGLE_PROCESS_ENV):
        return (
            "this is one process, not started by torchrun: launch it with `torchrun "
            "--nproc-per-node N -m dtensor_ulysses.train ...` (or `python -m "
            "dtensor_ulysses.launch --nproc-per-node N -m dtensor_ulysses.train ...`)"
        )
    return f"torchrun started {world_size} processes"


def validate(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """Check the configuration before any process group exists and return it resolved: a new
    :class:`TrainConfig` with the degrees (``sp``, ``parallel_dims``: one
    :class:`~dtensor_ulysses.parallel.ParallelDims`), the recipe (``parallel_options``: one
    :class:`~dtensor_ulysses.plan.ParallelOptions`, checked once), the built-in model's kernel
    (``kernel_choice``), ``model`` (``"tiny"`` unless ``--hf-model`` is given) and
    ``resume_from`` filled in; ``cfg`` itself is left as it was.

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
    for name in ("seq_len", "batch_size", "steps"):
        if getattr(cfg, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(cfg, name)} must be >= 1")
    if cfg.keep_last is not None and cfg.keep_last < 1:
        raise UsageError(f"--keep-last {cfg.keep_last} must be >= 1 (omit it to keep all)")
    check_numbers(cfg)  # the optimizer's and the schedule's numbers
    if cfg.eval_every < 0:
        raise UsageError(f"--eval-every {cfg.eval_every} must be >= 0 (0: only at the end)")
    if cfg.eval_every and not cfg.eval_data:
        raise UsageError("--eval-every needs --eval-data (the held-out files)")
    dims = _resolve_dims(cfg, world_size)
    # the resolved configuration, made once here (the caller's is never edited)
    cfg = replace(cfg, sp=dims.sp, parallel_dims=dims,
                  model=cfg.model if cfg.hf_model else cfg.model or "tiny")  # fmt: skip
    if dims.ring > 1:
        if cfg.hf_model is not None:
            raise UsageError("--ring applies to the built-in model, not to --hf-model")
        try:
            check_ring_seq(cfg.seq_len, cfg.ring)
        except ValueError as e:
            raise UsageError(f"--seq-len: {e}") from None
    shape = validate_hf(cfg) if cfg.hf_model is not None else _preset_shape(cfg)
    cfg = replace(cfg, parallel_options=_check_options(cfg, shape))  # built and checked once
    device_type, kernel = _validate_device(cfg, shape)
    if cfg.hf_model is None:  # the built-in model's one layer kind: parallelize stores this
        cfg = replace(cfg, kernel_choice=kernel)
    if (cfg.seq_len // cfg.ring) % dims.sp and cfg.strict_seq_len:
        raise UsageError(
            f"--seq-len {cfg.seq_len} is not divisible by sp={dims.sp}; use a multiple of "
            f"{dims.sp}, e.g. {nearby_multiples(cfg.seq_len, dims.sp)} (or drop --strict-seq-len)"
        )
    if cfg.batch_size % cfg.dp:
        raise UsageError(
            f"--batch-size {cfg.batch_size} (global) is not divisible by dp={cfg.dp}; use a "
            f"multiple of {cfg.dp}, e.g. {nearby_multiples(cfg.batch_size, cfg.dp)}"
        )
    if cfg.resume and not cfg.checkpoint_dir:
        raise UsageError("--resume needs --checkpoint-dir (where to find the checkpoint)")
    try:  # reads and checks the data files now; the corpora are cached for train()
        spec = model_spec(cfg)
        spec.corpus(cfg, cfg.data, "--data")
        if cfg.eval_data:
            check_eval_corpus(cfg, spec.corpus(cfg, cfg.eval_data, "--eval-data"))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if cfg.resume:
        assert cfg.checkpoint_dir is not None
        resume_from = str(select_checkpoint(cfg.checkpoint_dir))
        cfg = replace(cfg, resume_from=resume_from)
        try:
            check_resumable(Path(resume_from), cfg)  # before any model is built
        except ValueError as e:
            raise UsageError(str(e)) from None
    check_targets(cfg)  # the paths written, steps left to --resume, checkpoints of another run
    if shape is None:
        _warn(
            f"memory preflight skipped: the config of {cfg.hf_model!r} is not a Llama-style "
            f"decoder shape the estimate knows"
        )
    else:
        _preflight(cfg, shape, device_type)  # last: the run is otherwise valid
    return cfg


def _resolve_dims(cfg: TrainConfig, world_size: int) -> ParallelDims:
    """The run's degrees (``--sp`` unset: the ranks left), refused with the flags' names."""
    try:
        return ParallelDims.resolve(world_size, cfg.dp, cfg.sp, cfg.ring, spelling="flag",
                                    world=_started(world_size))  # fmt: skip
    except ValueError as e:
        raise UsageError(str(e)) from None


def _preset_shape(cfg: TrainConfig) -> ModelShape:
    assert cfg.model is not None
    try:
        return get_shape(cfg.model)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _check_options(cfg: TrainConfig, shape: ModelShape | None) -> ParallelOptions:
    """The run's :class:`~dtensor_ulysses.plan.ParallelOptions`, built from the flags and
    checked once (:meth:`~dtensor_ulysses.plan.ParallelOptions.check`, spelled as flags) with
    everything the run knows: the model's heads, sp, the ring, a rank's tokens, the family."""
    assert cfg.sp is not None
    options = cfg.options()
    if cfg.hf_model is not None:
        heads = f"q heads of {Path(cfg.hf_model).name}"
    else:
        heads = f"heads of model {cfg.model!r}"
    try:
        options.check(
            "flag", n_heads=None if shape is None else shape.n_heads, sp=cfg.sp, ring=cfg.ring,
            local_tokens=cfg.local_tokens(), hf_model=cfg.hf_model is not None,
            heads_name=heads,
        )  # fmt: skip
    except ValueError as e:
        raise UsageError(str(e)) from None
    return options


def _validate_device(cfg: TrainConfig, shape: ModelShape | None) -> tuple[str, KernelChoice | None]:
    """The device type the run uses and the built-in model's kernel (:func:`kernel_choice`;
    ``None`` without a shape); refuses a device or kernel this machine lacks."""
    device_type = cfg.device or default_device_type()
    if device_type == "cuda" and not torch.cuda.is_available():
        why = (
            "this PyTorch is built without CUDA"
            if torch.version.cuda is None
            else "no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)"
        )
        raise UsageError(f"--device cuda: {why}; drop --device cuda to train on the CPU")
    if shape is None:
        return device_type, None
    try:
        return device_type, kernel_choice(cfg, device_type, shape.head_dim)
    except AttentionBackendError as e:
        flag = f"--attention-backend {cfg.attention_backend}"
        if e.option == "compile":
            flag = f"--compile with --ring {cfg.ring}"
        raise UsageError(f"{flag}: {e}") from None


def kernel_choice(cfg: TrainConfig, device_type: str, head_dim: int) -> KernelChoice:
    """The built-in model's kernel for this run (its one layer kind: causal; packed documents
    with ``--pack-docs``; compiled; the ring's blocks with ``--ring``), chosen before any
    process group exists: ``validate`` keeps it in the resolved configuration
    (``kernel_choice``) and ``du.parallelize`` stores it on every layer as it is. For
    ``--hf-model`` it only refuses a kernel that cannot run plain attention here: the layers'
    kinds come from the model, and ``hf.apply_ulysses`` chooses per kind when it builds."""
    policy = parallel_apply.default_mixed_precision(device_type)  # what parallelize applies
    dtype = getattr(policy, "param_dtype", None) or torch.float32
    return choose_kernel(
        AttnFeatures(), device_type=device_type, dtype=dtype, head_dim=head_dim,
        requested=cfg.attention_backend, compiled=cfg.compile is not None, ring=cfg.ring > 1,
        docs=cfg.pack_docs,
    )  # fmt: skip


def _preflight(cfg: TrainConfig, shape, device_type: str) -> None:
    """Refuse a run whose estimated per-rank memory exceeds this machine's (``preflight.py``)."""
    assert cfg.sp is not None
    try:
        result = check_fits(
            shape, cfg.options(), device_type=device_type,
            seq_len=cfg.seq_len // cfg.ring,  # a ring rank's sp group sees S / ring tokens
            batch_size=cfg.batch_size, dp=cfg.dp, sp=cfg.sp, headroom=cfg.memory_headroom,
        )  # fmt: skip
    except ValueError as e:  # a bad capacity override
        raise UsageError(f"memory preflight: {e}") from None
    if result.fits:
        return
    if cfg.allow_oversubscribe:
        _warn(f"memory preflight: {result.problem} (starting anyway: --allow-oversubscribe)")
        return
    raise UsageError(f"memory preflight: {result.problem}")
