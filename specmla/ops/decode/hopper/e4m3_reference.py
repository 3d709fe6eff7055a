"""Torch emulation of the Hopper e4m3 decode kernels' arithmetic (`hopper.fp8` for fp8 caches, `hopper.tbq4` for
tbq4 caches).

Why: those kernels run Q·Kᵀ and P·V as e4m3 tensor-core matmuls, so they round q and P where the torch reference
(`mla_decode_torch`: exact arithmetic over the decoded rows) does not. This module repeats their rounding step by
step on the CPU, so that (1) the end-to-end quality of those kernels (attention cosine, perplexity, greedy
agreement: `benchmarks/kv_quant_quality.py`) can be measured without a GPU, and (2) their GPU tests have a tighter
reference than the exact one.

What is emulated (read from the kernels' sources):
- q's latent part: one scale per query row, sq = max(max|q_lat|, 1e-30) / 448 (`quant_common._load_q`), then
  hi = e4m3(q·448/max) and, with q_split, lo = e4m3(q·448/max − hi); the rope parts of q and of the keys in bf16.
- Keys in blocks of `block_n` (64); per block and 128-column chunk c the producer's scales: fp8
  (`fp8._store_scales`): f_c = max_{valid keys} scale_{k,c} / 448, sc_{k,c} = scale_{k,c} / f_c; tbq4
  (`tbq4._store_block_scales`): one factor per block for all chunks, m = max_{valid keys, chunks} norm,
  sc = norm · (448 / m), f = m · (1/k) / 448, the key values e4m3(centroid·k) (`kv_cache.tbq4.e4m3_centroids`).
- Scores s = (Σ_c (q8·codes_c) · (sc_c · f_c)) · sq + q_pe·k_pe, then the online softmax in base 2 (`_softmax_keys`):
  P = exp2(s·scale·log2e − m) at the running max, row sums kept per key slot and summed at the end.
- P·V: y_c = min(P · sc_c, 448) as the kernel's P format (`p_format`): "fp16" (the fp8 kernel: Vᵀ's codes are exact
  in fp16, y rounded to fp16) or "e4m3" (one term, the tbq4 kernel); O_c = O_c · alpha · f_prev / f_c + y_c·codes_c,
  and O_c · f_last at the end.
- Two consumers take the even and the odd blocks, each with its own softmax state, and merge at the end.
Products of e4m3 values are exact in fp32; each matmul is summed in fp64 and rounded to fp32 once, i.e. an ideal
fp32 accumulator (the tensor cores' own accumulation order and precision are not modelled). Each batch row is
one split starting at key 0 (the split launch and its combine are not modelled). Causal key ranges follow the
kernels with one query token per program (FOLD = 1): the scales' "valid" keys end at the query token's limit.

The kernels are not bit-exact against it: Hopper's fp8 tensor cores accumulate more coarsely than fp32, which moves
P a little, and rounding P to one e4m3 term turns that into whole-step differences. Triton's fp32 → e4m3 conversion
rounds to nearest even, as here.
"""

from __future__ import annotations

import torch

from specmla.ops.kv_cache import tbq4
from specmla.ops.kv_cache import FP8_BLOCK, FP8_FORMATS, decode_rope
from specmla.ops.decode.reference import check_args

E4M3_MAX = 448.0
LOG2E = 1.4426950408889634
FORMATS = ("fp8_ds_mla", "fp8", "tbq4")


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 → the nearest e4m3fn value (ties to even, subnormals included, saturating at ±448), as fp32."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def quantize_q(q_lat: torch.Tensor, q_split: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q's latent part [..., Dc] → (hi (+ lo) as fp32 [..., Dc], the row scale sq [...]) as `quant_common._load_q`."""
    x = q_lat.float()
    amax = x.abs().amax(-1).clamp_min(1e-30)
    sq = amax / E4M3_MAX
    y = x * (E4M3_MAX / amax)[..., None]  # the kernels multiply by the reciprocal
    hi = round_e4m3(y)
    return (hi + round_e4m3(y - hi) if q_split else hi), sq


def _mm(a: torch.Tensor, b: torch.Tensor, eq: str) -> torch.Tensor:
    """A matmul with an ideal fp32 accumulator: summed in fp64, rounded once."""
    return torch.einsum(eq, a.double(), b.double()).float()


