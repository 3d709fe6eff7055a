"""Gluon helpers shared by the Hopper decode kernels of quantised caches (`dequant`, `fp8`, `tbq4`).

Every one of them reads Dc = 512, Dr = 64 rows (four 128-column chunks with one scale or norm each, then the rope
part), keeps the keys as the matmuls' M dimension (Sᵀ = K·Qᵀ is [keys, rows], Oᵀ = Vᵀ·Pᵀ is [columns, rows]), and
shares the Triton kernel's grid, split rule and partial layout (`mla_decode_triton`'s combine merges the splits).
"""

from __future__ import annotations

import os

import torch

from specmla.ops.decode.hopper import common as G
from specmla.ops.kv_cache import row_spec, tbq4

if G.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import tma

    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # renamed after Triton 3.6

BLOCK_N = 64  # keys per block
DC, DR = 512, 64  # the latent and rope widths every quantised-cache kernel reads
ROW_BYTES = {fmt: row_spec(fmt, DC, DR, torch.uint8)[0] for fmt in ("fp8", "fp8_ds_mla", "tbq4")}  # 608, 656, 400

_SOURCE_KEY = G.source_key(__file__)  # in each kernel's SOURCE_KEY (see G.source_key)
_c = getattr(gl, "constexpr", int) if G.HAVE_GLUON else int
TBQ4_ROPE_AT = _c(tbq4.rope_offset(DC) // 2)  # the rope part of a tbq4 row, in bf16 units

# e4m3 codes of four keys (one 32-bit word each, byte b = column 4w + b) → four words, word b holding column
# 4w + b of the four keys (byte k = key k): a 4 × 4 byte transpose
_TRANSPOSE4 = _c("""{
.reg .b32 t0, t1, t2, t3;
prmt.b32 t0, $4, $5, 0x5140;
prmt.b32 t1, $4, $5, 0x7362;
prmt.b32 t2, $6, $7, 0x5140;
prmt.b32 t3, $6, $7, 0x7362;
prmt.b32 $0, t0, t2, 0x5410;
prmt.b32 $1, t0, t2, 0x7632;
prmt.b32 $2, t1, t3, 0x5410;
prmt.b32 $3, t1, t3, 0x7632;
}""")
# Two fp32 values rounded to e4m3 (nearest, ties to even) and back to fp32 by the hardware's conversions (e4m3 → f16
# is exact). Triton's own `.to(float8e4nv).to(float32)` round trip can keep unrounded values, so lo = y − hi is
# taken against this hi.
_ROUND_E4M3_PAIR = _c("""{
.reg .b16 q8, h0, h1;
.reg .b32 h2;
cvt.rn.satfinite.e4m3x2.f32 q8, $3, $2;
cvt.rn.f16x2.e4m3x2 h2, q8;
mov.b32 {h0, h1}, h2;
cvt.f32.f16 $0, h0;
cvt.f32.f16 $1, h1;
}""")

# `_latent_column`'s orders of latent columns: the dequant kernel's fp8 and tbq4 tiles, the e4m3 kernels' Vᵀ fragments
FMT_FP8, FMT_TBQ4, FMT_E4M3 = _c(0), _c(1), _c(2)


def hopper_rows_supported(q: torch.Tensor, kv_cache: torch.Tensor, row_bytes: int) -> bool:
    """What every Hopper kernel for quantised rows needs: a Hopper GPU outside the interpreter, bf16 queries of
    Dc + Dr = 576 columns, contiguous uint8 rows of `row_bytes`, 16-byte aligned (the kernels read 16- or 8-byte
    vectors or TMA boxes)."""
    if not G.HAVE_GLUON or not q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    return (q.dtype == torch.bfloat16 and q.shape[-1] == DC + DR and kv_cache.dtype == torch.uint8
            and kv_cache.is_contiguous() and kv_cache.shape[-1] == row_bytes and kv_cache.data_ptr() % 16 == 0)


def tma_launch_args(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2, plan, *, causal: bool,
                    direct: bool, num_splits: int, block_m: int, views: tuple) -> tuple:
    """`G.split_launch_args` for the kernels that read the cache through TMA descriptors (`views`) and take no
    pointer-path layouts or widths."""
    grid, args, consts = G.split_launch_args(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2,
                                             plan, dc=DC, causal=causal, direct=direct, num_splits=num_splits,
                                             block_n=BLOCK_N, block_m=block_m, kv_views=views)
    for k in ("DC", "DR", "Q_C_SMEM", "Q_R_SMEM", "K_C_SMEM", "K_R_SMEM"):
        consts.pop(k)
    return grid, args, consts


if G.HAVE_GLUON:

    @gluon.jit
    def _latent_column(j, FMT: gl.constexpr):
        """The latent column held in tile column (or Oᵀ row) j. Within each 128-column chunk (one scale or norm):
        FMT_FP8: word v (codes 4v … 4v+3) lands as pair 0 (codes 4v, 4v+1) at columns 2v, 2v+1 and pair 1 at
        64 + 2v, 65 + 2v; FMT_TBQ4: word v (codes 8v … 8v+7) as pair k (codes 8v+2k, 8v+2k+1) at 32k + 2v, 32k + 2v + 1;
        FMT_E4M3 (the e4m3 kernels' Vᵀ fragment rows m): column bits d0 … d6 = m3 m6 m0 m1 m2 m4 m5."""
        k = j % 128
        if FMT == FMT_E4M3:
            col = (((k >> 3) & 1) | (((k >> 6) & 1) << 1) | ((k & 7) << 2) | (((k >> 4) & 3) << 5))
        elif FMT == FMT_FP8:
            col = 4 * ((k % 64) // 2) + 2 * (k // 64) + k % 2
        else:
            col = 8 * ((k % 32) // 2) + 2 * (k // 32) + k % 2
        return (j // 128) * 128 + col

    @gluon.jit
    def _row_limits(seq_len, S, g, FOLD: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_M: gl.constexpr,
                    CAUSAL: gl.constexpr, ROW: gl.constexpr):
        """Each query row's key limit (keys < limit are seen) for token group g of a request of length seq_len:
        causal, the row's token position + 1 (rows are FOLD tokens × BLOCK_H heads); else the whole request."""
        cols_r = gl.arange(0, BLOCK_M, layout=ROW)
        if CAUSAL:
            limit = seq_len - S + g * FOLD + cols_r // BLOCK_H + 1
        else:
            limit = gl.full([BLOCK_M], 0, gl.int32, layout=ROW) + seq_len
        return limit

    @gluon.jit
    def _softmax_keys(s, m_i, l_keys, offs_n, end, limit, scale_log2):
        """Online softmax of Sᵀ [keys, rows] (keys offs_n; hidden at or past `end` and past each row's
        causal `limit`): P at the new max, the old rows' rescale factor, the new max, and the row sums kept
        per key slot (summed over the keys once, at the end: one cross-warp reduction per block, not two)."""
        visible = gl.expand_dims(offs_n < end, 1) & (gl.expand_dims(offs_n, 1) < gl.expand_dims(limit, 0))
        s = gl.where(visible, s * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - gl.expand_dims(m_safe, 0))
        return p, alpha, m_new, l_keys * gl.expand_dims(alpha, 0) + p

    @gluon.jit
    def _store_out(acc, m_i, l_i, b, g, H, MID_O, MID_LSE, OUT, LSE,
                   stride_mob, stride_mos, stride_moh, stride_mosp, stride_mlb, stride_mls, stride_mlh,
                   stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
                   BLOCK_H: gl.constexpr, FOLD: gl.constexpr, BLOCK_M: gl.constexpr, DC: gl.constexpr,
                   C0: gl.constexpr, NC: gl.constexpr, STORE_LSE: gl.constexpr, DIRECT: gl.constexpr,
                   FMT: gl.constexpr, ACC: gl.constexpr):
        """Normalise Oᵀ [NC, BLOCK_M] (tile columns C0 … C0+NC) and store them in the output (one split:
        natural-log lse) or this split's partial and log2-sum-exp; tile columns go back to latent columns."""
        has = l_i > 0
        lse2 = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
        out = acc * gl.expand_dims(1.0 / gl.where(has, l_i, 1.0), 0)
        cols_r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, ACC))
        s_o = g * FOLD + cols_r // BLOCK_H
        h_o = gl.program_id(1) * BLOCK_H + cols_r % BLOCK_H
        ok_o = (cols_r < FOLD * BLOCK_H) & (h_o < H)
        d = gl.expand_dims(_latent_column(C0 + gl.arange(0, NC, layout=gl.SliceLayout(1, ACC)), FMT), 1)
        mask = gl.expand_dims(ok_o, 0) & (d < DC)
        if DIRECT:
            o_at = OUT + b * stride_ob + s_o * stride_os + h_o * stride_oh
            gl.store(gl.expand_dims(o_at, 0) + d, out.to(OUT.dtype.element_ty), mask=mask)
            if STORE_LSE:
                gl.store(LSE + b * stride_lb + s_o * stride_ls + h_o, lse2 * 0.6931471805599453, mask=ok_o)
        else:
            split = gl.program_id(2)
            mo_at = MID_O + b * stride_mob + s_o * stride_mos + h_o * stride_moh + split * stride_mosp
            gl.store(gl.expand_dims(mo_at, 0) + d, out, mask=mask)
            if STORE_LSE:
                gl.store(MID_LSE + b * stride_mlb + s_o * stride_mls + h_o * stride_mlh + split, lse2, mask=ok_o)

    @gluon.jit
    def _block_row(BT, b, stride_btb, n0, PAGE_SIZE: gl.constexpr):
        """The cache row (page · PAGE_SIZE + offset) of request b's key n0, through its block table."""
        page = gl.load(BT + b * stride_btb + n0 // PAGE_SIZE)
        return page * PAGE_SIZE + n0 % PAGE_SIZE

    @gluon.jit
    def pick4(c: gl.constexpr, x0, x1, x2, x3):
        """x_c for a compile-time c: the kernels hold per-chunk tiles in four variables."""
        if c == 0:
            x = x0
        elif c == 1:
            x = x1
        elif c == 2:
            x = x2
        else:
            x = x3
        return x

    @gluon.jit
    def _store_q_chunk(x, inv, sq, hi_smem, lo_smem, qs_smem, LO: gl.constexpr):
        """One 128-column chunk x [rows, 128] of q as e4m3 terms of y = x·inv (inv = 1/sq per row): hi, and with LO
        its residual lo; sq into qs_smem."""
        FL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[4], order=[0])
        y = x * gl.expand_dims(inv, 1)
        hi_f = gl.inline_asm_elementwise(_ROUND_E4M3_PAIR, "=f,=f,f,f", [y], dtype=gl.float32, is_pure=True, pack=2)
        hi_smem.store(hi_f.to(gl.float8e4nv))  # exact
        if LO:
            lo_smem.store((y - hi_f).to(gl.float8e4nv))
        qs_smem.store(gl.convert_layout(sq, FL))

    @gluon.jit
    def _load_q(Q, q_hi, q_lo, q_r, qs, b, g, H, stride_qb, stride_qs, stride_qh, BLOCK_H: gl.constexpr,
                FOLD: gl.constexpr, BLOCK_M: gl.constexpr, DC: gl.constexpr, DR: gl.constexpr,
                LO: gl.constexpr = True, FIRST: gl.constexpr = 0, COUNT: gl.constexpr = 4, ROPE: gl.constexpr = True,
                PAIRED: gl.constexpr = False):
        """q's latent part in e4m3 with one scale per row, q ≈ (hi + lo)·sq (sq: the row's maximum / 448; LO False:
        hi alone), and (ROPE) its rope part in bf16; padded rows are zeros. Only chunks FIRST .. FIRST+COUNT-1 are
        written, so two warpgroups can share the work (each reads the whole row for the scale). PAIRED: chunk c's hi
        and lo tiles are q_hi's tiles 2c and 2c + 1 (one [2·rows, 128] operand; q_lo unused)."""
        QL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                            order=[1, 0])
        rows_q = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, QL))
        s_q = g * FOLD + rows_q // BLOCK_H
        h_q = gl.program_id(1) * BLOCK_H + rows_q % BLOCK_H
        ok_q = gl.expand_dims((rows_q < FOLD * BLOCK_H) & (h_q < H), 1)
        q_at = gl.expand_dims(b * stride_qb + s_q * stride_qs + h_q * stride_qh, 1)
        cols = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, QL)), 0)
        x0 = gl.load(Q + q_at + 0 * 128 + cols, mask=ok_q, other=0.0).to(gl.float32)
        x1 = gl.load(Q + q_at + 1 * 128 + cols, mask=ok_q, other=0.0).to(gl.float32)
        x2 = gl.load(Q + q_at + 2 * 128 + cols, mask=ok_q, other=0.0).to(gl.float32)
        x3 = gl.load(Q + q_at + 3 * 128 + cols, mask=ok_q, other=0.0).to(gl.float32)
        row_max = gl.maximum(gl.maximum(gl.max(gl.abs(x0), axis=1), gl.max(gl.abs(x1), axis=1)),
                             gl.maximum(gl.max(gl.abs(x2), axis=1), gl.max(gl.abs(x3), axis=1)))
        row_max = gl.maximum(row_max, 1e-30)
        sq = row_max / 448.0
        inv = 448.0 / row_max
        for c in gl.static_range(FIRST, FIRST + COUNT):
            _store_q_chunk(pick4(c, x0, x1, x2, x3), inv, sq, q_hi.index(2 * c if PAIRED else c),
                           q_hi.index(2 * c + 1) if PAIRED else q_lo.index(c), qs.index(c), LO)
        if ROPE:
            cols_r = gl.expand_dims(gl.arange(0, DR, layout=gl.SliceLayout(0, QL)), 0)
            q_r.store(gl.load(Q + q_at + DC + cols_r, mask=ok_q, other=0.0).to(gl.bfloat16))
