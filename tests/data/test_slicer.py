"""The one slicer (``data.slice_batch``), one test per layout the trainer trains, each against a
slicing written here from the definitions (never by calling the library's slicing again):

* dp: rows ``[r*b, (r+1)*b)``;
* sp: tokens ``[q*c, (q+1)*c)`` with ``c = ceil(S / sp)`` (DTensor's ``Shard(1)``), uneven too;
* ring x sp: zigzag chunks ``r`` and ``2*ring-1-r`` of ``S / (2*ring)`` tokens, then cut over sp;
* packed documents: the layout keeps the whole rows' document starts, positions stay global.

Labels are shifted over the whole row before slicing: every slice's last label is the next
token of the row. Shapes: ``G`` rows, ``S`` tokens.
"""

from __future__ import annotations

import pytest
import torch

from dtensor_ulysses.data import full_batch, slice_batch

G, S = 4, 24


def _rows(seed: int = 0, docs: bool = False):
    """Random whole rows: ids ``[G, S + 1]`` windows, labels = the next token (shifted first)."""
    g = torch.Generator().manual_seed(seed)
    win = torch.randint(0, 1000, (G, S + 1), generator=g)
    ids, labels = win[:, :-1], win[:, 1:]
    if not docs:
        return full_batch(ids, labels), ids, labels, torch.arange(S).expand(G, S), None
    starts = tuple((0, 5 + r, 13, 20 - r) for r in range(G))
    pos = torch.stack(
        [torch.tensor([t - max(s for s in row if s <= t) for t in range(S)]) for row in starts]
    )
    return full_batch(ids, labels, pos, starts), ids, labels, pos, starts


def _sp_piece(n: int, sp: int, q: int) -> range:
    c = -(-n // sp)
    lo = min(q * c, n)
    return range(lo, min(lo + c, n))


def _zigzag(ring: int, sp: int, r: int, q: int) -> list[int]:
    c = S // (2 * ring)
    mine = list(range(r * c, (r + 1) * c)) + list(range((2 * ring - 1 - r) * c, (2 * ring - r) * c))
    return [mine[i] for i in _sp_piece(len(mine), sp, q)]


def _check(got, ids, labels, pos, rows, cols) -> None:
    rows, cols = list(rows), list(cols)
    assert got.input_ids.tolist() == [[ids[i, t].item() for t in cols] for i in rows]
    assert got.labels.tolist() == [[labels[i, t].item() for t in cols] for i in rows]
    assert got.position_ids.tolist() == [[pos[i, t].item() for t in cols] for i in rows]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_dp_rows(dp):
    full, ids, labels, pos, _ = _rows()
    b = G // dp
    for r in range(dp):
        got = slice_batch(full, dp=dp, dp_rank=r)
        _check(got, ids, labels, pos, range(r * b, (r + 1) * b), range(S))
        assert got.layout.seq_sizes == (S,)
    with pytest.raises(ValueError, match=r"global batch 4 is not divisible by dp=3"):
        slice_batch(full, dp=3)


@pytest.mark.parametrize("sp", [1, 2, 3, 4])
def test_sp_slices_and_labels_at_the_edges(sp):
    full, ids, labels, pos, _ = _rows(1)
    for q in range(sp):
        got = slice_batch(full, sp=sp, sp_rank=q, uneven=False)
        cols = range(q * S // sp, (q + 1) * S // sp)
        _check(got, ids, labels, pos, range(G), cols)
        # the slice's last label is the first input of the next slice (shifted before slicing)
        if q + 1 < sp:
            assert torch.equal(got.labels[:, -1], ids[:, cols.stop])
        assert got.layout.seq_sizes == (S // sp,) * sp


@pytest.mark.parametrize("sp", [5, 7, 16])
def test_uneven_lengths(sp):
    full, ids, labels, pos, _ = _rows(2)
    sizes = []
    for q in range(sp):
        got = slice_batch(full, sp=sp, sp_rank=q)
        _check(got, ids, labels, pos, range(G), _sp_piece(S, sp, q))
        sizes.append(got.input_ids.shape[1])
    assert sum(sizes) == S and tuple(sizes) == got.layout.seq_sizes
    with pytest.raises(ValueError, match=rf"seq_len {S} is not divisible by sp={sp}"):
        slice_batch(full, sp=sp, uneven=False)


@pytest.mark.parametrize("ring,sp", [(2, 1), (2, 2), (3, 2), (2, 3)])
def test_ring_x_sp_zigzag(ring, sp):
    full, ids, labels, pos, _ = _rows(3)
    seen = []
    for r in range(ring):
        for q in range(sp):
            got = slice_batch(full, sp=sp, sp_rank=q, ring=ring, ring_rank=r)
            cols = _zigzag(ring, sp, r, q)
            _check(got, ids, labels, pos, range(G), cols)
            assert got.layout.ring == ring and got.layout.seq_len == S
            seen += cols
    assert sorted(seen) == list(range(S)), "every token on exactly one rank"


@pytest.mark.parametrize("ring,sp,dp", [(1, 2, 1), (2, 2, 2), (1, 3, 2)])
def test_packed_documents_keep_global_starts_and_positions(ring, sp, dp):
    full, ids, labels, pos, starts = _rows(4, docs=True)
    b = G // dp
    for d in range(dp):
        for r in range(ring):
            for q in range(sp):
                got = slice_batch(full, sp=sp, sp_rank=q, ring=ring, ring_rank=r, dp=dp, dp_rank=d)
                cols = _zigzag(ring, sp, r, q) if ring > 1 else _sp_piece(S, sp, q)
                _check(got, ids, labels, pos, range(d * b, (d + 1) * b), cols)
                assert got.layout.doc_starts == starts[d * b : (d + 1) * b]
