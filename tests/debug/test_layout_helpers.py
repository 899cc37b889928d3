"""The layout math (dtensor_ulysses.debug) and the notebooks' helpers against the real library.

* Placements: the cells ``debug.ownership`` computes for each rank are exactly the cells
  ``distribute_tensor`` places there, on a gloo world of 4 (even, uneven, nested, replicated).
* All-to-all: the per-rank send plan (``debug.a2a_plan``/``send_matrix``) and the closed form
  (``debug.ulysses_closed_form``) equal what ``du.CommCounter`` measures for ``seq_to_head``,
  ``head_to_seq`` and ``ulysses_attention`` forward and backward; the cells each rank holds at
  each stage and the kv heads the kernel receives equal the plan (MHA, GQA, MQA, 2-D mesh).
* Memory: activation bytes the real model saves per rank, measured, match the simulator's
  prediction (10%) and fall almost as 1/sp.
* The simulator reports (``simulations.report``) agree with the simulator's own totals; every
  figure (``notebooks/tutorial``) renders; ``widgets.live`` shows the default figure as an
  ordinary image and redraws it in place.

The functions the worlds run are the notebooks' own, read from their jupytext sources
(``notebooks/0N_*.py``: the imports and ``def`` statements of the code cells, nothing else) and
started by ``tutorial.workers.run_on_ranks``, as in the notebooks, with more cases here.
"""

from __future__ import annotations

import ast
import linecache
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from dtensor_ulysses import debug

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
sys.path.insert(0, str(NOTEBOOKS))  # `tutorial`, as the notebooks (cwd notebooks/) see it

from tutorial import checks  # noqa: E402
from tutorial.workers import run_on_ranks, torchrun_command  # noqa: E402


def notebook_functions(name: str) -> dict:
    """The imports and functions defined in the code cells of ``notebooks/{name}.py``.

    Statements other than imports and ``def`` (the cells that run worlds, print, plot) are left
    out. The code is registered with ``linecache``, as IPython does for a cell, so that
    ``run_on_ranks`` can send the functions' source to spawned processes.
    """
    jupytext = pytest.importorskip("jupytext")
    nb = jupytext.read(NOTEBOOKS / f"{name}.py", fmt="py:percent")
    parts = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        tree = ast.parse(cell.source)
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef)):
                parts.append(ast.get_source_segment(cell.source, node, padded=True))
    src = "\n\n".join(parts) + "\n"
    filename = f"<notebook {name}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    ns: dict = {"__name__": f"notebook_{name[:2]}"}
    exec(compile(src, filename, "exec"), ns)
    return ns


# ----------------------------------------------------------------------------------------------
# placements
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", range(0, 13))
@pytest.mark.parametrize("parts", range(1, 6))
def test_shard_range_is_torch_chunk(n, parts):
    chunks = list(torch.arange(n).chunk(parts)) if n else []
    for i in range(parts):
        lo, hi = debug.shard_range(n, parts, i)
        want = chunks[i].tolist() if i < len(chunks) else []
        assert list(range(lo, hi)) == want


def test_parse_placement_and_notation():
    assert debug.parse_placement(Shard(2)) == 2
    assert debug.parse_placement(Replicate()) is None
    assert debug.parse_placement("S(1)") == debug.parse_placement("Shard(1)") == 1
    assert debug.parse_placement("R") is None
    with pytest.raises(ValueError, match="not Shard"):
        debug.parse_placement("Partial()")
    assert debug.layout_notation([Shard(0), Shard(1)]) == "q[B_dp, S_sp, N, H]"
    assert debug.layout_notation(["Shard(0)", "Shard(2)"]) == "q[B_dp, S, N_sp, H]"
    assert debug.layout_notation(["Shard(1)", "Shard(1)"]) == "q[B, S_dp,sp, N, H]"
    assert debug.layout_notation(["Replicate()", "Replicate()"]) == "q[B, S, N, H]"
    assert debug.mesh_ranks(2, 3) == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize(
    "placements",
    [
        [Shard(0), Shard(1)],
        [Shard(0), Shard(2)],
        [Replicate(), Shard(1)],
        [Shard(3), Replicate()],
        [Replicate(), Replicate()],
        [Shard(1), Shard(1)],
    ],
)
def test_notation_round_trip(placements):
    text = debug.layout_notation(placements, name="x")
    assert debug.parse_layout(text) == placements
    with pytest.raises(ValueError, match="not a mesh axis"):
        debug.parse_layout("q[B, S_tp, N, H]")


