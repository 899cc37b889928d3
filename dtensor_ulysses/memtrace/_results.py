"""The tracer's result types, under its other modules: a phase's device peak by category, the
categories, and the error of a trace that cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CATEGORIES", "PhasePeak", "TraceUnavailable"]

CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations_and_buffers")


class TraceUnavailable(RuntimeError):
    """This torch lacks a private API the trace needs, or a requested feature does not exist."""


@dataclass(frozen=True)
class PhasePeak:
    """A phase's device peak, bytes, and what was alive at that moment, by category."""

    device: int
    by_category: dict[str, int]

    def scaled(self, other: PhasePeak, k: float) -> PhasePeak:
        """``self + k * (self - other)``, component by component (linear extrapolation)."""
        cats = {
            c: round(self.by_category[c] + k * (self.by_category[c] - other.by_category[c]))
            for c in self.by_category
        }
        return PhasePeak(sum(cats.values()), cats)
