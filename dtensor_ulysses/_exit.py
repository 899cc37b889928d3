"""How distributed worker processes stop and leave: every signal, stream and teardown rule, here.

Stopping (asked from outside):

1. Stop at an agreed step. SIGTERM and SIGUSR1 (what SLURM and Kubernetes send before they
   kill a job) and a first SIGINT (Ctrl-C; torchrun forwards it to its workers) only set a
   flag while :func:`catch_stop_signals` is on; :func:`agreed_stop` all-reduces it at a step
   boundary, so every rank stops after the same step and checkpoints. Under a launcher
   (torchrun) a watcher thread raises the same flag when the launcher is gone (this worker's
   parent process changed: plain ``torchrun`` ended at once by SIGUSR1, which it does not
   handle, or SIGKILLed by the out-of-memory killer), so orphaned workers stop the same way.
2. A second Ctrl-C stops at once. SIGINT, or torchrun's SIGTERM after its own second Ctrl-C,
   arriving at least :data:`ESCALATE_AFTER_S` after the first SIGINT ends the process at once
   with :data:`EXIT_INTERRUPTED` (130, the shell's status for Ctrl-C), without waiting for the
   checkpoint; the newest complete checkpoint stays. (A terminal sends one Ctrl-C to every
   process of its foreground group, and torchrun forwards it once more: copies that arrive
   within that second are the same press.) Arrival times are taken by a thread reading the
   interpreter's signal wake-up pipe, so they do not wait for the main thread, which may be
   inside a long collective.
3. Printing never ends a run. :func:`protect_output` makes stdout and stderr unbreakable: a
   stream whose reader is gone (``torchrun ... | tee log`` after ``tee`` died with the job's
   process group) or whose terminal closed is noticed once (one ``warning:`` line on the other
   stream, when it still works), then its file descriptor is pointed at ``/dev/null`` so that
   every later write, from Python or C++, succeeds and goes nowhere.

Leaving:

4. Leave together. On CPU/gloo, tearing down a process group while a peer is still inside its
   last collective can abort the process; a successful run therefore passes one barrier before
   ``destroy_process_group`` (:func:`leave_together`).
5. Let rank 0 speak first. Bad input is found alike on every rank and rank 0 says it once;
   torchrun stops every worker as soon as one exits, so the other ranks wait before leaving
   with a usage error. The wait costs nothing when rank 0 is on time (its own exit ends the job
   at once); it is long because on a loaded machine rank 0 can still be importing torch when
   the others are done. :func:`leave_with_message` prints a refusal or a stop in one line.
6. Skip C++ static destructors. Even after all of that, a gloo worker can abort at interpreter
   shutdown ("terminate called without an active exception": gloo's worker threads still hold
   work whose tensors need the GIL while the interpreter is finalized), seen here intermittently
   on torch 2.13 with 2-4 processes; upstream: pytorch/pytorch#190489 (and the abandoned atexit
   fix, pytorch/pytorch#179291). Workers flush their streams and leave with ``os._exit``
   (:func:`exit_process`): nothing is lost, because results, metrics and checkpoints are written
   and closed before this point.
7. Leave cleanly at exit, when the library does not own the process's end (``with_ulysses``
   or a script on :func:`~dtensor_ulysses.init_mesh`): :func:`leave_together_at_exit` installs
   the excepthook and an atexit teardown (the groups destroyed while the interpreter is
   intact), after which the C++ static destructors are skipped with the script's own exit
   status (glibc's ``on_exit``).
8. Say the status. :func:`record_exit_status` leaves each rank's status for
   ``python -m dtensor_ulysses.launch``, which exits with it; plain torchrun exits 1 whenever a
   worker fails, whatever the worker's status (:func:`shell_status`).
9. Leave a note. A worker's torchelastic error file is what torchrun's failure summary shows
   next to the rank (instead of "To enable traceback see ..."): :func:`write_rank_note`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# torch is imported where it is used: the launcher's command line runs without it

__all__ = [
    "ESCALATE_AFTER_S",
    "EXIT_DIR_ENV",
    "EXIT_INTERRUPTED",
    "EXIT_PREEMPTED",
    "LAUNCHER_ENV",
    "LAUNCHER_GONE",
    "LAUNCHER_POLL_S",
    "SINGLE_PROCESS_ENV",
    "STOP_SIGNALS",
    "USAGE_ERROR_GRACE_S",
    "agreed_stop",
    "catch_stop_signals",
    "describe_stop",
    "exit_process",
    "leave_together",
    "leave_together_at_exit",
    "leave_with_message",
    "mark_refusal",
    "protect_output",
    "record_exit_status",
    "shell_status",
    "stop_signal_received",
    "write_rank_note",
]

USAGE_ERROR_GRACE_S = 30.0
EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: stopped on request, checkpointed: retry (resume)
EXIT_INTERRUPTED = 130  # 128 + SIGINT: a second Ctrl-C, stopped at once
EXIT_DIR_ENV = "DTENSOR_ULYSSES_EXIT_DIR"  # set by the launcher: each rank leaves its status
LAUNCHER_ENV = "DTENSOR_ULYSSES_LAUNCHER"  # set by python -m dtensor_ulysses.launch
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
LAUNCHER_GONE = "launcher gone"  # a stop "signal": this worker's launcher (its parent) died
SINGLE_PROCESS_ENV = "DTENSOR_ULYSSES_SINGLE_PROCESS"  # a world of one started without torchrun
LAUNCHER_POLL_S = 0.5
ESCALATE_AFTER_S = 1.0  # a SIGINT this long after the first one is a second Ctrl-C
_LAUNCHER_GONE_CODE = 256  # above every signal number, so it wins the all-reduce
_REFUSAL = "_du_refusal"  # the attribute that marks an exception as a refusal (status 2)


def _rank() -> int:
    dist = sys.modules.get("torch.distributed")  # never imported here: a signal may ask
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK") or 0)


# ----------------------------------------------------------------------------------------------
# stop requests: signals, a second Ctrl-C, a launcher that died
# ----------------------------------------------------------------------------------------------
class _Stops:
    """What :func:`catch_stop_signals` received (one per process)."""

    def __init__(self) -> None:
        self.received: list[str] = []  # names, first arrival first (no repeats)
        self.depth = 0  # nesting of catch_stop_signals
        self.first_interrupt: float | None = None  # arrival of the first SIGINT
        self.lock = threading.RLock()  # also taken by a signal handler on the main thread
        self.watching = False  # the launcher watcher runs (once per process)
        self.pipe_reader: threading.Thread | None = None


_STOPS = _Stops()


def _arrived(signum: int, when: float) -> None:
    """Record one arrival of ``signum``; a second Ctrl-C ends the process here."""
    name = signal.Signals(signum).name
    with _STOPS.lock:
        if not _STOPS.depth:
            return
        first = _STOPS.first_interrupt
        # a second press; copies of the first one (the terminal's, torchrun's) come sooner
        if name in ("SIGINT", "SIGTERM") and first is not None and when - first >= ESCALATE_AFTER_S:
            _interrupt_now()
        announce = name == "SIGINT" and first is None
        if announce:
            _STOPS.first_interrupt = when
        if name not in _STOPS.received:
            _STOPS.received.append(name)
    if announce and _rank() == 0:
        _say(
            "interrupted (Ctrl-C): every rank stops after the current step and writes its "
            "checkpoint; press Ctrl-C again to stop at once without it"
        )


def _interrupt_now() -> None:
    """The second Ctrl-C: say so (rank 0), leave the note and the status, end the process."""
    text = (
        "a second Ctrl-C: stopped at once, without the checkpoint of this step (the newest "
        f"complete checkpoint is kept; exit status {EXIT_INTERRUPTED})"
    )
    write_rank_note(f"interrupted: {text}")
    if _rank() == 0:
        _say(f"interrupted: {text}")
    record_exit_status(EXIT_INTERRUPTED, _rank())
    exit_process(EXIT_INTERRUPTED)


def _say(text: str) -> None:
    with contextlib.suppress(Exception):  # a closed stderr: the note above stays
        print(text, file=sys.stderr, flush=True)


def _on_signal(signum: int, frame: Any) -> None:
    if _STOPS.pipe_reader is None:  # no wake-up pipe: the main thread's time is the arrival
        _arrived(signum, time.monotonic())


def _read_wakeup_pipe(fd: int) -> None:
    """Arrival times from the interpreter's wake-up pipe (its C handler writes each caught
    signal's number there at once, whatever the main thread is doing)."""
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        if not data:
            return
        now = time.monotonic()
        for signum in data:
            with contextlib.suppress(ValueError):
                _arrived(signum, now)


