"""Launch training so that a scheduler's warning reaches every worker; local gloo worlds.

``python -m dtensor_ulysses.launch [torchrun options] -m dtensor_ulysses.train [trainer options]``
runs ``torchrun`` with the same arguments and makes the signals a scheduler sends to the job's
first process (SLURM's ``--signal=B:USR1@N`` via the batch script's trap, Kubernetes' SIGTERM)
end in the trainer's agreed-step checkpoint, whether they are sent to this process alone or to
its whole process group:

* torchrun is told to handle SIGUSR1 too (its ``--signals-to-handle``, through
  ``PET_SIGNALS_TO_HANDLE``; by default it handles only SIGTERM, SIGINT, SIGHUP and SIGQUIT and
  dies at once on SIGUSR1, leaving its workers, which run in their own sessions, to train on;
  setting ``TORCHELASTIC_SIGNALS_TO_HANDLE`` does nothing, torchrun overwrites it) and to wait
  :data:`SHUTDOWN_TIMEOUT_S` seconds for its workers after forwarding a signal, instead of 30,
  before it kills them (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``; a value you set wins);
* torchrun runs in its own session, so a signal to this process's group reaches it once,
  through this process, which forwards SIGTERM, SIGUSR1, SIGINT and SIGHUP; if this process
  is killed, torchrun gets SIGTERM (Linux);
* the exit status is the workers' own when they agree (75: pre-empted, checkpointed; 2: bad
  input; 3: a non-finite step), where torchrun alone would exit 1 for all of them;
* a first Ctrl-C is forwarded like the other signals (every worker stops after the same step
  with its checkpoint: status 75); a second Ctrl-C (SIGINT at least :data:`ESCALATE_AFTER_S`
  after the first) does not wait for the checkpoint: it says so and kills torchrun and every
  worker at once (SIGKILL); the newest complete checkpoint is kept;
* a closed stderr (``2>&1 | tee log`` after ``tee`` died) never stops the relay of torchrun's
  output: it goes to ``/dev/null`` from then on.

Any script torchrun runs can be launched this way, a ``with_ulysses`` training script included
(its ranks stop the same way, through the Trainer's own checkpoint).

:func:`run_local_world` is for code that wants a small CPU world
from inside Python — a test, a notebook cell, ``python -m simulations validate`` — and wants each
rank's return value back. Every run has a deadline: a mismatched collective fails with a
``TimeoutError`` naming the ranks still running instead of hanging.

Example::

    from dtensor_ulysses.launch import run_local_world
    results = run_local_world(my_module.worker, 4, arg1, timeout_s=120)  # one result per rank

``worker(rank, world_size, *args)`` must be importable by module path (spawned processes cannot
unpickle functions defined in ``__main__`` or a notebook).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from dtensor_ulysses._exit import EXIT_DIR_ENV, LAUNCHER_ENV, exit_process

__all__ = [
    "ESCALATE_AFTER_S",
    "EXIT_DIR_ENV",
    "FORWARDED_SIGNALS",
    "SHUTDOWN_TIMEOUT_S",
    "WORLD_START_ENV",
    "main",
    "run_local_world",
]

# how run_local_world starts its processes: "spawn" (default: each imports everything afresh) or
# "forkserver" (forked from one server process that imported what
# multiprocessing.set_forkserver_preload names once: a world starts in a fraction of a second; the
# test suite uses it). Either way each process gets the caller's environment as it is at the call.
WORLD_START_ENV = "DTENSOR_ULYSSES_WORLD_START"
FORWARDED_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT", "SIGHUP")
SHUTDOWN_TIMEOUT_S = 600  # torchrun's wait for its workers after a signal (its default: 30)
ESCALATE_AFTER_S = 1.0  # a second SIGINT this long after the first kills (closer: one press)
_HELP = """usage: python -m dtensor_ulysses.launch [torchrun options] -m dtensor_ulysses.train
           [trainer options]

