"""The local attention kernel: one function, many backends, one place that decides which runs.

Legend: ``B`` batch, ``S`` sequence, ``N`` q heads, ``K`` kv heads (``N % K == 0``; q head ``i``
uses kv head ``i // (N // K)``), ``H`` head dim (``Hv`` v's, when it differs: multi-head latent
attention). All tensors are ``[B, S, heads, H]``.

:func:`local_attention` computes attention on full-length tensors with any combination of:
causal masking, packed documents (nothing crosses a document boundary), a sliding window
``(left, right)`` (flash-attn's convention: key ``j`` is visible to query ``i`` iff
``i - left <= j <= i + right``, ``-1`` an unlimited side), chunked attention (``j // C == i // C``),
a logit softcap (``c * tanh(s / c)``), attention sinks (a logit per q head that joins the
softmax denominator) and bidirectional blocks inside causal attention (``block_ids``: the tokens
of one image see each other both ways; the other rules still apply). The backends, what each
runs, and the choice (``backend="auto"``, :func:`force_backend`, ``DTENSOR_ULYSSES_ATTENTION``)
are in
:mod:`dtensor_ulysses.attention.kernels`; an explicitly requested backend that cannot run the
features raises, it never silently becomes another.

The flash-attn seam (``_flash_seam.py``): every flash-attn call of the project goes through
:func:`flash_attn_module`, which imports ``flash_attn``, or the module named by
``DTENSOR_ULYSSES_FLASH_ATTN_MODULE``, or the one installed by :func:`use_flash_attn_module` (the
test suite's pure-PyTorch double runs the flash path on CPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_ulysses.attention._blockwise import blockwise_attention
from dtensor_ulysses.attention._flash_seam import (
    FLASH_MODULE_ENV,
    _capability,
    flash_attn_available,
    flash_attn_module,
    flash_problem,
    use_flash_attn_module,
)
from dtensor_ulysses.attention._flex import flex_attention
from dtensor_ulysses.attention.doc_tensors import (
    DocTensors,
    build_block_ids,
    build_doc_tensors,
    check_doc_starts,
)
from dtensor_ulysses.attention.kernels import (
    BACKENDS,
    ENV_VAR,
    FEATURE_NAMES,
    KERNELS,
    AttentionBackendError,
    AttnFeatures,
    KernelChoice,
    check_backend,
    force_backend,
    select_backend,
)

__all__ = [
    "BACKENDS",
    "DeferredQ",
    "ENV_VAR",
    "FLASH_MODULE_ENV",
    "LocalAttention",
    "starts_from_positions",
    "flash_attn_available",
    "flash_attn_module",
    "force_backend",
    "local_attention",
    "resolve_backend",
    "use_flash_attn_module",
]

_ = _capability  # re-exported for tests that pin a GPU's compute capability


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


def _flash_attn_func():
    module = flash_attn_module()
    return None if module is None else module.flash_attn_func


def _flash_attn_problem(q: torch.Tensor) -> str | None:
    """Why flash-attn cannot run on ``q``, or ``None`` if it can."""
    return flash_problem(q.device.type, q.dtype, q.shape[-1], q.device.index)


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """The concrete backend that runs plain (causal or not) attention for ``backend`` on ``q``
    (:func:`~dtensor_ulysses.attention.select_backend` without features).

    Raises:
        AttentionBackendError: (a ``ValueError`` and a ``RuntimeError``) an unknown name, or an
            explicit backend that cannot run on these inputs.
    """
    return select_backend(AttnFeatures(), device_type=q.device.type, dtype=q.dtype,
                          head_dim=q.shape[-1], backend=backend,
                          device_index=q.device.index)  # fmt: skip


def starts_from_positions(position_ids_BS: torch.Tensor) -> list[list[int]]:
    """Per batch row, the token indices where a document starts: index 0, and every token whose
    position id is not its predecessor's plus one (ids restart at 0 per document)."""
    breaks_BS = torch.ones_like(position_ids_BS, dtype=torch.bool)
    breaks_BS[:, 1:] = position_ids_BS[:, 1:] != position_ids_BS[:, :-1] + 1
    return [row.nonzero().flatten().tolist() for row in breaks_BS.cpu()]


