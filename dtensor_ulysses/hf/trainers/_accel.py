"""The Trainer's accelerator under Ulysses: data by dp rank, no DDP wrap, the DTensor grad norm.

:func:`install` changes the class of the ``accelerate.Accelerator`` a ``Trainer`` built, in
place, to a subclass that overrides five public methods:

* ``prepare_data_loader``: the loader is sharded over the ``dp`` ranks only (every rank of an
  sp group reads the same rows), by handing accelerate's own ``prepare_data_loader`` the dp
  degree and dp rank instead of the world's. Everything else of accelerate's loader (the seeded
  sampler, ``set_epoch``, ``skip_first_batches`` on resume, even batches) is unchanged.
* ``prepare_model``: the model is already FSDP2-sharded: autocast and compile only, never DDP.
* ``clip_grad_norm_``: the norm of DTensor gradients as a plain tensor (logged as a float).
* ``split_between_processes``: over the dp ranks (accelerate's own rule, with ``dp`` processes),
  so every rank of an sp group gets its dp rank's share, as the loaders do.
* ``gather_for_metrics`` (the Trainer's ``gather_function``: evaluation losses, logits,
  labels): :func:`dp_gather`, across the dp ranks only, since the sp ranks of a group hold the
  same rows; the last batch cut to the dataset's remaining rows as accelerate's own does, so
  a partial last evaluation batch weighs by its rows in ``eval_loss``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtensor_ulysses.parallel.mesh import ParallelDims

__all__ = ["dp_gather", "dp_gather_object", "install"]


class _UlyssesAccelerator:
    """Mixin placed before the accelerator's own class (see :func:`install`)."""

    _du_dims: ParallelDims  # the trainer's degrees, bound to its mesh

    def prepare_model(
        self, model: Any, device_placement: Any = None, evaluation_mode: bool = False
    ):
        # FSDP2 owns placement and gradient reduction: autocast / compile only, no DDP
        return super().prepare_model(  # type: ignore[misc]
            model, device_placement=False, evaluation_mode=True
        )

    def prepare_data_loader(self, data_loader: Any, *args: Any, **kwargs: Any):
        import accelerate.accelerator as accelerator_module

        original = accelerator_module.prepare_data_loader
        dp, dp_rank = self._du_dims.dp, self._du_dims.dp_rank

        def by_dp_rank(*a: Any, **kw: Any):
            kw["num_processes"], kw["process_index"] = dp, dp_rank
            kw["torch_device_mesh"] = None  # the degrees above are the dp ones already
            return original(*a, **kw)

        accelerator_module.prepare_data_loader = by_dp_rank
        try:
            return super().prepare_data_loader(data_loader, *args, **kwargs)  # type: ignore[misc]
        finally:
            accelerator_module.prepare_data_loader = original

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        data = dp_gather(input_data, group=self._du_dims.dp_mesh.get_group())
        # accelerate's own rule: the last batch holds ``remainder`` rows of the dataset (the
        # rest repeats rows to fill it), and the Trainer repeats each loss eval_batch_size
        # times, so a partial last batch weighs by its rows, as in the stock run
        state = self.gradient_state  # type: ignore[attr-defined]
        if state.end_of_dataloader and state.remainder > 0:
            return _first_rows(data, state.remainder)
        return data

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Any:
        # by dp rank, as the loaders: every rank of an sp group gets its dp rank's share (what
        # TRL's generation callbacks split), accelerate's own rule over dp processes
        from accelerate.state import PartialState

        dims, device = self._du_dims, getattr(self, "device", None)
        view: Any = SimpleNamespace(
            num_processes=dims.dp, process_index=dims.dp_rank, device=device
        )
        return PartialState.split_between_processes(view, inputs, apply_padding=apply_padding)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2):
        self.unscale_gradients()  # type: ignore[attr-defined]
        params = [p for p in parameters if p.grad is not None]
        if not params:
            return torch.zeros(())
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        if max_norm != float("inf"):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total


def install(accelerator: Any, dims: ParallelDims) -> None:
    """Give ``accelerator`` (an ``accelerate.Accelerator``) the Ulysses overrides, in place;
    ``dims``: the trainer's degrees, bound to its mesh."""
    base = type(accelerator)
    if not issubclass(base, _UlyssesAccelerator):
        accelerator.__class__ = type(f"Ulysses{base.__name__}", (_UlyssesAccelerator, base), {})
    accelerator._du_dims = dims


def _first_rows(data: Any, n: int) -> Any:
    """``data`` (a tensor, or nested tuples / lists of them) cut to its first ``n`` rows."""
    if isinstance(data, (tuple, list)):
        return type(data)(_first_rows(d, n) for d in data)
    if isinstance(data, torch.Tensor) and data.dim():
        return data[:n]
    return data


def _pad_dim1(t: torch.Tensor, length: int) -> torch.Tensor:
    if t.dim() < 2 or t.shape[1] == length:
        return t
    pad = t.new_full((t.shape[0], length - t.shape[1], *t.shape[2:]), -100)
    return torch.cat([t, pad], dim=1)


def dp_gather(data: Any, *, group: dist.ProcessGroup, **_: Any) -> Any:
    """Concatenate ``data`` (a tensor, or nested tuples / lists of them) over the dp ranks
    along dim 0, padding dim 1 with ``-100`` to the longest; the Trainer's ``gather_function``."""
    if isinstance(data, (tuple, list)):
        return type(data)(dp_gather(d, group=group) for d in data)
    if not isinstance(data, torch.Tensor) or dist.get_world_size(group) == 1:
        return data
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, data.detach().cpu(), group=group)
    if data.dim() >= 2:
        length = max(p.shape[1] for p in parts)
        parts = [_pad_dim1(p, length) for p in parts]
    return torch.cat([p if p.dim() else p.reshape(1) for p in parts]).to(data.device)


def dp_gather_object(obj: Any, group: dist.ProcessGroup) -> list:
    """accelerate's ``gather_object`` over ``group`` (the dp ranks): the ranks' lists,
    concatenated in rank order."""
    if dist.get_world_size(group) == 1:
        return list(obj)
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, obj, group=group)
    return [x for part in parts for x in part]