def _start_wakeup_pipe() -> tuple[int, int] | None:
    """Own the interpreter's signal wake-up fd (unless someone, e.g. asyncio, already does):
    ``(read, write)`` of the pipe, or None."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:  # not the main thread
        old = None
    if old != -1:
        if old is not None:
            signal.set_wakeup_fd(old)
        os.close(r)
        os.close(w)
        return None
    thread = threading.Thread(target=_read_wakeup_pipe, args=(r,), name="du-signals", daemon=True)
    _STOPS.pipe_reader = thread
    thread.start()
    return r, w


def _watch_launcher() -> None:
    """Under torchrun (not a single process): start, once, a daemon thread that adds
    :data:`LAUNCHER_GONE` to the received stop signals when this process's parent changes."""
    if _STOPS.watching or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    if os.environ.get(SINGLE_PROCESS_ENV):
        return
    _STOPS.watching = True
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(LAUNCHER_POLL_S)
            if os.getppid() != parent:
                with _STOPS.lock:
                    if _STOPS.depth and LAUNCHER_GONE not in _STOPS.received:
                        _STOPS.received.append(LAUNCHER_GONE)
                return

    threading.Thread(target=watch, name="du-launcher-watch", daemon=True).start()


@contextlib.contextmanager
def catch_stop_signals() -> Iterator[None]:
    """While inside, SIGTERM, SIGUSR1 and a first SIGINT only set a flag (read with
    :func:`agreed_stop` at step boundaries); a second Ctrl-C ends the process at once. The
    previous handlers come back on leaving. Nested uses keep what the outer one received.
    Signals are not caught outside the main thread (the flag then only follows the launcher)."""
    previous: dict[int, Any] = {}
    pipe = None
    outermost = not _STOPS.depth
    if outermost:
        _STOPS.received.clear()
        _STOPS.first_interrupt = None
    with _STOPS.lock:
        _STOPS.depth += 1
    _watch_launcher()
    if outermost and threading.current_thread() is threading.main_thread():
        for name in STOP_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                previous[sig] = signal.signal(sig, _on_signal)
        pipe = _start_wakeup_pipe()
    try:
        yield
    finally:
        with _STOPS.lock:
            _STOPS.depth -= 1
        if pipe is not None:
            signal.set_wakeup_fd(-1)
            os.close(pipe[1])  # the reader sees the end of the pipe and returns
            if _STOPS.pipe_reader is not None:
                _STOPS.pipe_reader.join(timeout=5)
            _STOPS.pipe_reader = None
            os.close(pipe[0])
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_signal_received() -> bool:
    """Whether a stop signal (or the launcher's loss) was recorded by the last
    :func:`catch_stop_signals` (torchrun's SIGTERM to a rank that is leaving anyway)."""
    return bool(_STOPS.received)


