"""Per-file checksums of a checkpoint: written last, verified before anything is loaded.

``manifest.json`` lists every file of a checkpoint with its size and one CRC-32 per
:data:`CHUNK_BYTES` chunk (``zlib.crc32``: standard library, several GB/s on one core). It is
the last file written into the ``*.tmp`` directory, just before the rename that makes the
checkpoint complete, so a checkpoint with a manifest was whole when it was written; a byte that
changes afterwards (a flipped bit, a partial overwrite, a truncation, a planted file) no longer
matches. A CRC detects accidental damage, not a forgery: the unpickler's admitted set
(``dtensor_ulysses._safe_pickle``) is what keeps a deliberately crafted file from running code.

The work is split over the ranks: each computes the files ``sorted(names)[rank::world]``
(:func:`checksum`, :func:`check`), so writing or verifying costs one read of the checkpoint
in total, spread over the ranks. Checkpoints written before manifests existed have none and
still load (the trainer warns that their bytes cannot be checked).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

__all__ = ["CHUNK_BYTES", "MANIFEST", "checksum", "check", "files_of", "read", "write"]

MANIFEST = "manifest.json"
CHUNK_BYTES = 64 * 2**20
_VERSION = 1
_READ_BYTES = 8 * 2**20


def files_of(directory: str | os.PathLike) -> list[str]:
    """The files a manifest covers: every regular file of the checkpoint but the manifest."""
    root = Path(directory)
    return sorted(p.name for p in root.iterdir() if p.is_file() and p.name != MANIFEST)


def _crcs(path: Path) -> tuple[int, list[int]]:
    crcs: list[int] = []
    size = 0
    with path.open("rb") as f:
        while True:
            crc, n = 0, 0
            while n < CHUNK_BYTES:
                block = f.read(min(_READ_BYTES, CHUNK_BYTES - n))
                if not block:
                    break
                crc = zlib.crc32(block, crc)
                n += len(block)
            if n == 0 and crcs:
                break
            crcs.append(crc)
            size += n
            if n < CHUNK_BYTES:
                break
    return size, crcs


def checksum(directory: str | os.PathLike, names: list[str]) -> dict[str, dict]:
    """``{name: {"size", "crc32"}}`` of the files ``names`` in ``directory``."""
    root = Path(directory)
    out = {}
    for name in names:
        size, crcs = _crcs(root / name)
        out[name] = {"size": size, "crc32": crcs}
    return out


def write(directory: str | os.PathLike, entries: dict[str, dict]) -> Path:
    """Write ``manifest.json`` (atomically, flushed to disk) for ``entries``; returns it."""
    root = Path(directory)
    body = {"version": _VERSION, "chunk_bytes": CHUNK_BYTES, "files": dict(sorted(entries.items()))}
    tmp = root / (MANIFEST + ".tmp")
    with tmp.open("w") as f:
        json.dump(body, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(root / MANIFEST)
    return root / MANIFEST


def read(directory: str | os.PathLike) -> dict | None:
    """The manifest's ``files`` table, or None when the checkpoint has none (an old one).

    Raises:
        ValueError: the manifest exists but is not one this version wrote.
    """
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text())
        files = body["files"]
        ok = body.get("version") == _VERSION and body.get("chunk_bytes") == CHUNK_BYTES
        ok = ok and isinstance(files, dict) and all(
            isinstance(v, dict) and isinstance(v.get("size"), int)
            and isinstance(v.get("crc32"), list) for v in files.values()
        )  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{MANIFEST} cannot be read ({type(e).__name__})") from None
    if not ok:
        raise ValueError(f"{MANIFEST} is not a manifest this version wrote")
    return files


def check(
    directory: str | os.PathLike,
    files: dict[str, dict],
    *,
    rank: int = 0,
    world: int = 1,
    checksums: bool = True,
) -> str | None:
    """What is wrong with this rank's share of the files (``sorted[rank::world]``), or None.

    The set of files must be the manifest's (a file missing or added is damage); sizes are
    compared for every file, checksums (unless ``checksums=False``: a quick look) for this
    rank's share only.
    """
    root = Path(directory)
    present = set(files_of(root))
    listed = set(files)
    if listed - present:
        return f"{sorted(listed - present)[0]} is missing (listed in {MANIFEST})"
    if present - listed:
        return f"{sorted(present - listed)[0]} is not listed in {MANIFEST} (added afterwards)"
    for name in sorted(listed):
        size = (root / name).stat().st_size
        if size != files[name]["size"]:
            return f"{name} has {size} bytes, {MANIFEST} says {files[name]['size']}"
    for name in sorted(listed)[rank::world] if checksums else []:
        _, crcs = _crcs(root / name)
        for i, (got, want) in enumerate(zip(crcs, files[name]["crc32"])):
            if got != want:
                size = files[name]["size"]
                end = min((i + 1) * CHUNK_BYTES, size)
                return (
                    f"{name} does not match its checksum (bytes {i * CHUNK_BYTES} to {end} of "
                    f"its {size} changed since it was written)"
                )
        if len(crcs) != len(files[name]["crc32"]):
            return f"{name} does not match its checksum (chunk count)"
    return None
