"""The project's flash-attn path on CPU, through the pure-PyTorch double of flash-attn's API.

The double (``tests/attention/flash_double.py``) is checked against an independent float64 reference
first; then the local kernel (dense, varlen), the engine, the ring, Ulysses x Ring and the trainer
run their flash path through it (installed by the seam of ``dtensor_ulysses.attention``) and are
compared with float64 references or with SDPA at bf16 tolerance.
"""

from __future__ import annotations

import pytest
import torch

from dtensor_ulysses.attention import local as attention
from dtensor_ulysses.launch import run_local_world
from tests.attention import flash_double as fd
from tests.attention import flash_workers
from tests.ring_workers import reference as doc_reference

BF16_TOL = 3e-2  # bf16 inputs and outputs (8 bits of mantissa), float32 math inside


@pytest.fixture
def flash_double(monkeypatch):
    """Install the double for this process and for spawned ranks (they read the variable)."""
    monkeypatch.setenv(attention.FLASH_MODULE_ENV, "tests.attention.flash_double")
    with attention.use_flash_attn_module(fd):
        yield fd


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# the double itself, against the float64 reference
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("Sq,Sk", [(9, 9), (5, 9), (9, 5)])
def test_double_matches_reference_with_bottom_right_causal(Sq, Sk):
    q, k, v = _rand(2, Sq, 4, 16, seed=1), _rand(2, Sk, 2, 16, seed=2), _rand(2, Sk, 2, 16, seed=3)
    out, lse, dmask = fd.flash_attn_func(
        *(t.bfloat16() for t in (q, k, v)), causal=True, return_attn_probs=True
    )
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and dmask is None
    assert lse.shape == (2, 4, Sq)
    kr, vr = (t.repeat_interleave(2, dim=2) for t in (k, v))
    s = torch.einsum("bqnh,bknh->bnqk", q, kr) / 4.0
    seen = torch.arange(Sk)[None, :] <= torch.arange(Sq)[:, None] + (Sk - Sq)  # bottom-right
    s = s.masked_fill(~seen, float("-inf"))
    empty = ~seen.any(-1)  # rows that see no key: zeros, lse = +inf
    want = torch.einsum("bnqk,bknh->bqnh", torch.softmax(s, -1).nan_to_num(0.0), vr)
    torch.testing.assert_close(out.double(), want, atol=BF16_TOL, rtol=0)
    assert torch.isinf(lse[:, :, empty]).all() and (out[:, empty] == 0).all()
    torch.testing.assert_close(
        lse[:, :, ~empty].double(), torch.logsumexp(s, -1)[:, :, ~empty], atol=BF16_TOL, rtol=0
    )


def test_double_gradients_and_varlen_match_reference():
    q, k, v, go = _rand(1, 12, 4, 8, seed=4), *(_rand(1, 12, 1, 8, seed=s) for s in (5, 6)), \
        _rand(1, 12, 4, 8, seed=7)  # fmt: skip
    docs = [[0, 5, 7]]
    o64, dq64, dk64, dv64 = doc_reference(q, k, v, go, True, docs)
    qb, kb, vb = (t[0].bfloat16().requires_grad_() for t in (q, k, v))
    cu = torch.tensor([0, 5, 7, 12], dtype=torch.int32)
    o, lse, _ = fd.flash_attn_varlen_func(qb, kb, vb, cu, cu.clone(), 5, 5, causal=True,
                                          return_attn_probs=True)  # fmt: skip
    assert lse.shape == (4, 12)  # varlen: [N, total_q]
    o.backward(go[0].bfloat16())
    for got, want in ((o, o64), (qb.grad, dq64), (kb.grad, dk64), (vb.grad, dv64)):
        torch.testing.assert_close(got.double(), want[0], atol=BF16_TOL * 2, rtol=BF16_TOL)


