"""Differentiable all-to-all over a process group: communication only, no attention logic.

Legend: ``P`` ranks in the group; a tensor's *scatter dim* is cut into ``P`` pieces, piece ``j``
going to rank ``j``; the pieces received are concatenated, in rank order, along the *gather dim*.

    x[..., n_scatter, ..., m_gather, ...]  ->  y[..., n_scatter / P, ..., m_gather * P, ...]

Pieces may be uneven: ``scatter_sizes[j]`` is how much of the scatter dim goes to rank ``j`` and
``gather_sizes[j]`` how much of the gather dim arrives from rank ``j`` (every rank must pass the
same lists, except that ``gather_sizes`` lists the *senders'* sizes). Several tensors that share
the group and the dims can travel in one collective (pass a list): each rank packs, per
destination, the pieces of every tensor into one buffer, so q, k and v move with one launch and
the same bytes as three.

The backward of an all-to-all is the all-to-all with scatter and gather swapped (and their size
lists swapped), so forward and backward are one ``all_to_all_single`` each, on every backend
(NCCL and gloo alike), with the public ``torch.distributed.all_to_all_single``. Under
``torch.compile`` the same exchange runs through functional collectives instead (see
:func:`_exchange_functional`), so a compiled block has no graph break at the collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from dtensor_ulysses._torch_private import functional_all_to_all

__all__ = [
    "AllToAllInFlight",
    "PendingExchange",
    "all_to_all",
    "dim_order",
    "even_sizes",
    "start_exchange",
]

Sizes = Sequence[int]


def even_sizes(n: int, P: int) -> list[int]:
    """``n`` split in ``P`` equal parts (``n`` divisible by ``P``)."""
    return [n // P] * P


def _piece_shape(shape: torch.Size, dim_a: int, size_a: int, dim_b: int, size_b: int) -> list[int]:
    out = list(shape)
    out[dim_a], out[dim_b] = size_a, size_b
    return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _recv_shapes(xs, scatter_dim, gather_dim, scatter_sizes, gather_sizes, P: int, me: int):
    """From rank ``j``, tensor ``i`` arrives with scatter dim = my share, gather dim = ``j``'s."""
    return [
        [
            _piece_shape(x.shape, scatter_dim, scatter_sizes[i][me], gather_dim, gather_sizes[i][j])
            for i, x in enumerate(xs)
        ]
        for j in range(P)
    ]


def _strided_blocks(
    buf: torch.Tensor, P: int, block: int, offset: int, piece: Sequence[int]
) -> torch.Tensor:
    """``buf`` seen as ``[P, *piece]``: piece ``j`` at ``offset + j * block`` (contiguous)."""
    stride, acc = [], 1
    for size in reversed(piece):
        stride.append(acc)
        acc *= size
    return buf.as_strided([P, *piece], [block, *reversed(stride)], buf.storage_offset() + offset)


class PendingExchange:
    """An all-to-all in flight (``async_op=True``); :meth:`wait` unpacks and returns the results.

    The results are allocated when waited for, after the send buffer is released: in flight,
    an exchange holds its send and receive buffers only. Not differentiable: for code that
    computes its own gradients (the head-chunked stages).
    """

    def __init__(self, work, send, recv, out_shapes, recv_shapes, out_splits, gather_dim, order):
        self._work, self._send, self._recv = work, send, recv
        self._unpack = (out_shapes, recv_shapes, out_splits, gather_dim, order)

    def wait(self) -> list[torch.Tensor]:
        if self._work is not None:
            self._work.wait()
        recv, (out_shapes, recv_shapes, out_splits, gather_dim, order) = self._recv, self._unpack
        self._work = self._send = self._recv = None
        per_tensor = order is not None and not isinstance(order[0], int)
        orders = order if order is None or per_tensor else [order] * len(out_shapes)
        row_major = orders is None or orders[0] is None
        if len(out_shapes) == 1 and row_major and _leading_ones(out_shapes[0], gather_dim):
            return [recv.view(out_shapes[0])]  # the pieces, in rank order, are the result
        outs = [
            _empty_in_order(recv, shape, None if orders is None else orders[i])
            for i, shape in enumerate(out_shapes)
        ]
        _move(outs, recv, recv_shapes, out_splits, gather_dim, packing=False)
        return outs


