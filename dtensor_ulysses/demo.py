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

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

import dtensor_ulysses as du
from dtensor_ulysses._exit import exit_process
from dtensor_ulysses.debug.layout import head_ranges, shard_range, ulysses_closed_form


def _span(lo: int, hi: int) -> str:
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

    coord = mesh.get_coordinate()
    assert coord is not None  # every rank of the world is on the mesh
    d, r = coord
    bs, ss = _span(*shard_range(B, dp, d)), _span(*shard_range(S, sp, r))
    hs = _span(*head_ranges(N, sp)[r])
    ref = du.local_attention(*(t.to(od.device) for t in (q, k, v)), causal=True, backend="sdpa")
    err = (od.full_tensor() - ref).abs().max().item()
    index = du.kv_head_index(N, K, sp)
    closed: int | str = "n/a: S not divisible by sp"
    if S % sp == 0:
        cf = ulysses_closed_form(B // dp, S, N, K, H, sp, q.element_size(), rank=r)
        closed = cf["forward"]["bytes"]
    others = comm.count() - comm.count("all_to_all")
    lines = [
        f"rank {dist.get_rank()} (dp={d}, sp={r})",
        f"  before  q{list(qd.to_local().shape)} = q[batch {bs}, tokens {ss}, heads 0:{N}]"
        f"   placements {qd.placements}",
        f"  inside  q{list(head_view.to_local().shape)} = q[batch {bs}, tokens 0:{S}, heads {hs}]"
        f"   placements {head_view.placements}",
        f"  after   o{list(od.to_local().shape)} = o[batch {bs}, tokens {ss}, heads 0:{N}]"
        f"   placements {od.placements}",
        f"  moved   {comm.count('all_to_all')} all-to-alls, {comm.bytes('all_to_all')} bytes in "
        f"(closed form {closed}), other collectives: {others}",
        f"  max |ulysses - single-device| = {err:.2e}",
    ]
    gathered: list[object] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object("\n".join(lines), gathered, dst=0)
    if gathered is not None:
        print(f"Ulysses attention: B={B} S={S} N={N} K={K} H={H} on mesh dp={dp} x sp={sp}")
        if index is not None:
            print(f"GQA: sp={sp} does not divide {K} kv heads; kv heads sent per rank: {index}")
        print("\n".join(map(str, gathered)))
    dist.barrier()  # leave together (see train.main)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process(0)  # skip the teardown that can abort (see _exit.py)