def _segments(starts: list[int], S: int) -> list[tuple[int, int]]:
    return list(zip(starts, starts[1:] + [S]))


def _check_window(window) -> tuple[int, int]:
    if window is None:
        return (-1, -1)
    try:
        left, right = (int(x) for x in window)
    except (TypeError, ValueError):
        raise ValueError(f"window={window!r} must be a pair (left, right) of ints") from None
    if left < -1 or right < -1:
        raise ValueError(
            f"window={window!r}: each side is a number of tokens >= 0, or -1 (unlimited); "
            f"a causal sliding window of W tokens is window=(W - 1, 0)"
        )
    return (left, right)


def _check_scalars(chunk, softcap, sinks, N: int) -> None:
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk={chunk!r} must be an int >= 1 (tokens per attention chunk)")
    if softcap is not None and not softcap >= 0:
        raise ValueError(f"softcap={softcap!r} must be a float > 0 (or None: no softcap)")
    if sinks is not None and tuple(sinks.shape) != (N,):
        raise ValueError(
            f"sinks has shape {tuple(sinks.shape)}; expected [N] = ({N},), one logit per q "
            f"head of this call (the Ulysses engine slices a layer's sinks to its heads)"
        )


def local_attention(
    q_BSNH: torch.Tensor,
    k_BSKH: torch.Tensor,
    v_BSKH: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str | KernelChoice = "auto",
    position_ids: torch.Tensor | None = None,
    doc_starts: Sequence[Sequence[int]] | None = None,
    doc_tensors: DocTensors | None = None,
    window: tuple[int, int] | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    block_ids: torch.Tensor | None = None,
    block_spans: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> torch.Tensor:
    """Attention on local, full-length tensors; returns ``o[B, S, N, H]``.

    GQA/MQA: ``K`` may be smaller than ``N`` when it divides it (every backend).

    Packed documents: no token attends across a document boundary. Give the boundaries either as
    ``doc_starts`` (per batch row, the start indices, as in
    :attr:`~dtensor_ulysses.plan.SeqLayout.doc_starts`; no device sync), as
    ``position_ids[B, S]`` restarting at 0 per document (see :func:`starts_from_positions`;
    reads the ids back to the host), or as ``doc_tensors``
    (:class:`~dtensor_ulysses.attention.DocTensors`, what the model attaches to the layout once
    per step; compiled code uses it: no Python int of the layout enters the graph). A window and
    a chunk apply on top of the documents (a window never crosses a document).

    Args:
        causal: key ``j`` is visible to query ``i`` only if ``j <= i``.
        softmax_scale: the score scale (default ``H ** -0.5``).
        backend: ``"auto"`` or a name of :data:`~dtensor_ulysses.attention.BACKENDS`, or the
            :class:`~dtensor_ulysses.attention.KernelChoice` chosen for the layer (looked up
            for this call's documents, never chosen again).
        window: ``(left, right)``: key ``j`` visible to query ``i`` iff
            ``i - left <= j <= i + right`` (``-1``: that side unlimited); ``None``: no window.
        chunk: ``C``: key ``j`` visible to query ``i`` iff ``j // C == i // C`` (indices of the
            full-length rows).
        softcap: ``c``: scores become ``c * tanh(s / c)`` with ``s = softmax_scale * q.k``.
        sinks: ``[N]``, one logit per q head: ``exp(sinks[h])`` joins the softmax denominator
            of head ``h`` (no value); differentiable.
        block_ids: ``[B, S]`` ints: bidirectional blocks (``-1``: a token in none). With
            ``causal``, key ``j`` is visible to query ``i`` if ``j <= i`` or
            ``block_ids[b, i] == block_ids[b, j] >= 0`` (Gemma 3's image tokens); the window,
            chunk and documents still apply. Kernels: ``flex`` and ``blockwise``.
        block_spans: per row, each block's ``(start, end)`` (host ints, optional: lets the
            blockwise kernel skip the key blocks no block reaches).

    Raises:
        ValueError: ``N % K != 0``; ``doc_starts`` rows that do not rise strictly from 0 or reach
            past ``S``; both ``position_ids`` and ``doc_starts``; a malformed window, chunk,
            softcap or sinks; a backend that cannot run these features here
            (:class:`~dtensor_ulysses.attention.AttentionBackendError`, naming the fix).
    """
    B, S, N, H = q_BSNH.shape
    K = k_BSKH.shape[2]
    if N % K:
        raise ValueError(f"{N} q heads are not a multiple of {K} kv heads")
    win = _check_window(window)
    _check_scalars(chunk, softcap, sinks, N)
    if block_ids is not None and (
        tuple(block_ids.shape) != (B, S) or block_ids.is_floating_point()
    ):
        raise ValueError(
            f"block_ids has shape {tuple(block_ids.shape)} and dtype {block_ids.dtype}; expected "
            f"[B, S] = {(B, S)} ints (-1: a token in no bidirectional block)"
        )
    if position_ids is not None:
        if doc_starts is not None:
            raise ValueError("pass position_ids or doc_starts, not both")
        if tuple(position_ids.shape) != (B, S):
            raise ValueError(
                f"position_ids has shape {tuple(position_ids.shape)}; expected [B, S] = {(B, S)}"
            )
        doc_starts = starts_from_positions(position_ids)
    if doc_tensors is not None:
        if doc_starts is not None:
            raise ValueError("pass doc_starts or doc_tensors, not both")
    elif doc_starts is not None:
        check_doc_starts(doc_starts, B, S)
    compiled = torch.compiler.is_compiling()
    docs = doc_starts is not None or doc_tensors is not None
    features = AttnFeatures.of(causal=causal, window=window, chunk=chunk, softcap=softcap,
                               sinks=sinks, docs=docs, blocks=block_ids)  # fmt: skip
    if isinstance(backend, KernelChoice):  # chosen once where the recipe was applied: read
        chosen = _stored(backend, features, compiled)
    else:  # a direct call with a name: the one rule, for this call's features
        chosen = select_backend(features, device_type=q_BSNH.device.type, dtype=q_BSNH.dtype,
                                head_dim=H, backend=backend, compiled=compiled,
                                device_index=q_BSNH.device.index)  # fmt: skip
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q_BSNH, k_BSKH, v_BSKH, sinks)
    )
    if needs_grad and q_BSNH.device.type not in KERNELS[chosen].backward_device_types:
        raise AttentionBackendError(
            f"backend={chosen!r} has no backward on {q_BSNH.device.type} (torch "
            f"{torch.__version__}); train with backend='auto' or 'blockwise', or run it under "
            f"torch.no_grad()"
        )
    # the documents as host ints, where known without a sync (never inside a compiled graph)
    host_starts: list[list[int]] | None = None
    if doc_starts is not None:
        host_starts = [list(row) for row in doc_starts]
    elif doc_tensors is not None and not compiled:
        host_starts = [list(row) for row in doc_tensors.doc_starts]
    call = _Call(
        causal=causal, softmax_scale=softmax_scale,
        scale=H**-0.5 if softmax_scale is None else float(softmax_scale), window=win,
        chunk=chunk, softcap=softcap, sinks=sinks, doc_starts=doc_starts,
        doc_tensors=doc_tensors, host_starts=host_starts, block_ids=block_ids,
        block_spans=None if compiled else block_spans, compiled=compiled,
    )  # fmt: skip
    run = _RUNNERS[chosen]
    Hv = v_BSKH.shape[3]
    if Hv == H or chosen == "sdpa":  # SDPA alone takes v's own head dim
        return run(q_BSNH, k_BSKH, v_BSKH, call)
    # multi-head latent attention on a kernel that wants one head dim: the shorter side padded
    # with zeros to max(H, Hv) (zero columns of q and k add nothing to a score, zero columns of
    # v give zero output columns, dropped), with the scale of the unpadded H; exact
    call = dataclasses.replace(call, softmax_scale=call.scale)
    if Hv < H:
        return run(q_BSNH, k_BSKH, F.pad(v_BSKH, (0, H - Hv)), call)[..., :Hv]
    return run(F.pad(q_BSNH, (0, Hv - H)), F.pad(k_BSKH, (0, Hv - H)), v_BSKH, call)


