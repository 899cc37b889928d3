"""The flash-attn seam: the one place that resolves the module providing flash-attn 2's API.

Every flash-attn call of the project (the local kernel's dense and varlen calls, the ring's
blocks) goes through :func:`flash_attn_module`. It imports ``flash_attn``, or the module named by
``DTENSOR_ULYSSES_FLASH_ATTN_MODULE`` (read at the first lookup; spawned ranks inherit it), or
the module installed by :func:`use_flash_attn_module`. A module may list the device types it
runs on in ``DEVICE_TYPES`` (default ``("cuda",)``): the test suite's pure-PyTorch double
(``tests/attention/flash_double.py``) says ``("cpu", "cuda")``, so the project's flash path runs on
CPU in CI.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator

import torch

__all__ = [
    "FLASH_MODULE_ENV",
    "flash_attn_available",
    "flash_attn_module",
    "flash_problem",
    "use_flash_attn_module",
]

FLASH_MODULE_ENV = "DTENSOR_ULYSSES_FLASH_ATTN_MODULE"
_flash: list = []  # [the flash-attn module or None] once looked up (a plain cache: torch.compile
# traces through functools.cache wrappers, and would reach the import inside)
_capability: dict = {}  # CUDA device index -> (major, minor)


def flash_attn_module():
    """The module that provides ``flash_attn_func``/``flash_attn_varlen_func``, or ``None``.

    ``flash_attn``, or the module named by ``DTENSOR_ULYSSES_FLASH_ATTN_MODULE``, or the one
    installed by :func:`use_flash_attn_module` (the seam of the module docstring).
    """
    if not _flash:
        name = os.environ.get(FLASH_MODULE_ENV) or "flash_attn"
        try:
            module = importlib.import_module(name)
        except Exception:  # ImportError, or a broken build (undefined CUDA symbols)
            if name != "flash_attn":
                raise  # a module asked for by name must import
            module = None
        _flash.append(module)
    return _flash[0]


@contextlib.contextmanager
def use_flash_attn_module(module) -> Iterator[None]:
    """Inside the block the flash path calls ``module`` (e.g. a test double); ``None``: no
    flash-attn. Only for this process: spawned ranks read ``DTENSOR_ULYSSES_FLASH_ATTN_MODULE``."""
    previous = list(_flash)
    _flash[:] = [module]
    try:
        yield
    finally:
        _flash[:] = previous


def flash_attn_available() -> bool:
    """Whether the flash-attn package imports in this environment."""
    return flash_attn_module() is not None


def flash_problem(
    device_type: str, dtype: torch.dtype, head_dim: int, device_index: int | None = None
) -> str | None:
    """Why flash-attn cannot run on such inputs, or ``None`` if it can."""
    if not flash_attn_available():
        return "the flash-attn package is not importable (in a clone: pip install -e '.[flash]')"
    devices = getattr(flash_attn_module(), "DEVICE_TYPES", ("cuda",))
    if device_type not in devices:
        return f"flash-attn needs CUDA tensors, got device {device_type}"
    if device_type == "cuda":
        index = device_index if device_index is not None else torch.cuda.current_device()
        if index not in _capability:
            _capability[index] = torch.cuda.get_device_capability(index)
        major, minor = _capability[index]
        if major < 8:
            return f"flash-attn 2 needs compute capability 8.0 or newer, got sm_{major}{minor}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn needs float16 or bfloat16, got {dtype}"
    if head_dim > 256:
        return f"flash-attn supports head dim <= 256, got {head_dim}"
    return None
