"""The local attention kernel: one place decides which kernel runs.

Legend: ``B`` batch, ``S`` sequence, ``N`` q heads, ``K`` kv heads (``N % K == 0``; q head ``i``
uses kv head ``i // (N // K)``), ``H`` head dim. All tensors are ``[B, S, heads, H]``.

Backends:

* ``"flash_attn"``: ``flash_attn.flash_attn_func`` from the flash-attn package (CUDA, fp16/bf16,
  head dim <= 256).
* ``"sdpa"``: :func:`torch.nn.functional.scaled_dot_product_attention` (any device and dtype;
  on CUDA it dispatches to PyTorch's own flash / cuDNN / memory-efficient kernels).
* ``"auto"``: ``flash_attn`` when the package imports and the inputs suit it, else ``sdpa``.

An explicitly requested backend that cannot run raises; it never silently becomes another. Tests
and benchmarks can pin the ``auto`` choice with :func:`force_backend` or the environment variable
``DTENSOR_ULYSSES_ATTENTION`` (``flash_attn`` or ``sdpa``). ``auto`` picks flash-attn only on a GPU
of compute capability 8.0 or newer (flash-attn 2's floor), else SDPA.

The flash-attn seam: every flash-attn call of the project (this module's dense and varlen calls,
the ring's blocks) goes through :func:`flash_attn_module`, the one place that resolves the module
providing ``flash_attn_func`` and ``flash_attn_varlen_func``. It imports ``flash_attn``, or the
module named by ``DTENSOR_ULYSSES_FLASH_ATTN_MODULE`` (read at the first lookup; spawned ranks
inherit it), or the module installed by :func:`use_flash_attn_module`. A module may list the
device types it runs on in ``DEVICE_TYPES`` (default ``("cuda",)``): the test suite's pure-PyTorch
double (``tests/flash_double.py``) says ``("cpu", "cuda")``, so the project's flash path runs on
CPU in CI.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_ulysses.attention.doc_tensors import DocTensors, build_doc_tensors, check_doc_starts

__all__ = [
    "BACKENDS",
    "DeferredQ",
    "LocalAttention",
    "starts_from_positions",
    "flash_attn_available",
    "flash_attn_module",
    "force_backend",
    "local_attention",
    "resolve_backend",
    "use_flash_attn_module",
]

BACKENDS = ("auto", "flash_attn", "sdpa")


class DeferredQ:
    """``q`` not computed yet: its shape, and a function that computes it.

    A model hands this to an attention module whose ``defers_q`` attribute is true (the Ulysses
    engine with ``overlap=True``), so that k and v can start moving before q is projected
    (DeepSpeed-Ulysses' overlap of the k/v all-to-all with the q projection). Calling it
    computes q; every other attention module receives q itself.
    """

    def __init__(self, compute, shape: Sequence[int]) -> None:
        self._compute, self.shape = compute, torch.Size(shape)

    def __call__(self) -> torch.Tensor:
        q = self._compute()
        if q.shape != self.shape:
            raise ValueError(f"the deferred q has shape {tuple(q.shape)}, not the announced "
                             f"{tuple(self.shape)}")  # fmt: skip
        return q

    def dim(self) -> int:
        return len(self.shape)


ENV_VAR = "DTENSOR_ULYSSES_ATTENTION"
_forced: str | None = None


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


def _flash_attn_func():
    module = flash_attn_module()
    return None if module is None else module.flash_attn_func


def flash_attn_available() -> bool:
    """Whether the flash-attn package imports in this environment."""
    return _flash_attn_func() is not None


@contextlib.contextmanager
def force_backend(name: str) -> Iterator[None]:
    """Make ``backend="auto"`` resolve to ``name`` inside the block (for tests and benchmarks)."""
    global _forced
    if name not in ("flash_attn", "sdpa"):
        raise ValueError(f"cannot force backend {name!r}; choose 'flash_attn' or 'sdpa'")
    previous, _forced = _forced, name
    try:
        yield
    finally:
        _forced = previous


def _flash_attn_problem(q: torch.Tensor) -> str | None:
    """Why flash-attn cannot run on ``q``, or ``None`` if it can."""
    if not flash_attn_available():
        return "the flash-attn package is not importable (in a clone: pip install -e '.[flash]')"
    devices = getattr(flash_attn_module(), "DEVICE_TYPES", ("cuda",))
    if q.device.type not in devices:
        return f"flash-attn needs CUDA tensors, got device {q.device}"
    if q.device.type == "cuda":
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        if index not in _capability:
            _capability[index] = torch.cuda.get_device_capability(index)
        major, minor = _capability[index]
        if major < 8:
            return f"flash-attn 2 needs compute capability 8.0 or newer, got sm_{major}{minor}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn needs float16 or bfloat16, got {q.dtype}"
    if q.shape[-1] > 256:
        return f"flash-attn supports head dim <= 256, got {q.shape[-1]}"
    return None


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """The concrete backend (``"flash_attn"`` or ``"sdpa"``) that runs for ``backend`` on ``q``.

    Raises:
        ValueError: unknown backend name.
        RuntimeError: an explicit backend that cannot run on these inputs.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        backend = _forced or os.environ.get(ENV_VAR) or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"{ENV_VAR}={backend!r} is not one of {BACKENDS[1:]}")
        if backend == "auto":
            return "flash_attn" if _flash_attn_problem(q) is None else "sdpa"
    if backend == "flash_attn":
        problem = _flash_attn_problem(q)
        if problem is not None:
            raise RuntimeError(f"backend='flash_attn' cannot run: {problem}; use backend='sdpa'")
    return backend