def _cache_fields(kv_format: str, rows: torch.Tensor, dc: int, dr: int):
    """uint8 rows [B, L, W] → (key values [B, L, nc, 128] fp32 as the matmuls read them, per-key per-chunk scales
    [B, L, nc] fp32 (fp8: the fp32 scales; tbq4: the fp16 norms), rope [B, L, Dr] (bf16 values as fp32))."""
    B, L, _ = rows.shape
    nc = dc // FP8_BLOCK
    # bf16 values as they are; fp8's int8 × fp16 scale rounded to bf16, as the producer converts it
    rope = decode_rope(kv_format, rows, dc, dr).bfloat16().float()
    if kv_format in FP8_FORMATS:
        codes = rows[..., :dc].contiguous().view(torch.float8_e4m3fn).float().view(B, L, nc, FP8_BLOCK)
        scales = rows[..., dc : dc + 4 * nc].contiguous().view(torch.float32)
    else:
        _, table = tbq4.e4m3_centroids()
        values = torch.tensor(table, dtype=torch.uint8, device=rows.device).view(torch.float8_e4m3fn).float()
        packed = rows[..., : dc // 2].long().view(B, L, nc, FP8_BLOCK // 2)
        idx = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(B, L, nc, FP8_BLOCK)
        codes = values[idx]
        at = tbq4.norms_offset(dc)
        scales = rows[..., at : at + 2 * nc].contiguous().view(torch.float16).float()
    return codes, scales, rope


def _block_scales(kv_format: str, scales: torch.Tensor, valid: torch.Tensor):
    """One block's producer scales: scales [B, n, nc], valid [B, S, n] → (sc [B, S, n, nc], f [B, S, nc])."""
    s4 = torch.where(valid[..., None], scales[:, None], torch.zeros((), device=scales.device))
    if kv_format in FP8_FORMATS:  # one factor per chunk
        f = s4.amax(2).clamp_min(1e-30) / E4M3_MAX
        return s4 / f[:, :, None], f
    m = s4.amax((2, 3)).clamp_min(1e-30)  # tbq4: one factor per block, for every chunk
    inv_k = torch.tensor(1.0 / tbq4.e4m3_centroids()[0] / E4M3_MAX, dtype=torch.float32)
    f = (m * inv_k)[..., None].expand(*m.shape, scales.shape[-1])
    return s4 * (E4M3_MAX / m)[..., None, None], f


P_FORMATS = ("fp16", "e4m3")


def _p_terms(y: torch.Tensor, p_format: str) -> torch.Tensor:
    """Pᵀ·scale/f as the P·V matmul reads it: y clipped to 448, in fp16 or one e4m3 term."""
    y = y.clamp_max(E4M3_MAX)
    if p_format == "fp16":
        return y.half().float()
    return round_e4m3(y)


class _Consumer:
    """One consumer warpgroup's state over its blocks: running max m [B, S, H] (base 2), row sums per key slot
    [B, S, H, n], Oᵀ per chunk in units of the last block's f [B, S, H, nc, 128], and that f [B, S, nc]."""

    def __init__(self, B, S, H, n, nc, device):
        self.m = torch.full((B, S, H), float("-inf"), device=device)
        self.l_keys = torch.zeros(B, S, H, n, device=device)
        self.o = torch.zeros(B, S, H, nc, FP8_BLOCK, device=device)
        self.f = torch.ones(B, S, nc, device=device)

    def step(self, s2, active, codes, sc, f, p_format):
        """One block: s2 [B, S, H, n] base-2 scores (−inf where hidden), active [B, S] (the block is in this query
        token's range), codes [B, n, nc, 128], sc [B, S, n, nc], f [B, S, nc]."""
        m_new = torch.maximum(self.m, s2.amax(-1))
        m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        alpha = torch.exp2(self.m - m_safe)
        p = torch.exp2(s2 - m_safe[..., None])
        l_keys = self.l_keys * alpha[..., None] + p
        y = _p_terms(p[..., None] * sc[:, :, None], p_format)  # [B, S, H, n, nc]
        rescale = alpha[..., None] * (self.f / f)[:, :, None]  # [B, S, H, nc]
        o = self.o * rescale[..., None] + _mm(y, codes, "bshkc,bkcd->bshcd")
        a3 = active[..., None]
        self.m = torch.where(a3, m_new, self.m)
        self.l_keys = torch.where(a3[..., None], l_keys, self.l_keys)
        self.o = torch.where(a3[..., None, None], o, self.o)
        self.f = torch.where(active[..., None], f, self.f)

    def finish(self):
        """(m, l, O in value units)."""
        return self.m, self.l_keys.sum(-1), self.o * self.f[:, :, None, :, None]


def mla_decode_e4m3(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    *,
    causal: bool = True,
    kv_format: str = "fp8_ds_mla",
    head_dim_v: int | None = None,
    q_split: bool | None = None,
    p_format: str | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """`mla_decode_torch`'s contract with the e4m3 kernels' rounding: out [B, S, H, Dc] in q's dtype.

    kv_format "fp8" / "fp8_ds_mla" (`hopper.fp8`) or "tbq4" (`hopper.tbq4`). q_split: q as two e4m3 terms (default:
    True for fp8, False for tbq4, as the kernels); p_format: how P·scale/f enters P·V, one of `P_FORMATS` (default:
    "fp16" for fp8, "e4m3" for tbq4, as the kernels)."""
    if kv_format not in FORMATS:
        raise ValueError(f"mla_decode_e4m3 emulates the e4m3 kernels of the fp8 and tbq4 caches only; "
                         f"got kv_format={kv_format!r}")
    head_dim_v = q.shape[-1] - 64 if head_dim_v is None else head_dim_v
    check_args(q, kv_cache, block_table, seq_lens, head_dim_v, kv_format)
    if q_split is None:
        q_split = kv_format in FP8_FORMATS
    if p_format is None:
        p_format = "fp16" if kv_format in FP8_FORMATS else "e4m3"
    if p_format not in P_FORMATS:
        raise ValueError(f"p_format must be one of {P_FORMATS}; got {p_format!r}")
    B, S, H, D = q.shape
    dc, dr = head_dim_v, D - head_dim_v
    nc = dc // FP8_BLOCK
    dev = q.device
    page_size = kv_cache.shape[1]
    L = block_table.shape[1] * page_size
    n_blk = -(-L // block_n)
    pages = kv_cache[block_table.long().clamp(0, kv_cache.shape[0] - 1)].reshape(B, L, kv_cache.shape[-1])
    pages = torch.nn.functional.pad(pages, (0, 0, 0, n_blk * block_n - L))  # whole blocks; the pad is never valid
    codes, scales, rope = _cache_fields(kv_format, pages, dc, dr)

    # each query token's key range [0, end): the kernels' `end` (causal: the token's own limit), which is also
    # the range its softmax sees
    seq = seq_lens.long().to(dev)
    end = seq[:, None].expand(B, S)
    if causal:
        end = torch.minimum(end, seq[:, None] - S + torch.arange(S, device=dev)[None, :] + 1)
    pos = torch.arange(n_blk * block_n, device=dev)
    valid = pos[None, None, :] < end[..., None]  # [B, S, L']
    any_valid = valid.any(1)  # [B, L']: rows past every token's end hold anything (NaN codes): zero them
    zero = torch.zeros((), device=dev)
    codes = torch.where(any_valid[..., None, None], codes, zero)
    rope = torch.where(any_valid[..., None], rope, zero)

    q_lat = q[..., :dc]
    if kv_format == "tbq4":  # the caller's rotation (`mla_decode`): in fp32, back to q's dtype
        q_lat = tbq4.rotate_blocks(q_lat.float()).to(q.dtype)
    q8, sq = quantize_q(q_lat, q_split)
    q8 = q8.view(B, S, H, nc, FP8_BLOCK)
    q_pe = q[..., dc:].to(torch.bfloat16).float()
    scale_log2 = torch.tensor(softmax_scale * LOG2E, dtype=torch.float32)

    cons = [_Consumer(B, S, H, block_n, nc, dev) for _ in range(2)]
    for j in range(n_blk):
        ks = slice(j * block_n, (j + 1) * block_n)
        vis = valid[..., ks]  # [B, S, n]
        active = vis.any(-1)  # the block is in the token's range (the kernel runs cdiv(end, block_n) blocks)
        if not active.any():
            continue
        sc, f = _block_scales(kv_format, scales[:, ks], vis)
        cj = codes[:, ks]
        parts = _mm(q8, cj, "bshcd,bkcd->bshck")  # [B, S, H, nc, n]
        s = parts[:, :, :, 0] * (sc[..., 0] * f[..., 0:1])[:, :, None]
        for c in range(1, nc):
            s = s + parts[:, :, :, c] * (sc[..., c] * f[..., c : c + 1])[:, :, None]
        s = s * sq[..., None] + _mm(q_pe, rope[:, ks], "bshr,bkr->bshk")
        s2 = torch.where(vis[:, :, None], s * scale_log2, torch.tensor(float("-inf"), device=dev))
        cons[j % 2].step(s2, active, cj, sc, f, p_format)

    (m0, l0, o0), (m1, l1, o1) = cons[0].finish(), cons[1].finish()
    m_new = torch.maximum(m0, m1)
    m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
    a0, a1 = torch.exp2(m0 - m_safe), torch.exp2(m1 - m_safe)
    l = l0 * a0 + l1 * a1
    o = o0 * a0[..., None, None] + o1 * a1[..., None, None]
    o = o * (1.0 / torch.where(l > 0, l, torch.ones_like(l)))[..., None, None]
    o = o.reshape(B, S, H, dc).to(q.dtype)
    if kv_format == "tbq4":  # accumulated in the rotated domain: rotate back (`mla_decode`)
        o = tbq4.rotate_blocks(o.float()).to(q.dtype)
    return o

