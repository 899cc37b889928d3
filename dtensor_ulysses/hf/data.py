"""Tokenized corpora for transformers models (text and chat JSONL), batches, and evaluation.

:class:`TokenCorpus` is :class:`~dtensor_ulysses.data.PackedCorpus` for a real tokenizer: the
documents' token ids packed into one stream, read as overlapping windows of ``seq_len + 1``
(inputs ``window[:-1]``, labels ``window[1:]``), with two per-token flags beside the ids: whether a
token may be a *target* (chat: assistant tokens only) and whether it *starts* a document (its
label from the previous token is never taken; with ``pack_docs`` attention and positions restart
there). Its :meth:`TokenCorpus.rows` gives whole rows to the one slicer
(:func:`dtensor_ulysses.data.slice_batch`), so :func:`dtensor_ulysses.data.get_batch` (re-exported
here as :func:`get_batch`) reads both families' corpora with the same sampling: any
``(dp, sp)`` with the same global batch and seed trains on the same tokens.

Chat lines ``{"messages": [{"role": ..., "content": ...}, ...]}`` go through the tokenizer's chat
template (:func:`encode_chat`); loss is taken on the assistant tokens only.

:func:`eval_batches` (:mod:`dtensor_ulysses.data`) and :func:`evaluate`
(:mod:`dtensor_ulysses.parallel`, the trainer's evaluation component is
:mod:`dtensor_ulysses.train.evaluation`) are re-exported here, where they lived before.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dtensor_ulysses.data import IGNORE_INDEX, Batch, full_batch, read_documents
from dtensor_ulysses.data.batch import eval_batches, get_batch
from dtensor_ulysses.parallel.global_loss import evaluate

__all__ = [
    "TokenCorpus",
    "encode_chat",
    "eval_batches",
    "evaluate",
    "get_batch",
    "load_corpus",
]


def _apply_template(tokenizer: Any, messages: list, **kw: Any) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kw)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def encode_chat(tokenizer: Any, messages: Sequence[dict]) -> tuple[list[int], list[bool]]:
    """Token ids of a conversation through the tokenizer's chat template, and per token
    whether it is an assistant token (the only ones trained on).

    With ``{% generation %}`` markers in the template, transformers' assistant mask is used;
    otherwise assistant turn ``i`` is the tokens between the template of ``messages[:i]`` with
    the generation prompt and the template of ``messages[:i + 1]`` (which must extend it).

    Raises:
        ValueError: no chat template; malformed messages; a template that is not prefix-stable.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; chat data needs one")
    if not isinstance(messages, Sequence) or not messages:
        raise ValueError('"messages" must be a non-empty list')
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            raise ValueError(f'each message needs a "role" and "content", got {m!r}')
        if not isinstance(m.get("content"), str):
            raise ValueError(f'each message needs a "role" and "content", got {m!r}')
    messages = list(messages)
    if re.search(r"\{%-?\s*generation\s*-?%\}", tokenizer.chat_template):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), [bool(x) for x in out["assistant_masks"]]
    ids = _apply_template(tokenizer, messages)
    mask = [False] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _apply_template(tokenizer, messages[:i], add_generation_prompt=True) if i else []
        upto = _apply_template(tokenizer, messages[: i + 1])
        if upto[: len(before)] != before or ids[: len(upto)] != upto:
            raise ValueError(
                "the chat template is not prefix-stable (a turn changes the tokens before it), "
                "so the assistant tokens cannot be found; add {% generation %} markers to it"
            )
        for t in range(len(before), len(upto)):
            mask[t] = True
    return ids, mask


class TokenCorpus:
    """Token ids of packed documents with per-token target and document-start flags.

    Args:
        documents: per document, ``(ids, targets)``: token ids and whether each may be a target.
        seq_len: tokens per sample ``S``.
    """

    def __init__(self, documents: Sequence[tuple[Sequence[int], Sequence[bool]]], seq_len: int):
        docs = [(list(i), list(t)) for i, t in documents if len(i)]
        if not docs:
            raise ValueError("no documents with tokens")
        self.ids = torch.tensor([t for d, _ in docs for t in d], dtype=torch.int64)
        self.target = torch.tensor([x for _, m in docs for x in m], dtype=torch.bool)
        self.starts = torch.zeros(len(self.ids), dtype=torch.bool)
        offsets = torch.tensor([0] + [len(d) for d, _ in docs[:-1]]).cumsum(0)
        self.starts[offsets] = True
        self.target &= ~self.starts  # never a target across a document boundary
        if not bool(self.target.any()):
            raise ValueError(
                f"the data ({len(docs)} documents) has no token to learn: chat records are "
                f"trained on their assistant turns only, and none has one; add assistant "
                f'turns ({{"role": "assistant", ...}}) or train on text ({{"text": ...}}) lines'
            )
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r} must be a positive int")
        if len(self.ids) < seq_len + 1:
            raise ValueError(
                f"the data has {len(self.ids)} tokens but one window of seq_len={seq_len} needs "
                f"{seq_len + 1}; add data or use seq_len <= {len(self.ids) - 1}"
            )
        self.seq_len = seq_len
        self.n_windows = (len(self.ids) - 1) // seq_len
        self.n_documents = len(docs)

    @property
    def n_tokens(self) -> int:
        return len(self.ids)

    def __len__(self) -> int:
        return self.n_windows

    def rows(self, index: Sequence[int], pack_docs: bool) -> Batch:
        """Windows ``index`` as whole rows (:func:`~dtensor_ulysses.data.full_batch`): labels
        shifted, ``-100`` where a token may not be a target; the one slicer cuts them."""
        return full_batch(*self.full_batch(index, pack_docs))

    def full_batch(self, index: Sequence[int], pack_docs: bool):
        """``(ids, labels, position_ids, doc_starts)`` of windows ``index``, full length."""
        w = torch.as_tensor(list(index), dtype=torch.int64)
        offsets = w[:, None] * self.seq_len + torch.arange(self.seq_len + 1)
        win, tgt, st = self.ids[offsets], self.target[offsets], self.starts[offsets]
        ids = win[:, :-1]
        labels = torch.where(tgt[:, 1:], win[:, 1:], torch.full_like(ids, IGNORE_INDEX))
        S = self.seq_len
        if not pack_docs:
            return ids, labels, torch.arange(S).expand(len(w), S), None
        starts_bS = st[:, :-1].clone()
        starts_bS[:, 0] = True
        idx = torch.arange(S).expand(len(w), S)
        pos = idx - torch.cummax(torch.where(starts_bS, idx, torch.zeros_like(idx)), -1).values
        docs = tuple(tuple(row.nonzero().flatten().tolist()) for row in starts_bS)
        return ids, labels, pos, docs

    def __repr__(self) -> str:
        return (
            f"TokenCorpus(n_tokens={self.n_tokens}, seq_len={self.seq_len}, n_windows={len(self)})"
        )


