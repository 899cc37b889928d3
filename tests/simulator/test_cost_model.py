"""Unit tests of the torch-free cost model (``simulations/``): hand-worked formulas, scaling laws,
published rows, planner, bad input and the command line. Fast: no process groups are spawned here
(see ``test_simulations_measured.py`` for the real-code comparison)."""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys

import pytest

import simulations as sim
from dtensor_ulysses.plan import ModelShape, get_shape
from simulations import activations, comm, flops, memory
from simulations.cli import main
from simulations.config import Workload
from simulations.published import ROWS, check_row

GiB = 2**30


def _w(model="llama3-8b", S=131072, **kw) -> Workload:
    return Workload(model, S, **kw)


# ----------------------------------------------------------------------------------------------
# torch-free import
# ----------------------------------------------------------------------------------------------
def test_import_predict_plan_do_not_import_torch():
    code = (
        "import sys, simulations as s\n"
        "s.predict('llama3-8b', 131072, dp=1, sp=8, gpu='h100')\n"
        "s.plan('llama3-8b', 8, 'h100')\n"
        "from simulations import published; published.check_all()\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------------------------
# communication: hand-worked cases
# ----------------------------------------------------------------------------------------------
def test_ulysses_bytes_hand_worked_llama3_8b():
    # s = 131072 / 8 = 16384 tokens, bf16; q,k,v: 16384 * (32 + 2*8) * 128 * 2; o: 16384*32*128*2
    qkv, o = 16384 * 48 * 128 * 2, 16384 * 32 * 128 * 2
    assert (qkv, o) == (201_326_592, 134_217_728)
    p = sim.predict(_w(sp=8, ac="full"))
    assert p.comm.per_layer["forward"]["all_to_all"] == qkv + o
    assert p.comm.per_layer["backward"]["all_to_all"] == qkv + o
    assert p.comm.per_layer["recompute"]["all_to_all"] == qkv + o
    assert p.comm.bytes_by_kind["all_to_all"] == 32 * 3 * (qkv + o) == 32_212_254_720
    assert p.comm.calls_by_kind["all_to_all"] == 32 * 3 * 2
    # wire: (P-1)/P of the buffer
    assert p.comm.wire_by_kind["all_to_all"] == pytest.approx(32 * 3 * (qkv + o) * 7 / 8)
    no_ac = sim.predict(_w(sp=8, ac="none"))
    assert no_ac.comm.bytes_by_kind["all_to_all"] == 32 * 2 * (qkv + o)


@pytest.mark.parametrize(
    "n_q, n_kv, sp, expected",
    [(32, 8, 8, 8), (32, 8, 16, 16), (32, 8, 32, 32), (8, 2, 4, 4), (8, 1, 4, 4), (12, 3, 4, 8),
     (6, 2, 3, 4), (8, 4, 2, 4), (64, 8, 16, 16), (32, 32, 8, 32)],
)  # fmt: skip
def test_gqa_replication_hand_worked(n_q, n_kv, sp, expected):
    assert comm.kv_heads_after_replication(n_q, n_kv, sp) == expected


def test_gqa_replication_matches_the_real_kv_head_index():
    from dtensor_ulysses.plan import kv_head_index

    for n_q in range(1, 25):
        for n_kv in (d for d in range(1, n_q + 1) if n_q % d == 0):
            for sp in range(1, n_q + 1):  # uneven head splits included
                idx = kv_head_index(n_q, n_kv, sp)
                want = n_kv if idx is None else len(idx)
                assert comm.kv_heads_after_replication(n_q, n_kv, sp) == want, (n_q, n_kv, sp)


def test_ulysses_gqa_replication_bytes():
    # llama3-8b at sp=16 > 8 kv heads: each rank is sent one kv head, K' = 16
    p = sim.predict(_w(S=65536, sp=16, ac="none"))
    s = 65536 // 16
    assert p.comm.per_layer["forward"]["all_to_all"] == s * (32 + 2 * 16) * 128 * 2 + s * 32 * 256


def test_megatron_sp_bytes_hand_worked():
    w = _w("gpt-7b", S=8192, sp=4, attention="megatron-sp", ac="none")
    shard, full = 1 * 2048 * 4096 * 2, 1 * 8192 * 4096 * 2
    items = {
        (c.kind, c.phase): c for c in comm.per_layer_attention(w) if c.what != "tp+sp norm grads"
    }
    assert items["all_gather", "forward"].bytes == 2 * shard
    assert items["reduce_scatter", "forward"].bytes == 2 * full
    assert items["all_gather", "backward"].bytes == 4 * shard  # conjugate + re-gather
    assert items["reduce_scatter", "backward"].bytes == 2 * full


def test_ring_bytes_hand_worked():
    w = _w("llama3-8b", S=65536, sp=4, attention="ring", ac="none")
    kv = 16384 * 2 * 8 * 128  # elements of one local k,v block
    by = {(c.what, c.phase): c for c in comm.per_layer_attention(w)}
    assert by["ring k,v", "forward"].bytes == 3 * kv * 2
    assert by["ring k,v", "backward"].bytes == 3 * kv * 2
    assert by["ring dk,dv", "backward"].bytes == 4 * kv * 4  # fp32 accumulators, P hops


def test_usp_splits_ulysses_and_ring():
    w = _w("llama3-8b", S=131072, sp=16, attention="usp", gpu="h100")
    assert (w.a2a_degree, w.ring_degree) == (8, 2)
    kinds = {c.kind for c in comm.per_layer_attention(w)}
    assert kinds == {"all_to_all", "p2p"}
    with pytest.raises(ValueError, match="ulysses_degree=3 does not divide sp=16"):
        _w("llama3-8b", sp=16, attention="usp", ulysses_degree=3)


def test_fsdp_bytes_hand_worked_tiny():
    # tiny: D=64, N=8, K=2, H=8, F=176, V=272, 2 layers; W=2 shards, bf16 params, fp32 reduce
    w = Workload("tiny", 64, dp=1, sp=2, ac="none")
    block = 64 * 64 + 16 * 64 + 16 * 64 + 64 * 64 + 3 * 176 * 64 + 64 + 64
    root = 272 * 64 + 64 + 272 * 64
    assert (block, root) == (44160, 34880)
    by = {(c.what, c.phase): c for c in comm.collectives(w)}
    ag_f = by["fsdp params", "forward"]
    assert (ag_f.calls, ag_f.bytes) == (3, (2 * block // 2 + root // 2) * 2)
    assert by["fsdp params", "backward"].bytes == 2 * block // 2 * 2
    rs = by["fsdp grads", "backward"]
    assert (rs.calls, rs.bytes) == (3, (2 * block + root) * 4)


def test_fsdp_padding_to_the_shard_count():
    # dim 0 of each parameter is padded to a multiple of the shard count
    shard, full = comm._padded_shard_numel([(10, 3), (7,)], 4)
    assert (shard, full) == (3 * 3 + 2, (3 * 3 + 2) * 4)


def test_nccl_bus_factors_and_wire_bytes():
    assert comm.bus_factor("all_reduce", 8) == 2 * 7 / 8
    assert comm.wire_bytes("all_gather", 100, 4) == 300  # (n-1) x the shard
    assert comm.wire_bytes("reduce_scatter", 400, 4) == 300
    assert comm.wire_bytes("all_to_all", 400, 4) == 300
    assert comm.wire_bytes("p2p", 123, 4) == 123


# ----------------------------------------------------------------------------------------------
# scaling laws
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["gpt-7b", "llama3-8b"])
def test_ulysses_bytes_per_rank_constant_when_S_and_P_grow_together(model):
    vals = {
        sim.predict(_w(model, S=16384 * P, sp=P, ac="none")).comm.per_layer["forward"]["all_to_all"]
        for P in (2, 4, 8)
    }
    assert len(vals) == 1


@pytest.mark.parametrize("P", [2, 4, 8, 16, 32])
def test_megatron_sp_sends_P_times_ulysses(P):
    def sent(attention):
        w = _w("gpt-7b", S=65536, sp=P, attention=attention, ac="none")
        return sum(
            c.wire_bytes
            for c in comm.per_layer_attention(w)
            if c.phase == "forward" and c.kind in ("all_to_all", "all_gather", "reduce_scatter")
        )

    assert sent("megatron-sp") == pytest.approx(P * sent("ulysses"), rel=1e-12)


def test_ring_bytes_per_rank_grow_with_P_at_fixed_tokens_per_rank():
    b = [
        sim.predict(
            _w("llama3-8b", S=8192 * P, sp=P, attention="ring", ac="none")
        ).comm.bytes_by_kind["p2p"]
        for P in (2, 4, 8)
    ]
    assert b[0] < b[1] < b[2]


def test_activation_memory_per_rank_scales_as_one_over_sp():
    one = memory.block_activation_bytes(_w(S=65536, sp=2))
    per_tok = sum(one.values())
    for P in (2, 4, 8):
        w = _w(S=65536, sp=P)
        assert sum(memory.block_activation_bytes(w).values()) * w.local_seq == pytest.approx(
            per_tok * 65536 / P
        )


# ----------------------------------------------------------------------------------------------
# uneven layouts (Ulysses): heads or sequence not divisible by sp, as the real code runs them
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n_q, sp, heads, imbalance",
    [(32, 6, [6, 6, 5, 5, 5, 5], 6 * 6 / 32), (32, 5, [7, 7, 6, 6, 6], 7 * 5 / 32),
     (32, 12, [3] * 8 + [2] * 4, 3 * 12 / 32), (6, 4, [2, 2, 1, 1], 2 * 4 / 6),
     (10, 4, [3, 3, 2, 2], 3 * 4 / 10), (3, 2, [2, 1], 2 * 2 / 3), (32, 8, [4] * 8, 1.0)],
)  # fmt: skip
def test_attention_imbalance_hand_worked(n_q, sp, heads, imbalance):
    w = Workload(ModelShape("m", 1, 8 * n_q, n_q, 1, 8, 64, 64), 64 * sp, sp=sp)
    assert list(w.heads.q_heads) == heads
    assert w.attention_imbalance == pytest.approx(imbalance, rel=1e-15)  # max / mean
    assert w.token_imbalance == 1.0


def test_uneven_sequence_split_and_token_imbalance():
    w = _w("tiny", S=37, sp=4)
    assert (w.seq_sizes, w.local_seq) == ([10, 10, 10, 7], 10)  # DTensor Shard(1)
    assert w.token_imbalance == pytest.approx(40 / 37)
    empty = _w("tiny", S=6, sp=4)
    assert (empty.seq_sizes, empty.token_imbalance) == ([2, 2, 2, 0], pytest.approx(8 / 6))
    assert _w("tiny", S=64, sp=4).token_imbalance == 1.0


def test_ulysses_uneven_heads_bytes_hand_worked():
    # N=10, K=2 (groups of 5 q heads) on P=4: q heads 3, 3, 2, 2; rank 1 holds q heads 3-5,
    # which use kv heads 0, 0, 1: one kv head per q head (3); the others 1 each: K' = 6.
    # B*s = 8 local tokens, T = 32, H = 8, fp32 (e = 4): the measured W=4 case, exactly.
    ranks = comm.ulysses_bytes_by_rank(10, 2, 8, 4, 8, 4)
    assert [r["forward_qkv"] for r in ranks] == [8 * (10 + 2 * 6) * 8 * 4] * 4  # 5632
    assert [r["forward_o"] for r in ranks] == [32 * n * 8 * 4 for n in (3, 3, 2, 2)]
    assert [r["backward_o"] for r in ranks] == [8 * 10 * 8 * 4] * 4  # 2560
    assert [r["backward_qkv"] for r in ranks] == [
        32 * (n + 2 * m) * 8 * 4 for n, m in ((3, 1), (3, 3), (2, 1), (2, 1))
    ]
    fwd = [r["forward_qkv"] + r["forward_o"] for r in ranks]
    bwd = [r["backward_o"] + r["backward_qkv"] for r in ranks]
    assert (fwd, bwd) == ([8704, 8704, 7680, 7680], [7680, 11776, 6656, 6656])
    # through a Workload: the records carry the busiest rank (1) and every rank's bytes
    w = Workload(ModelShape("m", 1, 80, 10, 2, 8, 8, 8), 32, sp=4, dtype="fp32", ac="none")
    assert comm.ulysses_busiest_rank(w) == 1
    by = {(c.what, c.phase): c for c in comm.per_layer_attention(w)}
    bq = by["ulysses q,k,v", "backward"]
    assert bq.bytes == 11776 - 2560 and bq.bytes_by_rank == (5120, 9216, 4096, 4096)
    assert by["ulysses q,k,v", "forward"].bytes_by_rank is None  # equal on every rank


def test_ulysses_uneven_sequence_bytes_hand_worked():
    # S=37 on P=4 -> 10, 10, 10, 7 tokens; B=2: B*s_r = 20, 20, 20, 14, T = 74; N=8, K=2, H=8, fp32
    ranks = comm.ulysses_bytes_by_rank(8, 2, 8, 4, [20, 20, 20, 14], 4)
    assert [r["forward_qkv"] for r in ranks] == [t * (8 + 2 * 4) * 32 for t in (20, 20, 20, 14)]
    assert {r["forward_o"] for r in ranks} == {74 * 2 * 32}
    assert [r["backward_o"] for r in ranks] == [t * 8 * 32 for t in (20, 20, 20, 14)]
    assert {r["backward_qkv"] for r in ranks} == {74 * (2 + 2 * 1) * 32}
    assert [r["forward_qkv"] + r["forward_o"] for r in ranks] == [14976] * 3 + [11904]
    assert [r["backward_o"] + r["backward_qkv"] for r in ranks] == [14592] * 3 + [13056]
    w = Workload(ModelShape("m", 1, 64, 8, 2, 8, 8, 8), 37, sp=4, micro_batch=2, dtype="fp32",
                 ac="none")  # fmt: skip
    assert comm.ulysses_rank_tokens(w) == [20, 20, 20, 14]
    assert comm.ulysses_busiest_rank(w) == 0
    fwd = sum(c.bytes for c in comm.per_layer_attention(w) if c.phase == "forward")
    assert fwd == 14976
    # an empty rank (S=6 on 4: 2, 2, 2, 0 tokens) still attends with its head over all S
    empty = comm.ulysses_bytes_by_rank(4, 4, 8, 4, [2, 2, 2, 0], 4)
    assert empty[3] == {"forward_qkv": 0, "forward_o": 6 * 32, "backward_qkv": 6 * 3 * 32,
                        "backward_o": 0}  # fmt: skip


def test_uneven_heads_scale_attention_time_by_the_imbalance():
    p = sim.predict(_w(S=98304, sp=6))  # 32 heads on 6 ranks: 6, 6, 5, 5, 5, 5
    w, g = p.workload, p.workload.gpu
    even_att = p.flops.attention_hw / 6 / (g.peak_flops * g.attention_efficiency)
    even_mm = p.flops.matmul_hw / 6 / (g.peak_flops * g.matmul_efficiency)
    assert p.attention_imbalance == w.attention_imbalance == 1.125
    assert p.time.attention == pytest.approx(even_att * 1.125)
    assert p.time.matmul == pytest.approx(even_mm)  # 98304 = 6 * 16384: tokens are even
    assert p.time.imbalance == pytest.approx(even_att * 0.125)
    # an uneven sequence slows the matmuls of the rank holding ceil(S/P) tokens
    q = sim.predict(_w(S=131073, sp=8))
    mm = q.flops.matmul_hw / 8 / (g.peak_flops * g.matmul_efficiency)
    assert q.time.matmul == pytest.approx(mm * 16385 * 8 / 131073)
    assert q.attention_imbalance == 1.0 and q.time.imbalance == pytest.approx(q.time.matmul - mm)
    # GQA on sp=6: no rank's q heads use whole kv groups evenly -> one kv head per q head (K'=32)
    assert w.heads.kv_heads == [6, 6, 5, 5, 5, 5]
    assert p.comm.per_layer["forward"]["all_to_all"] == 16384 * (32 + 64) * 256 + 98304 * 6 * 256


def test_uneven_heads_memory_is_the_busiest_ranks():
    # N=10, K=2 on sp=4: q heads 3, 3, 2, 2, kv heads 1, 3, 1, 1; every rank 1024 tokens of 4096
    shape = ModelShape("odd", 2, 640, 10, 2, 64, 1024, 1000)
    w = Workload(shape, 4096, sp=4, ac="none")
    geo = memory.rank_geometries(w)
    assert [(g.ranks, g.tokens, g.att_tokens, g.q_heads, g.kv_heads) for g in geo] == [
        ((0,), 1024, 4096, 3, 1), ((1,), 1024, 4096, 3, 3), ((2, 3), 1024, 4096, 2, 1)]  # fmt: skip
    saved = memory.block_saved_bytes(w, geo[1])
    assert saved["attention_qkv"] == 2 * (3 + 2 * 3) * 64 * 4096  # the kernel's q, k, v
    assert saved["attention_out"] == (2 * 64 + 4) * 3 * 4096  # o + fp32 logsumexp
    assert saved["o_proj_input"] == 2 * 640 * 1024  # sequence-sharded, all heads
    stages = activations.block_backward_transients(w, geo[1])
    # d(q,k,v) all-to-all: head-sharded grads + send buffer, receive buffer + outputs (K' = 6)
    assert stages["all_to_all_buffers"] == 2 * 2 * 9 * 64 * 4096 + 2 * 2 * 22 * 64 * 1024
    assert stages["attention_working"] == (2 + 4) * 3 * 64 * 4096 + 2 * 9 * 64 * 4096
    rank0 = activations.block_backward_transients(w, geo[0])  # kv < q: FA2's per-q-head dK, dV
    assert rank0["attention_working"] == ((2 + 4) * 3 + 2 * 5 + 2 * 2 * 3) * 64 * 4096
    est = memory.estimate(w)
    p0, p1, p2, p3 = est.peak_by_rank
    assert est.rank == 1 and est.peak == p1 > p0 > p2 == p3
    per_tok = memory.block_activation_bytes(w)  # of the busiest rank, per local token
    assert sum(per_tok.values()) * 1024 == pytest.approx(sum(saved.values()))
    even = memory.estimate(_w(sp=8))
    assert even.rank == 0 and set(even.peak_by_rank) == {even.peak}


def test_pack_docs_adds_no_communication():
    """The trainer passes the step's layout (document starts) to every layer: no position ids
    travel, so packed documents cost exactly the communication of one long sequence."""
    plain = sim.predict(_w(sp=8))
    packed = sim.predict(_w(sp=8, pack_docs=True))
    assert packed.comm.per_layer == plain.comm.per_layer
    assert packed.comm.calls_by_kind == plain.comm.calls_by_kind
    odd = sim.predict(_w(S=131073, sp=8, pack_docs=True, ac="none"))
    assert not [c for c in odd.comm.items if "position" in c.what]


def test_predict_json_reports_the_imbalance_and_every_rank(capsys):
    argv = shlex.split("predict --model llama3-8b --seq-len 98304 --sp 6 --gpu h100 --json")
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["attention_imbalance"] == 1.125 and d["token_imbalance"] == 1.0
    ranks = d["per_sp_rank"]
    assert ranks["q_heads"] == [6, 6, 5, 5, 5, 5] and ranks["tokens"] == [16384] * 6
    assert [r["forward_o"] for r in ranks["all_to_all_bytes_per_layer"]] == [
        98304 * n * 128 * 2 for n in ranks["q_heads"]]  # fmt: skip
    assert ranks["comm_rank"] == 0 and len(ranks["memory_peak_bytes"]) == 6
    o_fwd = next(c for c in d["collectives"]
                 if c["what"] == "ulysses o" and c["phase"] == "forward")  # fmt: skip
    assert o_fwd["bytes_by_rank"] == [98304 * n * 256 for n in (6, 6, 5, 5, 5, 5)]
    assert o_fwd["bytes"] == max(o_fwd["bytes_by_rank"])
    assert main(argv[:-1]) == 0  # the table
    out = capsys.readouterr().out
    assert "attention imbalance 1.125x" in out and "Uneven layout, per sp rank" in out
    assert main(argv[:-1] + ["--sp", "8", "--json"]) == 0
    even = json.loads(capsys.readouterr().out)
    assert even["attention_imbalance"] == 1.0
    assert all("bytes_by_rank" not in c for c in even["collectives"])


def test_plan_considers_sp_not_dividing_the_heads():
    # 12 GPUs, 32 heads: sp = 3, 6, 12 split the heads unevenly; they run, slower per rank
    pl = sim.plan("llama3-8b", 12, "h100", seq_len=65536)
    pure = [x for x in pl.layouts if x.ring == 1]  # the Ulysses x Ring rows have their own tests
    by_sp = {x.sp: x for x in pure}
    assert all(x.valid for x in pl.layouts) and sorted(by_sp) == [1, 2, 3, 4, 6, 12]
    assert {sp: by_sp[sp].attention_imbalance for sp in (3, 6, 12)} == {
        3: 11 * 3 / 32, 6: 1.125, 12: 1.125}  # fmt: skip
    why6 = by_sp[6].why
    assert "attention load imbalance of 1.125x: ranks attend with 6 or 5 of 32 heads" in why6
    assert "s per step" in why6
    order = [x.sp for x in pure]
    fitting_balanced = [sp for sp in (2, 4) if by_sp[sp].fits]
    assert fitting_balanced
    for sp in (3, 6, 12):  # every imbalanced layout ranks below the balanced ones that fit
        assert all(order.index(sp) > order.index(b) for b in fitting_balanced)
    assert pl.to_dict()["layouts"][0]["attention_imbalance"] == 1.0


# ----------------------------------------------------------------------------------------------
# memory and FLOPs: hand-worked
# ----------------------------------------------------------------------------------------------
def test_block_activation_bytes_hand_worked_llama3_8b():
    # RMSNorm (_layers.py's autograd function): its bf16 input (2) + the bf16 output the next
    # matmul keeps (2) per element, twice; FlashAttention q,k,v,o + fp32 logsumexp; o again (the
    # all-to-all output); SwiGLU 4 x F
    b = memory.block_activation_bytes(_w(sp=8))
    assert b["attention_norm"] == b["mlp_norm"] == 4 * 4096
    assert b["attention_qkv"] == 2 * (32 + 16) * 128
    assert b["attention_out"] == 2 * 4096 + 4 * 32
    assert b["o_proj_input"] == 2 * 4096
    assert b["mlp"] == 4 * 2 * 14336
    assert sum(b.values()) == 225_408 - 2 * 6 * 4096
    assert memory.block_activation_bytes(_w(sp=1))["o_proj_input"] == 0
    assert memory.block_activation_bytes(_w(sp=8, tiled_mlp=True))["mlp"] == 0


def test_model_states_fsdp2():
    w = _w(sp=8)
    p = memory.estimate(w)
    n = get_shape("llama3-8b").n_params / 8
    assert p.components["parameters"] == pytest.approx(4 * n)
    assert p.components["optimizer_states"] == pytest.approx(8 * n)
    off = memory.estimate(w.with_(offload_optimizer=True))
    assert off.components["optimizer_states"] == 0
    # HostOffloadAdamW: fp32 master, gradient buffer, exp_avg, exp_avg_sq (16) + the CPU step's
    # fp32 temporary (4) on the host, as traced
    assert off.cpu_bytes == pytest.approx(20 * n)


def test_checkpointing_and_offload_reduce_activation_memory():
    full = memory.estimate(_w(S=262144, sp=8))
    none = memory.estimate(_w(S=262144, sp=8, ac="none"))
    assert full.peak < none.peak
    off = memory.estimate(_w(S=262144, sp=8, offload_activations=True))
    assert off.components["activations_checkpoints"] < full.components["activations_checkpoints"]
    tiled = memory.estimate(_w(S=262144, sp=8, tiled_loss=True))
    assert tiled.peak < full.peak


def test_model_flops_match_the_real_models_convention():
    from dtensor_ulysses.models import model_flops_per_token

    for name, S in (("llama3-8b", 131072), ("qwen3-4b", 8192), ("llama3-1b", 4096)):
        shape = get_shape(name)
        fl = flops.count(shape, S, 1, recompute=False)
        assert fl.model / S == pytest.approx(model_flops_per_token(shape, S), rel=1e-12)


def test_megatron_formula_rebuilt_op_by_op():
    for args in ((1, 2048, 96, 12288, 51200), (2, 8192, 32, 4096, 50304)):
        assert flops.gpt_block_flops(*args) == pytest.approx(flops.megatron_flops(*args), 1e-12)


def test_time_and_mfu_are_sane():
    p = sim.predict(_w(sp=8))
    assert 0 < p.mfu < 1
    assert p.step_time_s == pytest.approx(p.time.compute + p.time.comm_exposed)
    assert p.tokens_per_s == pytest.approx(131072 / p.step_time_s)
    # attention efficiency stays under the FlashAttention-2 ceiling (row T3)
    assert p.workload.gpu.peak_flops * p.workload.gpu.attention_efficiency <= 335e12
    # an sp group across nodes pays the NIC: slower than inside one node
    intra = sim.predict(_w(S=262144, sp=8)).time.comm_total
    inter = sim.predict(_w(S=262144, sp=16)).time.comm_total
    assert inter > intra


# ----------------------------------------------------------------------------------------------
# published rows: one test per row
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("row", list(ROWS))
def test_published_row(row):
    checks = check_row(row)
    assert checks
    failing = [c for c in checks if c.status == "fail"]
    assert not failing, failing


def test_c1_and_c2_are_exact():
    for c in check_row("C1"):
        assert c.status == "pass" and c.published == c.predicted, c
    c2 = {c.item: c for c in check_row("C2")}
    assert c2["Ulysses MHA (x bs L d)"].status == "pass"
    assert c2["Ulysses GQA G=4"].status == "pass"
    assert c2["Megatron TP-sp"].predicted == "10"
    # Ring differs only by the backward k,v pass the publication does not count
    assert "without the backward k,v pass: 4)" in c2["Ring MHA (x bs L d)"].predicted


# ----------------------------------------------------------------------------------------------
# planner
# ----------------------------------------------------------------------------------------------
def test_plan_ranks_sp8_first_for_llama3_8b_on_8_gpus():
    pl = sim.plan("llama3-8b", 8, "h100")
    assert [(x.dp, x.sp) for x in pl.layouts][0] == (1, 8)
    lens = {x.sp: x.max_seq_len for x in pl.layouts}
    assert lens[8] > lens[4] > lens[2] > lens[1] > 0
    assert all(x.why for x in pl.layouts)
    best = sim.predict("llama3-8b", lens[8], dp=1, sp=8, gpu="h100")
    assert best.fits
    assert not sim.predict("llama3-8b", lens[8] + 8 * 256, dp=1, sp=8, gpu="h100").fits


def test_plan_with_a_target_sequence_and_invalid_layouts():
    pl = sim.plan("llama3-8b", 64, "h100", seq_len=1_048_576, tiled_loss=True)
    assert pl.best is not None and pl.best.fits
    invalid = [x for x in pl.layouts if not x.valid]
    assert [x.sp for x in invalid] == [64] and "the largest valid sp is 32" in invalid[0].why
    losers = [x for x in pl.layouts[1:] if x.valid and not x.fits]
    assert losers and all("does not fit" in x.why for x in losers)


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(sp=48),
            r"sp=48 exceeds the 32 q heads .* the largest valid sp is 32 \(sp in "
            r"\{1, 2, 4, 8, 16, 32\} split the heads evenly\)",
        ),
        (dict(model="llama3-9b"), "unknown model preset 'llama3-9b'; choose one of"),
        (dict(S=-5), "seq_len=-5 must be a positive integer"),
        (dict(dp=0), "dp=0 must be a positive integer"),
        (dict(micro_batch=-1), "micro_batch=-1 must be a positive integer"),
        (dict(S=1000, sp=16, attention="ring"), "seq_len=1000 tokens are not divisible by sp=16"),
        (dict(S=1001, sp=8, attention="megatron-sp"), "or use attention='ulysses'"),
        (dict(sp=8, attention="ring", pack_docs=True), "pack_docs is modeled for attention="),
        (dict(sp=4, gpus=8), r"gpus=8 but dp \* sp = 1 \* 4 = 4"),
        (dict(gpu="h300"), "unknown GPU profile 'h300'; choose one of h100"),
        (dict(sp=16, attention="megatron-sp"), "megatron-sp needs tp=sp=16 to divide"),
        (dict(ac="selective"), "ac='selective' is not supported"),
        (dict(offload_activations=True, ac="none"), "needs ac='full'"),
    ],
)
def test_bad_input_is_a_clear_value_error(kwargs, message):
    model = kwargs.pop("model", "llama3-8b")
    S = kwargs.pop("S", 131072)
    with pytest.raises(ValueError, match=message):
        sim.predict(model, S, **kwargs)


