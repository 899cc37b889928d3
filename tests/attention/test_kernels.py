"""The local kernels and their choice: every backend's features against an independent float64
reference (``tests.attention.kernel_workers.reference``: a dense masked softmax written from the
definitions), the backend choice and its refusals, compiled packed documents without an
``S x S`` tensor, and the engine's per-head sinks on a spawned world.

Legend: ``B`` batch, ``S`` sequence, ``N`` q heads, ``K`` kv heads, ``H`` head dim.
"""

from __future__ import annotations

import pytest
import torch

import dtensor_ulysses as du
from dtensor_ulysses._torch_private import TorchDispatchMode
from dtensor_ulysses.attention import (
    KERNELS,
    AttentionBackendError,
    AttnFeatures,
    _blockwise,
    build_block_ids,
    build_doc_tensors,
    kernels,
    local_attention,
    select_backend,
    use_flash_attn_module,
)
from dtensor_ulysses.attention import local as attention
from dtensor_ulysses.launch import run_local_world
from tests.attention import flash_double as fd
from tests.attention import kernel_workers
from tests.attention.kernel_workers import reference

B, S, H = 2, 23, 8
DOCS = [[1, 9, 13], [12, 11]]  # per row, the document lengths (a one-token document first)
SCALE = 0.7  # large enough that a softcap of 2.5 bends the scores

# name -> (kernel keywords, kv heads); N = 4 q heads
CASES = {
    "causal": (dict(), 4),
    "not_causal": (dict(causal=False), 4),
    "gqa": (dict(), 2),
    "mqa_docs": (dict(docs=True), 1),
    "window": (dict(window=(4, -1)), 2),
    "window_two_sided": (dict(causal=False, window=(3, 2)), 4),
    "chunk": (dict(chunk=6), 2),
    "softcap": (dict(softcap=2.5), 2),
    "sinks": (dict(sinks=True), 2),
    "docs_window": (dict(docs=True, window=(5, 0)), 2),
    "docs_window_sinks_softcap": (dict(docs=True, window=(3, -1), sinks=True, softcap=2.5), 1),
    "docs_chunk_not_causal": (dict(docs=True, chunk=7, causal=False), 4),
}


def _inputs(K: int, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    return draw(B, S, 4, H), draw(B, S, K, H), draw(B, S, K, H), draw(B, S, 4, H), draw(4) * 2


def _kernel_kw(kw: dict, sinks: torch.Tensor, docs_as: str = "doc_starts") -> dict:
    out = {k: v for k, v in kw.items() if k not in ("docs", "sinks")}
    if kw.get("sinks"):
        out["sinks"] = sinks
    if kw.get("docs"):
        starts = [[sum(r[:i]) for i in range(len(r))] for r in DOCS]
        if docs_as == "doc_starts":
            out["doc_starts"] = starts
        elif docs_as == "doc_tensors":
            out["doc_tensors"] = build_doc_tensors(starts, S, "cpu")
        else:
            out["position_ids"] = torch.stack(
                [torch.cat([torch.arange(n) for n in r]) for r in DOCS]
            )
    return out


def _reference_kw(kw: dict, sinks: torch.Tensor) -> dict:
    out = {k: v for k, v in kw.items() if k not in ("docs", "sinks")}
    return dict(out, sinks=sinks if kw.get("sinks") else None,
                doc_lengths=DOCS if kw.get("docs") else None)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# every backend against the reference
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [5, 256])  # many blocks (skipped ones too), one block
def test_blockwise_forward_and_backward_match_reference(block, monkeypatch):
    monkeypatch.setattr(_blockwise, "DEFAULT_BLOCK", block)
    forms = ("doc_starts", "doc_tensors", "position_ids")
    for n, (name, (kw, K)) in enumerate(CASES.items()):
        q, k, v, go, sinks = _inputs(K, seed=n)
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        o = local_attention(*leaves[:3], backend="blockwise", softmax_scale=SCALE,
                            **_kernel_kw(kw, leaves[3], forms[n % 3]))  # fmt: skip
        got = torch.autograd.grad(o, leaves, go, allow_unused=True)
        refs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        o_ref = reference(*refs[:3], scale=SCALE, **_reference_kw(kw, refs[3]))
        want = torch.autograd.grad(o_ref, refs, go, allow_unused=True)
        torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12, msg=name)
        for grad_name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want):
            if b is None:
                assert a is None or not a.abs().any(), (name, grad_name)
                continue
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=f"{name} {grad_name}")


