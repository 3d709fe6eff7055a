"""Which implementation an op runs: its Triton kernel or its torch reference.

The kernels have no backward. So `auto` takes the kernel on CUDA only while no tensor of the call needs a
gradient, weights included: a trained norm weight on a frozen input (distilling only the MTP module) must
still get its gradient through the torch path.
"""

from __future__ import annotations

import torch


def pick_backend(backend: str, *tensors) -> str:
    """The implementation ("triton" or "torch") for a call on `tensors`: the first one decides the device,
    None entries are skipped. `backend` is "auto" or one of the two names."""
    if backend == "auto":
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
        return "triton" if tensors[0].is_cuda and not grad else "torch"
    if backend not in ("torch", "triton"):
        raise ValueError(f"unknown backend {backend!r} (auto | triton | torch)")
    return backend
