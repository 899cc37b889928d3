"""Memory of the real training step, traced with fake tensors on a fake process group.

:mod:`.trace` has the results and :func:`trace_train_step`; :mod:`.steps` the DPO and GRPO steps
it traces besides the trainer's, :mod:`.vision_step` the vision-language step; the timeline of
storage events is in ``_timeline.py``, the fake world and the step's setup in ``_setup.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtensor_ulysses._public import lazy_exports

if TYPE_CHECKING:  # the public names, written once (__all__ and the lazy map read them)
    from dtensor_ulysses.memtrace._results import (
        PhasePeak,
        TraceUnavailable,
    )
    from dtensor_ulysses.memtrace._setup import (
        fake_world,
        rank0_batch,
        trace_config,
        trace_options,
    )
    from dtensor_ulysses.memtrace.kernel import AttentionTrace, trace_attention
    from dtensor_ulysses.memtrace.steps import StepSpec
    from dtensor_ulysses.memtrace.trace import (
        PHASES,
        StepTrace,
        extrapolate,
        trace_train_step,
    )
    from dtensor_ulysses.memtrace.vision_step import VisionSpec

__getattr__, __dir__, __all__ = lazy_exports(__name__)
