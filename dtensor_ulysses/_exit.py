"""How distributed worker processes leave: every workaround for process-group teardown, here.

1. Leave together. On CPU/gloo, tearing down a process group while a peer is still inside its
   last collective can abort the process; a successful run therefore passes one barrier before
   ``destroy_process_group`` (:func:`leave_together`).
2. Let rank 0 speak first. Bad input is found alike on every rank and rank 0 says it once;
   torchrun stops every worker as soon as one exits, so the other ranks wait before leaving
   with a usage error. The wait costs nothing when rank 0 is on time (its own exit ends the job
   at once); it is long because on a loaded machine rank 0 can still be importing torch when
   the others are done.
3. Skip C++ static destructors. Even after all of that, a gloo worker can abort at interpreter
   shutdown ("terminate called without an active exception": gloo's worker threads still hold
   work whose tensors need the GIL while the interpreter is finalized), seen here intermittently
   on torch 2.13 with 2-4 processes; upstream: pytorch/pytorch#190489 (and the abandoned atexit
   fix, pytorch/pytorch#179291). Workers flush their streams and leave with ``os._exit``
   (:func:`exit_process`): nothing is lost, because results, metrics and checkpoints are written
   and closed before this point.
4. Leave together at exit, when the library does not own the process's end (``with_ulysses``
   inside a user's script): :func:`leave_together_at_exit` installs the excepthook and the
   atexit teardown.
5. Leave a note. A worker's torchelastic error file is what torchrun's failure summary shows
   next to the rank (instead of "To enable traceback see ..."): :func:`write_rank_note`.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = [
    "USAGE_ERROR_GRACE_S",
    "exit_process",
    "leave_together",
    "leave_together_at_exit",
    "write_rank_note",
]

USAGE_ERROR_GRACE_S = 30.0


def leave_together(code: int, rank: int, *, grace: bool = True) -> int:
    """Tear down the process group for an exit with status ``code``; returns ``code``.

    ``0``: all ranks pass one barrier, then destroy the group. ``2`` (usage error): ranks other
    than 0 wait :data:`USAGE_ERROR_GRACE_S` so rank 0's message is printed first, unless
    ``grace`` is False (the launcher already asked this rank to stop: rank 0 has left, and a
    wait would only end in the launcher's SIGKILL). Anything else (a failure, whose traceback is
    already printed): no barrier, since peers may never reach it.
    """
    if dist.is_initialized():
        if code == 0:
            dist.barrier()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    if code == 2 and rank != 0 and grace:
        time.sleep(USAGE_ERROR_GRACE_S)
    return code


_AT_EXIT = {"installed": False, "failed": False}


def leave_together_at_exit() -> None:
    """Leave the process group together at interpreter exit (installed once per process).

    For code that trains on a process group it did not create and whose end it does not own
    (``with_ulysses`` inside a user's script, on the group torchrun / accelerate made, and its
    mesh's groups). Left to interpreter shutdown, gloo's worker threads can be destroyed while
    they still hold work, and a rank aborts after training has finished (SIGABRT: the job
    fails). At exit (after the script's own code, which may still evaluate or save), every rank
    passes one barrier and destroys all groups while the interpreter is intact
    (:func:`leave_together`). After an uncaught exception (noted by an excepthook that then
    calls the previous one) there is no barrier, since a peer may never reach it: only the
    teardown. The exit status stays the script's.
    """
    if _AT_EXIT["installed"]:
        return
    _AT_EXIT["installed"] = True
    previous = sys.excepthook

    def note_failure(*exc: Any) -> None:
        _AT_EXIT["failed"] = True
        previous(*exc)

    sys.excepthook = note_failure
    atexit.register(_leave_at_exit)


def _leave_at_exit() -> None:
    if not dist.is_initialized():
        return
    leave_together(1 if _AT_EXIT["failed"] else 0, dist.get_rank())
    gc.collect()  # work objects and groups that only a reference cycle still held


def exit_process(code: int) -> None:
    """Flush stdout and stderr, then end the process with ``code`` immediately."""
    for stream in (sys.stdout, sys.stderr):
        # a closed or broken stream must not turn success into failure
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


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
