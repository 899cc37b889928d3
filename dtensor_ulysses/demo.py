"""Watch one Ulysses attention call: each rank's layout before and after, and the bytes it moved.

Run (CPU, gloo)::

    torchrun --nproc-per-node 2 -m dtensor_ulysses.demo
    torchrun --nproc-per-node 4 -m dtensor_ulysses.demo --dp 2 --sp 2 --kv-heads 1

Each rank prints which tokens and heads of ``q[B, S, N, H]`` it holds while sequence-sharded
(``Shard(1)`` on ``sp``), while head-sharded inside attention (``Shard(2)``), and afterwards; then
the collectives it issued with their bytes, next to the closed form, and the largest difference
from single-device attention on the same data.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

import dtensor_ulysses as du
from dtensor_ulysses._exit import exit_process


def _span(placement_dim: int, size: int, coord: int, parts: int) -> str:
    chunk = math.ceil(size / parts)
    lo, hi = min(coord * chunk, size), min((coord + 1) * chunk, size)
    return f"{lo}:{hi}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--sp", type=int, default=None, help="default: world size / dp")
    p.add_argument("--batch", type=int, default=None, help="default: dp")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    args = p.parse_args(argv)

    mesh = du.init_mesh(args.dp, args.sp)
    dp, sp = mesh.shape
    B = args.batch or dp
    S, N, K, H = args.seq_len, args.heads, args.kv_heads, args.head_dim
    placements = [Shard(0), Shard(1)]
    g = torch.Generator().manual_seed(0)  # the same global tensors on every rank
    q, k, v = (torch.randn(B, S, n, H, generator=g) for n in (N, K, K))
    qd, kd, vd = (distribute_tensor(t, mesh, placements, src_data_rank=None) for t in (q, k, v))

    with du.CommCounter() as comm:
        od = du.ulysses_attention(qd, kd, vd, causal=True, backend="sdpa")
    head_view = du.seq_to_head(qd)  # what attention sees: q[B, S, N_sp, H]

    d, r = mesh.get_coordinate()
    bs, ss, hs = _span(0, B, d, dp), _span(1, S, r, sp), _span(2, N, r, sp)
    ref = du.local_attention(*(t.to(od.device) for t in (q, k, v)), causal=True, backend="sdpa")
    err = (od.full_tensor() - ref).abs().max().item()
    index = du.kv_head_index(N, K, sp)
    Kp = K if index is None else len(index)
    e = q.element_size()
    closed = (B // dp) * (S // sp) * H * e * ((N + 2 * Kp) + N)
    lines = [
        f"rank {dist.get_rank()} (dp={d}, sp={r})",
        f"  before  q{list(qd.to_local().shape)} = q[batch {bs}, tokens {ss}, heads 0:{N}]"
        f"   placements {qd.placements}",
        f"  inside  q{list(head_view.to_local().shape)} = q[batch {bs}, tokens 0:{S}, heads {hs}]"
        f"   placements {head_view.placements}",
        f"  after   o{list(od.to_local().shape)} = o[batch {bs}, tokens {ss}, heads 0:{N}]"
        f"   placements {od.placements}",
        f"  moved   {comm.count('all_to_all')} all-to-alls, {comm.bytes('all_to_all')} bytes in "
        f"(closed form {closed}), other collectives: {comm.count() - comm.count('all_to_all')}",
        f"  max |ulysses - single-device| = {err:.2e}",
    ]
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object("\n".join(lines), gathered, dst=0)
    if dist.get_rank() == 0:
        print(f"Ulysses attention: B={B} S={S} N={N} K={K} H={H} on mesh dp={dp} x sp={sp}")
        if index is not None:
            print(f"GQA: sp={sp} does not divide {K} kv heads; kv heads sent per rank: {index}")
        print("\n".join(gathered))
    dist.barrier()  # leave together (see train.main)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process(0)  # skip the teardown that can abort (see _exit.py)
