"""Latent KV cache formats and the writes of a step's latents into the paged cache (torch reference).

One cache row per token holds [c_kv (Dc) | k_pe (Dr)] (after kv_a_layernorm and rope) in one of:
- "native" (bf16 / fp16 / fp32): the values themselves, width Dc + Dr;
- "fp8": Dc e4m3 bytes with one fp32 scale per 128 values (amax / 448), as in FlashMLA's layout, then the
  rope in int8 with one fp16 scale per 8 values (amax / 127): Dr/8 scales, then Dr int8 values — 608 bytes
  for Dc=512, Dr=64, 7 % fewer than FlashMLA's 656 (the decode reads them at the copy rate). One scale per 8
  rope values keeps the attention at the exact fp8 path's quality, where one scale per token does not;
- "fp8_ds_mla": FlashMLA's 656-byte layout for Dc=512, Dr=64 (vLLM's name for it): the same codes and scales,
  then Dr bf16 values; uint8 rows of Dc + 4·Dc/128 + 2·Dr bytes;
- "tbq4": c_kv in 128-blocks rotated by the FWHT and coded on 16 Lloyd–Max centroids (see
  `kv_cache.tbq4`: all codes, then the blocks' fp16 norms), then Dr bf16 values, each field starting
  16-byte aligned and the row padded to a multiple of 16 bytes (`tbq4.cache_row_bytes`: 400 for
  Dc=512, Dr=64 — 256 of codes, 8 of norms, 8 of padding, 128 of rope), so that TMA can copy it.
`slot_mapping` holds page * page_size + offset for each new token.
"""

from __future__ import annotations

import torch

from specmla.ops.kv_cache import tbq4
from specmla.ops.kv_cache.layout import (FP8_BLOCK, FP8_FORMATS, FP8_MAX, QUANTIZED, ROPE_GROUP, rope_offset,
                                         rope_scales_offset, row_spec)
from specmla.ops.kv_cache.reference import decode_rope, decode_rows, encode_rows, rope_int8
from specmla.ops.kv_cache.triton import rows_kernel_takes, write_kv_cache_triton, write_kv_rows_triton

__all__ = ["FP8_BLOCK", "FP8_FORMATS", "FP8_MAX", "QUANTIZED", "ROPE_GROUP", "decode_rope", "decode_rows",
           "encode_rows", "gather_kv_cache", "rope_int8", "rope_offset", "rope_scales_offset", "row_spec", "tbq4",
           "write_kv_cache", "write_kv_cache_triton", "write_kv_rows_triton"]


def write_kv_cache(kv_cache: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor,
                   kv_format: str = "auto") -> None:
    """Scatter the step's latents (quantising them first for fp8/tbq4) into their cache slots.
    kv_cache [num_pages, page_size, width]; c_kv [T, Dc]; k_pe [T, Dr]; slot_mapping int [T]."""
    dc, dr = c_kv.shape[-1], k_pe.shape[-1]
    width, _ = row_spec(kv_format, dc, dr, kv_cache.dtype)
    if kv_cache.shape[-1] != width:
        raise ValueError(f"cache row width {kv_cache.shape[-1]} != {width} for format {kv_format} (Dc={dc}, Dr={dr})")
    if kv_format in QUANTIZED and c_kv.is_cuda:  # the fused kernel on the GPU
        return write_kv_cache_triton(kv_cache, c_kv, k_pe, slot_mapping, kv_format)
    if c_kv.is_cuda and rows_kernel_takes(kv_cache, c_kv, k_pe):
        return write_kv_rows_triton(kv_cache, c_kv, k_pe, slot_mapping)  # one kernel instead of cat + scatter
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
