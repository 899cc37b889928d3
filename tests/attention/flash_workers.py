"""Per-rank functions that run the project's flash path through the flash-attn test double."""

from __future__ import annotations

import contextlib
import io
import os

import torch
import torch.utils._pytree as pytree
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

import dtensor_ulysses as du
from dtensor_ulysses.attention import local as attention
from dtensor_ulysses.plan import SeqLayout, seq_split
from tests.attention import flash_double
from tests.ring_workers import get_mesh as ring_mesh
from tests.ring_workers import reference as doc_reference
from tests.ring_workers import ring_worker
from tests.workers import OpCounts, get_mesh

__all__ = ["engine_worker", "ring_flash_worker", "train_bf16"]


def _installed() -> None:
    assert os.environ.get(attention.FLASH_MODULE_ENV) == "tests.attention.flash_double"
    assert attention.flash_attn_module() is flash_double


def engine_worker(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """UlyssesAttention(LocalAttention("flash_attn")) at bf16 vs a float64 reference."""
    _installed()
    out = []
    for case in cases:
        mesh = get_mesh(1, world_size)
        B, S, N, K, H = (case[x] for x in ("B", "S", "N", "K", "H"))
        g = torch.Generator().manual_seed(case["seed"])
        q, k, v, go = (torch.randn(B, S, n, H, generator=g, dtype=torch.float64)
                       for n in (N, K, K, N))  # fmt: skip
        docs = case.get("docs")
        ref = doc_reference(q, k, v, go, True, docs)
        sizes = seq_split(S, world_size)
        lo = sum(sizes[:rank])
        mine = slice(lo, lo + sizes[rank])
        ql, kl, vl = (t[:, mine].bfloat16().requires_grad_() for t in (q, k, v))
        attn = du.UlyssesAttention(
            attention.LocalAttention("flash_attn"), mesh,
            head_chunks=case.get("head_chunks", 1), overlap=case.get("overlap", False),
        )  # fmt: skip
        layout = SeqLayout.split(S, world_size, docs)
        before = dict(flash_double.calls)
        qin = attention.DeferredQ(lambda: ql * 1, ql.shape) if attn.defers_q else ql
        o = attn(qin, kl, vl, layout=layout)
        o.backward(go[:, mine].bfloat16())
        got = (o, ql.grad, kl.grad, vl.grad)
        errs = {n: (a.double() - b[:, mine]).abs().max().item()
                for n, a, b in zip(("o", "dq", "dk", "dv"), got, ref)}  # fmt: skip
        calls = {n: flash_double.calls[n] - before[n] for n in before}
        out.append({"case": case, "err": errs, "calls": calls})
    return out


def ring_flash_worker(rank: int, world_size: int, cases: list[dict]) -> dict:
    """The ring worker's cases (bf16) with the double installed, and how often it ran."""
    _installed()
    for case in cases:
        ring_mesh(case["dp"], case["ring"], case["sp"])
    res = ring_worker(rank, world_size, cases)
    return {"results": res, "calls": dict(flash_double.calls)}


def train_bf16(rank: int, world_size: int, runs: list[dict]) -> list[list[tuple[int, float]]]:
    """The trainer's runs with bf16 FSDP2 compute on CPU (the CUDA policy), the double installed."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from dtensor_ulysses import train as du_train
    from dtensor_ulysses.parallel import apply as parallel

    _installed()
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    parallel.default_mixed_precision = lambda device_type: bf16  # type: ignore[assignment]
    results = []
    for kw in runs:
        before = dict(flash_double.calls)
        cfg = du_train.validate(du_train.TrainConfig(**kw), world_size)
        records = du_train.train(cfg)
        calls = {n: flash_double.calls[n] - before[n] for n in before}
        results.append(([(r["step"], r["loss"]) for r in records], calls))
    return results


class _StrideChecked(torch.fx.Interpreter):
    """Runs a graph eagerly and checks every output of the library's custom ops against the
    shape and strides its fake kernel gave at trace time (inductor's ``assert_size_stride``;
    aot_eager alone runs on whatever strides come out)."""

    def run_node(self, n):
        out = super().run_node(n)
        if getattr(n.target, "namespace", None) == "dtensor_ulysses" and "val" in n.meta:
            real, fake = pytree.tree_leaves(out), pytree.tree_leaves(n.meta["val"])
            for i, (r, f) in enumerate(zip(real, fake)):
                if isinstance(r, torch.Tensor):
                    got, want = (tuple(r.shape), r.stride()), (tuple(f.shape), f.stride())
                    assert got == want, f"{n.target} output {i}: (shape, stride) {got} != {want}"
        return out


def _stride_checked(gm, example_inputs):
    return make_boxed_func(lambda *args: _StrideChecked(gm).run(*args))


_STRIDE_CHECKED_AOT_EAGER = aot_autograd(fw_compiler=_stride_checked, bw_compiler=_stride_checked)


def train_counting_compiles(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    """The trainer's runs; per run its losses and how many frames dynamo compiled."""
    from dtensor_ulysses import train as du_train

    compiled: list[int] = []

    @torch._dynamo.register_backend(name="counting_aot_eager")  # type: ignore[misc]
    def _counting(gm, example_inputs):
        compiled.append(1)
        return _STRIDE_CHECKED_AOT_EAGER(gm, example_inputs)

    results = []
    for kw in runs:
        kw = dict(kw)
        if kw.pop("bf16", False):  # FSDP2's CUDA policy on CPU: bf16 compute for flash-attn
            from torch.distributed.fsdp import MixedPrecisionPolicy

            from dtensor_ulysses.parallel import apply as parallel

            bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            parallel.default_mixed_precision = lambda device_type: bf16  # type: ignore[assignment]
        torch._dynamo.reset()
        compiled.clear()
        cfg = du_train.validate(du_train.TrainConfig(**kw), world_size)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):  # the start line: the kernel that runs
            records = du_train.train(cfg)
        results.append(
            {
                "losses": [(r["step"], r["loss"]) for r in records],
                "graphs": len(compiled),
                "calls": dict(flash_double.calls),
                "start": out.getvalue().splitlines()[0] if out.getvalue() else "",
            }
        )
    return results


