"""Per-rank functions for the multi-process tests (spawned processes import them by module path).

Each worker runs many cases in one world, because starting a world costs seconds; it returns plain
data (errors, counts, bytes) and the test in the parent process asserts on it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ulysses as du
from dtensor_ulysses._torch_private import TorchDispatchMode
from tests.reference import reference_attention

_MESHES: dict[tuple, DeviceMesh] = {}


class OpCounts(TorchDispatchMode):
    """Counts the calls of the named aten ops (by overload packet, e.g. ``"lift_fresh"``: a
    tensor made from host data; ``"_local_scalar_dense"``: a read back to the host) while
    active; ``counts`` holds them, zeroed on each entry."""

    def __init__(self, *names: str) -> None:
        super().__init__()
        self.counts = dict.fromkeys(names, 0)

    def __enter__(self):
        self.counts = dict.fromkeys(self.counts, 0)
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.counts:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def get_mesh(dp: int, sp: int, one_d: bool = False) -> DeviceMesh:
    """A ("dp", "sp") mesh (or its 1-D "sp" submesh), cached: building one is a collective."""
    key = (dp, sp)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", (dp, sp), mesh_dim_names=("dp", "sp"))
    mesh = _MESHES[key]
    return mesh["sp"] if one_d else mesh


def placements_for(mesh: DeviceMesh, batch_on_dp: bool = True):
    if mesh.ndim == 1:
        return [Shard(1)]
    return [Shard(0) if batch_on_dp else Replicate(), Shard(1)]


def make_inputs(case: dict, dtype: torch.dtype):
    """Global q, k, v, grad-of-output drawn from the case's seed (identical on every rank)."""
    g = torch.Generator().manual_seed(case["seed"])
    B, S, N, K, H = (case[x] for x in ("B", "S", "N", "K", "H"))

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    return draw(B, S, N, H), draw(B, S, K, H), draw(B, S, K, H), draw(B, S, N, H)


