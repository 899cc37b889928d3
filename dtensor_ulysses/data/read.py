"""Reading documents: data files and the built-in corpus (Python's stdlib sources) as bytes.

A ``.jsonl`` file gives one document per line (its ``"text"`` field); any other file is one
document, its whole content, and must be UTF-8 text. With no data files the corpus is the ``.py``
sources of the running Python's standard library, listed in a fixed order and read once per process.
Every error is a ``ValueError`` that says what is wrong (the file and line, when there is one) and
how to fix it.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import sysconfig
from collections.abc import Sequence

__all__ = ["default_corpus_paths", "read_documents"]

_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@functools.cache
def _default_paths() -> tuple[pathlib.Path, ...]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, pathlib.Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow symlinked dirs
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = pathlib.Path(dirpath, name)
                found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return tuple(path for _, path in found)


def default_corpus_paths() -> list[pathlib.Path]:
    """The built-in corpus: the running Python's standard-library ``.py`` files.

    Files under ``site-packages``/``dist-packages`` are left out (they differ between machines),
    and the list is sorted by path relative to the stdlib root, so it is identical on every rank
    and every run with the same Python.
    """
    return list(_default_paths())


def _read_bytes(path: pathlib.Path) -> bytes:
    if not path.exists():
        raise ValueError(
            f"data file {str(path)!r} does not exist; check the path (or pass no data files to "
            f"train on the built-in standard-library corpus)"
        )
    if path.is_dir():
        raise ValueError(
            f"data file {str(path)!r} is a directory; pass the files in it (e.g. {path}/*.txt)"
        )
    try:
        return path.read_bytes()
    except OSError as e:
        raise ValueError(
            f"cannot read data file {str(path)!r} ({e.strerror or e}); check its permissions"
        ) from None


def _jsonl_documents(path: pathlib.Path, data: bytes) -> list[bytes]:
    docs = []
    for lineno, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{str(path)!r} line {lineno}"
        fix = 'each line must be a JSON object with a "text" string, e.g. {"text": "hello"}'
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise ValueError(f"{where} is not valid UTF-8; {fix}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not valid JSON ({e.msg}); {fix}") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            got = f"keys {sorted(record)}" if isinstance(record, dict) else type(record).__name__
            if isinstance(record, dict) and ("messages" in record or "prompt" in record):
                fix = (
                    "chat records (messages, or prompt/completion) need a tokenizer's chat "
                    "template: train a transformers model on them with --hf-model DIR; the "
                    f"built-in model reads plain text ({fix})"
                )
            raise ValueError(f'{where} has no "text" string (got {got}); {fix}')
        if record["text"]:
            docs.append(record["text"].encode("utf-8"))
    return docs


def _check_text(path: pathlib.Path, data: bytes) -> None:
    """Refuse a file that is not UTF-8 text (an executable, an archive, UTF-16, ...)."""
    fix = "--data takes UTF-8 text or JSONL files; pass a text file (or convert this one)"
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(f"data file {str(path)!r} is binary (a NUL byte at offset {nul}); {fix}")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"data file {str(path)!r} is not UTF-8 text (byte {e.start} cannot be decoded); {fix}"
        ) from None


def _file_documents(
    path: pathlib.Path, *, allow_empty: bool = False, check_text: bool = False
) -> list[bytes]:
    data = _read_bytes(path)
    if path.suffix.lower() == ".jsonl":
        docs = _jsonl_documents(path, data)
    else:
        if check_text:
            _check_text(path, data)
        docs = [data] if data.strip() else []
    if not docs and not allow_empty:
        what = 'no line with a non-empty "text"' if path.suffix.lower() == ".jsonl" else "no text"
        raise ValueError(
            f"data file {str(path)!r} has {what}; remove it from the data files or fill it"
        )
    return docs


@functools.cache
def _default_documents() -> tuple[bytes, ...]:
    # Some stdlib files (empty __init__.py) have no text; the default corpus skips them.
    docs = tuple(d for p in _default_paths() for d in _file_documents(p, allow_empty=True))
    if not docs:
        root = sysconfig.get_paths()["stdlib"]
        raise ValueError(
            f"the built-in corpus is empty: no .py files with text under {root!r} (this Python "
            f"ships without its standard-library sources); pass data files instead (--data PATH)"
        )
    return docs


def read_documents(paths: Sequence[str | os.PathLike] | None = None) -> list[bytes]:
    """Documents (as UTF-8 bytes) from data files, in the order given.

    A ``.jsonl`` file gives one document per line, from the line's ``"text"`` field (blank lines
    and empty texts are skipped); any other file is one document, its whole content.

    Args:
        paths: data files (a single path is accepted too); ``None`` reads the built-in corpus
            (:func:`default_corpus_paths`), cached per process.

    Returns:
        The documents, none empty.

    Raises:
        ValueError: no paths; a file is missing, a directory or unreadable; a text file is not
            UTF-8 or holds a NUL byte (binary); a JSONL line is not
            valid JSON or has no ``"text"`` string (the message gives the line number); a file
            has no text; the built-in corpus is empty.
    """
    if paths is None:
        return list(_default_documents())
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if len(paths) == 0:
        raise ValueError(
            "no data files given; pass at least one file, or None for the built-in corpus"
        )
    return [d for p in paths for d in _file_documents(pathlib.Path(p), check_text=True)]