Runs torchrun with the same arguments, and adds what a long run needs from its launcher:
  * SIGUSR1 is handled too (SLURM's --signal=B:USR1@N): torchrun alone dies on it at once;
  * after a stop signal torchrun waits 600 s (not 30) for the workers' checkpoint
    (TORCH_ELASTIC_SHUTDOWN_TIMEOUT; a value you set wins);
  * a signal to this process or to its process group reaches torchrun once; SIGTERM, SIGUSR1,
    SIGINT and SIGHUP are forwarded, and torchrun gets SIGTERM if this process is killed;
  * the exit status is the workers' own when they agree: 75 pre-empted (checkpointed, rerun
    with --resume), 2 bad input, 3 a non-finite step, 74 a checkpoint could not be written
    (plain torchrun exits 1 for all of them);
  * a first Ctrl-C stops every worker after the same step with its checkpoint (75);
    a second Ctrl-C kills torchrun and every worker at once, without waiting for the checkpoint.

The script may also be a with_ulysses training script (python -m dtensor_ulysses.launch
--nproc-per-node 4 train_sft.py ...): it stops the same way, with the Trainer's checkpoint.

torchrun's own options: python -m torch.distributed.run --help
"""
_TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")


def _entry(
    rank: int, fn: Callable, world_size: int, tmp: str, args: tuple, coll_s: float, env: dict
) -> None:
    if os.environ != env:  # forked from a server started earlier: the caller's environment now
        os.environ.clear()
        os.environ.update(env)
    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=coll_s),
    )
    try:
        result = fn(rank, world_size, *args)
        with open(f"{tmp}/result_{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
        dist.barrier()  # leave together: a gloo teardown racing a peer's collective can abort
    except BaseException:
        with open(f"{tmp}/error_{rank}.txt", "w") as f:
            f.write(traceback.format_exc())
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    exit_process(0)  # results are written: skip the teardown that can abort (see _exit.py)


def run_local_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 180.0,
    collective_timeout_s: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` CPU processes joined by gloo.

    Args:
        fn: a module-level function (picklable by reference).
        world_size: number of processes.
        *args: picklable arguments passed to every rank.
        timeout_s: deadline for the whole run; past it every process is killed.
        collective_timeout_s: gloo's timeout for a single collective.

    The processes are started as :data:`WORLD_START_ENV` says (``spawn`` unless it is
    ``forkserver``); each runs with the caller's environment at the time of the call.

    Returns:
        The return values, indexed by rank.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message).
        TimeoutError: the deadline passed.
    """
    import torch.multiprocessing as mp  # here: the launcher's command line runs without torch

    if world_size < 1:
        raise ValueError(f"world_size={world_size}; use world_size >= 1")
    method = os.environ.get(WORLD_START_ENV) or "spawn"
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"{WORLD_START_ENV}={method!r}; use 'spawn' or 'forkserver'")
    with tempfile.TemporaryDirectory(prefix="du-world-") as tmp:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, tmp, args, collective_timeout_s, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method=method,
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                    raise TimeoutError(
                        f"{fn.__name__} on {world_size} ranks passed its {timeout_s:.0f} s "
                        f"deadline; "
                        f"ranks still running: {alive} (a collective mismatch or a hang)"
                    )
        except mp.ProcessRaisedException as e:
            errors = []
            for name in sorted(os.listdir(tmp)):
                if name.startswith("error_"):
                    with open(os.path.join(tmp, name)) as f:
                        errors.append(f.read())
            raise RuntimeError("\n".join(errors) or str(e)) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"result_{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def _torchrun_env(exit_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    # torchrun's --signals-to-handle (read from PET_SIGNALS_TO_HANDLE when not given) sets
    # TORCHELASTIC_SIGNALS_TO_HANDLE itself: setting the latter before torchrun has no effect
    have = [x.strip() for x in env.get("PET_SIGNALS_TO_HANDLE", "").split(",") if x.strip()]
    env["PET_SIGNALS_TO_HANDLE"] = ",".join(dict.fromkeys([*have, *_TORCHRUN_SIGNALS]))
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    env[EXIT_DIR_ENV] = exit_dir
    env[LAUNCHER_ENV] = str(os.getpid())
    return env


