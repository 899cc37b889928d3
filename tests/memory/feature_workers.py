"""Per-rank functions for the memory-feature tests (spawned processes import them by path)."""

from __future__ import annotations

import random

import torch

import dtensor_ulysses as du
from tests.reference import reference_attention
from tests.workers import get_mesh, make_inputs


def _doc_lengths(S: int, rng: random.Random) -> list[int]:
    lengths = [1]  # a one-token document first
    while sum(lengths) < S:
        lengths.append(min(rng.choice([1, 2, 3, 5, 8, 13]), S - sum(lengths)))
    return lengths


def _reference(q, k, v, go, starts, causal):
    """float64 attention run on each document alone; returns o and the gradients."""
    q64, k64, v64 = (t.detach().double().clone().requires_grad_() for t in (q, k, v))
    S = q.shape[1]
    rows = []
    for b, row in enumerate(starts):
        parts = [
            reference_attention(q64[b : b + 1, lo:hi], k64[b : b + 1, lo:hi],
                                v64[b : b + 1, lo:hi], causal=causal)
            for lo, hi in zip(row, [*row[1:], S])
        ]  # fmt: skip
        rows.append(torch.cat(parts, dim=1))
    o64 = torch.cat(rows, dim=0)
    o64.backward(go.double())
    return o64.detach(), q64.grad, k64.grad, v64.grad


