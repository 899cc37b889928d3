"""Which local attention kernel runs what: the backends' declarations and the one choice.

Each backend declares, as a :class:`KernelSpec`, what it computes exactly: the features
(:class:`AttnFeatures`: packed documents, a sliding window, chunked attention, a logit softcap,
attention sinks, bidirectional blocks such as an image's tokens inside causal text attention;
causal or not is run by all), the device types (and those it has a backward on), the dtypes,
the largest head dim, GQA, and which features still hold inside ``torch.compile``.
:func:`choose_kernel` is the one choice: where the recipe is applied (``du.parallelize``,
``hf.apply_ulysses``, the trainer's checks) it picks, once per layer kind, the kernel for the
layer's declared features on a device and dtype, with and without packed documents, and for
ring attention's blocks; the :class:`KernelChoice` is stored on the layer
and the call path only looks it up. A refusal is an :class:`AttentionBackendError` (a
``ValueError``) naming the feature, the reason and the fix, before step 1.
:func:`select_backend` is the same rule for one set of features (what
:func:`~dtensor_ulysses.attention.local_attention` applies when called without a stored choice).
:class:`Kernel` writes down what a kernel the engine wraps is called with and may declare.

Backends (``BACKENDS``; ``"auto"`` picks among them in :data:`AUTO_ORDER`):

* ``"flash_attn"``: flash-attn 2 (``flash_attn_func``, ``flash_attn_varlen_func`` with
  ``window_size`` and ``softcap``) through the flash-attn seam; CUDA, fp16/bf16, head dim <= 256.
  Neither it, ``"sdpa"`` nor ``"torch_varlen"`` runs bidirectional blocks (they would need an
  ``S x S`` mask): a layer with them is refused there before step 1.
* ``"sdpa"``: :func:`torch.nn.functional.scaled_dot_product_attention`: plain (causal or not)
  attention; packed documents in eager code (one call per document).
* ``"flex"``: FlexAttention: a block mask (``(S/128)^2`` blocks, built from the document ids
  and block ids without an ``S x S`` tensor) for documents, windows, chunks and bidirectional
  blocks, ``score_mod`` for the softcap,
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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from dtensor_ulysses.attention._flash_seam import flash_problem
from dtensor_ulysses.plan.recipe import check_kernel_name

__all__ = [
    "AUTO_ORDER",
    "AttentionBackendError",
    "AttnFeatures",
    "BACKENDS",
    "ENV_VAR",
    "FEATURE_NAMES",
    "KERNELS",
    "Kernel",
    "KernelChoice",
    "KernelSpec",
    "check_backend",
    "choose_kernel",
    "describe_kernels",
    "force_backend",
    "model_kernels",
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
    "blocks": "bidirectional blocks inside causal attention (block_ids=: e.g. one image's tokens)",
}


class AttentionBackendError(ValueError, RuntimeError):
    """An attention backend that cannot run a layer's features here (a ``ValueError``; also a
    ``RuntimeError``). ``option`` names what to change: ``"backend"`` (the kernel asked for)
    or ``"compile"`` (no kernel runs the layer compiled)."""

    def __init__(self, message: str, option: str = "backend") -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class AttnFeatures:
    """What a layer's attention needs from the kernel (booleans: whether it is used)."""

    causal: bool = True
    window: bool = False
    chunk: bool = False
    softcap: bool = False
    sinks: bool = False
    docs: bool = False
    blocks: bool = False

    def used(self) -> tuple[str, ...]:
        """The features used, by name, in :data:`FEATURE_NAMES` order (``causal`` is run by
        every backend and not listed)."""
        return tuple(f for f in FEATURE_NAMES if getattr(self, f))

    @property
    def label(self) -> str:
        """The layer kind, for the start line and :attr:`KernelChoice.label` (e.g.
        ``"window, sinks"``; ``"causal"`` without features; documents are not a kind)."""
        return ", ".join(f for f in self.used() if f != "docs") or "causal"

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
        blocks: object = None,
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
            blocks=blocks is not None,
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


def check_backend(backend: Any) -> None:
    """``backend`` is ``"auto"`` or a kernel of this torch (:data:`BACKENDS`).

    Raises:
        ValueError: an unknown name (the one message, :func:`~dtensor_ulysses.plan.recipe.
            check_kernel_name`).
    """
    check_kernel_name(backend, f"backend={backend!r}", BACKENDS)


@contextlib.contextmanager
def force_backend(name: str) -> Iterator[None]:
    """Make ``backend="auto"`` resolve to ``name`` inside the block (for tests and benchmarks)."""
    check_kernel_name(name, f"force_backend({name!r})", tuple(KERNELS))
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
    check_backend(backend)
    source = f"backend={backend!r}"
    if backend == "auto" and _forced:
        backend, source = _forced[-1], f"force_backend({_forced[-1]!r})"
    elif backend == "auto" and os.environ.get(ENV_VAR, "auto") != "auto":
        backend = os.environ[ENV_VAR]
        source = f"{ENV_VAR}={backend!r}"
        check_kernel_name(backend, source, tuple(KERNELS), error=AttentionBackendError)
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


