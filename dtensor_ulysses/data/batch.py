"""One step's batch: deterministic dp sampling, sp slicing, labels, and the step's sequence layout.

Legend (``X_sp`` means "dim X split over the ``sp`` mesh axis"):

    G global batch (samples per step), b = G / dp local batch, S seq_len, s = S / sp
    T tokens in the packed stream, W = (T - 1) // S windows, L = S + 1 tokens per window
    stream[T] -> window[L] -> ids[b, S], labels[b, S] -> ids[b, S_sp], labels[b, S_sp]

Tensor names carry their local shape: ``win_bL`` is a rank's ``b`` windows of ``L`` tokens,
``ids_bS`` their inputs, ``ids_bs`` this sp rank's slice of them.

**Tokenizer.** Bytes are tokens: ids ``0..255`` are the UTF-8 bytes of the text and
``SEP_ID = 256`` starts every document, so ``VOCAB_SIZE = 257``. No files to download, and any text
(and any language) encodes without unknown tokens.

**Packing.** Documents are concatenated as ``[SEP] doc0 [SEP] doc1 ...`` into one stream, stored
once as an ``int16`` tensor (two bytes a token). Window ``w`` is ``stream[w*S : w*S + S + 1]``:
windows overlap by one token, so the inputs ``window[:-1]`` tile the stream without gaps and each
input's label ``window[1:]`` is the token after it (the last label of window ``w`` is the first
input of window ``w + 1``). Documents run across window edges; no token is padding.

**Sampling.** Sample ``i`` of the global batch at step ``t`` is global sample ``g = t*G + i``, in
epoch ``e = g // W``; it reads window ``perm_e[g % W]``, where ``perm_e`` is a permutation of the
``W`` windows drawn from a ``torch.Generator`` seeded by ``(seed, e)``. Every window is read once
per epoch, and the batch at step ``t`` is a pure function of ``(t, seed)`` and the data: resuming at
step ``t`` needs no sampler state, only the step. dp rank ``r`` reads samples ``[r*b, (r+1)*b)``
of the global batch, so any ``(dp, sp)`` with the same ``G`` and seed trains on the same tokens.

**Sequence slicing.** All sp ranks of one dp group read the same ``b`` windows and keep their
contiguous slice ``[r*s, (r+1)*s)`` of the sequence: ``ids[b, S] -> ids[b, S_sp]``. Labels are
shifted *before* slicing, so the last token of a slice keeps its label (the first token of the next
slice) and no sp rank needs a halo exchange. Position ids are global (``arange(S)`` sliced), or,
with ``pack_docs=True``, restart at 0 at each ``SEP`` so that attention (and RoPE) treats every
document on its own; the tokens before a window's first ``SEP`` count from 0 at the window start.

**Default corpus.** With no data files, the corpus is the ``.py`` sources of the running Python's
standard library (about 30 MB on CPython 3.11): real, long documents present on every machine,
listed in a fixed order. Reading and packing it takes well under a second and is cached per process
(:meth:`PackedCorpus.from_paths`).

**Where the code lives.** This module holds the sampling and the batches (:func:`sample_index`,
:class:`Batch`, :func:`get_batch`, :func:`eval_batches`, the document positions) and the one
slicer every batch goes through, :func:`slice_batch` (dp rows, sp slices, ring x sp zigzag,
uneven lengths, packed documents; the built-in model's and ``--hf-model`` batches, evaluation,
and :func:`dtensor_ulysses.hf.shard_batch`); the tokenizer, packing and
:class:`PackedCorpus` are in ``corpus.py``, reading data files and the built-in corpus in
``read.py``; import every public name from :mod:`dtensor_ulysses.data`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtensor_ulysses.data.corpus import SEP_ID, PackedCorpus
from dtensor_ulysses.plan.splits import (
    SeqLayout,
    check_ring_seq,
    nearby_multiples,
    zigzag_positions,
)

__all__ = [
    "Batch",
    "dp_rows",
    "eval_batches",
    "full_batch",
    "slice_batch",
    "window_rows",
    "document_positions",
    "starts_from_separators",
    "get_batch",
    "IGNORE_INDEX",
    "sample_index",
]

# Labels equal to this take no loss (``torch.nn.functional.cross_entropy``'s default).
IGNORE_INDEX = -100

_MASK64 = (1 << 64) - 1


# ----------------------------------------------------------------------------------------------
# sampling
# ----------------------------------------------------------------------------------------------
def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@functools.lru_cache(maxsize=4)
def _permutation(n_windows: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(_splitmix64(_splitmix64(seed & _MASK64) ^ epoch))
    return torch.randperm(n_windows, generator=generator)


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an int >= {low}")
    return value


def _check_degrees(**degrees: object) -> None:
    """Each degree (``dp=``, ``sp=``, ``ring=``, named as the caller's arguments) is an int >= 1."""
    for name, value in degrees.items():
        _check_int(name, value, 1)


def sample_index(step: int, i: int, global_batch_size: int, n_windows: int, seed: int) -> int:
    """Window read by sample ``i`` of the global batch at ``step``.

    ``g = step * global_batch_size + i`` is the global sample number; epoch ``g // n_windows``
    reads window ``perm[g % n_windows]`` of a permutation drawn from a ``torch.Generator`` seeded
    by ``(seed, epoch)``. A pure function: every window once per epoch, the same answer on every
    rank, and nothing to restore on resume.

    Raises:
        ValueError: negative ``step``, ``i`` outside ``[0, global_batch_size)``, no windows.
    """
    _check_int("step", step, 0)
    _check_int("global_batch_size", global_batch_size, 1)
    _check_int("n_windows", n_windows, 1)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed={seed!r} must be an int")
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < global_batch_size:
        raise ValueError(
            f"sample i={i!r} is out of range for global batch {global_batch_size}; "
            f"use 0..{global_batch_size - 1}"
        )
    g = step * global_batch_size + i
    epoch, k = divmod(g, n_windows)
    return int(_permutation(n_windows, seed, epoch)[k])


# ----------------------------------------------------------------------------------------------
# batches
# ----------------------------------------------------------------------------------------------
@dataclass
class Batch:
    """One rank's slice of a step's global batch: int64 ``[b, S_sp]`` tensors and the layout.

    Attributes:
        input_ids: token ids.
        labels: the token after each input (already shifted, so slice edges are right).
        position_ids: global positions ``0..S-1``, or per-document positions with ``pack_docs``.
        layout: the step's sequence layout: tokens per sp rank and, with ``pack_docs``, the
            document starts of the full window (host-side ints; the model passes it to every
            attention layer, so no layer gathers position ids or syncs with the host).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    layout: SeqLayout

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Batch:
        """The batch on ``device`` (the layout stays on the host)."""
        ids, labels, pos = (
            t.to(device, non_blocking=non_blocking)
            for t in (self.input_ids, self.labels, self.position_ids)
        )
        return Batch(ids, labels, pos, self.layout)


def document_positions(ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 at each ``SEP`` along the last dim (int64, ``ids``' shape).

    Tokens before the first ``SEP`` count from 0 at index 0 (a document that began in an earlier
    window). Example: ``[7, 8, SEP, 9, SEP, 5] -> [0, 1, 0, 1, 0, 1]``.
    """
    idx = torch.arange(ids.shape[-1], device=ids.device).expand(ids.shape)
    starts = torch.where(ids == SEP_ID, idx, torch.zeros_like(idx))
    return idx - torch.cummax(starts, dim=-1).values


def starts_from_separators(ids_bS: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """Per row, the indices where a document starts: 0 and every ``SEP`` (host-side ints).

    The same boundaries as the restarts of :func:`document_positions`.
    Example: ``[[7, 8, SEP, 9, SEP, 5]] -> ((0, 2, 4),)``.
    """
    rows = []
    for row in ids_bS.cpu():
        seps = (row == SEP_ID).nonzero().flatten().tolist()
        rows.append(tuple([0] + [i for i in seps if i > 0]))
    return tuple(rows)


def dp_rows(global_batch_size: int, dp: int, dp_rank: int) -> range:
    """The samples ``[r*b, (r+1)*b)`` of the global batch that dp rank ``r`` reads (``b = G/dp``).

    Raises:
        ValueError: ``G`` not divisible by ``dp``; a rank out of range.
    """
    _check_int("global_batch_size", global_batch_size, 1)
    _check_degrees(dp=dp)
    _check_rank("dp_rank", dp_rank, dp)
    if global_batch_size % dp:
        raise ValueError(
            f"global batch {global_batch_size} is not divisible by dp={dp}; use a multiple of "
            f"{dp}, e.g. {-(-global_batch_size // dp) * dp}"
        )
    b = global_batch_size // dp
    return range(dp_rank * b, (dp_rank + 1) * b)


def _check_rank(name: str, rank: object, size: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        axis = name.removesuffix("_rank")
        raise ValueError(f"{name}={rank!r} is out of range for {axis}={size}; use 0..{size - 1}")


def full_batch(
    input_ids_BS: torch.Tensor,
    labels_BS: torch.Tensor,
    position_ids_BS: torch.Tensor | None = None,
    doc_starts: tuple[tuple[int, ...], ...] | None = None,
) -> Batch:
    """Whole rows as one :class:`Batch` for :func:`slice_batch`: labels already shifted (the
    target of each input), positions global (``0..S-1`` when ``None``), ``doc_starts`` the
    packed documents' starts per row (``None``: one sequence)."""
    B, S = input_ids_BS.shape
    if position_ids_BS is None:
        position_ids_BS = torch.arange(S, device=input_ids_BS.device).expand(B, S)
    return Batch(input_ids_BS, labels_BS, position_ids_BS, SeqLayout.split(S, 1, doc_starts))


def slice_batch(
    full: Batch,
    *,
    sp: int = 1,
    sp_rank: int = 0,
    ring: int = 1,
    ring_rank: int = 0,
    dp: int = 1,
    dp_rank: int = 0,
    uneven: bool = True,
) -> Batch:
    """The one slicer: this rank's piece of whole rows (:func:`full_batch`), for every layout.

    * ``dp``: rows ``[r*b, (r+1)*b)`` of ``full`` (:func:`dp_rows`; ``dp=1`` when ``full`` holds
      this dp rank's rows already).
    * ``sp`` (``ring = 1``): tokens ``[q*s, (q+1)*s)``, DTensor's ``Shard(1)`` piece (uneven
      ``S``: chunks of ``ceil(S / sp)``, the last ones shorter or empty).
    * ``ring x sp``: the zigzag tokens :func:`~dtensor_ulysses.plan.zigzag_positions`
      ``(S, ring, sp, ring_rank, sp_rank)``, in local order.

    Ids, labels (shifted over the whole row before slicing, so a slice's last token keeps its
    target) and positions (global, so RoPE is right) are cut alike; the returned layout is the
    step's :class:`~dtensor_ulysses.plan.SeqLayout` over ``sp`` (and ``ring``), with the full
    rows' document starts.

    Raises:
        ValueError: a rank out of range; ``S`` not divisible by ``sp`` (``uneven=False``); with a
            ring, ``S`` not a multiple of ``2 * ring`` or ``S / ring`` not divisible by ``sp``
            (``uneven=False``); rows not divisible by ``dp``.
    """
    _check_degrees(sp=sp, ring=ring)
    _check_rank("sp_rank", sp_rank, sp)
    _check_rank("ring_rank", ring_rank, ring)
    ids_BS, labels_BS, pos_BS = full.input_ids, full.labels, full.position_ids
    if dp > 1 or dp_rank:
        rows = dp_rows(ids_BS.shape[0], dp, dp_rank)
        ids_BS, labels_BS, pos_BS = (t[rows.start : rows.stop] for t in (ids_BS, labels_BS, pos_BS))
    S = ids_BS.shape[1]
    docs = full.layout.doc_starts
    if docs is not None and (dp > 1 or dp_rank):
        docs = docs[rows.start : rows.stop]
    if ring > 1:
        check_ring_seq(S, ring)  # S / (2 * ring) zigzag chunks
        if (S // ring) % sp and not uneven:
            raise ValueError(
                f"seq_len {S} gives each of the ring={ring} ranks {S // ring} tokens, not "
                f"divisible by sp={sp}; use a multiple of {2 * ring * sp}, e.g. "
                f"{nearby_multiples(S, 2 * ring * sp)}"
            )
        layout = SeqLayout.split(S, sp, docs, ring=ring)
        mine = torch.tensor(zigzag_positions(S, ring, sp, ring_rank, sp_rank), dtype=torch.int64)
        mine = mine.to(ids_BS.device)
        cut = [t[:, mine].contiguous() for t in (ids_BS, labels_BS, pos_BS)]
        return Batch(cut[0], cut[1], cut[2], layout)
    if S % sp and not uneven:
        raise ValueError(
            f"seq_len {S} is not divisible by sp={sp}; use a multiple of {sp}, "
            f"e.g. {nearby_multiples(S, sp)}"
        )
    layout = SeqLayout.split(S, sp, docs)
    lo = layout.offset(sp_rank)
    hi = lo + layout.seq_sizes[sp_rank]
    cut = [t[:, lo:hi].contiguous() for t in (ids_BS, labels_BS, pos_BS)]
    return Batch(cut[0], cut[1], cut[2], layout)


def window_rows(corpus: Any, index: Sequence[int], pack_docs: bool) -> Batch:
    """Windows ``index`` of a corpus as whole rows (:func:`full_batch`), labels shifted.

    A corpus with a ``rows(index, pack_docs)`` method (the tokenized corpus of
    :mod:`dtensor_ulysses.hf`) gives them itself; a :class:`PackedCorpus` reads its windows:
    inputs ``window[:-1]``, labels ``window[1:]``, with ``pack_docs`` positions restarting at
    each ``SEP`` and the documents' starts.
    """
    rows = getattr(corpus, "rows", None)
    if rows is not None:
        return rows(index, pack_docs)
    win_bL = corpus.windows(list(index))
    ids_bS, labels_bS = win_bL[:, :-1], win_bL[:, 1:]  # shift first, then slice
    if pack_docs:  # document starts may lie on an earlier slice: positions over all of S
        return full_batch(
            ids_bS, labels_bS, document_positions(ids_bS), starts_from_separators(ids_bS)
        )
    return full_batch(ids_bS, labels_bS)


def get_batch(
    corpus: Any,
    step: int,
    *,
    global_batch_size: int,
    dp_rank: int,
    dp: int,
    sp_rank: int,
    sp: int,
    seed: int,
    pack_docs: bool = False,
    uneven: bool = False,
    ring: int = 1,
    ring_rank: int = 0,
) -> Batch:
    """This rank's slice ``[b, S_sp]`` of the global batch ``[G, S]`` at ``step``.

    dp rank ``r`` reads samples ``[r*b, (r+1)*b)`` (``b = G / dp``) of the global batch, whose
    windows are given by :func:`sample_index`; :func:`slice_batch` cuts them for the rank
    (labels shifted before slicing). One function for both model families: ``corpus`` is a
    :class:`PackedCorpus` or any corpus with ``rows(index, pack_docs)``, ``len()`` and
    ``seq_len`` (:class:`dtensor_ulysses.hf.data.TokenCorpus`).

    Args:
        corpus: the corpus; ``S = corpus.seq_len``.
        step: training step (0-based); the batch is a pure function of ``(step, seed)``.
        global_batch_size: samples per step over all dp ranks, ``G``.
        dp_rank: this rank's coordinate on the ``dp`` mesh axis.
        dp: size of the ``dp`` mesh axis.
        sp_rank: this rank's coordinate on the ``sp`` mesh axis.
        sp: size of the ``sp`` mesh axis.
        seed: sampling seed.
        pack_docs: position ids restart at 0 at each document start (``SEP``).
        uneven: accept ``S`` not divisible by ``sp``: sp rank ``q`` then keeps DTensor's uneven
            ``Shard(1)`` piece (chunks of ``ceil(S / sp)``, the last ones shorter or empty, as
            :func:`dtensor_ulysses.plan.seq_split`); every token is still on exactly one rank.
        ring: the ring degree (Ulysses x Ring, :mod:`dtensor_ulysses.attention.ring`); ``1``: no
            ring.
        ring_rank: this rank's coordinate on the ``ring`` mesh axis. With ``ring > 1`` the rank
            at ``(ring_rank, sp_rank)`` keeps the global tokens
            :func:`~dtensor_ulysses.plan.zigzag_positions` ``(S, ring, sp, ring_rank, sp_rank)``
            (zigzag chunks ``ring_rank`` and ``2*ring-1-ring_rank`` of ``S / (2*ring)`` tokens,
            cut over ``sp``); ids, labels (shifted first) and position ids (global, or with
            ``pack_docs`` the document positions of the full window, so RoPE is right) are all
            sliced by them, and the layout holds the full window's document starts.

    Returns:
        :class:`Batch` of int64 ``[b, S_sp]`` tensors on the CPU, with the step's layout.

    Raises:
        ValueError: ``G`` not divisible by ``dp``; ``S`` not divisible by ``sp`` (with a ring:
            ``S`` not a multiple of ``2 * ring``, or ``S / ring`` not divisible by ``sp``); a
            rank out of range; a negative step.
    """
    if not (hasattr(corpus, "rows") or isinstance(corpus, PackedCorpus)):
        raise TypeError(
            f"corpus must be a PackedCorpus (or have rows(index, pack_docs)), got "
            f"{type(corpus).__name__}"
        )
    _check_int("step", step, 0)
    _check_degrees(sp=sp, ring=ring)
    _check_rank("sp_rank", sp_rank, sp)
    _check_rank("ring_rank", ring_rank, ring)
    samples = dp_rows(global_batch_size, dp, dp_rank)
    index = [sample_index(step, i, global_batch_size, len(corpus), seed) for i in samples]
    full = window_rows(corpus, index, pack_docs)
    return slice_batch(full, sp=sp, sp_rank=sp_rank, ring=ring, ring_rank=ring_rank, uneven=uneven)


def eval_batches(
    corpus: Any,
    *,
    global_batch_size: int,
    dp_rank: int,
    dp: int,
    sp_rank: int,
    sp: int,
    pack_docs: bool = False,
    max_batches: int | None = None,
    ring: int = 1,
    ring_rank: int = 0,
) -> Iterator[Batch]:
    """Held-out batches: the windows in order, ``global_batch_size`` per batch (a last partial
    batch is dropped, so every rank runs the same number), this rank's slice of each (any
    layout :func:`slice_batch` cuts, uneven lengths accepted).

    Raises:
        ValueError: fewer windows than one global batch.
    """
    n = len(corpus) // global_batch_size
    if n == 0:
        raise ValueError(
            f"the evaluation data has {len(corpus)} windows of {corpus.seq_len} tokens, fewer "
            f"than one global batch of {global_batch_size}; add data or shorten --seq-len"
        )
    if max_batches is not None:
        n = min(n, max_batches)
    rows = dp_rows(global_batch_size, dp, dp_rank)
    for k in range(n):
        first = k * global_batch_size
        full = window_rows(corpus, range(first + rows.start, first + rows.stop), pack_docs)
        yield slice_batch(full, sp=sp, sp_rank=sp_rank, ring=ring, ring_rank=ring_rank)
