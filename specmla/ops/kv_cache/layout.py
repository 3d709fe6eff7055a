"""Byte layout of one cached token in each KV cache format (see the package docstring)."""

from __future__ import annotations

import torch

from specmla.ops.kv_cache import tbq4

QUANTIZED = ("fp8", "fp8_ds_mla", "tbq4")
FP8_FORMATS = ("fp8", "fp8_ds_mla")  # e4m3 codes with per-128 fp32 scales; the rope in int8 or in bf16
FP8_MAX = 448.0
FP8_BLOCK = 128
ROPE_GROUP = 8  # (fp8) rope values per fp16 scale


def row_spec(kv_format: str, dc: int, dr: int, native_dtype: torch.dtype) -> tuple[int, torch.dtype]:
    """(row width, element dtype) of one cached token."""
    if kv_format in ("auto", "native", "bf16", "fp16", "fp32"):
        return dc + dr, native_dtype
    if kv_format in FP8_FORMATS:
        if dc % FP8_BLOCK:
            raise ValueError(f"{kv_format} cache needs Dc divisible by {FP8_BLOCK}, got {dc}")
        if kv_format == "fp8_ds_mla":
            return dc + 4 * (dc // FP8_BLOCK) + 2 * dr, torch.uint8
        if dr % ROPE_GROUP:
            raise ValueError(f"fp8 cache needs Dr divisible by {ROPE_GROUP}, got {dr}")
        return rope_offset(kv_format, dc, dr) + dr, torch.uint8
    if kv_format == "tbq4":
        if dc % tbq4.BLOCK:
            raise ValueError(f"tbq4 cache needs Dc divisible by {tbq4.BLOCK}, got {dc}")
        return tbq4.cache_row_bytes(dc, dr), torch.uint8
    raise ValueError(f"unknown kv format {kv_format!r} (bf16 | fp16 | fp32 | fp8 | fp8_ds_mla | tbq4)")


def rope_scales_offset(dc: int) -> int:
    """(fp8) Byte offset of the rope's fp16 scales: after the codes and their scales."""
    return dc + 4 * (dc // FP8_BLOCK)


def rope_offset(kv_format: str, dc: int, dr: int) -> int:
    """Byte offset of the rope part in a quantised row: bf16 values (fp8_ds_mla: after the codes and scales;
    tbq4), or (fp8) int8 values after the rope's scales."""
    if kv_format == "fp8_ds_mla":
        return rope_scales_offset(dc)
    if kv_format == "fp8":
        return rope_scales_offset(dc) + 2 * (dr // ROPE_GROUP)
    return tbq4.rope_offset(dc)
