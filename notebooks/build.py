"""Write the teaching notebooks from the cells below, and execute them in place.

    python notebooks/build.py                 # every notebook: write, then execute (outputs kept)
    python notebooks/build.py 02 05           # only these (by number or name)
    python notebooks/build.py --no-execute    # write the cells only (outputs dropped)

The cells here are the source of the ``.ipynb`` files; ``tests/test_notebooks.py`` checks that the
committed notebooks have exactly these cells. The notebooks are committed *with* their outputs
(figures included) so that GitHub and the docs site (mkdocs-jupyter, ``execute: false``) show
them; CI executes a temporary copy of each and never writes back. Execution is deterministic
except for timings and throughput: workers are seeded, figures are PNGs without a software tag,
cell timing metadata and widget state are not stored.
"""

# ruff: noqa: E501  (markdown tables and diagrams in the cells are wider than code)
from __future__ import annotations

import argparse
import sys
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNEL = "python3"
CELL_TIMEOUT_S = 120
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

INSTALL = """\
> **Run it yourself.** `pip install -e ".[notebooks]"` in the repository, then
> `jupyter lab notebooks/`. Everything runs on a laptop CPU: distributed parts start local
> processes joined by gloo. The controls (ipywidgets) redraw the figures live; on the docs site
> you see the figures for the default values."""


def md(text: str) -> tuple[str, str]:
    return ("markdown", textwrap.dedent(text).strip("\n"))


def code(text: str) -> tuple[str, str]:
    return ("code", textwrap.dedent(text).strip("\n"))