def test_blockwise_float32_and_bfloat16_are_close_to_reference():
    kw, K = CASES["docs_window_sinks_softcap"]
    q, k, v, _, sinks = _inputs(K, seed=3)
    want = reference(q, k, v, scale=SCALE, **_reference_kw(kw, sinks))
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        o = local_attention(*(t.to(dtype) for t in (q, k, v)), backend="blockwise",
                            softmax_scale=SCALE, **_kernel_kw(kw, sinks.to(dtype)))  # fmt: skip
        assert o.dtype == dtype
        torch.testing.assert_close(o.double(), want, rtol=0, atol=tol)


def test_flex_forward_on_cpu_matches_reference():
    """FlexAttention's forward (no backward on CPU in this torch) for every case."""
    for n, (name, (kw, K)) in enumerate(CASES.items()):
        q, k, v, _, sinks = _inputs(K, seed=n)
        with torch.no_grad():
            o = local_attention(q, k, v, backend="flex", softmax_scale=SCALE,
                                **_kernel_kw(kw, sinks, "doc_tensors"))  # fmt: skip
        want = reference(q, k, v, scale=SCALE, **_reference_kw(kw, sinks))
        torch.testing.assert_close(o, want, rtol=0, atol=1e-12, msg=name)


def test_flex_block_mask_skips_invisible_blocks():
    """The block mask (built from block facts, no S x S tensor) lists the blocks that hold a
    visible key, and which of them are fully visible (those skip the mask_mod): 8 blocks of
    128 over 1024 tokens."""
    from dtensor_ulysses.attention._flex import flex_block_mask

    def blocks(**kw):
        kw = dict(dict(causal=True, window=(-1, -1), chunk=0, doc_ids_BS=None), **kw)
        bm = flex_block_mask(1024, torch.device("cpu"), **kw)
        return bm.kv_num_blocks[0, 0].tolist(), bm.full_kv_num_blocks[0, 0].tolist()

    # a causal window of 128: the diagonal block and the one before, both partly visible
    assert blocks(window=(127, 0)) == ([1] + [2] * 7, [0] * 8)
    # a two-sided window of 255: 3 full blocks around the diagonal, a partial one each side
    partial, full = blocks(causal=False, window=(255, 255))
    assert partial[3:5] == [2, 2] and full[3:5] == [3, 3], (partial, full)
    # chunks of 256, causal: the diagonal block partial, the chunk's earlier block full
    assert blocks(chunk=256) == ([1] * 8, [0, 1] * 4)
    ids = torch.zeros(1, 1024, dtype=torch.int32)
    ids[0, 300:] = 1  # a document starts at 300: block 2 holds a boundary
    partial, full = blocks(doc_ids_BS=ids)
    visible = [a + b for a, b in zip(partial, full)]
    assert visible == [1, 2, 3, 2, 3, 4, 5, 6], visible  # from block 3 on, blocks 0-1 unseen


@pytest.mark.gpu
def test_flex_backward_on_cuda_matches_reference():
    for n, (name, (kw, K)) in enumerate(CASES.items()):
        q, k, v, go, sinks = _inputs(K, seed=n)
        leaves = [t.cuda().float().requires_grad_() for t in (q, k, v, sinks)]
        o = local_attention(*leaves[:3], backend="flex", softmax_scale=SCALE,
                            **_kernel_kw(kw, leaves[3], "doc_tensors"))  # fmt: skip
        got = torch.autograd.grad(o, leaves, go.cuda().float(), allow_unused=True)
        refs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        o_ref = reference(*refs[:3], scale=SCALE, **_reference_kw(kw, refs[3]))
        want = torch.autograd.grad(o_ref, refs, go, allow_unused=True)
        torch.testing.assert_close(o.double().cpu(), o_ref, rtol=0, atol=1e-4, msg=name)
        for a, b in zip(got, want):
            if b is not None:
                torch.testing.assert_close(a.double().cpu(), b, rtol=0, atol=1e-4, msg=name)


