"""Plain ``torchrun`` (no ``dtensor_ulysses.launch`` wrapper) cannot lose a run's work.

Six launches run at once, each a real torchrun job of 2 CPU ranks (gloo) training the tiny
model with checkpoints, signalled once step 2 is logged:

* SIGUSR1 and SIGTERM to the process group of ``torchrun ... | tee log`` (what ``scancel
  --signal`` and many schedulers do): ``tee`` dies with the group, so rank 0's stdout has no
  reader; torchrun dies at once on SIGUSR1 (it does not handle it: its workers see their
  launcher go) and forwards SIGTERM;
* SIGKILL of torchrun (as the OOM killer does);
* two torchrun agents (``--nnodes 2``, a c10d rendezvous on localhost, one rank each) of which
  only the first gets SIGUSR1 (schedulers warn only the batch shell's node);
* Ctrl-C: SIGINT to torchrun's group and to each worker (a terminal whose foreground group
  holds the workers too: every worker gets it twice, from the terminal and from torchrun);
* Ctrl-C twice: SIGINT to torchrun's group, and again 3 s later, while the ranks are held in
  the stop (the test hook ``DTENSOR_ULYSSES_TEST_SLOW_STOP_S``: a long checkpoint write).

In every case but the last: every rank stops after the same step, that step's checkpoint is
written, one ``preempted:`` line, every rank's status is 75 (each records it:
``DTENSOR_ULYSSES_EXIT_DIR``), no worker is left, and resuming gives the straight run's losses
exactly; a closed stdout costs nothing (one ``warning:`` line; the metrics file has every step).
Twice: every rank ends at once with status 130 without that checkpoint, and resuming from the
newest complete one gives the straight run's losses exactly.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtensor_ulysses._exit import EXIT_INTERRUPTED
from dtensor_ulysses.train.guard import EXIT_PREEMPTED, SLOW_STOP_ENV
from tests.processes import descendants, gone, kill_trees
from tests.train.test_faults import ROOT, _cmd, _env, _run_all, _worker_pids
from tests.train.test_guard import COMMON, _losses, _wait_for_step, _written

PIPE_JOB = str(Path(__file__).with_name("pipe_job.py"))
# how the job is launched, and what reaches it
_CASES = {
    "tee_usr1": ("tee", signal.SIGUSR1),
    "tee_term": ("tee", signal.SIGTERM),
    "kill": ("standalone", signal.SIGKILL),
    "two_agents_usr1": ("two_agents", signal.SIGUSR1),
    "ctrl_c": ("ctrl_c", signal.SIGINT),
    "ctrl_c_twice": ("ctrl_c_twice", signal.SIGINT),
}
SECOND_AFTER_S = 3.0  # the second Ctrl-C, this long after the first
HELD_S = 60  # how long the ranks are held in the stop, waiting for their checkpoint (test hook)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agents_cmds(args: list[str]) -> list[list[str]]:
    rdzv = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{_port()}", f"--rdzv-id=orphans-{os.getpid()}"]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, "-m", "dtensor_ulysses.train"]
    return [[*cmd, *args], [*cmd, *args]]


def _stop(case: str, agent: subprocess.Popen, workers: list[int]) -> float:
    """Send the case's stop to the job; returns when its last signal went."""
    how, sig = _CASES[case]
    if how in ("standalone", "two_agents"):
        agent.send_signal(sig)  # the first torchrun only
    else:
        os.killpg(agent.pid, sig)  # start_new_session: the job (and tee) lead their group
    if how == "ctrl_c":
        for pid in workers:
            os.kill(pid, sig)
    return time.monotonic()


