"""The trainer fails early, clearly and safely: damaged and interrupted checkpoints, bad input.

Damaged checkpoints (each kind of file) make ``--resume`` fall back to the newest intact one, or
stop with one ``error:`` line naming the damaged path; a rank killed by SIGKILL in the middle of
a checkpoint write leaves a run that resumes; ``--keep-last`` prunes only after a newer
checkpoint is complete; bad devices, kernels and data files are refused before anything is
built. (The memory preflight's refusals are in ``tests/plan/test_preflight.py``.) Each torchrun
job is a real one (2 CPU processes) with a timeout; the in-process checks need no process group.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dtensor_ulysses.train import checkpoint as ckpt
from tests.processes import descendants, kill_trees

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--seq-len", "64", "--batch-size", "2"]


def _cmd(args: list[str], nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "dtensor_ulysses.train", *args]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    """The test's environment without capacity overrides (unless given), one thread a rank."""
    env = {k: v for k, v in os.environ.items() if "MEMORY_CAPACITY" not in k}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _run_all(jobs: list[tuple[list[str], dict]], timeout: float = 240) -> list:
    """Start every torchrun job at once; wait for all. Returns CompletedProcess-like tuples."""
    procs = []
    for args, env in jobs:
        procs.append(subprocess.Popen(_cmd(args), cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    out = []
    for (args, _), proc in zip(jobs, procs):
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"{args}: still running after {timeout} s (a hang)")
        out.append(subprocess.CompletedProcess(args, proc.returncode, stdout, stderr))
    return out


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning: ")]


# ----------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def three_checkpoints(tmp_path_factory) -> Path:
    """A run of 3 steps checkpointing every step and keeping the last 2: step 2 and step 3."""
    ck = tmp_path_factory.mktemp("faults") / "ck"
    [res] = _run_all([([*TINY, "--steps", "3", "--checkpoint-every", "1", "--keep-last", "2",
                        "--checkpoint-dir", str(ck)], _env())])  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    written = re.findall(r"^checkpoint step (\d+) written to (\S+)", res.stdout, re.M)
    assert [int(s) for s, _ in written] == [1, 2, 3], res.stdout[-2000:]
    assert "pack-docs off" in res.stdout, "the header says whether packing is on"
    last = res.stdout.strip().splitlines()[-1]  # the closing line: what was written where
    assert re.fullmatch(rf"done: steps 0->3 in \d+ s \| last loss \d+\.\d{{4}} \| checkpoint "
                        rf"{ck / 'step_00000003'} \(continue with --resume and a larger "
                        rf"--steps\)", last), last  # fmt: skip
    return ck


def test_keep_last_prunes_after_the_newer_checkpoint_is_complete(three_checkpoints):
    names = sorted(p.name for p in three_checkpoints.iterdir())
    assert names == ["step_00000002", "step_00000003"], names
    for p in three_checkpoints.iterdir():
        assert ckpt.verify(p) is None, p


def _damage(step_dir: Path, kind: str) -> Path:
    """Truncate one file of a checkpoint to half its size; returns the file."""
    target = {
        "distcp": sorted(step_dir.glob("*.distcp"))[-1],
        "trainer": step_dir / "trainer.pt",
        "metadata": step_dir / ".metadata",
    }[kind]
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2])
    return target


@pytest.mark.timeout(400)
def test_damaged_newest_checkpoint_falls_back_or_stops(three_checkpoints, tmp_path):
    """Each kind of file truncated in the newest checkpoint: resume from the older one, with a
    warning naming both. Every checkpoint damaged: one error line naming the newest."""
    jobs, dirs = [], {}
    for kind in ("distcp", "trainer", "metadata"):
        ck = tmp_path / kind
        shutil.copytree(three_checkpoints, ck)
        _damage(ck / "step_00000003", kind)
        assert ckpt.verify(ck / "step_00000003") is not None, kind
        dirs[kind] = ck
        jobs.append(([*TINY, "--steps", "4", "--resume", "--checkpoint-dir", str(ck)], _env()))
    none_ok = tmp_path / "none"
    shutil.copytree(three_checkpoints, none_ok)
    _damage(none_ok / "step_00000003", "metadata")
    _damage(none_ok / "step_00000002", "distcp")
    jobs.append(([*TINY, "--steps", "4", "--resume", "--checkpoint-dir", str(none_ok)], _env()))
    results = _run_all(jobs)
    for kind, res in zip(dirs, results):
        label = f"{kind}: rc={res.returncode}\n{res.stderr[-3000:]}"
        assert res.returncode == 0, label
        bad, good = dirs[kind] / "step_00000003", dirs[kind] / "step_00000002"
        [warning] = _warnings(res.stderr)
        assert str(bad) in warning and str(good) in warning, label
        assert f"resumed from {good}" in res.stdout, res.stdout[-2000:]
        assert re.search(r"^step 3/4 \| loss", res.stdout, re.M), res.stdout[-2000:]
        assert "dtensor_ulysses/" not in res.stderr, label
    res = results[-1]
    label = f"none intact: rc={res.returncode}\n{res.stderr[-3000:]}"
    assert res.returncode != 0, label
    [error] = _errors(res.stderr)
    assert str(none_ok / "step_00000003") in error and "damaged" in error, label
    assert "dtensor_ulysses/" not in res.stderr, label