def test_double_enforces_the_kernel_preconditions():
    q, k = torch.randn(1, 4, 4, 8).bfloat16(), torch.randn(1, 4, 2, 8).bfloat16()
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        fd.flash_attn_func(q.float(), k.float(), k.float())
    with pytest.raises(RuntimeError, match="must divide"):
        fd.flash_attn_func(
            q, torch.randn(1, 4, 3, 8).bfloat16(), torch.randn(1, 4, 3, 8).bfloat16()
        )
    big = torch.randn(1, 4, 1, 264).bfloat16()
    with pytest.raises(RuntimeError, match="at most 256"):
        fd.flash_attn_func(big, big, big)
    q3, k3 = q[0], k[0]
    for cu, msg in (
        (torch.tensor([0, 4], dtype=torch.int64), "int32"),
        (torch.tensor([0, 0, 4, 4], dtype=torch.int32)[::2], "contiguous"),
        (torch.tensor([0, 3], dtype=torch.int32), "token count 4"),
    ):
        with pytest.raises(RuntimeError, match=msg):
            fd.flash_attn_varlen_func(q3, k3, k3, cu, cu, 4, 4)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="max_seqlen 3"):
        fd.flash_attn_varlen_func(q3, k3, k3, cu, cu, 3, 3)


# ---------------------------------------------------------------------------------------------
# the seam and the local kernel
# ---------------------------------------------------------------------------------------------
def test_seam_routes_every_flash_call_and_auto_picks_it(flash_double):
    q = torch.randn(1, 4, 2, 8).bfloat16()
    assert attention.resolve_backend("auto", q) == "flash_attn"  # the double runs on CPU
    assert attention.resolve_backend("auto", q.float()) == "sdpa"  # not fp32
    with attention.use_flash_attn_module(None):
        assert attention.resolve_backend("auto", q) == "sdpa"
        with pytest.raises(RuntimeError, match="not importable"):
            attention.resolve_backend("flash_attn", q)
    assert attention.flash_attn_module() is fd  # restored


@pytest.mark.parametrize("docs", [None, [[0, 5, 9], [0, 3]]])
@pytest.mark.parametrize("K", [4, 2, 1])
def test_local_kernel_flash_matches_sdpa_at_bf16(flash_double, docs, K):
    q, k, v, go = _rand(2, 13, 4, 16, seed=K), *(_rand(2, 13, K, 16, seed=K + s) for s in (1, 2)), \
        _rand(2, 13, 4, 16, seed=9)  # fmt: skip
    got, want = [], []
    for backend, out in (("flash_attn", got), ("sdpa", want)):
        before = dict(fd.calls)
        ts = [t.bfloat16().requires_grad_() for t in (q, k, v)]
        o = attention.local_attention(*ts, backend=backend, doc_starts=docs)
        o.backward(go.bfloat16())
        out.extend([o, *(t.grad for t in ts)])
        path = "varlen" if docs else "dense"
        assert fd.calls[path] - before[path] == (backend == "flash_attn")
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=BF16_TOL, rtol=BF16_TOL)


# ---------------------------------------------------------------------------------------------
# multi-rank: the engine, the ring, Ulysses x Ring, the trainer
# ---------------------------------------------------------------------------------------------
ENGINE_CASES = [
    dict(B=2, S=13, N=4, K=2, H=16, seed=0),
    dict(B=1, S=12, N=4, K=4, H=16, seed=1, head_chunks=2),
    dict(B=1, S=12, N=4, K=1, H=16, seed=2, overlap=True),
    dict(B=1, S=12, N=4, K=2, H=16, seed=3, head_chunks=2, overlap=True, docs=[[0, 5, 7]]),
    dict(B=2, S=11, N=6, K=3, H=8, seed=4, docs=[[0, 4], [0, 1, 9]]),
]


@pytest.mark.timeout(120)
def test_engine_flash_on_two_ranks_matches_float64_reference(flash_double):
    out = run_local_world(flash_workers.engine_worker, 2, ENGINE_CASES, timeout_s=100)
    for rank, results in enumerate(out):
        for r in results:
            path = "varlen" if r["case"].get("docs") else "dense"
            assert r["calls"][path] >= 1, f"rank {rank} {r['case']}: flash path not taken"
            for name, err in r["err"].items():
                assert err < 5e-2, f"rank {rank} {r['case']}: {name} error {err:.3e}"