# ---------------------------------------------------------------------------------------------
# the one choice per layer kind, and the contract of a kernel
# ---------------------------------------------------------------------------------------------
# ring attention's blocks: the ring merges each block's output by its log-sum-exp, so only the
# kernels that return one run them: flash-attn blocks, or the ring's exact torch blocks
RING_KERNELS: tuple[str, ...] = ("flash_attn", "blockwise")


@dataclass(frozen=True)
class KernelChoice:
    """The kernel that runs one layer kind, chosen once by :func:`choose_kernel`.

    Attributes:
        requested: what was asked (``"auto"`` or a kernel name).
        plain: the kernel for calls without packed documents.
        packed: the kernel for calls with packed documents (``None``: none runs them).
        refusal: why ``packed`` is ``None`` (raised if packed documents arrive).
        ring: the kernel runs ring attention's blocks.
        label: the layer kind's features, for the start line (e.g. ``"window, sinks"``).
    """

    requested: str
    plain: str
    packed: str | None
    refusal: str | None = None
    ring: bool = False
    label: str = "causal"

    def name(self, docs: bool) -> str:
        """The kernel that runs a call with (``docs``) or without packed documents."""
        if not docs:
            return self.plain
        if self.packed is None:
            raise AttentionBackendError(self.refusal or "no kernel runs packed documents here")
        return self.packed

    def describe(self, docs: bool | None = None) -> str:
        """What runs, e.g. ``"sdpa"``, ``"ring of blockwise"``; ``docs=None``: both cases."""
        if docs is None:
            names = [self.plain] + ([self.packed] if self.packed not in (None, self.plain) else [])
            what = self.plain if len(names) == 1 else f"{self.plain} (packed: {self.packed})"
        else:
            what = self.name(docs)
        return f"ring of {what}" if self.ring else what


def _ring_choice(
    features: AttnFeatures, requested: str, source: str, device_type: str, dtype: torch.dtype,
    head_dim: int, compiled: bool, docs: bool | None, device_index: int | None,
) -> tuple[str, str | None, str | None]:  # fmt: skip
    extra = [f for f in features.used() if f != "docs"]
    if extra:
        raise AttentionBackendError(
            f"ring attention runs causal attention and packed documents, not "
            f"{', '.join(FEATURE_NAMES[f] for f in extra)}; train this model without a ring"
        )
    if compiled:
        raise AttentionBackendError(
            "ring attention under torch.compile: dynamo does not trace its point-to-point "
            "exchange (torch.distributed.P2POp) into the block's one graph; drop the compile "
            "or the ring",
            option="compile",
        )
    if requested not in ("auto", *RING_KERNELS):
        raise AttentionBackendError(
            f"{source} cannot run ring attention's blocks: the ring merges each block by its "
            f"log-sum-exp, which {requested} does not return; use 'auto', 'blockwise' (the "
            f"ring's exact torch blocks) or 'flash_attn'"
        )
    flash = KERNELS["flash_attn"].problem(AttnFeatures(), device_type=device_type, dtype=dtype,
                                          head_dim=head_dim, device_index=device_index)  # fmt: skip
    if requested == "blockwise":
        return "blockwise", "blockwise", None
    if requested == "flash_attn":
        if flash is not None:
            raise AttentionBackendError(
                f"{source} cannot run ring attention's blocks: {flash[1]}; use 'auto' or "
                f"'blockwise'"
            )
        refusal = (
            f"{source} with packed documents in ring attention: its blocks carry a document "
            f"mask flash-attn cannot apply; use 'auto' or 'blockwise' (documents masked exactly)"
        )
        if docs:
            raise AttentionBackendError(refusal)
        return "flash_attn", None, refusal
    # auto: flash-attn blocks where it runs (blocks crossing documents in the exact torch
    # kernel), else the exact torch blocks
    name = "flash_attn" if flash is None else "blockwise"
    return name, name, None