def starts_from_positions(position_ids_BS: torch.Tensor) -> list[list[int]]:
    """Per batch row, the token indices where a document starts: index 0, and every token whose
    position id is not its predecessor's plus one (ids restart at 0 per document)."""
    breaks_BS = torch.ones_like(position_ids_BS, dtype=torch.bool)
    breaks_BS[:, 1:] = position_ids_BS[:, 1:] != position_ids_BS[:, :-1] + 1
    return [row.nonzero().flatten().tolist() for row in breaks_BS.cpu()]


def _segments(starts: list[int], S: int) -> list[tuple[int, int]]:
    return list(zip(starts, starts[1:] + [S]))


def local_attention(
    q_BSNH: torch.Tensor,
    k_BSKH: torch.Tensor,
    v_BSKH: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    position_ids: torch.Tensor | None = None,
    doc_starts: Sequence[Sequence[int]] | None = None,
    doc_tensors: DocTensors | None = None,
) -> torch.Tensor:
    """Attention on local, full-length tensors; returns ``o[B, S, N, H]``.

    GQA/MQA: ``K`` may be smaller than ``N`` when it divides it.

    Packed documents: no token attends across a document boundary. Give the boundaries either as
    ``doc_starts`` (per batch row, the start indices, as in
    :attr:`~dtensor_ulysses.plan.SeqLayout.doc_starts`; no device sync) or as
    ``position_ids[B, S]`` restarting at 0 per document (see :func:`starts_from_positions`;
    reads the ids back to the host). flash-attn then runs ``flash_attn_varlen_func`` over the
    documents;
    SDPA runs once per document (exact, no ``[S, S]`` mask is built). A third form,
    ``doc_tensors`` (:class:`~dtensor_ulysses.attention.DocTensors`, what the model attaches to
    the layout once per step), serves compiled code: flash-attn gets its ``cu_seqlens`` as they
    are, and compiled SDPA a block-diagonal mask built on the device (``[B, 1, S, S]`` booleans;
    eager SDPA still runs per document); no Python int of the layout enters the graph.

    Raises:
        ValueError: ``N % K != 0``; ``doc_starts`` rows that do not rise strictly from 0 or reach
            past ``S``; both ``position_ids`` and ``doc_starts``.
    """
    N, K = q_BSNH.shape[2], k_BSKH.shape[2]
    if N % K:
        raise ValueError(f"{N} q heads are not a multiple of {K} kv heads")
    chosen = resolve_backend(backend, q_BSNH)
    if position_ids is not None:
        if doc_starts is not None:
            raise ValueError("pass position_ids or doc_starts, not both")
        if tuple(position_ids.shape) != tuple(q_BSNH.shape[:2]):
            raise ValueError(
                f"position_ids has shape {tuple(position_ids.shape)}; expected [B, S] = "
                f"{tuple(q_BSNH.shape[:2])}"
            )
        doc_starts = starts_from_positions(position_ids)
    if doc_tensors is not None:
        if doc_starts is not None:
            raise ValueError("pass doc_starts or doc_tensors, not both")
        if chosen == "flash_attn":
            return _flash_varlen(q_BSNH, k_BSKH, v_BSKH, doc_tensors, causal, softmax_scale)
        if torch.compiler.is_compiling():
            ids_BS = doc_tensors.doc_ids
            return _sdpa_doc_mask(q_BSNH, k_BSKH, v_BSKH, ids_BS, causal, softmax_scale)
        doc_starts = doc_tensors.doc_starts
    elif doc_starts is not None:
        check_doc_starts(doc_starts, q_BSNH.shape[0], q_BSNH.shape[1])
        if chosen == "flash_attn":
            doc_tensors = build_doc_tensors(doc_starts, q_BSNH.shape[1], q_BSNH.device)
            return _flash_varlen(q_BSNH, k_BSKH, v_BSKH, doc_tensors, causal, softmax_scale)
    if doc_starts is not None:
        S = q_BSNH.shape[1]
        out = []
        for b, row_starts in enumerate(doc_starts):
            for lo, hi in _segments(list(row_starts), S):
                out.append(
                    _sdpa(q_BSNH[b : b + 1, lo:hi], k_BSKH[b : b + 1, lo:hi],
                          v_BSKH[b : b + 1, lo:hi], causal, softmax_scale)
                )  # fmt: skip
        return torch.cat(out, dim=1).view(q_BSNH.shape[0], S, N, -1)
    if chosen == "flash_attn":
        return _flash_attn_func()(
            q_BSNH, k_BSKH, v_BSKH, dropout_p=0.0, softmax_scale=softmax_scale, causal=causal
        )
    return _sdpa(q_BSNH, k_BSKH, v_BSKH, causal, softmax_scale)


