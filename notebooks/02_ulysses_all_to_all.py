# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 2. The Ulysses all-to-all, step by step
#
# Around attention, Ulysses changes the layout on the sp axis twice:
#
# ```
# q,k,v[B, S_sp, N, H] --all-to-all--> [B, S, N_sp, H] --attention--> o[B, S, N_sp, H]
#      o[B, S, N_sp, H] --all-to-all--> o[B, S_sp, N, H]
# sp axis:  Shard(1) -> Shard(2)  ...  Shard(2) -> Shard(1)
# ```
#
# In `du.seq_to_head`, each rank cuts its token block along the **head** dim into `sp` chunks,
# sends chunk `j` to rank `j`, and concatenates what it receives along the **sequence** dim;
# `du.head_to_seq` does the reverse. This notebook shows which chunk goes where, runs the real
# library on 4 local processes to watch it happen (including GQA, where there are fewer kv heads
# than ranks), and checks the bytes each rank moves, counted by `du.CommCounter`, against the
# closed form.

# %% [markdown]
# > **Run it yourself.** `pip install -e ".[notebooks]"` in the repository, then
# > `jupyter lab notebooks/`. Everything runs on a laptop CPU: distributed parts start local
# > processes joined by gloo. The controls (ipywidgets) redraw the figures live; on the docs site
# > you see the figures for the default values. The helpers in `notebooks/tutorial/` only draw
# > and start processes; every DTensor call is in the cells.

# %%
import torch
from torch.distributed.tensor import Shard, distribute_tensor

import dtensor_ulysses as du
from dtensor_ulysses import debug
from tutorial import checks, figures
from tutorial.widgets import live, show
from tutorial.workers import run_on_ranks

# %% [markdown]
# ## The plan: who sends what to whom
#
# With `S=16` tokens, `N=8` heads and `sp=4`, rank `r` starts with tokens `4r:4r+4` of all 8
# heads. It keeps heads `2r:2r+2` of its own tokens and sends heads `2j:2j+2` to rank `j`. Every
# chunk is `B * (S/sp) * (N/sp) * H` elements.

# %%
plan = debug.a2a_plan(S=16, N=8, sp=4, B=1, H=8, elem_bytes=4)
for c in plan[:4]:
    print(
        f"rank {c.src} -> rank {c.dst}: tokens {c.tokens[0]}:{c.tokens[1]}, "
        f"heads {c.heads[0]}:{c.heads[1]}, {c.bytes} bytes"
    )
print("bytes rank src puts in rank dst's slot:", debug.send_matrix(plan, 4))

# %% [markdown]
# The whole round trip as a picture. Top row: before, each rank holds a token block; labels say
# which rank each chunk goes to. Middle: inside attention, each rank holds all tokens of its
# heads; the colors show which rank each piece came from. Bottom: after `head_to_seq` the token
# blocks are back, each head block computed by a different rank.

# %%
live(figures.plot_round_trip, S=(4, 32, 4), N=(1, 16), sp=[1, 2, 4, 8])

# %% [markdown]
# ## Watch it happen on 4 processes
#
# The function below is what each of 4 gloo processes runs (`run_on_ranks` starts them and sends
# it the function). It builds the `("dp", "sp")` mesh and:
#
# 1. distributes a tensor whose every element holds its own cell number `(b*S + s)*N + n`, so the
#    values a rank holds after `du.seq_to_head` name the cells it received; each call runs under
#    `du.CommCounter`;
# 2. runs `du.ulysses_attention` forward and backward under `du.CommCounter` and compares it with
#    single-device attention on the full tensors;
# 3. runs `du.UlyssesAttention` (the engine on local tensors) with a kernel that records which q
#    and kv heads it was given.
#
# Two cases: the `tiny` model's heads (`N=8` q heads, `K=2` kv heads) on `dp=1 x sp=4`, and
# multi-head attention on a `dp=2 x sp=2` mesh.


# %%
def moved(comm, group):
    """All-to-alls on ``group`` that ``du.CommCounter`` saw, their input bytes, anything else."""
    n = comm.count("all_to_all", group)
    return {"count": n, "bytes": comm.bytes("all_to_all", group), "other": comm.count() - n}


