"""The token stream: the byte tokenizer, packing into windows, ``PackedCorpus``.

Legend: ``T`` tokens in the packed stream, ``L = seq_len + 1`` tokens per window, ``n`` windows
read at once. ``stream_T`` is the packed stream, ``offsets_nL`` the stream index of each token of
``n`` windows.

Bytes are tokens (ids ``0..255``) and ``SEP_ID = 256`` starts every document. Documents are packed
once as ``[SEP] doc0 [SEP] doc1 ...`` into an ``int16`` stream ``[T]``, cached per process for the
built-in corpus and per ``(path, mtime, size)`` for data files; :class:`PackedCorpus` reads it as
overlapping windows of ``seq_len + 1`` tokens.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

from dtensor_ulysses.data.read import _default_documents, read_documents

__all__ = ["SEP_ID", "VOCAB_SIZE", "PackedCorpus", "decode", "encode"]

SEP_ID = 256  # starts every document; ids 0..255 are bytes
VOCAB_SIZE = 257


# ----------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------
def _bytes_to_ids(data: bytes | bytearray) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def encode(text: str) -> torch.Tensor:
    """Token ids of ``text``: its UTF-8 bytes as an int64 tensor ``[len(text.encode())]``.

    No ``SEP`` is added; packing adds one before every document.
    """
    if not isinstance(text, str):
        raise TypeError(f"encode takes a str, got {type(text).__name__}; decode bytes first")
    return _bytes_to_ids(text.encode("utf-8"))


def decode(ids: torch.Tensor | Sequence[int]) -> str:
    """Text of token ids: byte ids (0..255) as UTF-8, invalid sequences replaced with U+FFFD.

    ``SEP`` and any other non-byte id (e.g. ``IGNORE_INDEX``, or the spare rows of an embedding
    larger than ``VOCAB_SIZE``) are skipped.
    """
    if isinstance(ids, torch.Tensor):
        flat = ids.detach().reshape(-1).to("cpu", torch.int64)
        values = flat[(flat >= 0) & (flat < 256)].tolist()
    else:
        values = [int(t) for t in ids if 0 <= int(t) < 256]
    return bytes(values).decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------------------------
# packing
# ----------------------------------------------------------------------------------------------
def _pack(documents: Sequence[bytes]) -> torch.Tensor:
    """``[SEP] doc0 [SEP] doc1 ...`` as an int16 stream ``[T]``."""
    if len(documents) == 0:
        raise ValueError("no documents to pack; read_documents() gives the built-in corpus")
    for j, d in enumerate(documents):
        if not isinstance(d, (bytes, bytearray)):
            raise TypeError(
                f"document {j} is a {type(d).__name__}; documents are bytes (use text.encode())"
            )
    # A 0 byte holds each SEP's place in the byte buffer; the SEP ids are written afterwards.
    buf = bytearray(b"\x00")
    buf += b"\x00".join(documents)
    stream_T = torch.frombuffer(buf, dtype=torch.uint8).to(torch.int16)
    sizes = torch.tensor([len(d) + 1 for d in documents], dtype=torch.int64)
    stream_T[torch.cumsum(sizes, 0) - sizes] = SEP_ID
    return stream_T


@functools.cache
def _default_stream() -> torch.Tensor:
    # Unwrapped: holding the stream does not also hold the documents' bytes in a cache.
    return _pack(_default_documents.__wrapped__())


@functools.lru_cache(maxsize=4)
def _files_stream(key: tuple[tuple[str, int, int], ...]) -> torch.Tensor:
    return _pack(read_documents([path for path, _, _ in key]))


def _stream_for(paths: Sequence[str | os.PathLike] | None) -> torch.Tensor:
    if paths is None:
        return _default_stream()
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    try:  # cache on (path, mtime, size), so an edited file is read again
        key = tuple((os.path.abspath(p), (st := os.stat(p)).st_mtime_ns, st.st_size) for p in paths)
    except OSError:  # let read_documents say what is wrong
        return _pack(read_documents(paths))
    return _files_stream(key)


class PackedCorpus:
    """Documents packed into one token stream, read as overlapping windows of ``seq_len + 1``.

    ``stream`` is ``[SEP] doc0 [SEP] doc1 ...`` (int16 ``[T]``); window ``w`` is
    ``stream[w*seq_len : w*seq_len + seq_len + 1]`` for ``w < len(corpus) = (T - 1) // seq_len``:
    inputs ``window[:-1]``, labels ``window[1:]``. The few tokens after the last full window are
    only ever read as the label of its last input.

    Args:
        documents: document bytes, e.g. from :func:`read_documents`.
        seq_len: tokens per sample ``S``.

    Raises:
        ValueError: ``seq_len < 1``; no documents; fewer than ``seq_len + 1`` tokens in all.
    """

    def __init__(self, documents: Sequence[bytes], seq_len: int) -> None:
        self._init(_pack(documents), seq_len)

    @classmethod
    def from_paths(
        cls, paths: Sequence[str | os.PathLike] | None = None, *, seq_len: int
    ) -> PackedCorpus:
        """``PackedCorpus(read_documents(paths), seq_len)``, with the stream cached per process.

        The stream does not depend on ``seq_len``, so corpora of any length share it; a file's
        cache entry is keyed on its path, mtime and size.
        """
        corpus = cls.__new__(cls)
        corpus._init(_stream_for(paths), seq_len)
        return corpus

    def _init(self, stream_T: torch.Tensor, seq_len: int) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r} must be a positive int")
        n_tokens = stream_T.numel()
        if n_tokens < seq_len + 1:
            raise ValueError(
                f"the corpus has {n_tokens} tokens but one window of seq_len={seq_len} needs "
                f"{seq_len + 1} (seq_len + 1, for the labels); add data or use "
                f"seq_len <= {n_tokens - 1}"
            )
        self.stream = stream_T
        self.seq_len = seq_len
        self.n_windows = (n_tokens - 1) // seq_len

    @property
    def n_tokens(self) -> int:
        """Tokens in the stream, ``SEP``s included."""
        return self.stream.numel()

    @property
    def n_documents(self) -> int:
        return int((self.stream == SEP_ID).sum())

    def __len__(self) -> int:
        return self.n_windows

    def windows(self, index: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Windows ``index`` as int64 ``[len(index), seq_len + 1]``."""
        w = torch.as_tensor(index, dtype=torch.int64).reshape(-1)
        if w.numel() and (int(w.min()) < 0 or int(w.max()) >= self.n_windows):
            bad = int(w[(w < 0) | (w >= self.n_windows)][0])
            raise IndexError(f"window {bad} out of range; the corpus has {self.n_windows}")
        L = self.seq_len + 1
        offsets_nL = w[:, None] * self.seq_len + torch.arange(L)
        return self.stream[offsets_nL].to(torch.int64)

    def __getitem__(self, w: int) -> torch.Tensor:
        """Window ``w`` as int64 ``[seq_len + 1]``."""
        return self.windows([w])[0]

    def __repr__(self) -> str:
        return (
            f"PackedCorpus(n_tokens={self.n_tokens}, seq_len={self.seq_len}, "
            f"n_windows={self.n_windows})"
        )
