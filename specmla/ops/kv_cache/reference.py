"""Torch reference of the quantised cache rows: encode a step's latents, decode rows back to values."""

from __future__ import annotations

import torch

from specmla.ops.kv_cache import tbq4
from specmla.ops.kv_cache.layout import (FP8_BLOCK, FP8_FORMATS, FP8_MAX, QUANTIZED, ROPE_GROUP, rope_offset,
                                         rope_scales_offset)


def rope_int8(k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, Dr] → (int8 values [T, Dr], fp16 scales [T, Dr/8]): per 8 values amax / 127, rounded to fp16 first (so
    that the values are coded with the scale the reader uses; kept within fp16's [2⁻²⁴, 65504], so an all-zero group
    codes to zeros and values beyond 127 · 65504 saturate), then round-half-even of value / scale."""
    T, dr = k_pe.shape
    groups = k_pe.float().view(T, dr // ROPE_GROUP, ROPE_GROUP)
    scale = (groups.abs().amax(-1, keepdim=True) / 127).clamp(2.0 ** -24, 65504.0).half()
    values = torch.round(groups / scale.float()).clamp(-127, 127).to(torch.int8)
    return values.view(T, dr), scale.view(T, -1)


def encode_rows(kv_format: str, c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """[T, Dc], [T, Dr] → the cache rows of `kv_format` (quantized formats only)."""
    T, dc = c_kv.shape
    rope = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8).view(T, -1)
    if kv_format in FP8_FORMATS:
        blocks = c_kv.float().view(T, dc // FP8_BLOCK, FP8_BLOCK)
        scale = (blocks.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
        codes = (blocks / scale).to(torch.float8_e4m3fn).view(torch.uint8).view(T, dc)
        if kv_format == "fp8":
            values, rope_scale = rope_int8(k_pe)
            rope = torch.cat([rope_scale.view(torch.uint8), values.view(torch.uint8)], dim=-1)
        return torch.cat([codes, scale.view(T, -1).contiguous().view(torch.uint8).view(T, -1), rope], dim=-1)
    if kv_format == "tbq4":
        rows = torch.zeros(T, tbq4.cache_row_bytes(dc, k_pe.shape[-1]), dtype=torch.uint8, device=c_kv.device)
        rope_at = tbq4.rope_offset(dc)
        rows[:, : tbq4.row_bytes(dc)] = tbq4.quantize(c_kv)
        rows[:, rope_at : rope_at + rope.shape[-1]] = rope
        return rows
    raise ValueError(f"{kv_format!r} is not a quantized format")


def decode_rows(kv_format: str, rows: torch.Tensor, dc: int, dr: int, dtype=torch.float32) -> torch.Tensor:
    """Cache rows → [..., Dc + Dr] values in the original (unrotated) domain."""
    if kv_format not in QUANTIZED:
        return rows.to(dtype)
    lead = rows.shape[:-1]
    rows = rows.reshape(-1, rows.shape[-1])
    T = rows.shape[0]
    rope = decode_rope(kv_format, rows, dc, dr)
    if kv_format in FP8_FORMATS:
        codes = rows[:, :dc].contiguous().view(torch.float8_e4m3fn).float().view(T, dc // FP8_BLOCK, FP8_BLOCK)
        scale = rows[:, dc : dc + 4 * (dc // FP8_BLOCK)].contiguous().view(torch.float32).view(T, -1, 1)
        c_kv = (codes * scale).view(T, dc)
    else:
        c_kv = tbq4.dequantize(rows[:, : tbq4.row_bytes(dc)].contiguous(), dc)
    return torch.cat([c_kv, rope], dim=-1).to(dtype).view(*lead, dc + dr)


def decode_rope(kv_format: str, rows: torch.Tensor, dc: int, dr: int) -> torch.Tensor:
    """Quantised rows [..., W] → their rope part [..., Dr] in fp32: the bf16 values, or (fp8) the int8
    values × their group's fp16 scale."""
    rope_at = rope_offset(kv_format, dc, dr)
    if kv_format != "fp8":
        return rows[..., rope_at : rope_at + 2 * dr].contiguous().view(torch.bfloat16).float()
    scale = rows[..., rope_scales_offset(dc) : rope_at].contiguous().view(torch.float16).float()
    values = rows[..., rope_at : rope_at + dr].contiguous().view(torch.int8).float()
    lead = rows.shape[:-1]
    return (values.view(*lead, -1, ROPE_GROUP) * scale.view(*lead, -1, 1)).view(*lead, dr)