RING_CASES = [
    dict(api="ring", dp=2, ring=2, sp=1, B=2, S=16, N=4, K=2, H=16, causal=True,
         dtype=torch.bfloat16),
    dict(api="ring", dp=2, ring=2, sp=1, B=2, S=16, N=4, K=4, H=16, causal=False,
         dtype=torch.bfloat16),
    dict(api="usp", dp=1, ring=2, sp=2, B=1, S=16, N=4, K=2, H=16, causal=True,
         dtype=torch.bfloat16),
]  # fmt: skip


@pytest.mark.timeout(120)
def test_ring_and_usp_flash_blocks_match_float64_reference(flash_double):
    out = run_local_world(flash_workers.ring_flash_worker, 4, RING_CASES, timeout_s=100)
    for rank, res in enumerate(out):
        assert res["calls"]["dense"] >= len(RING_CASES), f"rank {rank}: flash blocks not used"
        for case, r in zip(RING_CASES, res["results"]):
            for name, err in r["err"].items():
                assert err < 5e-2, f"rank {rank} {case['api']}: {name} error {err:.3e}"


TRAIN = dict(model="tiny", seq_len=32, batch_size=2, seed=0, lr=3e-3, warmup_steps=2,
             decay_steps=8, steps=3, dp=1, sp=2)  # fmt: skip


@pytest.mark.timeout(200)
def test_trainer_flash_equals_sdpa_at_bf16(flash_double):
    runs = [dict(TRAIN, attention_backend=b, pack_docs=p)
            for p in (False, True) for b in ("flash_attn", "sdpa")]  # fmt: skip
    (results, *_) = run_local_world(flash_workers.train_bf16, 2, runs, timeout_s=180)
    for i in (0, 2):
        (flash, calls), (sdpa, _) = results[i], results[i + 1]
        assert calls["varlen" if runs[i]["pack_docs"] else "dense"] > 0
        for (s1, a), (s2, b) in zip(flash, sdpa):
            assert s1 == s2 and abs(a - b) < 2e-2 * max(1.0, abs(b)), (runs[i], s1, a, b)


# ---------------------------------------------------------------------------------------------
# compile: flash and packed documents
# ---------------------------------------------------------------------------------------------
def test_compiled_varlen_call_passes_two_distinct_cu_tensors(flash_double):
    """dynamo (2.13) refuses one tensor passed twice to ``autograd.Function.apply``: the double
    reproduces that, and the project's compiled varlen call gets through."""
    import torch._dynamo

    q = torch.randn(2, 8, 4, 8, dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)

    def same_tensor_twice(x):
        return fd.flash_attn_varlen_func(x, x, x, cu, cu, 8, 8, causal=True)

    torch._dynamo.reset()
    with pytest.raises(Exception, match="duplicate tensor input"):
        torch.compile(same_tensor_twice, backend="aot_eager", fullgraph=True)(q[0])

    def project(x):
        return attention.local_attention(x, x, x, backend="flash_attn", doc_starts=[[0, 3], [0]])

    torch._dynamo.reset()
    got = torch.compile(project, backend="aot_eager", fullgraph=True)(q)
    got.float().sum().backward()
    want = attention.local_attention(*(q.detach().float(),) * 3, backend="sdpa",
                                     doc_starts=[[0, 3], [0]])  # fmt: skip
    torch.testing.assert_close(got.float(), want, atol=BF16_TOL, rtol=BF16_TOL)


def _docs_file(tmp_path) -> str:
    """Many short documents: every 32-token window holds a new layout of several."""
    import json
    import random

    r = random.Random(0)
    path = tmp_path / "docs.jsonl"
    lines = [
        "".join(r.choice("abcdefgh ij\n") for _ in range(r.randint(5, 40))) for _ in range(400)
    ]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    return str(path)