def round_trip(mesh, B, S, N, H):
    """1. seq_to_head then head_to_seq on a tensor whose values name their cells."""
    cells = torch.arange(B * S * N, dtype=torch.float32).reshape(B, S, N, 1).expand(B, S, N, H)
    x = distribute_tensor(cells.contiguous(), mesh, [Shard(0), Shard(1)])  # x[B_dp, S_sp, N, H]
    with du.CommCounter() as to_heads:
        y = du.seq_to_head(x)  # x[B_dp, S, N_sp, H]
    with du.CommCounter() as to_tokens:
        z = du.head_to_seq(y)  # x[B_dp, S_sp, N, H] again
    stages = {"before": x, "inside": y, "after": z}
    return {
        "placements": {stage: t.placements for stage, t in stages.items()},
        "codes": {stage: t.to_local()[..., 0].flatten().tolist() for stage, t in stages.items()},
        "round_trip_exact": torch.equal(z.to_local(), x.to_local()),
        "seq_to_head": moved(to_heads, mesh.get_group("sp")),
        "head_to_seq": moved(to_tokens, mesh.get_group("sp")),
    }


def attention(mesh, B, S, N, K, H):
    """2. ulysses_attention forward and backward, against single-device attention."""
    g = torch.Generator().manual_seed(0)  # the same global q, k, v on every rank
    q, k, v = (torch.randn(B, S, n, H, generator=g) for n in (N, K, K))
    qd, kd, vd = (
        distribute_tensor(t, mesh, [Shard(0), Shard(1)], src_data_rank=None).requires_grad_()
        for t in (q, k, v)
    )
    with du.CommCounter() as forward:
        o = du.ulysses_attention(qd, kd, vd, causal=True)
    with du.CommCounter() as backward:
        o.to_local().square().sum().backward()
    reference = du.local_attention(q, k, v, causal=True)
    sp_group = mesh.get_group("sp")
    return {
        "attention": {"forward": moved(forward, sp_group), "backward": moved(backward, sp_group)},
        "max_abs_err": (o.full_tensor() - reference).abs().max().item(),
    }


def heads_the_kernel_gets(mesh, B, S, N, K, H):
    """3. du.UlyssesAttention with a kernel that records its heads (q, k filled with head ids)."""
    seen = {}

    def recording_kernel(q, k, v, **kwargs):
        seen["q_heads"] = [int(h) for h in q[0, 0, :, 0].tolist()]
        seen["kv_heads"] = [int(h) for h in k[0, 0, :, 0].tolist()]
        seen["shape_q"], seen["shape_kv"] = list(q.shape), list(k.shape)
        return du.local_attention(q, k, v, **kwargs)

    def head_ids(n):
        ids = torch.arange(n, dtype=torch.float32).reshape(1, 1, n, 1).expand(B, S, n, H)
        return distribute_tensor(ids.contiguous(), mesh, [Shard(0), Shard(1)]).to_local()

    q, kv = head_ids(N), head_ids(K)
    du.UlyssesAttention(recording_kernel, mesh)(q, kv, kv, causal=True)
    return {"kernel": seen}


def ulysses_on_each_rank(rank, world_size, cases):
    out = []
    for c in cases:
        mesh = du.init_mesh(dp=c["dp"], sp=c["sp"])
        row = {"rank": rank, "coord": mesh.get_coordinate()}
        row |= round_trip(mesh, c["B"], c["S"], c["N"], c["H"])
        row |= attention(mesh, c["B"], c["S"], c["N"], c["K"], c["H"])
        row |= heads_the_kernel_gets(mesh, c["B"], c["S"], c["N"], c["K"], c["H"])
        out.append(row)
    return out


CASES = [
    dict(dp=1, sp=4, B=1, S=16, N=8, K=2, H=8),
    dict(dp=2, sp=2, B=2, S=16, N=8, K=8, H=8),
]
per_rank = run_on_ranks(ulysses_on_each_rank, 4, CASES)
case0 = [rows[0] for rows in per_rank]
print("placements on rank 0:", case0[0]["placements"])
print("head_to_seq(seq_to_head(x)) == x on every rank:", all(r["round_trip_exact"] for r in case0))
print("max |ulysses_attention - single-device| per rank:", [r["max_abs_err"] for r in case0])

