"""Gluon helpers shared by the Hopper decode kernels of quantised caches (`dequant`, `fp8`, `tbq4`).

Every one of them reads Dc = 512, Dr = 64 rows (four 128-column chunks with one scale or norm each, then the rope
part), keeps the keys as the matmuls' M dimension (Sᵀ = K·Qᵀ is [keys, rows], Oᵀ = Vᵀ·Pᵀ is [columns, rows]), and
shares the Triton kernel's grid, split rule and partial layout (the Triton combine merges the splits).
"""

from __future__ import annotations


import torch

from specmla.ops.decode.hopper import common as G
from specmla.ops.kv_cache import row_spec, tbq4

if G.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # renamed after Triton 3.6
    _cta_barrier = G._cta_barrier

BLOCK_N = 64  # keys per block
E4M3_ROWS = 16  # query rows of the e4m3 kernels (`fp8`, `tbq4`): Oᵀ and the Vᵀ fragments take 64 registers each
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


def hopper_rows_supported(q: torch.Tensor, kv_cache: torch.Tensor, row_bytes: int,
                          head_dim_v: int | None = None) -> bool:
    """What every Hopper kernel for quantised rows needs: a Hopper GPU outside the interpreter, bf16 queries of
    Dc + Dr = 512 + 64 columns (`head_dim_v`: Dc, default D - 64), contiguous uint8 rows of `row_bytes`, 16-byte
    aligned (the kernels read 16- or 8-byte vectors or TMA boxes)."""
    if head_dim_v not in (None, DC):
        return False
    if not G.on_hopper(q):
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
    def _load_q(Q, q8, q_r, qs, b, g, H, stride_qb, stride_qs, stride_qh, BLOCK_H: gl.constexpr, FOLD: gl.constexpr,
                BLOCK_M: gl.constexpr, DC: gl.constexpr, DR: gl.constexpr, TWO_TERMS: gl.constexpr,
                FIRST: gl.constexpr, COUNT: gl.constexpr, ROPE: gl.constexpr):
        """q's latent part in e4m3 with one scale per row, sq = the row's maximum / 448: q ≈ hi·sq, or with TWO_TERMS
        (hi + lo)·sq, chunk c's hi and lo as q8's tiles 2c and 2c + 1 (one [2·rows, 128] operand), else hi as tile
        c; and (ROPE) its rope part in bf16. Padded rows are zeros. Only chunks FIRST .. FIRST+COUNT-1 are written, so
        two warpgroups share the work (each reads the whole row for the scale)."""
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
            _store_q_chunk(pick4(c, x0, x1, x2, x3), inv, sq, q8.index(2 * c if TWO_TERMS else c),
                           q8.index(2 * c + 1 if TWO_TERMS else c), qs.index(c), TWO_TERMS)
        if ROPE:
            cols_r = gl.expand_dims(gl.arange(0, DR, layout=gl.SliceLayout(0, QL)), 0)
            q_r.store(gl.load(Q + q_at + DC + cols_r, mask=ok_q, other=0.0).to(gl.bfloat16))


# ---------------------------------------------------------------- the e4m3 kernels' consumers -------------------
# `fp8` and `tbq4` hand their consumers the same stage: a block's codes as four [64, 128] e4m3 tiles, its rope part as
# a [64, 64] bf16 tile, and per key and chunk a scale normalised so that P·scale / f stays within e4m3's 448 (sc, and
# the chunk's factor f per row in fs).

# `_f16_fragment`'s relabelling of the e4m3 fragment's key bits, as a permutation of the dims (m, k5 … k0): the new
# k3 is k1, k2 is k3, k1 is k2
F16_KEY_ORDER = (0, 1, 2, 5, 3, 4, 6)