def test_bad_plan_input():
    with pytest.raises(ValueError, match="gpus=0 must be a positive integer"):
        sim.plan("llama3-8b", 0)
    with pytest.raises(ValueError, match="plan chooses sp itself"):
        sim.plan("llama3-8b", 8, sp=2)


def test_custom_shape_is_accepted():
    shape = ModelShape("mine", 4, 1024, 16, 4, 64, 4096, 32000)
    p = sim.predict(shape, 65536, sp=8, gpu="a100-80gb")
    assert p.memory.peak > 0 and math.isfinite(p.step_time_s)


# ----------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------
def test_cli_predict_json_keys(capsys):
    rc = main(
        shlex.split("predict --model llama3-8b --seq-len 131072 --dp 1 --sp 8 --gpu h100 --json")
    )
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert set(d["comm_bytes"]) == {
        "all_to_all",
        "all_gather",
        "reduce_scatter",
        "all_reduce",
        "p2p",
    }
    assert d["comm_bytes"]["all_to_all"] == 32_212_254_720
    mem = d["memory_bytes"]
    assert abs(mem["peak"] - sum(v for k, v in mem.items() if k != "peak")) <= len(mem)
    for key in ("step_time_s", "tflops_per_gpu", "mfu", "tokens_per_s"):
        assert isinstance(d[key], float) and d[key] > 0