# %% [markdown]
# The cells each rank held at each stage, as the real run reports them (they match the plan
# above, which the next cell checks exactly):

# %%
show(figures.plot_round_trip(S=16, N=8, sp=4, observed=checks.cells_by_stage(case0, CASES[0])))

# %% [markdown]
# ## Bytes: measured vs closed form
#
# A rank's bytes for a collective are the size of the buffer it passes in (the project's
# convention; the chunk it keeps is part of that buffer, so `(sp-1)/sp` of it actually leaves the
# rank). Per `ulysses_attention` call and rank, with `s = S/sp` local tokens and `e` bytes per
# element:
#
# * forward: one **fused** all-to-all for q, k and v, `B*s*(N + 2K')*H*e`, then one for o,
#   `B*s*N*H*e`;
# * backward: the same two again (the gradient of an all-to-all is the reverse all-to-all).
#
# `K'` is the number of kv heads summed over the ranks they are sent to: `K` when `sp` divides
# `K`, more when kv heads must be replicated (next section). At a fixed number of tokens per rank
# `s`, none of this grows with `sp`. `debug.ulysses_closed_form` computes it:

# %%
print(debug.ulysses_closed_form(B=1, S=16, n_q=8, n_kv=2, H=8, sp=4, elem_bytes=4, rank=0))
report, problems = checks.round_trip_report(case0, CASES[0])
print(report)
assert not problems, problems

# %%
measured = [r["attention"] for r in case0]
show(figures.plot_a2a_bytes(B=1, S=16, n_q=8, n_kv=2, H=8, sp=4, elem_bytes=4, measured=measured))

# %% [markdown]
# ## GQA: when sp is larger than the number of kv heads
#
# With grouped-query attention, q head `i` uses kv head `i // (N/K)`. If `sp` divides `K`, the kv
# heads are sharded like the q heads. The `tiny` model has `K=2` kv heads and we run `sp=4`: rank
# `r` attends with q heads `2r, 2r+1`, which both use kv head `r // 2`. So each kv head is sent to
# **two** ranks: `du.kv_head_index(8, 2, 4) == [0, 0, 1, 1]`, `K' = 4`. The copy is an
# `index_select` before the all-to-all, so autograd sums the copies' gradients back into the one
# kv head. The kernel-recorded heads from the real run:

# %%
print("du.kv_head_index(8, 2, 4) =", du.kv_head_index(8, 2, 4))
print("debug.kv_plan(8, 2, 4) =", debug.kv_plan(8, 2, 4))
for r in case0:
    k = r["kernel"]
    print(
        f"rank {r['rank']}: kernel got q heads {k['q_heads']} {k['shape_q']}, "
        f"kv heads {k['kv_heads']} {k['shape_kv']}"
    )

# %%
live(figures.plot_gqa, n_q=[4, 8, 16, 32, 64], n_kv=[1, 2, 4, 8], sp=[1, 2, 4, 8, 16])

# %% [markdown]
# ## A 2-D mesh: the dp axis is left alone
#
# The second case ran on `dp=2 x sp=2` with a global batch of 2: each dp row is its own sp group,
# the batch placement `Shard(0)` is kept throughout, and each all-to-all runs inside one sp group
# only.

# %%
case1 = [rows[1] for rows in per_rank]
report, problems = checks.round_trip_report(case1, CASES[1])
print(report)
print("placements:", case1[0]["placements"])
assert not problems, problems

# %% [markdown]
# ## What to take away
#
# * `q[B, S_sp, N, H] -> q[B, S, N_sp, H]` is one `all_to_all_single` per call on the sp group,
#   on every backend; q, k and v travel together in one of them.
# * Per rank and layer, forward moves `B*s*(N + 2K')*H*e + B*s*N*H*e` bytes in, and backward the
#   same; only `(sp-1)/sp` of it leaves the rank.
# * With fewer kv heads than ranks, kv heads are replicated (`K' > K`), which the byte count
#   includes.
# * Next, notebook 3 (memory): what sharding the sequence buys.