if G.HAVE_GLUON:
    # Sᵀ / Oᵀ accumulators: rows of the tile along M (keys for Q·Kᵀ, latent columns for P·V), query rows along N
    ACC = _c(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, E4M3_ROWS, 32]))
    ACC16 = _c(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, E4M3_ROWS, 16]))
    ACC2 = _c(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 2 * E4M3_ROWS, 32]))
    VT_FRAG = _c(gl.DotOperandLayout(operand_index=0, parent=ACC.value, k_width=4))
    VT16_FRAG = _c(gl.DotOperandLayout(operand_index=0, parent=ACC16.value, k_width=2))
    F16_KEY_PERM = _c(F16_KEY_ORDER)
    # A chunk's codes [64 keys, 128 columns] as loaded: registers hold columns d0 d1 (one 32-bit word) and keys
    # e0 e3 e4 e5; lanes keys e1 e2 and columns d2 d3 d4; warps columns d5 d6. Permuted as below, that is the
    # wgmma's A fragment [128 rows m, 64 keys k] (registers k0 k1 m3 k4 k5 m6, lanes k2 k3 m0 m1 m2, warps m4 m5):
    # m ↔ d: m0 d2, m1 d3, m2 d4, m3 d0, m4 d5, m5 d6, m6 d1; k ↔ e: k0 e0, k1 e3, k2 e1, k3 e2, k4 e4, k5 e5.
    V_LOAD = _c(gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [1, 0], [8, 0], [16, 0], [32, 0]],
                                           lane_bases=[[2, 0], [4, 0], [0, 4], [0, 8], [0, 16]],
                                           warp_bases=[[0, 32], [0, 64]], block_bases=[], shape=[64, 128]))

