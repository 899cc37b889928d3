"""Re-exporting a subpackage's public names lazily: the one helper every ``__init__`` uses.

A subpackage's ``__init__`` maps each public name to the module that defines it and calls
:func:`lazy_exports`; a name is imported on first use (PEP 562), so importing one module of a
subpackage (``dtensor_ulysses.memory.tiling``) does not import its siblings (``offload`` and
``torch.distributed``): the layering test follows real import-time dependencies only. On first
use, a function's or class's ``__module__`` becomes the subpackage (``repr``, docs and pickling
say ``dtensor_ulysses.debug.CommCounter``, not the file it lives in), as
``torch.distributed.tensor.debug`` does. Only ``__init__`` files re-export.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose public name ``n`` lives in the submodule
    ``exports[n]`` (relative to ``package``)."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        module = getattr(value, "__module__", None)
        if callable(value) and isinstance(module, str) and module.startswith(package + "."):
            value.__module__ = package
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
