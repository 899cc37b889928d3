"""The optional dependencies of :mod:`dtensor_ulysses.hf`, checked once with one clear message."""

from __future__ import annotations

import functools

EXTRA = 'pip install -e ".[hf]" (in a clone of the repository)'
MIN_TRANSFORMERS = 5


@functools.cache
def require_transformers() -> str:
    """The installed transformers version; raises ImportError naming the extra otherwise."""
    try:
        import transformers
    except ImportError:
        raise ImportError(
            f"dtensor_ulysses.hf needs transformers >= {MIN_TRANSFORMERS}, safetensors and "
            f"tokenizers: {EXTRA}"
        ) from None
    version = transformers.__version__
    if int(version.split(".")[0]) < MIN_TRANSFORMERS:
        raise ImportError(
            f"dtensor_ulysses.hf needs transformers >= {MIN_TRANSFORMERS}, found {version}: {EXTRA}"
        )
    return version


require_transformers()