def test_flash_double_window_softcap_chunk_match_reference():
    """The flash path (through the flash-attn double, bf16) runs windows, softcaps and chunks
    (chunks as documents cut at multiples of C), dense and varlen, forward and backward."""
    names = ("causal", "gqa", "window", "window_two_sided", "softcap", "chunk", "docs_window",
             "docs_chunk_not_causal", "mqa_docs")  # fmt: skip
    with use_flash_attn_module(fd):
        for n, name in enumerate(names):
            kw, K = CASES[name]
            q, k, v, go, sinks = _inputs(K, seed=n)
            leaves = [t.bfloat16().requires_grad_() for t in (q, k, v)]
            o = local_attention(*leaves, backend="flash_attn", softmax_scale=SCALE,
                                **_kernel_kw(kw, sinks))  # fmt: skip
            got = torch.autograd.grad(o, leaves, go.bfloat16())
            refs = [t.clone().requires_grad_() for t in (q, k, v)]
            o_ref = reference(*refs, scale=SCALE, **_reference_kw(kw, sinks))
            want = torch.autograd.grad(o_ref, refs, go)
            torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=3e-2, msg=name)
            for a, b in zip(got, want):
                torch.testing.assert_close(a.double(), b, rtol=3e-2, atol=6e-2, msg=name)


def test_flash_double_window_bottom_right_aligned():
    """The double alone, ``Sq < Sk``: window and causal aligned to the bottom-right corner
    (flash-attn's rule), against the reference on the last ``Sq`` queries."""
    q, k, v, _, _ = _inputs(2, seed=9)
    o = fd.flash_attn_func(q[:, -7:].bfloat16(), k.bfloat16(), v.bfloat16(), softmax_scale=SCALE,
                           causal=True, window_size=(4, -1), softcap=2.5)  # fmt: skip
    want = reference(q, k, v, scale=SCALE, window=(4, -1), softcap=2.5)[:, -7:]
    torch.testing.assert_close(o.double(), want, rtol=0, atol=3e-2)


def test_sdpa_plain_and_documents_match_reference():
    for name in ("causal", "not_causal", "gqa", "mqa_docs"):
        kw, K = CASES[name]
        q, k, v, _, sinks = _inputs(K)
        o = local_attention(q, k, v, backend="sdpa", softmax_scale=SCALE, **_kernel_kw(kw, sinks))
        want = reference(q, k, v, scale=SCALE, **_reference_kw(kw, sinks))
        torch.testing.assert_close(o, want, rtol=0, atol=1e-12, msg=name)


# ---------------------------------------------------------------------------------------------
# the choice and the refusals
# ---------------------------------------------------------------------------------------------
def _pick(features, device="cpu", dtype=torch.float32, compiled=False, backend="auto", hd=64):
    return select_backend(features, device_type=device, dtype=dtype, head_dim=hd,
                          backend=backend, compiled=compiled, device_index=0)  # fmt: skip


def test_auto_choices_on_cpu_and_cuda(monkeypatch):
    plain, docs = AttnFeatures(), AttnFeatures(docs=True)
    window = AttnFeatures(window=True, docs=True)
    assert _pick(plain) == "sdpa" and _pick(docs) == "sdpa"
    assert _pick(docs, compiled=True) == "blockwise"  # no [B, 1, S, S] mask any more
    assert _pick(window) == "blockwise" and _pick(AttnFeatures(sinks=True)) == "blockwise"
    # a CUDA device without flash-attn (no wheels for torch >= 2.11)
    monkeypatch.setattr(kernels, "flash_problem", lambda *a: "the flash-attn package is absent")
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    assert _pick(plain, **bf16) == "sdpa" and _pick(docs, **bf16) == "sdpa"
    assert _pick(docs, compiled=True, **bf16) == "flex"
    assert _pick(window, **bf16) == "flex" and _pick(AttnFeatures(softcap=True), **bf16) == "flex"
    # with flash-attn
    monkeypatch.setattr(kernels, "flash_problem", lambda *a: None)
    softcap_window = AttnFeatures(window=True, softcap=True, docs=True)
    assert _pick(softcap_window, **bf16) == "flash_attn"
    assert _pick(softcap_window, compiled=True, **bf16) == "flash_attn"
    assert _pick(AttnFeatures(chunk=True), **bf16) == "flash_attn"
    assert _pick(AttnFeatures(chunk=True, docs=True), compiled=True, **bf16) == "flex"
    assert _pick(AttnFeatures(sinks=True, window=True), **bf16) == "flex"
    assert _pick(window, device="cuda", dtype=torch.float32) == "flex"  # flash: fp16/bf16 only
    assert _pick(window, hd=512, **bf16) == "flex"


