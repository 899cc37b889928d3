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
# # 5. Train with FSDP2 + Ulysses, from the notebook
#
# `python -m dtensor_ulysses.train` is the project's `torchrun` entry point. Each step, every rank
# reads its slice `ids[b, S_sp]` of the global batch (`b = batch / dp` sequences, a contiguous
# `S/sp` block of tokens), runs the model on it (attention through Ulysses,
# `Shard(1) -> Shard(2) -> Shard(1)` on sp), computes the token-weighted cross entropy over the
# whole global batch, and lets FSDP2, sharded over all `dp x sp` ranks, reduce-scatter the
# gradients.
#
# Because `--batch-size` is the **global** batch and the data order depends only on the step and
# the seed, any `(dp, sp)` trains on the same tokens and must give the same loss curve, up to
# floating-point summation order. This notebook launches three short real runs of the `tiny`
# preset on CPU (gloo) and checks exactly that.

# %% [markdown]
# > **Run it yourself.** `pip install -e ".[notebooks]"` in the repository, then
# > `jupyter lab notebooks/`. Everything runs on a laptop CPU: distributed parts start local
# > processes joined by gloo. The helpers in `notebooks/tutorial/` only draw and start processes.

# %%
from tutorial import checks, figures
from tutorial.widgets import show
from tutorial.workers import run_training, torchrun_command

# %% [markdown]
# ## The command
#
# `torchrun_command` builds it; `python -m torch.distributed.run` is what the `torchrun` script
# runs, started with the notebook's own interpreter:

# %%
RUN = dict(model="tiny", seq_len=128, batch_size=4, steps=10, seed=0)
cmd = torchrun_command(1, 2, metrics_file="metrics.jsonl", **RUN)
print("torchrun", " ".join(cmd[3:]))

# %% [markdown]
# ## Three layouts, one global batch
#
# `(dp, sp) = (1, 1)` is a single process; `(1, 2)` splits every sequence over 2 ranks (Ulysses);
# `(2, 1)` gives each of 2 ranks its own 2 sequences (plain data parallelism). Each run's output is
# streamed here as it arrives; `run_training` returns the records of its `--metrics-file` (one
# JSON object per step).

# %%
runs = {}
for dp, sp in [(1, 1), (1, 2), (2, 1)]:
    print(f"--- dp={dp} x sp={sp} ---")
    runs[f"dp={dp} x sp={sp}"] = run_training(dp, sp, **RUN)

# %%
show(figures.plot_training(runs))

# %%
agreement = checks.loss_agreement(runs)
for name, rel in agreement.items():
    print(
        f"{name}: largest relative loss difference from dp=1 x sp=1 over "
        f"{len(runs[name])} steps = {rel:.1e}"
    )
assert all(rel < 1e-4 for rel in agreement.values()), agreement

# %% [markdown]
# The curves lie on top of each other. Tokens per second differ: on a CPU, splitting a 128-token
# sequence over two processes adds communication and halves each matmul, so it buys no speed; on
# GPUs at long sequence lengths it is what lets the sequence fit at all (notebook 3).
#
# ## Try more
#
# * `run_training(2, 2, **RUN)` runs 4 processes, `dp=2 x sp=2`: the same curve again.
# * `RUN["seq_len"] = 1024` and compare `peak_mem_bytes` in the records (on CPU it is the
#   process's peak resident set, which includes the Python runtime).
# * From a terminal, the same job:
#   `torchrun --standalone --nproc-per-node 2 -m dtensor_ulysses.train --dp 1 --sp 2 --steps 40`.
