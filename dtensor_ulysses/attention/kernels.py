"""Which local attention kernel runs what: the backends' declarations and the one choice.

Each backend declares, as a :class:`KernelSpec`, what it computes exactly: the features
(:class:`AttnFeatures`: packed documents, a sliding window, chunked attention, a logit softcap,
attention sinks; causal or not is run by all), the device types (and those it has a backward
on), the dtypes, the largest head dim, GQA, and which features still hold inside
``torch.compile``. :func:`select_backend` picks the backend for a layer's features on a device,
or raises :class:`AttentionBackendError` (a ``ValueError``) naming the feature, the reason and
the fix. Callers call it when they build a layer, so a refusal comes before step 1;
:func:`~dtensor_ulysses.attention.local_attention` calls it again per call (cheap, no sync).

Backends (``BACKENDS``; ``"auto"`` picks among them in :data:`AUTO_ORDER`):

* ``"flash_attn"``: flash-attn 2 (``flash_attn_func``, ``flash_attn_varlen_func`` with
  ``window_size`` and ``softcap``) through the flash-attn seam; CUDA, fp16/bf16, head dim <= 256.
* ``"sdpa"``: :func:`torch.nn.functional.scaled_dot_product_attention`: plain (causal or not)
  attention; packed documents in eager code (one call per document).
* ``"flex"``: FlexAttention: a block mask (``(S/128)^2`` blocks, built from the document ids
  without an ``S x S`` tensor) for documents, windows and chunks, ``score_mod`` for the softcap,
  sinks through the log-sum-exp. A backward on CUDA only (torch 2.13 has none on CPU; its CPU
  forward is for inference and tests).
* ``"torch_varlen"``: ``torch.nn.attention.varlen.varlen_attn`` (present in this torch: listed
  only where it is): documents and windows on CUDA, fp16/bf16; explicit only (not yet checked on
  a GPU by this project's tests, so ``auto`` does not pick it).
* ``"blockwise"``: the exact pure-PyTorch kernel (``_blockwise.py``): every feature, any device
  and float dtype, memory linear in ``S``; what CPU training and compiled packed documents
  without a CUDA kernel use.

Forcing: :func:`force_backend` (a context manager) or ``DTENSOR_ULYSSES_ATTENTION=<name>``
makes ``backend="auto"`` resolve to that backend; if it cannot run the layer's features, the
call raises (never a silent switch).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dtensor_ulysses.attention._flash_seam import flash_problem

__all__ = [
    "AUTO_ORDER",
    "AttentionBackendError",
    "AttnFeatures",
    "BACKENDS",
    "ENV_VAR",
    "FEATURE_NAMES",
    "KERNELS",
    "KernelSpec",
    "force_backend",
    "select_backend",
]

ENV_VAR = "DTENSOR_ULYSSES_ATTENTION"
_forced: list[str] = []  # the innermost force_backend name, if any

# feature -> how a message names it
FEATURE_NAMES = {
    "docs": "packed documents (doc_starts= / doc_tensors= / position_ids=)",
    "window": "a sliding window (window=)",
    "chunk": "chunked attention (chunk=)",
    "softcap": "a logit softcap (softcap=)",
    "sinks": "attention sinks (sinks=)",
}


class AttentionBackendError(ValueError, RuntimeError):
    """An attention backend that cannot run a layer's features here (a ``ValueError``; also a
    ``RuntimeError``, what an unusable explicit backend raised before)."""


@dataclass(frozen=True)
class AttnFeatures:
    """What a layer's attention needs from the kernel (booleans: whether it is used)."""

    causal: bool = True
    window: bool = False
    chunk: bool = False
    softcap: bool = False
    sinks: bool = False
    docs: bool = False

    def used(self) -> tuple[str, ...]:
        """The features used, by name, in :data:`FEATURE_NAMES` order (``causal`` is run by
        every backend and not listed)."""
        return tuple(f for f in FEATURE_NAMES if getattr(self, f))

    @classmethod
    def of(
        cls,
        *,
        causal: bool = True,
        window: tuple[int, int] | None = None,
        chunk: int | None = None,
        softcap: float | None = None,
        sinks: object = None,
        docs: bool = False,
    ) -> AttnFeatures:
        """The features of :func:`~dtensor_ulysses.attention.local_attention`'s arguments
        (``window=(-1, -1)`` and ``softcap=0`` are no window, no softcap)."""
        return cls(
            causal=bool(causal),
            window=window is not None and tuple(window) != (-1, -1),
            chunk=chunk is not None,
            softcap=bool(softcap),
            sinks=sinks is not None,
            docs=bool(docs),
        )