def _die_with_parent() -> None:  # in the child, before exec: SIGTERM when the launcher dies
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux: from /proc; elsewhere none)."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                    children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_all(pid: int) -> None:
    """The second Ctrl-C: SIGKILL torchrun (``pid``) and every process below it, and say so."""
    _write_stderr(
        b"launch: second interrupt: killing torchrun and its workers now (SIGKILL), without "
        b"waiting for their checkpoint; the newest complete checkpoint is kept\n"
    )
    for target in [*_descendants(pid), pid]:  # workers first: they would outlive torchrun
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(target, signal.SIGKILL)


PREEMPTED = 75  # the trainer's status after a stop signal (EX_TEMPFAIL), checkpointed


class _StderrRelay:
    """Copies torchrun's stderr (its workers' too: they inherit it) to ours, line by line, as
    it comes; but a traceback that starts once every worker has recorded its exit status is
    torchrun's own report of the end (its ``ChildFailedError``). That one is held back, and
    after a clean pre-emption (every worker 75) replaced by one line; otherwise printed."""

    def __init__(self, stream, exit_dir: str) -> None:
        self.stream, self.exit_dir = stream, exit_dir
        self.held: list[bytes] = []
        self.thread = threading.Thread(target=self._run, name="du-stderr-relay", daemon=True)
        self.thread.start()

    def _workers_done(self) -> bool:
        return any(name.startswith("rank") for name in os.listdir(self.exit_dir))

    def _run(self) -> None:
        for line in iter(self.stream.readline, b""):  # read to the end, whatever happens to ours
            starts = line.startswith(b"Traceback (most recent call last):")
            if self.held or (starts and self._workers_done()):
                self.held.append(line)
                continue
            _write_stderr(line)

    def join(self) -> None:
        self.thread.join(timeout=30)

    def finish(self, *, preempted: bool) -> None:
        if preempted and self.held:
            _write_stderr(
                "launch: every worker stopped pre-empted (status 75, checkpointed); torchrun's "
                f"own report of that stop ({len(self.held)} lines) is omitted\n".encode()
            )
        elif self.held:
            _write_stderr(b"".join(self.held))


def _write_stderr(data: bytes) -> None:
    """Write to our stderr; once it is closed (its reader gone: ``2>&1 | tee`` after ``tee``
    died), point it at /dev/null, so that relaying torchrun's output never stops (a full pipe
    would block torchrun and its workers)."""
    try:
        sys.stderr.buffer.write(data)
        sys.stderr.buffer.flush()
    except (OSError, ValueError):
        with contextlib.suppress(OSError, ValueError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, sys.stderr.fileno())
            os.close(null)


def _workers_status(exit_dir: str) -> int | None:
    codes = set()
    for name in os.listdir(exit_dir):
        if name.startswith("rank"):
            with open(os.path.join(exit_dir, name)) as f:
                codes.add(int(f.read().strip() or 1))
    codes.discard(0)
    return codes.pop() if len(codes) == 1 else None


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv`` (its own options, then the script or ``-m module`` and its
    options), forwarding stop signals; returns the exit status (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_HELP, end="", file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    with tempfile.TemporaryDirectory(prefix="du-launch-") as exit_dir:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *argv],
            env=_torchrun_env(exit_dir),
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            stderr=subprocess.PIPE,
        )
        relay = _StderrRelay(proc.stderr, exit_dir)
        forwarded: dict[int, float] = {}

        def forward(signum, frame) -> None:
            now = time.monotonic()
            if signum not in forwarded:  # once: a group signal and a trap may both deliver it
                forwarded[signum] = now
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signum)
            elif signum == signal.SIGINT and now - forwarded[signum] >= ESCALATE_AFTER_S:
                _kill_all(proc.pid)

        for name in FORWARDED_SIGNALS:
            signal.signal(getattr(signal, name), forward)
        code = proc.wait()
        relay.join()
        if code != 0:
            code = _workers_status(exit_dir) or code
        relay.finish(preempted=code == PREEMPTED)
        return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
