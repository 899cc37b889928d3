"""The vision split on CPU: each image encoded on one rank of the sp group vs every rank encoding
every image (what verl, prime-rl and ms-swift do).

A Qwen2.5-VL vision tower (random init, ``--hidden`` wide, ``--depth`` blocks) encodes a batch of
``--images`` images of different sizes on ``P`` gloo ranks, forward and backward of
``sum(features * w)``:

* ``split``: ``du.hf.vision``'s ``get_image_features`` (whole images assigned by patch count,
  features all-gathered, gradients reduce-scattered back);
* ``every rank``: the stock ``get_image_features`` on all images on every rank.

The table gives, per ``P``, the patches each rank encodes (the largest share), the median time of
the slowest rank for forward+backward, the same work timed in one process alone (all images vs the
largest rank's share: the compute saved, without ``P`` ranks competing for the cores), the bytes of
the tensors autograd saves for backward (the activations the vision tower keeps, per rank, the
largest rank's; storages counted once), the bytes of the split's collectives per rank (forward all-
gather / backward reduce-scatter), and the features checked equal. CPU numbers on a shared machine:
the ratio matters, not the times.

    python -m benchmarks.bench_vision_split --json benchmarks/results/bench_vision_split_cpu.json
    python -m benchmarks.bench_vision_split --world-sizes 2 --iters 2   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

from dtensor_ulysses.launch import run_local_world

# image grids (t, h, w) in patches, cycled to --images: different sizes, as in a real batch
GRIDS = [(1, 16, 16), (1, 16, 32), (1, 32, 16), (1, 8, 16), (1, 24, 24), (1, 16, 8)]


def _model(cfg: dict):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    h = cfg["hidden"]
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2],
                                          "rope_theta": 10000.0}),
        vision_config=dict(depth=cfg["depth"], hidden_size=h, intermediate_size=4 * h,
                           num_heads=max(1, h // 64), out_hidden_size=64, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[cfg["depth"] - 1]),
    )  # fmt: skip
    return Qwen2_5_VLForConditionalGeneration(config).float()


def _worker(rank: int, world: int, cfg: dict, variant: str) -> dict:
    torch.set_num_threads(cfg["threads"])
    from dtensor_ulysses.debug import CommCounter
    from dtensor_ulysses.hf.models.vision import assign_images, route_vision

    model = _model(cfg)
    grids = [GRIDS[i % len(GRIDS)] for i in range(cfg["images"])]
    grid = torch.tensor(grids)
    patch = 3 * 2 * 14 * 14
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(int(grid.prod(-1).sum()), patch, generator=g)
    if variant == "split":
        group = dist.group.WORLD
        assert group is not None  # run_local_world set it up
        route_vision(model, group)
    base = model.model
    times, comm, feats = [], {}, None
    saved: dict[int, int] = {}  # storage -> bytes of the tensors autograd saves for backward

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    for it in range(cfg["warmup"] + cfg["iters"]):
        dist.barrier()
        saved.clear()
        t0 = time.perf_counter()
        with CommCounter() as counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = base.get_image_features(pixels, grid, return_dict=True)
            feats = torch.cat(list(out.pooler_output))
            w = torch.randn(feats.shape, generator=torch.Generator().manual_seed(2))
            (feats * w).sum().backward()
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if it >= cfg["warmup"]:
            times.append(elapsed.item())
        comm = counter.by_kind()
        model.zero_grad(set_to_none=True)
    patches = grid.prod(-1).tolist()
    owner = assign_images(patches, world)
    mine = (
        sum(p for p, o in zip(patches, owner) if o == rank) if variant == "split" else sum(patches)
    )
    assert feats is not None
    return {"ms": 1e3 * statistics.median(times), "patches": mine,
            "saved_activation_bytes": sum(saved.values()),
            "comm": comm, "feats_sum": float(feats.detach().double().sum())}  # fmt: skip


def _one_process(cfg: dict, P: int) -> dict:
    """Forward+backward of all images vs of the largest rank's share, in this one process (no
    other rank competing for the cores): the compute the split saves, without the scheduler."""
    from dtensor_ulysses.hf.models.vision import assign_images

    torch.set_num_threads(cfg["threads"])
    model = _model(cfg)
    grids = [GRIDS[i % len(GRIDS)] for i in range(cfg["images"])]
    patches = [t * h * w for t, h, w in grids]
    owner = assign_images(patches, P)
    loads = [sum(p for p, o in zip(patches, owner) if o == q) for q in range(P)]
    share = [i for i, o in enumerate(owner) if o == loads.index(max(loads))]
    g = torch.Generator().manual_seed(1)

    def step(idx: list[int]) -> float:
        grid = torch.tensor([grids[i] for i in idx])
        pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, generator=g)
        t0 = time.perf_counter()
        out = model.model.get_image_features(pixels, grid, return_dict=True)
        torch.cat(list(out.pooler_output)).sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def median(idx: list[int]) -> float:
        for _ in range(cfg["warmup"]):
            step(idx)
        return 1e3 * statistics.median(step(idx) for _ in range(cfg["iters"]))

    return {"ms_all_images": median(list(range(len(grids)))), "ms_largest_share": median(share)}


def _row(cfg: dict, P: int) -> dict:
    out = {}
    for variant in ("every_rank", "split"):
        res = run_local_world(_worker, P, cfg, variant, timeout_s=1800)
        out[variant] = {
            "ms_fwd_bwd": max(r["ms"] for r in res),
            "max_patches_per_rank": max(r["patches"] for r in res),
            "max_saved_activation_bytes": max(r["saved_activation_bytes"] for r in res),
            "comm_rank0": res[0]["comm"],
            "feats_sum": res[0]["feats_sum"],
        }
    a, b = out["every_rank"], out["split"]
    one = _one_process(cfg, P)
    return {
        "P": P, **out, "one_process": one,
        "one_process_speedup": one["ms_all_images"] / one["ms_largest_share"],
        "speedup": a["ms_fwd_bwd"] / b["ms_fwd_bwd"],
        "patch_ratio": b["max_patches_per_rank"] / a["max_patches_per_rank"],
        "features_equal": abs(a["feats_sum"] - b["feats_sum"]) <= 1e-4 * abs(a["feats_sum"]),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    cfg = dict(images=a.images, hidden=a.hidden, depth=a.depth, iters=a.iters, warmup=a.warmup,
               threads=a.threads)  # fmt: skip
    rows = [_row(cfg, P) for P in a.world_sizes]
    cols = [f"{'P':>2}", "patches/rank every / split", "ms every", "ms split", "speedup",
            "1-proc ms all / share", "saved activations MiB every / split", "split bytes f / b",
            "eq"]  # fmt: skip
    head = " | ".join(cols)
    print(head)
    print("-" * len(head))
    for r in rows:
        e, s = r["every_rank"], r["split"]
        ag = s["comm_rank0"].get("all_gather", {}).get("bytes", 0)
        rs = s["comm_rank0"].get("reduce_scatter", {}).get("bytes", 0)
        mib = (e["max_saved_activation_bytes"] / 2**20, s["max_saved_activation_bytes"] / 2**20)
        one = r["one_process"]
        print(" | ".join([
            f"{r['P']:>2}", f"{e['max_patches_per_rank']:>12} / {s['max_patches_per_rank']:<11}",
            f"{e['ms_fwd_bwd']:>8.1f}", f"{s['ms_fwd_bwd']:>8.1f}", f"{r['speedup']:>6.2f}x",
            f"{one['ms_all_images']:>9.1f} / {one['ms_largest_share']:<9.1f}",
            f"{mib[0]:>14.1f} / {mib[1]:<11.1f}", f"{ag:>8} / {rs:<8}", str(r["features_equal"]),
        ]))  # fmt: skip
    result = {
        "benchmark": "bench_vision_split", "device": "cpu", "config": cfg,
        "grids": GRIDS, "rows": rows,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_avg_1m": os.getloadavg()[0], "torch": torch.__version__,
                    "python": sys.version.split()[0]},
    }  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