# the engine may hand over a layout's doc_tensors= (built once per step, not per layer)
local_attention.takes_doc_tensors = True  # type: ignore[attr-defined]


class LocalAttention(nn.Module):
    """The model's default ``inner_attention``: :func:`local_attention` on full-length tensors.

    ``forward(q, k, v, *, layout=None, doc_starts=None)`` takes ``[B, S, heads, H]`` tensors;
    packed documents come as a :class:`~dtensor_ulysses.plan.SeqLayout` (``layout``, on one
    rank) or as ``doc_starts`` (what the Ulysses engine passes after its exchange).
    ``du.parallelize`` wraps this module in the Ulysses engine; it keeps the kernel choice.

    Args:
        backend: ``"auto"``, ``"flash_attn"`` or ``"sdpa"``.
        causal: causal masking.
    """

    def __init__(self, backend: str = "auto", *, causal: bool = True) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
        self.backend = backend
        self.causal = causal
        _flash_attn_func()  # look flash-attn up now, eagerly, not inside a compiled forward

    takes_doc_tensors = True  # the engine may hand over doc_tensors= (compiled packed docs)

    def forward(self, q, k, v, *, layout=None, doc_starts=None, doc_tensors=None):
        if layout is not None and doc_starts is None and doc_tensors is None:
            if layout.doc_tensors is not None:
                doc_tensors = layout.doc_tensors
            else:
                doc_starts = layout.doc_starts
        return local_attention(
            q, k, v, causal=self.causal, backend=self.backend, doc_starts=doc_starts,
            doc_tensors=doc_tensors,
        )  # fmt: skip

    def input_dim_order(self, q: torch.Tensor) -> tuple[int, ...] | None:
        """The memory layout this kernel reads without a copy, for ``q``-like inputs: SDPA
        works on ``[B, N, S, H]`` (``(0, 2, 1, 3)`` of ``[B, S, N, H]``), flash-attn on
        ``[B, S, N, H]`` as it is (``None``). The Ulysses engine unpacks into it directly."""
        return (0, 2, 1, 3) if resolve_backend(self.backend, q) == "sdpa" else None

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, causal={self.causal}"


def _sdpa(q_BSNH, k_BSKH, v_BSKH, causal: bool, softmax_scale: float | None) -> torch.Tensor:
    o_BNSH = F.scaled_dot_product_attention(
        q_BSNH.transpose(1, 2),
        k_BSKH.transpose(1, 2),
        v_BSKH.transpose(1, 2),
        is_causal=causal,
        scale=softmax_scale,
        enable_gqa=k_BSKH.shape[2] != q_BSNH.shape[2],
    )
    return o_BNSH.transpose(1, 2)


def _sdpa_doc_mask(q_BSNH, k_BSKH, v_BSKH, doc_ids_BS, causal, softmax_scale) -> torch.Tensor:
    """SDPA with a block-diagonal (and causal) mask from the document index of every token."""
    S = q_BSNH.shape[1]
    mask_BSS = doc_ids_BS[:, :, None] == doc_ids_BS[:, None, :]
    if causal:
        mask_BSS = mask_BSS & torch.ones(S, S, dtype=torch.bool, device=q_BSNH.device).tril()
    o_BNSH = F.scaled_dot_product_attention(
        q_BSNH.transpose(1, 2),
        k_BSKH.transpose(1, 2),
        v_BSKH.transpose(1, 2),
        attn_mask=mask_BSS[:, None],
        scale=softmax_scale,
        enable_gqa=k_BSKH.shape[2] != q_BSNH.shape[2],
    )
    return o_BNSH.transpose(1, 2)


def _flash_varlen(q_BSNH, k_BSKH, v_BSKH, docs: DocTensors, causal, softmax_scale):
    """flash-attn over the documents of every row, flattened to ``[B*S, heads, H]``; the
    boundaries come as device tensors (no copy here); compiled, ``max_seqlen`` is ``S``."""
    flash_attn_varlen_func = flash_attn_module().flash_attn_varlen_func
    B, S, N, H = q_BSNH.shape
    longest = S if torch.compiler.is_compiling() else docs.max_seqlen
    o_TNH = flash_attn_varlen_func(
        q_BSNH.reshape(B * S, N, H),
        k_BSKH.reshape(B * S, -1, H),
        v_BSKH.reshape(B * S, -1, H),
        cu_seqlens_q=docs.cu_seqlens_q,
        cu_seqlens_k=docs.cu_seqlens_k,  # a distinct tensor: dynamo refuses one passed twice
        max_seqlen_q=longest,
        max_seqlen_k=longest,
        dropout_p=0.0,
        softmax_scale=softmax_scale,
        causal=causal,
    )
    return o_TNH.view(B, S, N, H)
