"""The kernel feature "bidirectional blocks" (the tokens of one image see each other both ways
inside causal attention, Gemma 3's image mask): the blockwise kernel (forward and backward) and
FlexAttention (forward on CPU; its block mask's skipped blocks) against a dense masked
reference written from the definition, windows, documents, GQA and softcap included; the kernel
choice and its refusals (SDPA, flash-attn, ring attention); the layout's spans.

Legend: ``B`` batch, ``S`` sequence, ``N`` q heads, ``K`` kv heads, ``H`` head dim.
"""

from __future__ import annotations

import pytest
import torch

from dtensor_ulysses.attention import (
    AttentionBackendError,
    AttnFeatures,
    _blockwise,
    build_block_ids,
    choose_kernel,
    kernels,
    local_attention,
)
from dtensor_ulysses.plan import SeqLayout

B, N, H = 2, 4, 8
SCALE = 0.7


def dense_reference(q_BSNH, k_BSKH, v_BSKH, *, block_ids_BS, causal=True, window=(-1, -1),
                    doc_ids_BS=None, softcap=None):  # fmt: skip
    """Attention with the whole ``[B, S, S]`` mask, from the definition: key ``j`` is visible
    to query ``i`` iff (``j <= i`` or ``i`` and ``j`` in one block) and inside the window and
    the document."""
    _, S, n_q, _ = q_BSNH.shape
    dev = q_BSNH.device
    kv_of = torch.arange(n_q, device=dev) // (n_q // k_BSKH.shape[2])
    s_BNSS = torch.einsum("bind,bjnd->bnij", q_BSNH, k_BSKH[:, :, kv_of]) * SCALE
    if softcap:
        s_BNSS = softcap * torch.tanh(s_BNSS / softcap)
    i, j = torch.arange(S, device=dev)[None, :, None], torch.arange(S, device=dev)[None, None, :]
    same_block = (block_ids_BS[:, :, None] == block_ids_BS[:, None, :]) & (
        block_ids_BS[:, :, None] >= 0
    )
    seen_BSS = ((j <= i) | same_block) if causal else torch.ones_like(same_block)
    left, right = window
    if left >= 0:
        seen_BSS = seen_BSS & (j >= i - left)
    if right >= 0:
        seen_BSS = seen_BSS & (j <= i + right)
    if doc_ids_BS is not None:
        seen_BSS = seen_BSS & (doc_ids_BS[:, :, None] == doc_ids_BS[:, None, :])
    s_BNSS = s_BNSS.masked_fill(~seen_BSS[:, None], float("-inf"))
    p_BNSS = torch.softmax(s_BNSS, dim=-1)
    return torch.einsum("bnij,bjnd->bind", p_BNSS, v_BSKH[:, :, kv_of])


def _ids(spans, S):
    return build_block_ids(spans, S, "cpu")


# S=23: row 0 has two images (3..9, 12..16), row 1 one image reaching the end (15..23)
SPANS = [[(3, 9), (12, 16)], [(15, 23)]]
DOCS = torch.tensor([[0] * 11 + [1] * 12, [0] * 14 + [1] * 9])  # row 1: the image is a document
CASES = {
    "blocks": (dict(), 4),
    "blocks_gqa_softcap": (dict(softcap=2.5), 2),
    "blocks_sliding_window": (dict(window=(4, -1)), 2),  # Gemma's sliding layers: left only
    "blocks_window_both_sides": (dict(window=(4, 2)), 1),  # the right side bounds a block too
    "blocks_docs_window": (dict(window=(6, -1), docs=True), 2),
}


def _draw(S, K, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, n, H, generator=g, dtype=torch.float64) for n in (N, K, K, N)]