# ----------------------------------------------------------------------------------------------
# 01: the mesh and the placements
# ----------------------------------------------------------------------------------------------
NB01 = [
    md(
        """
        # 1. The (dp, sp) mesh and DTensor placements

        Ulysses sequence parallelism is a statement about *layouts*: which rank holds which part of
        an activation `q[B, S, N, H]` (batch, sequence, heads, head dim). In dtensor-ulysses a
        layout is a PyTorch `DTensor`: a local tensor plus a `DeviceMesh` and one *placement* per
        mesh axis. This notebook builds the picture: the mesh as a grid of ranks, what each
        placement means for `q[B, S, N, H]`, and, per rank, exactly which (batch, token, head)
        cells it holds. The pictures are computed from the placements by
        `dtensor_ulysses.viz`, and the last section checks them against what `distribute_tensor`
        really puts on each of 4 processes.
        """
    ),
    md(INSTALL),
    code(
        """
        import dtensor_ulysses as du
        from dtensor_ulysses import notebook_workers as nw
        from dtensor_ulysses import viz
        from dtensor_ulysses.launch import run_local_world
        """
    ),
    md(
        """
        ## The mesh: rows are sp groups, columns are dp groups

        `du.init_mesh(dp, sp)` arranges `dp * sp` ranks as a 2-D grid with named axes
        `("dp", "sp")`, row by row: `rank = dp_coord * sp + sp_coord`.

        * An **sp group** (a row) shares one sequence: each of its ranks holds a contiguous slice
          of the tokens. Attention's all-to-alls run inside this group, so it is a block of
          consecutive ranks, which `torchrun` places on one node.
        * A **dp group** (a column) holds different sequences at the same token positions.
        * FSDP2 shards the parameters over all `dp x sp` ranks (the flattened `dp_sp` view): sp
          ranks hold the same weights but see different tokens.
        """
    ),
    code(
        """
        viz.live(viz.plot_mesh, dp=(1, 4), sp=(1, 8))
        """
    ),
    md(
        """
        ## Placements: one per mesh axis

        `x.shape` of a DTensor is always the **global** shape; each mesh axis says how that
        global tensor is laid out along it:

        | placement on an axis | what it does to `q[B, S, N, H]` | notation |
        |---|---|---|
        | `Shard(0)` | the batch is cut into contiguous chunks, chunk `i` on the axis' rank `i` | `q[B_dp, ...]` |
        | `Shard(1)` | the sequence is cut: each rank holds a block of consecutive tokens | `q[B, S_sp, N, H]` |
        | `Shard(2)` | the heads are cut: each rank holds all tokens of some heads | `q[B, S, N_sp, H]` |
        | `Replicate()` | every rank of the axis holds the same values | no subscript |

        `X_sp` means "dim X split over the `sp` mesh axis". Training keeps activations
        sequence-sharded, `(Shard(0), Shard(1))` = `q[B_dp, S_sp, N, H]`; inside attention
        Ulysses switches the sp axis to heads, `(Shard(0), Shard(2))` = `q[B_dp, S, N_sp, H]`:

        ```
        q[B, S_sp, N, H]  ->  q[B, S, N_sp, H]        on the sp axis:  Shard(1)  ->  Shard(2)
        ```

        Here is what each of 4 ranks holds of `q[B=2, S=8, N=4, H=16]` in the training layout:
        """
    ),
    code(
        """
        print(viz.describe_placements(dp=2, sp=2, B=2, S=8, N=4, H=16,
                                      placements=("Shard(0)", "Shard(1)")))
        """
    ),
    md(
        """
        The same as a picture: one panel per rank, laid out like the mesh. In a panel, each batch
        element is a block of heads (rows) by tokens (columns), colored where the rank holds the
        cell (a rank holds all `H` values of a cell it holds). Change the sizes and the placement
        of each axis; try `S=5` to see an uneven shard (chunks of `ceil(S / sp)`, the last ones
        shorter or empty), or `Shard(1)` on both axes (the sp axis cuts the dp axis' piece again).
        """
    ),
    code(
        """
        PLACEMENTS = ["Shard(0)", "Shard(1)", "Shard(2)", "Replicate()"]
        viz.live(viz.plot_placements, dp=(1, 4), sp=(1, 4), B=(1, 4), S=(1, 16), N=(1, 8),
                 dp_placement=PLACEMENTS, sp_placement=PLACEMENTS)
        """
    ),
    md(
        """
        Inside attention the sp axis shards the heads instead. Same tensor, same mesh, the other
        layout, `q[B_dp, S, N_sp, H]`: every rank now sees all 8 tokens, but only 2 of the 4 heads.
        Getting from the previous picture to this one is the Ulysses all-to-all (notebook 2).
        """
    ),
    code(
        """
        viz.show(viz.plot_placements(dp=2, sp=2, B=2, S=8, N=4,
                                     dp_placement="Shard(0)", sp_placement="Shard(2)"))
        """
    ),
    md(
        """
        ## Check: what `distribute_tensor` really places on each rank

        The pictures above come from a few lines of arithmetic (`viz.ownership`). Here a real
        gloo world of 4 processes runs `torch.distributed.tensor.distribute_tensor` for several
        layouts on a global tensor that holds its own flat index in every element, so each rank's
        local shard names exactly the cells it received. `run_local_world` spawns the processes;
        the worker lives in `dtensor_ulysses.notebook_workers` because spawned processes cannot
        import a function defined in a notebook.
        """
    ),
    code(
        """
        CASES = [
            nw.placement_case(2, 2, (2, 8, 4, 2), ("Shard(0)", "Shard(1)")),     # training layout
            nw.placement_case(2, 2, (2, 8, 4, 2), ("Shard(0)", "Shard(2)")),     # inside attention
            nw.placement_case(2, 2, (2, 8, 4, 2), ("Replicate()", "Shard(1)")),  # batch replicated
            nw.placement_case(2, 2, (3, 5, 4, 2), ("Shard(1)", "Shard(1)")),     # nested, uneven
            nw.placement_case(1, 4, (1, 5, 4, 2), ("Shard(0)", "Shard(1)")),     # S=5 on sp=4
        ]
        per_rank = run_local_world(nw.placement_worker, 4, CASES, timeout_s=240)
        problems = viz.placement_mismatches(CASES, per_rank)
        for i, case in enumerate(CASES):
            shapes = [per_rank[r][i]["local_shape"] for r in range(4)]
            print(f"{viz.layout_notation(case['placements']):22} shape {case['shape']} on "
                  f"dp={case['dp']} x sp={case['sp']}: local shapes by rank {shapes}")
        print("every rank holds exactly the cells its placements say:", not problems)
        assert not problems, problems
        """
    ),
    md(
        """
        ## What to take away

        * A DTensor layout is *(mesh, one placement per axis)*; `Shard(d)` cuts dim `d` into
          contiguous chunks, `Replicate()` copies.
        * The training layout is `(Shard(0), Shard(1))` = `q[B_dp, S_sp, N, H]`; attention needs
          `(Shard(0), Shard(2))` = `q[B_dp, S, N_sp, H]`. Ulysses is the move between them, on
          the sp axis only; the dp axis never changes.
        * Next, notebook 2 (the Ulysses all-to-all) moves the chunks.
        """
    ),
]

