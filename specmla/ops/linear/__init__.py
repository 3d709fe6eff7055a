"""FP8 block-scaled linear layers (contract C7): DeepSeek-V3 / R1 / Kimi-K2 checkpoints keep their linear weights in
float8_e4m3fn with one fp32 `weight_scale_inv` per 128 × 128 block.

- `reference.py`: `fp8_block_linear_torch` (the weights dequantised, fp32 product), `weight_dequant`,
  `weight_quant` and `act_quant_torch` (DeepSeek's block and per-token-group rules);
- `triton.py`: `fp8_block_linear_triton` (w8a8: activations quantised per token per 128 columns, e4m3 tensor-core
  products promoted to fp32 every 128 K with both scales; a split-K swap-AB kernel up to 64 rows, a tiled GEMM
  above) and `act_quant` (the activation rule as a kernel).
"""

from __future__ import annotations

from specmla.ops.backend import pick_backend
from specmla.ops.linear.reference import (act_quant_torch, fp8_block_linear_torch, weight_dequant,
                                          weight_quant)
from specmla.ops.linear.triton import act_quant, fp8_block_linear_triton

__all__ = ["act_quant", "act_quant_torch", "fp8_block_linear", "fp8_block_linear_torch", "fp8_block_linear_triton",
           "weight_dequant", "weight_quant"]


def fp8_block_linear(x, weight, weight_scale_inv, *, bias=None, out_dtype=None, backend="auto"):
    """Contract C7: x [..., K] @ (weight · scale)ᵀ (+ bias) → [..., N] in out_dtype (default x's dtype); weight
    float8_e4m3fn [N, K], weight_scale_inv fp32 [⌈N/128⌉, ⌈K/128⌉]. backend: "auto" (the Triton kernels on CUDA
    when no tensor needs a gradient, else the torch reference), "triton" (also under TRITON_INTERPRET=1 on CPU
    tensors; activations quantised per token per 128 columns) or "torch" (the weights dequantised, activations
    exact). No host synchronisation; graph-capturable once called eagerly (its split-K counters are allocated then)."""
    if pick_backend(backend, x, weight, weight_scale_inv, bias) == "triton":
        return fp8_block_linear_triton(x, weight, weight_scale_inv, bias=bias, out_dtype=out_dtype)
    return fp8_block_linear_torch(x, weight, weight_scale_inv, bias=bias, out_dtype=out_dtype)
