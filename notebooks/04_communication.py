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
# # 4. Communication: Ulysses vs Ring vs Megatron-SP vs USP
#
# Four ways to split one sequence over `P` GPUs, and what each moves per layer (forward, per rank;
# `s = S/P` tokens per rank, `e` bytes per element, `D` hidden size):
#
# * **Ulysses**: `q[B, S_P, N, H] -> q[B, S, N_P, H]` (`Shard(1) -> Shard(2)`); all-to-alls of
#   `B*s*(N+2K')*H*e` (q, k, v) and `B*s*N*H*e` (o).
# * **Ring attention**: stays `Shard(1)`; the k, v blocks travel round the ring: `P-1` sends of the
#   local k, v block, `B*s*2K*H*e` each.
# * **Megatron-SP** (tensor parallel + sequence parallel): `x[B, S_P, D] -> x[B, S, D]` around each
#   matmul pair; all-gathers of `B*s*D*e`, reduce-scatters of `B*S*D*e`.
# * **USP**: Ulysses inside a node, ring across nodes; both, on smaller groups.
#
# Ulysses' volume per rank is proportional to `S/P` and independent of `P` at a fixed `S/P`;
# ring's per-rank volume is proportional to `S` (every k, v block visits every rank);
# Megatron-SP's to `S*D`. Time adds the links: an sp group that fits in a node talks over NVLink,
# one that spans nodes over the NICs, several times slower. All numbers here come from the cost
# model, `simulations`; the tables from `simulations.report`.

# %% [markdown]
# > **Run it yourself.** `pip install -e ".[notebooks]"` in the repository, then
# > `jupyter lab notebooks/`. Everything runs on a laptop CPU: distributed parts start local
# > processes joined by gloo. The controls (ipywidgets) redraw the figures live; on the docs site
# > you see the figures for the default values. The helpers in `notebooks/tutorial/` only draw
# > and start processes.

# %%
import simulations as sim
from dtensor_ulysses.plan import PRESETS
from simulations import report
from tutorial import sim_figures
from tutorial.widgets import live

# %% [markdown]
# ## One layout, four methods
#
# Llama-3-8B (32 q heads, 8 kv heads), 128K tokens over `P=8` H100s, per rank per training step
# (forward, backward and the recompute of full activation checkpointing), attention collectives
# only:

# %%
print(report.methods_table("llama3-8b", seq_len=131072, sp=8, gpu="h100"))

# %% [markdown]
# ## As S, P, heads and the interconnect change
#
# From left to right: volume vs sequence length; volume vs `P` at a fixed `S` (and, dashed,
# Ulysses at a fixed `S/P`: flat until `P` exceeds the kv heads, where kv heads start being
# replicated); communication time vs `P`, with the region where an sp group spans nodes shaded
# (the cliff); and the step time split into compute and exposed communication. Ulysses needs `P`
# to divide the q heads; Megatron-SP also the kv heads, so some methods stop early. Change the kv
# heads (GQA degree) and the links.

# %%
LINK = [("profile", None)] + [(f"{v} GB/s", v) for v in (25, 50, 100, 200, 370, 900)]
live(
    sim_figures.plot_comm_methods,
    model=[m for m in PRESETS if m != "tiny"],
    seq_len=[32768, 131072, 524288, 1048576],
    sp=[2, 4, 8, 16, 32, 64],
    gpu=list(sim.GPUS),
    kv_heads=[("model", None)] + [(str(k), k) for k in (1, 2, 4, 8)],
    intra_gbps=LINK,
    inter_gbps=LINK,
    gpus_per_node=[("profile", None), ("4", 4), ("8", 8)],
)

# %% [markdown]
# ## The intra-node vs inter-node cliff
#
# `torchrun` numbers ranks node by node and the sp groups are consecutive ranks, so with 8 GPUs
# per node, `P <= 8` keeps every all-to-all on NVLink (about 370 GB/s of bus bandwidth on H100)
# and `P = 16` sends it through the NICs (about 48 GB/s). Here is the Ulysses communication time
# of Llama-3-70B (64 q heads) at 256K tokens as `P` crosses the node boundary, next to USP, which
# keeps its all-to-all inside the node and runs a ring across nodes:

# %%
print("attention communication per rank per step, if nothing overlapped it:")
for method in ("ulysses", "usp", "ring"):
    row = []
    for P in (4, 8, 16, 32, 64):
        p = sim.predict("llama3-70b", 262144, sp=P, gpu="h100", attention=method)
        row.append(f"P={P}: {report.attention_comm(p)['time_s']:.2f} s")
    print(f"{method:8}", " | ".join(row))

# %% [markdown]
# ## What the planner recommends
#
# `sim.plan` tries every `(dp, sp)` for a GPU count, finds the longest sequence each fits, and
# ranks them; with a target length it ranks the layouts that fit it by throughput. The same as
# `python -m simulations plan --model llama3-8b --gpus 8 --gpu h100`:

# %%
print(report.format_plan(sim.plan("llama3-8b", gpus=8, gpu="h100")))

# %%
live(
    report.plan_report,
    model=[m for m in PRESETS if m != "tiny"],
    gpus=[8, 16, 32, 64],
    gpu=list(sim.GPUS),
    seq_len=[("longest", None)] + [(f"{s:,}", s) for s in (32768, 131072, 524288)],
    ac=["full", "none"],
    tiled_loss=False,
)

# %% [markdown]
# ## When Ulysses x Ring wins
#
# Pure Ulysses over `P` GPUs hits two ceilings:
#
# * **heads**: past the `K` kv heads every rank still needs one, so kv heads are replicated
#   (Llama-3-8B has 8: at `P = 16` and `32` the all-to-all carries `K' = P` of them); past the `N`
#   q heads a rank would hold none (`P = 64` cannot run);
# * **nodes**: an sp group wider than a node (8 GPUs) sends its all-to-all through the NICs,
#   about 48 GB/s per GPU on H100 instead of NVLink's 370, on the critical path.
#
# Ulysses x Ring (the library's `("dp", "ring", "sp")` mesh, `docs/concepts/ring.md`) keeps the
# all-to-all inside a node over `sp` ranks and runs a ring of `P / sp` across nodes. The ring's
# p2p bytes are the library's `ring_closed_form`; they grow with `S`, but each hop hides behind
# that step's attention. Here, at 32K tokens per GPU (`dp = 1`), pure Ulysses against the split
# the planner proposes (`simulations.planner.hybrid_split`: the largest `sp` that divides the q
# heads, replicates no kv head and fits in a node); per rank per step, `comm s` is the attention
# traffic's time if nothing overlapped, `exposed s` what the step waits for (FSDP included):

# %%
rows = sim_figures.hybrid_rows("llama3-8b", tokens_per_gpu=32768, gpu="h100")
print(sim_figures.hybrid_table(rows))
by = {(r["gpus"], r["method"]): r for r in rows}
assert (64, "ulysses") not in by  # past the 32 q heads only the hybrid runs
assert by[32, "ulysses x ring"]["exposed_s"] < by[32, "ulysses"]["exposed_s"] / 5

# %%
live(
    sim_figures.plot_hybrid,
    model=[m for m in PRESETS if m != "tiny"],
    tokens_per_gpu=[8192, 32768, 131072],
    gpu=list(sim.GPUS),
)

# %% [markdown]
# The planner makes the same comparison: where pure Ulysses hits a ceiling it adds a
# `(dp, ring, sp)` row (`ring > 1`) next to the `(dp, sp)` rows, costed by the same functions.
# `python -m simulations plan --model llama3-8b --gpus 32 --gpu h100` prints it with a `ring`
# column; the first rows:

# %%
pl = sim.plan("llama3-8b", gpus=32, gpu="h100")
for x in pl.layouts[:4]:
    print(f"dp={x.dp} sp={x.sp} ring={x.ring}: {x.tokens_per_s:,.0f} tokens/s; {x.why}\n")
assert (pl.best.sp, pl.best.ring) == (8, 4)

# %% [markdown]
# ## What to take away
#
# * Ulysses moves `O(S/P)` bytes per rank, constant as `P` grows at a fixed `S/P`; ring moves
#   `O(S)` per rank but hides it behind attention when blocks are large; Megatron-SP moves
#   `O(S*D)` and sits on the critical path.
# * Ulysses' degree is capped by the heads (`P <= N`; uneven splits cost an imbalance), and beyond
#   the kv heads it pays for replicated k, v.
# * Keep an all-to-all inside a node; to go past a node or past the heads, Ulysses x Ring puts
#   the ring across nodes, and the planner proposes it where pure Ulysses hits a ceiling.
# * Next, notebook 5: train with FSDP2 + Ulysses from the notebook.