def test_cli_predict_all_flags(capsys):
    argv = shlex.split(
        "predict --model qwen3-4b --seq-len 65536 --dp 2 --sp 4 --gpu a100-80gb --gpus 8 "
        "--micro-batch 2 --dtype bf16 --ac full --offload-optimizer --offload-activations "
        "--tiled-mlp --tiled-loss --attention usp --json"
    )
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["inputs"]["attention"] == "usp" and d["inputs"]["offload_optimizer"] is True
    assert main(argv[:-1] + ["--offload-params"]) == 0  # human-readable table
    out = capsys.readouterr().out
    assert "Communication per rank per step" in out and "MFU" in out


def test_cli_plan_json(capsys):
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert {"layouts", "best"} <= set(d)
    for lay in d["layouts"]:
        assert {"dp", "sp", "max_seq_len", "tokens_per_s"} <= set(lay)
    assert d["best"]["sp"] == 8


def test_cli_compare_and_published(capsys):
    assert main(shlex.split("compare --model llama3-8b --seq-len 131072 --sp 8 --gpu h100")) == 0
    out = capsys.readouterr().out
    for m in sim.METHODS:
        assert m in out
    assert main(["published", "--row", "C1", "--json"]) == 0
    assert all(c["status"] == "pass" for c in json.loads(capsys.readouterr().out))