def choose_kernel(
    features: AttnFeatures,
    *,
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    requested: str = "auto",
    compiled: bool = False,
    ring: bool = False,
    docs: bool | None = None,
    device_index: int | None = None,
) -> KernelChoice:
    """The kernel for one layer kind: chosen once, where the recipe is applied.

    Args:
        features: the layer's declared features (``docs`` is ignored: see ``docs``).
        device_type: where it runs.
        dtype: the compute dtype of q, k, v (the autocast or mixed-precision dtype).
        head_dim: the head dim.
        requested: ``"auto"`` or a kernel name (``--attention-backend``, ``backend=``).
        compiled: the layer runs inside ``torch.compile``.
        ring: the kernel runs ring attention's blocks (:data:`RING_KERNELS`).
        docs: ``True``: packed documents will come (a kernel that cannot run them is refused
            now); ``False``: they will not; ``None``: unknown (the packed choice is made too,
            and a refusal is kept for the call that brings them).

    Raises:
        AttentionBackendError: (a ``ValueError``) a requested kernel that cannot run the layer
            here; the message names the feature, the reason and the fix.
    """
    check_backend(requested)
    label = features.label
    if ring:
        source = f"backend={requested!r}"
        r_plain, r_packed, r_refusal = _ring_choice(features, requested, source, device_type,
                                                    dtype, head_dim, compiled, docs,
                                                    device_index)  # fmt: skip
        return KernelChoice(requested, r_plain, r_packed, r_refusal, ring=True, label=label)
    kw: dict[str, Any] = dict(
        device_type=device_type, dtype=dtype, head_dim=head_dim, backend=requested,
        compiled=compiled, device_index=device_index,
    )  # fmt: skip
    base = AttnFeatures(**{**features.__dict__, "docs": False})
    with_docs = AttnFeatures(**{**features.__dict__, "docs": True})
    plain = select_backend(base, **kw) if docs is not True else None
    packed: str | None = None
    refusal = None
    if docs is not False:
        try:
            packed = select_backend(with_docs, **kw)
        except AttentionBackendError as e:
            if docs:
                raise
            refusal = str(e)
    if plain is None:  # packed documents always: the plain calls run what the packed ones run
        plain = packed
    assert plain is not None
    return KernelChoice(requested, plain, packed, refusal, label=label)


class Kernel(Protocol):
    """What the Ulysses engine (:class:`~dtensor_ulysses.attention.UlyssesAttention`) calls: a
    local attention on full-length, head-sharded tensors, and what it may declare.

    ``kernel(q[B, S, N, H], k[B, S, K, H], v[B, S, K, H], *, causal, softmax_scale, layout=None,
    doc_starts=None, doc_tensors=None, window=None, chunk=None, softcap=None, sinks=None,
    block_ids=None, block_spans=None, backend=...)`` returns ``o[B, S, N, H]`` and runs exactly:
    causal masking; packed documents (``doc_starts`` per row, or ``doc_tensors`` when
    ``takes_doc_tensors``; nothing crosses a document); a sliding window ``(left, right)``;
    chunks of ``C`` tokens; a logit softcap ``c * tanh(s / c)``; sinks ``[N]`` (one logit per q
    head in the denominator); bidirectional blocks: ``block_ids[B, S]`` (int, ``-1``: no block;
    the tokens of one image share an id), where key ``j`` is visible to query ``i`` if
    ``j <= i`` *or* both carry the same block id, and then also inside the window, the chunk
    and the document (a block lifts causality only); ``block_spans`` (per row, the blocks'
    ``(start, end)`` as host ints, eager code only) lets a kernel skip key blocks. A kernel
    that cannot run a feature it is handed raises a ``ValueError`` naming it; it never drops
    one.

    Declarations (class attributes, all optional; the engine reads them with these defaults):
        takes_doc_tensors: takes ``doc_tensors=`` (device tensors of the documents: what
            compiled code passes, no host ints) instead of ``doc_starts=`` (default ``False``).
        global_doc_starts: expects document starts in global positions over the full
            sequence (ring attention), not local to this rank's rows (default ``False``).
        defers_q: takes q as a :class:`~dtensor_ulysses.attention.DeferredQ` (default ``False``).
        kernel_choice: the :class:`KernelChoice` it runs (``None``: chosen per call).
        input_dim_order: ``input_dim_order(q) -> tuple | None``: the memory layout it reads
            without a copy (``(0, 2, 1, 3)``: ``[B, N, S, H]``); the engine unpacks into it.
    """

    takes_doc_tensors: ClassVar[bool]
    global_doc_starts: ClassVar[bool]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 **kwargs: Any) -> torch.Tensor: ...  # fmt: skip


def model_kernels(model: Any) -> list[KernelChoice]:
    """The stored choices of a model's attention layers (every module's ``kernel_choice``), in
    module order."""
    return [c for m in model.modules() if (c := getattr(m, "kernel_choice", None)) is not None]


def describe_kernels(choices: Sequence[KernelChoice], docs: bool | None = None) -> str:
    """The start line's kernels: ``"sdpa"`` for one layer kind, else per kind with its count,
    e.g. ``"blockwise (window, sinks) x 12, blockwise (sinks) x 12"``."""
    counts: dict[tuple[str, str], int] = {}
    for c in choices:
        key = (c.label, c.describe(docs))
        counts[key] = counts.get(key, 0) + 1
    if not counts:
        return "none chosen"
    if len(counts) == 1:
        return next(iter(counts))[1]
    return ", ".join(f"{what} ({label}) x {n}" for (label, what), n in counts.items())