def host_data_ops_per_step(rank: int, world_size: int, cfg_kw: dict, depths: list[int]) -> dict:
    """Per model depth: the tensors made from host data (``aten.lift_fresh``: ``torch.tensor``
    of Python values) and the reads back to the host (``aten._local_scalar_dense``: ``.item()``,
    ``int()``, ``.tolist()``) in one packed-document forward/backward (flash double, bf16, GQA
    with replicated kv heads); after one warm-up step (per-plan caches)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from dtensor_ulysses import train as du_train
    from dtensor_ulysses.data import PackedCorpus, get_batch
    from dtensor_ulysses.parallel import apply as parallel
    from dtensor_ulysses.parallel.mesh import flatten_dp_sp, init_mesh
    from dtensor_ulysses.plan.presets import PRESETS, get_shape

    _installed()
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    parallel.default_mixed_precision = lambda device_type: bf16  # type: ignore[assignment]
    count = OpCounts("lift_fresh", "_local_scalar_dense", "_to_copy")
    mesh = init_mesh(1, world_size, device_type="cpu")
    group = flatten_dp_sp(mesh).get_group()
    out = {}
    for depth in depths:
        name = f"tiny-gqa@{depth}L"
        PRESETS[name] = get_shape("tiny").with_(name=name, n_layers=depth, n_kv_heads=1)
        cfg = du_train.validate(du_train.TrainConfig(model=name, dp=1, sp=world_size, **cfg_kw),
                                world_size)  # fmt: skip
        model, _, _ = du_train.build(cfg, mesh, torch.device("cpu"))
        corpus = PackedCorpus.from_paths(cfg.data, seq_len=cfg.seq_len)
        counts = []
        for step in range(2):
            batch = get_batch(
                corpus, step, global_batch_size=cfg.batch_size, dp_rank=0, dp=1, sp_rank=rank,
                sp=world_size, seed=cfg.seed, pack_docs=True,
            )  # fmt: skip
            with count:
                du_train.forward_backward(model, batch, group)
            counts.append(dict(count.counts))
        out[depth] = {"counts": counts[1], "docs": max(len(r) for r in batch.layout.doc_starts)}
    return out
