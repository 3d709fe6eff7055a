"""RMSNorm with the residual add fused into the same pass (Triton kernel + torch reference).

`rms_norm(x, weight, eps, residual)` returns (normed, x + residual): a decoder layer adds the
attention (or MLP) output to the residual stream and normalises the sum for the next block; doing
both in one read of the row saves a full pass over the activations. The math matches
transformers' DeepseekV3RMSNorm: normalise in fp32, cast back, then scale by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmla.ops.backend import pick_backend
from specmla.ops.pdl import launch_dependents, pdl_args, wait


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    h = x if residual is None else x + residual
    hf = h.float()
    out = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return out, h


@triton.jit
def _scaled_norm(x, w, D, eps):
    """w · normalise(x) for one row, as the reference: normalise in fp32, cast back to x's dtype, scale."""
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)
    return w * (xf * inv).to(x.dtype)


@triton.jit
def _rms_norm_kernel(X, R, W, OUT, H_OUT, stride_x, stride_r, stride_o, stride_h, D, eps,
                     BLOCK: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < D
    w = tl.load(W + offs, mask=ok, other=0.0)  # the weight is constant: loaded before the wait
    wait(PDL)
    launch_dependents(PDL)
    x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0)
    if HAS_RES:
        x = x + tl.load(R + row * stride_r + offs, mask=ok, other=0.0)
        tl.store(H_OUT + row * stride_h + offs, x, mask=ok)
    tl.store(OUT + row * stride_o + offs, _scaled_norm(x, w, D, eps).to(OUT.dtype.element_ty), mask=ok)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    if x.shape[-1] != weight.shape[0] or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_dtype = torch.result_type(weight, x)  # weight * x.to(input dtype), as the reference
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, D).contiguous()
        h = torch.empty_like(x2)
    else:
        r2, h = x2, x2
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, h, x2.stride(0), r2.stride(0), out.stride(0), h.stride(0), D, eps,
            BLOCK=triton.next_power_of_2(D), HAS_RES=residual is not None, **pdl_args(x2),
        )
    return out.view(*x.shape[:-1], D), (h.view(x.shape) if residual is not None else x)


def rms_norm(x, weight, eps, residual=None, backend: str = "auto"):
    """(weight · normalise(x + residual), x + residual); backend auto = Triton on CUDA."""
    fn = {"torch": rms_norm_torch, "triton": rms_norm_triton}[pick_backend(backend, x, weight, residual)]
    return fn(x, weight, eps, residual)


def rms_norm_pair_torch(a: torch.Tensor, b: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """[weight_a · normalise(a) | weight_b · normalise(b)] along the last dimension."""
    return torch.cat([rms_norm_torch(a, weight_a, eps)[0], rms_norm_torch(b, weight_b, eps)[0]], dim=-1)


@triton.jit
def _rms_norm_pair_kernel(A, B, WA, WB, OUT, stride_a, stride_b, stride_o, D, eps, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
    row = tl.program_id(0)
    half = tl.program_id(1)  # 0: a into the first D columns, 1: b into the next D
    offs = tl.arange(0, BLOCK)
    ok = offs < D
    if half == 0:  # the weights are constant: loaded before the wait
        w = tl.load(WA + offs, mask=ok, other=0.0)
    else:
        w = tl.load(WB + offs, mask=ok, other=0.0)
    wait(PDL)
    launch_dependents(PDL)
    if half == 0:
        x = tl.load(A + row * stride_a + offs, mask=ok, other=0.0)
    else:
        x = tl.load(B + row * stride_b + offs, mask=ok, other=0.0)
    tl.store(OUT + row * stride_o + half * D + offs, _scaled_norm(x, w, D, eps).to(OUT.dtype.element_ty), mask=ok)


def rms_norm_pair_triton(a: torch.Tensor, b: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor,
                         eps: float) -> torch.Tensor:
    D = a.shape[-1]
    if (b.shape != a.shape or weight_a.shape != (D,) or weight_b.shape != (D,) or b.dtype != a.dtype
            or weight_b.dtype != weight_a.dtype):
        raise ValueError(f"a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} {b.dtype} must match, and so must "
                         f"their weights {tuple(weight_a.shape)} {weight_a.dtype} / {tuple(weight_b.shape)} "
                         f"{weight_b.dtype} (length {D})")
    a2, b2 = a.reshape(-1, D), b.reshape(-1, D)
    a2 = a2 if a2.stride(-1) == 1 else a2.contiguous()
    b2 = b2 if b2.stride(-1) == 1 else b2.contiguous()
    out = torch.empty(a2.shape[0], 2 * D, dtype=torch.result_type(weight_a, a), device=a.device)
    if a2.shape[0]:
        _rms_norm_pair_kernel[(a2.shape[0], 2)](a2, b2, weight_a, weight_b, out, a2.stride(0), b2.stride(0),
                                                out.stride(0), D, eps, BLOCK=triton.next_power_of_2(D),
                                                **pdl_args(a2))
    return out.view(*a.shape[:-1], 2 * D)


def rms_norm_pair(a, b, weight_a, weight_b, eps, backend: str = "auto") -> torch.Tensor:
    """Two RMSNorms side by side in one launch: the MTP module's [enorm(embedding) | hnorm(hidden)],
    which would otherwise be two norm kernels and a cat, in every draft pass of a graphed step."""
    backend = pick_backend(backend, a, b, weight_a, weight_b)
    if backend == "triton" and (a.dtype != b.dtype or weight_a.dtype != weight_b.dtype):
        backend = "torch"  # mixed precision (autocast training): the reference promotes like torch.cat
    fn = {"torch": rms_norm_pair_torch, "triton": rms_norm_pair_triton}[backend]
    return fn(a, b, weight_a, weight_b, eps)