def test_ownership_tiles_the_tensor_once_per_replica():
    shape = (2, 8, 4, 2)
    for placements in [
        ("Shard(0)", "Shard(1)"),
        ("Shard(0)", "Shard(2)"),
        ("Shard(1)", "Shard(1)"),
    ]:
        cells = [checks.owned_cells(r) for r in debug.ownership(shape, placements, (2, 2)).values()]
        assert sum(len(c) for c in cells) == 2 * 8 * 4 * 2  # disjoint and complete
        assert set().union(*cells) == checks.owned_cells([(0, n) for n in shape])
    text = debug.describe_placements(2, 2, 2, 8, 4, 16, [Shard(0), Shard(1)])
    assert "rank 3 (dp=1, sp=1): q[1:2, 4:8, 0:4, 0:16]  local shape [1, 4, 4, 16]" in text


PLACEMENT_CASES = [
    dict(dp=2, sp=2, shape=(2, 8, 4, 2), placements=[Shard(0), Shard(1)]),
    dict(dp=2, sp=2, shape=(2, 8, 4, 2), placements=[Shard(0), Shard(2)]),
    dict(dp=2, sp=2, shape=(2, 8, 4, 2), placements=[Replicate(), Shard(1)]),
    dict(dp=2, sp=2, shape=(2, 8, 4, 2), placements=[Shard(3), Replicate()]),
    dict(dp=2, sp=2, shape=(3, 5, 4, 2), placements=[Shard(1), Shard(1)]),  # nested and uneven
    dict(dp=2, sp=2, shape=(3, 7, 3, 1), placements=[Shard(0), Shard(2)]),  # uneven batch, heads
    dict(dp=1, sp=4, shape=(1, 5, 4, 2), placements=[Shard(0), Shard(1)]),  # an empty shard
    dict(dp=4, sp=1, shape=(4, 6, 2, 1), placements=[Shard(0), Shard(1)]),
]


@pytest.mark.timeout(300)
def test_ownership_equals_distribute_tensor_on_4_ranks():
    nb = notebook_functions("01_mesh_and_placements")
    per_rank = run_on_ranks(nb["where_cells_land"], 4, PLACEMENT_CASES)
    assert checks.placement_mismatches(PLACEMENT_CASES, per_rank) == []
    for i, case in enumerate(PLACEMENT_CASES):
        own = debug.ownership(case["shape"], case["placements"], (case["dp"], case["sp"]))
        for rank in range(4):
            assert per_rank[rank][i]["local_shape"] == [hi - lo for lo, hi in own[rank]]
            assert f"*rank {rank}:" in per_rank[rank][i]["describe"]  # debug.describe on a DTensor


# ----------------------------------------------------------------------------------------------
# the all-to-all plan and closed form
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("S", "N", "sp"), [(16, 8, 4), (12, 6, 3), (8, 4, 1), (10, 5, 4)])
def test_a2a_plan_chunks_tile_both_layouts(S, N, sp):
    s2h = debug.a2a_plan(S, N, sp, B=2, H=3, elem_bytes=4)
    h2s = debug.a2a_plan(S, N, sp, "head_to_seq", B=2, H=3, elem_bytes=4)
    cells = [checks.owned_cells([c.tokens, c.heads]) for c in s2h]  # every cell exactly once
    assert sum(len(c) for c in cells) == S * N
    m1, m2 = debug.send_matrix(s2h, sp), debug.send_matrix(h2s, sp)
    assert m2 == [list(row) for row in zip(*m1)]  # head_to_seq is the transpose
    toks = debug.token_ranges(S, sp)
    for r in range(sp):  # a rank's seq_to_head buffer is its whole local tensor
        assert sum(m1[r]) == 2 * (toks[r][1] - toks[r][0]) * N * 3 * 4