def _worker_pids(root_pid: int) -> dict[int, int]:
    """rank -> pid of the torchrun workers below ``root_pid`` (from their environment)."""
    out = {}
    for pid in descendants(root_pid):
        with contextlib.suppress(OSError):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"dtensor_ulysses.train" not in cmdline or b"torch.distributed.run" in cmdline:
                continue
            for item in env:
                if item.startswith(b"RANK="):
                    out[int(item[5:])] = pid
    return out


@pytest.mark.timeout(300)
def test_kill_a_rank_during_a_checkpoint_write_then_resume(tmp_path):
    """SIGKILL rank 1 while a checkpoint is being written (its ``.tmp`` directory exists):
    torchrun stops the job, the half-written checkpoint is ignored, and --resume continues from
    the newest complete one."""
    if not Path("/proc/self/environ").exists():
        pytest.skip("needs /proc")
    ck = tmp_path / "ck"
    args = [*TINY, "--steps", "100000", "--checkpoint-every", "1", "--checkpoint-dir", str(ck)]
    proc = subprocess.Popen(_cmd(args), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        workers: dict[int, int] = {}
        killed_during = None
        while killed_during is None:
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint write seen"
            if len(workers) < 2:
                workers = _worker_pids(proc.pid)
            tmps = list(ck.glob("step_*.tmp")) if ck.is_dir() else []
            done = list(ck.glob("step_????????")) if ck.is_dir() else []
            if tmps and done and 1 in workers:
                os.kill(workers[1], signal.SIGKILL)
                killed_during = tmps[0]
            time.sleep(0.002)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode != 0, "torchrun must fail when a worker is killed"
        # torchrun's summary names the rank and the signal; the rank's note, its peak memory
        assert re.search(r"rank\s*: 1 .*\n.*exitcode\s*: -9 .*SIGKILL", stderr), stderr[-3000:]
        assert re.search(r"rank 1 \(pid \d+\) had finished step \d+ of 100000, peak memory "
                         r"[\d.]+ [KMG]iB", stderr), stderr[-3000:]  # fmt: skip
    finally:
        kill_trees([proc.pid])
    complete = sorted(p.name for p in ck.iterdir() if not p.name.endswith(".tmp"))
    last = int(complete[-1].removeprefix("step_"))
    [res] = _run_all([([*TINY, "--steps", str(last + 1), "--resume", "--checkpoint-dir",
                        str(ck)], _env())])  # fmt: skip
    assert res.returncode == 0, f"killed during {killed_during.name}\n{res.stderr[-3000:]}"
    assert f"resumed from {ck / complete[-1]}" in res.stdout, res.stdout[-2000:]
    assert not list(ck.glob("step_*.tmp")), "the next save clears older half-written ones"


def _tiny_checkpoint(path: Path) -> Path:
    """A complete one-process checkpoint of the tiny model (no process group needed)."""
    from dtensor_ulysses.models import build_model

    model = build_model("tiny", device="cpu")
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long), torch.arange(8)[None]).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.warns(UserWarning):  # DCP: "assuming the intent is to save in a single process"
        return ckpt.save(path, 7, model, opt, sched, {"seed": 0})


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_verify_names_what_is_wrong(tmp_path):
    good = _tiny_checkpoint(tmp_path / "ck")
    assert ckpt.verify(good) is None
    cases = {
        "distcp": "truncated",
        "trainer": "trainer.pt cannot be read",
        "metadata": ".metadata cannot be read",
    }
    for kind, want in cases.items():
        bad = tmp_path / kind / good.name
        shutil.copytree(good, bad)
        _damage(bad, kind)
        problem = ckpt.verify(bad)
        assert problem is not None and want in problem, (kind, problem)
    missing = tmp_path / "missing" / good.name
    shutil.copytree(good, missing)
    (missing / ".metadata").unlink()
    assert "missing" in (ckpt.verify(missing) or "")
    # newest damaged, older intact: the older is chosen and the newer reported
    both = tmp_path / "both"
    shutil.copytree(good, both / "step_00000007")
    newer = both / "step_00000009"
    shutil.copytree(good, newer)
    trainer = torch.load(newer / "trainer.pt", weights_only=False)
    torch.save(dict(trainer, step=9), newer / "trainer.pt")
    _damage(newer, "distcp")
    path, damaged = ckpt.select_resume(both)
    assert path == both / "step_00000007"
    assert [p for p, _ in damaged] == [newer]