def start_exchange(
    xs: Sequence[torch.Tensor],
    scatter_dim: int,
    gather_dim: int,
    scatter_sizes: Sequence[Sizes],
    gather_sizes: Sequence[Sizes],
    group: dist.ProcessGroup,
    dim_order: Sequence[int] | None = None,
    *,
    async_op: bool = True,
) -> PendingExchange:
    """The collective: per destination, the pieces of every tensor, in one 1-D buffer.

    Each byte is copied once on the way in (into the preallocated send buffer) and once on the
    way out (into the results): one strided copy per tensor when its pieces are equal for every
    rank (and the blocks of the other tensors too), else one copy per piece. A copy is skipped
    where the memory already is the buffer: one contiguous tensor cut along its outermost
    non-unit dim is sent as it is, and one result gathered along its outermost non-unit dim,
    row-major, is a view of the receive buffer (e.g. ``B = 1`` and ``S`` cut or gathered,
    as DeepSpeed's layout permutes degenerate there). With ``async_op``
    the all-to-all runs in the background until :meth:`PendingExchange.wait`. ``dim_order``:
    the results' memory layout (see :func:`all_to_all`), one for all, or one per tensor.
    """
    P, me = dist.get_world_size(group), dist.get_rank(group)
    # send: destination j's block holds, in tensor order, the piece of every tensor for j
    send_shapes = [
        [_piece_shape(x.shape, scatter_dim, scatter_sizes[i][j], gather_dim, x.shape[gather_dim])
         for i, x in enumerate(xs)]
        for j in range(P)
    ]  # fmt: skip
    # recv: from rank j, tensor i arrives with scatter dim = my share, gather dim = j's size
    recv_shapes = _recv_shapes(xs, scatter_dim, gather_dim, scatter_sizes, gather_sizes, P, me)
    in_splits = [sum(_numel(s) for s in shapes) for shapes in send_shapes]
    out_splits = [sum(_numel(s) for s in shapes) for shapes in recv_shapes]
    if len(xs) == 1 and xs[0].is_contiguous() and _leading_ones(xs[0].shape, scatter_dim):
        send = xs[0].reshape(-1)  # the pieces, in rank order, already are the buffer
    else:
        send = xs[0].new_empty(sum(in_splits))
        _move(xs, send, send_shapes, in_splits, scatter_dim, packing=True)
    recv = send.new_empty(sum(out_splits))
    out_shapes = [
        _piece_shape(x.shape, scatter_dim, scatter_sizes[i][me], gather_dim, sum(gather_sizes[i]))
        for i, x in enumerate(xs)
    ]
    work = dist.all_to_all_single(recv, send, out_splits, in_splits, group=group, async_op=async_op)
    order: tuple | None = None
    if dim_order is not None:
        order = tuple(tuple(o) if isinstance(o, Sequence) else o for o in dim_order)
    return PendingExchange(work, send, recv, out_shapes, recv_shapes, out_splits, gather_dim, order)


def _exchange(xs, scatter_dim, gather_dim, scatter_sizes, gather_sizes, group, dim_order=None):
    """:func:`start_exchange`, waited for at once."""
    return start_exchange(
        xs, scatter_dim, gather_dim, scatter_sizes, gather_sizes, group, dim_order, async_op=False
    ).wait()


def _leading_ones(shape: Sequence[int], dim: int) -> bool:
    """Whether every dim before ``dim`` has size 1 (so the pieces along ``dim`` of a
    row-major tensor are consecutive in memory)."""
    return all(size == 1 for size in shape[:dim])


def _empty_in_order(like: torch.Tensor, shape: list[int], order: Sequence[int] | None):
    """An empty tensor of ``shape`` whose memory is laid out with dims in ``order`` (outermost
    first; ``None``: row-major), e.g. ``(0, 2, 1, 3)``: a ``[B, S, N, H]`` tensor stored as
    ``[B, N, S, H]``, whose ``transpose(1, 2)`` is contiguous."""
    if order is None:
        return like.new_empty(shape)
    inverse = sorted(range(len(order)), key=lambda d: order[d])
    return like.new_empty([shape[d] for d in order]).permute(inverse)