def _code(name: str) -> int:
    return _LAUNCHER_GONE_CODE if name == LAUNCHER_GONE else int(signal.Signals[name])


def _name(code: int) -> str:
    return LAUNCHER_GONE if code == _LAUNCHER_GONE_CODE else signal.Signals(code).name


def agreed_stop(device: Any = "cpu", group: Any = None) -> str | None:
    """The stop every rank agrees on at this step boundary, or None: one all-reduce (MAX) of a
    4-byte int32 over ``group`` (default: the world) when there is more than one rank, so
    call it on every rank of the group alike. The largest code wins (the launcher's loss, then
    the largest signal number), so every rank names the same stop."""
    import torch
    import torch.distributed as dist

    with _STOPS.lock:
        local = _code(_STOPS.received[0]) if _STOPS.received else 0
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        flag = torch.tensor([local], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        local = int(flag.item())
    return _name(local) if local else None


def describe_stop(name: str | None) -> str:
    """What stopped the run, for its ``preempted:`` line."""
    if name == LAUNCHER_GONE:
        return (
            "a rank's launcher (torchrun) is gone (ended by a signal it does not handle, such "
            "as SIGUSR1, or SIGKILLed)"
        )
    if name == "SIGINT":
        return "SIGINT (Ctrl-C) received"
    return f"{name or 'a stop signal'} received"


# ----------------------------------------------------------------------------------------------
# printing never ends a run
# ----------------------------------------------------------------------------------------------
class _Unbreakable:
    """A text stream that never raises on ``write``/``flush``: the first failure (a closed pipe,
    a terminal gone) points the stream's file descriptor at ``/dev/null`` and says so once on
    ``other``; every other attribute is the wrapped stream's."""

    def __init__(self, stream: Any, label: str, note: str) -> None:
        self._du_stream, self._du_label, self._du_note = stream, label, note
        self._du_broken = False

    def write(self, s: str) -> int:
        try:
            return self._du_stream.write(s)
        except (OSError, ValueError) as e:
            self._du_break(e)
            return len(s)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._du_stream.flush()
        except (OSError, ValueError) as e:
            self._du_break(e)

    def _du_break(self, e: BaseException) -> None:
        if self._du_broken:
            return
        self._du_broken = True
        with contextlib.suppress(Exception):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._du_stream.fileno())
            os.close(null)
        with contextlib.suppress(Exception):
            self._du_stream.flush()  # what it still held goes to /dev/null now
        other = sys.stderr if self._du_label == "stdout" else sys.stdout
        why = type(e).__name__ if not isinstance(e, OSError) else (e.strerror or type(e).__name__)
        text = (
            f"warning: rank {_rank()}: {self._du_label} is closed ({why}: its reader, such as "
            f"`tee`, or its terminal is gone); the run goes on and {self._du_note}"
        )
        with contextlib.suppress(Exception):
            other.write(text + "\n")
            other.flush()
        write_rank_note(text)

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, buffer, ...
        return getattr(self._du_stream, name)


