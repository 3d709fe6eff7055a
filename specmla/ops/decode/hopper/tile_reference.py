"""Torch emulation of `dequant_seesaw`'s rounding, for quality checks: the quantised keys' latent part dequantised
into fp16 tiles (fp8: the code times the scale rounded to fp16, the product rounded once; tbq4: in the rotated
domain, the fp16 centroid times the fp16 norm, rounded once), the rope part in bf16, q's latent part in fp16 (from
bf16) and its rope in bf16, scores and sums in fp32, P rounded to fp16 for P·V.

P is rounded against each row's final max rather than the running max of the kernel's online softmax: both
round P to fp16's 2⁻¹¹ relative, which is what the quality checks see.
"""

from __future__ import annotations

import torch

from specmla.ops.decode.reference import check_args
from specmla.ops.kv_cache import tbq4
from specmla.ops.kv_cache.layout import FP8_BLOCK, FP8_FORMATS
from specmla.ops.kv_cache.reference import decode_rope
from specmla.ops.kv_cache.rotation import rotate_rows_torch

FORMATS = ("fp8", "fp8_ds_mla", "tbq4")


def tile_rows(kv_format: str, rows: torch.Tensor, dc: int, dr: int) -> torch.Tensor:
    """Quantised rows [T, W] → the tile rows [T, Dc + Dr] the kernel's producer writes, as fp32 values: the latent
    part rounded to fp16 (tbq4: in the rotated domain), the rope part to bf16."""
    T = rows.shape[0]
    if kv_format in FP8_FORMATS:
        codes = rows[:, :dc].contiguous().view(torch.float8_e4m3fn).float().view(T, dc // FP8_BLOCK, FP8_BLOCK)
        scale = rows[:, dc : dc + 4 * (dc // FP8_BLOCK)].contiguous().view(torch.float32).view(T, -1, 1)
        latent = (codes * scale.half().float()).view(T, dc).half()  # an exact fp32 product, rounded once
    else:
        nb, block = dc // tbq4.BLOCK, tbq4.BLOCK
        norms = rows[:, dc // 2 : dc // 2 + 2 * nb].contiguous().view(torch.float16).float().view(T, nb, 1)
        packed = rows[:, : dc // 2].long().view(T, nb, block // 2)
        idx = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(T, nb, block)
        centroids = tbq4.centroids(rows.device).half().float()
        latent = (centroids[idx] * norms).view(T, dc).half()
    return torch.cat([latent.float(), decode_rope(kv_format, rows, dc, dr).bfloat16().float()], dim=-1)


def e4m3_codes(kv_format: str, rows: torch.Tensor, dc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The e4m3 values `fp8_folded` multiplies and their per-key, per-chunk fp32 scales, from quantised rows
    [B, L, W]: fp8 formats' codes and scales; tbq4's codes decoded to e4m3 centroid·k (`tbq4.e4m3_centroids`) and
    norm / k. Returns ([B, L, nc, 128], [B, L, nc])."""
    from specmla.ops.decode.hopper.e4m3_reference import _cache_fields

    codes, scales, _ = _cache_fields(kv_format, rows, dc, 64)
    if kv_format == "tbq4":
        scales = scales * torch.tensor(1.0 / tbq4.e4m3_centroids()[0], dtype=torch.float32)
    return codes, scales


def e4m3_latent_scores(q_lat: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                       q_split: bool = False) -> torch.Tensor:
    """q's latent part [B, S, H, Dc] (tbq4: rotated) against the e4m3 values and scales of `e4m3_codes` as
    `fp8_folded` computes it: q as one e4m3 term (two, hi + lo, with q_split: the rejected variant) of q / sq with one
    scale sq per row (`e4m3_reference.quantize_q`), times the e4m3 values per 128-column chunk, each chunk's partial
    times the key's fp32 scale, the sum times sq: [B, S, H, L] fp32."""
    from specmla.ops.decode.hopper.e4m3_reference import quantize_q

    nc = codes.shape[-2]
    q8, sq = quantize_q(q_lat, q_split=q_split)
    partial = torch.einsum("bshcd,blcd->bshlc", q8.view(*q8.shape[:-1], nc, FP8_BLOCK).double(), codes.double())
    return ((partial * scales[:, None, None].double()).sum(-1) * sq[..., None].double()).float()


def mla_decode_tiles(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                          softmax_scale: float, *, causal: bool = True, kv_format: str = "fp8",
                          head_dim_v: int | None = None, return_lse: bool = False, e4m3_scores: bool = False,
                          q_split: bool = False):
    """`mla_decode_torch`'s contract with `dequant_seesaw`'s rounding: out [B, S, H, Dc] in q's dtype, and with
    return_lse the natural-log sum of exp of the scores [B, S, H] in fp32 (-inf for rows that see no key).
    e4m3_scores: `fp8_folded`'s rounding instead: the latent part of the scores from q in one e4m3 term (two with
    q_split) against the e4m3 values (`e4m3_latent_scores`); P·V as before for fp8 formats (the two kernels build the
    same fp16 values), for tbq4 on the e4m3 centroid·k times norm / k in fp16."""

    if kv_format not in FORMATS:
        raise ValueError(f"mla_decode_tiles emulates the quantised formats {FORMATS}; got {kv_format!r}")
    head_dim_v = q.shape[-1] - 64 if head_dim_v is None else head_dim_v
    check_args(q, kv_cache, block_table, seq_lens, head_dim_v, kv_format)
    B, S, H, D = q.shape
    dc, dr = head_dim_v, D - head_dim_v
    page_size = kv_cache.shape[1]
    L = block_table.shape[1] * page_size
    pages = kv_cache[block_table.long().clamp(0, kv_cache.shape[0] - 1)].reshape(B * L, kv_cache.shape[-1])
    kv = tile_rows(kv_format, pages, dc, dr).float().view(B, L, D)
    if e4m3_scores:
        codes, scales = e4m3_codes(kv_format, pages.view(B, L, -1), dc)
    if e4m3_scores and kv_format == "tbq4":  # P·V on e4m3 centroid·k times norm / k in fp16, rounded once
        lat = (codes.half().float() * scales.half().float()[..., None]).half().float().view(B, L, dc)
        kv = torch.cat([lat, kv[..., dc:]], dim=-1)
    pos = torch.arange(L, device=q.device)
    seq = seq_lens.long().to(q.device)
    valid = pos[None, :] < seq[:, None]
    kv = torch.where(valid[..., None], kv, torch.zeros((), device=q.device))  # rows past the end read zeros
    qb = q.float()
    if kv_format == "tbq4":  # attention in the rotated domain: q's latent part rotated once
        qb = rotate_rows_torch(qb.reshape(-1, D), dc).view(B, S, H, D)
    qb = qb.bfloat16().float()
    q_lat = qb[..., :dc]  # as the e4m3 kernel reads it (bf16)
    qb = torch.cat([qb[..., :dc].half().float(), qb[..., dc:]], dim=-1)  # the latent part as the kernel's fp16
    if e4m3_scores:
        lat = e4m3_latent_scores(q_lat, codes, scales, q_split)
        scores = (lat + torch.einsum("bshd,bld->bshl", qb[..., dc:], kv[..., dc:])) * softmax_scale
    else:
        scores = torch.einsum("bshd,bld->bshl", qb, kv) * softmax_scale
    mask = valid[:, None, None, :]
    if causal:
        limit = seq[:, None] - S + torch.arange(S, device=q.device)[None, :] + 1
        mask = mask & (pos[None, None, :] < limit[:, :, None])[:, :, None, :]
    scores = scores.masked_fill(~mask, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - torch.where(torch.isinf(m), 0.0, m))
    l_sum = p.sum(dim=-1, keepdim=True)
    o = torch.einsum("bshl,blc->bshc", p.half().float(), kv[..., :dc]) / torch.where(l_sum > 0, l_sum, 1.0)
    if kv_format == "tbq4":  # the output back to the original domain
        o = rotate_rows_torch(o.reshape(-1, dc), dc).view(B, S, H, dc)
    if return_lse:
        lse = torch.where(l_sum > 0, m + torch.log(torch.where(l_sum > 0, l_sum, 1.0)), float("-inf"))
        return o.to(q.dtype), lse.squeeze(-1)
    return o.to(q.dtype)