@pytest.mark.parametrize("block", [5, 256])  # many blocks (skipped ones too), one block
def test_blockwise_blocks_forward_and_backward_match_dense_reference(block, monkeypatch):
    monkeypatch.setattr(_blockwise, "DEFAULT_BLOCK", block)
    S = 23
    ids = _ids(SPANS, S)
    for n, (name, (kw, K)) in enumerate(CASES.items()):
        q, k, v, go = _draw(S, K, n)
        docs = kw.get("docs")
        kernel_kw = {k_: v_ for k_, v_ in kw.items() if k_ != "docs"}
        ref_kw = dict(kernel_kw, doc_ids_BS=DOCS if docs else None)
        if docs:
            kernel_kw["doc_starts"] = [[0, 11], [0, 14]]
        for spans in (SPANS, None):  # host spans bound the key blocks; without, none skipped
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            o = local_attention(*leaves, backend="blockwise", softmax_scale=SCALE,
                                block_ids=ids, block_spans=spans, **kernel_kw)  # fmt: skip
            got = torch.autograd.grad(o, leaves, go)
            refs = [t.clone().requires_grad_() for t in (q, k, v)]
            o_ref = dense_reference(*refs, block_ids_BS=ids, **ref_kw)
            want = torch.autograd.grad(o_ref, refs, go)
            torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12, msg=name)
            for g_name, a, b in zip(("dq", "dk", "dv"), got, want):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=f"{name} {g_name}")
        # the blocks change the result: the same call without them differs
        o_causal = dense_reference(q, k, v, block_ids_BS=torch.full_like(ids, -1), **ref_kw)
        assert not torch.allclose(o_causal, o_ref.detach()), name


def test_key_ranges_reach_the_end_of_a_block():
    """A query block inside an image visits the key blocks up to the image's end (host spans),
    and every key block when the spans are unknown (compiled code)."""
    plain = _blockwise.key_ranges(20, 4, causal=True, window=(-1, -1), chunk=0)
    spans = _blockwise.key_ranges(20, 4, causal=True, window=(-1, -1), chunk=0, blocks=True,
                                  block_spans=[[(6, 13)], []])  # fmt: skip
    unknown = _blockwise.key_ranges(20, 4, causal=True, window=(-1, -1), chunk=0, blocks=True)
    assert plain[1::2] == [4, 8, 12, 16, 20]
    assert spans[1::2] == [4, 13, 13, 16, 20]  # query blocks 4..7 and 8..11 see up to 13
    assert unknown[1::2] == [20] * 5


def test_flex_blocks_forward_on_cpu_matches_dense_reference():
    """FlexAttention (forward only on CPU) with blocks over several 128-token blocks: an image
    crossing a block boundary, one inside a block, a window; the block mask is exact."""
    S = 260  # three blocks of 128
    spans = [[(100, 140), (150, 170)], [(5, 9), (120, 250)]]
    ids = _ids(spans, S)
    for n, (kw, K) in enumerate([(dict(softcap=2.0), 2), (dict(window=(60, -1)), 1)]):
        q, k, v, _ = _draw(S, K, 10 + n)
        with torch.no_grad():
            o = local_attention(q, k, v, backend="flex", softmax_scale=SCALE, block_ids=ids, **kw)
        want = dense_reference(q, k, v, block_ids_BS=ids, **kw)
        torch.testing.assert_close(o, want, rtol=0, atol=1e-12, msg=str(kw))


def test_flex_block_mask_adds_the_blocks_an_image_reaches():
    """Causal over 4 blocks of 128: an image 100..300 makes blocks 0-1 see blocks 1-2 (partly);
    blocks that share no image stay causal; no block becomes 'full' through an image."""
    from dtensor_ulysses.attention._flex import flex_block_mask

    ids = _ids([[(100, 300)]], 512)
    bm = flex_block_mask(512, torch.device("cpu"), causal=True, window=(-1, -1), chunk=0,
                         doc_ids_BS=None, block_ids_BS=ids)  # fmt: skip
    partial, full = bm.kv_num_blocks[0, 0].tolist(), bm.full_kv_num_blocks[0, 0].tolist()
    assert [a + b for a, b in zip(partial, full)] == [3, 3, 3, 4]
    assert full == [0, 1, 2, 3]  # the causal rule alone decides what is full


def _choose(features, device="cpu", dtype=torch.float32, requested="auto", **kw):
    return choose_kernel(features, device_type=device, dtype=dtype, head_dim=64,
                         requested=requested, **kw)  # fmt: skip


