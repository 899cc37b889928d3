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
# # 1. The (dp, sp) mesh and DTensor placements
#
# Ulysses sequence parallelism is a statement about *layouts*: which rank holds which part of an
# activation `q[B, S, N, H]` (batch, sequence, heads, head dim). In dtensor-ulysses a layout is a
# PyTorch `DTensor`: a local tensor plus a `DeviceMesh` and one *placement* per mesh axis. This
# notebook builds the picture: the mesh as a grid of ranks, what each placement means for
# `q[B, S, N, H]`, and, per rank, exactly which (batch, token, head) cells it holds. The pictures
# are computed from the placements by `dtensor_ulysses.debug`, and the last section checks them
# against what `distribute_tensor` really puts on each of 4 processes.

# %% [markdown]
# > **Run it yourself.** `pip install -e ".[notebooks]"` in the repository, then
# > `jupyter lab notebooks/`. Everything runs on a laptop CPU: distributed parts start local
# > processes joined by gloo. The controls (ipywidgets) redraw the figures live; on the docs site
# > you see the figures for the default values. The helpers in `notebooks/tutorial/` only draw
# > and start processes; every DTensor call is in the cells.

# %%
import math

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dtensor_ulysses import debug
from tutorial import checks, figures
from tutorial.widgets import live, show
from tutorial.workers import run_on_ranks

# %% [markdown]
# ## The mesh: rows are sp groups, columns are dp groups
#
# `du.init_mesh(dp, sp)` (or `init_device_mesh(device, (dp, sp), mesh_dim_names=("dp", "sp"))`)
# arranges `dp * sp` ranks as a 2-D grid with named axes `("dp", "sp")`, row by row:
# `rank = dp_coord * sp + sp_coord`.
#
# * An **sp group** (a row) shares one sequence: each of its ranks holds a contiguous slice of the
#   tokens. Attention's all-to-alls run inside this group, so it is a block of consecutive ranks,
#   which `torchrun` places on one node.
# * A **dp group** (a column) holds different sequences at the same token positions.
# * FSDP2 shards the parameters over all `dp x sp` ranks (the flattened `dp_sp` view): sp ranks
#   hold the same weights but see different tokens.

# %%
print("ranks of a dp=2 x sp=4 mesh, one row per sp group:", debug.mesh_ranks(2, 4))
live(figures.plot_mesh, dp=(1, 4), sp=(1, 8))

# %% [markdown]
# ## Placements: one per mesh axis
#
# `x.shape` of a DTensor is always the **global** shape; each mesh axis says how that global
# tensor is laid out along it:
#
# | placement | what it does to `q[B, S, N, H]` | notation |
# |---|---|---|
# | `Shard(0)` | the batch is cut into contiguous chunks | `q[B_dp, ...]` |
# | `Shard(1)` | each rank holds a block of consecutive tokens | `q[B, S_sp, N, H]` |
# | `Shard(2)` | each rank holds all tokens of some heads | `q[B, S, N_sp, H]` |
# | `Replicate()` | every rank of the axis holds the same values | no subscript |
#
# `X_sp` means "dim X split over the `sp` mesh axis". Training keeps activations
# sequence-sharded, `(Shard(0), Shard(1))` = `q[B_dp, S_sp, N, H]`; inside attention Ulysses
# switches the sp axis to heads, `(Shard(0), Shard(2))` = `q[B_dp, S, N_sp, H]`:
#
# ```
# q[B, S_sp, N, H]  ->  q[B, S, N_sp, H]        on the sp axis:  Shard(1)  ->  Shard(2)
# ```
#
# `debug.layout_notation` and `debug.parse_layout` translate between the two spellings:

# %%
print(debug.layout_notation([Shard(0), Shard(1)]), "<-", debug.parse_layout("q[B_dp, S_sp, N, H]"))
print(debug.layout_notation([Shard(0), Shard(2)]), "<-", debug.parse_layout("q[B_dp, S, N_sp, H]"))
print(debug.layout_notation([Replicate(), Shard(1)]), "<-", debug.parse_layout("q[B, S_sp, N, H]"))

# %% [markdown]
# Here is what each of 4 ranks holds of `q[B=2, S=8, N=4, H=16]` in the training layout (the
# arithmetic of DTensor's `Shard`: contiguous chunks of `ceil(size / parts)`):

# %%
print(debug.describe_placements(dp=2, sp=2, B=2, S=8, N=4, H=16, placements=[Shard(0), Shard(1)]))