_ANY_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class KernelSpec:
    """What one backend runs exactly.

    Attributes:
        name: the backend's name (``backend=``).
        features: the features it runs in eager code.
        compiled_features: the features it runs inside ``torch.compile``.
        device_types: where its forward runs.
        backward_device_types: where it also has a backward (training).
        dtypes: the input dtypes it takes.
        max_head_dim: the largest head dim (``None``: any).
        gqa: fewer kv heads than q heads (``K`` dividing ``N``).
        in_auto: whether ``backend="auto"`` may pick it.
    """

    name: str
    features: frozenset[str]
    compiled_features: frozenset[str]
    device_types: tuple[str, ...]
    backward_device_types: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...] = _ANY_FLOAT
    max_head_dim: int | None = None
    gqa: bool = True
    in_auto: bool = True

    def problem(
        self,
        features: AttnFeatures,
        *,
        device_type: str,
        dtype: torch.dtype,
        head_dim: int,
        compiled: bool = False,
        device_index: int | None = None,
    ) -> tuple[str, str] | None:
        """``(what, why)`` this backend cannot run, or ``None``: it runs them exactly."""
        if self.name == "flash_attn":
            why = flash_problem(device_type, dtype, head_dim, device_index)
            if why is not None:
                return "flash-attn", why
        if self.name == "torch_varlen" and not _has_torch_varlen():
            return "torch_varlen", f"torch {torch.__version__} has no torch.nn.attention.varlen"
        if device_type not in self.device_types:
            return "device", f"it runs on {'/'.join(self.device_types)}, not {device_type}"
        if dtype not in self.dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in self.dtypes)
            return "dtype", f"it takes {names}, not {str(dtype).replace('torch.', '')}"
        if self.max_head_dim is not None and head_dim > self.max_head_dim:
            return "head_dim", f"it takes head dim <= {self.max_head_dim}, not {head_dim}"
        runs = self.compiled_features if compiled else self.features
        for f in features.used():
            if f not in runs:
                where = " inside torch.compile" if compiled and f in self.features else ""
                return f, f"it does not run {FEATURE_NAMES[f]}{where}"
        return None


def _has_torch_varlen() -> bool:
    try:
        from torch.nn.attention import varlen  # noqa: F401
    except ImportError:
        return False
    return True


_ALL = frozenset(FEATURE_NAMES)
_SPECS = [
    KernelSpec(
        "flash_attn",
        features=frozenset({"docs", "window", "chunk", "softcap"}),
        compiled_features=frozenset({"docs", "window", "softcap"}),
        device_types=("cuda", "cpu"),  # the seam's module narrows it (DEVICE_TYPES)
        backward_device_types=("cuda", "cpu"),
        dtypes=_HALF,
        max_head_dim=256,
    ),
    KernelSpec(
        "sdpa",
        features=frozenset({"docs"}),
        compiled_features=frozenset(),
        device_types=("cuda", "cpu", "xpu", "mps", "hpu", "meta"),
        backward_device_types=("cuda", "cpu", "xpu", "mps", "hpu", "meta"),
    ),
    KernelSpec(
        "flex",
        features=_ALL,
        compiled_features=_ALL,
        device_types=("cuda", "cpu"),
        backward_device_types=("cuda",),
        dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
    ),
    KernelSpec(
        "torch_varlen",
        features=frozenset({"docs", "window", "chunk"}),
        compiled_features=frozenset({"docs", "window"}),
        device_types=("cuda",),
        backward_device_types=("cuda",),
        dtypes=_HALF,
        max_head_dim=256,
        in_auto=False,
    ),
    KernelSpec(
        "blockwise",
        features=_ALL,
        compiled_features=_ALL,
        device_types=("cuda", "cpu", "xpu", "mps", "hpu", "meta"),
        backward_device_types=("cuda", "cpu", "xpu", "mps", "hpu", "meta"),
    ),
]
KERNELS: dict[str, KernelSpec] = {
    s.name: s for s in _SPECS if s.name != "torch_varlen" or _has_torch_varlen()
}
BACKENDS: tuple[str, ...] = ("auto", *KERNELS)
# auto: the first that runs the features; flex only where it trains (CUDA); blockwise always runs
AUTO_ORDER: tuple[str, ...] = ("flash_attn", "sdpa", "flex", "blockwise")