def test_explicit_backends_refuse_with_feature_and_fix(monkeypatch):
    cases = [
        (dict(backend="sdpa", features=AttnFeatures(window=True)),
         r"backend='sdpa' cannot run window: it does not run a sliding window \(window=\); "
         r"use backend='auto' or one of \['blockwise'\]"),
        (dict(backend="sdpa", features=AttnFeatures(docs=True), compiled=True),
         r"cannot run docs: it does not run packed documents .* inside torch.compile; "
         r"use backend='auto' or one of \['blockwise'\]"),
        (dict(backend="flash_attn", features=AttnFeatures(sinks=True), device="cuda",
              dtype=torch.bfloat16),
         r"backend='flash_attn' cannot run sinks: it does not run attention sinks \(sinks=\); "
         r"use backend='auto' or one of \['flex', 'blockwise'\]"),
        (dict(backend="flex", features=AttnFeatures(), dtype=torch.int32),
         r"backend='flex' cannot run dtype: it takes float16, bfloat16, float32, float64, "
         r"not int32"),
    ]  # fmt: skip
    monkeypatch.setattr(kernels, "flash_problem", lambda *a: None)
    for kw, pattern in cases:
        with pytest.raises(AttentionBackendError, match=pattern):
            _pick(**kw)
    assert issubclass(AttentionBackendError, ValueError)
    # forced (context manager, environment): the forced name must run the features
    with du.force_backend("blockwise"):
        assert _pick(AttnFeatures(window=True)) == "blockwise"
    with du.force_backend("sdpa"), pytest.raises(AttentionBackendError, match=r"force_backend"):
        _pick(AttnFeatures(chunk=True))
    monkeypatch.setenv(kernels.ENV_VAR, "flex")
    assert _pick(AttnFeatures(softcap=True)) == "flex"
    assert set(KERNELS) >= {"flash_attn", "sdpa", "flex", "blockwise"}


def test_choose_kernel_once_per_layer_kind_plain_packed_and_ring(monkeypatch):
    """choose_kernel: the kernel of a layer kind with and without packed documents, chosen once
    (the call looks it up); the ring's blocks in the same vocabulary (a kernel without a
    log-sum-exp refused, flash-attn blocks where they run, the exact blockwise blocks else);
    docs=True refuses up front what docs=None keeps for the call that brings documents."""
    cpu = dict(device_type="cpu", dtype=torch.float32, head_dim=16)
    c = kernels.choose_kernel(AttnFeatures(), **cpu)
    assert (c.plain, c.packed, c.name(False), c.name(True)) == ("sdpa", "sdpa", "sdpa", "sdpa")
    c = kernels.choose_kernel(AttnFeatures(), compiled=True, **cpu)
    assert (c.plain, c.packed) == (
        "sdpa",
        "blockwise",
    ) and c.describe() == "sdpa (packed: blockwise)"
    c = kernels.choose_kernel(AttnFeatures(sinks=True, window=True), **cpu)
    assert c.name(True) == c.name(False) == "blockwise" and c.label == "window, sinks"
    c = kernels.choose_kernel(AttnFeatures(), requested="sdpa", compiled=True, **cpu)
    assert c.packed is None and c.name(False) == "sdpa"
    with pytest.raises(AttentionBackendError, match="inside torch.compile"):
        c.name(True)
    with pytest.raises(AttentionBackendError, match="inside torch.compile"):
        kernels.choose_kernel(AttnFeatures(), requested="sdpa", compiled=True, docs=True, **cpu)
    # the ring: same names; sdpa and flex return no log-sum-exp; windows are not ring features
    for name in ("sdpa", "flex"):
        with pytest.raises(AttentionBackendError, match=r"ring attention's blocks.*'blockwise'"):
            kernels.choose_kernel(AttnFeatures(), requested=name, ring=True, **cpu)
    for name in ("auto", "blockwise"):
        c = kernels.choose_kernel(AttnFeatures(), requested=name, ring=True, **cpu)
        assert (c.name(False), c.name(True), c.describe(True)) == (
            "blockwise",
            "blockwise",
            "ring of blockwise",
        )
    with pytest.raises(AttentionBackendError, match="ring attention runs causal"):
        kernels.choose_kernel(AttnFeatures(window=True), ring=True, **cpu)
    with pytest.raises(AttentionBackendError, match="P2POp") as e:
        kernels.choose_kernel(AttnFeatures(), ring=True, compiled=True, **cpu)
    assert e.value.option == "compile"
    monkeypatch.setattr(kernels, "flash_problem", lambda *a: None)  # a GPU with flash-attn
    bf16 = dict(device_type="cuda", dtype=torch.bfloat16, head_dim=16)
    c = kernels.choose_kernel(AttnFeatures(), requested="flash_attn", ring=True, **bf16)
    assert c.name(False) == "flash_attn" and c.packed is None
    with pytest.raises(AttentionBackendError, match="packed documents in ring attention"):
        c.name(True)
    assert kernels.choose_kernel(AttnFeatures(), ring=True, **bf16).name(True) == "flash_attn"
    # the start line: one kind, or each kind with its count
    a = kernels.choose_kernel(AttnFeatures(window=True, sinks=True), **cpu)
    b = kernels.choose_kernel(AttnFeatures(sinks=True), **cpu)
    assert kernels.describe_kernels([a, a]) == "blockwise"
    assert kernels.describe_kernels([a, b, a]) == (
        "blockwise (window, sinks) x 2, blockwise (sinks) x 1"
    )


