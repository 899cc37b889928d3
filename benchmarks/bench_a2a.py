"""The Ulysses exchange against the backend's own all-to-all, at equal bytes.

For each size, every rank holds ``x[1, s, N, H]`` (its sequence slice, all heads) and moves it to
``[1, S, N/P, H]`` (``Shard(1) -> Shard(2)`` on sp) two ways:

* ``ulysses``: the library's exchange (``dtensor_ulysses.comm.alltoall``): the pack into
  one send buffer, ``all_to_all_single``, the unpack into the layout the kernel reads
  (``[B, N, S, H]`` for SDPA);
* ``raw``: ``torch.distributed.all_to_all_single`` on a ready, contiguous buffer of the same bytes
  (NCCL's own all-to-all on GPUs, gloo's on CPU): the floor.

Time per call: the median over ``--iters`` (after ``--warmup``), barrier and device sync around
each; bandwidth = bytes a rank sends / time (the project's convention: the buffer passed in).
The issue's target: ``ulysses`` within 10% of ``raw`` on GPUs.

GPU (one node, N GPUs; the command when GPUs are lent)::

    torchrun --standalone --nproc-per-node 8 -m benchmarks.bench_a2a \\
        --sizes-mib 16 64 256 1024 --json benchmarks/results/bench_a2a_gpu.json

CPU (gloo, spawned processes): ``python -m benchmarks.bench_a2a --cpu-world 2 --sizes-mib 1 4``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

HEADS, HEAD_DIM = 32, 128


def _time(fn, device: torch.device, iters: int, warmup: int) -> float:
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's median
    return float(t.item())


def run(sizes_mib: list[float], iters: int, warmup: int, dtype: torch.dtype) -> list[dict]:
    from dtensor_ulysses.comm import all_to_all

    P, device = dist.get_world_size(), _device()
    group = dist.group.WORLD
    assert group is not None
    rows = []
    for mib in sizes_mib:
        e = torch.tensor([], dtype=dtype).element_size()
        s = max(P, int(mib * 2**20 / (HEADS * HEAD_DIM * e)) // P * P)  # tokens per rank
        x = torch.randn(1, s, HEADS, HEAD_DIM, device=device, dtype=dtype)
        send, recv = x.reshape(-1).clone(), torch.empty_like(x.reshape(-1))

        def ours(x=x, order=(0, 2, 1, 3)):  # the SDPA layout the exchange writes
            all_to_all(x, scatter_dim=2, gather_dim=1, group=group, dim_order=order)

        def raw(send=send, recv=recv):
            dist.all_to_all_single(recv, send, group=group)

        t_ours = _time(ours, device, iters, warmup)
        t_raw = _time(raw, device, iters, warmup)
        nbytes = x.numel() * e
        rows.append(dict(P=P, mib=nbytes / 2**20, tokens_per_rank=s, ms_ulysses=1e3 * t_ours,
                         ms_raw=1e3 * t_raw, gbps_ulysses=nbytes / t_ours / 1e9,
                         gbps_raw=nbytes / t_raw / 1e9, ratio=t_ours / t_raw))  # fmt: skip
    return rows


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _table(rows: list[dict]) -> str:
    lines = [f"{'P':>3} {'MiB/rank':>9} {'ulysses ms':>11} {'raw ms':>9} {'ulysses GB/s':>13} "
             f"{'raw GB/s':>9} {'ratio':>6}"]  # fmt: skip
    for r in rows:
        lines.append(f"{r['P']:>3} {r['mib']:>9.1f} {r['ms_ulysses']:>11.3f} {r['ms_raw']:>9.3f} "
                     f"{r['gbps_ulysses']:>13.2f} {r['gbps_raw']:>9.2f} "
                     f"{r['ratio']:>6.3f}")  # fmt: skip
    return "\n".join(lines)


def _cpu_worker(rank: int, world_size: int, args: dict) -> list[dict]:
    return run(args["sizes_mib"], args["iters"], args["warmup"], torch.float32)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--cpu-world", type=int, default=0, help="gloo ranks (spawned) instead of torchrun"
    )
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.cpu_world:
        from dtensor_ulysses.launch import run_local_world

        cfg = dict(sizes_mib=a.sizes_mib, iters=a.iters, warmup=a.warmup)
        rows, rank = run_local_world(_cpu_worker, a.cpu_world, cfg, timeout_s=900)[0], 0
        device = "cpu (gloo)"
    else:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        rows, rank = run(a.sizes_mib, a.iters, a.warmup, torch.bfloat16), dist.get_rank()
        device = torch.cuda.get_device_name()
        dist.destroy_process_group()
    if rank == 0:
        print(_table(rows))
        if a.json:
            nccl = str(torch.cuda.nccl.version()) if torch.cuda.is_available() else None
            env = dict(torch=torch.__version__, python=platform.python_version(), device=device,
                       nccl=nccl)  # fmt: skip
            with open(a.json, "w") as f:
                json.dump(dict(argv=argv, environment=env, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
