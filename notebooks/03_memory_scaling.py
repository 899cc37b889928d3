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
# # 3. Memory per rank vs sequence length
#
# What fills a GPU in long-context training, and what sequence parallelism does to it:
#
# * **model states** (weights, gradients, optimizer states): FSDP2 shards them over all
#   `dp x sp` ranks, so for a fixed number of GPUs they do not depend on `sp`;
# * **activations**, kept for backward: every one lives in a sequence-sharded layout
#   `x[B, S_sp, D]` (`Shard(1)` on sp), so they shrink as `1/sp`; only inside attention is a
#   layer's q, k, v briefly head-sharded `q[B, S, N_sp, H]` (`Shard(2)`), which is the same number
#   of bytes;
# * **logits** `[B, S_sp, V]` for the loss: also `1/sp`, and large, since the vocabulary `V` is
#   large.
#
# The curves come from the project's cost model (`simulations`, torch-free); the last section
# measures the real model on CPU and puts the measured points on the model's prediction.

# %% [markdown]
# > **Run it yourself.** `pip install -e ".[notebooks]"` in the repository, then
# > `jupyter lab notebooks/`. Everything runs on a laptop CPU: distributed parts start local
# > processes joined by gloo. The controls (ipywidgets) redraw the figures live; on the docs site
# > you see the figures for the default values. The helpers in `notebooks/tutorial/` only draw
# > and start processes; every DTensor call is in the cells.

# %%
import torch
import torch.nn.functional as F

import dtensor_ulysses as du
import simulations as sim
from dtensor_ulysses import debug
from dtensor_ulysses.plan import PRESETS
from simulations import report
from simulations.config import Workload
from simulations.planner import max_seq_len
from tutorial import sim_figures
from tutorial.widgets import live, show
from tutorial.workers import SavedActivations, run_on_ranks

# %% [markdown]
# ## Where the out-of-memory wall is
#
# The number of GPUs is fixed (`gpus`) and `dp = gpus / sp`, so every layout shards the model
# states over the same ranks and only the tokens per rank differ. Left: peak memory per rank as
# the sequence grows, one line per `sp` (dotted past the GPU's usable memory, vertical lines at the
# wall). Middle: what the peak is made of at one length. Right: the longest sequence that fits,
# for each `sp`. Try `tiled_loss` (logits computed over sequence tiles) and `ac="none"` (no
# activation checkpointing), another model or GPU.

# %%
live(
    sim_figures.plot_memory_scaling,
    model=[m for m in PRESETS if m != "tiny"],
    gpu=list(sim.GPUS),
    gpus=[8, 16, 32, 64],
    ac=["full", "none"],
    tiled_loss=False,
    seq_len=[16384, 32768, 65536, 131072, 262144],
)

# %% [markdown]
# The wall as numbers (`simulations.report.oom_walls`), and how much further it moves when the
# loss is tiled (with full checkpointing the logits are the largest term for Llama-3-8B's 128K
# vocabulary):

# %%
for tiled in (False, True):
    walls = report.oom_walls("llama3-8b", "h100", gpus=8, ac="full", tiled_loss=tiled)
    print(
        f"tiled_loss={tiled!s:5}: longest sequence per sp on 8x h100:",
        {sp: f"{n:,}" for sp, n in walls.items()},
    )

# %% [markdown]
# ## Measured: the real model on CPU
#
# Does the model count what the code keeps? Here the real `tiny` preset, parallelized by
# `du.parallelize` (Ulysses + FSDP2 over `dp x sp`), runs forward and the loss on 4 gloo processes
# in three layouts: `dp=4 x sp=1`, `dp=2 x sp=2` and `dp=1 x sp=4`, one sequence per rank, fp32,
# no checkpointing, for several lengths. Each rank feeds the model only its own tokens, the slice
# `Shard(1)` gives it (`debug.shard_range`), with their global positions.
#
# **What is measured, and how**: every tensor autograd saves for backward is recorded with
# `torch.autograd.graph.saved_tensors_hooks` (`SavedActivations`), tagged by whether a
# transformer block saved it. After the loss, the distinct storages still held are summed (a
# tensor saved twice, or a view, counts once; parameters are excluded). That is the activation
# memory a rank holds at the start of backward, exactly, independent of allocator caching. It is
# compared with the simulator's per-layer activation bytes for the same workload (`fp32`,
# `ac="none"`) times the number of layers.


# %%
def saved_activations(rank, world_size, layouts, seq_lens):
    rows = []
    for dp, sp in layouts:
        mesh = du.init_mesh(dp=dp, sp=sp)
        model = du.parallelize(du.build_model("tiny"), mesh)  # Ulysses + FSDP2 over dp x sp
        model.to_empty(device="cpu")
        du.init_weights(model, seed=0)
        dp_rank, sp_rank = mesh.get_coordinate()
        for S in seq_lens:
            g = torch.Generator().manual_seed(1000 * dp_rank + S)  # one sequence per dp rank
            ids = torch.randint(0, 256, (1, S + 1), generator=g)
            lo, hi = debug.shard_range(S, sp, sp_rank)  # this rank's tokens: Shard(1) on sp
            inputs, labels = ids[:, lo:hi], ids[:, lo + 1 : hi + 1]
            positions = torch.arange(lo, hi)[None]
            with SavedActivations(model.layers) as saved:
                logits = model(inputs, positions)
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
            rows.append({"dp": dp, "sp": sp, "seq_len": S, "local_tokens": hi - lo})
            rows[-1] |= saved.bytes(model)
            loss.backward()
            model.zero_grad(set_to_none=True)
    return rows


