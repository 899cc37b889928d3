"""The independent float64 attention reference of the kernel tests, and their spawned ranks.

Legend: ``B`` batch, ``S`` sequence, ``N`` q heads, ``K`` kv heads, ``H`` head dim.

:func:`reference` is written from the definitions, not from the kernels: an explicit ``[B, N, S,
S]`` score tensor, a dense boolean mask built rule by rule, a softcap, the sinks as one more
column of the softmax (dropped after it), float64. Small ``S`` only.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

import dtensor_ulysses as du
from dtensor_ulysses.plan import SeqLayout, seq_split
from tests.workers import get_mesh

__all__ = ["reference", "sinks_worker"]


def reference(
    q_BSNH: torch.Tensor,
    k_BSKH: torch.Tensor,
    v_BSKH: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    window: tuple[int, int] | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    doc_lengths: list[list[int]] | None = None,
) -> torch.Tensor:
    """``o[B, S, N, H]`` by the definition (see the module docstring); differentiable."""
    B, S, N, _ = q_BSNH.shape
    G = N // k_BSKH.shape[2]
    kv_of = torch.arange(N) // G  # the kv head of each q head
    s_BNSS = torch.einsum("bind,bjnd->bnij", q_BSNH, k_BSKH[:, :, kv_of]) * scale
    if softcap:
        s_BNSS = softcap * torch.tanh(s_BNSS / softcap)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    seen_SS = torch.ones(S, S, dtype=torch.bool)
    if causal:
        seen_SS &= j <= i
    if window is not None:
        left, right = window
        if left != -1:
            seen_SS &= j >= i - left
        if right != -1:
            seen_SS &= j <= i + right
    if chunk is not None:
        seen_SS &= torch.div(j, chunk, rounding_mode="floor") == torch.div(
            i, chunk, rounding_mode="floor"
        )
    seen_BSS = seen_SS.expand(B, S, S).clone()
    if doc_lengths is not None:
        for b, lengths in enumerate(doc_lengths):
            doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
            seen_BSS[b] &= doc[:, None] == doc[None, :]
    s_BNSS = s_BNSS.masked_fill(~seen_BSS[:, None], float("-inf"))
    if sinks is not None:
        column = sinks.view(1, N, 1, 1).expand(B, N, S, 1)
        p_BNSS = torch.softmax(torch.cat([s_BNSS, column], dim=-1), dim=-1)[..., :S]
    else:
        p_BNSS = torch.softmax(s_BNSS, dim=-1)
    return torch.einsum("bnij,bjnd->bind", p_BNSS, v_BSKH[:, :, kv_of])


def sinks_worker(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """The engine (``UlyssesAttention`` around ``local_attention``) with sinks, windows,
    softcaps and packed documents, against :func:`reference` on the global batch: ``o``,
    ``dq``, ``dk``, ``dv`` of this rank's slice and the sinks' gradient summed over the world
    (each rank's own gradient must be zero outside the q heads it attends with)."""
    results = []
    for case in cases:
        dp, sp, B, S, N, K, H = (case[x] for x in ("dp", "sp", "B", "S", "N", "K", "H"))
        mesh = get_mesh(dp, sp)
        me_sp, me_dp = mesh.get_local_rank("sp"), mesh.get_local_rank("dp")
        g = torch.Generator().manual_seed(case["seed"])
        q, go = (torch.randn(B, S, N, H, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(B, S, K, H, generator=g, dtype=torch.float64) for _ in range(2))
        sinks = torch.randn(N, generator=g, dtype=torch.float64) * 2
        feats = dict(window=case.get("window"), softcap=case.get("softcap"),
                     chunk=case.get("chunk"))  # fmt: skip
        docs = case.get("docs")
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        o_ref = reference(*leaves[:3], scale=H**-0.5, sinks=leaves[3], doc_lengths=docs, **feats)
        o_ref.backward(go)
        rows = slice(me_dp * (B // dp), (me_dp + 1) * (B // dp))
        sizes = seq_split(S, sp)
        cols = slice(sum(sizes[:me_sp]), sum(sizes[: me_sp + 1]))
        layout = None
        if docs is not None:
            starts = tuple(
                tuple(sum(lengths[:i]) for i in range(len(lengths))) for lengths in docs[rows]
            )
            layout = SeqLayout.split(S, sp, starts)
        mine = [t[rows, cols].clone().requires_grad_() for t in (q, k, v)]
        sinks_leaf = sinks.clone().requires_grad_()
        if case.get("dtensor"):  # the DTensor face: du.ulysses_attention (no documents)
            placements = [Shard(0), Shard(1)]
            qd, kd, vd = (
                DTensor.from_local(m, mesh, placements, run_check=False, shape=t.shape,
                                   stride=t.stride())
                for m, t in zip(mine, (q, k, v))
            )  # fmt: skip
            kept = {n: x for n, x in feats.items() if x is not None}
            o = du.ulysses_attention(qd, kd, vd, allow_uneven=True, sinks=sinks_leaf,
                                     **kept).to_local()  # fmt: skip
        else:
            attn_fn = functools.partial(du.local_attention, backend=case.get("backend", "auto"))
            engine = du.UlyssesAttention(attn_fn, mesh["sp"],
                                         head_chunks=case.get("head_chunks", 1))  # fmt: skip
            o = engine(*mine, layout=layout, seq_len=S, causal=True, sinks=sinks_leaf, **feats)
        o.backward(go[rows, cols])
        own = sinks_leaf.grad.clone()
        dsinks = sinks_leaf.grad.clone()
        dist.all_reduce(dsinks)  # every rank's heads and rows: the global gradient
        errors = {
            "o": (o - o_ref[rows, cols]).abs().max().item(),
            "dq": (mine[0].grad - leaves[0].grad[rows, cols]).abs().max().item(),
            "dk": (mine[1].grad - leaves[1].grad[rows, cols]).abs().max().item(),
            "dv": (mine[2].grad - leaves[2].grad[rows, cols]).abs().max().item(),
            "dsinks": (dsinks - leaves[3].grad).abs().max().item(),
        }
        results.append({"case": case, "errors": errors, "own_dsinks": own.tolist(),
                        "sp_rank": me_sp})  # fmt: skip
    return results
