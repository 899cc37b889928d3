"""The memory trace's timeline: storage allocations, resizes and frees, and their peaks.

:class:`_Timeline` records, in order, every storage an op creates (by ``id`` of its untyped
storage, freed through a ``weakref.finalize``), each resize and free, and the phase marks of the
traced step; :meth:`_Timeline.peaks` replays the events afterwards into device peaks per segment
(with their composition by category) and the host peak, and :meth:`_Timeline.live_at_peak` lists
the largest device storages alive at the device peak. The recording mode that feeds it, and the
marks, are in ``_setup.py``; the results (:class:`PhasePeak`) in ``_results.py`` and the public
entry point in :mod:`dtensor_ulysses.memtrace.trace`.
"""

from __future__ import annotations

import os
import traceback
import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dtensor_ulysses.memtrace._results import CATEGORIES, PhasePeak

# the tracer's own folder, skipped when naming the library line that allocated a storage
_TRACER_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class _Timeline:
    """Storage allocations, resizes and frees in order, with phase marks; peaks computed later."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int]] = []  # ("a"|"r"|"f"|"m", uid, bytes or mark)
        self.marks: list[str] = []
        self._uid_of: dict[int, int] = {}  # id(storage) -> uid, live storages only
        self._size: dict[int, int] = {}  # uid -> bytes now
        self._next = 0
        self.host: set[int] = set()  # uids that live in host memory
        self.host_late: set[int] = set()  # on the device until the next mark, then host
        self.category: dict[int, str] = {}
        self.op: dict[int, str] = {}  # uid -> the op that created it (diagnostics)
        self.where: dict[int, str] = {}  # uid -> the library line that allocated it
        self.where_min_bytes: int | None = None  # record ``where`` from this size on (None: off)
        self.total_peak = 0  # set by peaks(): device + host bytes alive at once (CPU: both)

    # -- recording --
    def uid(self, t: torch.Tensor) -> int | None:
        st = t.untyped_storage()
        return self._uid_of.get(id(st))

    def add(self, t: torch.Tensor, *, host: bool = False, op: str = "") -> int | None:
        if t.device.type == "meta" or isinstance(t, DTensor):  # no memory of its own: a
            return None  # DTensor's local tensor is counted when the op on it dispatches
        st = t.untyped_storage()
        key = id(st)
        if key in self._uid_of:
            return self._uid_of[key]
        uid = self._next
        self._next += 1
        self._uid_of[key] = uid
        self._size[uid] = st.nbytes()
        if host:
            self.host.add(uid)
        self.events.append(("a", uid, st.nbytes()))
        self.op[uid] = op
        if self.where_min_bytes is not None and st.nbytes() >= self.where_min_bytes:
            self.where[uid] = _library_line()
        weakref.finalize(st, self._free, key, uid)
        return uid

    def _free(self, key: int, uid: int) -> None:
        if self._uid_of.get(key) == uid:
            del self._uid_of[key]
        self.events.append(("f", uid, 0))

    def resized(self, st: Any, nbytes: int) -> None:
        uid = self._uid_of.get(id(st))
        if uid is not None:
            self.events.append(("r", uid, nbytes - self._size[uid]))
            self._size[uid] = nbytes

    def mark(self, phase: str) -> None:
        self.marks.append(phase)
        self.events.append(("m", len(self.marks) - 1, 0))

    def is_host(self, t: torch.Tensor) -> bool:
        u = self.uid(t)
        return u is not None and u in self.host

    def set_host(self, t: torch.Tensor, *, late: bool = False) -> None:
        u = self.uid(t)
        if u is None:
            u = self.add(t)
        if u is None:
            return
        (self.host_late if late else self.host).add(u)

    def set_category(self, t: torch.Tensor, cat: str) -> None:
        u = self.uid(t)
        if u is not None:
            self.category.setdefault(u, cat)

    # -- analysis --
    def live_at_peak(self, start_mark: str, top: int) -> list[dict[str, Any]]:
        """The ``top`` largest device storages alive at the step's device peak (from the mark
        ``start_mark`` on), each with its bytes, category, the op and the library line that
        allocated it (``where`` is recorded for storages of at least ``where_min_bytes``)."""

        def replay(stop: int) -> tuple[int, dict[int, int]]:
            size: dict[int, int] = {}
            now, best, at, started = 0, -1, -1, False
            for i, (kind, uid, n) in enumerate(self.events[:stop]):
                if kind == "m":
                    started = started or self.marks[uid] == start_mark
                    continue
                if kind == "a":
                    size[uid] = n
                elif kind == "r":
                    size[uid] += n
                elif uid in size:
                    n = -size.pop(uid)
                else:
                    continue
                now += 0 if uid in self.host else n
                if started and now > best:
                    best, at = now, i
            return at, size

        at, _ = replay(len(self.events))  # where the device peak is
        _, live = replay(at + 1)  # what is alive there
        rows: list[dict[str, Any]] = [
            dict(bytes=b, category=self.category.get(u, "activations_and_buffers"),
                 op=self.op.get(u, ""), where=self.where.get(u, ""))
            for u, b in live.items() if u not in self.host
        ]  # fmt: skip
        return sorted(rows, key=lambda r: -r["bytes"])[:top]

    def peaks(self, start_mark: str) -> tuple[dict[tuple[str, str], PhasePeak], int]:
        """Device peaks per segment (with the composition at the peak) and the host peak, from
        the mark ``start_mark`` on; the bytes alive before it are the baseline. Segments are
        ``(phase, "start" | block index | "-")``: a phase is cut where each block starts."""
        dev_now: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        host_now = 0
        size: dict[int, int] = {}
        where: dict[int, str] = {}  # uid -> "host" | category
        pending: list[int] = []  # host_late uids still on the device
        phase: tuple[str, str] | None = None
        out: dict[tuple[str, str], PhasePeak] = {}
        host_peak = 0
        self.total_peak = 0

        def place(uid: int) -> str:
            if uid in self.host:
                return "host"
            return self.category.get(uid, "activations_and_buffers")

        def move(uid: int, to: str) -> None:
            nonlocal host_now
            n = size[uid]
            if where[uid] == "host":
                host_now -= n
            else:
                dev_now[where[uid]] -= n
            where[uid] = to
            if to == "host":
                host_now += n
            else:
                dev_now[to] += n

        def flush_pending() -> None:
            for u in pending:
                if u in size:
                    move(u, "host")
            pending.clear()

        for kind, uid, n in self.events:
            if kind == "m":
                flush_pending()
                name = self.marks[uid]
                if name == start_mark:
                    phase = ("forward", "start")
                elif phase is not None and name != "end":
                    ph, _, where_ = name.partition(":")
                    phase = (ph, where_ or ("start" if ph == "backward" else "-"))
                elif name == "end":
                    phase = None
                continue
            if kind == "a":
                size[uid] = n
                where[uid] = "activations_and_buffers"
                move_to = place(uid)
                where[uid] = move_to
                if move_to == "host":
                    host_now += n
                else:
                    dev_now[move_to] += n
                if uid in self.host_late:
                    pending.append(uid)
            elif kind == "r":
                size[uid] += n
                if where[uid] == "host":
                    host_now += n
                else:
                    dev_now[where[uid]] += n
            else:  # free
                if uid not in size:
                    continue
                move(uid, "host")  # out of the device sums
                host_now -= size.pop(uid)
                where.pop(uid)
            if phase is not None:
                total = sum(dev_now.values())
                cur = out.get(phase)
                if cur is None or total > cur.device:
                    out[phase] = PhasePeak(total, dict(dev_now))
                host_peak = max(host_peak, host_now)
                self.total_peak = max(self.total_peak, total + host_now)
        return out, host_peak


def _library_line() -> str:
    """``file:line (function)`` of the innermost ``dtensor_ulysses`` frame outside the tracer's
    folder, with its caller in the library, e.g. ``llama.py:89 (forward) < tiling.py:50
    (backward)``."""
    frames = [
        f for f in traceback.extract_stack()
        if "dtensor_ulysses" in f.filename
        and not os.path.abspath(f.filename).startswith(_TRACER_DIR)
    ]  # fmt: skip
    return " < ".join(
        f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} ({f.name})" for f in frames[::-1][:2]
    )