# ----------------------------------------------------------------------------------------------
# 02: the all-to-all
# ----------------------------------------------------------------------------------------------
NB02 = [
    md(
        """
        # 2. The Ulysses all-to-all, step by step

        Around attention, Ulysses changes the layout on the sp axis twice:

        ```
        q,k,v[B, S_sp, N, H]  --all-to-all-->  [B, S, N_sp, H]  --attention-->  o[B, S, N_sp, H]  --all-to-all-->  o[B, S_sp, N, H]
        sp axis:    Shard(1)           ->          Shard(2)                          Shard(2)          ->          Shard(1)
        ```

        In `du.seq_to_head`, each rank cuts its token block along the **head** dim into `sp`
        chunks, sends chunk `j` to rank `j`, and concatenates what it receives along the
        **sequence** dim; `du.head_to_seq` does the reverse. This notebook shows which chunk goes
        where, runs the real library on 4 local processes to watch it happen (including GQA,
        where there are fewer kv heads than ranks), and checks the bytes each rank moves, counted
        by `du.CommCounter`, against the closed form.
        """
    ),
    md(INSTALL),
    code(
        """
        import dtensor_ulysses as du
        from dtensor_ulysses import notebook_workers as nw
        from dtensor_ulysses import viz
        from dtensor_ulysses.launch import run_local_world
        """
    ),
    md(
        """
        ## The plan: who sends what to whom

        With `S=16` tokens, `N=8` heads and `sp=4`, rank `r` starts with tokens `4r:4r+4` of all
        8 heads. It keeps heads `2r:2r+2` of its own tokens and sends heads `2j:2j+2` to rank `j`.
        Every chunk is `B * (S/sp) * (N/sp) * H` elements.
        """
    ),
    code(
        """
        plan = viz.a2a_plan(S=16, N=8, sp=4, B=1, H=8, elem_bytes=4)
        for c in plan[:4]:
            print(f"rank {c.src} -> rank {c.dst}: tokens {c.tokens[0]}:{c.tokens[1]}, "
                  f"heads {c.heads[0]}:{c.heads[1]}, {c.bytes} bytes")
        print("bytes rank src puts in rank dst's slot:", viz.send_matrix(plan, 4))
        """
    ),
    md(
        """
        The whole round trip as a picture. Top row: before, each rank holds a token block; labels
        say which rank each chunk goes to. Middle: inside attention, each rank holds all tokens of
        its heads; the colors show which rank each piece came from. Bottom: after `head_to_seq`
        the token blocks are back, each head block computed by a different rank.
        """
    ),
    code(
        """
        viz.live(viz.plot_round_trip, S=(4, 32, 4), N=(1, 16), sp=[1, 2, 4, 8])
        """
    ),
    md(
        """
        ## Watch it happen on 4 processes

        `nw.ulysses_round_trip_worker` runs on a real gloo world of 4 processes. It distributes a
        tensor whose every element holds its own `(b, s, n)` code, so after `seq_to_head` the
        values each rank received name the cells it holds. It then runs `ulysses_attention`
        forward and backward under `du.CommCounter`, compares with single-device attention, and
        runs `du.UlyssesAttention` with a kernel that records which q and kv heads it was given.
        Two cases: the `tiny` model's heads (`N=8` q heads, `K=2` kv heads) on `dp=1 x sp=4`,
        and multi-head attention on a `dp=2 x sp=2` mesh.
        """
    ),
    code(
        """
        CASES = [
            nw.round_trip_case(dp=1, sp=4, S=16, N=8, K=2, H=8),
            nw.round_trip_case(dp=2, sp=2, S=16, N=8, K=8, H=8),
        ]
        per_rank = run_local_world(nw.ulysses_round_trip_worker, 4, CASES, timeout_s=240)
        case0 = [rows[0] for rows in per_rank]
        print("placements on rank 0:", case0[0]["placements"])
        print("head_to_seq(seq_to_head(x)) == x on every rank:",
              all(r["round_trip_exact"] for r in case0))
        print("max |ulysses_attention - single-device attention| per rank:",
              [r["max_abs_err"] for r in case0])
        """
    ),
    md(
        """
        The cells each rank held at each stage, as the real run reports them (they match the plan
        above, which the next cell checks exactly):
        """
    ),
    code(
        """
        viz.show(viz.plot_round_trip(S=16, N=8, sp=4, observed=viz.cells_by_stage(case0)))
        """
    ),
    md(
        """
        ## Bytes: measured vs closed form

        A rank's bytes for a collective are the size of the buffer it passes in (the project's
        convention; the chunk it keeps is part of that buffer, so `(sp-1)/sp` of it actually
        leaves the rank). Per `ulysses_attention` call and rank, with `s = S/sp` local tokens and
        `e` bytes per element:

        * forward: one **fused** all-to-all for q, k and v, `B*s*(N + 2K')*H*e`, then one for o,
          `B*s*N*H*e`;
        * backward: the same two again (the gradient of an all-to-all is the reverse all-to-all).

        `K'` is the number of kv heads summed over the ranks they are sent to: `K` when `sp`
        divides `K`, more when kv heads must be replicated (next section). At a fixed number of
        tokens per rank `s`, none of this grows with `sp`.
        """
    ),
    code(
        """
        report, problems = viz.round_trip_report(case0, CASES[0])
        print(report)
        assert not problems, problems
        """
    ),
    code(
        """
        viz.show(viz.plot_a2a_bytes(B=1, S=16, n_q=8, n_kv=2, H=8, sp=4, elem_bytes=4,
                                    measured=[r["attention"] for r in case0]))
        """
    ),
    md(
        """
        ## GQA: when sp is larger than the number of kv heads

        With grouped-query attention, q head `i` uses kv head `i // (N/K)`. If `sp` divides `K`,
        the kv heads are sharded like the q heads. The `tiny` model has `K=2` kv heads and we run
        `sp=4`: rank `r` attends with q heads `2r, 2r+1`, which both use kv head `r // 2`. So each
        kv head is sent to **two** ranks: `du.kv_head_index(8, 2, 4) == [0, 0, 1, 1]`, `K' = 4`.
        The copy is an `index_select` before the all-to-all, so autograd sums the copies'
        gradients back into the one kv head. The kernel-recorded heads from the real run:
        """
    ),
    code(
        """
        print("du.kv_head_index(8, 2, 4) =", du.kv_head_index(8, 2, 4))
        for r in case0:
            k = r["kernel"]
            print(f"rank {r['rank']}: kernel got q heads {k['q_heads']} {k['shape_q']}, "
                  f"kv heads {k['kv_heads']} {k['shape_kv']}")
        """
    ),
    code(
        """
        viz.live(viz.plot_gqa, n_q=[4, 8, 16, 32, 64], n_kv=[1, 2, 4, 8], sp=[1, 2, 4, 8, 16])
        """
    ),
    md(
        """
        ## A 2-D mesh: the dp axis is left alone

        The second case ran on `dp=2 x sp=2` with a global batch of 2: each dp row is its own sp
        group, the batch placement `Shard(0)` is kept throughout, and each all-to-all runs inside
        one sp group only.
        """
    ),
    code(
        """
        case1 = [rows[1] for rows in per_rank]
        report, problems = viz.round_trip_report(case1, CASES[1])
        print(report)
        print("placements:", case1[0]["placements"])
        assert not problems, problems
        """
    ),
    md(
        """
        ## What to take away

        * `q[B, S_sp, N, H] -> q[B, S, N_sp, H]` is one `all_to_all_single` per call on the sp
          group, on every backend; q, k and v travel together in one of them.
        * Per rank and layer, forward moves `B*s*(N + 2K')*H*e + B*s*N*H*e` bytes in, and
          backward the same; only `(sp-1)/sp` of it leaves the rank.
        * With fewer kv heads than ranks, kv heads are replicated (`K' > K`), which the byte count
          includes.
        * Next, notebook 3 (memory): what sharding the sequence buys.
        """
    ),
]