@pytest.mark.timeout(300)
def test_compile_pack_docs_trains_with_the_eager_losses_and_no_recompiles(tmp_path):
    """--compile --pack-docs, 50 steps of new document layouts on CPU (fullgraph per block):
    the eager losses, and one compiled graph (the layout's ints never enter it)."""
    cfg = dict(TRAIN, sp=1, steps=50, pack_docs=True, data=[_docs_file(tmp_path)])
    runs = [dict(cfg, compile=None), dict(cfg, compile="counting_aot_eager")]
    (eager, compiled), *_ = run_local_world(flash_workers.train_counting_compiles, 1, runs,
                                            timeout_s=280)  # fmt: skip
    assert compiled["graphs"] == 1, compiled["graphs"]
    assert len(compiled["losses"]) == 50
    for (s1, a), (s2, b) in zip(eager["losses"], compiled["losses"]):
        assert s1 == s2 and abs(a - b) < 1e-4, (s1, a, b)


@pytest.mark.timeout(400)
def test_compiled_steps_of_every_kernel_compile_can_choose_on_two_ranks(flash_double, tmp_path):
    """The real compiled training step (aot_eager, fullgraph per block) of every kernel the
    recipe can choose under --compile on CPU, at sp=2 (one kv head per rank): the eager losses.
    Packed documents run the blockwise custom op (its fake kernel once gave the wrong strides:
    a stride assertion in step 1), plain attention SDPA, and --attention-backend flash_attn the
    double at bf16 (at most one recompile: the count of documents becomes a dynamic
    dimension). Rank 0's start line names the kernel that runs (eager packed documents: SDPA,
    one call per document)."""
    docs = dict(TRAIN, pack_docs=True, data=[_docs_file(tmp_path)])
    cases = [
        ("blockwise", dict(docs, steps=4)),
        ("sdpa", dict(TRAIN, steps=4)),
        ("flash_attn", dict(docs, steps=12, attention_backend="flash_attn", bf16=True)),
    ]  # bf16 last: it changes the ranks' default mixed precision
    runs = [dict(cfg, compile=c) for _, cfg in cases for c in (None, "counting_aot_eager")]
    results = run_local_world(flash_workers.train_counting_compiles, 2, runs, timeout_s=380)
    for rank, per_rank in enumerate(results):
        for i, (kernel, cfg) in enumerate(cases):
            eager, compiled = per_rank[2 * i], per_rank[2 * i + 1]
            assert len(compiled["losses"]) == cfg["steps"], kernel
            assert compiled["graphs"] <= 2, (kernel, compiled["graphs"])
            tol = 1e-3 if kernel == "flash_attn" else 1e-5
            for (s1, a), (s2, b) in zip(eager["losses"], compiled["losses"]):
                assert s1 == s2 and abs(a - b) < tol, (kernel, s1, a, b)
        assert per_rank[3]["calls"] == {"dense": 0, "varlen": 0}  # fp32: not flash-attn
        if rank == 0:  # its start line names the kernel that runs (the other ranks print none)
            kernels = [r["start"].split("attention kernel ")[1].split(" |")[0] for r in per_rank]
            assert kernels == ["sdpa", "blockwise", "sdpa", "sdpa", "flash_attn", "flash_attn"]
        assert per_rank[4]["calls"]["varlen"] > 0


def test_compile_with_offloaded_checkpoints_is_refused_up_front():
    from dtensor_ulysses import train as du_train
    from dtensor_ulysses.train.cli import UsageError

    cfg = du_train.TrainConfig(**dict(TRAIN, sp=1, dp=1), compile="inductor",
                               activation_checkpointing=True, offload_activations=True)  # fmt: skip
    with pytest.raises(UsageError, match="--offload-activations with --compile"):
        du_train.validate(cfg, 1)