@pytest.mark.parametrize(
    "argv, message",
    [
        ("predict --model llama3-8b --seq-len 131072 --sp 64", "the largest valid sp is 32"),
        ("predict --model nope --seq-len 8 --sp 1", "unknown model preset 'nope'"),
        ("predict --model llama3-8b --seq-len -1 --sp 1", "seq_len=-1 must be a positive"),
        ("plan --model llama3-8b --gpus 8 --gpu tpu", "unknown GPU profile 'tpu'"),
    ],
)
def test_cli_bad_input_exits_2_without_traceback(argv, message):
    r = subprocess.run([sys.executable, "-m", "simulations", *argv.split()],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


def test_cli_plot_without_or_with_matplotlib(tmp_path, capsys):
    png = tmp_path / "p.png"
    argv = f"predict --model tiny --seq-len 256 --sp 2 --gpu h100 --plot {png}".split()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert main(argv) == 2
        assert "needs matplotlib" in capsys.readouterr().err
    else:
        assert main(argv) == 0 and png.stat().st_size > 0


def test_plan_plot_draws_the_hybrid_rows(tmp_path):
    """``plan --plot`` draws every valid row, the planner's Ulysses x Ring rows included (as USP
    over ``sp * ring`` ranks), one memory curve per row."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from simulations import plots
    from simulations.planner import plan

    pl = plan("llama3-8b", 32, "h100")
    hybrid = [x for x in pl.layouts if x.valid and x.ring > 1]
    assert hybrid, "the planner proposes Ulysses x Ring on 32 GPUs (kv heads cap sp at 8)"
    drawn = []
    real_savefig = plt.Figure.savefig

    def savefig(fig, path, **kw):
        drawn.extend(line.get_label() for line in fig.axes[1].get_lines())
        return real_savefig(fig, path, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plt.Figure, "savefig", savefig)
        plots.plot_plan(pl, str(tmp_path / "plan.png"))
    for x in pl.layouts:
        if x.valid:
            assert f"dp={x.dp} {x.label}" in drawn, (x.label, drawn)
    assert (tmp_path / "plan.png").stat().st_size > 0


def test_trace_find_max_search_settles_on_the_grid(monkeypatch):
    # the search alone, with a stand-in trace whose peak is a + b * S (no torch): it must return
    # the largest multiple of the grid that fits, with few probes
    from simulations import _trace
    from simulations.hardware import get_gpu

    cap = get_gpu("h100").usable_bytes

    class Fake:
        def __init__(self, s):
            self.device_peak_bytes = 20 * 2**30 + 40_000 * s + (s // 7919) % 3  # not exactly linear
            self.host_bytes, self.traced_layers = 0, (32,)

        def to_dict(self):
            return {"device_peak_bytes": self.device_peak_bytes, "phases": {}}

    monkeypatch.setattr(_trace, "trace", lambda case: Fake(case.seq_len))
    case = _trace.TraceCase("llama3-8b", 8192, 1, 8)
    g = 8192
    best, probes, rep = _trace.find_max(case, granularity=g)
    assert best % g == 0 and Fake(best).device_peak_bytes <= cap < Fake(best + g).device_peak_bytes
    assert rep is not None and rep["seq_len"] == best and len(probes) <= 8
    for start in (g, 64 * g, 10_000 * g):  # a bad starting guess still converges
        assert _trace.find_max(case, granularity=g, start=start)[0] == best


def test_cli_trace_bad_input(capsys):
    from simulations.cli import main

    assert main(["trace", "--model", "llama3-8b", "--sp", "8"]) == 2
    assert "--find-max" in capsys.readouterr().err
    assert main(["trace", "--model", "llama3-8b", "--sp", "8", "--find-max", "--seq-len", "8"]) == 2
    assert main(["trace", "--model", "llama3-8b", "--seq-len", "8192", "--layers", "2"]) == 2
    assert "at least 5 blocks" in capsys.readouterr().err
    assert main(["trace", "--model", "llama3-8b", "--seq-len", "8192", "--sp", "8",
                 "--head-chunks", "3"]) == 2  # fmt: skip
    assert "head_chunks=3" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Ulysses x Ring (USP): one closed form with the library, and the planner's hybrid rows
# ----------------------------------------------------------------------------------------------
def test_usp_ring_p2p_bytes_hand_worked_equal_the_library_closed_form():
    # llama3-8b (K=8 kv heads, H=128), S=131072 over sp=8 (Ulysses) x ring=4, bf16, B=1. After the
    # all-to-all a rank holds S/ring = 32768 tokens of K/sp = 1 kv head, so one k,v block is
    # kv = 1 * 32768 * 2 * 1 * 128 = 8,388,608 elements. ring_closed_form, by hand:
    #   forward  ring-1 = 3 sends of kv*2 bytes:             3 * 16,777,216 = 50,331,648
    #   backward 3 k,v sends (kv*2) + 4 dk,dv sends (kv*4): 50,331,648 + 134,217,728 = 184,549,376
    w = _w("llama3-8b", S=131072, sp=32, attention="usp", ulysses_degree=8, ac="none")
    assert (w.a2a_degree, w.ring_degree) == (8, 4)
    p2p = [c for c in comm.per_layer_attention(w) if c.kind == "p2p"]
    by_phase = {ph: [c for c in p2p if c.phase == ph] for ph in ("forward", "backward")}
    assert sum(c.calls for c in by_phase["forward"]) == 3
    assert sum(c.bytes for c in by_phase["forward"]) == 50_331_648
    assert sum(c.calls for c in by_phase["backward"]) == 7
    assert sum(c.bytes for c in by_phase["backward"]) == 184_549_376
    assert {c.group: c.span for c in p2p} == {"ring": 32}  # the ring spans 4 nodes of 8
    # per step: 32 layers, no recompute (ac="none")
    p = sim.predict("llama3-8b", 131072, sp=32, attention="usp", ulysses_degree=8, ac="none")
    assert p.comm.bytes_by_kind["p2p"] == 32 * (50_331_648 + 184_549_376)
    assert p.comm.calls_by_kind["p2p"] == 32 * (3 + 7)


def test_usp_ring_sees_the_busiest_ranks_kv_heads():
    # 6 q heads, 2 kv heads (groups of 3) over a Ulysses degree of 3: rank 1 holds q heads 2, 3,
    # which use kv heads 0 and 1, so its kernel sees 2 kv heads (the others 1); K'/u would be 1.
    # ring 2, S=1200: 600 tokens per ring rank, H=64, bf16: kv = 600 * 2 * 2 * 64 = 153,600.
    shape = ModelShape("odd", 2, 384, 6, 2, 64, 1024, 1000)
    w = Workload(shape, 1200, sp=6, attention="usp", ulysses_degree=3, ac="none")
    assert list(w.heads.kv_heads) == [1, 2, 1]
    fwd = [c for c in comm.per_layer_attention(w) if c.kind == "p2p" and c.phase == "forward"]
    assert [(c.calls, c.bytes) for c in fwd] == [(1, 153_600 * 2)]


def test_plan_proposes_ulysses_x_ring_for_llama3_8b_on_32_gpus():
    pl = sim.plan("llama3-8b", 32, "h100")
    by = {(x.dp, x.sp, x.ring): x for x in pl.layouts}
    hybrid, pure = by[1, 8, 4], by[1, 32, 1]
    assert hybrid.valid and hybrid.max_seq_len > 0
    assert "Ulysses x Ring: all-to-all over sp=8 in a node, ring of 4 across nodes" in hybrid.why
    # pure Ulysses at sp=32 > 8 kv heads replicates them (the simulator's K'), and spans 4 nodes
    assert pure.valid and "kv heads replicated (sp=32 > 8 kv heads): 32 travel, not 8" in pure.why
    assert "all-to-all across 4 nodes" in pure.why
    assert pl.layouts.index(hybrid) < pl.layouts.index(pure)
    assert hybrid.tokens_per_s > pure.tokens_per_s
    # no hybrid where pure Ulysses is clean: sp <= 8 (in a node, K' = K)
    assert {(x.dp, x.sp, x.ring) for x in pl.layouts if x.ring > 1} == {(1, 8, 4), (2, 8, 2)}
    d = pl.to_dict()
    assert {(x["dp"], x["sp"], x["ring"]) for x in d["layouts"]} >= {(1, 8, 4), (1, 32, 1)}
    # past the q heads the hybrid is the only option: 64 GPUs, sp=64 > 32 q heads
    pl64 = sim.plan("llama3-8b", 64, "h100")
    (bad,) = [x for x in pl64.layouts if not x.valid]
    assert (bad.sp, bad.ring) == (64, 1)
    assert "Ulysses x Ring runs it: sp=8 x ring=8" in bad.why
    assert any((x.dp, x.sp, x.ring) == (1, 8, 8) and x.valid for x in pl64.layouts)
    assert sim.plan("llama3-8b", 32, "h100", hybrid=False).layouts[0].ring == 1


def test_hybrid_wins_when_the_all_to_all_would_cross_nodes():
    # gpt-7b is MHA (32 kv heads): pure Ulysses at sp=16 replicates nothing, but its all-to-all
    # spans 2 nodes of 8 at one NIC's rate; sp=8 x ring=2 keeps it on NVLink and rings across.
    def ratio(gpu):
        pl = sim.plan("gpt-7b", 16, gpu)
        by = {(x.dp, x.sp, x.ring): x for x in pl.layouts}
        hybrid, pure = by[1, 8, 2], by[1, 16, 1]
        assert hybrid.max_seq_len == pure.max_seq_len and hybrid.eval_seq_len == pure.eval_seq_len
        return pl, hybrid, pure, hybrid.tokens_per_s / pure.tokens_per_s

    pl, hybrid, pure, r = ratio("h100")
    assert (pl.best.dp, pl.best.sp, pl.best.ring) == (1, 8, 2)
    assert "kv heads replicated" not in pure.why and "all-to-all across 2 nodes" in pure.why
    assert r > 1.05  # 13% in the model
    assert pure.prediction.time.comm_exposed > 3 * hybrid.prediction.time.comm_exposed
    # the win is the inter-node all-to-all: with NVLink-speed links across nodes it nearly vanishes
    g = sim.get_gpu("h100")
    *_, r_flat = ratio(g.with_(inter_bw=g.intra_bw, inter_latency_s=g.intra_latency_s))
    assert 1.0 <= r_flat < 1.01


def test_cli_output_into_a_closed_pipe_leaves_quietly():
    """``python -m simulations published | head -1``: no BrokenPipeError traceback, status 141."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "simulations", "published"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) in (0, 141), err[-2000:]
    assert "Traceback" not in err and "BrokenPipe" not in err, err[-2000:]


def test_plan_says_nothing_fits_and_suggests_the_memory_options():
    """``plan --seq-len 10000000`` for llama3-8b on 8x H100: no row is called best; the first
    says that nothing fits and which options reach how far (computed, not assumed)."""
    from simulations.planner import plan

    pl = plan("llama3-8b", 8, "h100", seq_len=10_000_000)
    assert not any(x.fits for x in pl.layouts)
    why = pl.layouts[0].why
    assert why.startswith("nothing fits 10,000,000 tokens") and "best" not in why, why
    assert "with --tiled-loss" in why and "it reaches" in why, why
    tiled = plan("llama3-8b", 8, "h100", tiled_loss=True, tiled_mlp=True,
                 offload_activations=True, offload_optimizer=True)  # fmt: skip
    assert f"reaches {tiled.layouts[0].max_seq_len / 2**20:.2f}M" in why, (why, tiled.layouts[0])


def test_trace_find_max_reports_the_length_within_the_headroom(monkeypatch, capsys):
    """``trace --find-max`` (a stand-in linear trace, no torch): the zero-slack length and, next
    to it, the longest whose peak stays within 90% of the usable memory, each on the grid."""
    from simulations import _trace
    from simulations.cli import main
    from simulations.hardware import get_gpu

    cap = get_gpu("h100").usable_bytes

    class Fake:
        def __init__(self, s):
            self.device_peak_bytes = 20 * 2**30 + 40_000 * s
            self.host_bytes, self.traced_layers = 0, (32,)

        def to_dict(self):
            return {"device_peak_bytes": self.device_peak_bytes, "phases": {}}

    monkeypatch.setattr(_trace, "trace", lambda case: Fake(case.seq_len))
    args = ["trace", "--model", "llama3-8b", "--sp", "8", "--find-max", "--json"]
    assert main(args) == 0
    obj = json.loads(capsys.readouterr().out)
    g, full, within = obj["granularity"], obj["max_seq_len"], obj["max_seq_len_with_headroom"]
    assert Fake(full).device_peak_bytes <= cap < Fake(full + g).device_peak_bytes
    assert Fake(within).device_peak_bytes <= 0.9 * cap < Fake(within + g).device_peak_bytes
    assert obj["headroom"] == 0.9 and within < full
    assert main([*args, "--headroom", "1"]) == 0
    assert "max_seq_len_with_headroom" not in json.loads(capsys.readouterr().out)
    assert main([*args, "--headroom", "0"]) == 2


def test_trace_find_max_bounded_by_host_memory(monkeypatch, capsys):
    """``trace --find-max --host-memory GIB`` (a stand-in linear trace, no torch): the longest
    length fits both memories, the report says which binds, and without the host budget (or with
    one that does not bind) the device length comes back, the device named as binding."""
    from simulations import _trace
    from simulations.cli import main
    from simulations.hardware import get_gpu

    cap = get_gpu("h100").usable_bytes

    class Fake:
        def __init__(self, s):
            self.device_peak_bytes = 20 * 2**30 + 10_000 * s
            self.host_bytes, self.traced_layers = 12 * 2**30 + 30_000 * s, (32,)

        def to_dict(self):
            phase = {"device_peak_bytes": self.device_peak_bytes, "by_category": {"other": 0}}
            return {"device_peak_bytes": self.device_peak_bytes, "phases": {"backward": phase},
                    "layers": 32, "traced_layers": [32], "peak_phase": "backward"}  # fmt: skip

    monkeypatch.setattr(_trace, "trace", lambda case: Fake(case.seq_len))
    args = ["trace", "--model", "llama3-8b", "--sp", "8", "--find-max", "--json"]
    assert main(args) == 0
    free = json.loads(capsys.readouterr().out)
    g, dev_max = free["granularity"], free["max_seq_len"]
    assert Fake(dev_max).device_peak_bytes <= cap < Fake(dev_max + g).device_peak_bytes
    assert free["binding"] == "device" and "host_capacity_bytes" not in free

    host = 64 * 2**30  # binds: at the device's longest length the host holds ~180 GiB
    assert main([*args, "--host-memory", "64"]) == 0
    obj = json.loads(capsys.readouterr().out)
    best = obj["max_seq_len"]
    assert best % g == 0 and best < dev_max
    assert Fake(best).host_bytes <= host < Fake(best + g).host_bytes
    assert obj["binding"] == "host" and obj["host_capacity_bytes"] == host
    assert obj["host_bytes"] == Fake(best).host_bytes and obj["host_fits"] is True
    assert all(p["fits"] == (p["host_bytes"] <= host and p["device_peak_bytes"] <= cap)
               for p in obj["probes"])  # fmt: skip
    # the headroom search keeps 10% of both, as the trainer's preflight does
    within = obj["max_seq_len_with_headroom"]
    assert Fake(within).host_bytes <= 0.9 * host < Fake(within + g).host_bytes
    assert obj["binding_with_headroom"] == "host"

    assert main([*args, "--host-memory", "4096"]) == 0  # more than the device's length needs
    roomy = json.loads(capsys.readouterr().out)
    assert roomy["max_seq_len"] == dev_max and roomy["binding"] == "device"

    assert main([*args[:-1], "--host-memory", "64"]) == 0  # the text report names it too
    text = capsys.readouterr().out
    assert f"longest fitting sequence: {best:,}" in text and "host memory binds" in text, text
    assert f"{within:,} (host binds)" in text, text
    assert main([*args, "--host-memory", "0"]) == 2
    assert "--host-memory 0.0 must be > 0" in capsys.readouterr().err
    assert main(["trace", "--model", "llama3-8b", "--sp", "8", "--seq-len", "8192",
                 "--host-memory", "64"]) == 2  # fmt: skip
    assert "bounds the --find-max search" in capsys.readouterr().err
