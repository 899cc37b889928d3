"""Pure, single-process tests of ``dtensor_ulysses.data.batch``.

References are built here from the packed stream and ``sample_index`` with plain Python, never by
calling ``get_batch`` again. Shapes: ``G`` global batch, ``S`` seq_len, ``s = S / sp``.
"""

from __future__ import annotations

import json
import pathlib
import random
import sysconfig

import pytest
import torch

from dtensor_ulysses.data import (
    SEP_ID,
    VOCAB_SIZE,
    Batch,
    PackedCorpus,
    decode,
    default_corpus_paths,
    document_positions,
    encode,
    get_batch,
    read_documents,
    sample_index,
)
from dtensor_ulysses.plan.splits import padded_seq_len, seq_split

LAYOUTS = [(1, 1), (1, 2), (2, 1), (1, 4), (2, 2)]
S, G = 16, 4


def _documents(n: int = 12, seed: int = 0) -> list[bytes]:
    """Documents of 1..60 bytes, including non-ASCII text, all different."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "γάμμα", "delta", "日本語", "ε", "zeta\n", "🙂"]
    docs = []
    for j in range(n):
        text = f"{j}:" + " ".join(rng.choice(words) for _ in range(rng.randint(0, 8)))
        docs.append(text.encode("utf-8"))
    return docs


@pytest.fixture(scope="module")
def docs() -> list[bytes]:
    return _documents()


@pytest.fixture(scope="module")
def corpus(docs: list[bytes]) -> PackedCorpus:
    return PackedCorpus(docs, S)


def _stream_list(docs: list[bytes]) -> list[int]:
    out: list[int] = []
    for d in docs:
        out += [SEP_ID, *d]
    return out


def _positions(tokens: list[int], pack_docs: bool) -> list[int]:
    if not pack_docs:
        return list(range(len(tokens)))
    out, pos = [], -1
    for t in tokens:
        pos = 0 if t == SEP_ID else pos + 1
        out.append(pos)
    return out


def _reference(corpus: PackedCorpus, step: int, seed: int, pack_docs: bool = False):
    """Global ``[G, S]`` inputs, labels, positions straight from the stream."""
    stream = corpus.stream.tolist()
    ids, labels, pos = [], [], []
    for i in range(G):
        w = sample_index(step, i, G, len(corpus), seed)
        window = stream[w * S : w * S + S + 1]
        ids.append(window[:-1])
        labels.append(window[1:])
        pos.append(_positions(window[:-1], pack_docs))
    return tuple(torch.tensor(x, dtype=torch.int64) for x in (ids, labels, pos))


def _pieces(corpus, step, dp, sp, seed=0, pack_docs=False) -> dict[tuple[int, int], Batch]:
    return {
        (r, q): get_batch(
            corpus,
            step,
            global_batch_size=G,
            dp_rank=r,
            dp=dp,
            sp_rank=q,
            sp=sp,
            seed=seed,
            pack_docs=pack_docs,
        )
        for r in range(dp)
        for q in range(sp)
    }


def _assemble(corpus, step, dp, sp, seed=0, pack_docs=False):
    """The global ``[G, S]`` batch put back together from every (dp_rank, sp_rank) piece."""
    pieces = _pieces(corpus, step, dp, sp, seed, pack_docs)
    out = []
    for field in ("input_ids", "labels", "position_ids"):
        rows = [
            torch.cat([getattr(pieces[r, q], field) for q in range(sp)], dim=1) for r in range(dp)
        ]
        out.append(torch.cat(rows, dim=0))
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------
def test_encode_decode_round_trip():
    text = "Grüße, κόσμε! 日本語 🙂\n\ttabs and ascii"
    ids = encode(text)
    assert ids.dtype == torch.int64
    assert ids.tolist() == list(text.encode("utf-8"))
    assert decode(ids) == text
    assert decode(ids.tolist()) == text
    assert encode("").numel() == 0 and decode(encode("")) == ""
    assert VOCAB_SIZE == SEP_ID + 1 == 257


def test_decode_skips_sep_and_replaces_invalid_bytes():
    ids = [SEP_ID, *encode("ab").tolist(), SEP_ID, 0xFF, *encode("c").tolist(), -100, 300]
    assert decode(ids) == "ab\ufffdc"
    assert decode(torch.tensor([[SEP_ID, 104], [105, SEP_ID]])) == "hi"


# ----------------------------------------------------------------------------------------------
# packing
# ----------------------------------------------------------------------------------------------
def test_packed_stream_and_windows(docs, corpus):
    ref = _stream_list(docs)
    assert corpus.stream.dtype == torch.int16
    assert corpus.stream.tolist() == ref
    assert corpus.n_tokens == len(ref)
    assert corpus.n_documents == len(docs)
    assert len(corpus) == (len(ref) - 1) // S
    for w in range(len(corpus)):
        window = corpus[w]
        assert window.dtype == torch.int64 and window.tolist() == ref[w * S : w * S + S + 1]
        if w + 1 < len(corpus):  # the last label of a window is the first input of the next
            assert window[-1] == corpus[w + 1][0]
    with pytest.raises(IndexError, match="out of range"):
        corpus[len(corpus)]


def test_corpus_smaller_than_one_window():
    with pytest.raises(ValueError, match=r"has 6 tokens but one window of seq_len=8 needs 9"):
        PackedCorpus([b"ab", b"cd"], 8)
    assert len(PackedCorpus([b"ab", b"cd"], 5)) == 1  # exactly one window fits
    with pytest.raises(ValueError, match="seq_len=0 must be a positive int"):
        PackedCorpus([b"abc"], 0)
    with pytest.raises(TypeError, match=r"document 0 is a str.*text.encode"):
        PackedCorpus(["abc"], 1)


def test_from_paths_matches_and_caches(tmp_path, docs):
    paths = []
    for j, d in enumerate(docs):
        paths.append(tmp_path / f"{j:02d}.txt")
        paths[-1].write_bytes(d)
    a = PackedCorpus.from_paths(paths, seq_len=S)
    b = PackedCorpus.from_paths([str(p) for p in paths], seq_len=2 * S)
    assert a.stream.tolist() == _stream_list(docs)
    assert b.stream is a.stream  # one stream per process, whatever the seq_len
    paths[0].write_bytes(b"changed, and longer than before")
    assert PackedCorpus.from_paths(paths, seq_len=S).stream.tolist() != a.stream.tolist()


# ----------------------------------------------------------------------------------------------
# global batch: every token once, labels, positions
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pack_docs", [False, True])
@pytest.mark.parametrize("dp,sp", LAYOUTS)
def test_every_token_once_per_step(corpus, dp, sp, pack_docs):
    for step in (0, 1, 7):
        pieces = _pieces(corpus, step, dp, sp, seed=3, pack_docs=pack_docs)
        for batch in pieces.values():
            for t in (batch.input_ids, batch.labels, batch.position_ids):
                assert t.dtype == torch.int64 and t.shape == (G // dp, S // sp)
        got = _assemble(corpus, step, dp, sp, seed=3, pack_docs=pack_docs)
        want = _reference(corpus, step, seed=3, pack_docs=pack_docs)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_same_global_batch_for_every_layout(corpus):
    for step in range(3):
        base = _assemble(corpus, step, 1, 1, seed=5, pack_docs=True)
        for dp, sp in LAYOUTS[1:]:
            got = _assemble(corpus, step, dp, sp, seed=5, pack_docs=True)
            for g, b in zip(got, base):
                assert torch.equal(g, b), (step, dp, sp)


def test_labels_at_slice_boundaries(corpus):
    sp, s, step, seed = 4, S // 4, 2, 1
    pieces = _pieces(corpus, step, 1, sp, seed=seed)
    stream = corpus.stream.tolist()
    for row in range(G):
        w = sample_index(step, row, G, len(corpus), seed)
        for q in range(sp):
            last = pieces[0, q].labels[row, -1].item()
            k = w * S + (q + 1) * s - 1  # stream index of this slice's last input
            assert pieces[0, q].input_ids[row, -1].item() == stream[k]
            assert last == stream[k + 1]
            if q + 1 < sp:
                assert last == pieces[0, q + 1].input_ids[row, 0].item()


def test_position_ids_are_global(corpus):
    sp, s = 4, S // 4
    for (_, q), batch in _pieces(corpus, 0, 2, sp).items():
        want = torch.arange(q * s, (q + 1) * s).expand(G // 2, s)
        assert torch.equal(batch.position_ids, want)


def test_pack_docs_positions_restart_at_sep(corpus):
    ids, _, pos = _assemble(corpus, 4, 2, 2, seed=0, pack_docs=True)
    assert (pos[ids == SEP_ID] == 0).all()
    assert ((ids == SEP_ID).sum() > 0).item()
    after = pos[:, 1:][ids[:, 1:] != SEP_ID]  # elsewhere: one more than the token before
    assert torch.equal(after, pos[:, :-1][ids[:, 1:] != SEP_ID] + 1)
    assert (pos[:, 0] == 0).all()  # before the first SEP: count from the window start
    x = torch.tensor([[7, 8, SEP_ID, 9, SEP_ID, 5], [SEP_ID, 1, 2, 3, 4, 5]])
    assert document_positions(x).tolist() == [[0, 1, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5]]


# ----------------------------------------------------------------------------------------------
# sampling
# ----------------------------------------------------------------------------------------------
def test_determinism_seeds_and_steps(corpus):
    a = _assemble(corpus, 3, 2, 2, seed=11)[0]
    assert torch.equal(a, _assemble(corpus, 3, 2, 2, seed=11)[0])
    assert not torch.equal(a, _assemble(corpus, 3, 2, 2, seed=12)[0])
    assert not torch.equal(a, _assemble(corpus, 4, 2, 2, seed=11)[0])


def test_epoch_wrap_reads_each_window_once_per_epoch():
    n, gbs, seed = 7, 3, 42
    order = [sample_index(t, i, gbs, n, seed) for t in range(14) for i in range(gbs)]  # 6 epochs
    epochs = [order[e * n : (e + 1) * n] for e in range(len(order) // n)]
    for e in epochs:
        assert sorted(e) == list(range(n))
    assert len({tuple(e) for e in epochs}) > 1  # a new permutation each epoch
    assert order == [sample_index(t, i, gbs, n, seed) for t in range(14) for i in range(gbs)]


def test_sample_index_validation():
    with pytest.raises(
        ValueError, match=r"sample i=4 is out of range for global batch 4; use 0\.\.3"
    ):
        sample_index(0, 4, 4, 10, 0)
    with pytest.raises(ValueError, match="step=-1 must be an int >= 0"):
        sample_index(-1, 0, 4, 10, 0)
    with pytest.raises(ValueError, match="n_windows=0 must be an int >= 1"):
        sample_index(0, 0, 4, 0, 0)


def test_get_batch_validation(corpus):
    def call(**overrides):
        kwargs = dict(global_batch_size=8, dp_rank=0, dp=1, sp_rank=0, sp=1, seed=0)
        kwargs.update(overrides)
        return get_batch(corpus, 0, **kwargs)

    msg = r"global batch 6 is not divisible by dp=4; use a multiple of 4, e.g\. 8"
    with pytest.raises(ValueError, match=msg):
        call(global_batch_size=6, dp=4)
    with pytest.raises(
        ValueError, match=r"seq_len 16 is not divisible by sp=3; .* e\.g\. 15 or 18"
    ):
        call(sp=3)
    with pytest.raises(ValueError, match=r"seq_len 16 is not divisible by sp=32; .* e\.g\. 32"):
        call(sp=32)
    with pytest.raises(ValueError, match=r"dp_rank=2 is out of range for dp=2; use 0\.\.1"):
        call(dp=2, dp_rank=2)
    with pytest.raises(ValueError, match=r"sp_rank=-1 is out of range for sp=2; use 0\.\.1"):
        call(sp=2, sp_rank=-1)


# ----------------------------------------------------------------------------------------------
# reading files
# ----------------------------------------------------------------------------------------------
def test_read_text_and_jsonl(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("héllo\nworld\n", encoding="utf-8")
    jsonl = tmp_path / "b.jsonl"
    rows = [{"text": "first 🙂"}, {"text": ""}, {"text": "second", "id": 2}]
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    got = read_documents([txt, str(jsonl)])
    assert got == ["héllo\nworld\n".encode(), "first 🙂".encode(), b"second"]  # empty text skipped
    assert read_documents(txt) == [got[0]]


def test_read_errors(tmp_path, monkeypatch):
    missing = tmp_path / "missing.txt"
    with pytest.raises(ValueError, match=r"missing\.txt' does not exist; check the path"):
        read_documents([missing])
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match=r"empty\.txt' has no text; remove it"):
        read_documents([empty])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl' line 3 is not valid JSON .*\"text\" string"):
        read_documents([bad])
    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"line 1 has no \"text\" string \(got keys \['body'\]\)"):
        read_documents([nokey])
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": ""}\n')
    with pytest.raises(ValueError, match=r"blank\.jsonl' has no line with a non-empty \"text\""):
        read_documents([blank])
    with pytest.raises(ValueError, match=r"is a directory; pass the files in it"):
        read_documents([tmp_path])
    with pytest.raises(ValueError, match="no data files given"):
        read_documents([])
    locked = tmp_path / "locked.txt"
    locked.write_text("secret")
    real_read_bytes = pathlib.Path.read_bytes

    def read_bytes(self):
        if self.name == "locked.txt":
            raise PermissionError(13, "Permission denied")
        return real_read_bytes(self)

    monkeypatch.setattr(pathlib.Path, "read_bytes", read_bytes)
    with pytest.raises(
        ValueError, match=r"cannot read data file .*locked\.txt' \(Permission denied"
    ):
        read_documents([locked])


# ----------------------------------------------------------------------------------------------
# the built-in corpus
# ----------------------------------------------------------------------------------------------
def test_default_corpus():
    paths = default_corpus_paths()
    assert len(paths) > 100
    assert paths == default_corpus_paths()
    assert all(p.suffix == ".py" for p in paths)
    assert not any({"site-packages", "dist-packages"} & set(p.parts) for p in paths)
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    rel = [p.relative_to(root).as_posix() for p in paths]
    assert rel == sorted(rel)  # a fixed order, the same on every rank
    assert "json/decoder.py" in rel

    docs = read_documents()
    assert len(docs) > 100 and all(docs)
    corpus = PackedCorpus.from_paths(seq_len=64)
    assert PackedCorpus.from_paths(seq_len=32).stream is corpus.stream  # cached
    assert corpus.n_documents == len(docs) and corpus.n_tokens > 1_000_000
    # Spot-check the packed stream against the documents read directly.
    assert corpus.stream[: 1 + len(docs[0])].tolist() == [SEP_ID, *docs[0]]
    got = _assemble(corpus, 5, 2, 2, seed=0, pack_docs=True)
    base = _assemble(corpus, 5, 1, 1, seed=0, pack_docs=True)
    assert all(torch.equal(g, b) for g, b in zip(got, base))
    stream = corpus.stream
    w = sample_index(5, 0, G, len(corpus), 0)
    assert torch.equal(got[0][0], stream[w * 64 : w * 64 + 64].long())
    assert decode(got[0][0])  # real text


def test_padded_length_leaves_no_rank_empty():
    """``padded_seq_len``: the shortest length >= S whose cut leaves every sp rank a token (the
    length ``shard_batch`` pads a batch to): S itself when no rank is empty; rows shorter than
    sp, and lengths like 5, 6, 9 at sp=4 ([2, 2, 1, 0], [2, 2, 2, 0], [3, 3, 3, 0]), longer."""
    for sp in range(1, 9):
        for S in range(0, 50):
            n = padded_seq_len(S, sp)
            assert min(seq_split(n, sp)) >= 1, (S, sp, n)
            assert all(min(seq_split(m, sp)) == 0 for m in range(S, n)), (S, sp, n)
    assert [padded_seq_len(S, 4) for S in (1, 2, 3, 4, 5, 6, 9, 10)] == [4, 4, 4, 4, 7, 7, 10, 10]
    assert padded_seq_len(0, 2) == 2 and padded_seq_len(1, 2) == 2 and padded_seq_len(37, 4) == 37
    # with a ring: multiples of 2 * ring, each ring rank's S / ring cut over sp
    assert padded_seq_len(4, 4, ring=2) == 8 and padded_seq_len(16, 4, ring=2) == 16
    assert padded_seq_len(6, 2, ring=2) == 6  # not a multiple of 4: the slicer refuses it
