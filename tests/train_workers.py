"""Per-rank functions for the training tests (imported by module path in spawned processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtensor_ulysses import train as du_train
from dtensor_ulysses.data import PackedCorpus, get_batch
from dtensor_ulysses.loss import cross_entropy_sum, global_valid_tokens, loss_for_backward
from dtensor_ulysses.mesh import init_mesh
from dtensor_ulysses.parallelize import fsdp_world_size


def one_step_grads(rank: int, world_size: int, layouts: list[tuple[int, int]], cfg_kw: dict):
    """For each (dp, sp): loss and every parameter's full gradient after one forward/backward."""
    out = []
    for dp, sp in layouts:
        cfg = du_train.validate(du_train.TrainConfig(dp=dp, sp=sp, **cfg_kw), world_size)
        mesh = init_mesh(dp, sp, device_type="cpu")
        model, _, _ = du_train.build(cfg, mesh, torch.device("cpu"))
        dp_rank, sp_rank = mesh.get_coordinate()
        corpus = PackedCorpus.from_paths(cfg.data, seq_len=cfg.seq_len)
        batch = get_batch(
            corpus, 0, global_batch_size=cfg.batch_size, dp_rank=dp_rank, dp=dp,
            sp_rank=sp_rank, sp=sp, seed=cfg.seed,
        )  # fmt: skip
        local_sum = cross_entropy_sum(model(batch.input_ids, batch.position_ids), batch.labels)
        n_valid = global_valid_tokens(batch.labels)
        loss_for_backward(local_sum, n_valid, fsdp_world_size(mesh)).backward()
        total = local_sum.detach().reshape(1)
        dist.all_reduce(total)
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[name] = g.clone()
        out.append({"layout": (dp, sp), "loss": total.item() / n_valid, "grads": grads})
    return out


def run_training(rank: int, world_size: int, runs: list[dict]):
    """Each run: a TrainConfig's keyword arguments; returns each run's per-step losses."""
    results = []
    for kw in runs:
        cfg = du_train.validate(du_train.TrainConfig(**kw), world_size)
        records = du_train.train(cfg)
        results.append([(r["step"], r["loss"]) for r in records])
    return results
