"""Torch references of the FP8 block-scaled linear (contract C7) and DeepSeek's two quantisation rules.

- weights: float8_e4m3fn [N, K] with fp32 `weight_scale_inv` [⌈N/128⌉, ⌈K/128⌉]; the real weight of block
  (i, j) is the e4m3 values times scale_inv[i, j] (DeepSeek's `weight_dequant`; edge blocks are partial);
- activations (the kernels' w8a8 path): per token, per group of 128 columns, scale = amax / 448 and the
  values divided by it, rounded to e4m3 (DeepSeek's `act_quant`; a group of zeros keeps scale 1).

Two references of the product: `fp8_block_linear_torch` (the weights dequantised, activations exact: the exact
product of the stored weights) and `fp8_block_linear_w8a8_torch` (the kernels' w8a8 arithmetic: activations through
`act_quant_torch` first, then the same fp32 product).
"""

from __future__ import annotations

import torch

BLOCK = 128  # DeepSeek's weight_block_size [128, 128] and activation group width
E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def weight_dequant(weight: torch.Tensor, scale_inv: torch.Tensor | None, block: int = BLOCK) -> torch.Tensor:
    """float8 weight [..., R, C] with fp32 scales [..., ⌈R/block⌉, ⌈C/block⌉] → fp32 weight · scale per block;
    a weight without scales → fp32 as it is."""
    if scale_inv is None:
        return weight.float()
    R, C = weight.shape[-2:]
    if tuple(scale_inv.shape[-2:]) != (-(-R // block), -(-C // block)):
        raise ValueError(f"weight_scale_inv {tuple(scale_inv.shape)} does not cover a [{R}, {C}] weight in "
                         f"{block}×{block} blocks")
    s = scale_inv.float().repeat_interleave(block, dim=-2)[..., :R, :].repeat_interleave(block, dim=-1)[..., :C]
    return weight.float() * s


def weight_quant(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., R, C] (any float dtype) → (float8_e4m3fn [..., R, C], fp32 scale_inv [..., ⌈R/block⌉,
    ⌈C/block⌉]) with scale_inv = amax / 448 per block (1 for an all-zero block): the inverse of `weight_dequant`
    up to e4m3 rounding. This is how the FP8 checkpoints of DeepSeek-V3 / R1 / Kimi-K2 are laid out."""
    *lead, R, C = weight.shape
    rb, cb = -(-R // block), -(-C // block)
    w = torch.nn.functional.pad(weight.float(), (0, cb * block - C, 0, rb * block - R))
    tiles = w.view(*lead, rb, block, cb, block)
    amax = tiles.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (tiles / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).view(*lead, rb * block, cb * block)
    return q[..., :R, :C].to(torch.float8_e4m3fn), scale


def act_quant_torch(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] → (float8_e4m3fn [..., K], fp32 scales [..., ⌈K/block⌉]): per row, per group of `block`
    columns (the last one partial), scale = amax / 448 (1 for a group of zeros); both divisions correctly rounded
    on every device, as in the kernels (`act_quant`), so the two agree bit for bit."""
    K = x.shape[-1]
    kb = -(-K // block)
    xp = torch.nn.functional.pad(x.float(), (0, kb * block - K)).view(*x.shape[:-1], kb, block)
    amax = xp.abs().amax(dim=-1)
    # a tensor divisor: torch on CUDA multiplies by the rounded reciprocal of a Python-number divisor, which moves
    # the scale by an ulp now and then and with it the rounding of values on an e4m3 tie (common for bf16 inputs)
    scale = torch.where(amax > 0, amax / amax.new_tensor(E4M3_MAX), torch.ones_like(amax))
    q = (xp / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).view(*x.shape[:-1], kb * block)[..., :K]
    return q.to(torch.float8_e4m3fn), scale


def act_quant_dequant_torch(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """x [..., K] → fp32 [..., K]: x as the w8a8 kernels multiply it, `act_quant_torch`'s e4m3 values times their
    group's scale."""
    q, s = act_quant_torch(x, block)
    return q.float() * s.repeat_interleave(block, dim=-1)[..., :x.shape[-1]]


def check_fp8_linear_args(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                          bias: torch.Tensor | None) -> None:
    """Shapes and dtypes of a `fp8_block_linear` call; raises ValueError naming the offending argument."""
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_block_linear: weight must be float8_e4m3fn [N, K], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    N, K = weight.shape
    if x.shape[-1] != K or not x.is_floating_point() or x.dtype == torch.float8_e4m3fn:
        raise ValueError(f"fp8_block_linear: x must be a float tensor [..., {K}], got {x.dtype} {tuple(x.shape)}")
    want = (-(-N // BLOCK), -(-K // BLOCK))
    if tuple(weight_scale_inv.shape) != want or weight_scale_inv.dtype != torch.float32:
        raise ValueError(f"fp8_block_linear: weight_scale_inv must be float32 {list(want)} for a [{N}, {K}] "
                         f"weight, got {weight_scale_inv.dtype} {tuple(weight_scale_inv.shape)}")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"fp8_block_linear: bias must be [{N}], got {tuple(bias.shape)}")
    if len({t.device for t in (x, weight, weight_scale_inv) + ((bias,) if bias is not None else ())}) != 1:
        raise ValueError("fp8_block_linear: x, weight, weight_scale_inv and bias must be on one device")


def fp8_block_linear_torch(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, *,
                           bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ (weight · scale)ᵀ (+ bias) with the weight dequantised and the product in fp32 (the activations are
    not quantised: the reference is the exact product of the stored weights); out_dtype defaults to x's."""
    check_fp8_linear_args(x, weight, weight_scale_inv, bias)
    y = x.float() @ weight_dequant(weight, weight_scale_inv).T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def fp8_block_linear_w8a8_torch(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, *,
                                bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
                                ) -> torch.Tensor:
    """The w8a8 kernels' arithmetic in torch (DeepSeek's inference numerics): x quantised per token per 128 columns
    (`act_quant_torch`), times the dequantised weight in fp32 (+ bias in fp32), rounded once to out_dtype (default
    x's). Equals the kernels up to the fp32 sums' order. No host synchronisation."""
    check_fp8_linear_args(x, weight, weight_scale_inv, bias)
    y = act_quant_dequant_torch(x) @ weight_dequant(weight, weight_scale_inv).T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)
