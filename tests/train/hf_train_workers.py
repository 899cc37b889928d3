"""Per-rank functions for tests/train/test_train_hf.py (spawned processes import them by path)."""

from __future__ import annotations

import torch

from dtensor_ulysses import train as du_train
from dtensor_ulysses.parallel import init_mesh
from dtensor_ulysses.train.loop import _train
from tests import hf_workers as W


def train_runs(rank: int, world: int, runs: list[dict]):
    """Each run: TrainConfig keyword arguments (plus ``probe``: also return this rank's logits
    of the trained model on ``W.global_batch``); returns per run the step records."""
    from dtensor_ulysses import hf

    out = []
    for kw in runs:
        kw = dict(kw)
        probe = kw.pop("probe", False)
        cfg = du_train.validate(du_train.TrainConfig(**kw), world)
        records, model = _train(cfg)
        res: dict = {"records": records}
        if probe:
            assert cfg.sp is not None
            mesh = init_mesh(cfg.dp, cfg.sp, device_type="cpu")
            ids, _, pos, _ = W.global_batch(packed=False)
            b = ids.shape[0] // cfg.dp
            rows = slice(mesh.get_local_rank("dp") * b, (mesh.get_local_rank("dp") + 1) * b)
            sb = hf.shard_batch({"input_ids": ids[rows], "position_ids": pos[rows]}, mesh)
            model.eval()
            with torch.no_grad():
                logits = model(sb.input_ids, sb.position_ids, layout=sb.layout)
            lo = sb.layout.offset(mesh.get_local_rank("sp"))
            res["probe"] = (rows, (lo, lo + logits.shape[1]), logits.detach().clone())
        out.append(res)
    return out
