"""``--offload-optimizer``: :class:`HostOffloadAdamW`, AdamW with its states on the host.

:mod:`dtensor_ulysses.memory.offload`'s module docstring gives the feature's traffic, host memory
and CPU time. The host buffers come from the one host allocator (:mod:`dtensor_ulysses.memory.host`:
``host_empty``, ``to_host``) and the CPU math runs inside its ``host_compute``, so a memory trace
counts them as host memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as _adamw

from dtensor_ulysses._torch_private import dtensor_like
from dtensor_ulysses.memory.host import host_compute, host_empty, to_host

__all__ = ["HostOffloadAdamW"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class HostOffloadAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` whose states live on the host and whose step runs on the CPU.

    Same hyperparameters, param groups and update as ``torch.optim.AdamW`` (no ``amsgrad``,
    ``maximize``, ``fused``, ``capturable``): the math is torch's own functional AdamW. For each
    parameter (an FSDP2 ``DTensor`` shard or a plain tensor) it keeps on the host (pinned on
    CUDA): an fp32 master copy of the local shard, ``exp_avg``, ``exp_avg_sq`` and a gradient
    buffer. :meth:`step` copies the local gradients to the host, runs AdamW on the CPU and copies
    the updated values into the device parameters.

    ``state_dict()`` holds exactly AdamW's keys (``step``, ``exp_avg``, ``exp_avg_sq``), each
    presented as a ``DTensor`` shaped and placed like its parameter whose local tensor *is* the
    host buffer (no device copy), so ``torch.distributed.checkpoint``'s ``get_state_dict`` /
    ``set_state_dict`` save and load it like AdamW's (and the checkpoints are interchangeable).
    The master copy is not saved: it equals the fp32 parameter after every step, and is taken
    again from the parameter at the first step after :meth:`load_state_dict` (DCP loads the
    optimizer before the model). Parameters are expected in fp32 (FSDP2 keeps fp32 shards;
    bf16 is compute only); with lower-precision parameters, a resume restarts the master from
    the rounded parameter.

    Cost per step and rank, ``n`` local parameter elements: ``4n`` bytes device-to-host
    (gradients, fp32) and ``4n`` host-to-device (parameters), plus the CPU AdamW, about
    ``76 * n / host_bandwidth`` seconds (see :mod:`dtensor_ulysses.memory.offload`); host memory
    ``16n`` bytes; device memory saved ``8n`` bytes.

    Args:
        params: as ``torch.optim.AdamW``.
        lr: as ``torch.optim.AdamW``.
        betas: as ``torch.optim.AdamW``.
        eps: as ``torch.optim.AdamW``.
        weight_decay: as ``torch.optim.AdamW``.
        foreach: the CPU math with foreach kernels (default True; bit-identical on CPU).
        pin_memory: pinned host buffers (``None``: when the parameter is on CUDA).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        foreach: bool = True,
        pin_memory: bool | None = None,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate {lr}; use lr >= 0")
        if not eps >= 0.0:
            raise ValueError(f"invalid eps {eps}; use eps >= 0")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"invalid beta parameter at index {i}: {b}; use 0 <= beta < 1")
        if not weight_decay >= 0.0:
            raise ValueError(f"invalid weight_decay {weight_decay}; use weight_decay >= 0")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.foreach = foreach
        self.pin_memory = pin_memory
        self._master: dict[torch.Tensor, torch.Tensor] = {}
        self._grad: dict[torch.Tensor, torch.Tensor] = {}
        self._copied_back: list[Any] = []  # CUDA events: parameters written from the masters

    def _pin(self, p: torch.Tensor) -> bool:
        return _local(p).device.type == "cuda" if self.pin_memory is None else self.pin_memory

    def _host_zeros(self, p: torch.Tensor) -> torch.Tensor:
        return host_empty(_local(p).shape, torch.float32, pin=self._pin(p)).zero_()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One AdamW step of every parameter with a gradient, on the CPU."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for event in self._copied_back:  # the masters are not overwritten mid-copy
            event.synchronize()
        self._copied_back = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            masters, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for p in params:
                if p.grad.is_sparse:
                    raise ValueError("HostOffloadAdamW does not support sparse gradients")
                local, state = _local(p), self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = self._host_zeros(p)
                    state["exp_avg_sq"] = self._host_zeros(p)
                if p not in self._master:  # first step, or first after load_state_dict
                    self._master[p] = to_host(
                        local, pin=self._pin(p), dtype=torch.float32, non_blocking=True
                    )
                if p not in self._grad:
                    self._grad[p] = host_empty(local.shape, torch.float32, pin=self._pin(p))
                self._grad[p].copy_(_local(p.grad), non_blocking=self._grad[p].is_pinned())
                masters.append(self._master[p])
                grads.append(self._grad[p])
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            if any(_local(p).device.type == "cuda" for p in params):
                torch.cuda.current_stream().synchronize()  # gradients and masters have arrived
            beta1, beta2 = group["betas"]
            with host_compute():
                _adamw(
                    masters, grads, exp_avgs, exp_avg_sqs, [], steps,
                    foreach=self.foreach, amsgrad=False, beta1=beta1, beta2=beta2,
                    lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                    maximize=False,
                )  # fmt: skip
            for p, master in zip(params, masters):
                local = _local(p)
                local.copy_(master, non_blocking=master.is_pinned())
                if local.device.type == "cuda":
                    self._copied_back.append(torch.cuda.current_stream().record_event())
        return loss

    def state_dict(self) -> dict[str, Any]:
        """AdamW's state dict; ``exp_avg``/``exp_avg_sq`` as DTensors over the host shards."""
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        state = {}
        for idx, st in sd["state"].items():
            p = params[idx]
            st = dict(st)
            if isinstance(p, DTensor):
                for key in ("exp_avg", "exp_avg_sq"):
                    st[key] = dtensor_like(st[key], p)
            state[idx] = st
        return {"state": state, "param_groups": sd["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load AdamW-format state (from :meth:`state_dict`, AdamW's, or DCP) into host memory."""
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups) or any(
            len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)
        ):
            raise ValueError(
                f"loaded state dict has groups of sizes {[len(s['params']) for s in saved_groups]}"
                f", this optimizer {[len(g['params']) for g in groups]}"
            )
        saved_state = state_dict["state"]
        with torch.no_grad():
            for g, s in zip(groups, saved_groups):
                for p, key in zip(g["params"], s["params"]):
                    if key not in saved_state:
                        continue
                    saved, state = saved_state[key], self.state[p]
                    for name in ("exp_avg", "exp_avg_sq"):
                        value = _local(saved[name])
                        if name not in state:
                            state[name] = self._host_zeros(p)
                        if state[name].untyped_storage() is not value.untyped_storage():
                            state[name].copy_(value)
                    state["step"] = torch.tensor(float(saved["step"]), dtype=torch.float32)
                g.update({k: v for k, v in s.items() if k not in ("params", "param_names")})
        self._master.clear()  # taken again from the (by then loaded) parameters
