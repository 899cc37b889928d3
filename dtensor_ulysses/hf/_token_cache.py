"""The built-in corpus through a transformers tokenizer: progress lines, and a disk cache.

Tokenizing the built-in corpus (the standard library's sources, about 30 MB of text) takes most
of a minute per rank. :func:`builtin_documents` prints progress from rank 0 while it runs and
keeps the result in a cache file keyed by the tokenizer (its full serialized definition and EOS
id) and the corpus text (a hash of every document), so the next run with the same tokenizer on
the same Python reads it in a second. The cache lives in ``$DTENSOR_ULYSSES_CACHE`` (default
``~/.cache/dtensor_ulysses``); set it to an empty string to turn the cache off. Slow (Python)
tokenizers, which cannot be serialized, are not cached.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CACHE_ENV", "builtin_documents", "cache_dir"]

CACHE_ENV = "DTENSOR_ULYSSES_CACHE"
_PROGRESS_EVERY_S = 5.0


def cache_dir() -> Path | None:
    """Where token caches go (None: caching is off)."""
    root = os.environ.get(CACHE_ENV)
    if root == "":
        return None
    return Path(root) if root else Path.home() / ".cache" / "dtensor_ulysses"


def _tokenizer_key(tokenizer: Any) -> str | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return f"{backend.to_str()}\neos={tokenizer.eos_token_id}"


def _key(tokenizer_text: str, docs: list[str]) -> str:
    h = hashlib.sha256(tokenizer_text.encode())
    for d in docs:
        h.update(len(d).to_bytes(8, "little"))
        h.update(d.encode("utf-8", errors="replace"))
    return h.hexdigest()[:32]


def _say(text: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(text, file=sys.stderr, flush=True)


def builtin_documents(
    docs: list[str],
    tokenizer: Any,
    encode: Callable[[list[Any], Any], list[tuple[list[int], list[bool]]]],
) -> list[tuple[list[int], list[bool]]]:
    """``encode(docs, tokenizer)`` with progress lines and the disk cache (every target True:
    text documents only)."""
    root = cache_dir()
    tok_text = _tokenizer_key(tokenizer) if root is not None else None
    path = None
    if root is not None and tok_text is not None:
        path = root / "tokens" / f"builtin-{_key(tok_text, docs)}.npz"
        if path.is_file():
            try:
                with np.load(path) as f:
                    ids, ends = f["ids"], f["ends"]
                bounds = zip([0, *ends[:-1].tolist()], ends.tolist())
                return [(ids[a:b].tolist(), [True] * (b - a)) for a, b in bounds]
            except Exception:  # a damaged cache file: tokenize again (and rewrite it)
                pass
    t0 = last = time.monotonic()
    out: list[tuple[list[int], list[bool]]] = []
    _say(f"tokenizing the built-in corpus ({len(docs)} documents) with the --hf-model tokenizer")
    for i, doc in enumerate(docs):
        out += encode([doc], tokenizer)
        now = time.monotonic()
        if now - last >= _PROGRESS_EVERY_S:
            last = now
            _say(f"  {i + 1}/{len(docs)} documents ({now - t0:.0f} s)")
    _say(
        f"  done: {sum(len(i) for i, _ in out) / 1e6:.1f}M tokens in {time.monotonic() - t0:.0f} s"
        + (f"; cached in {path}" if path is not None else "")
    )
    if path is not None:
        _write(path, out)
    return out


def _write(path: Path, docs: list[tuple[list[int], list[bool]]]) -> None:
    """Atomically (every rank may write the same file): a temporary file, then a rename."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        ids = np.fromiter((t for i, _ in docs for t in i), dtype=np.int32)
        ends = np.cumsum([len(i) for i, _ in docs], dtype=np.int64)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, ids=ids, ends=ends)
        os.replace(tmp, path)
    except OSError:
        pass  # a cache that cannot be written is only slower
