"""Rotary position embedding applied to q_pe / k_pe (torch reference; a fused kernel comes later).

Layouts (`interleave=True`, DeepSeek's default): the input holds pairs (x0, x1), (x2, x3), ... each
rotated by one frequency; the output is written de-interleaved, [rotated evens | rotated odds], as
transformers' DeepSeek-V3 does. DeepSeek-V2 in transformers keeps the output interleaved (complex
multiply); q_pe and k_pe pass through the same permutation, so every q·k score is identical and
specmla uses the V3 layout for both families. `interleave=False` is the GPT-NeoX rotate-half form.
"""

from __future__ import annotations

import torch

from specmla.ops.backend import pick_backend


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, interleave: bool = True) -> torch.Tensor:
    """Rotate x [..., T, (heads,) dim] by the angles of `positions` [T]; computed in fp32, returned in x.dtype.

    x's token axis must be the one that `positions` indexes: x is [T, dim] or [T, H, dim].
    """
    half = x.shape[-1] // 2
    cs = cos_sin.index_select(0, positions.reshape(-1).long())
    cos, sin = cs[:, :half], cs[:, half:]
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    xf = x.float()
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Triton: rotate in place, one program per token (all heads), positions gathered from the table
# ---------------------------------------------------------------------------------------------
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _rope_kernel(X, POS, CS, stride_t, stride_h, stride_cs, H, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                 INTERLEAVE: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(POS + t)
    i = tl.arange(0, HALF)
    cos = tl.load(CS + pos * stride_cs + i)
    sin = tl.load(CS + pos * stride_cs + HALF + i)
    hs = tl.arange(0, BLOCK_H)
    ok = (hs < H)[:, None]
    base = X + t * stride_t + hs[:, None] * stride_h
    if INTERLEAVE:
        x1 = tl.load(base + 2 * i[None, :], mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(base + 2 * i[None, :] + 1, mask=ok, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(base + i[None, :], mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + i[None, :], mask=ok, other=0.0).to(tl.float32)
    y1 = x1 * cos[None, :] - x2 * sin[None, :]
    y2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(base + i[None, :], y1.to(X.dtype.element_ty), mask=ok)  # written de-interleaved
    tl.store(base + HALF + i[None, :], y2.to(X.dtype.element_ty), mask=ok)


def apply_rope_(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, interleave: bool = True,
                backend: str = "auto") -> torch.Tensor:
    """In-place `apply_rope` on x [T, dim] or [T, H, dim] (a strided view, e.g. q_pe inside q, is fine)."""
    if pick_backend(backend, x) == "torch":
        x.copy_(apply_rope(x, positions, cos_sin, interleave))
        return x
    x3 = x if x.dim() == 3 else x[:, None, :]
    T, H, dim = x3.shape
    if x3.stride(-1) != 1 or dim & (dim - 1):
        raise ValueError("rope needs a unit-stride last dim of power-of-two size")
    if T:
        _rope_kernel[(T,)](x3, positions, cos_sin, x3.stride(0), x3.stride(1), cos_sin.stride(0), H,
                           HALF=dim // 2, BLOCK_H=triton.next_power_of_2(H), INTERLEAVE=interleave)
    return x