def test_the_call_path_looks_the_stored_choice_up(monkeypatch):
    """A layer with a stored KernelChoice runs what it says, never choosing again (no
    ``select_backend`` on the call path; force_backend, which changes what ``auto`` picks per
    call, does not change it); every kernel has its runner; a call that brings a feature the
    stored kernel does not run is refused, never run by another kernel."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    calls = []
    real = attention.blockwise_attention
    monkeypatch.setattr(attention, "blockwise_attention",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))  # fmt: skip

    def chosen_again(*a, **kw):
        raise AssertionError("the call path chose a kernel again")

    layer = attention.LocalAttention()
    layer.kernel_choice = kernels.choose_kernel(
        AttnFeatures(), device_type="cpu", dtype=q.dtype, head_dim=4, requested="blockwise"
    )
    monkeypatch.setattr(attention, "select_backend", chosen_again)
    with du.force_backend("sdpa"):
        got = layer(q, k, v)
    assert calls == [1]
    torch.testing.assert_close(got, reference(q, k, v, scale=0.5, causal=True))
    assert set(attention._RUNNERS) >= set(KERNELS)
    plain = kernels.choose_kernel(AttnFeatures(), device_type="cpu", dtype=q.dtype, head_dim=4)
    assert plain.plain == "sdpa"
    with pytest.raises(AttentionBackendError, match=r"stored kernel 'sdpa' .* does not run a "
                                                    r"sliding window"):  # fmt: skip
        local_attention(q, k, v, backend=plain, window=(2, 0))


def test_local_attention_bad_feature_values_and_flex_training_on_cpu():
    q = torch.randn(1, 8, 4, 8, requires_grad=True)
    for kw, pattern in (
        (dict(window=(-2, 0)), r"window=\(-2, 0\): each side is a number of tokens >= 0, or -1"),
        (dict(window=5), r"window=5 must be a pair \(left, right\)"),
        (dict(chunk=0), r"chunk=0 must be an int >= 1"),
        (dict(softcap=-1.0), r"softcap=-1.0 must be a float > 0"),
        (dict(sinks=torch.zeros(3)), r"sinks has shape \(3,\); expected \[N\] = \(4,\)"),
        (dict(backend="flex"), r"backend='flex' has no backward on cpu .* 'blockwise'"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=pattern):
            local_attention(q, q, q, **kw)


# ---------------------------------------------------------------------------------------------
# compiled, and memory linear in S
# ---------------------------------------------------------------------------------------------
def test_compiled_packed_window_sinks_equal_eager_without_graph_break():
    """torch.compile(fullgraph=True) of packed documents with a window and sinks: auto takes
    the blockwise kernel (one opaque op), the eager values and gradients; a new layout of
    documents does not recompile (the documents are tensors)."""
    torch._dynamo.reset()
    kw, K = CASES["docs_window_sinks_softcap"]
    q, k, v, go, sinks = (t.float() for t in _inputs(K, seed=4))
    kernel = _kernel_kw(kw, sinks, "doc_tensors")

    def attend(q, k, v, sinks, docs):
        return local_attention(q, k, v, softmax_scale=SCALE, doc_tensors=docs, window=(3, -1),
                               softcap=2.5, sinks=sinks)  # fmt: skip

    frames = []

    def counting(gm, example_inputs):  # aot_eager: the forward and backward graphs, run eagerly
        frames.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(attend, fullgraph=True, backend=counting)
    out = []
    for fn in (attend, compiled):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        o = fn(*leaves, kernel["doc_tensors"])
        out.append((o, *torch.autograd.grad(o, leaves, go.float())))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    compiled(*leaves, build_doc_tensors([[0, 4], [0, 2, 3]], S, "cpu"))
    assert len(frames) == 1, f"{len(frames)} graphs: a new layout recompiled"


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("N,K", [(4, 1), (4, 2), (4, 4)])
def test_blockwise_custom_ops_pass_opcheck(N, K):
    """torch.library.opcheck of both blockwise ops (schema, fake kernels, autograd
    registration): the fake outputs have the real shapes and strides (with one kv head the
    log-sum-exp came out strided, and inductor's compiled step asserted in step 1)."""
    g = torch.Generator().manual_seed(N * 10 + K)
    q = torch.randn(2, 16, N, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 16, K, 8, generator=g, dtype=torch.float64) for _ in range(2))
    doc_ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 16])
    sinks = torch.randn(N, generator=g, dtype=torch.float64)
    block_ids = torch.tensor([[-1] * 6 + [0] * 4 + [-1] * 6, [-1] * 16])  # an image at 6..10
    ranges = _blockwise.key_ranges(16, 8, causal=True, window=(4, -1), chunk=0, blocks=True,
                                   block_spans=[[(6, 10)], []])  # fmt: skip
    args = (0.3, True, [4, -1], 0, 2.0, ranges, 8)
    torch.library.opcheck(_blockwise._attn_op, (q, k, v, doc_ids, block_ids, sinks, *args))
    o, lse = _blockwise._attn_op(q, k, v, doc_ids, block_ids, sinks, *args)
    do = torch.randn(o.shape, generator=g, dtype=torch.float64)
    torch.library.opcheck(
        _blockwise._attn_backward_op, (do, q, k, v, o, lse, doc_ids, block_ids, sinks, *args)
    )