@pytest.mark.timeout(400)
def test_a_full_disk_while_checkpointing_gives_one_error_and_resumes(tmp_path):
    """A checkpoint write that fails as on a full disk (ENOSPC, injected on rank 1 only by the
    test hook): every rank stops with status 74 and one ``error:`` line naming the failed
    checkpoint, the newest intact one and the fix; no partial checkpoint is left, and
    ``--resume`` continues from the intact one. When the disk is full from the start (the
    final checkpoint lost), ``--resume`` fails with one line."""
    mid, start = tmp_path / "mid", tmp_path / "start"
    jobs = [
        ([*TINY, "--steps", "3", "--checkpoint-every", "1", "--checkpoint-dir", str(mid)],
         _env(**{ckpt.ENOSPC_HOOK_ENV: "2"})),
        ([*TINY, "--steps", "1", "--checkpoint-dir", str(start)],
         _env(**{ckpt.ENOSPC_HOOK_ENV: "1"})),
    ]  # fmt: skip
    results = _run_all(jobs)
    for ck, step, res in zip((mid, start), (2, 1), results):
        label = f"{ck.name}: rc={res.returncode}\n{res.stderr[-3000:]}"
        assert res.returncode != 0 and re.search(r"exitcode\s*: 74 ", res.stderr), label
        [error] = _errors(res.stderr)
        assert f"checkpoint step {step} could not be written to {ck / f'step_{step:08d}'} " \
            "(rank 1: No space left on device" in error, label  # fmt: skip
        assert "Free space under" in error, label
        assert "Traceback" not in res.stderr.split("error: ")[0], label
        assert "CheckpointException" not in res.stderr, label
    assert "newest intact checkpoint is " + str(mid / "step_00000001") in _errors(
        results[0].stderr)[0]  # fmt: skip
    assert "no intact checkpoint is left" in _errors(results[1].stderr)[0]
    assert sorted(p.name for p in mid.iterdir()) == ["step_00000001"], "a partial one is left"
    assert sorted(start.iterdir()) == []
    resumed, none = _run_all([
        ([*TINY, "--steps", "3", "--resume", "--checkpoint-dir", str(mid)], _env()),
        ([*TINY, "--steps", "1", "--resume", "--checkpoint-dir", str(start)], _env()),
    ])  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {mid / 'step_00000001'}" in resumed.stdout, resumed.stdout[-2000:]
    [error] = _errors(none.stderr)
    assert none.returncode != 0 and "--resume: no checkpoint in" in error, none.stderr[-2000:]
    assert "dtensor_ulysses/" not in none.stderr, none.stderr[-2000:]


def _reseal(step_dir: Path) -> None:
    """Rewrite the checkpoint's manifest to match its files as they are now."""
    from dtensor_ulysses.train import manifest

    manifest.write(step_dir, manifest.checksum(step_dir, manifest.files_of(step_dir)))


