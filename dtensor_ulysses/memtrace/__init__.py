"""Memory of the real training step, traced with fake tensors on a fake process group.

:mod:`.trace` has the results and :func:`trace_train_step`; the timeline of storage events is in
``_timeline.py``, the fake world and the step's setup in ``_setup.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtensor_ulysses._public import lazy_exports

# public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "AttentionTrace": "attention",
    "CATEGORIES": "_results",
    "extrapolate": "trace",
    "fake_world": "_setup",
    "PhasePeak": "_results",
    "PHASES": "trace",
    "rank0_batch": "_setup",
    "StepTrace": "trace",
    "trace_config": "_setup",
    "TRACE_DEVICES": "trace",
    "trace_attention": "attention",
    "trace_train_step": "trace",
    "TraceUnavailable": "_results",
}

__all__ = [
    "AttentionTrace",
    "CATEGORIES",
    "extrapolate",
    "fake_world",
    "PhasePeak",
    "PHASES",
    "rank0_batch",
    "StepTrace",
    "trace_config",
    "TRACE_DEVICES",
    "trace_attention",
    "trace_train_step",
    "TraceUnavailable",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs
    from dtensor_ulysses.memtrace._results import (
        CATEGORIES,
        PhasePeak,
        TraceUnavailable,
    )
    from dtensor_ulysses.memtrace._setup import (
        fake_world,
        rank0_batch,
        trace_config,
    )
    from dtensor_ulysses.memtrace.attention import AttentionTrace, trace_attention
    from dtensor_ulysses.memtrace.trace import (
        PHASES,
        TRACE_DEVICES,
        StepTrace,
        extrapolate,
        trace_train_step,
    )
