"""CommCounter: count the collectives a rank issues, and their bytes.

:class:`CommCounter` is a ``TorchDispatchMode`` that records every c10d and functional collective
(including those issued by DTensor, FSDP2 and autograd backward): kind, group, input bytes. A
rank's *bytes* for a collective are the size of the buffer it passes in (for an all-gather, the
local shard; for a reduce-scatter, the full buffer). Point-to-point: each send
(``dist.send``/``isend``, also inside ``batch_isend_irecv``) is one ``p2p``; each receive is one
``p2p_recv``, with its buffer's bytes.

Legend: no shaped tensor names here; a tensor's bytes are ``numel * element_size`` (summed over
a list of tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtensor_ulysses._torch_private import TorchDispatchMode

__all__ = ["CollectiveCall", "CommCounter"]

# (namespace, op name) -> (kind, index of the input argument, index of the group argument)
_C10D = {
    "alltoall_base_": ("all_to_all", 1, 2),
    "alltoall_": ("all_to_all", 1, 2),
    "_allgather_base_": ("all_gather", 1, 2),
    "allgather_": ("all_gather", 1, 2),
    "allgather_coalesced_": ("all_gather", 1, 2),
    "allgather_into_tensor_coalesced_": ("all_gather", 1, 2),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 2),
    "reduce_scatter_": ("reduce_scatter", 1, 2),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 2),
    "allreduce_": ("all_reduce", 0, 1),
    "allreduce_coalesced_": ("all_reduce", 0, 1),
    "broadcast_": ("broadcast", 0, 1),
    "reduce_": ("reduce", 0, 1),
    "gather_": ("gather", 1, 2),
    "scatter_": ("scatter", 1, 2),
    "send": ("p2p", 0, 1),
    "recv_": ("p2p_recv", 0, 1),  # kept apart: "p2p" bytes are what goes on the wire
    "barrier": ("barrier", 0, 1),
}
_FUNCTIONAL = {  # input first, group name last
    "all_to_all_single": "all_to_all",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "broadcast": "broadcast",
}


@dataclass(frozen=True)
class CollectiveCall:
    """One collective: its kind (``all_to_all``, ``all_gather``, ...), group, op and input bytes."""

    kind: str
    group_name: str
    op: str
    bytes: int


def _nbytes(x: object) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _group_name(g: object) -> str:
    if isinstance(g, str):
        return g
    if isinstance(g, torch.ScriptObject):
        g = dist.ProcessGroup.unbox(g)
    return getattr(g, "group_name", "?")


class CommCounter(TorchDispatchMode):
    """Record every collective issued inside the ``with`` block (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[CollectiveCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        if ns == "c10d" and name in _C10D:
            kind, i_in, i_group = _C10D[name]
            self.calls.append(
                CollectiveCall(kind, _group_name(args[i_group]), name, _nbytes(args[i_in]))
            )
        elif ns in ("_c10d_functional", "_c10d_functional_autograd") and name in _FUNCTIONAL:
            self.calls.append(
                CollectiveCall(_FUNCTIONAL[name], _group_name(args[-1]), name, _nbytes(args[0]))
            )
        return func(*args, **kwargs)

    def _select(self, kind: str | None, group: dist.ProcessGroup | None) -> list[CollectiveCall]:
        gname = None if group is None else group.group_name
        return [
            c
            for c in self.calls
            if (kind is None or c.kind == kind) and (gname is None or c.group_name == gname)
        ]

    def count(self, kind: str | None = None, group: dist.ProcessGroup | None = None) -> int:
        """Number of collectives of ``kind`` (any if ``None``) on ``group`` (any if ``None``)."""
        return len(self._select(kind, group))

    def bytes(self, kind: str | None = None, group: dist.ProcessGroup | None = None) -> int:
        """Input bytes this rank passed into the selected collectives."""
        return sum(c.bytes for c in self._select(kind, group))

    def by_kind(self) -> dict[str, dict[str, int]]:
        """``{kind: {"count": n, "bytes": b}}`` over everything recorded."""
        out: dict[str, dict[str, int]] = {}
        for c in self.calls:
            d = out.setdefault(c.kind, {"count": 0, "bytes": 0})
            d["count"] += 1
            d["bytes"] += c.bytes
        return out

    def reset(self) -> None:
        self.calls.clear()
