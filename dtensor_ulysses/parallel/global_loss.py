"""The global-batch token count: how many labels the loss averages over, across ``dp x sp``;
and :func:`evaluate`, the held-out loss summed and counted over the same ranks.

Each rank computes ``sum_{its tokens} ce(t) / T_valid`` with the *global* count ``T_valid`` of
valid labels (``label != IGNORE_INDEX``), so the rank losses add up to the single-device mean and
FSDP2 sums their gradients (:mod:`dtensor_ulysses.models.loss` has the local sums).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from dtensor_ulysses.data.batch import IGNORE_INDEX

__all__ = ["evaluate", "global_valid_tokens"]


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


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: Iterable[Any],
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> dict[str, float]:
    """Loss and perplexity over held-out batches, the sequence sharded as in training.

    ``model(input_ids, position_ids, layout=, labels=)`` returns the loss sum of this rank's
    slice (the built-in model, :class:`~dtensor_ulysses.hf.HFCausalLM`). Every rank of
    ``group`` (all ``dp x [ring x] sp`` ranks) must pass its slices of the same batches
    (:func:`~dtensor_ulysses.data.eval_batches`); the trainer's component is
    :class:`~dtensor_ulysses.train.Evaluator`.

    Returns:
        ``{"loss", "perplexity", "tokens"}``, equal on every rank.

    Raises:
        ValueError: the batches hold no valid label.
    """
    was = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    try:
        for batch in batches:
            if device is not None:
                batch = batch.to(device)
            s = model(batch.input_ids, batch.position_ids, layout=batch.layout, labels=batch.labels)
            total += s.detach().double().cpu()
            count += int((batch.labels != IGNORE_INDEX).sum())
    finally:
        model.train(was)
    dev = next(model.parameters()).device if device is None else torch.device(device)
    sums = torch.tensor([float(total), float(count)], dtype=torch.float64, device=dev)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
    loss_sum, n = float(sums[0]), int(sums[1])
    if n == 0:
        raise ValueError("the evaluation batches have no valid labels")
    loss = loss_sum / n
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": n}
