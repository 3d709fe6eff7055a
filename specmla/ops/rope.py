"""Rotary position embedding applied to q_pe / k_pe: torch reference, and a Triton kernel that rotates in place
(q's heads and, in the same launch, the token's k_pe).

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

from specmla.ops.pdl import launch_dependents, pdl_args, wait  # noqa: E402


@triton.jit
def _rotate_rows(base, ok, cos, sin, i, HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Rotate the rows at base (pointers [R, 1]) in place, written de-interleaved."""
    if INTERLEAVE:
        x1 = tl.load(base + 2 * i[None, :], mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(base + 2 * i[None, :] + 1, mask=ok, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(base + i[None, :], mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + i[None, :], mask=ok, other=0.0).to(tl.float32)
    y1 = x1 * cos[None, :] - x2 * sin[None, :]
    y2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(base + i[None, :], y1.to(base.dtype.element_ty), mask=ok)
    tl.store(base + HALF + i[None, :], y2.to(base.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(X, POS, CS, stride_t, stride_h, stride_cs, H, K, stride_kt, HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, INTERLEAVE: tl.constexpr, HAS_K: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0)
    wait(PDL)  # the positions come from the step's inputs (and the table rows they pick with them)
    launch_dependents(PDL)
    pos = tl.load(POS + t)
    i = tl.arange(0, HALF)
    cos = tl.load(CS + pos * stride_cs + i)
    sin = tl.load(CS + pos * stride_cs + HALF + i)
    hs = tl.arange(0, BLOCK_H)
    _rotate_rows(X + t * stride_t + hs[:, None] * stride_h, (hs < H)[:, None], cos, sin, i, HALF, INTERLEAVE)
    if HAS_K:  # the token's k_pe, one row
        one = tl.arange(0, 1)
        _rotate_rows(K + t * stride_kt + one[:, None], (one < 1)[:, None], cos, sin, i, HALF, INTERLEAVE)


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
        _rope_kernel[(T,)](x3, positions, cos_sin, x3.stride(0), x3.stride(1), cos_sin.stride(0), H, x3, 0,
                           HALF=dim // 2, BLOCK_H=triton.next_power_of_2(H), INTERLEAVE=interleave, HAS_K=False,
                           **pdl_args(x3))
    return x


def apply_rope_qk_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                   interleave: bool = True, backend: str = "auto") -> None:
    """In-place `apply_rope` on q [T, H, dim] and k [T, dim] (strided views are fine), one launch on CUDA."""
    if pick_backend(backend, q) == "torch":
        q.copy_(apply_rope(q, positions, cos_sin, interleave))
        k.copy_(apply_rope(k, positions, cos_sin, interleave))
        return
    T, H, dim = q.shape
    if k.shape != (T, dim) or q.stride(-1) != 1 or k.stride(-1) != 1 or dim & (dim - 1):
        raise ValueError("rope needs q [T, H, dim] and k [T, dim], unit-stride last dims of power-of-two size")
    if T:
        _rope_kernel[(T,)](q, positions, cos_sin, q.stride(0), q.stride(1), cos_sin.stride(0), H, k, k.stride(0),
                           HALF=dim // 2, BLOCK_H=triton.next_power_of_2(H), INTERLEAVE=interleave, HAS_K=True,
                           **pdl_args(q))