def test_blockwise_never_holds_an_s_by_s_tensor():
    """S = 4096, packed documents, a window and an image block: every tensor the kernel's
    forward and backward make has fewer than S*S elements (the largest: a block's scores,
    B*N*512*512, or a [B, S, heads, H] activation); key blocks outside the window are skipped."""
    Sl, N, Hl = 4096, 2, 8
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(1, Sl, N, Hl, generator=g) for _ in range(2))
    k, v = (torch.randn(1, Sl, 1, Hl, generator=g) for _ in range(2))
    starts = [[0, 1000, 1001, 3000]]
    ids = build_doc_tensors(starts, Sl, "cpu").doc_ids
    args = dict(causal=True, window=[511, -1], chunk=0, softcap=5.0)
    spans = [[(2100, 2200)]]  # a bidirectional block (an image) inside one query block
    block_ids = build_block_ids(spans, Sl, "cpu")
    ranges = _blockwise.key_ranges(Sl, 512, causal=True, window=(511, -1), chunk=0,
                                   doc_starts=starts, blocks=True, block_spans=spans)  # fmt: skip
    assert max(hi - lo for lo, hi in zip(ranges[::2], ranges[1::2])) <= 512 + 511
    sinks = torch.zeros(N)
    with _LargestTensor() as mode:
        o, lse = _blockwise._forward(q, k, v, ids, block_ids, sinks, 0.3, args["causal"],
                                     args["window"], 0, 5.0, ranges, 512)  # fmt: skip
        _blockwise._backward(do, q, k, v, o, lse, ids, block_ids, sinks, 0.3, True, [511, -1], 0,
                             5.0, ranges, 512)  # fmt: skip
    assert 0 < mode.largest <= max(N * 512 * 512, Sl * N * Hl), mode.largest
    assert mode.largest < Sl * Sl


