"""Helpers for the tutorial notebooks: figures, widgets, spawning ranks, checks.

Teaching code, kept beside the notebooks and out of the library (``dtensor_ulysses`` never imports
matplotlib, ipywidgets or the simulator). The notebooks run with ``notebooks/`` as their working
directory, so ``import tutorial`` finds this package; processes they spawn inherit that path.

* :mod:`tutorial.figures` - matplotlib figures from plain numbers (layouts from
  ``dtensor_ulysses.debug.layout``, predictions from ``simulations``);
* :mod:`tutorial.widgets` - :func:`~tutorial.widgets.show` a figure as a PNG output, and
  :func:`~tutorial.widgets.live` controls that redraw it;
* :mod:`tutorial.workers` - :func:`~tutorial.workers.run_on_ranks` runs a function written in a
  notebook cell on a local gloo world, :func:`~tutorial.workers.run_training` a ``torchrun`` job;
* :mod:`tutorial.checks` - what a real run reports, compared with the plan and the closed form.
"""