def _move(
    tensors: Sequence[torch.Tensor],
    buf: torch.Tensor,
    shapes: Sequence[Sequence[Sequence[int]]],
    splits: Sequence[int],
    dim: int,
    *,
    packing: bool,
) -> None:
    """Copy ``tensors`` into ``buf`` (packing) or ``buf`` into ``tensors``, cut along ``dim``:
    rank ``j``'s block of ``buf`` holds piece ``j`` of every tensor, in order."""
    P = len(splits)
    starts = [0] * P
    for j in range(1, P):
        starts[j] = starts[j - 1] + splits[j - 1]
    within = [0] * P  # offset of the current tensor inside each rank's block
    for i, t in enumerate(tensors):
        sizes = [shapes[j][i][dim] for j in range(P)]
        equal = len(set(sizes)) == 1 and len(set(splits)) == 1 and len(set(within)) == 1
        if equal and sizes[0] > 0:  # one strided copy for all ranks
            view = _strided_blocks(buf, P, splits[0], within[0], shapes[0][i])
            pieces = t.unflatten(dim, (P, sizes[0])).movedim(dim, 0)
            (view.copy_(pieces) if packing else pieces.copy_(view))
        else:  # uneven pieces: one copy per piece
            lo = 0
            for j in range(P):
                if sizes[j]:
                    n = _numel(shapes[j][i])
                    flat = buf.narrow(0, starts[j] + within[j], n).view(shapes[j][i])
                    piece = t.narrow(dim, lo, sizes[j])
                    (flat.copy_(piece) if packing else piece.copy_(flat))
                lo += sizes[j]
        for j in range(P):
            within[j] += _numel(shapes[j][i])


def _exchange_functional(
    xs: Sequence[torch.Tensor],
    scatter_dim: int,
    gather_dim: int,
    scatter_sizes: Sequence[Sizes],
    gather_sizes: Sequence[Sizes],
    group: dist.ProcessGroup,
) -> list[torch.Tensor]:
    """The same exchange with functional ops only, for ``torch.compile``: the pieces are
    concatenated instead of copied into preallocated buffers, and the functional all-to-all
    (differentiable itself: its backward is the reverse all-to-all) moves them. Same bytes."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    pieces, in_splits, offsets = [], [], [0] * len(xs)
    for j in range(P):
        for i, x in enumerate(xs):
            pieces.append(x.narrow(scatter_dim, offsets[i], scatter_sizes[i][j]).reshape(-1))
            offsets[i] += scatter_sizes[i][j]
        in_splits.append(sum(p.numel() for p in pieces[-len(xs) :]))
    recv_shapes = _recv_shapes(xs, scatter_dim, gather_dim, scatter_sizes, gather_sizes, P, me)
    out_splits = [sum(_numel(s) for s in shapes) for shapes in recv_shapes]
    recv = functional_all_to_all(torch.cat(pieces), out_splits, in_splits, group)
    parts: list[list[torch.Tensor]] = [[] for _ in xs]
    for j, chunk in enumerate(recv.split(out_splits)):
        for i, flat in enumerate(chunk.split([_numel(s) for s in recv_shapes[j]])):
            parts[i].append(flat.view(recv_shapes[j][i]))
    return [torch.cat(p, dim=gather_dim) for p in parts]


def dim_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The memory layout of ``t`` as dims outermost first (``None``: row-major), e.g.
    ``(0, 2, 1, 3)`` for ``x_BNSH.transpose(1, 2)``; size-1 dims keep their place."""
    if t.is_contiguous():
        return None
    strides = t.stride()
    big = iter(sorted((d for d in range(t.dim()) if t.shape[d] > 1), key=lambda d: -strides[d]))
    order = tuple(d if t.shape[d] == 1 else next(big) for d in range(t.dim()))
    return None if order == tuple(range(t.dim())) else order


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def _remember(ctx, scatter_dim, gather_dim, scatter_sizes, gather_sizes, group, xs) -> None:
        """What the reverse exchange needs; each gradient comes back in its input's layout."""
        ctx.args = (scatter_dim, gather_dim, scatter_sizes, gather_sizes, group)
        ctx.orders = tuple(dim_order(x) for x in xs)

    @staticmethod
    def forward(ctx, scatter_dim, gather_dim, scatter_sizes, gather_sizes, group, order, *xs):
        _AllToAll._remember(ctx, scatter_dim, gather_dim, scatter_sizes, gather_sizes, group, xs)
        return tuple(
            _exchange(xs, scatter_dim, gather_dim, scatter_sizes, gather_sizes, group, order)
        )

    @staticmethod
    def backward(ctx, *grads):
        scatter_dim, gather_dim, scatter_sizes, gather_sizes, group = ctx.args
        # reverse: scatter along the old gather dim by the senders' sizes, gather back ours
        back = _exchange(
            grads, gather_dim, scatter_dim, gather_sizes, scatter_sizes, group, ctx.orders
        )
        return (None, None, None, None, None, None, *back)