# the engine may hand over a layout's doc_tensors= (built once per step, not per layer)
local_attention.takes_doc_tensors = True  # type: ignore[attr-defined]


def _stored(choice: KernelChoice, features: AttnFeatures, compiled: bool) -> str:
    """The kernel a stored :class:`~dtensor_ulysses.attention.KernelChoice` names for this
    call (with or without documents), never chosen again. A call that brings a feature the
    stored kernel does not run (the layer declared less when its kernel was chosen) is an
    error, not another kernel."""
    name = choice.name(features.docs)
    runs = KERNELS[name].compiled_features if compiled else KERNELS[name].features
    extra = [f for f in features.used() if f not in runs]
    if extra:
        where = " inside torch.compile" if compiled else ""
        raise AttentionBackendError(
            f"the layer's stored kernel {name!r} (chosen for {choice.label!r} layers) does not "
            f"run {FEATURE_NAMES[extra[0]]}{where}, which this call brings; declare the feature "
            f"where the layer's kernel is chosen"
        )
    return name


@dataclass(frozen=True)
class _Call:
    """One call's resolved arguments, as every kernel runner takes them."""

    causal: bool
    softmax_scale: float | None  # as given (flash-attn and SDPA default it themselves)
    scale: float  # resolved
    window: tuple[int, int]  # (-1, -1): none
    chunk: int | None
    softcap: float | None
    sinks: torch.Tensor | None
    doc_starts: Sequence[Sequence[int]] | None
    doc_tensors: DocTensors | None
    host_starts: list[list[int]] | None  # the documents as host ints, when known without a sync
    block_ids: torch.Tensor | None
    block_spans: Sequence[Sequence[tuple[int, int]]] | None  # eager only
    compiled: bool

    def masks(self, q_BSNH: torch.Tensor) -> dict[str, Any]:
        """The mask arguments of the flex and blockwise kernels."""
        doc_ids_BS = None
        if self.doc_tensors is not None:
            doc_ids_BS = self.doc_tensors.doc_ids
        elif self.doc_starts is not None:
            doc_ids_BS = build_doc_tensors(self.doc_starts, q_BSNH.shape[1], q_BSNH.device).doc_ids
        return dict(scale=self.scale, causal=self.causal, window=self.window,
                    chunk=self.chunk or 0, softcap=float(self.softcap or 0.0),
                    sinks_N=self.sinks, doc_ids_BS=doc_ids_BS,
                    block_ids_BS=self.block_ids)  # fmt: skip