# ----------------------------------------------------------------------------------------------
# 03: memory
# ----------------------------------------------------------------------------------------------
NB03 = [
    md(
        """
        # 3. Memory per rank vs sequence length

        What fills a GPU in long-context training, and what sequence parallelism does to it:

        * **model states** (weights, gradients, optimizer states): FSDP2 shards them over all
          `dp x sp` ranks, so for a fixed number of GPUs they do not depend on `sp`;
        * **activations**, kept for backward: every one lives in a sequence-sharded layout
          `x[B, S_sp, D]` (`Shard(1)` on sp), so they shrink as `1/sp`; only inside attention is
          a layer's q, k, v briefly head-sharded `q[B, S, N_sp, H]` (`Shard(2)`), which is the
          same number of bytes;
        * **logits** `[B, S_sp, V]` for the loss: also `1/sp`, and large, since the vocabulary
          `V` is large.

        The curves come from the project's cost model (`simulations`, torch-free); the last
        section measures the real model on CPU and puts the measured points on the model's
        prediction.
        """
    ),
    md(INSTALL),
    code(
        """
        import simulations as sim
        from dtensor_ulysses import notebook_workers as nw
        from dtensor_ulysses import viz
        from dtensor_ulysses.launch import run_local_world
        from dtensor_ulysses.presets import PRESETS
        """
    ),
    md(
        """
        ## Where the out-of-memory wall is

        The number of GPUs is fixed (`gpus`) and `dp = gpus / sp`, so every layout shards the
        model states over the same ranks and only the tokens per rank differ. Left: peak memory
        per rank as the sequence grows, one line per `sp` (dotted past the GPU's usable memory,
        vertical lines at the wall). Middle: what the peak is made of at one length. Right: the
        longest sequence that fits, for each `sp`. Try `tiled_loss` (logits computed over
        sequence tiles) and `ac="none"` (no activation checkpointing), another model or GPU.
        """
    ),
    code(
        """
        MODELS = [m for m in PRESETS if m != "tiny"]
        viz.live(viz.plot_memory_scaling, model=MODELS, gpu=list(sim.GPUS), gpus=[8, 16, 32, 64],
                 ac=["full", "none"], tiled_loss=False,
                 seq_len=[16384, 32768, 65536, 131072, 262144])
        """
    ),
    md(
        """
        The wall as numbers, and how much further it moves when the loss is tiled (with full
        checkpointing the logits are the largest term for Llama-3-8B's 128K vocabulary):
        """
    ),
    code(
        """
        for tiled in (False, True):
            walls = viz.oom_walls("llama3-8b", "h100", gpus=8, ac="full", tiled_loss=tiled)
            print(f"tiled_loss={tiled!s:5}: longest sequence per sp on 8x h100:",
                  {sp: f"{n:,}" for sp, n in walls.items()})
        """
    ),
    md(
        """
        ## Measured: the real model on CPU

        Does the model count what the code keeps? Here the real `tiny` preset, parallelized by
        `du.parallelize` (Ulysses + FSDP2), runs forward and the loss on 4 gloo processes in three
        layouts: `dp=4 x sp=1`, `dp=2 x sp=2` and `dp=1 x sp=4`, one sequence per rank, fp32,
        no checkpointing, for several lengths.

        **What is measured, and how**: every tensor autograd saves for backward is recorded with
        `torch.autograd.graph.saved_tensors_hooks`, tagged by whether a transformer block saved
        it. After the loss, the distinct storages still held are summed (a tensor saved twice, or
        a view, counts once; parameters are excluded). That is the activation memory a rank
        holds at the start of backward, exactly, independent of allocator caching. It is
        compared with the simulator's per-layer activation bytes for the same workload (`fp32`,
        `ac="none"`) times the number of layers.
        """
    ),
    code(
        """
        LAYOUTS = [(4, 1), (2, 2), (1, 4)]
        SEQ_LENS = [256, 512, 1024, 2048]
        per_rank = run_local_world(nw.activation_memory_worker, 4, LAYOUTS, SEQ_LENS, "tiny",
                                   timeout_s=300)
        measured = per_rank[0]
        assert all(rows == measured for rows in per_rank), "ranks measured different bytes"
        print(viz.activation_table(measured, model="tiny"))
        """
    ),
    code(
        """
        viz.show(viz.plot_activation_check(measured, model="tiny"))
        """
    ),
    md(
        """
        At a fixed sequence length the measured bytes per rank fall almost as `1/sp`: a little
        less, because with `sp > 1` the output of the second all-to-all is one more saved tensor
        (the o projection's input), and at `sp=4` the 2 kv heads are replicated (`K' = 4`). The
        simulator counts both and tracks the measurement within a few percent at every point;
        most of the remaining gap is the RMSNorms, whose outputs the simulator's profile counts
        at 2 bytes (bf16 training) while this fp32 run keeps 4.
        """
    ),
    code(
        """
        by = {(r["sp"], r["seq_len"]): r["blocks_bytes"] for r in measured}
        for S in SEQ_LENS:
            print(f"S={S:5}: sp=1 / sp=2 = {by[1, S] / by[2, S]:.3f}, "
                  f"sp=1 / sp=4 = {by[1, S] / by[4, S]:.3f}")
        """
    ),
    md(
        """
        ## What to take away

        * Model states are sharded over all GPUs whatever `sp` is; activations and logits are
          sharded over `sp`. So the out-of-memory wall moves out roughly `sp` times.
        * Once activations are checkpointed, the logits are often what hits the wall first; a
          tiled loss removes most of them.
        * Next, notebook 4 (communication): what sharding the sequence costs.
        """
    ),
]