def equivalence_worker(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Forward and backward of ulysses_attention / UlyssesAttention vs the float64 reference."""
    results = []
    for case in cases:
        mesh = get_mesh(case["dp"], case["sp"], case.get("one_d", False))
        placements = placements_for(mesh, case.get("batch_on_dp", True))
        dtype = case["dtype"]
        q, k, v, go = make_inputs(case, dtype)

        # reference: float64, full tensors, plain autograd
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        o64 = reference_attention(q64, k64, v64, causal=case["causal"])
        o64.backward(go.double())

        def shard(t):
            return distribute_tensor(t, mesh, placements, src_data_rank=None)

        qd, kd, vd = (shard(t).requires_grad_() for t in (q, k, v))
        if case["api"] == "dtensor":
            od = du.ulysses_attention(qd, kd, vd, causal=case["causal"], backend="sdpa")
            od.backward(shard(go))
            out_local = od.to_local()
            got = {"o": out_local, "dq": qd.grad, "dk": kd.grad, "dv": vd.grad}
            got = {n: (t.to_local() if isinstance(t, DTensor) else t) for n, t in got.items()}
            meta_ok = od.placements == qd.placements and od.shape == qd.shape
        else:  # UlyssesAttention on local tensors, with a user kernel (SDPA with GQA)
            ql, kl, vl = (t.to_local().detach().requires_grad_() for t in (qd, kd, vd))

            def kernel(q_, k_, v_, causal):
                return du.local_attention(q_, k_, v_, causal=causal, backend="sdpa")

            attn = du.UlyssesAttention(kernel, mesh)
            out_local = attn(ql, kl, vl, causal=case["causal"])
            out_local.backward(shard(go).to_local())
            got = {"o": out_local, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
            meta_ok = out_local.shape == ql.shape
        want = {
            "o": shard(o64.detach()).to_local(),
            "dq": shard(q64.grad).to_local(),
            "dk": shard(k64.grad).to_local(),
            "dv": shard(v64.grad).to_local(),
        }
        errors = {n: (got[n].double() - want[n]).abs().max().item() for n in want}
        scale = {n: want[n].abs().max().item() for n in want}
        results.append({"case": case, "errors": errors, "scale": scale, "meta_ok": meta_ok})
    return results


def _count(fn):
    """Run fn under CommCounter and CommDebugMode; return (result, per-kind calls, debug counts)."""
    counter, debug = du.CommCounter(), CommDebugMode()
    with counter, debug:
        out = fn()
    counts = {str(op): n for op, n in debug.get_comm_counts().items()}
    return out, counter, counts


def comm_worker(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Collectives, counts and bytes of forward and backward, per rank."""
    results = []
    for case in cases:
        mesh = get_mesh(case["dp"], case["sp"], case.get("one_d", False))
        sp_group = mesh.get_group("sp")
        placements = placements_for(mesh)
        q, k, v, go = make_inputs(case, torch.float32)
        qd, kd, vd = (
            distribute_tensor(t, mesh, placements, src_data_rank=None).requires_grad_()
            for t in (q, k, v)
        )
        god = distribute_tensor(go, mesh, placements, src_data_rank=None)
        if case["op"] == "attention":

            def forward():
                return du.ulysses_attention(qd, kd, vd, backend="sdpa", fuse_qkv=case["fuse"])

        elif case["op"] == "seq_to_head":

            def forward():
                return du.seq_to_head(qd)

            god = distribute_tensor(go, mesh, [*placements[:-1], Shard(2)], src_data_rank=None)
        else:  # head_to_seq of a head-sharded tensor
            qh = distribute_tensor(q, mesh, [*placements[:-1], Shard(2)], src_data_rank=None)
            qh.requires_grad_()

            def forward():
                return du.head_to_seq(qh)

        out, fwd, fwd_debug = _count(forward)
        _, bwd, bwd_debug = _count(lambda: out.backward(god))

        def summary(counter):
            return {
                "kinds": counter.by_kind(),
                "on_sp": counter.count(group=sp_group),
                "sp_bytes": counter.bytes(group=sp_group),
                "all": [(c.kind, c.bytes) for c in counter.calls],
            }

        results.append(
            {
                "case": case,
                "local_B": qd.to_local().shape[0],
                "fwd": summary(fwd),
                "bwd": summary(bwd),
                "fwd_debug": fwd_debug,
                "bwd_debug": bwd_debug,
            }
        )
    return results


def roundtrip_worker(rank: int, world_size: int, max_examples: int) -> int:
    """head_to_seq(seq_to_head(x)) == x on hypothesis-drawn shapes; all ranks draw alike."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    layouts = [(d, world_size // d) for d in (1, 2, 4) if world_size % d == 0]
    ran = []

    @settings(max_examples=max_examples, derandomize=True, database=None, deadline=None)
    @given(
        layout=st.sampled_from(layouts),
        B=st.integers(1, 3),
        s=st.integers(1, 4),
        n=st.integers(1, 3),
        H=st.integers(1, 5),
        one_d=st.booleans(),
        batch_on_dp=st.booleans(),
    )
    def check(layout, B, s, n, H, one_d, batch_on_dp):
        dp, sp = layout
        mesh = get_mesh(dp, sp, one_d)
        placements = placements_for(mesh, batch_on_dp)
        x = torch.arange(B * s * sp * n * sp * H, dtype=torch.float32).reshape(B, s * sp, n * sp, H)
        xd = distribute_tensor(x, mesh, placements, src_data_rank=None)
        h = du.seq_to_head(xd)
        assert h.placements[-1] == Shard(2) and h.shape == x.shape
        assert tuple(h.placements[:-1]) == tuple(placements[:-1])
        # the head-sharded local piece is exactly the global tensor's (seq all, heads chunk)
        expect_h = distribute_tensor(x, mesh, [*placements[:-1], Shard(2)], src_data_rank=None)
        assert torch.equal(h.to_local(), expect_h.to_local())
        back = du.head_to_seq(h)
        assert back.placements == xd.placements and torch.equal(back.to_local(), xd.to_local())
        ran.append((dp, sp, B, s, n, H))

    check()
    return len(ran)


def _bound_dims_agree(mesh: DeviceMesh) -> None:
    """``ParallelDims.from_mesh``: the degrees, this rank's coordinates and groups, the one
    slicer's arguments, all read from the mesh itself (an ``AssertionError`` names a
    difference)."""
    from dtensor_ulysses.parallel import ParallelDims

    dims = ParallelDims.from_mesh(mesh)
    dp_rank, sp_rank = mesh.get_coordinate()
    got = (dims.dp, dims.sp, dims.dp_rank, dims.sp_rank, dims.flat_mesh.size())
    want = (mesh.size(0), mesh.size(1), dp_rank, sp_rank, mesh.size())
    assert got == want, f"{got} != {want}"
    assert dims.coords() == dict(dp=dims.dp, dp_rank=dp_rank, sp=dims.sp, sp_rank=sp_rank,
                                 ring=1, ring_rank=0), dims.coords()  # fmt: skip
    assert dims.sp_mesh.get_group() is mesh.get_group(1)
    assert dims.dp_mesh.get_group() is mesh.get_group(0)
    assert ParallelDims.of(dims) is dims and ParallelDims.of(mesh) == dims


def error_worker(rank: int, world_size: int) -> list[dict]:
    """Each bad input: the exception type and message, so the parent can assert both."""
    from dtensor_ulysses.parallel import ParallelDims

    mesh = get_mesh(1, world_size)
    mesh22 = get_mesh(2, world_size // 2)
    tp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))

    def dt(shape, m=mesh, placements=None):
        t = torch.randn(*shape)
        return distribute_tensor(t, m, placements or placements_for(m), src_data_rank=None)

    q = dt((1, 8, 8, 4))
    cases = {
        "sp_exceeds_heads": lambda: du.ulysses_attention(
            dt((1, 8, 2, 4)), dt((1, 8, 2, 4)), dt((1, 8, 2, 4))
        ),
        "s2h_heads_not_divisible": lambda: du.seq_to_head(dt((1, 8, 6, 4))),
        "s2h_seq_not_divisible": lambda: du.seq_to_head(dt((1, 6, 8, 4))),
        "positions_not_dtensor": lambda: du.ulysses_attention(
            q, q, q, position_ids=torch.zeros(1, 8, dtype=torch.long)
        ),
        "positions_wrong_shape": lambda: du.ulysses_attention(
            q, q, q, position_ids=dt((1, 4)).long()
        ),
        "seq_not_divisible": lambda: du.ulysses_attention(
            dt((1, 6, 8, 4)), dt((1, 6, 8, 4)), dt((1, 6, 8, 4))
        ),
        "not_seq_sharded": lambda: du.ulysses_attention(
            dt((1, 8, 8, 4), placements=[Replicate(), Shard(2)]), q, q
        ),
        "replicated_on_sp": lambda: du.seq_to_head(
            dt((1, 8, 8, 4), placements=[Replicate(), Replicate()])
        ),
        "seq_on_dp": lambda: du.seq_to_head(
            dt((2, 8, 8, 4), m=mesh22, placements=[Shard(1), Shard(1)])
        ),
        "different_meshes": lambda: du.ulysses_attention(q, dt((2, 8, 8, 4), m=mesh22), q),
        "head_dims_differ": lambda: du.ulysses_attention(q, dt((1, 8, 8, 2)), dt((1, 8, 8, 2))),
        "no_sp_axis": lambda: du.seq_to_head(dt((1, 8, 8, 4), m=tp_mesh, placements=[Shard(1)])),
        "not_dtensor": lambda: du.ulysses_attention(torch.randn(1, 8, 8, 4), q, q),
        "not_dtensor_s2h": lambda: du.seq_to_head(torch.randn(1, 8, 8, 4)),
        "gqa_not_multiple": lambda: du.ulysses_attention(q, dt((1, 8, 3, 4)), dt((1, 8, 3, 4))),
        "head_to_seq_wrong": lambda: du.head_to_seq(q),
        "init_mesh_product": lambda: du.init_mesh(dp=3, sp=2),
        "init_mesh_dp_zero": lambda: du.init_mesh(dp=0),
        "init_mesh_sp_negative": lambda: du.init_mesh(dp=1, sp=-1),
        "init_mesh_dp_not_dividing": lambda: du.init_mesh(dp=3),
        "module_dtensor_input": lambda: du.UlyssesAttention(du.local_attention, mesh)(q, q, q),
        "module_heads": lambda: du.UlyssesAttention(du.local_attention, mesh)(
            torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
        ),
        "module_bad_mesh": lambda: du.UlyssesAttention(du.local_attention, "sp"),
        "flash_on_cpu": lambda: du.ulysses_attention(q, q, q, backend="flash_attn"),
        "unknown_backend": lambda: du.ulysses_attention(q, q, q, backend="xformers"),
        "dims_bound": lambda: _bound_dims_agree(mesh22),
        "dims_unbound": lambda: ParallelDims(2, 1, 2).sp_mesh,
        "dims_other_mesh": lambda: ParallelDims(dp=1, sp=4, mesh=mesh22),
    }
    out = []
    for name, fn in cases.items():
        try:
            fn()
            out.append({"name": name, "type": None, "msg": ""})
        except Exception as e:  # noqa: BLE001 - we report whatever was raised
            out.append({"name": name, "type": type(e).__name__, "msg": str(e)})
        dist.barrier()  # keep ranks in step so one rank's early error cannot skew the next case
    return out


def long_context_worker(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Uneven S, uneven heads and packed documents vs a per-document float64 reference.

    A case may carry ``docs``: per batch row, the document lengths (summing to S); the reference
    then runs attention on each document alone.
    """
    results = []
    for case in cases:
        mesh = get_mesh(case["dp"], case["sp"])
        sp_group = mesh.get_group("sp")
        placements = placements_for(mesh)
        q, k, v, go = make_inputs(case, torch.float64)
        B, S = case["B"], case["S"]
        docs = case.get("docs") or [[S]] * B

        q64, k64, v64 = (t.clone().requires_grad_() for t in (q, k, v))
        rows = []
        for b, lengths in enumerate(docs):
            pieces, lo = [], 0
            for n in lengths:
                sl = slice(lo, lo + n)
                pieces.append(
                    reference_attention(
                        q64[b : b + 1, sl], k64[b : b + 1, sl], v64[b : b + 1, sl],
                        causal=case["causal"],
                    )
                )  # fmt: skip
                lo += n
            rows.append(torch.cat(pieces, dim=1))
        o64 = torch.cat(rows, dim=0)
        o64.backward(go)

        def shard(t):
            return distribute_tensor(t, mesh, placements, src_data_rank=None)

        pos = None
        if case.get("docs"):
            pos_BS = torch.cat(
                [torch.cat([torch.arange(n) for n in lengths]).reshape(1, S) for lengths in docs]
            )
            pos = shard(pos_BS)
        # local leaves wrapped with from_local (as the model does): how DTensor *leaves* of an
        # uneven shard accumulate .grad differs across torch versions (2.11: Replicate)
        leaves = [shard(t).to_local().detach().requires_grad_() for t in (q, k, v)]
        qd, kd, vd = (
            DTensor.from_local(loc, mesh, placements, run_check=False, shape=t.shape,
                               stride=t.stride())
            for loc, t in zip(leaves, (q, k, v))
        )  # fmt: skip
        with du.CommCounter() as fwd:
            od = du.ulysses_attention(
                qd, kd, vd, causal=case["causal"], backend="sdpa", position_ids=pos,
                allow_uneven=True,
            )  # fmt: skip
        with du.CommCounter() as bwd:
            od.backward(shard(go))
        want = {
            "o": shard(o64.detach()).to_local(),
            "dq": shard(q64.grad).to_local(),
            "dk": shard(k64.grad).to_local(),
            "dv": shard(v64.grad).to_local(),
        }
        got = {"o": od.to_local(), "dq": leaves[0].grad, "dk": leaves[1].grad,
               "dv": leaves[2].grad}  # fmt: skip
        results.append(
            {
                "case": {kk: vv for kk, vv in case.items()},
                "local_S": qd.to_local().shape[1],
                "sp_rank": mesh.get_local_rank("sp"),
                "local_B": qd.to_local().shape[0],
                "errors": {
                    n: (got[n] - want[n]).abs().max().item() if want[n].numel() else 0.0
                    for n in want
                },  # fmt: skip
                "fwd": [(c.kind, c.bytes, c.group_name == sp_group.group_name) for c in fwd.calls],
                "bwd": [(c.kind, c.bytes, c.group_name == sp_group.group_name) for c in bwd.calls],
                "meta_ok": od.shape == qd.shape and od.placements == qd.placements,
            }
        )
    return results
