"""Helpers for the tests that start launchers (torchrun, ``dtensor_ulysses.launch``, a
``torchrun`` script) in subprocesses: the processes below a pid, whether a pid has exited, and
killing whole trees when a test ends. Shared by tests/train and tests/hf."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable
from pathlib import Path

__all__ = ["descendants", "gone", "kill_trees"]


def descendants(pid: int) -> list[int]:
    """All processes below ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (absent, or a zombie waiting for its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def kill_trees(roots: Iterable[int], also: Iterable[int] = ()) -> None:
    """SIGKILL each of ``roots`` with every process below it (found before the root dies, while
    they are still its descendants), then each pid of ``also`` (workers known by pid, which a
    launcher may have started in sessions of their own); pids already gone are skipped."""
    for root in roots:
        for pid in [root, *descendants(root)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for pid in also:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
