"""``python -m dtensor_ulysses.train`` (under torchrun): the trainer's command line."""

from dtensor_ulysses._exit import exit_process
from dtensor_ulysses.train.loop import main

exit_process(main())  # not sys.exit: skip the teardown that can abort (see _exit.py)