@contextlib.contextmanager
def protect_output(note: str = "its output to that stream is dropped") -> Iterator[None]:
    """While inside, a closed stdout or stderr never raises (see the module docstring, 3).

    ``note`` ends the one warning line (e.g. where the progress still goes). The streams come
    back on leaving (a broken one already points at ``/dev/null``)."""
    saved = sys.stdout, sys.stderr
    if not isinstance(sys.stdout, _Unbreakable) and sys.stdout is not None:
        sys.stdout = _Unbreakable(sys.stdout, "stdout", note)
    if not isinstance(sys.stderr, _Unbreakable) and sys.stderr is not None:
        sys.stderr = _Unbreakable(sys.stderr, "stderr", note)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()  # type: ignore[union-attr]
        sys.stdout, sys.stderr = saved


# ----------------------------------------------------------------------------------------------
# leaving
# ----------------------------------------------------------------------------------------------
def leave_together(code: int, rank: int, *, grace: bool = True) -> int:
    """Tear down the process group for an exit with status ``code``; returns ``code``.

    ``0``: all ranks pass one barrier, then destroy the group. ``2`` (usage error): ranks other
    than 0 wait :data:`USAGE_ERROR_GRACE_S` so rank 0's message is printed first, unless
    ``grace`` is False (the launcher already asked this rank to stop: rank 0 has left, and a
    wait would only end in the launcher's SIGKILL). Anything else (a failure, whose traceback is
    already printed, or a stop every rank agreed on): no barrier, since peers may never reach
    it.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        if code == 0:
            dist.barrier()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    if code == 2 and rank != 0 and grace:
        time.sleep(USAGE_ERROR_GRACE_S)
    return code


def leave_with_message(
    code: int, text: str, *, prefix: str, note: str | None = None, grace: bool = True
) -> None:
    """End this process with status ``code`` after one line: rank 0 prints ``prefix: text`` on
    stderr; every rank leaves ``note`` (default: ``text``) where torchrun's failure summary
    shows it, and its status for the launcher; the ranks leave together
    (:func:`leave_together`). Never returns."""
    rank = _rank()
    write_rank_note(note or text)
    if rank == 0:
        _say(f"{prefix}: {text}")
    record_exit_status(code, rank)
    exit_process(leave_together(code, rank, grace=grace))


def shell_status(code: int) -> str:
    """What the shell will see when every rank exits with ``code``, for a message: the status
    itself, or under plain torchrun, which exits 1 whenever a worker fails, that and how to
    get the workers' own."""
    if code == 0 or "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get(LAUNCHER_ENV):
        return f"exit status {code}"
    return (
        f"exit status {code} on every rank; plain torchrun itself exits 1, "
        f"python -m dtensor_ulysses.launch exits {code}"
    )