def _run_flex(q_BSNH, k_BSKH, v_BSKH, c: _Call) -> torch.Tensor:
    return flex_attention(q_BSNH, k_BSKH, v_BSKH, **c.masks(q_BSNH))


def _run_blockwise(q_BSNH, k_BSKH, v_BSKH, c: _Call) -> torch.Tensor:
    return blockwise_attention(q_BSNH, k_BSKH, v_BSKH, doc_starts=c.host_starts,
                               block_spans=c.block_spans, **c.masks(q_BSNH))  # fmt: skip


def _varlen_docs(q_BSNH: torch.Tensor, c: _Call) -> DocTensors | None:
    """The documents of a varlen kernel as device tensors; chunks are documents too (every
    document cut at multiples of ``C``)."""
    B, S = q_BSNH.shape[:2]
    doc_starts, doc_tensors = c.doc_starts, c.doc_tensors
    if c.chunk is not None:
        rows = c.host_starts or [[0]] * B
        doc_starts = [sorted(set(row) | set(range(0, S, c.chunk))) for row in rows]
        doc_tensors = None
    if doc_tensors is None and doc_starts is not None:
        doc_tensors = build_doc_tensors(doc_starts, S, q_BSNH.device)
    return doc_tensors


def _run_flash(q_BSNH, k_BSKH, v_BSKH, c: _Call) -> torch.Tensor:
    docs = _varlen_docs(q_BSNH, c)
    extra: dict[str, Any] = {}
    if c.window != (-1, -1):
        extra["window_size"] = c.window
    if c.softcap:
        extra["softcap"] = float(c.softcap)
    if docs is not None:
        return _flash_varlen(q_BSNH, k_BSKH, v_BSKH, docs, c.causal, c.softmax_scale, **extra)
    return _flash_attn_func()(q_BSNH, k_BSKH, v_BSKH, dropout_p=0.0,
                              softmax_scale=c.softmax_scale, causal=c.causal, **extra)  # fmt: skip


