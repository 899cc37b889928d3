"""``python -m simulations``: see :mod:`simulations.cli`."""

import sys

from simulations.cli import main

sys.exit(main())
