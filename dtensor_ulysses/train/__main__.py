"""``python -m dtensor_ulysses.train`` (under torchrun): the trainer's command line.

``--help`` is answered by the torch-free parser before anything imports torch (which alone takes
seconds, tens of them on a loaded machine).
"""

import contextlib
import sys

from dtensor_ulysses.train.cli import UsageError, parse_args

if "-h" in sys.argv[1:] or "--help" in sys.argv[1:]:
    # prints the help and leaves with status 0; a bad flag before it is left to main() below,
    # which reports it as it reports every bad command line
    with contextlib.suppress(UsageError):
        parse_args(sys.argv[1:])

from dtensor_ulysses._exit import exit_process  # noqa: E402 (after the torch-free --help)
from dtensor_ulysses.train.loop import main  # noqa: E402

exit_process(main())  # not sys.exit: skip the teardown that can abort (see _exit.py)