class _AtExit:
    installed = False  # the atexit teardown is registered
    failed = False  # an uncaught exception was seen (no barrier: a peer may never reach it)
    barrier = False  # some installer knows that every rank reaches the end (with_ulysses)


_AT_EXIT = _AtExit()


def mark_refusal(e: BaseException) -> None:
    """Mark ``e`` as bad input that the library refused: left uncaught, it ends the process as
    :func:`leave_with_message` does (one ``error:`` line from rank 0, status 2) instead of a
    traceback from every rank. Installs the process's excepthook (once)."""
    setattr(e, _REFUSAL, True)
    _install_excepthook()


def _install_excepthook() -> None:
    if getattr(sys.excepthook, "_du_leaving", False):
        return
    previous = sys.excepthook

    def hook(kind: type, value: BaseException, tb: Any) -> None:
        if getattr(value, _REFUSAL, False):
            text = " ".join(str(value).split())
            leave_with_message(2, text, prefix="error", note=f"{type(value).__name__}: {text}")
        _AT_EXIT.failed = True
        previous(kind, value, tb)

    hook._du_leaving = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def leave_together_at_exit(*, barrier: bool = True) -> None:
    """Leave the process group cleanly at interpreter exit (installed once per process).

    For code that trains on a process group whose end it does not own (``with_ulysses`` inside
    a user's script, on the group torchrun / accelerate made; a script on
    :func:`~dtensor_ulysses.init_mesh`). Left to interpreter shutdown, gloo's worker threads
    can be destroyed while they still hold work, and a rank aborts after its work is done
    (SIGABRT: the job fails). At exit (after the script's own code, which may still evaluate or
    save), while the interpreter is intact: every rank passes one barrier (``barrier``, and no
    uncaught exception was seen: a peer may never reach it) and destroys all groups
    (:func:`leave_together`), reference cycles are collected, and the C++ static destructors
    that run after the interpreter is gone are skipped (glibc's ``on_exit`` ends the process
    with ``_exit`` and the script's own status, whatever it is: 0, ``sys.exit(n)``, 1 after a
    traceback). ``barrier=False`` (:func:`~dtensor_ulysses.init_mesh`: a script may end on one
    rank alone, whose barrier would then wait for a peer in another collective) tears down
    without the barrier unless another installer asked for it.
    """
    _AT_EXIT.barrier = _AT_EXIT.barrier or barrier
    if _AT_EXIT.installed:
        return
    _AT_EXIT.installed = True
    _install_excepthook()
    atexit.register(_leave_at_exit)


def _leave_at_exit() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        together = _AT_EXIT.barrier and not _AT_EXIT.failed
        leave_together(0 if together else 1, dist.get_rank())
    gc.collect()  # work objects and groups that only a reference cycle still held
    _skip_static_destructors()


def _skip_static_destructors() -> None:
    """Register, last, a C exit handler that ends the process with ``_exit(status)`` (glibc's
    ``on_exit`` passes the status ``exit`` got): it runs before the handlers registered
    earlier, torch's and gloo's static destructors among them. C stdio is flushed first (what
    ``exit`` would have flushed); Python's own streams are flushed by the interpreter before
    ``exit``. Elsewhere (no ``on_exit``): nothing."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None)
        on_exit = getattr(libc, "on_exit", None)
        if on_exit is None:
            return
        libc.fflush(None)
        on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        on_exit(ctypes.cast(libc._exit, ctypes.c_void_p), None)


def exit_process(code: int) -> None:
    """Flush stdout and stderr, then end the process with ``code`` immediately."""
    for stream in (sys.stdout, sys.stderr):
        # a closed or broken stream must not turn success into failure
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def record_exit_status(code: int, rank: int) -> None:
    """Under ``python -m dtensor_ulysses.launch``: leave this rank's exit status for the
    launcher, which exits with the workers' status when they agree."""
    where = os.environ.get(EXIT_DIR_ENV)
    if where:
        with contextlib.suppress(OSError):
            Path(where, f"rank{rank}").write_text(str(code))


def write_rank_note(text: str) -> None:
    """Write ``text`` as this worker's torchelastic error file, atomically (torchrun's failure
    summary shows it next to the rank and its exit code or signal); nothing outside torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    stamp = str(int(time.time()))
    data = {"message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": stamp}}}
    with contextlib.suppress(OSError):
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(target)
