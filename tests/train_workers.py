"""Per-rank functions for the training tests (imported by module path in spawned processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtensor_ulysses import train as du_train
from dtensor_ulysses.attention import model_kernels
from dtensor_ulysses.data import PackedCorpus, get_batch
from dtensor_ulysses.parallel import flatten_dp_sp, init_mesh


def one_step_grads(rank: int, world_size: int, layouts: list[tuple[int, int]], cfg_kw: dict):
    """For each (dp, sp): loss and every parameter's full gradient after one forward/backward."""
    out = []
    for dp, sp in layouts:
        cfg = du_train.validate(du_train.TrainConfig(dp=dp, sp=sp, **cfg_kw), world_size)
        mesh = init_mesh(dp, sp, device_type="cpu")
        model, _, _ = du_train.build(cfg, mesh, torch.device("cpu"))
        # validate's kernel choice is the one every layer stores
        stored = [c is cfg.kernel_choice for c in model_kernels(model)]
        dp_rank, sp_rank = mesh.get_coordinate()
        corpus = PackedCorpus.from_paths(cfg.data, seq_len=cfg.seq_len)
        batch = get_batch(
            corpus, 0, global_batch_size=cfg.batch_size, dp_rank=dp_rank, dp=dp,
            sp_rank=sp_rank, sp=sp, seed=cfg.seed,
        )  # fmt: skip
        group = flatten_dp_sp(mesh).get_group()
        local_sum, n_valid = du_train.forward_backward(model, batch, group)
        total = local_sum.reshape(1)
        dist.all_reduce(total)
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[name] = g.clone()
        out.append({"layout": (dp, sp), "loss": total.item() / n_valid, "grads": grads,
                    "stored": stored})  # fmt: skip
    return out


def run_training(rank: int, world_size: int, runs: list[dict]):
    """Each run: a TrainConfig's keyword arguments; returns each run's per-step losses."""
    results = []
    for kw in runs:
        cfg = du_train.validate(du_train.TrainConfig(**kw), world_size)
        records = du_train.train(cfg)
        results.append([(r["step"], r["loss"]) for r in records])
    return results


def packed_step_collectives(rank: int, world_size: int, cfg_kw: dict):
    """One forward/backward at dp=1, sp=world_size, with and without packed documents: per
    collective kind, the count and bytes on this rank."""
    from dtensor_ulysses.debug import CommCounter

    cfg = du_train.validate(du_train.TrainConfig(dp=1, sp=world_size, **cfg_kw), world_size)
    mesh = init_mesh(1, world_size, device_type="cpu")
    model, _, _ = du_train.build(cfg, mesh, torch.device("cpu"))
    corpus = PackedCorpus.from_paths(cfg.data, seq_len=cfg.seq_len)
    out = {}
    for pack_docs in (False, True):
        batch = get_batch(
            corpus, 0, global_batch_size=cfg.batch_size, dp_rank=0, dp=1, sp_rank=rank,
            sp=world_size, seed=cfg.seed, pack_docs=pack_docs, uneven=True,
        )  # fmt: skip
        with CommCounter() as comm:
            du_train.forward_backward(model, batch, flatten_dp_sp(mesh).get_group())
        kinds = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")
        out[pack_docs] = {k: (comm.count(k), comm.bytes(k)) for k in kinds}
        out[pack_docs]["total"] = comm.count()
        if pack_docs:
            out["docs"] = max(len(row) for row in batch.layout.doc_starts)
    return out


def one_step_grads_many(rank: int, world_size: int, runs: list[tuple[list, dict]]):
    """:func:`one_step_grads` for several (layouts, config) pairs in one world."""
    return [one_step_grads(rank, world_size, layouts, cfg_kw) for layouts, cfg_kw in runs]