def test_kv_plan_agrees_with_library_and_simulator():
    import dtensor_ulysses as du
    from simulations.comm import kv_heads_after_replication

    for n_q in (4, 6, 8, 12, 16, 32):
        for n_kv in (k for k in (1, 2, 3, 4, 8) if n_q % k == 0):
            for sp in range(1, min(n_q, 8) + 1):  # uneven head splits included
                plan = debug.kv_plan(n_q, n_kv, sp)
                flat = [h for r in plan for h in r["kv_heads"]]
                index = du.kv_head_index(n_q, n_kv, sp)
                assert flat == (list(range(n_kv)) if index is None else index)
                assert len(flat) == kv_heads_after_replication(n_q, n_kv, sp)
                group = n_q // n_kv
                for r in plan:  # every q head finds its kv head on its rank
                    assert {q // group for q in r["q_heads"]} <= set(r["kv_heads"])


def test_closed_form_equals_simulator_per_layer():
    from dtensor_ulysses.plan import ModelShape
    from simulations import predict

    for N, K, H, sp, S in [(8, 2, 8, 4, 64), (32, 8, 128, 8, 4096), (8, 8, 16, 2, 32)]:
        shape = ModelShape("probe", 1, N * H, N, K, H, ffn_dim=8, vocab_size=8)
        p = predict(shape, S, sp=sp, dtype="fp32", ac="none")
        for rank in range(sp):  # even splits: every rank moves the same
            cf = debug.ulysses_closed_form(1, S, N, K, H, sp, elem_bytes=4, rank=rank)
            assert p.comm.per_layer["forward"]["all_to_all"] == cf["forward"]["bytes"]
            assert p.comm.per_layer["backward"]["all_to_all"] == cf["backward"]["bytes"]
            assert cf["forward"]["bytes"] == cf["backward"]["bytes"]


def _case(dp, sp, S, N, K, H, B=None):
    return dict(dp=dp, sp=sp, B=B or dp, S=S, N=N, K=K, H=H)


ROUND_TRIP_CASES = [
    _case(dp=1, sp=4, S=16, N=8, K=2, H=8),  # GQA, kv heads replicated (K' = 4)
    _case(dp=1, sp=4, S=8, N=8, K=1, H=4),  # MQA
    _case(dp=1, sp=4, S=8, N=8, K=4, H=4),  # sp divides K: plain shard
    _case(dp=2, sp=2, S=16, N=8, K=8, H=8),  # 2-D mesh, MHA
    _case(dp=2, sp=2, B=4, S=8, N=4, K=2, H=2),  # 2 sequences per dp rank
    _case(dp=4, sp=1, S=8, N=4, K=2, H=2),  # no sp: nothing moves
]


@pytest.mark.timeout(300)
def test_round_trip_plan_and_bytes_equal_comm_counter():
    nb = notebook_functions("02_ulysses_all_to_all")
    per_rank = run_on_ranks(nb["ulysses_on_each_rank"], 4, ROUND_TRIP_CASES)
    for i, case in enumerate(ROUND_TRIP_CASES):
        rows = [r[i] for r in per_rank]
        report, problems = checks.round_trip_report(rows, case)
        assert problems == [], report
        for row in rows:
            assert row["round_trip_exact"]
            assert row["max_abs_err"] < 1e-5
            assert row["placements"]["inside"] == (row["placements"]["before"][0], Shard(2))
    # the plotted stages are the observed ones
    rows = [r[0] for r in per_rank]
    observed = checks.cells_by_stage(rows, ROUND_TRIP_CASES[0])
    planned = checks.stage_cells(16, 8, 4)
    for stage, by_rank in planned.items():
        assert {r: set(c) for r, c in observed[stage].items()} == by_rank


# ----------------------------------------------------------------------------------------------
# memory: the real model vs the simulator
# ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_measured_activations_match_simulator_and_scale_with_sp():
    from simulations.report import predicted_block_activations

    nb = notebook_functions("03_memory_scaling")
    per_rank = run_on_ranks(nb["saved_activations"], 2, [(2, 1), (1, 2)], [128, 512])
    assert per_rank[0] == per_rank[1]
    rows = per_rank[0]
    for r in rows:
        pred = predicted_block_activations("tiny", r["seq_len"], r["dp"], r["sp"])
        assert 0.9 < r["blocks_bytes"] / pred < 1.1, (r, pred)
        assert r["other_bytes"] > 0
    by = {(r["sp"], r["seq_len"]): r["blocks_bytes"] for r in rows}
    for S in (128, 512):
        assert 1.8 < by[1, S] / by[2, S] <= 2.0
    assert by[1, 512] == 4 * by[1, 128]  # linear in tokens


# ----------------------------------------------------------------------------------------------
# simulator reports
# ----------------------------------------------------------------------------------------------
def test_memory_groups_add_up_to_the_peak():
    from simulations import predict, report

    p = predict("llama3-8b", 32768, dp=2, sp=4, gpu="h100")
    groups = report.memory_groups(p.memory.components)
    assert set(groups) == set(report.MEMORY_GROUPS)
    assert sum(groups.values()) == pytest.approx(p.memory.peak)
    assert report.memory_groups({"new_component": 5.0, "peak": 9.0})["other"] == 5.0


def test_memory_sweep_and_walls():
    from simulations import report

    rows = report.memory_sweep("llama3-8b", "h100", 8, seq_lens=[8192, 65536])
    assert {r["sp"] for r in rows} == {1, 2, 4, 8}
    for r in rows:
        assert r["dp"] * r["sp"] == 8
        assert sum(r["groups"].values()) == pytest.approx(r["peak"])
    walls = report.oom_walls("llama3-8b", "h100", 8)
    assert list(walls) == [1, 2, 4, 8]
    assert all(walls[a] < walls[b] for a, b in [(1, 2), (2, 4), (4, 8)])
    for sp, n in walls.items():  # the wall is where the peak crosses the capacity
        fits = report.memory_sweep("llama3-8b", "h100", 8, seq_lens=[n], sps=[sp])
        assert fits[0]["fits"]


def test_attention_comm_counts_only_the_attention_collectives():
    from simulations import predict, report

    p = predict("llama3-8b", 131072, sp=8, gpu="h100", attention="ulysses")
    a = report.attention_comm(p)
    assert a["bytes"] == p.comm.bytes_by_kind["all_to_all"]
    assert a["wire_bytes"] == pytest.approx(a["bytes"] * 7 / 8)
    assert a["time_s"] > 0
    ring = predict("llama3-8b", 131072, sp=8, gpu="h100", attention="ring")
    assert report.attention_comm(ring)["bytes"] == ring.comm.bytes_by_kind["p2p"] > 0
    table = report.methods_table("llama3-8b", 131072, 8, "h100")
    assert all(m in table for m in ("ulysses", "ring", "megatron-sp", "usp"))
    assert "recommendation: dp=" in report.plan_report("llama3-8b", 8, "h100")


def test_loss_agreement_and_torchrun_command():
    runs = {
        "a": [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}],
        "b": [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.1}],
    }
    assert checks.loss_agreement(runs) == {"b": pytest.approx(0.1)}
    cmd = torchrun_command(2, 2, seq_len=64, metrics_file="m.jsonl")
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    tail = " ".join(cmd[4:])
    assert "--nproc-per-node 4 -m dtensor_ulysses.train --dp 2 --sp 2" in tail
    assert tail.endswith("--seq-len 64 --batch-size 4 --steps 10 --seed 0 --metrics-file m.jsonl")


