"""Per-rank functions for the offload tests (imported by module path in spawned processes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dtensor_ulysses import memory
from dtensor_ulysses.memory import offload_checkpoints
from dtensor_ulysses.models import build_model, init_weights
from dtensor_ulysses.parallel import flatten_dp_sp, init_mesh, parallelize
from dtensor_ulysses.train import checkpoint as ckpt

B, S = 2, 64


def tiny(dp: int, sp: int, *, ac: bool = True, offload_acts: bool = False, seed: int = 0):
    """The tiny preset, parallelized over (dp, sp), initialized; and its offloader (or None)."""
    mesh = init_mesh(dp, sp, device_type="cpu")
    model = build_model("tiny")
    parallelize(model, mesh, activation_checkpointing=ac)
    offloader = offload_checkpoints(model.layers) if offload_acts else None
    model.to_empty(device="cpu")
    init_weights(model, seed=seed)
    return model, mesh, offloader


def batch(mesh, step: int = 0):
    """This rank's slice of a fixed global batch ``[B, S]``: rows on dp, sequence on sp."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, 272, (B, S + 1), generator=g)
    dp_rank, sp_rank = mesh.get_coordinate()
    dp, sp = mesh["dp"].size(), mesh["sp"].size()
    rows = slice(dp_rank * B // dp, (dp_rank + 1) * B // dp)
    cols = slice(sp_rank * S // sp, (sp_rank + 1) * S // sp)
    pos = torch.arange(S).expand(B, S)
    return ids[rows, :-1][:, cols], pos[rows][:, cols], ids[rows, 1:][:, cols]


def loss_backward(model, mesh, step: int = 0) -> float:
    ids, pos, labels = batch(mesh, step)
    logits = model(ids, pos)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / (B * S)
    loss.backward()
    return loss.item()


def full_grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[name] = g.clone()
    return out


def full_params(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def activation_offload(rank: int, world_size: int, dp: int, sp: int):
    """Gradients of one step with and without offloaded checkpoints; the offloader's counters."""
    out = {}
    for offload_acts in (False, True):
        model, mesh, offloader = tiny(dp, sp, offload_acts=offload_acts)
        host_before = memory.host_bytes()
        ids, pos, labels = batch(mesh)
        logits = model(ids, pos)
        host_after_forward = memory.host_bytes() - host_before
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        loss.backward()
        out[offload_acts] = {
            "grads": full_grads(model),
            "host_after_forward": host_after_forward,
            "host_after_backward": memory.host_bytes() - host_before,
            "stats": None if offloader is None else vars(offloader.stats).copy(),
            "h_bytes": ids.numel() * model.shape.dim * 4,
            "layers": len(model.layers),
        }
    return out


def _groups(model, weight_decay: float):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0},
    ]


def make_optimizer(model, host: bool):
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
    if host:
        opt = memory.HostOffloadAdamW(_groups(model, 0.1), **kw)
    else:
        opt = torch.optim.AdamW(_groups(model, 0.1), foreach=True, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: (step + 1) / 4)
    return opt, sched


def train(model, mesh, opt, sched, steps: range) -> list[float]:
    losses = []
    for step in steps:
        losses.append(loss_backward(model, mesh, step))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return losses


def host_optimizer(rank: int, world_size: int, ckpt_dir: str):
    """FSDP2 at dp=world: HostOffloadAdamW vs AdamW for 3 steps; 6 steps vs 3 + DCP resume + 3."""
    out = {}
    for host in (False, True):
        model, mesh, _ = tiny(world_size, 1, ac=False)
        opt, sched = make_optimizer(model, host)
        losses = train(model, mesh, opt, sched, range(3))
        out[host] = {"losses": losses, "params": full_params(model)}
    states = [v for st in opt.state.values() for v in st.values() if v.dim() > 0]
    out["states_on_host"] = all(memory.is_host(v) for v in states) and len(states) > 0
    out["state_dict_is_dtensor"] = all(
        isinstance(st["exp_avg"], DTensor) for st in opt.state_dict()["state"].values()
    )
    # straight 6 steps vs 3 + checkpoint + a fresh model and optimizer resumed + 3
    model, mesh, _ = tiny(world_size, 1, ac=False)
    opt, sched = make_optimizer(model, True)
    straight = train(model, mesh, opt, sched, range(6))
    straight_params = full_params(model)
    model, mesh, _ = tiny(world_size, 1, ac=False)
    opt, sched = make_optimizer(model, True)
    first = train(model, mesh, opt, sched, range(3))
    path = ckpt.save(ckpt_dir, 3, model, opt, sched, meta={})
    model, mesh, _ = tiny(world_size, 1, ac=False, seed=123)  # other weights: all must load
    opt, sched = make_optimizer(model, True)
    ckpt.load(path, model, opt, sched)
    resumed = first + train(model, mesh, opt, sched, range(3, 6))
    resumed_params = full_params(model)
    out["resume"] = {
        "straight": straight,
        "resumed": resumed,
        "params_equal": all(torch.equal(v, resumed_params[k]) for k, v in straight_params.items()),
        "lr": (opt.param_groups[0]["lr"], sched.get_last_lr()[0]),
    }
    return out


def offload_params(rank: int, world_size: int):
    """FSDP2's CPUOffloadPolicy on a CPU/gloo mesh: gradients and one AdamW step vs no offload."""
    out = {}
    for use_policy in (False, True):
        mesh = init_mesh(world_size, 1, device_type="cpu")
        model = build_model("tiny")
        kw: dict = {"mesh": flatten_dp_sp(mesh)}
        if use_policy:
            kw["offload_policy"] = memory.fsdp_offload_policy(mesh)
        for block in model.layers:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        model.to_empty(device="cpu")
        init_weights(model, seed=0)
        opt, sched = make_optimizer(model, False)
        loss = train(model, mesh, opt, sched, range(2))
        out[use_policy] = {"loss": loss, "params": full_params(model)}
    out["pin_memory"] = memory.fsdp_offload_policy(mesh).pin_memory
    return out