class _Landed(_AllToAll):
    """An exchange started earlier (:class:`AllToAllInFlight`), now waited for; its backward
    is :class:`_AllToAll`'s (the reverse exchange, synchronous)."""

    @staticmethod
    def forward(ctx, scatter_dim, gather_dim, scatter_sizes, gather_sizes, group, pending, *xs):
        _AllToAll._remember(ctx, scatter_dim, gather_dim, scatter_sizes, gather_sizes, group, xs)
        return tuple(pending.wait())


class AllToAllInFlight:
    """A differentiable all-to-all started now and finished by :meth:`wait`.

    The exchange of :func:`all_to_all` (one collective for all of ``xs``, explicit sizes),
    started asynchronously so the caller computes something else while it moves; :meth:`wait`
    returns the results connected to ``xs`` in the autograd graph (backward: the reverse
    all-to-all, synchronous). ``xs`` must not be modified in place before :meth:`wait`.
    """

    def __init__(
        self,
        xs: Sequence[torch.Tensor],
        *,
        scatter_dim: int,
        gather_dim: int,
        group: dist.ProcessGroup,
        scatter_sizes: Sequence[Sizes],
        gather_sizes: Sequence[Sizes],
        dim_order: Sequence[int] | None = None,
    ) -> None:
        self._xs = list(xs)
        sc = tuple(tuple(s) for s in scatter_sizes)
        ga = tuple(tuple(g) for g in gather_sizes)
        self._args = (scatter_dim, gather_dim, sc, ga, group)
        with torch.no_grad():
            self._pending = start_exchange(
                [x.detach() for x in xs], scatter_dim, gather_dim, sc, ga, group, dim_order
            )

    def wait(self) -> list[torch.Tensor]:
        """The results (differentiable), once the exchange has arrived."""
        return list(_Landed.apply(*self._args, self._pending, *self._xs))


