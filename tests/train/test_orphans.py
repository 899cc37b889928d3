"""Plain ``torchrun`` (no ``dtensor_ulysses.launch`` wrapper) cannot lose a run's work.

Four launches run at once, each a real torchrun job of 2 CPU ranks (gloo) training the tiny
model with checkpoints: SIGUSR1 to torchrun's pid (torchrun does not handle it and dies at once,
as when a scheduler warns the batch shell), SIGTERM to torchrun's pid (torchrun forwards it),
SIGKILL of torchrun (as the OOM killer does), and two torchrun agents (``--nnodes 2``, a c10d
rendezvous on localhost, one rank each) of which only the first gets SIGUSR1 (schedulers warn
only the batch shell's node). In every case: every rank stops after the same step, that step's
checkpoint is written, every rank's status is 75 (each records it: ``DTENSOR_ULYSSES_EXIT_DIR``),
no worker is left, and resuming gives the straight run's losses exactly.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtensor_ulysses.train.guard import EXIT_PREEMPTED
from tests.train.test_faults import ROOT, _cmd, _env, _run_all, _worker_pids
from tests.train.test_guard import COMMON, _gone, _losses, _wait_for_step, _written
from tests.train.test_train import _descendants

# how the job is launched, and what reaches the first torchrun
_CASES = {
    "usr1": ("standalone", signal.SIGUSR1),
    "term": ("standalone", signal.SIGTERM),
    "kill": ("standalone", signal.SIGKILL),
    "two_agents_usr1": ("two_agents", signal.SIGUSR1),
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agents_cmds(args: list[str]) -> list[list[str]]:
    rdzv = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{_port()}", f"--rdzv-id=orphans-{os.getpid()}"]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, "-m", "dtensor_ulysses.train"]
    return [[*cmd, *args], [*cmd, *args]]


@pytest.mark.timeout(600)
def test_plain_torchrun_stopped_or_killed_leaves_a_checkpoint_and_no_worker(tmp_path):
    procs: dict[str, list[subprocess.Popen]] = {}
    for case, (how, _) in _CASES.items():
        exits = tmp_path / f"{case}.exit"
        exits.mkdir()
        args = [*COMMON, "--steps", "1000", "--checkpoint-dir", str(tmp_path / case),
                "--metrics-file", str(tmp_path / f"{case}.jsonl")]  # fmt: skip
        env = _env(DTENSOR_ULYSSES_EXIT_DIR=str(exits))
        cmds = [_cmd(args)] if how == "standalone" else _agents_cmds(args)
        procs[case] = []
        for cmd in cmds:
            procs[case].append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE, text=True,
                                                start_new_session=True))  # fmt: skip
            if how == "two_agents":
                time.sleep(1.0)  # the first agent hosts the rendezvous
    workers: dict[str, list[int]] = {}
    try:
        deadline = time.monotonic() + 300
        for case, agents in procs.items():
            _wait_for_step(tmp_path / f"{case}.jsonl", agents[0], 2, deadline)
            workers[case] = [pid for a in agents for pid in _worker_pids(a.pid).values()]
            assert len(workers[case]) == 2, (case, workers[case])
            agents[0].send_signal(_CASES[case][1])  # the first torchrun only
        outs = {c: [a.communicate(timeout=200) for a in agents] for c, agents in procs.items()}
        deadline = time.monotonic() + 60
        while any(not _gone(p) for pids in workers.values() for p in pids):
            assert time.monotonic() < deadline, "workers still running 60 s after the stop"
            time.sleep(0.2)
    finally:
        for agents in procs.values():
            for a in agents:
                for pid in [a.pid, *_descendants(a.pid)]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        for pids in workers.values():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    stops, resume_jobs = {}, []
    for case, streams in outs.items():
        stderr = "\n".join(err for _, err in streams)
        label = f"{case}:\n{stderr[-4000:]}"
        m = re.search(r"^preempted: (.*): stopped after step (\d+) of 1000; checkpoint (\S+) "
                      r"written", stderr, re.M)  # fmt: skip
        assert m, label
        how, sig = _CASES[case]
        gone = m.group(1).startswith("a rank's launcher (torchrun) is gone")
        if sig == signal.SIGTERM:
            assert m.group(1) == "SIGTERM received", label
        elif how == "standalone":  # torchrun died at once: its workers saw their launcher go
            assert gone, label
        else:  # the second torchrun loses the rendezvous store the first one hosted and
            # SIGTERMs its worker; whichever a step boundary sees first is named
            assert gone or m.group(1) == "SIGTERM received", label
        stop = int(m.group(2))
        statuses = sorted((p.name, p.read_text()) for p in (tmp_path / f"{case}.exit").iterdir())
        assert statuses == [("rank0", str(EXIT_PREEMPTED)), ("rank1", str(EXIT_PREEMPTED))], (
            statuses, label)  # fmt: skip
        assert _written(tmp_path / case) == [f"step_{stop:08d}"], label
        assert sorted(_losses(tmp_path / f"{case}.jsonl")) == list(range(1, stop + 1)), label
        stops[case] = stop
        resume_jobs.append(([*COMMON, "--steps", str(stop + 2), "--resume", "--checkpoint-dir",
                             str(tmp_path / case), "--metrics-file",
                             str(tmp_path / f"{case}.b.jsonl")], _env()))  # fmt: skip
    straight = ([*COMMON, "--steps", str(max(stops.values()) + 2), "--metrics-file",
                 str(tmp_path / "a.jsonl")], _env())  # fmt: skip
    straight_res, *resumed = _run_all([straight, *resume_jobs])
    assert straight_res.returncode == 0, straight_res.stderr[-3000:]
    a = _losses(tmp_path / "a.jsonl")
    for (case, stop), res in zip(stops.items(), resumed):
        assert res.returncode == 0, (case, res.stderr[-3000:])
        got = {**_losses(tmp_path / f"{case}.jsonl"), **_losses(tmp_path / f"{case}.b.jsonl")}
        assert sorted(got) == list(range(1, stop + 3)), (case, sorted(got))
        assert got == {s: a[s] for s in got}, f"{case}: resumed losses differ from the straight run"


_STUBBORN = """
import signal, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a worker that does not stop on Ctrl-C
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_a_second_ctrl_c_to_the_launcher_kills_everything_and_says_so(tmp_path):
    """The first Ctrl-C is forwarded (torchrun then waits up to 600 s for the workers); a
    second one, later, kills torchrun and every worker at once, with one line saying so."""
    script = tmp_path / "stubborn.py"
    script.write_text(_STUBBORN)
    cmd = [sys.executable, "-m", "dtensor_ulysses.launch", "--standalone",
           "--nproc-per-node=1", str(script)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        cmdlines = {p: Path(f"/proc/{p}/cmdline").read_bytes() for p in _descendants(proc.pid)}
        [worker] = [p for p, c in cmdlines.items() if b"stubborn" in c and b"distributed" not in c]
        proc.send_signal(signal.SIGINT)
        time.sleep(2.0)
        assert proc.poll() is None and not _gone(worker), "the first Ctrl-C only forwards"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)  # a hang guard: torchrun alone waits 600 s
    finally:
        for pid in [proc.pid, *_descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert "launch: second interrupt: killing torchrun and its workers now" in stderr, stderr
    assert _gone(worker), "the worker outlived the second Ctrl-C"


def test_launch_help_says_what_it_adds_to_torchrun():
    res = subprocess.run([sys.executable, "-m", "dtensor_ulysses.launch", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stderr
    for needed in ("SIGUSR1", "600 s", "exit status", "75", "second Ctrl-C", "--resume"):
        assert needed in res.stdout, (needed, res.stdout)