def test_choice_and_refusals_of_blocks(monkeypatch):
    blocks = AttnFeatures(blocks=True, window=True)
    assert _choose(blocks).plain == "blockwise"
    assert _choose(blocks).label == "window, blocks"
    monkeypatch.setattr(kernels, "flash_problem", lambda *a: None)  # flash-attn "present"
    assert _choose(blocks, device="cuda", dtype=torch.bfloat16).plain == "flex"
    for name in ("sdpa", "flash_attn"):
        with pytest.raises(
            AttentionBackendError,
            match=rf"backend='{name}' cannot run blocks: it "
            r"does not run bidirectional blocks .*use backend='auto' or one of",
        ):
            _choose(AttnFeatures(blocks=True), device="cuda", dtype=torch.bfloat16,
                    requested=name)  # fmt: skip
    with pytest.raises(AttentionBackendError, match=r"ring attention runs causal attention and "
                       r"packed documents, not .*bidirectional blocks"):  # fmt: skip
        _choose(AttnFeatures(blocks=True), ring=True)
    # the call: a kernel handed block ids that it cannot run raises, it never drops them
    q = torch.randn(1, 6, 2, 8)
    with pytest.raises(AttentionBackendError, match="bidirectional blocks"):
        local_attention(q, q, q, backend="sdpa", block_ids=_ids([[(1, 4)]], 6))
    with pytest.raises(ValueError, match=r"block_ids has shape \(6,\)"):
        local_attention(q, q, q, backend="blockwise", block_ids=torch.zeros(6, dtype=torch.long))


def test_layout_blocks_are_checked():
    assert SeqLayout((4, 4), blocks=(((1, 3), (3, 8)),)).blocks == (((1, 3), (3, 8)),)
    for bad in ((((3, 3),),), (((2, 5), (4, 6)),), (((0, 9),),)):
        with pytest.raises(ValueError, match="blocks row 0"):
            SeqLayout((4, 4), blocks=bad)
    assert _ids([[(1, 3), (5, 6)], []], 7).tolist() == [[-1, 0, 0, -1, -1, 1, -1], [-1] * 7]


@pytest.mark.gpu
def test_flex_blocks_backward_on_cuda_matches_dense_reference():
    """FlexAttention with blocks trains on CUDA: forward and backward against the reference
    (float32 inputs, the fused kernel's tolerance)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    S = 300
    ids = _ids([[(100, 140), (150, 170)], [(5, 9), (120, 290)]], S).cuda()
    for n, kw in enumerate([dict(), dict(window=(60, -1))]):
        q, k, v, go = (t.float().cuda() for t in _draw(S, 2, 20 + n))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = local_attention(*leaves, backend="flex", softmax_scale=SCALE, block_ids=ids, **kw)
        got = torch.autograd.grad(o, leaves, go)
        refs = [t.double().clone().requires_grad_() for t in (q, k, v)]
        o_ref = dense_reference(*refs, block_ids_BS=ids, **kw)
        want = torch.autograd.grad(o_ref, refs, go.double())
        torch.testing.assert_close(o.double(), o_ref, rtol=1e-3, atol=1e-4)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b, rtol=1e-3, atol=1e-4)


def test_compiled_blocks_equal_eager_without_graph_break():
    """torch.compile(fullgraph=True) of a sliding window with image blocks: auto takes the
    blockwise kernel (one opaque op; no host spans inside the graph, so no key block is
    skipped on the causal side), the eager values and gradients; new blocks do not recompile
    (the block ids are a tensor)."""
    torch._dynamo.reset()
    S = 23
    q, k, v, go = (t.float() for t in _draw(S, 2, 30))

    def attend(q, k, v, ids):
        return local_attention(q, k, v, softmax_scale=SCALE, window=(4, -1), block_ids=ids)

    frames = []

    def counting(gm, example_inputs):  # aot_eager: the forward and backward graphs, run eagerly
        frames.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(attend, fullgraph=True, backend=counting)
    out = []
    for fn in (attend, compiled):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = fn(*leaves, _ids(SPANS, S))
        out.append((o, *torch.autograd.grad(o, leaves, go)))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    compiled(*leaves, _ids([[(1, 20)], []], S))
    assert len(frames) == 1, f"{len(frames)} graphs: new blocks recompiled"
