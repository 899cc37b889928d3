"""File modes of what the trainer exports: as a plain ``mkdir`` and ``open`` would make them.

A directory written beside its destination and renamed into place (``tempfile.mkdtemp``, mode
``0700``) and files some writers create private (``0600``) would leave an exported model unreadable
by the group, unlike the checkpoints next to it. :func:`apply_umask` gives every directory
``0777`` and every file ``0666``, less the process's umask, as ``mkdir`` and ``open`` do.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["apply_umask", "current_umask"]


def current_umask() -> int:
    """This process's umask (read from ``/proc`` where it can be, else set and restored)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(root: str | os.PathLike) -> None:
    """Set ``root``, every directory under it to ``0777 & ~umask`` and every file to
    ``0666 & ~umask`` (symbolic links are left alone)."""
    mask = current_umask()
    root = Path(root)
    os.chmod(root, 0o777 & ~mask)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, 0o777 & ~mask)
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, 0o666 & ~mask)