# %% [markdown]
# The same as a picture: one panel per rank, laid out like the mesh. In a panel, each batch element
# is a block of heads (rows) by tokens (columns), colored where the rank holds the cell (a rank
# holds all `H` values of a cell it holds). Change the sizes and the placement of each axis; try
# `S=5` to see an uneven shard (chunks of `ceil(S / sp)`, the last ones shorter or empty), or
# `Shard(1)` on both axes (the sp axis cuts the dp axis' piece again).

# %%
PLACEMENTS = ["Shard(0)", "Shard(1)", "Shard(2)", "Replicate()"]
live(
    figures.plot_placements,
    dp=(1, 4),
    sp=(1, 4),
    B=(1, 4),
    S=(1, 16),
    N=(1, 8),
    dp_placement=PLACEMENTS,
    sp_placement=PLACEMENTS,
)

# %% [markdown]
# Inside attention the sp axis shards the heads instead. Same tensor, same mesh, the other layout,
# `q[B_dp, S, N_sp, H]`: every rank now sees all 8 tokens, but only 2 of the 4 heads. Getting from
# the previous picture to this one is the Ulysses all-to-all (notebook 2).

# %%
show(figures.plot_placements(dp=2, sp=2, B=2, S=8, N=4, sp_placement="Shard(2)"))

# %% [markdown]
# ## Check: what `distribute_tensor` really places on each rank
#
# The pictures above come from a few lines of arithmetic (`debug.ownership`). Here a real gloo
# world of 4 processes runs `distribute_tensor` for several layouts on a global tensor that holds
# its own flat index in every element, so each rank's local shard names exactly the cells it
# received. The function below is what every rank runs; `run_on_ranks` starts the 4 processes,
# sends them the function and returns what each rank returned.

# %%
CASES = [
    dict(dp=2, sp=2, shape=(2, 8, 4, 2), placements=[Shard(0), Shard(1)]),  # training layout
    dict(dp=2, sp=2, shape=(2, 8, 4, 2), placements=[Shard(0), Shard(2)]),  # inside attention
    dict(dp=2, sp=2, shape=(2, 8, 4, 2), placements=[Replicate(), Shard(1)]),  # batch replicated
    dict(dp=2, sp=2, shape=(3, 5, 4, 2), placements=[Shard(1), Shard(1)]),  # nested, uneven
    dict(dp=1, sp=4, shape=(1, 5, 4, 2), placements=[Shard(0), Shard(1)]),  # S=5 on sp=4
]


def where_cells_land(rank, world_size, cases):
    meshes = {}
    out = []
    for case in cases:
        dp, sp, shape = case["dp"], case["sp"], case["shape"]
        if (dp, sp) not in meshes:
            meshes[dp, sp] = init_device_mesh("cpu", (dp, sp), mesh_dim_names=("dp", "sp"))
        x = torch.arange(math.prod(shape)).reshape(shape)  # each element holds its flat index
        x = distribute_tensor(x, meshes[dp, sp], case["placements"])
        local = x.to_local()  # this rank's shard of the global tensor
        out.append(
            {
                "local_shape": list(local.shape),
                "codes": local.flatten().tolist(),
                "describe": debug.describe(x, "x"),
            }
        )
    return out


per_rank = run_on_ranks(where_cells_land, 4, CASES)
print("rank 1's view of the first case (debug.describe, * marks the rank itself):")
print(per_rank[1][0]["describe"])

# %%
for i, case in enumerate(CASES):
    shapes = [per_rank[r][i]["local_shape"] for r in range(4)]
    print(
        f"{debug.layout_notation(case['placements']):22} shape {case['shape']} on "
        f"dp={case['dp']} x sp={case['sp']}: local shapes by rank {shapes}"
    )
problems = checks.placement_mismatches(CASES, per_rank)
print("every rank holds exactly the cells its placements say:", not problems)
assert not problems, problems

# %% [markdown]
# ## What to take away
#
# * A DTensor layout is *(mesh, one placement per axis)*; `Shard(d)` cuts dim `d` into contiguous
#   chunks, `Replicate()` copies.
# * The training layout is `(Shard(0), Shard(1))` = `q[B_dp, S_sp, N, H]`; attention needs
#   `(Shard(0), Shard(2))` = `q[B_dp, S, N_sp, H]`. Ulysses is the move between them, on the sp
#   axis only; the dp axis never changes.
# * Next, notebook 2 (the Ulysses all-to-all) moves the chunks.
