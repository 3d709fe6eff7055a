"""Latent KV cache formats and the writes of a step's latents into the paged cache (torch reference).

One cache row per token holds [c_kv (Dc) | k_pe (Dr)] (after kv_a_layernorm and rope) in one of:
- "native" (bf16 / fp16 / fp32): the values themselves, width Dc + Dr;
- "fp8": FlashMLA's 656-byte layout for Dc=512, Dr=64 — Dc e4m3 bytes, one fp32 scale per 128
  values (amax / 448), then Dr bf16 values; uint8 rows of Dc + 4·Dc/128 + 2·Dr bytes;
- "tbq4": c_kv in 128-blocks rotated by the FWHT and coded on 16 Lloyd–Max centroids (see
  `ops.tbq4`), then Dr bf16 values; uint8 rows of 66·Dc/128 + 2·Dr bytes.
`slot_mapping` holds page * page_size + offset for each new token.
"""

from __future__ import annotations

import torch

from specmla.ops import tbq4

QUANTIZED = ("fp8", "tbq4")
FP8_MAX = 448.0
FP8_BLOCK = 128


def row_spec(kv_format: str, dc: int, dr: int, native_dtype: torch.dtype) -> tuple[int, torch.dtype]:
    """(row width, element dtype) of one cached token."""
    if kv_format in ("auto", "native", "bf16", "fp16", "fp32"):
        return dc + dr, native_dtype
    if kv_format == "fp8":
        if dc % FP8_BLOCK:
            raise ValueError(f"fp8 cache needs Dc divisible by {FP8_BLOCK}, got {dc}")
        return dc + 4 * (dc // FP8_BLOCK) + 2 * dr, torch.uint8
    if kv_format == "tbq4":
        if dc % tbq4.BLOCK:
            raise ValueError(f"tbq4 cache needs Dc divisible by {tbq4.BLOCK}, got {dc}")
        return tbq4.row_bytes(dc) + 2 * dr, torch.uint8
    raise ValueError(f"unknown kv format {kv_format!r} (bf16 | fp16 | fp32 | fp8 | tbq4)")


def encode_rows(kv_format: str, c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """[T, Dc], [T, Dr] → the cache rows of `kv_format` (quantized formats only)."""
    T, dc = c_kv.shape
    rope = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8).view(T, -1)
    if kv_format == "fp8":
        blocks = c_kv.float().view(T, dc // FP8_BLOCK, FP8_BLOCK)
        scale = (blocks.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
        codes = (blocks / scale).to(torch.float8_e4m3fn).view(torch.uint8).view(T, dc)
        return torch.cat([codes, scale.view(T, -1).contiguous().view(torch.uint8).view(T, -1), rope], dim=-1)
    if kv_format == "tbq4":
        return torch.cat([tbq4.quantize(c_kv), rope], dim=-1)
    raise ValueError(f"{kv_format!r} is not a quantized format")


def decode_rows(kv_format: str, rows: torch.Tensor, dc: int, dr: int, dtype=torch.float32) -> torch.Tensor:
    """Cache rows → [..., Dc + Dr] values in the original (unrotated) domain."""
    if kv_format not in QUANTIZED:
        return rows.to(dtype)
    lead = rows.shape[:-1]
    rows = rows.reshape(-1, rows.shape[-1])
    T = rows.shape[0]
    rope = rows[:, -2 * dr :].contiguous().view(torch.bfloat16).float()
    if kv_format == "fp8":
        codes = rows[:, :dc].contiguous().view(torch.float8_e4m3fn).float().view(T, dc // FP8_BLOCK, FP8_BLOCK)
        scale = rows[:, dc : dc + 4 * (dc // FP8_BLOCK)].contiguous().view(torch.float32).view(T, -1, 1)
        c_kv = (codes * scale).view(T, dc)
    else:
        c_kv = tbq4.dequantize(rows[:, : tbq4.row_bytes(dc)].contiguous(), dc)
    return torch.cat([c_kv, rope], dim=-1).to(dtype).view(*lead, dc + dr)


def write_kv_cache(kv_cache: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor,
                   kv_format: str = "auto") -> None:
    """Scatter the step's latents (quantising them first for fp8/tbq4) into their cache slots.
    kv_cache [num_pages, page_size, width]; c_kv [T, Dc]; k_pe [T, Dr]; slot_mapping int [T]."""
    dc, dr = c_kv.shape[-1], k_pe.shape[-1]
    width, _ = row_spec(kv_format, dc, dr, kv_cache.dtype)
    if kv_cache.shape[-1] != width:
        raise ValueError(f"cache row width {kv_cache.shape[-1]} != {width} for format {kv_format} (Dc={dc}, Dr={dr})")
    flat = kv_cache.view(-1, width)
    if kv_format in QUANTIZED:
        rows = encode_rows(kv_format, c_kv, k_pe)
    else:
        rows = torch.cat([c_kv, k_pe], dim=-1).to(kv_cache.dtype)
    flat.index_copy_(0, slot_mapping.long(), rows)


def gather_kv_cache(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Contiguous copy [length, width] of one request's first `length` cached rows (block_table int [P])."""
    page_size = kv_cache.shape[1]
    n_pages = -(-length // page_size)
    return kv_cache[block_table[:n_pages].long()].reshape(-1, kv_cache.shape[-1])[:length]
