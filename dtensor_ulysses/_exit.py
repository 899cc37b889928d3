"""Leave a distributed worker process without running C++ static destructors.

On CPU/gloo, a worker that has finished all its work, written its results and destroyed its
process groups can still abort at interpreter shutdown ("terminate called without an active
exception": a library thread still joinable while static objects are destroyed), seen here
intermittently on torch 2.13 with 2-4 processes. That turns a successful run into a SIGABRT that
torchrun or the spawning parent reports as a failure. Workers therefore flush their streams and
leave with ``os._exit``: nothing is lost, because results, metrics and checkpoints are written and
closed before this point.
"""

from __future__ import annotations

import contextlib
import os
import sys

__all__ = ["exit_process"]


def exit_process(code: int) -> None:
    """Flush stdout and stderr, then end the process with ``code`` immediately."""
    for stream in (sys.stdout, sys.stderr):
        # a closed or broken stream must not turn success into failure
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
