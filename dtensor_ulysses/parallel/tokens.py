"""The global-batch token count: how many labels the loss averages over, across ``dp x sp``.

Each rank computes ``sum_{its tokens} ce(t) / T_valid`` with the *global* count ``T_valid`` of
valid labels (``label != IGNORE_INDEX``), so the rank losses add up to the single-device mean and
FSDP2 sums their gradients (:mod:`dtensor_ulysses.models.loss` has the local sums).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtensor_ulysses.data.batch import IGNORE_INDEX

__all__ = ["global_valid_tokens"]


def global_valid_tokens(labels_Bs: torch.Tensor, group: dist.ProcessGroup | None = None) -> int:
    """Valid labels summed over all ranks of ``group``; one all-reduce.

    Pass the ``dp x sp`` group (``du.flatten_dp_sp(mesh).get_group()``); ``None`` means the
    default group, which is the same set of ranks when the mesh spans the world.

    Raises:
        ValueError: the global batch has no valid label (the loss would divide by zero).
    """
    count = (labels_Bs != IGNORE_INDEX).sum().to(torch.int64).reshape(1)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(count, group=group)
    n = int(count.item())
    if n < 1:
        raise ValueError("the global batch has no valid labels; check the data and seq_len")
    return n