def head_chunks_worker(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """UlyssesAttention(head_chunks=C) on local slices vs the float64 per-document reference;
    plus the all-to-alls on the sp group, forward and backward."""
    out = []
    for case in cases:
        mesh = get_mesh(case["dp"], case["sp"])
        P, me, dp_rank = case["sp"], mesh.get_local_rank("sp"), mesh.get_local_rank("dp")
        B, S = case["B"], case["S"]
        q, k, v, go = make_inputs(case, torch.float64)
        rng = random.Random(case["seed"])
        if case["docs"]:
            starts = []
            for _ in range(B):
                lengths = _doc_lengths(S, rng)
                starts.append(tuple(sum(lengths[:i]) for i in range(len(lengths))))
        else:
            starts = [(0,)] * B
        o64, dq, dk, dv = _reference(q, k, v, go, starts, case["causal"])
        b = B // case["dp"]
        rows = slice(dp_rank * b, (dp_rank + 1) * b)
        sizes = [-(-S // P)] * P  # DTensor's Shard(1): chunks of ceil(S/P), the last ones shorter
        sizes = [max(0, min(sizes[0], S - r * sizes[0])) for r in range(P)]
        lo = sum(sizes[:me])
        cut = slice(lo, lo + sizes[me])
        doc_starts = tuple(starts[rows]) if case["docs"] else None
        layout = du.SeqLayout(tuple(sizes), doc_starts)
        ql, kl, vl = (t[rows, cut].detach().clone().requires_grad_() for t in (q, k, v))
        kernel = du.LocalAttention("sdpa", causal=case["causal"])
        engine = du.UlyssesAttention(kernel, mesh["sp"], head_chunks=case["C"])
        with du.CommCounter() as fwd:
            o = engine(ql, kl, vl, layout=layout)
        with du.CommCounter() as bwd:
            o.backward(go[rows, cut])
        want = {"o": o64, "dq": dq, "dk": dk, "dv": dv}
        got = {"o": o.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
        errors = {n: (got[n] - want[n][rows, cut]).abs().max().item() for n in want}
        group = mesh.get_group("sp")
        out.append(
            {
                "case": case,
                "errors": errors,
                "sp_rank": me,
                "local_B": b,
                "local_S": sizes[me],
                "fwd": (fwd.count("all_to_all", group), fwd.bytes("all_to_all", group)),
                "bwd": (bwd.count("all_to_all", group), bwd.bytes("all_to_all", group)),
                "other": sum(c.count() - c.count("all_to_all") for c in (fwd, bwd)),
            }
        )
    return out


def copy_count_worker(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Bytes written by copy kernels (copy_, cat, clone, _to_copy) inside the fused q, k, v
    all-to-all and its backward, next to the bytes that travel."""
    import torch.distributed as dist

    from dtensor_ulysses._torch_private import TorchDispatchMode
    from dtensor_ulysses.comm import all_to_all

    aten = torch.ops.aten
    copies = {aten.copy_.default, aten.cat.default, aten.clone.default, aten._to_copy.default}

    class CopyBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in copies:
                self.bytes += out.numel() * out.element_size()
            return out

    group = dist.group.WORLD
    out = []
    for case in cases:
        g = torch.Generator().manual_seed(case["seed"])
        B, s, H, P = case["B"], case["s"], case["H"], world_size
        if case.get("heads_major"):  # x[B, s, n, H] stored as [B, n, s, H] (a kernel's o)
            bases = [
                torch.randn(B, n, s, H, generator=g, requires_grad=True) for n in case["heads"]
            ]
            xs = [b.transpose(1, 2) for b in bases]
        else:
            xs = [torch.randn(B, s, n, H, generator=g, requires_grad=True) for n in case["heads"]]
        sizes = [[n // P] * P for n in case["heads"]]
        if case.get("uneven_heads"):
            sizes = [[n // P + (r < n % P) for r in range(P)] for n in case["heads"]]
        with CopyBytes() as fwd:
            ys = all_to_all(xs, scatter_dim=2, gather_dim=1, group=group, scatter_sizes=sizes)
        grads = [torch.ones_like(y) for y in ys]
        with CopyBytes() as bwd:
            dxs = torch.autograd.grad(ys, xs, grads)
        out.append(
            {
                "case": case,
                "grad_strides_match": all(d.stride() == x.stride() for d, x in zip(dxs, xs)),
                "sent": sum(x.numel() * x.element_size() for x in xs),
                "received": sum(y.numel() * y.element_size() for y in ys),
                "fwd_copy_bytes": fwd.bytes,
                "bwd_copy_bytes": bwd.bytes,
            }
        )
    return out


def compile_worker(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """``torch.compile(fullgraph=True)`` of the engine around SDPA (a graph break is an error)
    against the eager call: outputs and gradients."""
    torch._dynamo.reset()
    mesh = get_mesh(1, world_size)
    out = []
    for case in cases:
        q, k, v, go = make_inputs(case, torch.float32)
        s = case["S"] // world_size
        cut = slice(rank * s, (rank + 1) * s)
        engine = du.UlyssesAttention(
            du.LocalAttention("sdpa"), mesh["sp"], head_chunks=case.get("C", 1)
        )
        compiled = torch.compile(engine, fullgraph=True, backend=case["backend"])
        results = {}
        for name, fn in (("eager", engine), ("compiled", compiled)):
            ql, kl, vl = (t[:, cut].detach().clone().requires_grad_() for t in (q, k, v))
            o = fn(ql, kl, vl)
            o.backward(go[:, cut])
            results[name] = {"o": o.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
        e, c = results["eager"], results["compiled"]
        errors = {n: (e[n] - c[n]).abs().max().item() for n in ("o", "dq", "dk", "dv")}
        out.append({"case": case, "errors": errors})
    return out


def compiled_model_worker(rank: int, world_size: int, backend: str) -> dict:
    """The tiny model through du.parallelize with and without compile=backend (blocks compiled
    after checkpointing, before FSDP2), and compiled with overlap_comm (the model hands q over
    deferred; compiled, the engine evaluates it at once), at dp=1, sp=world_size: loss and
    every gradient."""
    from torch.distributed.tensor import DTensor

    from dtensor_ulysses.data import PackedCorpus, get_batch
    from dtensor_ulysses.models import build_model, init_weights
    from dtensor_ulysses.parallel import flatten_dp_sp

    torch._dynamo.reset()
    mesh = du.init_mesh(1, world_size, device_type="cpu")
    corpus = PackedCorpus.from_paths(None, seq_len=64)
    batch = get_batch(corpus, 0, global_batch_size=2, dp_rank=0, dp=1, sp_rank=rank,
                      sp=world_size, seed=0)  # fmt: skip
    group = flatten_dp_sp(mesh).get_group()
    out = {}
    variants = (("eager", False, False), ("compiled", backend, False), ("overlap", backend, True))
    for name, compile, overlap in variants:
        model = build_model("tiny")
        du.parallelize(model, mesh, activation_checkpointing=True, compile=compile,
                       overlap_comm=overlap)  # fmt: skip
        model.to_empty(device="cpu")
        init_weights(model, seed=0)
        loss = model(batch.input_ids, batch.position_ids, layout=batch.layout, labels=batch.labels)
        loss.backward()
        grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                 for n, p in model.named_parameters()}  # fmt: skip
        total = loss.detach().reshape(1)
        torch.distributed.all_reduce(total, group=group)
        out[name] = (total.item(), grads)
    (le, ge), (lc, gc), (lo, go) = out["eager"], out["compiled"], out["overlap"]
    return {"loss": (le, lc, lo), "grad_err": max((ge[n] - g[n]).abs().max().item()
                                                  for g in (gc, go) for n in ge)}  # fmt: skip


def kernel_layout_worker(rank: int, world_size: int, head_chunks: int) -> dict:
    """What memory layout the SDPA kernel receives through the engine."""

    class Recording(du.LocalAttention):
        seen: list = []

        def forward(self, q, k, v, **kw):
            self.seen.append(all(t.transpose(1, 2).is_contiguous() for t in (q, k, v)))
            return super().forward(q, k, v, **kw)

    mesh = get_mesh(1, world_size)
    kernel = Recording("sdpa")
    engine = du.UlyssesAttention(kernel, mesh["sp"], head_chunks=head_chunks)
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(2, 4, 8, 4, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 4, 2, 4, generator=g, requires_grad=True) for _ in range(2))
    engine(q, k, v).sum().backward()
    return {"bnsh": kernel.seen}


def overlap_worker(rank: int, world_size: int, case: dict) -> dict:
    """Head-chunked attention with ``overlap=True`` (asynchronous all-to-alls) and without (one
    exchange at a time): outputs and gradients, and the order of starts and kernels."""
    from dtensor_ulysses.attention import _head_stages

    mesh = get_mesh(1, world_size)
    q, k, v, go = make_inputs(case, torch.float32)
    s = case["S"] // world_size
    cut = slice(rank * s, (rank + 1) * s)
    events: list[str] = []
    kernel = du.LocalAttention("sdpa")

    def attend(q_, k_, v_, **kw):
        events.append("attend")
        return kernel(q_, k_, v_, **kw)

    real_start = _head_stages.start_exchange

    def start(*args, **kw):
        events.append(f"start {'heads' if args[1] == 2 else 'seq'}")
        return real_start(*args, **kw)

    results = {}
    _head_stages.start_exchange = start
    try:
        for overlap in (True, False):
            events.clear()
            engine = du.UlyssesAttention(attend, mesh["sp"], head_chunks=case["C"],
                                         overlap=overlap)  # fmt: skip
            ql, kl, vl = (t[:, cut].detach().clone().requires_grad_() for t in (q, k, v))
            o = engine(ql, kl, vl)
            o.backward(go[:, cut])
            results[overlap] = dict(o=o.detach(), dq=ql.grad, dk=kl.grad, dv=vl.grad,
                                    events=list(events))  # fmt: skip
    finally:
        _head_stages.start_exchange = real_start
    a, b = results[True], results[False]
    return {
        "equal": {n: bool(torch.equal(a[n], b[n])) for n in ("o", "dq", "dk", "dv")},
        "events": a["events"],
        "events_sequential": b["events"],
    }


def kv_overlap_worker(rank: int, world_size: int, case: dict) -> dict:
    """An attention layer of the model whose engine defers q (``overlap=True``: k and v move
    while q is projected) against the fused one-exchange engine and the single-device layer:
    output, input and weight gradients; the order of the collectives and the q projection."""
    import torch.distributed as dist

    from dtensor_ulysses.models import Attention, rope_cos_sin
    from dtensor_ulysses.plan import get_shape

    shape = get_shape("tiny").with_(n_heads=case["N"], n_kv_heads=case["K"],
                                    qk_norm=case.get("qk_norm", False))  # fmt: skip
    torch.manual_seed(case["seed"])
    layer = Attention(shape)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    B, S, D = case["B"], case["S"], shape.dim
    g = torch.Generator().manual_seed(case["seed"])
    x, gy = torch.randn(B, S, D, generator=g), torch.randn(B, S, D, generator=g)
    pos = torch.arange(S).expand(B, S)
    s = S // world_size
    cut = slice(rank * s, (rank + 1) * s)
    events: list[str] = []
    real_a2a = dist.all_to_all_single

    def a2a(out, inp, *args, **kw):
        events.append(f"a2a {inp.numel()} {'async' if kw.get('async_op') else 'sync'}")
        return real_a2a(out, inp, *args, **kw)

    hook = layer.wq.register_forward_hook(lambda *_: events.append("project q"))

    def run(inner, lo: slice):
        layer.inner_attention = inner
        layer.zero_grad()
        xi = x[:, lo].clone().requires_grad_()
        cos, sin = rope_cos_sin(pos[:, lo], shape.head_dim, shape.rope_theta)
        y = layer(xi, cos, sin)
        n_fwd = len(events)
        y.backward(gy[:, lo])
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        return dict(y=y.detach(), dx=xi.grad, **grads), n_fwd

    kernel = du.LocalAttention("sdpa")
    out = {}
    dist.all_to_all_single = a2a
    try:
        for name, overlap in (("overlap", True), ("fused", False)):
            events.clear()
            r, n_fwd = run(du.UlyssesAttention(kernel, dist.group.WORLD, overlap=overlap), cut)
            out[name] = dict(values=r, forward=events[:n_fwd], backward=events[n_fwd:])
    finally:
        dist.all_to_all_single = real_a2a
        hook.remove()
    single, _ = run(du.LocalAttention("sdpa"), slice(0, S))  # the whole sequence, one device
    a, b = out["overlap"]["values"], out["fused"]["values"]
    return {
        "equal": {n: bool(torch.equal(a[n], b[n])) for n in a},
        # weight gradients are this rank's part of the sum over ranks: compare the sum
        "close": {
            n: bool(
                torch.allclose(
                    t if n in ("y", "dx") else _summed(t),
                    single[n][:, cut] if n in ("y", "dx") else single[n],
                    atol=1e-5,
                    rtol=1e-4,
                )
            )
            for n, t in a.items()
        },  # fmt: skip
        "forward": out["overlap"]["forward"],
        "backward": out["overlap"]["backward"],
        "fused_forward": out["fused"]["forward"],
        "fused_backward": out["fused"]["backward"],
        "elements": dict(
            q=B * s * case["N"] * shape.head_dim, kv=2 * B * s * case["K"] * shape.head_dim
        ),  # fmt: skip
    }


def _summed(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    t = t.clone()
    dist.all_reduce(t)
    return t


def run_calls(rank: int, world_size: int, calls: list[tuple[str, tuple]]) -> list:
    """Several per-rank functions in one world, in order (a world start costs seconds of
    process spawn, imports and gloo setup): each ``(name, args)`` is a function of this module,
    or ``train_workers.<name>``, called as ``fn(rank, world_size, *args)``; one result each.
    Dynamo's caches are reset before each call, as in a fresh world (no call's compiled code
    or recompile count carries over to the next)."""
    import sys

    from tests import train_workers

    out = []
    for name, args in calls:
        module, _, fn = name.rpartition(".")
        owner = train_workers if module == "train_workers" else sys.modules[__name__]
        torch._dynamo.reset()
        out.append(getattr(owner, fn)(rank, world_size, *args))
    return out


VL_PATCHES = [5, 3, 4, 7, 2]  # images of different sizes: R = 21 image tokens of a 40-token row


def vl_setup():
    """The vision-language step's tiny decoder, tower, images and row (float32, seeded)."""
    from dtensor_ulysses.data import full_batch
    from dtensor_ulysses.data.batch import IGNORE_INDEX
    from dtensor_ulysses.memtrace.vision_step import PATCH_VALUES, VisionSpec, VisionTower
    from dtensor_ulysses.models import build_model

    torch.manual_seed(0)
    policy = build_model("tiny", device="cpu")
    tower = VisionTower(VisionSpec(layers=2, hidden=32, head_dim=8), policy.shape.dim)
    with torch.no_grad():
        for p in tower.parameters():  # gains away from 1 too
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 1.0))
    pixels = [torch.randn(r, PATCH_VALUES) for r in VL_PATCHES]
    ids = torch.randint(0, 200, (1, 40))
    labels = torch.roll(ids, -1, 1)
    labels[:, : sum(VL_PATCHES)] = IGNORE_INDEX
    labels[:, -1] = IGNORE_INDEX
    return policy, tower, pixels, full_batch(ids, labels)


def vl_step_worker(rank: int, world_size: int) -> dict:
    """``memtrace.vision_step.vl_step`` at (dp, sp) = (1, world_size): the decoder under
    ``du.parallelize`` (Ulysses + FSDP2), the tower under FSDP2 (sum reduction), SGD lr 1: the
    global loss, the full weights after the step, and the patches this rank encoded."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from dtensor_ulysses.data import slice_batch
    from dtensor_ulysses.memtrace.vision_step import vl_step
    from dtensor_ulysses.parallel import flatten_dp_sp

    mesh = get_mesh(1, world_size)
    flat = flatten_dp_sp(mesh)
    policy, tower, pixels, batch = vl_setup()
    policy = du.parallelize(policy, mesh, mixed_precision=None)
    for block in tower.layers:
        fully_shard(block, mesh=flat)
    fully_shard(tower, mesh=flat)
    for m in tower.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    encoded: list[int] = []
    encode = tower.encode
    tower.encode = lambda x, patches: (encoded.append(x.shape[0]), encode(x, patches))[1]
    opts = [torch.optim.SGD(m.parameters(), lr=1.0) for m in (policy, tower)]
    sched = torch.optim.lr_scheduler.LambdaLR(opts[0], lambda _: 1.0)
    loss = vl_step(policy, tower, slice_batch(batch, sp=world_size, sp_rank=rank), pixels, opts,
                   sched, sp_group=mesh["sp"].get_group(), sp_rank=rank,
                   group=flat.get_group(), grad_clip=0)  # fmt: skip
    total = torch.tensor([loss])
    torch.distributed.all_reduce(total)
    weights = {
        **{f"p.{n}": p.full_tensor().detach() for n, p in policy.named_parameters()},
        **{f"t.{n}": p.full_tensor().detach() for n, p in tower.named_parameters()},
    }
    return {"loss": total.item(), "weights": weights, "encoded": encoded}