# ----------------------------------------------------------------------------------------------
# 04: communication
# ----------------------------------------------------------------------------------------------
NB04 = [
    md(
        """
        # 4. Communication: Ulysses vs Ring vs Megatron-SP vs USP

        Four ways to split one sequence over `P` GPUs, and what each moves per layer (forward,
        per rank; `s = S/P` tokens per rank, `e` bytes per element, `D` hidden size):

        | method | layouts | forward traffic per rank and layer |
        |---|---|---|
        | **Ulysses** | `q[B, S_P, N, H] -> q[B, S, N_P, H]` (`Shard(1) -> Shard(2)`) | all-to-alls of `B*s*(N+2K')*H*e` (q,k,v) and `B*s*N*H*e` (o) |
        | **Ring attention** | stays `Shard(1)`; k,v blocks travel round the ring | `P-1` sends of the local k,v block, `B*s*2K*H*e` each |
        | **Megatron-SP** (tensor parallel + sequence parallel) | `x[B, S_P, D] -> x[B, S, D]` around each matmul pair | all-gathers of `B*s*D*e`, reduce-scatters of `B*S*D*e` |
        | **USP** | Ulysses inside a node, ring across nodes | both, on smaller groups |

        Ulysses' volume per rank is proportional to `S/P` and independent of `P` at a fixed
        `S/P`; ring's per-rank volume is proportional to `S` (every k,v block visits every rank);
        Megatron-SP's to `S*D`. Time adds the links: an sp group that fits in a node talks over
        NVLink, one that spans nodes over the NICs, several times slower. All numbers here come
        from the cost model, `simulations`.
        """
    ),
    md(INSTALL),
    code(
        """
        import simulations as sim
        from dtensor_ulysses import viz
        from dtensor_ulysses.presets import PRESETS
        """
    ),
    md(
        """
        ## One layout, four methods

        Llama-3-8B (32 q heads, 8 kv heads), 128K tokens over `P=8` H100s, per rank per
        training step (forward, backward and the recompute of full activation checkpointing),
        attention collectives only:
        """
    ),
    code(
        """
        print(viz.methods_table("llama3-8b", seq_len=131072, sp=8, gpu="h100"))
        """
    ),
    md(
        """
        ## As S, P, heads and the interconnect change

        From left to right: volume vs sequence length; volume vs `P` at a fixed `S` (and,
        dashed, Ulysses at a fixed `S/P`: flat until `P` exceeds the kv heads, where kv heads
        start being replicated); communication time vs `P`, with the region where an sp group
        spans nodes shaded (the cliff); and the step time split into compute and exposed
        communication. Ulysses needs `P` to divide the q heads; Megatron-SP also the kv heads, so
        some methods stop early. Change the kv heads (GQA degree) and the links.
        """
    ),
    code(
        """
        LINK = [("profile", None)] + [(f"{v} GB/s", v) for v in (25, 50, 100, 200, 370, 900)]
        viz.live(viz.plot_comm_methods, model=[m for m in PRESETS if m != "tiny"],
                 seq_len=[32768, 131072, 524288, 1048576], sp=[2, 4, 8, 16, 32, 64],
                 gpu=list(sim.GPUS), kv_heads=[("model", None)] + [(str(k), k) for k in (1, 2, 4, 8)],
                 intra_gbps=LINK, inter_gbps=LINK,
                 gpus_per_node=[("profile", None), ("4", 4), ("8", 8)])
        """
    ),
    md(
        """
        ## The intra-node vs inter-node cliff

        `torchrun` numbers ranks node by node and the sp groups are consecutive ranks, so with 8
        GPUs per node, `P <= 8` keeps every all-to-all on NVLink (about 370 GB/s of bus bandwidth
        on H100) and `P = 16` sends it through the NICs (about 48 GB/s). Here is the Ulysses
        communication time of Llama-3-70B (64 q heads) at 256K tokens as `P` crosses the node
        boundary, next to USP, which keeps its all-to-all inside the node and runs a ring across
        nodes:
        """
    ),
    code(
        """
        print("attention communication per rank per step, if nothing overlapped it:")
        for method in ("ulysses", "usp", "ring"):
            row = []
            for P in (4, 8, 16, 32, 64):
                p = sim.predict("llama3-70b", 262144, sp=P, gpu="h100", attention=method)
                row.append(f"P={P}: {viz.attention_comm(p)['time_s']:.2f} s")
            print(f"{method:8}", " | ".join(row))
        """
    ),
    md(
        """
        ## What the planner recommends

        `sim.plan` tries every `(dp, sp)` for a GPU count, finds the longest sequence each fits,
        and ranks them; with a target length it ranks the layouts that fit it by throughput. The
        same as `python -m simulations plan --model llama3-8b --gpus 8 --gpu h100`:
        """
    ),
    code(
        """
        print(viz.plan_report("llama3-8b", gpus=8, gpu="h100"))
        """
    ),
    code(
        """
        viz.live(viz.plan_report, model=[m for m in PRESETS if m != "tiny"], gpus=[8, 16, 32, 64],
                 gpu=list(sim.GPUS),
                 seq_len=[("longest", None)] + [(f"{s:,}", s) for s in (32768, 131072, 524288)],
                 ac=["full", "none"], tiled_loss=False)
        """
    ),
    md(
        """
        ## What to take away

        * Ulysses moves `O(S/P)` bytes per rank, constant as `P` grows at a fixed `S/P`; ring
          moves `O(S)` per rank but hides it behind attention when blocks are large; Megatron-SP
          moves `O(S*D)` and sits on the critical path.
        * Ulysses' degree is capped by the heads (`P` must divide `N`), and beyond the kv heads
          it pays for replicated k,v.
        * Keep an all-to-all inside a node; to go past a node, USP puts the ring across nodes.
        * Next, notebook 5: train with FSDP2 + Ulysses from the notebook.
        """
    ),
]