def all_to_all(
    xs: torch.Tensor | Sequence[torch.Tensor],
    *,
    scatter_dim: int,
    gather_dim: int,
    group: dist.ProcessGroup,
    scatter_sizes: Sizes | Sequence[Sizes] | None = None,
    gather_sizes: Sizes | Sequence[Sizes] | None = None,
    dim_order: Sequence[int] | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """All-to-all of one tensor or several tensors in a single collective, differentiable.

    Args:
        xs: a tensor, or a sequence of tensors of one dtype and device with the same rank.
        scatter_dim: dim cut into ``P`` pieces, piece ``j`` sent to rank ``j``.
        gather_dim: dim along which the received pieces are concatenated in rank order.
        group: the process group (e.g. ``mesh.get_group("sp")``).
        scatter_sizes: per destination rank, how much of the scatter dim it gets (one list, or
            one list per tensor). Default: equal parts.
        gather_sizes: per source rank, the size of the gather dim it holds (one list, or one
            per tensor). Default: equal, this rank's own size.
        dim_order: the memory layout of the results, dims outermost first (``None``:
            row-major), e.g. ``(0, 2, 1, 3)`` to receive ``[B, S, N, H]`` stored as
            ``[B, N, S, H]``, the layout SDPA consumes: the received pieces are written there
            directly, no further copy. Ignored under ``torch.compile``. In backward each
            gradient is written in the layout of its input (e.g. a kernel's head-major ``o``
            receives a head-major ``d o``).

    Returns:
        The exchanged tensor (or a list, if ``xs`` was a sequence). Forward issues exactly one
        ``all_to_all_single`` (none when the group has one rank); backward issues exactly one.
    """
    single = isinstance(xs, torch.Tensor)
    tensors: list[torch.Tensor] = [xs] if isinstance(xs, torch.Tensor) else list(xs)
    ndim = tensors[0].dim()
    for d, name in ((scatter_dim, "scatter_dim"), (gather_dim, "gather_dim")):
        if not 0 <= d < ndim:
            raise ValueError(f"{name}={d} is out of range for {ndim}-D tensors; use 0..{ndim - 1}")
    if scatter_dim == gather_dim:
        raise ValueError(f"scatter_dim and gather_dim are both {scatter_dim}; they must differ")
    P = dist.get_world_size(group)
    for i, t in enumerate(tensors):
        if t.dim() != ndim or t.dtype != tensors[0].dtype or t.device != tensors[0].device:
            raise ValueError(
                f"tensor {i} is {t.dim()}-D {t.dtype} on {t.device}, tensor 0 is "
                f"{ndim}-D {tensors[0].dtype} on {tensors[0].device}; fused tensors must match"
            )
    sc = _per_tensor(scatter_sizes, tensors, P, "scatter_sizes")
    ga = _per_tensor(gather_sizes, tensors, P, "gather_sizes")
    for i, t in enumerate(tensors):
        if sc[i] is None:
            if t.shape[scatter_dim] % P:
                raise ValueError(
                    f"tensor {i}: dim {scatter_dim} has size {t.shape[scatter_dim]}, not "
                    f"divisible by the group size {P}; pass scatter_sizes for uneven pieces"
                )
            sc[i] = even_sizes(t.shape[scatter_dim], P)
        elif sum(sc[i]) != t.shape[scatter_dim]:
            raise ValueError(
                f"tensor {i}: scatter_sizes {list(sc[i])} sum to {sum(sc[i])}, but dim "
                f"{scatter_dim} has size {t.shape[scatter_dim]}"
            )
        if ga[i] is None:
            ga[i] = [t.shape[gather_dim]] * P
        elif ga[i][dist.get_rank(group)] != t.shape[gather_dim]:
            raise ValueError(
                f"tensor {i}: gather_sizes {list(ga[i])} say this rank holds "
                f"{ga[i][dist.get_rank(group)]} along dim {gather_dim}, it holds "
                f"{t.shape[gather_dim]}"
            )
    if P == 1:
        return tensors[0] if single else tensors
    if torch.compiler.is_compiling():  # traced by dynamo: no autograd.Function, no c10d call
        out = _exchange_functional(tensors, scatter_dim, gather_dim, sc, ga, group)
        return out[0] if single else out
    sc_t = tuple(tuple(s) for s in sc)
    ga_t = tuple(tuple(g) for g in ga)
    order = None if dim_order is None else tuple(dim_order)
    out = _AllToAll.apply(scatter_dim, gather_dim, sc_t, ga_t, group, order, *tensors)
    return out[0] if single else list(out)


def _per_tensor(sizes, tensors, P: int, name: str) -> list:
    if sizes is None:
        return [None] * len(tensors)
    if len(sizes) and isinstance(sizes[0], int):
        sizes = [sizes] * len(tensors)
    if len(sizes) != len(tensors):
        raise ValueError(f"{name}: {len(sizes)} lists for {len(tensors)} tensors")
    for s in sizes:
        if len(s) != P or any(v < 0 for v in s):
            raise ValueError(f"{name}: {list(s)} must hold {P} non-negative sizes, one per rank")
    return [list(s) for s in sizes]