# ----------------------------------------------------------------------------------------------
# figures and widgets
# ----------------------------------------------------------------------------------------------
MEASURED = [
    {
        "dp": d,
        "sp": s,
        "seq_len": S,
        "local_tokens": S // s,
        "blocks_bytes": 10 * S // s,
        "other_bytes": S,
    }
    for d, s in [(2, 1), (1, 2)]
    for S in (128, 256)
]
TRAINING = {
    "x": [{"step": i, "loss": 3.0 - i / 10, "tokens_per_s": 100.0 + i} for i in range(1, 4)],
    "y": [{"step": i, "loss": 3.0 - i / 10, "tokens_per_s": 90.0 + i} for i in range(1, 4)],
}
A2A_MEASURED = [{"forward": {"bytes": 3072}, "backward": {"bytes": 3072}}] * 4
PLOTS = {
    "mesh": lambda f, sf: f.plot_mesh(2, 4),
    "placements": lambda f, sf: f.plot_placements(2, 2, 3, 5, 4, "Shard(1)", "Shard(1)"),
    "round_trip": lambda f, sf: f.plot_round_trip(12, 6, 3),
    "a2a_bytes": lambda f, sf: f.plot_a2a_bytes(measured=A2A_MEASURED),
    "gqa": lambda f, sf: f.plot_gqa(8, 1, 8),
    "memory": lambda f, sf: sf.plot_memory_scaling("llama3-1b", "a100-80gb", 8, "none", True),
    "activation_check": lambda f, sf: sf.plot_activation_check(MEASURED),
    "comm": lambda f, sf: sf.plot_comm_methods(
        "llama3-8b",
        65536,
        16,
        "h100",
        kv_heads=2,
        intra_gbps=200.0,
        inter_gbps=25.0,
        gpus_per_node=4,
    ),  # fmt: skip
    "training": lambda f, sf: f.plot_training(TRAINING),
}