# ---------------------------------------------------------------------------------------------
# no host data per layer
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_no_host_data_per_layer_in_a_packed_flash_step(flash_double, tmp_path):
    """A 2- and a 6-block model, packed documents, flash-attn varlen, kv heads replicated (1 kv
    head over sp=2): as many tensors made from Python values and as many reads back to the host
    in one step, whatever the depth (the varlen bounds, the kv index and the layout's tensors
    are made once per step or per plan, not per layer)."""
    cfg = dict(seq_len=32, batch_size=2, seed=0, pack_docs=True, data=[_docs_file(tmp_path)],
               attention_backend="flash_attn")  # fmt: skip
    out = run_local_world(flash_workers.host_data_ops_per_step, 2, cfg, [2, 6], timeout_s=100)
    for rank, per_depth in enumerate(out):
        shallow, deep = per_depth[2], per_depth[6]
        assert shallow["docs"] > 1, "the batch must hold several documents"
        for op in ("lift_fresh", "_local_scalar_dense"):
            assert deep["counts"][op] == shallow["counts"][op], (rank, op, per_depth)


@pytest.mark.timeout(120)
def test_no_host_data_per_layer_in_a_packed_hf_step(flash_double):
    """The same through a transformers Llama (``apply_ulysses``, ``shard_batch``, flash-attn
    varlen) at 2 and 4 layers: the documents' device tensors are built once per forward by the
    routing, not per attention layer (before: 9 more ``lift_fresh`` per layer)."""
    pytest.importorskip("transformers")
    from tests import hf_workers

    out = run_local_world(hf_workers.host_data_per_depth, 2, [2, 4], "flash_attn", timeout_s=100)
    for rank, per_depth in enumerate(out):
        assert per_depth[2]["lift_fresh"] > 0, "the packed batch must build its doc tensors"
        for op in ("lift_fresh", "_local_scalar_dense"):
            assert per_depth[4][op] == per_depth[2][op], (rank, op, per_depth)


def test_explicit_rules_kept_ring_flash_docs_cc_check_and_doc_starts(flash_double, monkeypatch):
    """The ring refuses an explicit flash_attn with documents (never a silent torch kernel), the
    trainer says so up front; auto does not pick flash-attn below sm80; bad doc_starts raise."""
    from dtensor_ulysses import train as du_train
    from dtensor_ulysses.attention import ring
    from dtensor_ulysses.train.cli import UsageError

    q = torch.randn(1, 4, 2, 8).bfloat16()
    with pytest.raises(ValueError, match="backend='flash_attn' with packed documents in ring"):
        ring.ring_attention(q, q, q, None, doc_starts=[[0, 2]], backend="flash_attn")  # type: ignore[arg-type]
    cfg = du_train.TrainConfig(**dict(TRAIN, dp=1, sp=1, ring=2, seq_len=32), pack_docs=True,
                               attention_backend="flash_attn")  # fmt: skip
    with pytest.raises(UsageError, match="^--attention-backend flash_attn: .*ring attention"):
        du_train.validate(cfg, 2)

    class Cuda:  # a stand-in for a CUDA tensor on a pre-Ampere GPU
        device, dtype, shape = torch.device("cuda", 0), torch.bfloat16, (1, 4, 2, 8)

    monkeypatch.setitem(attention._capability, 0, (7, 5))
    monkeypatch.setattr(fd, "DEVICE_TYPES", ("cpu", "cuda"))
    assert attention.resolve_backend("auto", Cuda()) == "sdpa"  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="sm_75"):
        attention.resolve_backend("flash_attn", Cuda())  # type: ignore[arg-type]
    monkeypatch.setitem(attention._capability, 0, (8, 0))
    assert attention.resolve_backend("auto", Cuda()) == "flash_attn"  # type: ignore[arg-type]

    for bad, msg in (([[1, 3]], r"\[1, 3\]: document starts must rise strictly from 0"),
                     ([[0, 3, 3]], "rise strictly"), ([[0, 4]], "last start 4 .* S=4"),
                     ([[0], [0]], "2 rows for a batch of 1")):  # fmt: skip
        for backend in ("flash_attn", "sdpa"):
            with pytest.raises(ValueError, match=msg):
                attention.local_attention(q, q, q, backend=backend, doc_starts=bad)
