"""Smoke test of benchmarks/bench_checkpoint.py at a toy size (a 10 MiB checkpoint)."""

from __future__ import annotations

import json

from benchmarks import bench_checkpoint


def test_bench_checkpoint_toy(tmp_path):
    out = tmp_path / "bench.json"
    bench_checkpoint.main(["--gib", "0.01", "--repeats", "1", "--dir", str(tmp_path),
                           "--json", str(out)])  # fmt: skip
    [row] = json.loads(out.read_text())["rows"]
    assert 0.01 <= row["bytes"] / 2**30 < 0.02 and row["requested_gib"] == 0.01, row
    assert 0 < row["manifest_checksum_s"] < row["save_s"], row
    assert 0 < row["verify_s"] < row["load_s"], row
    assert list(tmp_path.iterdir()) == [out], "the benchmark leaves its checkpoint behind"