class _Payload:
    """Unpickling this runs ``os.makedirs(marker)``: what a planted payload would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_payload_planted_in_a_checkpoint_never_runs(tmp_path, capsys):
    """A pickled payload planted in ``trainer.pt``, in ``rng_rank0.pt`` and in DCP's
    ``.metadata``: verifying, choosing and loading the checkpoint never runs it; the checkpoint
    is damaged (named with the file) and ``--resume`` falls back to the older intact one."""
    import pickle

    from dtensor_ulysses.models import build_model
    from dtensor_ulysses.train.resume import select_checkpoint

    good = _tiny_checkpoint(tmp_path / "good")
    trainer = ckpt.read_meta(good)
    marker = tmp_path / "payload-ran"
    for name in ("trainer.pt", "rng_rank0.pt", ".metadata"):
        root = tmp_path / name
        shutil.copytree(good, root / "step_00000007")
        bad = root / "step_00000009"
        shutil.copytree(good, bad)
        torch.save(dict(trainer, step=9), bad / "trainer.pt")
        if name == "trainer.pt":
            torch.save(dict(trainer, step=9, meta={"seed": _Payload(marker)}), bad / name)
        elif name == "rng_rank0.pt":
            torch.save({"cpu": torch.get_rng_state(), "x": _Payload(marker)}, bad / name)
        else:
            metadata = ckpt.read_dcp_metadata(bad)
            metadata.planner_data = _Payload(marker)
            (bad / name).write_bytes(pickle.dumps(metadata))
        _reseal(bad)  # a planted file comes with a matching manifest (a CRC is no signature)
        problem = ckpt.verify(bad)
        assert problem is not None and problem.startswith(name), (name, problem)
        assert "os.makedirs" in problem or "makedirs" in problem, (name, problem)
        assert select_checkpoint(str(root)) == root / "step_00000007", name
        warning = capsys.readouterr().err
        assert f"checkpoint {bad} is damaged ({name}" in warning, warning
        model = build_model("tiny", device="cpu")
        opt = torch.optim.AdamW(model.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        with pytest.raises(ckpt.DamagedCheckpoint, match="makedirs"):
            ckpt.load(bad, model, opt, sched)
        assert ckpt.load(root / "step_00000007", model, opt, sched)["step"] == 7
        assert not marker.exists(), f"the payload in {name} ran"


# ----------------------------------------------------------------------------------------------
# bad input up front
# ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(400)
def test_bad_devices_kernels_and_data_each_give_one_error(tmp_path):
    binary = tmp_path / "program.bin"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 cr\u00e8me br\u00fbl\u00e9e ".encode("latin-1") * 20)
    cases = [
        (["--data", str(binary)], r"program\.bin' is binary \(a NUL byte at offset 7\)"),
        (["--data", str(latin1)], r"latin1\.txt' is not UTF-8 text \(byte 3"),
        (["--attention-backend", "flash_attn"], r"flash_attn"),
        (["--keep-last", "0"], r"--keep-last 0 must be >= 1"),
        (["--no-such-option"], r"unrecognized arguments: --no-such-option"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], r"--device cuda: "))
    results = _run_all([([*TINY, *args, "--steps", "1"], _env()) for args, _ in cases])
    for (args, pattern), res in zip(cases, results):
        label = f"{args}: rc={res.returncode}\n{res.stderr[-2000:]}"
        assert res.returncode != 0, label
        errors = _errors(res.stderr)
        assert len(errors) == 1, f"expected one message from rank 0; {label}"
        assert re.search(pattern, errors[0]), label
        assert "dtensor_ulysses/" not in res.stderr, f"a worker traceback leaked; {label}"
        assert "step 1/1" not in res.stdout, f"it trained; {label}"


@pytest.mark.timeout(120)
def test_usage_error_exits_2_without_torchrun():
    """A world of one (plain ``python -m``): the process's own status, 2."""
    cmd = [sys.executable, "-m", "dtensor_ulysses.train", "--keep-last", "-1"]
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=100)
    assert res.returncode == 2, res.stderr[-2000:]
    assert _errors(res.stderr) == ["error: --keep-last -1 must be >= 1 (omit it to keep all)"]


def test_help_shows_every_default_once(capsys):
    from dtensor_ulysses.train import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert not re.search(r"\(default: [^)]*\) \(default:", text), text
    assert "(default: None)" not in text
    for option, default in [("--seed SEED", "0"), ("--lr LR", "0.001"), ("--steps STEPS", "40"),
                            ("--warmup-steps WARMUP_STEPS", "10"),
                            ("--head-chunks HEAD_CHUNKS", "1")]:  # fmt: skip
        block = text.split(option, 2)[-1].split(" --", 1)[0]
        assert f"(default: {default})" in block, (option, block)