LAYOUTS = [(4, 1), (2, 2), (1, 4)]
SEQ_LENS = [256, 512, 1024, 2048]
per_rank = run_on_ranks(saved_activations, 4, LAYOUTS, SEQ_LENS, timeout_s=300)
measured = per_rank[0]
assert all(rows == measured for rows in per_rank), "ranks measured different bytes"
print(report.activation_table(measured, model="tiny"))

# %%
show(sim_figures.plot_activation_check(measured, model="tiny"))

# %% [markdown]
# At a fixed sequence length the measured bytes per rank fall almost as `1/sp`: a little less,
# because with `sp > 1` the output of the second all-to-all is one more saved tensor (the o
# projection's input), and at `sp=4` the 2 kv heads are replicated (`K' = 4`). The simulator
# counts both and tracks the measurement within a few percent at every point (its RMSNorm keeps
# its input and output in the activation dtype, as the model's norm does; the small remainder is
# tensors it does not list, such as the norms' per-token scales).

# %%
by = {(r["sp"], r["seq_len"]): r["blocks_bytes"] for r in measured}
for S in SEQ_LENS:
    print(
        f"S={S:5}: sp=1 / sp=2 = {by[1, S] / by[2, S]:.3f}, sp=1 / sp=4 = {by[1, S] / by[4, S]:.3f}"
    )

# %% [markdown]
# ## The million-token features, one at a time
#
# Past checkpointing, four other things fill a rank at millions of tokens: the logits of the loss,
# the MLP's `[s, F]` intermediates, the checkpointed block inputs and the optimizer states. The
# trainer has a flag for each (see the how-to "Train a million tokens"); each is exact. Here they
# are stacked one at a time for llama3-8b on 8x H100 (`sp=8`), with the simulator's longest
# sequence for each stack. The simulator's model of every feature is checked against a trace of
# the real training step (`python -m simulations trace`) within 10%.

# %%
STACK = [
    ("checkpointing", dict(ac="full")),
    ("+ tiled loss", dict(tiled_loss=True)),
    ("+ tiled MLP", dict(tiled_mlp=True)),
    ("+ checkpoints on host", dict(offload_activations=True)),
    ("+ 4 head chunks", dict(head_chunks=4)),
    ("+ optimizer on host", dict(offload_optimizer=True)),
]
options, stacked = {}, []
for label, kw in STACK:
    options |= kw
    w = Workload("llama3-8b", 8 * 1024, dp=1, sp=8, gpu="h100", **options)
    stacked.append((label, max_seq_len(w)))
    print(f"{label:>24}: {stacked[-1][1]:>10,} tokens")
assert [n for _, n in stacked] == sorted(n for _, n in stacked), "no feature may cost length"


# %%
def plot_stack(stacked):
    from tutorial.figures import new_figure  # not pyplot's: the figure is shown once

    fig = new_figure(6.4, 2.8)  # as wide as the docs' text at 90 dpi
    ax = fig.subplots()
    labels, tokens = zip(*stacked)
    ax.barh(range(len(tokens)), [t / 1e6 for t in tokens], color="tab:blue")
    ax.set_yticks(range(len(tokens)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("longest sequence (million tokens), llama3-8b, 8x H100, sp=8")
    for i, t in enumerate(tokens):
        ax.text(t / 1e6, i, f" {t / 1e6:.2f}M", va="center", fontsize=8)
    ax.set_xlim(0, max(tokens) / 1e6 * 1.15)
    return fig


show(plot_stack(stacked))

# %% [markdown]
# ## Measured: what each feature buys in the real step
#
# The stack above is the simulator's. The same question, answered by the library's real training
# step traced with fake tensors (`python -m simulations trace --find-max`: the model built on
# meta, `du.parallelize`, forward, backward and the optimizer step, every feature through its own
# code): the 8x H100 recipe with all five flags, then with each flag dropped in turn.
# `python -m benchmarks.trace_max_seq` wrote these numbers (about 4 minutes a row on 2 cores, so
# they are read here, not recomputed).

# %%
import json
from pathlib import Path

results = Path(du.__file__).resolve().parents[1] / "benchmarks/results/trace_max_seq.json"
runs = {r["hardware"]: r["result"] for r in json.loads(results.read_text())["runs"]}
traced = [("all five (8x H100 recipe)", runs["8x H100"]["max_seq_len"])]
traced += [(k[len("8x H100 ") :], v["max_seq_len"]) for k, v in runs.items() if "without" in k]
for label, n in traced:
    host = runs["8x H100" if label.startswith("all") else f"8x H100 {label}"]["host_bytes"]
    print(f"{label:>32}: {n:>10,} tokens, host {host / 2**30:6.1f} GiB per rank")
assert all(n < traced[0][1] for _, n in traced[1:]), "every feature buys length"
show(plot_stack(traced))

# %% [markdown]
# The tiled loss buys the most (without it the `[s, V]` logits bind below 0.4M), then the tiled
# MLP (its `[s, F]` intermediates, `F = 3.5 D`) and the offloaded checkpoints (32 blocks' inputs
# move to the host: that is the host column). Head chunks keep attention's full-length working
# set to one head per stage. The traced numbers for one GPU, and how the backward's peak was
# found and cut, are in the simulator's README.

# %% [markdown]
# ## What to take away
#
# * Model states are sharded over all GPUs whatever `sp` is; activations and logits are sharded
#   over `sp`. So the out-of-memory wall moves out roughly `sp` times.
# * Once activations are checkpointed, the logits are often what hits the wall first; a tiled loss
#   removes most of them, and offloading the checkpoints to the host the next largest part.
# * Next, notebook 4 (communication): what sharding the sequence costs.