if G.HAVE_GLUON:

    @gluon.jit
    def _vt_fragment(raw_chunk, VL: gl.constexpr, FRAG: gl.constexpr):
        """One chunk's codes [64 keys, 128] in shared memory → Vᵀ [128 tile rows, 64 tile keys] as the wgmma's
        register operand. Each thread's 16 consecutive codes (4 keys e0 e3 × one word d0 d1) go through a 4 × 4 byte
        transpose (8 byte permutes); the result is relabelled (index bits d0 d1 ↔ e0 e3) and permuted into the
        fragment's order, which leaves only whole 32-bit registers to rename. The fragment's row and key orders are
        free to choose: Pᵀ is stored in the same key order (`_store_pt`), the output's rows are put back when stored
        (`_latent_column`'s FMT_E4M3)."""
        t = raw_chunk.load(VL)
        t = gl.inline_asm_elementwise(_TRANSPOSE4, "=r,=r,=r,=r,r,r,r,r", [t], dtype=gl.float8e4nv, is_pure=True,
                                      pack=16)
        t = gl.reshape(t, [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])
        # index bits (e5 e4 e3 e2 e1 e0 d6 … d0) now hold (e5 e4 d1 e2 e1 d0 d6 … d2 e3 e0) → (m6 … m0, k5 … k0)
        t = gl.reshape(gl.permute(t, (2, 6, 7, 5, 8, 9, 10, 0, 1, 3, 4, 11, 12)), [128, 64])
        return gl.convert_layout(t, FRAG)

    @gluon.jit
    def _vt_fragments(raw_codes, rs):
        """Stage rs's four chunks as Vᵀ fragments."""
        a0 = _vt_fragment(raw_codes.index(rs * 4 + 0), V_LOAD, VT_FRAG)
        a1 = _vt_fragment(raw_codes.index(rs * 4 + 1), V_LOAD, VT_FRAG)
        a2 = _vt_fragment(raw_codes.index(rs * 4 + 2), V_LOAD, VT_FRAG)
        a3 = _vt_fragment(raw_codes.index(rs * 4 + 3), V_LOAD, VT_FRAG)
        return a0, a1, a2, a3

    @gluon.jit
    def _f16_fragment(a8, FRAG: gl.constexpr):
        """A Vᵀ fragment of e4m3 codes (`_vt_fragment`) → the fp16 wgmma's register operand, values exact. The
        fp16 fragment holds 2 keys per register where the e4m3 one holds 4, and its lanes cover keys k1 k2 where
        the e4m3 one's cover k2 k3: relabelling the keys (k1 → k3, k2 → k1, k3 → k2) makes the layouts equal up to
        the order of whole registers, and composed with `_vt_fragment`'s order it gives the keys in stage order."""
        t = gl.reshape(a8.to(gl.float16), [128, 2, 2, 2, 2, 2, 2])  # (m, k5 … k0)
        t = gl.reshape(gl.permute(t, F16_KEY_PERM.value), [128, 64])
        return gl.convert_layout(t, FRAG)

    @gluon.jit
    def _pv16_chunk(raw_codes, rs, p16, i, c: gl.constexpr, o):
        """Issue chunk c's Oᵀ += Vᵀ·Pᵀ in fp16: its Vᵀ fragment loaded from stage rs and converted."""
        a8 = _vt_fragment(raw_codes.index(rs * 4 + c), V_LOAD, VT_FRAG)
        return warpgroup_mma(_f16_fragment(a8, VT16_FRAG), p16.index(i + c).permute((1, 0)), o, is_async=True)

    @gluon.jit
    def _pv16(raw_codes, rs, p16, ROLE: gl.constexpr, o0, o1, o2, o3, free_bar):
        """P·V in fp16 chunk by chunk, at most two converted fragments (32 registers each) alive, so nothing spills:
        each chunk's matmul runs while the next chunk is loaded and converted; the stage is handed back after the
        last load."""
        o0 = _pv16_chunk(raw_codes, rs, p16, ROLE * 4, 0, o0)
        o1 = _pv16_chunk(raw_codes, rs, p16, ROLE * 4, 1, o1)
        o0 = warpgroup_mma_wait(num_outstanding=1, deps=(o0,))
        o2 = _pv16_chunk(raw_codes, rs, p16, ROLE * 4, 2, o2)
        o1 = warpgroup_mma_wait(num_outstanding=1, deps=(o1,))
        o3 = _pv16_chunk(raw_codes, rs, p16, ROLE * 4, 3, o3)
        _cta_barrier()  # every warp has read the stage
        mbarrier.arrive(free_bar)
        o2, o3 = warpgroup_mma_wait(num_outstanding=0, deps=(o2, o3))
        return o0, o1, o2, o3

    @gluon.jit
    def _store_p8(p8, i, y):
        """Pᵀ·scale/f (y, [64 keys, rows]) into p8 tile i in e4m3, clipped to 448."""
        y = gl.minimum(y, 448.0)
        _store_pt(p8.index(i), y.to(gl.float8e4nv))

    @gluon.jit
    def _store_p16(p16, i, y):
        """Pᵀ·scale/f (y, [64 keys, rows], ≤ 448) into fp16 tile i [rows, 64 keys], keys in stage order (the
        order `_f16_fragment` gives Vᵀ)."""
        p16.index(i).permute((1, 0)).store(y.to(gl.float16))

    @gluon.jit
    def _store_pt(p8_chunk, p):
        """Pᵀ·scale/f [64 keys, rows] (e4m3) → p8_chunk [rows, 64 tile keys] in the fragment's key order."""
        BM: gl.constexpr = p.shape[1]
        t = gl.reshape(p, [2, 2, 2, 2, 2, 2, BM])
        # Sᵀ [64 keys, rows] as 7 index bits (e5 … e0, row) → (k5 … k0, row): the fragment's key order
        t = gl.reshape(gl.permute(t, (0, 1, 3, 4, 2, 5, 6)), [64, BM])
        p8_chunk.permute((1, 0)).store(t)

    @gluon.jit
    def _issue_chunk_scores(raw_codes, q8, rs, c: gl.constexpr, s_zero, TWO_TERMS: gl.constexpr):
        """Issue chunk c's partial Sᵀ on stage rs's codes; with TWO_TERMS q's hi and lo terms are one [2·rows]
        operand (q8's tiles 2c, 2c + 1), so the codes are read once, into an accumulator of 2·rows columns
        (`_fold_terms`)."""
        BM: gl.constexpr = q8.shape[1]
        QROWS: gl.constexpr = 2 * BM if TWO_TERMS else BM
        Q8L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        q_op = G._reinterpret(q8, gl.float8e4nv, [q8.shape[0] * BM // QROWS, QROWS, 128], Q8L).index(c)
        return warpgroup_mma(raw_codes.index(rs * 4 + c), q_op.permute((1, 0)), s_zero, use_acc=False, is_async=True)

    @gluon.jit
    def _fold_terms(s2, BM: gl.constexpr):
        """An Sᵀ accumulator [keys, 2·rows] of q's hi (first rows) and lo terms → their sum [keys, rows] (each thread
        holds both halves: no data moves); [keys, rows] stays as it is."""
        t = gl.reshape(s2, [s2.shape[0], s2.shape[1] // BM, BM])
        return gl.convert_layout(gl.sum(t, axis=1), ACC)

    @gluon.jit
    def _issue_scores(raw_codes, raw_rope, q8, q_r, rs, s_zero, s_zero16, TWO_TERMS: gl.constexpr):
        """Issue stage rs's partial Sᵀ per 128-column chunk and its rope part's."""
        s0 = _issue_chunk_scores(raw_codes, q8, rs, 0, s_zero, TWO_TERMS)
        s1 = _issue_chunk_scores(raw_codes, q8, rs, 1, s_zero, TWO_TERMS)
        s2 = _issue_chunk_scores(raw_codes, q8, rs, 2, s_zero, TWO_TERMS)
        s3 = _issue_chunk_scores(raw_codes, q8, rs, 3, s_zero, TWO_TERMS)
        sr = warpgroup_mma(raw_rope.index(rs), q_r.permute((1, 0)), s_zero16, use_acc=False, is_async=True)
        return s0, s1, s2, s3, sr

    @gluon.jit
    def _consume_block(ROLE: gl.constexpr, ring, rs, n0, limit, q0, scale_log2, keys, s_zero_q, s_zero16, state,
                       BLOCK_M: gl.constexpr, NR: gl.constexpr, TWO_TERMS: gl.constexpr, P16: gl.constexpr):
        """One key block (keys n0 …, handed over in stage rs) into a consumer's state: Sᵀ on the raw codes, the
        online softmax, Pᵀ·scale/f into shared memory, Oᵀ += Vᵀ·Pᵀ; the stage is handed back once read. P16: P·V in
        fp16 (Vᵀ's codes converted in registers, exact; Pᵀ·scale/f in fp16), else in e4m3."""
        b, start, end, n_blocks, q8, q_r, qs, raw_codes, raw_rope, sc, fs, p8, bars = ring
        RAW_FREE: gl.constexpr = NR
        KEY: gl.constexpr = gl.SliceLayout(1, ACC)
        ROW: gl.constexpr = gl.SliceLayout(0, ACC)
        OL: gl.constexpr = ACC16 if P16 else ACC
        OROW: gl.constexpr = gl.SliceLayout(0, OL)
        m_i, l_keys, o0, o1, o2, o3, f0p, f1p, f2p, f3p = state
        s0, s1, s2, s3, sr = _issue_scores(raw_codes, raw_rope, q8, q_r, rs, s_zero_q, s_zero16, TWO_TERMS)
        sc0 = gl.expand_dims(sc.index(rs * 4 + 0).load(KEY), 1)
        sc1 = gl.expand_dims(sc.index(rs * 4 + 1).load(KEY), 1)
        sc2 = gl.expand_dims(sc.index(rs * 4 + 2).load(KEY), 1)
        sc3 = gl.expand_dims(sc.index(rs * 4 + 3).load(KEY), 1)
        f0 = gl.max(fs.index(rs * 4 + 0).load(ROW), axis=0)
        f1 = gl.max(fs.index(rs * 4 + 1).load(ROW), axis=0)
        f2 = gl.max(fs.index(rs * 4 + 2).load(ROW), axis=0)
        f3 = gl.max(fs.index(rs * 4 + 3).load(ROW), axis=0)
        s0, s1, s2, s3, sr = warpgroup_mma_wait(num_outstanding=0, deps=(s0, s1, s2, s3, sr))
        s0 = _fold_terms(s0, BLOCK_M)
        s1 = _fold_terms(s1, BLOCK_M)
        s2 = _fold_terms(s2, BLOCK_M)
        s3 = _fold_terms(s3, BLOCK_M)
        s = ((s0 * (sc0 * f0) + s1 * (sc1 * f1) + s2 * (sc2 * f2) + s3 * (sc3 * f3)) * gl.expand_dims(q0, 0)
             + gl.convert_layout(sr, ACC))
        p, alpha, m_i, l_keys = _softmax_keys(s, m_i, l_keys, n0 + keys, end, limit, scale_log2)
        if P16:
            _store_p16(p8, ROLE * 4 + 0, p * sc0)
            _store_p16(p8, ROLE * 4 + 1, p * sc1)
            _store_p16(p8, ROLE * 4 + 2, p * sc2)
            _store_p16(p8, ROLE * 4 + 3, p * sc3)
        else:
            _store_p8(p8, ROLE * 8 + 0, p * sc0)
            _store_p8(p8, ROLE * 8 + 1, p * sc1)
            _store_p8(p8, ROLE * 8 + 2, p * sc2)
            _store_p8(p8, ROLE * 8 + 3, p * sc3)
        fence_async_shared()
        _cta_barrier()  # every warp's Pᵀ is stored
        o0 = o0 * gl.expand_dims(gl.convert_layout(alpha * (f0p / f0), OROW), 0)
        o1 = o1 * gl.expand_dims(gl.convert_layout(alpha * (f1p / f1), OROW), 0)
        o2 = o2 * gl.expand_dims(gl.convert_layout(alpha * (f2p / f2), OROW), 0)
        o3 = o3 * gl.expand_dims(gl.convert_layout(alpha * (f3p / f3), OROW), 0)
        f0p = f0
        f1p = f1
        f2p = f2
        f3p = f3
        if P16:
            o0, o1, o2, o3 = _pv16(raw_codes, rs, p8, ROLE, o0, o1, o2, o3, bars.index(RAW_FREE + rs))
        else:
            # Vᵀ fragments loaded late, so that fewer registers live through the softmax (nothing spills)
            a0, a1, a2, a3 = _vt_fragments(raw_codes, rs)
            _cta_barrier()  # every warp has read the stage
            mbarrier.arrive(bars.index(RAW_FREE + rs))
            o0 = warpgroup_mma(a0, p8.index(ROLE * 8 + 0).permute((1, 0)), o0, is_async=True)
            o1 = warpgroup_mma(a1, p8.index(ROLE * 8 + 1).permute((1, 0)), o1, is_async=True)
            o2 = warpgroup_mma(a2, p8.index(ROLE * 8 + 2).permute((1, 0)), o2, is_async=True)
            o3 = warpgroup_mma(a3, p8.index(ROLE * 8 + 3).permute((1, 0)), o3, is_async=True)
            o0, o1, o2, o3 = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1, o2, o3))
        return m_i, l_keys, o0, o1, o2, o3, f0p, f1p, f2p, f3p

    @gluon.jit
    def _fresh_state(qs, seq_len, g, S, BLOCK_H: gl.constexpr, FOLD: gl.constexpr, BLOCK_N: gl.constexpr,
                     P16: gl.constexpr, CAUSAL: gl.constexpr):
        """Once q (of a request of length seq_len, token group g) is in shared memory: its row scale, each row's
        causal key limit, and an empty consumer state (m, per-key l, Oᵀ per chunk, the previous block's chunk
        factors f: scalars, as the producer writes one per row)."""
        ROW: gl.constexpr = gl.SliceLayout(0, ACC)
        BLOCK_M: gl.constexpr = qs.shape[1]
        q0 = qs.index(0).load(ROW)  # one scale per row for every chunk: fewer registers
        limit = _row_limits(seq_len, S, g, FOLD, BLOCK_H, BLOCK_M, CAUSAL, ROW)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=ROW)
        f0p = gl.max(gl.full([BLOCK_M], 1.0, gl.float32, layout=ROW), axis=0)
        o0 = gl.zeros([128, BLOCK_M], gl.float32, layout=ACC16 if P16 else ACC)
        return q0, limit, (m_i, gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=ACC), o0, o0, o0, o0, f0p, f0p, f0p,
                           f0p)

    @gluon.jit
    def _merge_consumers(ROLE: gl.constexpr, raw_codes, sc, bars, state, NR: gl.constexpr):
        """Both consumers' states → consumer 0's, merged (Oᵀ per chunk in ACC, the rows' max and sum; consumer 1
        gets its own back): consumer 1's state goes through stage 0's code tiles once both are done with the ring."""
        DONE0: gl.constexpr = 3 * NR + 1
        WROTE1: gl.constexpr = 3 * NR + 2
        ROW: gl.constexpr = gl.SliceLayout(0, ACC)
        m_i, l_keys, o0, o1, o2, o3, f0p, f1p, f2p, f3p = state
        BLOCK_M: gl.constexpr = o0.shape[1]
        l_i = gl.sum(l_keys, axis=0)
        o0 = gl.convert_layout(o0, ACC) * f0p
        o1 = gl.convert_layout(o1, ACC) * f1p
        o2 = gl.convert_layout(o2, ACC) * f2p
        o3 = gl.convert_layout(o3, ACC) * f3p
        PLAIN2: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        if ROLE == 1:
            mbarrier.wait(bars.index(DONE0), 0)
            G._reinterpret(raw_codes.index(0), gl.float32, [128, BLOCK_M], PLAIN2).store(o0)
            G._reinterpret(raw_codes.index(1), gl.float32, [128, BLOCK_M], PLAIN2).store(o1)
            G._reinterpret(raw_codes.index(2), gl.float32, [128, BLOCK_M], PLAIN2).store(o2)
            G._reinterpret(raw_codes.index(3), gl.float32, [128, BLOCK_M], PLAIN2).store(o3)
            sc.index(0).slice(0, BLOCK_M).store(m_i)
            sc.index(1).slice(0, BLOCK_M).store(l_i)
            _cta_barrier()
            mbarrier.arrive(bars.index(WROTE1))
            m_new = m_i
        else:
            _cta_barrier()
            mbarrier.arrive(bars.index(DONE0))
            mbarrier.wait(bars.index(WROTE1), 0)
            m1 = sc.index(0).slice(0, BLOCK_M).load(ROW)
            l1 = sc.index(1).slice(0, BLOCK_M).load(ROW)
            m_new = gl.maximum(m_i, m1)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            a_self = gl.expand_dims(gl.exp2(m_i - m_safe), 0)
            a_other = gl.expand_dims(gl.exp2(m1 - m_safe), 0)
            l_i = l_i * gl.exp2(m_i - m_safe) + l1 * gl.exp2(m1 - m_safe)
            o0 = o0 * a_self + G._reinterpret(raw_codes.index(0), gl.float32, [128, BLOCK_M],
                                              PLAIN2).load(ACC) * a_other
            o1 = o1 * a_self + G._reinterpret(raw_codes.index(1), gl.float32, [128, BLOCK_M],
                                              PLAIN2).load(ACC) * a_other
            o2 = o2 * a_self + G._reinterpret(raw_codes.index(2), gl.float32, [128, BLOCK_M],
                                              PLAIN2).load(ACC) * a_other
            o3 = o3 * a_self + G._reinterpret(raw_codes.index(3), gl.float32, [128, BLOCK_M],
                                              PLAIN2).load(ACC) * a_other
        return o0, o1, o2, o3, m_new, l_i

    @gluon.jit
    def e4m3_consumer(ROLE: gl.constexpr, ring, args, BLOCK_H: gl.constexpr, FOLD: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NR: gl.constexpr, CAUSAL: gl.constexpr,
                      DIRECT: gl.constexpr, TWO_TERMS: gl.constexpr, P16: gl.constexpr):
        """Consumer warpgroup ROLE of an e4m3 kernel: it takes blocks ROLE, ROLE + 2, … whole (all 512 columns), so
        the two consumers never wait on each other per block. Per block: Sᵀ on the raw codes (q in one or, with
        TWO_TERMS, two e4m3 terms; the rope part in bf16), its own online softmax, Pᵀ·scale/f per chunk into shared
        memory, then the Vᵀ fragments from the raw codes (the stage is freed once they are in registers) and
        Oᵀ += Vᵀ·Pᵀ per chunk. At the end consumer 1 hands its state to consumer 0 through the (then idle) ring, and
        consumer 0 merges and stores.

        ring: (b, start, end, n_blocks, q8, q_r, qs, codes, rope, sc, fs, p8, bars) with NR stages; barriers 2·NR + s:
        stage s ready, NR + s: stage s read (one arrival), 3·NR: q ready (both consumers arrive), 3·NR + 1 and 3·NR + 2:
        the merge."""
        b, start, end, n_blocks, q8, q_r, qs, raw_codes, raw_rope, sc, fs, p8, bars = ring
        (Q, MID_O, MID_LSE, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_mob, stride_mos, stride_moh,
         stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
         scale_log2, S, H, g, seq_len) = args
        KV_READY: gl.constexpr = 2 * NR
        Q_READY: gl.constexpr = 3 * NR
        KEY: gl.constexpr = gl.SliceLayout(1, ACC)
        # q's prologue split between the consumers: each quantises two chunks, consumer 0 the rope part too
        _load_q(Q, q8, q_r, qs, b, g, H, stride_qb, stride_qs, stride_qh, BLOCK_H, FOLD, BLOCK_M, 512, 64, TWO_TERMS,
                2 * ROLE, 2, ROLE == 0)
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(bars.index(Q_READY))
        mbarrier.wait(bars.index(Q_READY), 0)
        q0, limit, state = _fresh_state(qs, seq_len, g, S, BLOCK_H, FOLD, BLOCK_N, P16, CAUSAL)
        m_i, l_keys, o0, o1, o2, o3, f0p, f1p, f2p, f3p = state
        s_zero16 = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=ACC16)
        s_zero_q = gl.zeros([BLOCK_N, 2 * BLOCK_M if TWO_TERMS else BLOCK_M], gl.float32,
                            layout=ACC2 if TWO_TERMS else ACC)
        keys = gl.arange(0, BLOCK_N, layout=KEY)
        for j in range(ROLE, n_blocks, 2):
            rs = j % NR
            n0 = start + j * BLOCK_N
            mbarrier.wait(bars.index(KV_READY + rs), (j // NR) & 1)
            state = _consume_block(ROLE, ring, rs, n0, limit, q0, scale_log2, keys, s_zero_q, s_zero16,
                                   (m_i, l_keys, o0, o1, o2, o3, f0p, f1p, f2p, f3p), BLOCK_M, NR, TWO_TERMS, P16)
            m_i, l_keys, o0, o1, o2, o3, f0p, f1p, f2p, f3p = state
        o0, o1, o2, o3, m_new, l_i = _merge_consumers(ROLE, raw_codes, sc, bars, (m_i, l_keys, o0, o1, o2, o3, f0p,
                                                                                  f1p, f2p, f3p), NR)
        if ROLE == 0:
            for c in gl.static_range(4):
                _store_out(pick4(c, o0, o1, o2, o3), m_new, l_i, b, g, H, MID_O, MID_LSE, OUT, LSE, stride_mob,
                           stride_mos, stride_moh, stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob,
                           stride_os, stride_oh, stride_lb, stride_ls, BLOCK_H, FOLD, BLOCK_M, 512, c * 128, 128,
                           c == 0, DIRECT, FMT_E4M3, ACC)
