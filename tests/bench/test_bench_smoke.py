"""Smoke test of benchmarks/bench_ulysses.py at a toy size (world size 2, S=64; a few seconds).

Runs the benchmark's ``main`` exactly as the command line would and checks the JSON it writes:
every variant is there, timed (> 0 ms), with the same collectives and bytes on every rank, the
closed form holds where the all-to-all is ours, and the variants agree numerically.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_ulysses

ARGV = [
    "--world-sizes", "2", "--seq-len", "64", "--heads", "4", "--kv-heads", "4",
    "--gqa-kv-heads", "2", "--head-dim", "8", "--batch", "1", "--dtype", "float32",
    "--iters", "1", "--warmup", "1", "--timeout", "120",
]  # fmt: skip


@pytest.mark.timeout(180)
def test_bench_ulysses_toy(tmp_path):
    out = tmp_path / "bench.json"
    returned = bench_ulysses.main([*ARGV, "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["rows"] == json.loads(json.dumps(returned["rows"]))
    assert data["argv"][-2:] == ["--json", str(out)]
    assert {"torch", "python", "cpu_model", "cpu_count"} <= set(data["environment"])

    rows = data["rows"]
    mha = {r["variant"]: r for r in rows if r["K"] == 4}
    gqa = {r["variant"]: r for r in rows if r["K"] == 2}
    assert set(mha) == set(bench_ulysses.VARIANTS)
    assert set(gqa) == {"ulysses_fused", "ulysses_unfused"}
    for r in rows:
        where = f"{r['variant']} K={r['K']}"
        assert "skipped" not in r, where
        assert r["P"] == 2 and r["S"] == 64, where
        assert r["ms_fwd_bwd"] > 0 and all(t > 0 for t in r["ms_per_iter_max_over_ranks"]), where
        assert r["bytes_equal_across_ranks"], where
        assert r["bytes_per_rank_fwd"] > 0 and r["bytes_per_rank_bwd"] > 0, where
        assert r["equivalent"] and max(r["max_abs_diff_vs_reference"].values()) <= 1e-5, where
        if r["variant"] != "redistribute":  # DTensor's choice of collective depends on torch
            assert r["closed_form_ok"], (where, r["collectives_fwd"], r["closed_form_fwd"])
    # fused and unfused move the same bytes, in 2 vs 4 all-to-alls per direction
    for by in (mha, gqa):
        f, u = by["ulysses_fused"], by["ulysses_unfused"]
        assert f["bytes_per_rank_fwd"] == u["bytes_per_rank_fwd"]
        assert (f["a2a_count_fwd"], u["a2a_count_fwd"]) == (2, 4)
    assert data["all_equivalent"] and data["all_bytes_equal_across_ranks"]


@pytest.mark.timeout(180)
def test_bench_vs_deepspeed_toy(tmp_path):
    """The side-by-side benchmark at a toy size: our row is timed; DeepSpeed's is timed and equal
    to ours where it imports, and recorded as skipped (with the reason) where it does not."""
    from benchmarks import bench_vs_deepspeed

    out = tmp_path / "ds.json"
    argv = ["--world-sizes", "2", "--seq-lens", "64", "--heads", "4", "--head-dim", "8",
            "--iters", "1", "--json", str(out)]  # fmt: skip
    bench_vs_deepspeed.main(argv)
    [row] = json.loads(out.read_text())["rows"]
    assert min(row["ms"][n] for n in ("dtensor_ulysses", "kernel", "collectives")) > 0
    if "deepspeed" in row["ms"]:
        assert row["max_abs_diff"] <= 1e-5 and row["ratio"] > 0 and row["paired_ratio"] > 0
    else:
        assert row["deepspeed_problem"], row


@pytest.mark.timeout(240)
def test_bench_trainer_overhead_toy(tmp_path):
    """sp = 1 vs sp = 2 at equal tokens per rank: both timed, the FLOPs ratio from the model's
    formula (attention at twice the length), the JSON as printed."""
    from benchmarks import bench_trainer_overhead
    from dtensor_ulysses.models import model_flops_per_token

    out = tmp_path / "overhead.json"
    ret = bench_trainer_overhead.main(["--tokens", "64", "--steps", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["P"] for r in rows] == [1, 2] and [r["seq_len"] for r in rows] == [64, 128]
    assert all(r["ms_per_step"] > 0 for r in rows)
    flops = model_flops_per_token("tiny", 128) / model_flops_per_token("tiny", 64)
    assert rows[1]["flops_ratio"] == pytest.approx(flops) and flops > 1
    assert rows[1]["ratio"] == pytest.approx(rows[1]["ms_per_step"] / rows[0]["ms_per_step"])
    assert ret["rows"] == rows


@pytest.mark.timeout(240)
def test_bench_a2a_toy():
    """The exchange vs the backend's all-to-all on 2 gloo ranks: both timed, bytes as asked."""
    from benchmarks import bench_a2a

    rows = bench_a2a.main(
        ["--cpu-world", "2", "--sizes-mib", "0.25", "--iters", "1", "--warmup", "0"]
    )
    (r,) = rows
    assert r["P"] == 2 and r["ms_ulysses"] > 0 and r["ms_raw"] > 0
    assert r["tokens_per_rank"] * bench_a2a.HEADS * bench_a2a.HEAD_DIM * 4 == r["mib"] * 2**20
