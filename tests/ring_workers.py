"""Per-rank functions for the ring attention tests (spawned processes import them by module path).

Each case runs ring attention alone (``api="ring"``) or Ulysses x Ring (``api="usp"``:
``UlyssesAttention(RingAttention(mesh), mesh)``) on a ``("dp", "ring", "sp")`` mesh, against the
float64 reference on the full tensors (per document when packed), forward and backward, and
records the collectives of each phase. The parent test asserts on the returned plain data.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtensor_ulysses.attention import RingAttention, UlyssesAttention, ring_attention
from dtensor_ulysses.debug import CommCounter
from dtensor_ulysses.plan import zigzag_positions
from tests.reference import reference_adamw, reference_attention

_MESHES: dict[tuple, DeviceMesh] = {}


def get_mesh(dp: int, ring: int, sp: int) -> DeviceMesh:
    key = (dp, ring, sp)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", key, mesh_dim_names=("dp", "ring", "sp"))
    return _MESHES[key]


def reference(q, k, v, go, causal, docs):
    """float64 reference output and gradients; with ``docs``, attention within each document."""
    q, k, v = (t.detach().double().clone().requires_grad_() for t in (q, k, v))
    if docs is None:
        o = reference_attention(q, k, v, causal=causal)
    else:
        S, rows = q.shape[1], []
        for b, starts in enumerate(docs):
            bounds = [*starts, S]
            rows.append(
                torch.cat(
                    [
                        reference_attention(
                            q[b : b + 1, lo:hi],
                            k[b : b + 1, lo:hi],
                            v[b : b + 1, lo:hi],
                            causal=causal,
                        )  # fmt: skip
                        for lo, hi in zip(bounds, bounds[1:])
                    ],
                    dim=1,
                )
            )
        o = torch.cat(rows, dim=0)
    o.backward(go.double())
    return o.detach(), q.grad, k.grad, v.grad


def _comm(counter: CommCounter, ring_pg, sp_pg) -> dict:
    return {
        "p2p": (counter.count("p2p", ring_pg), counter.bytes("p2p", ring_pg)),
        "p2p_recv": (counter.count("p2p_recv", ring_pg), counter.bytes("p2p_recv", ring_pg)),
        "a2a": (counter.count("all_to_all", sp_pg), counter.bytes("all_to_all", sp_pg)),
        "other": counter.count() - counter.count("p2p") - counter.count("p2p_recv")
        - counter.count("all_to_all"),
    }  # fmt: skip


def ring_worker(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    results = []
    for case in cases:
        dp, R, sp = case["dp"], case["ring"], case["sp"]
        mesh = get_mesh(dp, R, sp)
        d, r, p = mesh.get_coordinate()
        ring_pg, sp_pg = mesh.get_group("ring"), mesh.get_group("sp")
        B, S, N, K, H = (case[x] for x in ("B", "S", "N", "K", "H"))
        g = torch.Generator().manual_seed(case.get("seed", 0))
        q, k, v, go = (
            torch.randn(B, S, n, H, generator=g, dtype=torch.float64) for n in (N, K, K, N)
        )
        docs, causal = case.get("docs"), case["causal"]
        ref = reference(q, k, v, go, causal, docs)

        rows = slice(d * B // dp, (d + 1) * B // dp)
        pos = zigzag_positions(S, R, sp, r, p, case.get("order", "zigzag"))
        dtype = case.get("dtype", torch.float64)
        ql, kl, vl = (t[rows][:, pos].to(dtype).detach().requires_grad_() for t in (q, k, v))
        my_docs = None if docs is None else docs[rows]
        with CommCounter() as fwd:
            if case["api"] == "ring":
                assert sp == 1
                o = ring_attention(
                    ql, kl, vl, ring_pg, causal=causal, doc_starts=my_docs,
                    order=case.get("order", "zigzag"),
                )  # fmt: skip
            else:
                attn = UlyssesAttention(RingAttention(mesh, causal=not causal), mesh)
                # the call's causal overrides the module's default (checks kwargs pass through)
                o = attn(ql, kl, vl, causal=causal, doc_starts=my_docs, seq_len=S // R)
        with CommCounter() as bwd:
            o.backward(go[rows][:, pos].to(dtype))
        got = (o.detach(), ql.grad, kl.grad, vl.grad)
        errs = {
            name: (a.double() - b[rows][:, pos]).abs().max().item()
            for name, a, b in zip(("o", "dq", "dk", "dv"), got, ref)
        }
        results.append(
            {
                "coord": (d, r, p),
                "tokens": len(pos),
                "err": errs,
                "forward": _comm(fwd, ring_pg, sp_pg),
                "backward": _comm(bwd, ring_pg, sp_pg),
            }
        )
    return results


def bad_input_worker(rank: int, world_size: int) -> dict:
    """Messages of the errors a user can hit at run time."""
    out = {}
    mesh = get_mesh(1, world_size, 1)
    x = torch.zeros(1, 1, 2, 4)  # one token per ring rank: fewer than 2 x ring chunks
    try:
        ring_attention(x, x, x, mesh)
    except ValueError as e:
        out["short"] = str(e)
    y = torch.zeros(1, 2, 2, 4)  # 2 tokens per rank, but documents over a wrong length
    try:
        ring_attention(y, y, y, mesh, doc_starts=[[0, 2 * world_size]])
    except ValueError as e:
        out["docs"] = str(e)
    flat = init_device_mesh("cpu", (world_size,), mesh_dim_names=("sp",))
    try:
        RingAttention(flat)
    except ValueError as e:
        out["no_ring_axis"] = str(e)
    dist.barrier()
    return out


def world_worker(rank: int, world_size: int, cases: list[dict]) -> dict:
    """All cases, then the bad-input messages, in one world (starting a world costs seconds)."""
    return {
        "cases": ring_worker(rank, world_size, cases),
        "bad": bad_input_worker(rank, world_size),
    }


# ----------------------------------------------------------------------------------------------
# training: the tiny model through init_mesh(ring=) -> parallelize -> get_batch(ring=)
# ----------------------------------------------------------------------------------------------
def ring_training(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    """Each run: ``dp, ring, sp, steps`` and the config (``model, seq_len, batch_size, seed,
    lr, data, pack_docs``). Returns the first step's loss and full gradients and every step's
    loss (AdamW at a constant learning rate, clipping at 1.0; the trainer's step by hand)."""
    from torch.distributed.tensor import DTensor

    from dtensor_ulysses import train as du_train
    from dtensor_ulysses.data import PackedCorpus, get_batch
    from dtensor_ulysses.models import build_model, init_weights
    from dtensor_ulysses.parallel import flatten_dp_sp, init_mesh, mesh_ring, parallelize

    out = []
    for run in runs:
        dp, R, sp = run["dp"], run["ring"], run["sp"]
        mesh = init_mesh(dp, sp, ring=R, device_type="cpu")
        assert mesh_ring(mesh) == R
        model = build_model(run["model"], device="meta")
        parallelize(
            model, mesh, attention_backend=run.get("backend", "auto"),
            activation_checkpointing=run.get("activation_checkpointing", False),
            head_chunks=run.get("head_chunks", 1),
        )  # fmt: skip
        model.to_empty(device="cpu")
        init_weights(model, seed=run["seed"])
        opt = reference_adamw(model, run["lr"])
        dp_rank, sp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("sp")
        ring_rank = mesh.get_local_rank("ring") if R > 1 else 0
        group = flatten_dp_sp(mesh).get_group()
        assert dist.get_world_size(group) == world_size
        corpus = PackedCorpus.from_paths(run.get("data"), seq_len=run["seq_len"])
        losses, first = [], None
        for step in range(run["steps"]):
            batch = get_batch(
                corpus, step, global_batch_size=run["batch_size"], dp_rank=dp_rank, dp=dp,
                sp_rank=sp_rank, sp=sp, seed=run["seed"], pack_docs=run.get("pack_docs", False),
                ring=R, ring_rank=ring_rank,
            )  # fmt: skip
            local_sum, n_valid = du_train.forward_backward(model, batch, group)
            total = local_sum.reshape(1)
            dist.all_reduce(total, group=group)
            losses.append(total.item() / n_valid)
            if first is None:
                first = {
                    name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                    for name, p in model.named_parameters()
                }
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out.append({"layout": (dp, R, sp), "losses": losses, "grads": first})
    return out


def ring_bad_input(rank: int, world_size: int) -> dict:
    """The messages of bad degrees, a too-short sequence and ``position_ids`` with a ring."""
    from dtensor_ulysses.parallel import flatten_dp_sp, init_mesh

    msgs: dict = {}
    for key, kw in (("product", dict(dp=1, sp=3, ring=2)), ("sp_none", dict(dp=3, ring=2))):
        try:
            init_mesh(device_type="cpu", **kw)
        except ValueError as e:
            msgs[key] = str(e)
    mesh = init_mesh(1, 2, ring=2, device_type="cpu")
    flat = flatten_dp_sp(mesh)
    msgs["flatten"], msgs["world"] = list(flat.mesh_dim_names), flat.size()
    q = torch.randn(1, 1, 4, 8)
    try:  # S = 2 tokens over ring = 2: fewer than the 4 zigzag chunks
        ring_attention(q, q, q, mesh)
    except ValueError as e:
        msgs["short"] = str(e)
    q = torch.randn(1, 4, 4, 8)
    try:
        UlyssesAttention(RingAttention(mesh), mesh)(
            q, q, q, position_ids=torch.zeros(1, 4, dtype=torch.int64)
        )
    except ValueError as e:
        msgs["position_ids"] = str(e)
    return msgs