# ----------------------------------------------------------------------------------------------
# 05: training
# ----------------------------------------------------------------------------------------------
NB05 = [
    md(
        """
        # 5. Train with FSDP2 + Ulysses, from the notebook

        `python -m dtensor_ulysses.train` is the project's `torchrun` entry point. Each step, every
        rank reads its slice `ids[b, S_sp]` of the global batch (`b = batch / dp` sequences, a
        contiguous `S/sp` block of tokens), runs the model on it (attention through Ulysses,
        `Shard(1) -> Shard(2) -> Shard(1)` on sp), computes the token-weighted cross entropy over
        the whole global batch, and lets FSDP2, sharded over all `dp x sp` ranks, reduce-scatter
        the gradients.

        Because `--batch-size` is the **global** batch and the data order depends only on the
        step and the seed, any `(dp, sp)` trains on the same tokens and must give the same loss
        curve, up to floating-point summation order. This notebook launches three short real
        runs of the `tiny` preset on CPU (gloo) and checks exactly that.
        """
    ),
    md(INSTALL),
    code(
        """
        from dtensor_ulysses import notebook_workers as nw
        from dtensor_ulysses import viz
        """
    ),
    md(
        """
        ## The command

        `nw.torchrun_command` builds it; `python -m torch.distributed.run` is what the `torchrun`
        script runs, started with the notebook's own interpreter:
        """
    ),
    code(
        """
        RUN = dict(model="tiny", seq_len=128, batch_size=4, steps=10, seed=0)
        cmd = nw.torchrun_command(1, 2, metrics_file="metrics.jsonl", **RUN)
        print("torchrun", " ".join(cmd[3:]))
        """
    ),
    md(
        """
        ## Three layouts, one global batch

        `(dp, sp) = (1, 1)` is a single process; `(1, 2)` splits every sequence over 2 ranks
        (Ulysses); `(2, 1)` gives each of 2 ranks its own 2 sequences (plain data parallelism).
        Each run's output is streamed here as it arrives; `run_training` returns the records of
        its `--metrics-file` (one JSON object per step).
        """
    ),
    code(
        """
        runs = {}
        for dp, sp in [(1, 1), (1, 2), (2, 1)]:
            print(f"--- dp={dp} x sp={sp} ---")
            runs[f"dp={dp} x sp={sp}"] = nw.run_training(dp, sp, **RUN)
        """
    ),
    code(
        """
        viz.show(viz.plot_training(runs))
        """
    ),
    code(
        """
        agreement = viz.loss_agreement(runs)
        for name, rel in agreement.items():
            print(f"{name}: largest relative loss difference from dp=1 x sp=1 over "
                  f"{len(runs[name])} steps = {rel:.1e}")
        assert all(rel < 1e-4 for rel in agreement.values()), agreement
        """
    ),
    md(
        """
        The curves lie on top of each other. Tokens per second differ: on a CPU, splitting a
        128-token sequence over two processes adds communication and halves each matmul, so it
        buys no speed; on GPUs at long sequence lengths it is what lets the sequence fit at all
        (notebook 3).

        ## Try more

        * `nw.run_training(2, 2, **RUN)` runs 4 processes, `dp=2 x sp=2`: the same curve again.
        * `RUN["seq_len"] = 1024` and compare `peak_mem_bytes` in the records (on CPU it is the
          process's peak resident set, which includes the Python runtime).
        * From a terminal, the same job:
          `torchrun --standalone --nproc-per-node 2 -m dtensor_ulysses.train --dp 1 --sp 2 --steps 40`.
        """
    ),
]

