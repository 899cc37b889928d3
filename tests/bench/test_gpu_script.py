"""benchmarks/gpu.sh tells the truth: a CPU dry run of every step, and a failing step fails it."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu.sh"


def _env(**env: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DRY_RUN": "1", **env}


def _run(out: Path, *steps: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), str(out), *steps], cwd=ROOT, env=_env(**env),
                          capture_output=True, text=True, timeout=500)  # fmt: skip


def _start(out: Path, *steps: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(SCRIPT), str(out), *steps], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


STEPS = ("env", "tests", "mfu", "long", "long4b", "a2a", "hf")


@pytest.mark.timeout(520)
def test_dry_run_executes_every_step_on_cpu(tmp_path):
    # with no STEP the script runs every step in order: seen through a stand-in Python that
    # prints what it is asked to run and succeeds (the torchrun launches of hf included)
    echo = tmp_path / "python_echo"
    echo.write_text('#!/usr/bin/env bash\necho "python $*"\n')
    echo.chmod(echo.stat().st_mode | stat.S_IEXEC)
    order = _run(tmp_path / "order", PYTHON=str(echo))
    assert order.returncode == 0, order.stdout + order.stderr
    heads = [x[3:] for x in order.stdout.splitlines() if x.startswith("== ")]
    want = [h for s in STEPS for h in ((f"{s} preflight", s) if s.startswith(("mfu", "long"))
                                       else (s,))]  # fmt: skip
    assert heads == [*want, "all steps passed"], order.stdout
    # every step for real, as two scripts side by side (each step writes its own files; the
    # multi-process steps a2a and hf beside the single-process ones, 2 cores)
    procs = [_start(tmp_path, *steps) for steps in (STEPS[:5], STEPS[5:])]
    try:
        outs = [p.communicate(timeout=500) for p in procs]
    finally:
        for p in procs:
            p.kill()
    res = subprocess.CompletedProcess(
        "gpu.sh", max(p.returncode for p in procs), "".join(o for o, _ in outs),
        "".join(e for _, e in outs),
    )  # fmt: skip
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    for step in STEPS:
        assert f"== {step}\n" in res.stdout, log[-4000:]
    assert "!! failed" not in res.stdout
    # the real shapes of the GPU steps, through the trainer's preflight on one H100
    for step, shape in (("mfu", "llama3-1b S=8192"), ("long", "llama3-1b S=131072"),
                        ("long4b", "qwen3-4b S=65536")):  # fmt: skip
        assert f"== {step} preflight\npreflight {shape} on h100 + 120 GiB of host: " in res.stdout
    assert "REFUSED" not in res.stdout
    for name, n_rows in (("bench_mfu_gpu.json", 2), ("bench_long_context_gpu.json", 1),
                         ("bench_long_context_4b_gpu.json", 1)):  # fmt: skip
        rows = json.loads((tmp_path / name).read_text())["rows"]
        assert len(rows) == n_rows and all("error" not in r["measured"] for r in rows), name
    assert "flash_attn" in (tmp_path / "gpu_environment.txt").read_text()
    # the examples/ scripts: with_ulysses in SFTTrainer, Trainer and GRPOTrainer, each trained to
    # the end
    assert (tmp_path / "gpu_hf.txt").read_text().count("'train_loss'") == 3, log[-4000:]


@pytest.mark.timeout(120)
def test_a_failing_step_inside_a_pipe_fails_the_script(tmp_path):
    """A Python whose pytest fails: the tests step (piped through tee) is reported failed, the
    next step still runs, the script exits 1."""
    fake = tmp_path / "python_failing_pytest"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$1" = "-m" ] && [ "$2" = "pytest" ]; then echo boom; exit 3; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    res = _run(tmp_path / "out", "tests", "env", PYTHON=str(fake))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "!! failed" in res.stdout and "== env" in res.stdout
    assert "boom" in (tmp_path / "out" / "gpu_tests.txt").read_text()
    ok = _run(tmp_path / "ok", "env")
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_preflight_only_refuses_llama3_8b_on_one_gpu_with_128_gib_of_host(capsys):
    """The check the dry run makes of the real shapes: llama3-8b's AdamW states, 16 bytes a
    parameter (119.7 GiB), do not fit 90% of 128 GiB of host (the old long8b step); the row
    says the host binds, and the rows that fail are reported."""
    from benchmarks import bench_long_context as b

    argv = ["--models", "llama3-8b", "qwen3-4b", "--features", "all", "--seq-lens", "32768",
            "--preflight-only", "--gpu", "h100", "--host-memory", "128"]  # fmt: skip
    result = b.main(argv)
    eight, four = result["rows"]
    assert not eight["fits"] and "host memory is the limit" in eight["error"], eight
    assert eight["host_bytes"] > 119 * 2**30 and four["fits"], result
    assert b.failed_rows(result) == [eight]
    assert "REFUSED (host memory is the limit" in capsys.readouterr().out


def test_bench_long_context_exits_nonzero_and_keeps_rows_when_a_row_fails(tmp_path):
    """Two rows on a CUDA device this machine lacks: both fail, both are in the JSON, exit 1."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA (the rows must fail)")
    out = tmp_path / "rows.json"
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_long_context", "--models", "tiny",
         "--seq-lens", "64", "128", "--steps", "1", "--device", "cuda", "--json", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=100,
    )  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["seq_len"] for r in rows] == [64, 128] and all("error" in r["measured"] for r in rows)
