"""``with_ulysses`` under a plain ``torchrun``: the stops that lose work elsewhere end here after
the same step on every rank, saved through the Trainer's own checkpointing, and resume exactly.

Three real launches at once (2 CPU ranks, gloo, sp=2, ``tests/hf/stop_script.py``: a tiny Llama
under ``with_ulysses(transformers.Trainer)``, a constant learning rate, ``save_strategy="no"``),
each signalled once its step 2 is logged: torchrun SIGKILLed (its workers' launcher is gone),
SIGTERM to torchrun's process group (a scheduler), SIGINT to it (a terminal's Ctrl-C). Each: one
``preempted:`` line naming the stop and the step, ``output_dir/checkpoint-N`` of that step
(``trainer_state.json`` at step N), status 75 on every rank (recorded through
``DTENSOR_ULYSSES_EXIT_DIR``), no worker left, no step logged after N; then
``train(resume_from_checkpoint=...)`` to N + 2 gives the losses of one uninterrupted run,
bit for bit (the straight run and the resumes in one job). The stop costs one 4-byte
all-reduce per optimizer step (counted in that job's world of 2).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from dtensor_ulysses._exit import EXIT_PREEMPTED  # noqa: E402
from tests.processes import descendants, gone, kill_trees  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/hf/stop_script.py"
# what reaches the job: (the signal, to torchrun's pid or to its process group)
_STOPS = {
    "launcher_killed": (signal.SIGKILL, "pid"),
    "term_group": (signal.SIGTERM, "group"),
    "ctrl_c": (signal.SIGINT, "group"),
}
_NAMES = {
    "launcher_killed": "a rank's launcher (torchrun) is gone",
    "term_group": "SIGTERM received",
    "ctrl_c": "SIGINT (Ctrl-C) received",
}


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def _cmd(*runs: list) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           SCRIPT]  # fmt: skip
    for run in runs:
        cmd += ["--one-run", *map(str, run)]
    return cmd


def _workers(root_pid: int) -> list[int]:
    """The pids of the script's ranks below torchrun ``root_pid``."""
    out = []
    for pid in descendants(root_pid):
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if SCRIPT.encode() in cmdline and b"torch.distributed.run" not in cmdline:
                out.append(pid)
    return out


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.timeout(600)
def test_trainer_door_stops_after_the_same_step_with_its_checkpoint_and_resumes(tmp_path):
    procs, workers = {}, {}
    for case in _STOPS:
        exits = tmp_path / f"{case}.exit"
        exits.mkdir()
        cmd = _cmd([tmp_path / case, 1000, tmp_path / f"{case}.jsonl"])
        procs[case] = subprocess.Popen(cmd, cwd=ROOT, env=_env(DTENSOR_ULYSSES_EXIT_DIR=str(exits)),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        for case, proc in procs.items():
            losses = tmp_path / f"{case}.jsonl"
            while not (losses.is_file() and len(losses.read_text().splitlines()) >= 2):
                assert proc.poll() is None and time.monotonic() < deadline, (
                    case,
                    proc.communicate()[1][-3000:] if proc.poll() is not None else "slow",
                )
                time.sleep(0.05)
            workers[case] = _workers(proc.pid)
            assert len(workers[case]) == 2, (case, workers[case])
            sig, target = _STOPS[case]
            if target == "pid":
                proc.send_signal(sig)
            else:
                os.killpg(proc.pid, sig)  # start_new_session: torchrun leads its group
        outs = {case: proc.communicate(timeout=200) for case, proc in procs.items()}
        deadline = time.monotonic() + 90
        while any(not gone(p) for pids in workers.values() for p in pids):
            assert time.monotonic() < deadline, "workers still running 90 s after the stop"
            time.sleep(0.2)
    finally:
        kill_trees((proc.pid for proc in procs.values()),
                   also=(pid for pids in workers.values() for pid in pids))  # fmt: skip
    stops, resumes = {}, []
    for case, (_, stderr) in outs.items():
        label = f"{case}:\n{stderr[-4000:]}"
        lines = re.findall(r"^preempted: .*$", stderr, re.M)
        assert len(lines) == 1, label
        m = re.match(r"preempted: (.*): stopped after step (\d+) of 1000; the Trainer's "
                     r"checkpoint (\S+) is written: continue with trainer\.train\("
                     r"resume_from_checkpoint=", lines[0])  # fmt: skip
        assert m and m.group(1).startswith(_NAMES[case]), label
        stop = int(m.group(2))
        ck = tmp_path / case / f"checkpoint-{stop}"
        assert m.group(3) == str(ck), label
        assert sorted(p.name for p in (tmp_path / case).iterdir()) == [ck.name], label
        state = json.loads((ck / "trainer_state.json").read_text())
        assert state["global_step"] == stop, label
        statuses = sorted((p.name, p.read_text()) for p in (tmp_path / f"{case}.exit").iterdir())
        assert statuses == [("rank0", str(EXIT_PREEMPTED)), ("rank1", str(EXIT_PREEMPTED))], (
            statuses, label)  # fmt: skip
        assert sorted(_losses(tmp_path / f"{case}.jsonl")) == list(range(1, stop + 1)), label
        stops[case] = stop
        resumes.append([tmp_path / case, stop + 2, tmp_path / f"{case}.b.jsonl", ck])
    # one job: the straight run, then each resume, one after the other in the same processes;
    # first, what the stop callback issues at a step's end
    straight = [tmp_path / "straight", max(stops.values()) + 2, tmp_path / "a.jsonl"]
    comm = tmp_path / "stop_collectives"
    cmd = [*_cmd(straight, *resumes), "--stop-collectives", str(comm)]
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    _check_stop_collectives([json.loads(Path(f"{comm}.rank{r}").read_text()) for r in (0, 1)])
    a = _losses(tmp_path / "a.jsonl")
    for case, stop in stops.items():
        b = _losses(tmp_path / f"{case}.b.jsonl")
        assert sorted(b) == [stop + 1, stop + 2], (case, b)
        got = {**_losses(tmp_path / f"{case}.jsonl"), **b}
        assert got == {s: a[s] for s in got}, f"{case}: resumed losses differ from the straight run"


def _check_stop_collectives(ranks: list[dict]) -> None:
    """The callback at a step's end, in a world of 2: one all-reduce of one int32 on the world
    group, with or without a stop; SIGUSR1 on rank 1 alone stops both ranks at that step; the
    last step (the run ends anyway) issues none."""
    one = {"all_reduce": {"count": 1, "bytes": 4}}
    for rank, cases in enumerate(ranks):
        none, usr1, last = cases["none"], cases["usr1_on_rank1"], cases["last_step"]
        assert none["collectives"] == one and none["on_the_world"], (rank, cases)
        assert none["stop"] is None and none["flags"] == [False, False, False], (rank, none)
        assert usr1["collectives"] == one and usr1["on_the_world"], (rank, usr1)
        assert usr1["stop"] == "SIGUSR1" and usr1["step"] == 3, (rank, usr1)
        assert usr1["flags"] == [True, True, True], (rank, usr1)
        assert last["collectives"] == {} and last["stop"] is None, (rank, last)