def _run_torch_varlen(q_BSNH, k_BSKH, v_BSKH, c: _Call) -> torch.Tensor:
    return _torch_varlen(q_BSNH, k_BSKH, v_BSKH, _varlen_docs(q_BSNH, c), c.causal, c.scale,
                         c.window)  # fmt: skip


def _run_sdpa(q_BSNH, k_BSKH, v_BSKH, c: _Call) -> torch.Tensor:
    """Plain attention; packed documents one call per document (eager only)."""
    if c.host_starts is None:
        return _sdpa(q_BSNH, k_BSKH, v_BSKH, c.causal, c.softmax_scale)
    B, S, N, _ = q_BSNH.shape
    out = []
    for b, row_starts in enumerate(c.host_starts):
        for lo, hi in _segments(list(row_starts), S):
            out.append(
                _sdpa(q_BSNH[b : b + 1, lo:hi], k_BSKH[b : b + 1, lo:hi],
                      v_BSKH[b : b + 1, lo:hi], c.causal, c.softmax_scale)
            )  # fmt: skip
    return torch.cat(out, dim=1).view(B, S, N, -1)


# every kernel's runner, by the name the choice stores (a test holds it equal to KERNELS)
_RUNNERS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, _Call], torch.Tensor]] = {
    "flash_attn": _run_flash,
    "sdpa": _run_sdpa,
    "flex": _run_flex,
    "torch_varlen": _run_torch_varlen,
    "blockwise": _run_blockwise,
}


