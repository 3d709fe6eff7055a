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


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    h = x if residual is None else x + residual
    hf = h.float()
    out = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return out, h


@triton.jit
def _rms_norm_kernel(X, R, W, OUT, H_OUT, stride_x, stride_r, stride_o, stride_h, D, eps,
                     BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < D
    x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0)
    if HAS_RES:
        x = x + tl.load(R + row * stride_r + offs, mask=ok, other=0.0)
        tl.store(H_OUT + row * stride_h + offs, x, mask=ok)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)
    y = (xf * inv).to(X.dtype.element_ty)
    w = tl.load(W + offs, mask=ok, other=0.0)
    tl.store(OUT + row * stride_o + offs, (w * y).to(OUT.dtype.element_ty), mask=ok)


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
            BLOCK=triton.next_power_of_2(D), HAS_RES=residual is not None,
        )
    return out.view(*x.shape[:-1], D), (h.view(x.shape) if residual is not None else x)


def rms_norm(x, weight, eps, residual=None, backend: str = "auto"):
    """(weight · normalise(x + residual), x + residual); backend auto = Triton on CUDA."""
    if backend == "auto":
        backend = "triton" if x.is_cuda and not _needs_grad(x) else "torch"  # kernels have no backward
    fn = {"torch": rms_norm_torch, "triton": rms_norm_triton}.get(backend)
    if fn is None:
        raise ValueError(f"unknown backend {backend!r} (auto | triton | torch)")
    return fn(x, weight, eps, residual)


def _needs_grad(t: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and t.requires_grad
