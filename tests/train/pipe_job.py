"""``COMMAND | tee LOG`` as a shell runs a pipeline: both in this process's group, which the test
makes a new session (``start_new_session``), so that a signal to the group reaches the job's
first process and ``tee`` alike (``tee`` dies of it; the job's stdout then has no reader).
This process survives the signals (it only waits) and exits with the job's status.

    python tests/train/pipe_job.py LOG COMMAND...
"""

from __future__ import annotations

import signal
import subprocess
import sys


def main() -> int:
    log, cmd = sys.argv[1], sys.argv[2:]
    for name in ("SIGTERM", "SIGUSR1", "SIGINT", "SIGHUP"):  # handled here, default in children
        signal.signal(getattr(signal, name), lambda *_: None)
    tee = subprocess.Popen(["tee", log], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    job = subprocess.Popen(cmd, stdout=tee.stdin)
    assert tee.stdin is not None
    tee.stdin.close()  # the job (and its workers) hold the pipe's only write ends
    code = job.wait()
    tee.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
