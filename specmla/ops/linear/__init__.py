"""FP8 block-scaled linear layers (contract C7): DeepSeek-V3 / R1 / Kimi-K2 checkpoints keep their linear weights in
float8_e4m3fn with one fp32 `weight_scale_inv` per 128 × 128 block.

- `reference.py`: `fp8_block_linear_torch` (the weights dequantised, fp32 product), `fp8_block_linear_w8a8_torch`
  (the kernels' w8a8 arithmetic: activations through `act_quant_torch` first), `weight_dequant`,
  `weight_quant` and `act_quant_torch` (DeepSeek's block and per-token-group rules);
- `triton.py`: `fp8_block_linear_triton` (w8a8: activations quantised per token per 128 columns, e4m3 tensor-core
  products promoted to fp32 every 128 K with both scales; a split-K swap-AB kernel up to 64 rows, a tiled GEMM
  above) and `act_quant` (the activation rule as a kernel);
- `deepgemm.py`: `fp8_block_linear_deepgemm`, the same product on DeepGEMM's sm_90 kernel (the optional extra
  `specmla[hopper]`), which "auto" takes where it is available and measured faster (`deepgemm.preferred`);
- `gemv.py`: 16-bit products of at most `SMALL_M` rows (decode at small batch), which stream the weight where cuBLAS
  leaves most of the copy rate unused: `linear_small_m` (x @ weightᵀ) and `head_matmul_small_m` (one matrix per
  head, MLA's absorbed projections); `linear` and `head_matmul` pick them or torch.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from specmla.ops.backend import pick_backend
from specmla.ops.linear import deepgemm
from specmla.ops.linear.gemv import SMALL_M, head_matmul_small_m, linear_small_m
from specmla.ops.linear.reference import (act_quant_torch, fp8_block_linear_torch, fp8_block_linear_w8a8_torch,
                                          weight_dequant, weight_quant)
from specmla.ops.linear.triton import act_quant, fp8_block_linear_triton

__all__ = ["act_quant", "act_quant_torch", "e4m3_backend", "fp8_block_linear", "fp8_block_linear_torch",
           "fp8_block_linear_triton", "fp8_block_linear_w8a8_torch", "head_matmul", "linear", "weight_dequant",
           "weight_quant"]


@functools.lru_cache(maxsize=None)
def _e4m3_dots(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def e4m3_backend(backend: str, *tensors) -> str:
    """`pick_backend` for the e4m3 kernels: "auto" keeps to the torch reference on CUDA devices without e4m3
    matmuls (compute capability below 8.9: A100 and older); "triton" there raises."""
    chosen = pick_backend(backend, *tensors)
    t = tensors[0]
    if chosen == "triton" and t.is_cuda and not _e4m3_dots(t.device.index if t.device.index is not None
                                                           else torch.cuda.current_device()):
        if backend == "triton":
            raise ValueError(f"the e4m3 Triton kernels need compute capability 8.9 or newer; {t.device} has "
                             f"{torch.cuda.get_device_capability(t.device)} (backend='torch' runs the reference)")
        return "torch"
    return chosen


FP8_LINEAR_BACKENDS = ("auto", "triton", "deepgemm", "torch", "w8a8_torch")


def fp8_block_linear(x, weight, weight_scale_inv, *, bias=None, out_dtype=None, backend="auto"):
    """Contract C7: x [..., K] @ (weight · scale)ᵀ (+ bias) → [..., N] in out_dtype (default x's dtype); weight
    float8_e4m3fn [N, K], weight_scale_inv fp32 [⌈N/128⌉, ⌈K/128⌉]. backend: "auto" (on CUDA when no tensor needs
    a gradient: DeepGEMM where `deepgemm.routes_to` (installed, the call fits it, its rows `preferred`), else the
    Triton kernels; the torch reference otherwise), "triton" (also under TRITON_INTERPRET=1 on CPU tensors;
    activations quantised per token per 128 columns), "deepgemm" (RuntimeError where it is not available),
    "torch" (the weights dequantised, activations exact) or "w8a8_torch" (`fp8_block_linear_w8a8_torch`: the
    kernels' w8a8 arithmetic in torch, any device). No host synchronisation; graph-capturable once called
    eagerly (the split-K counters are allocated, DeepGEMM's kernels compiled, then)."""
    if backend not in FP8_LINEAR_BACKENDS:
        raise ValueError(f"fp8_block_linear: unknown backend {backend!r} ({' | '.join(FP8_LINEAR_BACKENDS)})")
    if backend == "w8a8_torch":
        return fp8_block_linear_w8a8_torch(x, weight, weight_scale_inv, bias=bias, out_dtype=out_dtype)
    if backend == "deepgemm":
        return deepgemm.fp8_block_linear_deepgemm(x, weight, weight_scale_inv, bias=bias, out_dtype=out_dtype)
    if e4m3_backend(backend, x, weight, weight_scale_inv, bias) == "triton":
        if backend == "auto" and deepgemm.routes_to(x, weight, bias, out_dtype):
            return deepgemm.fp8_block_linear_deepgemm(x, weight, weight_scale_inv, bias=bias, out_dtype=out_dtype)
        return fp8_block_linear_triton(x, weight, weight_scale_inv, bias=bias, out_dtype=out_dtype)
    return fp8_block_linear_torch(x, weight, weight_scale_inv, bias=bias, out_dtype=out_dtype)


def _small_m(x: torch.Tensor, weight: torch.Tensor, rows: int, backend: str) -> bool:
    """Whether a product of `rows` rows runs on the small-M kernels: backend "triton", or "auto" on CUDA without
    gradients for 16-bit operands of one dtype and at most SMALL_M rows."""
    if backend == "torch":
        return False
    if backend == "triton":
        return True
    return (pick_backend("auto", x, weight) == "triton" and rows <= SMALL_M and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           backend: str = "auto") -> torch.Tensor:
    """x [..., K] @ weightᵀ (+ bias) → [..., N]: `linear_small_m` for decode-sized 16-bit calls (`_small_m`), else
    F.linear (cuBLAS on CUDA). backend: "auto", "triton" (the small-M kernel; ValueError above SMALL_M rows) or
    "torch"."""
    rows = math.prod(x.shape[:-1])
    if bias is not None or not _small_m(x, weight, rows, backend):
        return F.linear(x, weight, bias)
    y = linear_small_m(x.reshape(rows, x.shape[-1]), weight)
    return y.view(*x.shape[:-1], weight.shape[0])


def head_matmul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
                backend: str = "auto") -> torch.Tensor:
    """out[t, g] = x[t, g] @ w[g] for x [T, G, K], w [G, K, N] (any strides), into `out` [T, G, N] when given (any
    strides): `head_matmul_small_m` for decode-sized 16-bit calls (`_small_m`), else torch.matmul per head."""
    if _small_m(x, w, x.shape[0], backend):
        return head_matmul_small_m(x, w, out=out)
    y = torch.matmul(x.transpose(0, 1), w).transpose(0, 1)
    return y if out is None else out.copy_(y)
