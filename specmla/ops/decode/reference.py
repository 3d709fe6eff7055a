"""Torch reference of MLA decode over a paged latent cache (contract C1), and of the split combine.

Every kernel of this package is checked against `mla_decode_torch`; it gathers each request's pages, masks,
and runs the softmax in fp32 (fp64 when q is fp64).
"""

from __future__ import annotations

import math

import torch

from specmla.ops.kv_cache import decode_rows, row_spec


def check_args(q, kv_cache, block_table, seq_lens, head_dim_v, kv_format="bf16"):
    if q.dim() != 4:
        raise ValueError(f"q must be [B, S, H, D], got shape {tuple(q.shape)}")
    if not 0 < head_dim_v <= q.shape[-1]:
        raise ValueError(f"head_dim_v={head_dim_v} must be in (0, {q.shape[-1]}]")
    width = row_spec(kv_format, head_dim_v, q.shape[-1] - head_dim_v, kv_cache.dtype)[0]
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != width:
        raise ValueError(f"kv_cache must be [num_pages, page_size, {width}] for kv_format {kv_format!r}, "
                         f"got {tuple(kv_cache.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0]:
        raise ValueError(f"block_table must be [B={q.shape[0]}, max_pages], got {tuple(block_table.shape)}")
    if seq_lens.shape != (q.shape[0],):
        raise ValueError(f"seq_lens must be [B={q.shape[0]}], got {tuple(seq_lens.shape)}")


def mla_decode_torch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    *,
    causal: bool = True,
    kv_format: str = "bf16",
    kv_scale=None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    head_dim_v: int | None = None,
):
    """Reference: gather each request's pages, mask, softmax in fp32 (fp64 if q is fp64)."""
    head_dim_v = q.shape[-1] - 64 if head_dim_v is None else head_dim_v
    check_args(q, kv_cache, block_table, seq_lens, head_dim_v, kv_format)
    B, S, H, D = q.shape
    page_size = kv_cache.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    max_pages = block_table.shape[1]
    L = max_pages * page_size
    # [B, L, D]: every page the table names (pages beyond a request's length may hold anything)
    pages = kv_cache[block_table.long().clamp(0, kv_cache.shape[0] - 1)].reshape(B, L, kv_cache.shape[-1])
    kv = decode_rows(kv_format, pages, head_dim_v, D - head_dim_v, acc)  # dequantised for fp8 / tbq4
    pos = torch.arange(L, device=q.device)
    seq = seq_lens.long().to(q.device)
    valid = pos[None, :] < seq[:, None]  # [B, L]
    kv = torch.where(valid[..., None], kv, torch.zeros((), dtype=acc, device=q.device))  # NaN-safe
    scores = torch.einsum("bshd,bld->bshl", q.to(acc), kv) * softmax_scale
    mask = valid[:, None, None, :]
    if causal:  # query s sees j < seq_len - S + s + 1
        limit = seq[:, None] - S + torch.arange(S, device=q.device)[None, :] + 1  # [B, S]
        mask = mask & (pos[None, None, :] < limit[:, :, None])[:, :, None, :]
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, S, H]; -inf for rows with no visible key
    p = torch.exp(scores - lse[..., None].masked_fill(torch.isinf(lse)[..., None], 0.0))
    o = torch.einsum("bshl,blc->bshc", p, kv[..., :head_dim_v])
    o = o.to(q.dtype)
    if out is not None:
        out.copy_(o)
        o = out
    if return_lse:
        return o, lse.float()
    return o


def combine_splits_torch(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Reference for `triton.combine_splits` (same arguments): each row's partials mid_o [B, S, H, splits, Dc]
    weighed by exp2 of their log2-sum-exps mid_lse [B, S, H, splits]; writes out and its natural-log lse."""
    parts, lses = mid_o.float(), mid_lse.float()
    merged = torch.logsumexp(lses * math.log(2), dim=3)  # natural log
    w = torch.exp(lses * math.log(2) - torch.where(torch.isinf(merged), 0.0, merged)[..., None])
    out.copy_(torch.einsum("bshp,bshpd->bshd", w, parts).to(out.dtype))
    lse.copy_(merged)