NOTEBOOKS = {
    "01_mesh_and_placements": NB01,
    "02_ulysses_all_to_all": NB02,
    "03_memory_scaling": NB03,
    "04_communication": NB04,
    "05_train_with_fsdp2": NB05,
}


def build(name: str):
    """The notebook ``name`` (cells only, no outputs)."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    for kind, src in NOTEBOOKS[name]:
        if kind == "markdown":
            nb.cells.append(nbformat.v4.new_markdown_cell(src))
        else:
            nb.cells.append(nbformat.v4.new_code_cell(src))
    for i, cell in enumerate(nb.cells):
        cell.id = f"{name[:2]}-{i:02d}"  # stable ids: no churn in diffs
    nb.metadata["kernelspec"] = {"name": KERNEL, "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def execute(nb, cwd: Path = HERE, timeout_s: int = CELL_TIMEOUT_S) -> float:
    """Execute ``nb`` in place (kernel ``python3``, working directory ``cwd``); returns seconds.

    Widget state and cell timing metadata are not stored (the docs site must not load widget
    scripts from a CDN, and timestamps would churn every run).
    """
    from nbclient import NotebookClient

    t0 = time.perf_counter()
    NotebookClient(
        nb,
        timeout=timeout_s,
        kernel_name=KERNEL,
        resources={"metadata": {"path": str(cwd)}},
        store_widget_state=False,
        record_timing=False,
    ).execute()
    nb.metadata["language_info"] = {"name": "python"}  # no interpreter version: no churn
    strip_widget_views(nb)
    return time.perf_counter() - t0


def strip_widget_views(nb) -> None:
    """Drop widget views from outputs, keeping their text fallback.

    A widget view only means something to a live kernel, and its random model id would change
    on every execution; the figure next to it is an ordinary image output and stays.
    """
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            data.pop(WIDGET_VIEW, None)


def _select(keys: list[str]) -> list[str]:
    if not keys:
        return list(NOTEBOOKS)
    out = []
    for k in keys:
        match = [n for n in NOTEBOOKS if n == k or n.startswith(k)]
        if not match:
            raise SystemExit(f"no notebook matches {k!r}; choose from {', '.join(NOTEBOOKS)}")
        out += match
    return out


def main(argv: list[str] | None = None) -> int:
    import nbformat

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="notebooks to build (number or name); default: all")
    p.add_argument("--no-execute", action="store_true", help="write the cells only")
    args = p.parse_args(argv)
    for name in _select(args.names):
        nb = build(name)
        path = HERE / f"{name}.ipynb"
        if not args.no_execute:
            seconds = execute(nb)
            print(f"{name}: executed in {seconds:.0f} s", flush=True)
        nbformat.write(nb, path)
        print(f"wrote {path.relative_to(HERE.parent)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
