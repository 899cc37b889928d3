"""The trainer's checkpoints: which one ``--resume`` loads (the newest intact one), what a
checkpoint records of its run and whether this run may continue it (both checked by
``validate`` before any model is built), and saving one (``checkpoint.py`` does the writing).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dtensor_ulysses.plan.presets import get_shape
from dtensor_ulysses.train import checkpoint as ckpt
from dtensor_ulysses.train.cli import TrainConfig, UsageError, _warn
from dtensor_ulysses.train.inputs import hf_dir, run_tokenizer
from dtensor_ulysses.train.manifest import MANIFEST

__all__ = [
    "check_resumable",
    "checkpoint_meta",
    "load_checkpoint",
    "save_checkpoint",
    "select_checkpoint",
]


def select_checkpoint(ckpt_dir: str) -> Path:
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


def load_checkpoint(cfg: TrainConfig, path: Path, model, optimizer, scheduler) -> tuple[int, Path]:
    """Load ``path`` (validate()'s choice) on every rank, or, when it turns out damaged while
    loading (a checksum mismatch, a failure inside DCP), the newest older intact one: one
    ``warning:`` line per damaged checkpoint. Returns ``(step, the checkpoint loaded)``.

    Raises:
        UsageError: no intact checkpoint is left (one ``error:`` line).
    """
    assert cfg.checkpoint_dir is not None
    while True:
        if not (path / MANIFEST).is_file():
            _warn(
                f"checkpoint {path} has no {MANIFEST} (written by an earlier version): its "
                f"bytes cannot be checked before loading"
            )
        try:
            return int(ckpt.load(path, model, optimizer, scheduler)["step"]), path
        except ckpt.DamagedCheckpoint as e:
            older, skipped = ckpt.select_resume(cfg.checkpoint_dir, older_than=path)
            if older is None:
                raise UsageError(
                    f"--resume: checkpoint {path} is damaged ({e}) and no older intact "
                    f"checkpoint is left in {cfg.checkpoint_dir!r}. Restore it from a copy, "
                    f"or delete the damaged directories to start over without --resume"
                ) from None
            _warn(f"checkpoint {path} is damaged ({e}); resuming from {older} instead")
            for bad, problem in skipped:
                _warn(f"checkpoint {bad} is damaged ({problem}); resuming from {older} instead")
            path = older


def checkpoint_meta(cfg: TrainConfig) -> dict:
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
    config = json.loads((Path(hf_dir(cfg)) / "config.json").read_text())
    for volatile in ("transformers_version", "_name_or_path"):
        config.pop(volatile, None)
    tok = run_tokenizer(cfg)
    vocab = json.dumps([sorted(tok.get_vocab().items()), getattr(tok, "chat_template", None)])
    return {
        "hf_model": {
            "path": hf_dir(cfg),
            "architectures": config.get("architectures"),
            "config_sha256": _sha256(json.dumps(config, sort_keys=True)),
        },
        "tokenizer_sha256": _sha256(vocab),
        **meta,
    }


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def check_resumable(path, cfg: TrainConfig) -> None:
    meta = ckpt.read_meta(path)["meta"]
    run = checkpoint_meta(cfg)
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


def save_checkpoint(cfg: TrainConfig, step: int, model, optimizer, scheduler, meta: dict) -> None:
    assert cfg.checkpoint_dir is not None
    ckpt.save(
        cfg.checkpoint_dir, step, model, optimizer, scheduler, meta,
        keep_last=cfg.keep_last, announce=True,
    )  # fmt: skip