@contextlib.contextmanager
def force_backend(name: str) -> Iterator[None]:
    """Make ``backend="auto"`` resolve to ``name`` inside the block (for tests and benchmarks)."""
    if name not in KERNELS:
        raise ValueError(f"cannot force backend {name!r}; choose one of {tuple(KERNELS)}")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


def _fix(
    features: AttnFeatures,
    device_type: str,
    dtype,
    head_dim: int,
    compiled: bool,
    device_index: int | None = None,
) -> str:
    able = [
        n
        for n, s in KERNELS.items()
        if device_type in s.backward_device_types
        and s.problem(features, device_type=device_type, dtype=dtype, head_dim=head_dim,
                      compiled=compiled, device_index=device_index) is None
    ]  # fmt: skip
    if not able:
        return "no backend runs these features here"
    return (
        f"use backend='auto' or one of {able} (these train with "
        f"{', '.join(features.used()) or 'plain attention'} on {device_type}"
        f"{' compiled' if compiled else ''})"
    )


def select_backend(
    features: AttnFeatures,
    *,
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    backend: str = "auto",
    compiled: bool = False,
    device_index: int | None = None,
) -> str:
    """The backend that runs ``features`` exactly on this device, dtype and head dim.

    ``backend="auto"`` (unless forced, see the module docstring) takes the first of
    :data:`AUTO_ORDER` that runs them (``flex`` only on a device where it has a backward); an
    explicit name must run them.

    Raises:
        ValueError: an unknown backend name.
        AttentionBackendError: (a ``ValueError``) a backend that cannot run a feature here:
            the message names the feature, the reason and the fix.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    source = f"backend={backend!r}"
    if backend == "auto" and _forced:
        backend, source = _forced[-1], f"force_backend({_forced[-1]!r})"
    elif backend == "auto" and os.environ.get(ENV_VAR, "auto") != "auto":
        backend = os.environ[ENV_VAR]
        source = f"{ENV_VAR}={backend!r}"
        if backend not in KERNELS:
            raise AttentionBackendError(f"{source} is not one of {tuple(KERNELS)}")
    kw = dict(device_type=device_type, dtype=dtype, head_dim=head_dim, compiled=compiled)
    if backend != "auto":
        problem = KERNELS[backend].problem(features, device_index=device_index, **kw)  # type: ignore[arg-type]
        if problem is None:
            return backend
        what, why = problem
        raise AttentionBackendError(
            f"{source} cannot run {what}: {why}; {_fix(features, device_index=device_index, **kw)}"  # type: ignore[arg-type]
        )
    reasons = []
    for name in AUTO_ORDER:
        spec = KERNELS[name]
        if device_type not in spec.backward_device_types:
            reasons.append(f"{name}: no backward on {device_type}")
            continue
        problem = spec.problem(features, device_index=device_index, **kw)  # type: ignore[arg-type]
        if problem is None:
            return name
        reasons.append(f"{name}: {problem[1]}")
    raise AttentionBackendError(
        f"no attention backend runs {', '.join(features.used()) or 'attention'} on "
        f"{device_type} {dtype} head dim {head_dim}: {'; '.join(reasons)}"
    )
