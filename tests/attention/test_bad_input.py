"""Bad input: the exception type and a message that names the numbers and the fix."""

from __future__ import annotations

import re

import pytest
import torch

import dtensor_ulysses as du
from dtensor_ulysses.launch import run_local_world
from tests import workers

EXPECTED = {
    "sp_exceeds_heads": ("ValueError", r"sp=4 exceeds the 2 q heads \(a rank would hold no head\); use sp <= 2"),
    "s2h_heads_not_divisible": ("ValueError", r"6 heads are not divisible by sp=4; choose sp in \{1, 2, 3, 6\}"),
    "s2h_seq_not_divisible": ("ValueError", r"6 tokens .* not divisible by sp=4; pad the sequence to a multiple of 4"),
    "positions_not_dtensor": ("TypeError", r"position_ids must be a \[B, S\] int64 DTensor placed like q, got Tensor"),
    "positions_wrong_shape": ("ValueError", r"position_ids has shape \(1, 4\); expected \[B, S\] = \(1, 8\)"),
    "seq_not_divisible": ("ValueError", r"6 tokens .* not divisible by sp=4; pad the sequence to a multiple of 4 tokens, or pass allow_uneven=True"),
    "not_seq_sharded": ("ValueError", r"q has placement Shard\(2\) on the 'sp' axis; expected Shard\(1\)"),
    "replicated_on_sp": ("ValueError", r"placement Replicate\(\) on the 'sp' axis; expected Shard\(1\)"),
    "seq_on_dp": ("ValueError", r"placement Shard\(1\) on mesh axis 'dp'; only Shard\(0\)"),
    "different_meshes": ("ValueError", r"k is on mesh .* but q is on mesh .*; put q, k and v on one mesh"),
    "head_dims_differ": ("ValueError", r"head dims differ: q has 4, k/v have 2"),
    "no_sp_axis": ("ValueError", r"axes \('tp',\) but no 'sp' axis; build it with du.init_mesh"),
    "not_dtensor": ("TypeError", r"q must be a DTensor, got Tensor; wrap .* DTensor.from_local"),
    "not_dtensor_s2h": ("TypeError", r"x must be a DTensor, got Tensor"),
    "gqa_not_multiple": ("ValueError", r"8 q heads are not a multiple of 3 kv heads"),
    "head_to_seq_wrong": ("ValueError", r"placement Shard\(1\) on the 'sp' axis; expected Shard\(2\)"),
    "init_mesh_product": ("ValueError", r"dp \* sp = 3 \* 2 = 6 but the world size is 4"),
    "init_mesh_dp_zero": ("ValueError", r"dp=0 is not a positive degree; use dp >= 1"),
    "init_mesh_sp_negative": ("ValueError", r"sp=-1 is not a positive degree; use sp >= 1"),
    "init_mesh_dp_not_dividing": ("ValueError", r"dp=3 does not divide world_size=4; choose dp in \[1, 2, 4\]"),
    "module_dtensor_input": ("TypeError", r"q is a DTensor; UlyssesAttention takes local tensors"),
    "module_heads": ("ValueError", r"sp=4 exceeds the 2 q heads"),
    "module_bad_mesh": ("TypeError", r"mesh must be a DeviceMesh with an 'sp' axis or a ProcessGroup"),
    "flash_on_cpu": ("AttentionBackendError", r"backend='flash_attn' cannot run flash-attn: .*; use backend='auto' or one of \['sdpa', 'blockwise'\]"),
    "unknown_backend": ("ValueError", r"backend='xformers' is not an attention kernel; choose one of"),
    # the parallel recipe: the degrees bound to their mesh, the options as one object
    "dims_bound": (None, r"^$"),
    "dims_unbound": ("ValueError", r"ParallelDims\(dp=2 x sp=2\) has no mesh yet: bind"),
    "dims_other_mesh": ("ValueError", r"the mesh has axes \('dp', 'sp'\) of sizes \(2, 2\), not the dp=1 x sp=4"),
}  # fmt: skip


@pytest.mark.timeout(240)
def test_bad_input_messages():
    results = run_local_world(workers.error_worker, 4)
    for rank, per_rank in enumerate(results):
        assert [r["name"] for r in per_rank] == list(EXPECTED), "worker and test disagree"
        for r in per_rank:
            want_type, pattern = EXPECTED[r["name"]]
            assert r["type"] == want_type, f"rank {rank} {r['name']}: {r['type']}: {r['msg']}"
            assert re.search(pattern, r["msg"]), f"rank {rank} {r['name']}: {r['msg']!r}"


def test_local_attention_backend_errors():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="backend='bogus' is not an attention kernel"):
        du.local_attention(q, q, q, backend="bogus")
    with pytest.raises(RuntimeError, match="backend='flash_attn' cannot run"):
        du.local_attention(q, q, q, backend="flash_attn")
    with (
        pytest.raises(ValueError, match=r"force_backend\('cudnn'\) is not an attention kernel"),
        du.force_backend("cudnn"),
    ):
        pass


def test_all_to_all_argument_errors():
    from dtensor_ulysses.comm import all_to_all

    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="scatter_dim=5 is out of range for 2-D tensors"):
        all_to_all(x, scatter_dim=5, gather_dim=0, group=None)
    with pytest.raises(ValueError, match="scatter_dim and gather_dim are both 1"):
        all_to_all(x, scatter_dim=1, gather_dim=1, group=None)