class LocalAttention(nn.Module):
    """The model's default ``inner_attention``: :func:`local_attention` on full-length tensors.

    ``forward(q, k, v, *, layout=None, doc_starts=None, doc_tensors=None, **features)`` takes
    ``[B, S, heads, H]`` tensors; packed documents come as a
    :class:`~dtensor_ulysses.plan.SeqLayout` (``layout``, on one rank) or as ``doc_starts`` /
    ``doc_tensors`` (what the Ulysses engine passes after its exchange); ``features``
    (``window``, ``chunk``, ``softcap``, ``sinks``) override the module's own.
    ``du.parallelize`` wraps this module in the Ulysses engine; it keeps the kernel choice.

    Args:
        backend: ``"auto"`` or a name of :data:`~dtensor_ulysses.attention.BACKENDS`.
        causal: causal masking.
        window: a sliding window ``(left, right)`` (see :func:`local_attention`).
        chunk: chunked attention, ``C`` tokens per chunk.
        softcap: a logit softcap.
    """

    def __init__(
        self,
        backend: str = "auto",
        *,
        causal: bool = True,
        window: tuple[int, int] | None = None,
        chunk: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        check_backend(backend)
        self.backend = backend
        self.causal = causal
        self.window = None if window is None else _check_window(window)
        _check_scalars(chunk, softcap, None, 1)
        self.chunk, self.softcap = chunk, softcap
        self.kernel_choice: KernelChoice | None = None  # set where the recipe is applied
        _flash_attn_func()  # look flash-attn up now, eagerly, not inside a compiled forward

    takes_doc_tensors = True  # the engine may hand over doc_tensors= (compiled packed docs)

    def forward(self, q, k, v, *, layout=None, doc_starts=None, doc_tensors=None, **features):
        kw: dict[str, Any] = dict(window=self.window, chunk=self.chunk, softcap=self.softcap)
        if layout is not None and doc_starts is None and doc_tensors is None:
            if layout.doc_tensors is not None:
                doc_tensors = layout.doc_tensors
            else:
                doc_starts = layout.doc_starts
        if layout is not None and layout.blocks is not None:
            kw.update(block_ids=_layout_block_ids(layout, q.device), block_spans=layout.blocks)
        kw.update(features)
        return local_attention(
            q, k, v, causal=self.causal, backend=self.kernel_choice or self.backend,
            doc_starts=doc_starts,
            doc_tensors=doc_tensors, **kw,
        )  # fmt: skip

    def input_dim_order(self, q: torch.Tensor) -> tuple[int, ...] | None:
        """The memory layout this kernel reads without a copy, for ``q``-like inputs: SDPA
        works on ``[B, N, S, H]`` (``(0, 2, 1, 3)`` of ``[B, S, N, H]``), flash-attn on
        ``[B, S, N, H]`` as it is (``None``). The Ulysses engine unpacks into it directly."""
        if self.kernel_choice is not None:
            chosen = self.kernel_choice.plain
            return (0, 2, 1, 3) if chosen in ("sdpa", "flex") else None
        features = AttnFeatures.of(causal=self.causal, window=self.window, chunk=self.chunk,
                                   softcap=self.softcap)  # fmt: skip
        try:
            chosen = select_backend(features, device_type=q.device.type, dtype=q.dtype,
                                    head_dim=q.shape[-1], backend=self.backend,
                                    compiled=torch.compiler.is_compiling(),
                                    device_index=q.device.index)  # fmt: skip
        except ValueError:
            return None  # the call itself raises, with the reason
        return (0, 2, 1, 3) if chosen in ("sdpa", "flex") else None

    def extra_repr(self) -> str:
        out = f"backend={self.backend!r}, causal={self.causal}"
        for name in ("window", "chunk", "softcap"):
            if getattr(self, name) is not None:
                out += f", {name}={getattr(self, name)!r}"
        return out


def _layout_block_ids(layout: Any, device: torch.device) -> torch.Tensor:
    """The layout's ``block_ids[B, S]`` (attached once per step, else built here)."""
    if layout.block_ids is not None:
        return layout.block_ids
    return build_block_ids(layout.blocks, layout.seq_len, device)


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


def _flash_varlen(q_BSNH, k_BSKH, v_BSKH, docs: DocTensors, causal, softmax_scale, **extra):
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
        **extra,
    )
    return o_TNH.view(B, S, N, H)


def _torch_varlen(q_BSNH, k_BSKH, v_BSKH, docs: DocTensors | None, causal, scale, window):
    """``torch.nn.attention.varlen.varlen_attn`` over the documents (one per row without
    documents); causal is its window ``(left, 0)``."""
    from torch.nn.attention.varlen import varlen_attn

    B, S, N, H = q_BSNH.shape
    if docs is None:
        docs = build_doc_tensors([[0]] * B, S, q_BSNH.device)
    left, right = window
    if causal:
        right = 0
    longest = S if torch.compiler.is_compiling() else docs.max_seqlen
    o_TNH = varlen_attn(
        q_BSNH.reshape(B * S, N, H),
        k_BSKH.reshape(B * S, -1, H),
        v_BSKH.reshape(B * S, -1, H),
        docs.cu_seqlens_q,
        docs.cu_seqlens_k,
        longest,
        longest,
        scale=scale,
        window_size=(left, right),
        enable_gqa=k_BSKH.shape[2] != N,
    )
    assert isinstance(o_TNH, torch.Tensor)
    return o_TNH.view(B, S, N, H)
