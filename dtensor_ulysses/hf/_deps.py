"""The optional dependencies of :mod:`dtensor_ulysses.hf`, checked once with one clear message.

Imported by the package's ``__init__``, so ``import dtensor_ulysses.hf`` (or any of its modules)
without ``transformers`` raises one ``ImportError`` line naming the extra to install. The check
reads the installed version without importing ``transformers`` (importing the package stays
cheap; its names import transformers on first use).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util

__all__ = ["EXTRA", "MIN_TRANSFORMERS", "require_transformers"]

EXTRA = 'pip install -e ".[hf]" (in a clone of the repository)'
MIN_TRANSFORMERS = 5


@functools.cache
def require_transformers() -> str:
    """The installed transformers version; raises ImportError naming the extra otherwise."""
    need = f"dtensor_ulysses.hf needs transformers >= {MIN_TRANSFORMERS}"
    try:
        found = importlib.util.find_spec("transformers") is not None
        version = importlib.metadata.version("transformers") if found else None
    except (ImportError, importlib.metadata.PackageNotFoundError, ValueError):
        version = None
    if version is None:
        raise ImportError(f"{need}, safetensors and tokenizers: {EXTRA}") from None
    if int(version.split(".")[0]) < MIN_TRANSFORMERS:
        raise ImportError(f"{need}, found {version}: {EXTRA}")
    return version


require_transformers()