# ---------------------------------------------------------------------------------------------
# the engine: sinks follow the head split
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_engine_sinks_follow_uneven_heads_on_four_ranks():
    """sp=4 with N=6 q heads (ranks attend with 2, 2, 1, 1) and K=2 or 3 kv heads, N=8
    (even; head chunks), dp=2 x sp=2 (also through du.ulysses_attention, the DTensor face);
    windows, softcaps, chunks and packed documents on top:
    o, dq, dk, dv and the sinks' gradient equal the float64 reference, and each rank's own
    sinks gradient is zero outside the heads it attends with."""
    docs = [[3, 10, 9], [22]]
    cases = [
        dict(dp=1, sp=4, B=2, S=22, N=6, K=2, H=4, seed=0, window=(5, -1), softcap=2.0),
        dict(dp=1, sp=4, B=2, S=21, N=6, K=3, H=4, seed=1, docs=[[3, 10, 8], [21]],
             window=(4, 0)),
        dict(dp=1, sp=4, B=2, S=22, N=8, K=2, H=4, seed=2, chunk=6, head_chunks=2, docs=docs),
        dict(dp=2, sp=2, B=2, S=22, N=6, K=2, H=4, seed=3, window=(3, -1), docs=docs,
             backend="blockwise"),
        dict(dp=2, sp=2, B=2, S=21, N=6, K=3, H=4, seed=4, window=(2, 3), softcap=3.0,
             dtensor=True),
    ]  # fmt: skip
    results = run_local_world(kernel_workers.sinks_worker, 4, cases, timeout_s=280)
    for rank, per_rank in enumerate(results):
        for r in per_rank:
            c = r["case"]
            for name, err in r["errors"].items():
                assert err <= 1e-10, f"rank {rank} {c}: {name} error {err:.2e}"
            P, N = c["sp"], c["N"]
            heads = [N // P + (i < N % P) for i in range(P)]
            first = sum(heads[: r["sp_rank"]])
            mine = range(first, first + heads[r["sp_rank"]])
            own = r["own_dsinks"]
            assert all(own[h] == 0 for h in range(N) if h not in mine), (rank, c, own)
            assert any(own[h] != 0 for h in mine), (rank, c, own)


def test_compiled_packed_documents_trace_linear_in_s_without_s_squared():
    """The kernel compiled code runs for packed documents (and a window) on a CPU, traced with
    fake tensors at 32K, 64K and 128K tokens: no tensor of S^2 elements (the removed SDPA mask
    was [B, 1, S, S]), the largest is an activation [B, S, N, H], and the peak grows linearly;
    FlexAttention's block mask (CUDA's compiled path) at 128K holds (S/128)^2 entries a row."""
    from dtensor_ulysses._torch_private import fake_world_classes
    from dtensor_ulysses.attention._flex import flex_block_mask
    from dtensor_ulysses.memtrace import trace_attention

    peaks = {}
    for Sl in (32768, 65536, 131072):
        for window in (None, (4095, 0)):
            t = trace_attention(Sl, heads=8, kv_heads=2, head_dim=64, window=window)
            assert t.backend == "blockwise", t
            assert t.largest_elements == Sl * 8 * 64 < Sl * Sl, t
            peaks[Sl, window] = t.peak_bytes
    for window in (None, (4095, 0)):
        p32, p64, p128 = (peaks[Sl, window] for Sl in (32768, 65536, 131072))
        assert p128 - p64 == 2 * (p64 - p32) and p32 > 0, (window, p32, p64, p128)
    FakeTensorMode, _ = fake_world_classes()
    Sl = 131072
    largest = _LargestTensor()
    with FakeTensorMode(allow_non_fake_inputs=True), largest:
        ids = torch.zeros(1, Sl, dtype=torch.int32)
        flex_block_mask(Sl, ids.device, causal=True, window=(4095, 0), chunk=0, doc_ids_BS=ids)
    assert largest.largest <= 2 * (Sl // 128) ** 2 < Sl * Sl, largest.largest
