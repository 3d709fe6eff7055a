"""FP8 block-scaled linear layers (contract C7): DeepSeek-V3 / R1 / Kimi-K2 checkpoints keep their linear weights in
float8_e4m3fn with one fp32 `weight_scale_inv` per 128 × 128 block.

- `reference.py`: `fp8_block_linear_torch` (the weights dequantised, fp32 product), `weight_dequant`,
  `weight_quant` and `act_quant_torch` (DeepSeek's block and per-token-group rules).
"""

from __future__ import annotations

from specmla.ops.backend import pick_backend
from specmla.ops.linear.reference import (act_quant_torch, fp8_block_linear_torch, weight_dequant,
                                          weight_quant)

__all__ = ["act_quant_torch", "fp8_block_linear", "fp8_block_linear_torch", "weight_dequant", "weight_quant"]


def fp8_block_linear(x, weight, weight_scale_inv, *, bias=None, out_dtype=None, backend="auto"):
    """Contract C7: x [..., K] @ (weight · scale)ᵀ (+ bias) → [..., N] in out_dtype (default x's dtype); weight
    float8_e4m3fn [N, K], weight_scale_inv fp32 [⌈N/128⌉, ⌈K/128⌉]. backend: "auto" | "torch"."""
    pick_backend(backend, x, weight, weight_scale_inv, bias)
    return fp8_block_linear_torch(x, weight, weight_scale_inv, bias=bias, out_dtype=out_dtype)
