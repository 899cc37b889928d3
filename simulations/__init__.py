"""Torch-free cost model of Ulysses sequence parallelism and its alternatives.

What will a (model, sequence, dp, sp, GPU) cost, and which layout should I pick? ``simulations``
answers per rank, per layer and per step: communication by collective and process group, memory
by component with the peak, step time, MFU and tokens/s; the planner ranks (dp, sp) layouts by the
longest sequence they train. Importing it does not import torch (only ``simulations.validate``,
which runs the real code, does).

    >>> import simulations as sim
    >>> p = sim.predict("llama3-8b", seq_len=131072, dp=1, sp=8, gpu="h100")
    >>> plan = sim.plan("llama3-8b", gpus=8, gpu="h100")

Command line: ``python -m simulations {predict,plan,compare,published,validate} --help``.
"""

from __future__ import annotations

from simulations.config import METHODS, Workload
from simulations.hardware import GPUS, GpuProfile, get_gpu
from simulations.planner import Plan, plan
from simulations.predict import Prediction, compare_methods, predict

__all__ = [
    "GPUS",
    "METHODS",
    "GpuProfile",
    "Plan",
    "Prediction",
    "Workload",
    "compare_methods",
    "get_gpu",
    "plan",
    "predict",
]