# ----------------------------------------------------------------------------------------------
# reading and tokenizing
# ----------------------------------------------------------------------------------------------
def _documents(paths: Sequence[str | os.PathLike] | None, chat: bool | None) -> list[Any]:
    """Per document: a ``str`` (text) or a list of messages (chat)."""
    if paths is None:
        if chat:
            raise ValueError('chat data needs --data files with {"messages": [...]} lines')
        return [d.decode("utf-8", errors="replace") for d in read_documents(None)]
    docs: list[Any] = []
    for p in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
        path = Path(p)
        if path.suffix.lower() != ".jsonl":
            if chat:
                raise ValueError(f'chat data must be JSONL with "messages"; {str(path)!r} is not')
            docs += [d.decode("utf-8", errors="replace") for d in read_documents([path])]
            continue
        if not path.is_file():
            raise ValueError(f"data file {str(path)!r} does not exist")
        for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not raw.strip():
                continue
            where = f"{str(path)!r} line {lineno}"
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where} is not valid JSON ({e.msg})") from None
            if isinstance(rec, dict) and "messages" in rec and chat is not False:
                docs.append(rec["messages"])
            elif isinstance(rec, dict) and isinstance(rec.get("text"), str) and not chat:
                if rec["text"]:
                    docs.append(rec["text"])
            else:
                want = '"messages"' if chat else '"text" (or "messages" for chat)'
                raise ValueError(f"{where} has no {want} field")
    if not docs:
        raise ValueError("the data files have no documents")
    return docs


def load_corpus(
    paths: Sequence[str | os.PathLike] | None,
    tokenizer: Any,
    seq_len: int,
    *,
    chat: bool | None = None,
) -> TokenCorpus:
    """Tokenize text and chat documents into a :class:`TokenCorpus`.

    Text files are one document each, JSONL lines are ``{"text": ...}`` or (chat)
    ``{"messages": [...]}``; ``chat=None`` takes either per line, ``True`` only chat, ``False``
    only text. Text documents get the tokenizer's special tokens and end with its EOS token;
    chat documents go through its chat template, with targets on assistant tokens only.
    ``paths=None``: the built-in corpus (the standard library's sources) as text.
    """
    key = None
    if paths is not None:
        plist = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        try:
            key = tuple((os.path.abspath(p), os.stat(p).st_mtime_ns) for p in plist)
        except OSError:
            key = None
    if key is not None:
        return _cached_corpus(key, _TokKey(tokenizer), seq_len, chat)
    if paths is None:  # the built-in corpus: progress lines and a disk cache (_token_cache.py)
        from dtensor_ulysses.hf._token_cache import builtin_documents

        docs = builtin_documents(_documents(None, chat), tokenizer, _encode_all)
        return TokenCorpus(docs, seq_len)
    return TokenCorpus(_encode_all(_documents(paths, chat), tokenizer), seq_len)


class _TokKey:
    """Hashes a tokenizer by its identity, for the per-process cache."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __hash__(self) -> int:
        return id(self.tokenizer)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _TokKey) and other.tokenizer is self.tokenizer


@functools.lru_cache(maxsize=4)
def _cached_corpus(key: tuple, tok: _TokKey, seq_len: int, chat: bool | None) -> TokenCorpus:
    return TokenCorpus(_encode_all(_documents([p for p, _ in key], chat), tok.tokenizer), seq_len)


def _encode_all(docs: list[Any], tokenizer: Any) -> list[tuple[list[int], list[bool]]]:
    out = []
    eos = tokenizer.eos_token_id
    for doc in docs:
        if isinstance(doc, str):
            ids = list(tokenizer(doc, add_special_tokens=True)["input_ids"])
            if eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)
            out.append((ids, [True] * len(ids)))
        else:
            out.append(encode_chat(tokenizer, doc))
    return out