@pytest.mark.parametrize("name", list(PLOTS))
def test_plot_functions_render(name):
    pytest.importorskip("matplotlib")
    from tutorial import figures, sim_figures
    from tutorial.widgets import figure_png

    fig = PLOTS[name](figures, sim_figures)
    assert fig.axes
    png = figure_png(fig)
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    assert b"Software" not in png[:2000]  # no version tag: re-executing does not churn


def test_live_shows_the_default_figure_and_redraws_in_place(monkeypatch):
    pytest.importorskip("matplotlib")
    widgets = pytest.importorskip("ipywidgets")
    ipd = pytest.importorskip("IPython.display")
    from tutorial import figures
    from tutorial.widgets import live

    shown, updates = [], []

    class Handle:
        def update(self, obj):
            updates.append(obj)

    def fake_display(obj, raw=False, display_id=None):
        shown.append((obj, raw))
        return Handle() if display_id else None

    monkeypatch.setattr(ipd, "display", fake_display)
    boxes = []

    class HBox(widgets.HBox):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            boxes.append(self)

    monkeypatch.setattr(widgets, "HBox", HBox)
    calls = []

    def fn(dp: int = 2, sp: int = 2):
        calls.append((dp, sp))
        if dp * sp > 8:
            raise ValueError(f"dp * sp = {dp * sp} > 8")
        return figures.plot_mesh(dp, sp)

    live(fn, dp=(1, 4), sp=[1, 2, 4])
    assert calls == [(2, 2)]  # the defaults, rendered once
    bundle, raw = shown[0]
    assert raw and "application/vnd.jupyter.widget-view+json" in bundle
    assert "interactive controls for fn (dp, sp)" in bundle["text/plain"]
    assert isinstance(shown[1][0], ipd.Image)  # an ordinary image output
    dp_w, sp_w = boxes[0].children
    sp_w.value = 4
    assert calls[-1] == (2, 4) and isinstance(updates[-1], ipd.Image)
    dp_w.value = 4
    assert "dp * sp = 16 > 8" in updates[-1].data  # an error shows as text, nothing raises
    with pytest.raises(ValueError, match="no argument"):
        live(fn, tp=(1, 2))
