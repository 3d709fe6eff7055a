"""Writes of the step's latents into the paged cache (torch reference).

One cache row per token = [c_kv (Dc) | k_pe (Dr)] (after kv_a_layernorm and rope). `slot_mapping`
holds page * page_size + offset for each new token.
Quantised formats (fp8, tbq4) will get their own pack + quantize path here.
"""

from __future__ import annotations

import torch


def write_kv_cache(kv_cache: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache [num_pages, page_size, Dc+Dr]; c_kv [T, Dc]; k_pe [T, Dr]; slot_mapping int [T]."""
    dc, dr = c_kv.shape[-1], k_pe.shape[-1]
    if kv_cache.shape[-1] != dc + dr:
        raise ValueError(f"cache row width {kv_cache.shape[-1]} != Dc+Dr = {dc}+{dr}")
    flat = kv_cache.view(-1, dc + dr)
    rows = torch.cat([c_kv, k_pe], dim=-1).to(kv_cache.dtype)
    flat.index_copy_(0, slot_mapping.long(), rows)


def gather_kv_cache(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Contiguous copy [length, D] of one request's first `length` cached tokens (block_table int [P])."""
    page_size = kv_cache.shape[1]
    n_pages = -(-length // page_size)
    return kv_cache[block_table[:n_pages].long()].reshape(-1, kv_cache.shape[-1])[:length]
