"""Mixture of experts (contract C6): the router and the fused expert compute, each beside its torch reference.

    from specmla.ops import fused_moe, moe_route
    weights, ids = moe_route(x, router_weight, bias, RouteSpec.from_config(cfg))
    y = fused_moe(x, w_gate_up, w_down, weights, ids, shared=(w_gate_up_shared, w_down_shared))

- `route.py`: `moe_route` (one Triton kernel) and `moe_route_torch`;
- `reference.py`: `fused_moe_torch`, the same signature as `fused_moe`;
- `triton.py`: the align kernel, the two grouped GEMMs and the top-k sum (bf16 / fp16 / fp32 experts, and
  float8 block-scaled ones w8a8 with an activation quantisation kernel);
- `tuning.py` + `configs/`: tile configurations per device and shape (benchmarks/tune_moe.py makes them).
"""

from __future__ import annotations

from specmla.ops.backend import pick_backend
from specmla.ops.linear import e4m3_backend
from specmla.ops.moe.reference import check_moe_args, fused_moe_torch
from specmla.ops.moe.route import RouteSpec, moe_route, moe_route_torch, moe_route_triton
from specmla.ops.moe.triton import fused_moe_fp8_triton, fused_moe_triton

__all__ = ["RouteSpec", "fused_moe", "fused_moe_torch", "moe_route", "moe_route_torch", "moe_route_triton"]


MOE_BACKENDS = ("auto", "triton", "torch", "w8a8_torch")


def fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, *, shared=None, w_gate_up_scale=None,
              w_down_scale=None, shared_scales=None, out=None, residual=None, backend="auto"):
    """out[t] = Σ_j topk_weights[t, j] · w_down[e] (silu(gate_e x[t]) ⊙ up_e x[t]), e = topk_ids[t, j]
    (an id outside [0, E) adds nothing), plus shared = (w_gate_up_shared [2·Is, H], w_down_shared [H, Is])
    with weight 1.

    x [T, H]; w_gate_up [E, 2I, H] (gate rows, then up rows); w_down [E, H, I]; topk_weights fp32 [T, k];
    topk_ids int32/int64 [T, k]. Any T ≥ 0, no host synchronisation, CUDA-graph capturable. float8_e4m3fn
    weights carry fp32 scales per 128 × 128 block: w_gate_up_scale [E, ⌈2I/128⌉, ⌈H/128⌉], w_down_scale
    [E, ⌈H/128⌉, ⌈I/128⌉], shared_scales = (gate‖up scale, down scale) of the shared experts.
    backend: "auto" (Triton on CUDA without gradients, else the torch reference; float8 experts need compute
    capability 8.9, see `ops.linear.e4m3_backend`), "triton", "torch", or for float8 experts "w8a8_torch" (the
    torch emulation of the Triton w8a8 arithmetic, `fused_moe_torch(..., act_quant=True)`, on any device). float8
    experts run w8a8 in Triton (x and the intermediate quantised per token and group of 128 columns, as
    DeepSeek's act_quant; needs I and Is multiples of 128), the reference multiplies the dequantised weights.
    residual [T, H] in x's dtype: out = residual + the above, the sum in fp32 rounded once (a decoder layer's
    `x + mlp(normed)` without a separate add); out may be residual itself (the residual stream updated in place).
    """
    args = dict(shared=shared, out=out, residual=residual)
    fp8 = w_gate_up_scale is not None or w_down_scale is not None or shared_scales is not None
    if backend not in MOE_BACKENDS:
        raise ValueError(f"fused_moe: unknown backend {backend!r} ({' | '.join(MOE_BACKENDS)})")
    if backend == "w8a8_torch":
        if not fp8:
            raise ValueError("fused_moe: backend='w8a8_torch' emulates the float8 experts' kernels; these experts are "
                             f"{w_gate_up.dtype} without scales")
        return fused_moe_torch(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale=w_gate_up_scale,
                               w_down_scale=w_down_scale, shared_scales=shared_scales, act_quant=True, **args)
    chosen = (e4m3_backend if fp8 else pick_backend)(backend, x, w_gate_up, w_down, topk_weights, residual,
                                                     *(shared or ()))
    if chosen == "torch":
        return fused_moe_torch(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale=w_gate_up_scale,
                               w_down_scale=w_down_scale, shared_scales=shared_scales, **args)  # checks its args
    check_moe_args(x, w_gate_up, w_down, topk_weights, topk_ids, shared, w_gate_up_scale, w_down_scale, out,
                   shared_scales, residual)
    if fp8:
        return fused_moe_fp8_triton(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale=w_gate_up_scale,
                                    w_down_scale=w_down_scale, shared_scales=shared_scales, **args)
    return fused_moe_triton(x, w_gate_up, w_down, topk_weights, topk_ids, **args)