@pytest.mark.timeout(600)
def test_plain_torchrun_stopped_or_killed_leaves_a_checkpoint_and_no_worker(tmp_path):
    procs: dict[str, list[subprocess.Popen]] = {}
    for case, (how, _) in _CASES.items():
        exits = tmp_path / f"{case}.exit"
        exits.mkdir()
        args = [*COMMON, "--steps", "1000", "--checkpoint-dir", str(tmp_path / case),
                "--metrics-file", str(tmp_path / f"{case}.jsonl")]  # fmt: skip
        extra = {}
        if how == "ctrl_c_twice":
            args += ["--checkpoint-every", "2"]
            extra[SLOW_STOP_ENV] = str(HELD_S)
        env = _env(DTENSOR_ULYSSES_EXIT_DIR=str(exits), **extra)
        cmds = [_cmd(args)] if how != "two_agents" else _agents_cmds(args)
        if how == "tee":
            cmds = [[sys.executable, PIPE_JOB, str(tmp_path / f"{case}.log"), *cmds[0]]]
        procs[case] = []
        for cmd in cmds:
            procs[case].append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE, text=True,
                                                start_new_session=True))  # fmt: skip
            if how == "two_agents":
                time.sleep(1.0)  # the first agent hosts the rendezvous
    workers: dict[str, list[int]] = {}
    second: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 300
        for case, agents in procs.items():
            _wait_for_step(tmp_path / f"{case}.jsonl", agents[0], 2, deadline)
            workers[case] = [pid for a in agents for pid in _worker_pids(a.pid).values()]
            assert len(workers[case]) == 2, (case, workers[case])
            _stop(case, agents[0], workers[case])
        time.sleep(SECOND_AFTER_S)
        second["ctrl_c_twice"] = _stop("ctrl_c_twice", procs["ctrl_c_twice"][0], [])
        gone_by: dict[str, float] = {}
        deadline = time.monotonic() + 120
        while len(gone_by) < len(workers):
            for case, pids in workers.items():
                if case not in gone_by and all(gone(p) for p in pids):
                    gone_by[case] = time.monotonic()
            assert time.monotonic() < deadline, (
                f"workers still running: {set(workers) - set(gone_by)}"
            )
            time.sleep(0.1)
        outs = {c: [a.communicate(timeout=120) for a in agents] for c, agents in procs.items()}
    finally:
        kill_trees((a.pid for agents in procs.values() for a in agents),
                   also=(pid for pids in workers.values() for pid in pids))  # fmt: skip
    stops, resume_jobs = {}, []
    for case, streams in outs.items():
        stderr = "\n".join(err for _, err in streams)
        label = f"{case}:\n{stderr[-4000:]}"
        how, sig = _CASES[case]
        statuses = sorted((p.name, p.read_text()) for p in (tmp_path / f"{case}.exit").iterdir())
        logged = sorted(_losses(tmp_path / f"{case}.jsonl"))
        if how == "ctrl_c_twice":  # at once, without the stop's checkpoint
            code = str(EXIT_INTERRUPTED)
            assert statuses == [("rank0", code), ("rank1", code)], (statuses, label)
            assert gone_by[case] - second[case] < HELD_S / 2, (gone_by[case] - second[case], label)
            assert len(re.findall(r"^interrupted: a second Ctrl-C: stopped at once", stderr,
                                  re.M)) == 1, label  # fmt: skip
            assert "preempted:" not in stderr, label
            newest = int(_written(tmp_path / case)[-1][5:])
            assert _written(tmp_path / case) == [f"step_{s:08d}" for s in range(2, newest + 1, 2)]
            stop = newest
        else:
            lines = re.findall(r"^preempted: .*$", stderr, re.M)
            assert len(lines) == 1, label
            m = re.match(r"preempted: (.*): stopped after step (\d+) of 1000; checkpoint (\S+) "
                         r"written", lines[0])  # fmt: skip
            assert m, label
            launcher_gone = m.group(1).startswith("a rank's launcher (torchrun) is gone")
            if sig == signal.SIGTERM:
                assert m.group(1) == "SIGTERM received", label
            elif sig == signal.SIGINT:
                assert m.group(1) == "SIGINT (Ctrl-C) received", label
                assert "exit status 75 on every rank; plain torchrun itself exits 1" in lines[0]
            elif how == "two_agents":  # the second torchrun loses the rendezvous store the
                # first one hosted and SIGTERMs its worker; whichever a step boundary sees first
                assert launcher_gone or m.group(1) == "SIGTERM received", label
            else:  # torchrun died at once: its workers saw their launcher go
                assert launcher_gone, label
            stop = int(m.group(2))
            assert statuses == [("rank0", str(EXIT_PREEMPTED)), ("rank1", str(EXIT_PREEMPTED))], (
                statuses, label)  # fmt: skip
            assert _written(tmp_path / case) == [f"step_{stop:08d}"], label
            assert logged == list(range(1, stop + 1)), label
        if how == "tee":  # the closed stdout: noticed once, the steps' records all kept
            assert len(re.findall(r"^warning: rank 0: stdout is closed", stderr, re.M)) == 1, label
            assert "BrokenPipeError" not in stderr, label
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
        b = _losses(tmp_path / f"{case}.b.jsonl")
        assert sorted(b) == [stop + 1, stop + 2], (case, sorted(b))
        got = {**_losses(tmp_path / f"{case}.jsonl"), **b}
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
        cmdlines = {p: Path(f"/proc/{p}/cmdline").read_bytes() for p in descendants(proc.pid)}
        [worker] = [p for p, c in cmdlines.items() if b"stubborn" in c and b"distributed" not in c]
        proc.send_signal(signal.SIGINT)
        time.sleep(2.0)
        assert proc.poll() is None and not gone(worker), "the first Ctrl-C only forwards"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)  # a hang guard: torchrun alone waits 600 s
    finally:
        kill_trees([proc.pid])
    assert "launch: second interrupt: killing torchrun and its workers now" in stderr, stderr
    assert gone(worker), "the worker outlived the second Ctrl-C"


def test_launch_help_says_what_it_adds_to_torchrun():
    res = subprocess.run([sys.executable, "-m", "dtensor_ulysses.launch", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stderr
    for needed in ("SIGUSR1", "600 s", "exit status", "75", "second Ctrl-C", "--resume"):
        assert needed in res.stdout, (needed, res.stdout)
