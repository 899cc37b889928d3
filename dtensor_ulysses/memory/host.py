"""Host memory: the one host allocator, its weak registry, and the flag a tracer reads.

Every host tensor these features create is allocated by
:func:`host_empty` (:func:`to_host` is ``host_empty`` + copy), and the CPU optimizer math runs
inside :func:`host_compute`. While either runs, :func:`allocating_host` is true: a
``TorchDispatchMode`` that traces the real step under ``FakeTensorMode`` on CPU (where device and
host are both ``"cpu"``) counts the storages that ops create while ``allocating_host()`` as host
memory. Afterwards :func:`is_host` tells a registered host storage (keyed on
``id(t.untyped_storage())``, weakly: an entry disappears with its storage) and :func:`host_bytes`
sums the live ones.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch

__all__ = ["allocating_host", "host_bytes", "host_compute", "host_empty", "is_host", "to_host"]

_HOST: dict[int, int] = {}  # id(untyped storage) -> nbytes, while the storage lives
_STATE = threading.local()


def allocating_host() -> bool:
    """True inside :func:`host_empty` and :func:`host_compute`: ops allocate host memory now."""
    return getattr(_STATE, "depth", 0) > 0


@contextlib.contextmanager
def host_compute() -> Iterator[None]:
    """Mark a region whose allocations are host memory (the CPU optimizer step's temporaries)."""
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1


def host_empty(
    shape: torch.Size | tuple[int, ...], dtype: torch.dtype, *, pin: bool = False
) -> torch.Tensor:
    """The one allocation of host memory in this project: an empty CPU tensor, registered.

    ``pin``: page-locked (needed for asynchronous copies to and from CUDA; needs CUDA).
    """
    with host_compute():
        t = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)
    st = t.untyped_storage()
    key = id(st)
    _HOST[key] = st.nbytes()
    weakref.finalize(st, _HOST.pop, key, None)
    return t


def to_host(
    t: torch.Tensor,
    *,
    pin: bool | None = None,
    dtype: torch.dtype | None = None,
    non_blocking: bool = False,
) -> torch.Tensor:
    """A copy of ``t`` in (registered) host memory, contiguous, optionally cast to ``dtype``.

    ``pin=None``: pinned when ``t`` is on CUDA. ``non_blocking`` (pinned only): the copy is
    queued on the current CUDA stream; synchronize before the CPU reads the result.
    """
    if pin is None:
        pin = t.device.type == "cuda"
    host = host_empty(t.shape, dtype or t.dtype, pin=pin)
    host.copy_(t, non_blocking=non_blocking and pin)
    return host


def is_host(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage was allocated by :func:`host_empty` (and is still alive)."""
    return id(t.untyped_storage()) in _HOST


def host_bytes() -> int:
    """Bytes of all live host storages allocated by :func:`host_empty` in this process."""
    return sum(_HOST.values())
