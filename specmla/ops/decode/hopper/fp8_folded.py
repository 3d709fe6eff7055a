"""Hopper MLA decode over an fp8 cache (608-byte `fp8` rows, 656-byte `fp8_ds_mla` rows) or a tbq4 cache (400-byte
rows, its 4-bit codes decoded to e4m3 centroids) for up to 64 query rows (S > 1 tokens folded, so each block's codes
are read once for all of them), with Q·Kᵀ as e4m3 matmuls on the codes themselves and no dequantised tile in shared
memory.

- A one-warp loader TMA-copies whole rows of each 64-key block into a ring of stages (`fp8._issue_block`: the codes
  as four [64, 128] e4m3 tiles, the rope part, the per-chunk scales; tbq4: the raw rows, which the two P·V
  warpgroups decode into the e4m3 tiles, centroid·k, with norm / k as the scales, before the block is scored).
- The scoring warpgroup takes every block: S [64 rows, 64 keys] as q's latent part in e4m3 (one term, one scale per
  row) against each 128-column chunk of codes, every chunk's partial scaled by its keys' fp32
  scales and added in fp32 (DeepGEMM's promotion), plus the rope part in bf16 (608-byte rows: its int8 values
  converted first); then the online softmax, whose running max moves only when a row's max grows by more than
  2^RESCALE_LOG2, and P in fp16 into the stage's rope tile (which S no longer needs) with the block's rescale
  factors beside it.
- Two P·V warpgroups hold Oᵀ [256 latent columns, 64 rows] each (chunks 2w and 2w + 1) and, per block, build Vᵀ in
  registers from the codes (`_v_fragment`: an exact conversion to fp16 times the key's scale rounded to fp16,
  `dequant_seesaw`'s tile numerics) against the stored Pᵀ; they rescale Oᵀ only in blocks where the max moved.
  Neither holds the other's state, so the scoring warpgroup runs blocks ahead of the matmuls.

Dc = 512, Dr = 64, bf16 queries, pages of a multiple of 64 keys. Same contract, grid, split rule and partials as
`mla_decode`. Gluon does not run in the Triton interpreter: GPU tests check it against the reference, a CPU test
compiles it for sm_90.
"""

from __future__ import annotations

import dataclasses

import torch

from specmla.ops.decode.hopper import common as G
from specmla.ops.decode.hopper import fp8 as F8
from specmla.ops.decode.hopper import quant_common as QC
from specmla.ops.decode.hopper import tbq4 as T4

if G.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    _cta_barrier = G._cta_barrier

FORMATS = ("fp8", "fp8_ds_mla", "tbq4")
ROWS = 64  # query rows of a program (wgmma's M)
_c = getattr(gl, "constexpr", int) if G.HAVE_GLUON else int
BLOCK_N = _c(QC.BLOCK_N)  # keys per block
HALF_N = _c(QC.BLOCK_N // 2)  # keys per matmul of S and of P·V (half a block: fewer registers)
BLOCK_M = _c(ROWS)
# mbarrier slots, per stage s of NS: the loader's copies have landed (`fp8._issue_block` arrives at s), the block's
# P is stored (NS + s), both P·V warpgroups are done with the stage (2 NS + s, two arrivals); then the final max
# and sums (3 NS)
L_READY = _c(0)
TBQ4_ROW = _c(QC.ROW_BYTES["tbq4"])  # 400 bytes: 256 of codes, 4 fp16 norms and padding, 64 bf16 rope values
TBQ4_INV_K = _c(T4._INV_K)  # 1/k of the e4m3 centroids·k (`kv_cache.tbq4.e4m3_centroids`)

# Two words of e4m3 codes, keys e and e+1 ($4, $5: latent columns 4w … 4w+3 each), and their scales (fp16 pairs
# $6 $7 of key e, $8 $9 of key e+1) → four f16x2 registers, column 4w + j of keys e (low) and e+1 (high) in $j:
# codes converted exactly, regrouped by column, times the scales (each product rounded once)
_V_PAIR = _c("""{
.reg .b16 al, ah, bl, bh;
.reg .b32 a01, a23, b01, b23, s;
mov.b32 {al, ah}, $4;
mov.b32 {bl, bh}, $5;
cvt.rn.f16x2.e4m3x2 a01, al;
cvt.rn.f16x2.e4m3x2 a23, ah;
cvt.rn.f16x2.e4m3x2 b01, bl;
cvt.rn.f16x2.e4m3x2 b23, bh;
prmt.b32 s, $6, $8, 0x5410;
prmt.b32 $0, a01, b01, 0x5410;
prmt.b32 $1, a01, b01, 0x7632;
prmt.b32 $2, a23, b23, 0x5410;
prmt.b32 $3, a23, b23, 0x7632;
mul.rn.f16x2 $0, $0, s;
mul.rn.f16x2 $1, $1, s;
mul.rn.f16x2 $2, $2, s;
mul.rn.f16x2 $3, $3, s;
}""")

_SOURCE_KEY = G.source_key(__file__) ^ QC._SOURCE_KEY ^ F8._SOURCE_KEY ^ T4._SOURCE_KEY


@dataclasses.dataclass(frozen=True)
class Options:
    """The kernel's knobs: registers per thread of each P·V warpgroup and of the loader warp (the scoring
    warpgroup takes the rest of the 64K: 120 at the defaults; below 176 for P·V, ptxas serialises the wgmmas),
    (656-byte rows) the scales' TMA box width in 32-bit words. q is one e4m3 term (a second, hi + lo, is slower at
    every measured shape and not needed for the quality bars: docs/benchmarks.md)."""

    regs: tuple[int, int] = (184, 24)
    scale_words: int = 4


if G.HAVE_GLUON:
    # S [64 rows, 32 keys] of the e4m3 matmuls and of the rope's bf16 one; Oᵀ [128 latent columns, 64 rows] per chunk
    S_LAYOUT = _c(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 32]))
    S16_LAYOUT = _c(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 16]))
    O_LAYOUT = _c(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
    V_FRAG = _c(gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT.value, k_width=2))
    # 16 keys of a chunk's codes [16 keys, 128 columns] for `_v_fragment`: registers columns c0 c1 (one 32-bit
    # word), then key e0 (an asm call takes the words of keys e and e+1), then key e3; lanes keys e1 e2 and columns
    # c2 c3 c4, warps columns c5 c6. A warp's 32 word loads then hit 8 distinct 16-byte pieces of four rows of the
    # 128-byte swizzled tile: no bank conflicts.
    V_KEYS = _c(16)
    V_CODES = _c(gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [1, 0], [8, 0]],
                                            lane_bases=[[2, 0], [4, 0], [0, 4], [0, 8], [0, 16]],
                                            warp_bases=[[0, 32], [0, 64]], block_bases=[], shape=[16, 128]))
    V_KEY_COLUMN = _c(gl.DistributedLinearLayout(reg_bases=[[1, 0], [8, 0]],
                                                 lane_bases=[[2, 0], [4, 0], [0, 0], [0, 0], [0, 0]],
                                                 warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[16, 1]))
    # one scale per key of half a block [32, 1], keys spread as along S's keys and along V_CODES' (registers: key
    # bits 0 3 4, lanes: bits 1 2), so its slice converts to either without moving data
    KEY_COLUMN = _c(gl.DistributedLinearLayout(reg_bases=[[1, 0], [8, 0], [16, 0]],
                                               lane_bases=[[2, 0], [4, 0], [0, 0], [0, 0], [0, 0]],
                                               warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[32, 1]))
    RESCALE_LOG2 = _c(8.0)  # the running max moves only by more than 2^8: P ≤ 2^8 stays an fp16 normal

    @gluon.jit
    def _load_q_rows(Q, q8, q_r, qs, b, g, H, stride_qb, stride_qs, stride_qh, BLOCK_H: gl.constexpr,
                     FOLD: gl.constexpr, ROLE: gl.constexpr):
        """Rows 32·ROLE … 32·ROLE + 31 of q into shared memory: the latent part as e4m3 of q / sq (sq = the row's
        maximum / 448; chunk c in q8's tile c), sq into qs, the rope part in bf16. Padded rows are zeros. The row maximum is taken in a first pass over the chunks, so one chunk's values
        are in registers at a time."""
        QL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                            order=[1, 0])
        HALF: gl.constexpr = BLOCK_M // 2
        rows = ROLE * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, QL))
        s_q = g * FOLD + rows // BLOCK_H
        h_q = gl.program_id(1) * BLOCK_H + rows % BLOCK_H
        ok = gl.expand_dims((rows < FOLD * BLOCK_H) & (h_q < H), 1)
        q_at = Q + gl.expand_dims(b * stride_qb + s_q * stride_qs + h_q * stride_qh, 1)
        cols = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, QL)), 0)
        amax = gl.full([HALF], 1e-30, gl.float32, layout=gl.SliceLayout(1, QL))
        for c in gl.static_range(4):
            x = gl.load(q_at + c * 128 + cols, mask=ok, other=0.0).to(gl.float32)
            amax = gl.maximum(amax, gl.max(gl.abs(x), axis=1))
        sq = amax / 448.0
        inv = 448.0 / amax
        for c in gl.static_range(4):
            x = gl.load(q_at + c * 128 + cols, mask=ok, other=0.0).to(gl.float32)
            QC._store_q_chunk(x, inv, sq, q8.index(c).slice(ROLE * HALF, HALF, dim=0),
                              q8.index(c).slice(ROLE * HALF, HALF, dim=0), qs.slice(ROLE * HALF, HALF), False)
        RL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                            order=[1, 0])
        rope_cols = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, RL)), 0)
        rows_r = ROLE * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, RL))
        s_r = g * FOLD + rows_r // BLOCK_H
        h_r = gl.program_id(1) * BLOCK_H + rows_r % BLOCK_H
        ok_r = gl.expand_dims((rows_r < FOLD * BLOCK_H) & (h_r < H), 1)
        rope_at = Q + gl.expand_dims(b * stride_qb + s_r * stride_qs + h_r * stride_qh, 1) + 512
        q_r.slice(ROLE * HALF, HALF, dim=0).store(gl.load(rope_at + rope_cols, mask=ok_r, other=0.0).to(gl.bfloat16))

    @gluon.jit
    def _zero_tail(raw_codes, raw_scales, rs, n_valid):
        """(The block's owner, when it ends before BLOCK_N keys) zero the codes and scales of keys at or past n_valid
        in stage rs: they may hold NaN, which would reach P·V through 0 · NaN."""
        ZL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                            order=[1, 0])
        SL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[32, 1], warps_per_cta=[4, 1],
                                            order=[1, 0])
        keys_z = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ZL)), 1)
        for c in gl.static_range(4):
            t = raw_codes.index(rs * 4 + c).load(ZL)
            raw_codes.index(rs * 4 + c).store(gl.where(keys_z < n_valid, t, gl.zeros_like(t)))
        sc = raw_scales.index(rs).slice(0, 4, dim=1)
        t = sc.load(SL)
        keys_s = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SL)), 1)
        sc.store(gl.where(keys_s < n_valid, t, 0.0))

    @gluon.jit
    def _p_tile(raw_rope, rs):
        """Stage rs's rope tile once S has read it: the block's P [64 rows, 64 keys] in fp16."""
        QR: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        return G._reinterpret(raw_rope.index(rs), gl.float16, [BLOCK_M, BLOCK_N], QR)

    @gluon.jit
    def _v_fragment(raw_codes, rs, c: gl.constexpr, k0: gl.constexpr, sc):
        """Keys k0 … k0 + 15 of chunk c of stage rs as Vᵀ [128 latent columns, 16 keys], the fp16 wgmma's register
        operand: each code converted exactly to fp16 and times its key's scale (sc: the keys' fp16 scales in
        `V_CODES`' key slice) rounded to fp16, each product rounded once.

        Each thread loads one 32-bit word (4 codes of one key) for each of the key pairs (e, e+1) it holds and turns
        the pair of words into four f16x2 registers, one per latent column holding both keys (`_V_PAIR`: 4
        conversions, 5 byte permutes, 4 multiplies). The asm call's eight elements are labelled (key e or e+1,
        column 4w … 4w+3) but hold (column 4w + j, keys e and e+1) in register j: the labels are then renamed (key
        bit 0 ↔ column bit 0 ↔ column bit 1 ↔ key bit 0, no data moves) and permuted into the fragment's order,
        latent columns as `quant_common._latent_column`'s FMT_E4M3 and the keys in stage order."""
        codes = raw_codes.index(rs * 4 + c).slice(k0, V_KEYS, dim=0).load(V_CODES)
        scale = gl.expand_dims(sc, 1) + gl.zeros([V_KEYS, 128], gl.float16, layout=V_CODES)
        v = gl.inline_asm_elementwise(_V_PAIR, "=r,=r,=r,=r,r,r,r,r,r,r", [codes, scale], dtype=gl.float16,
                                      is_pure=True, pack=8)
        # labels (e3 … e0, c6 … c0) → rows m6 … m0 = (e0, c6, c5, c1, c4, c3, c2), keys k3 … k0 = (e3, e2, e1, c0)
        t = gl.reshape(v, [2] * 11)
        t = gl.reshape(gl.permute(t, (3, 4, 5, 9, 6, 7, 8, 0, 1, 2, 10)), [128, V_KEYS])
        return gl.convert_layout(t, V_FRAG)

    @gluon.jit
    def _key_scale(raw_scales, rs, c: gl.constexpr, h: gl.constexpr, LAYOUT: gl.constexpr):
        """Stage rs's fp32 scales of latent chunk c for keys 32h … 32h + 31, in LAYOUT (a slice along the keys)."""
        t = raw_scales.index(rs).slice(h * HALF_N, HALF_N, dim=0).slice(c, 1, dim=1).load(KEY_COLUMN)
        return gl.convert_layout(gl.sum(t, axis=1), LAYOUT)

    @gluon.jit
    def _chunk_scores(q8, raw_codes, rs, c: gl.constexpr, h: gl.constexpr, zero):
        """Issue chunk c's partial S over keys 32h …: q·codesᵀ, one e4m3 matmul."""
        codes = raw_codes.index(rs * 4 + c).slice(h * HALF_N, HALF_N, dim=0).permute((1, 0))
        return warpgroup_mma(q8.index(c), codes, zero, use_acc=False, is_async=True)

    @gluon.jit
    def _scores(q8, q_r, raw_codes, raw_rope, raw_scales, rs, sq):
        """S [rows, keys] of stage rs in two halves of 32 keys: per chunk both halves' e4m3 partials in flight, each
        times the chunk's key scales once it lands, then times sq (per row), then the rope part's bf16 matmuls
        accumulated onto them."""
        KEY: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
        zero = gl.zeros([BLOCK_M, HALF_N], gl.float32, layout=S_LAYOUT)
        a0 = _chunk_scores(q8, raw_codes, rs, 0, 0, zero)
        a1 = _chunk_scores(q8, raw_codes, rs, 0, 1, zero)
        a0, a1 = warpgroup_mma_wait(num_outstanding=1, deps=(a0, a1))
        s0 = a0 * gl.expand_dims(_key_scale(raw_scales, rs, 0, 0, KEY), 0)
        a0, a1 = warpgroup_mma_wait(num_outstanding=0, deps=(a0, a1))
        s1 = a1 * gl.expand_dims(_key_scale(raw_scales, rs, 0, 1, KEY), 0)
        for c in gl.static_range(1, 4):
            a0 = _chunk_scores(q8, raw_codes, rs, c, 0, zero)
            a1 = _chunk_scores(q8, raw_codes, rs, c, 1, zero)
            a0, a1 = warpgroup_mma_wait(num_outstanding=1, deps=(a0, a1))
            s0 = s0 + a0 * gl.expand_dims(_key_scale(raw_scales, rs, c, 0, KEY), 0)
            a0, a1 = warpgroup_mma_wait(num_outstanding=0, deps=(a0, a1))
            s1 = s1 + a1 * gl.expand_dims(_key_scale(raw_scales, rs, c, 1, KEY), 0)
        s0 = gl.convert_layout(s0 * gl.expand_dims(sq, 1), S16_LAYOUT)
        s1 = gl.convert_layout(s1 * gl.expand_dims(sq, 1), S16_LAYOUT)
        s0 = warpgroup_mma(q_r, raw_rope.index(rs).slice(0, HALF_N, dim=0).permute((1, 0)), s0, is_async=True)
        s1 = warpgroup_mma(q_r, raw_rope.index(rs).slice(HALF_N, HALF_N, dim=0).permute((1, 0)), s1, is_async=True)
        s0, s1 = warpgroup_mma_wait(num_outstanding=0, deps=(s0, s1))
        return gl.convert_layout(s0, S_LAYOUT), gl.convert_layout(s1, S_LAYOUT)

    @gluon.jit
    def _scorer(ring, args, BLOCK_H: gl.constexpr, FOLD: gl.constexpr, CAUSAL: gl.constexpr, ROPE_I8: gl.constexpr,
                TBQ4: gl.constexpr):
        """The scoring warpgroup: q into shared memory, then per block S, the online softmax and P (fp16, in the
        stage's rope tile) with the rows' rescale factors; at the end the rows' max and sums for the P·V
        warpgroups. tbq4: a block's codes are scored once both P·V warpgroups have decoded it (`_decode_half`)."""
        b, start, end, n_blocks, q8, q_r, qs, raw_codes, raw_rope, raw_scales, alphas, ml, bars, words, norms = ring
        (Q, MID_O, MID_LSE, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_mob, stride_mos, stride_moh,
         stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
         scale_log2, S, H, g, seq_len) = args
        NS: gl.constexpr = raw_rope.shape[0]
        ROW: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        KEY: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
        _load_q_rows(Q, q8, q_r, qs, b, g, H, stride_qb, stride_qs, stride_qh, BLOCK_H, FOLD, 0)
        _load_q_rows(Q, q8, q_r, qs, b, g, H, stride_qb, stride_qs, stride_qh, BLOCK_H, FOLD, 1)
        fence_async_shared()
        _cta_barrier()
        sq = qs.load(ROW)
        limit = QC._row_limits(seq_len, S, g, FOLD, BLOCK_H, BLOCK_M, CAUSAL, ROW)
        mask_from = gl.minimum(end, gl.min(limit, axis=0))  # blocks that reach it hide some keys
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=ROW)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=ROW)
        for j in range(n_blocks):
            rs = j % NS
            n0 = start + j * BLOCK_N
            mbarrier.wait(bars.index(rs), (j // NS) & 1)
            if TBQ4:  # the codes decoded into e4m3 and the scales written (keys past the end with zero scales)
                mbarrier.wait(bars.index(3 * NS + 1 + rs), (j // NS) & 1)
            elif end - n0 < BLOCK_N:
                _zero_tail(raw_codes, raw_scales, rs, end - n0)
                fence_async_shared()
                _cta_barrier()
            if ROPE_I8:  # 608-byte rows: the rope arrived in int8
                F8._convert_rope(raw_rope, raw_scales, rs)
                _cta_barrier()
            s0, s1 = _scores(q8, q_r, raw_codes, raw_rope, raw_scales, rs, sq)
            _cta_barrier()  # every warp's matmuls have read the rope tile, which P overwrites
            s0 = s0 * scale_log2
            s1 = s1 * scale_log2
            if n0 + BLOCK_N > mask_from:
                keys = n0 + gl.arange(0, HALF_N, layout=KEY)
                lim = gl.expand_dims(gl.minimum(limit, end), 1)
                s0 = gl.where(gl.expand_dims(keys, 0) < lim, s0, float("-inf"))
                s1 = gl.where(gl.expand_dims(keys + HALF_N, 0) < lim, s1, float("-inf"))
            m_top = gl.maximum(m_i, gl.maximum(gl.max(s0, axis=1), gl.max(s1, axis=1)))
            m_new = gl.where(m_top > m_i + RESCALE_LOG2, m_top, m_i)
            m_safe = gl.expand_dims(gl.where(m_new == float("-inf"), 0.0, m_new), 1)
            # 1 where the max stays -inf (the row has seen no key: O is zero), so no rescale is forced
            alpha = gl.where(m_i == float("-inf"), 1.0, gl.exp2(m_i - gl.sum(m_safe, axis=1)))
            p0 = gl.exp2(s0 - m_safe)
            p1 = gl.exp2(s1 - m_safe)
            l_i = l_i * alpha + gl.sum(p0, axis=1) + gl.sum(p1, axis=1)
            m_i = m_new
            p_tile = _p_tile(raw_rope, rs)
            p_tile.slice(0, HALF_N, dim=1).store(p0.to(gl.float16))
            p_tile.slice(HALF_N, HALF_N, dim=1).store(p1.to(gl.float16))
            alphas.index(rs).store(alpha)
            fence_async_shared()
            _cta_barrier()
            mbarrier.arrive(bars.index(NS + rs))
        ml.index(0).store(m_i)
        ml.index(1).store(l_i)
        _cta_barrier()
        mbarrier.arrive(bars.index(3 * NS + L_READY))

    @gluon.jit
    def _pv_part(raw_codes, raw_scales, rs, c: gl.constexpr, k0: gl.constexpr, p_tile, o):
        """Issue Oᵀ_c += Vᵀ·Pᵀ over keys k0 … k0 + 15 of chunk c of stage rs (p_tile: P [rows, 64 keys])."""
        t = raw_scales.index(rs).slice(k0, V_KEYS, dim=0).slice(c, 1, dim=1).load(V_KEY_COLUMN)
        sc = gl.convert_layout(gl.sum(t, axis=1), gl.SliceLayout(1, V_CODES)).to(gl.float16)
        return warpgroup_mma(_v_fragment(raw_codes, rs, c, k0, sc),
                             p_tile.slice(k0, V_KEYS, dim=1).permute((1, 0)), o, is_async=True)

    @gluon.jit
    def _decode_half(ROLE: gl.constexpr, ring, j):
        """(tbq4, P·V warpgroup ROLE) block j's latent chunks 2·ROLE and 2·ROLE + 1, once its raw rows have landed:
        the 4-bit codes → e4m3 centroid·k into the stage's code tiles (`tbq4._decode_chunk`), and each key's norm
        times 1/k (zero for keys at or past the end, whose norms may be NaN) into the stage's scales; then the
        block's decoded barrier (two arrivals)."""
        b, start, end, n_blocks, q8, q_r, qs, raw_codes, raw_rope, raw_scales, alphas, ml, bars, words, norms = ring
        NS: gl.constexpr = raw_rope.shape[0]
        # a chunk's codes [64 keys, 16 words] (64-byte rows), 8-byte loads: 4 keys per warp, conflict-free
        DL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                            order=[1, 0])
        NL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[32, 1], warps_per_cta=[4, 1],
                                            order=[1, 0])
        rs = j % NS
        mbarrier.wait(bars.index(rs), (j // NS) & 1)
        keys = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, NL)), 1)
        valid = start + j * BLOCK_N + keys < end
        for c in gl.static_range(2 * ROLE, 2 * ROLE + 2):
            T4._decode_chunk(words.index(rs).slice(16 * c, 16, dim=1).load(DL), raw_codes.index(rs * 4 + c), BLOCK_N)
            n = norms.index(rs).slice(c, 1, dim=1).load(NL).to(gl.float32)
            raw_scales.index(rs).slice(c, 1, dim=1).store(gl.where(valid, n * TBQ4_INV_K, 0.0))
        fence_async_shared()  # the scorer's wgmmas read the decoded tiles
        _cta_barrier()
        mbarrier.arrive(bars.index(3 * NS + 1 + rs))

    @gluon.jit
    def _multiplier(ROLE: gl.constexpr, ring, args, BLOCK_H: gl.constexpr, FOLD: gl.constexpr,
                    DIRECT: gl.constexpr, TBQ4: gl.constexpr):
        """P·V warpgroup ROLE (latent chunks 2·ROLE and 2·ROLE + 1): per block, Oᵀ rescaled where the max moved,
        then Vᵀ·Pᵀ in parts of 16 keys (at most two parts of Vᵀ, 8 registers each, alive); at the end its
        chunks normalised and stored (and, warpgroup 0, the rows' lse). tbq4: before block j it decodes its chunks
        of block j + 1 (`_decode_half`), so the scorer's next block is ready while this one is multiplied."""
        b, start, end, n_blocks, q8, q_r, qs, raw_codes, raw_rope, raw_scales, alphas, ml, bars, words, norms = ring
        (Q, MID_O, MID_LSE, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_mob, stride_mos, stride_moh,
         stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
         scale_log2, S, H, g, seq_len) = args
        NS: gl.constexpr = raw_rope.shape[0]
        OROW: gl.constexpr = gl.SliceLayout(0, O_LAYOUT)
        C0: gl.constexpr = 2 * ROLE
        o0 = gl.zeros([128, BLOCK_M], gl.float32, layout=O_LAYOUT)
        o1 = gl.zeros([128, BLOCK_M], gl.float32, layout=O_LAYOUT)
        if TBQ4:
            if n_blocks > 0:
                _decode_half(ROLE, ring, 0)
        for j in range(n_blocks):
            rs = j % NS
            if TBQ4:
                if j + 1 < n_blocks:
                    _decode_half(ROLE, ring, j + 1)
            mbarrier.wait(bars.index(NS + rs), (j // NS) & 1)
            a_o = alphas.index(rs).load(OROW)
            if gl.min(a_o, axis=0) < 1.0:
                o0 = o0 * gl.expand_dims(a_o, 0)
                o1 = o1 * gl.expand_dims(a_o, 0)
            p_tile = _p_tile(raw_rope, rs)
            o0 = _pv_part(raw_codes, raw_scales, rs, C0, 0, p_tile, o0)
            for k in gl.static_range(1, BLOCK_N // V_KEYS):
                o0 = _pv_part(raw_codes, raw_scales, rs, C0, k * V_KEYS, p_tile, o0)
                o0, o1 = warpgroup_mma_wait(num_outstanding=1, deps=(o0, o1))
            for k in gl.static_range(BLOCK_N // V_KEYS):
                o1 = _pv_part(raw_codes, raw_scales, rs, C0 + 1, k * V_KEYS, p_tile, o1)
                o0, o1 = warpgroup_mma_wait(num_outstanding=1, deps=(o0, o1))
            o0, o1 = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1))
            _cta_barrier()  # every warp's matmuls have read the stage (P is among their operands)
            mbarrier.arrive(bars.index(2 * NS + rs))
        mbarrier.wait(bars.index(3 * NS + L_READY), 0)
        m_o = ml.index(0).load(OROW)
        l_o = ml.index(1).load(OROW)
        QC._store_out(o0, m_o, l_o, b, g, H, MID_O, MID_LSE, OUT, LSE, stride_mob, stride_mos, stride_moh,
                      stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb,
                      stride_ls, BLOCK_H, FOLD, BLOCK_M, 512, C0 * 128, 128, ROLE == 0, DIRECT, QC.FMT_E4M3,
                      O_LAYOUT)
        QC._store_out(o1, m_o, l_o, b, g, H, MID_O, MID_LSE, OUT, LSE, stride_mob, stride_mos, stride_moh,
                      stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb,
                      stride_ls, BLOCK_H, FOLD, BLOCK_M, 512, (C0 + 1) * 128, 128, False, DIRECT, QC.FMT_E4M3,
                      O_LAYOUT)

    @gluon.jit
    def _loader(loads, ring, PAGE_SIZE: gl.constexpr, SW: gl.constexpr, ROPE_I8: gl.constexpr, TBQ4: gl.constexpr):
        """One warp that issues the copies: block j into stage j % NS once both P·V warpgroups are done with the
        stage's block j - NS. tbq4: whole 400-byte rows (codes as [64, 64] words, norms, the bf16 rope straight into
        the rope tile) on one barrier."""
        codes_desc, rope_desc, scale_desc, BT, stride_btb = loads
        b, start, end, n_blocks, q8, q_r, qs, raw_codes, raw_rope, raw_scales, alphas, ml, bars, words, norms = ring
        NS: gl.constexpr = raw_rope.shape[0]
        for j in range(n_blocks):
            rs = j % NS
            if j >= NS:
                mbarrier.wait(bars.index(2 * NS + rs), ((j - NS) // NS) & 1)
            if TBQ4:
                row = QC._block_row(BT, b, stride_btb, start + j * BLOCK_N, PAGE_SIZE)
                bar = bars.index(rs)
                mbarrier.expect(bar, BLOCK_N * TBQ4_ROW)
                QC._tma_load(codes_desc, [row, 0], bar, words.index(rs))
                QC._tma_load(scale_desc, [row, T4.NORMS_AT], bar, norms.index(rs))
                QC._tma_load(rope_desc, [row, QC.TBQ4_ROPE_AT], bar, raw_rope.index(rs))
            else:
                F8._issue_block(codes_desc, rope_desc, scale_desc, BT, b, stride_btb, start + j * BLOCK_N, raw_codes,
                                raw_rope, raw_scales, bars, rs, PAGE_SIZE, BLOCK_N, SW, ROPE_I8)

    @gluon.jit
    def _mla_decode_fp8_folded_kernel(
        Q, codes_desc, rope_desc, scale_desc, BT, SEQ, MID_O, MID_LSE, OUT, LSE,
        stride_qb, stride_qs, stride_qh,
        stride_kvp, stride_kvt,
        stride_btb,
        stride_mob, stride_mos, stride_moh, stride_mosp,
        stride_mlb, stride_mls, stride_mlh,
        stride_ob, stride_os, stride_oh,
        stride_lb, stride_ls,
        scale_log2,
        S, H, NUM_SPLITS,
        PAGE_SIZE: gl.constexpr, BLOCK_H: gl.constexpr, FOLD: gl.constexpr, CAUSAL: gl.constexpr,
        DIRECT: gl.constexpr, MULTIPLIER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, SW: gl.constexpr,
        ROPE_I8: gl.constexpr, TBQ4: gl.constexpr, SOURCE_KEY: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        b, g, seq_len, start, end = G._program_keys(SEQ, S, NUM_SPLITS, FOLD, BLOCK_N, CAUSAL)
        n_blocks = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
        Q8L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        QR: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        SC: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        q8 = gl.allocate_shared_memory(gl.float8e4nv, [4, BLOCK_M, 128], Q8L)  # chunk c in tile c
        q_r = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, 64], QR)
        qs = gl.allocate_shared_memory(gl.float32, [BLOCK_M], PLAIN)
        # stages beside q's e4m3 (32 KB): 42 KB on fp8 rows; 59 KB on tbq4 rows (their raw rows, 17 KB, too)
        NS: gl.constexpr = 3 if TBQ4 else 4
        raw_codes = gl.allocate_shared_memory(gl.float8e4nv, [NS * 4, BLOCK_N, 128], Q8L)
        raw_rope = gl.allocate_shared_memory(gl.bfloat16, [NS, BLOCK_N, 64], QR)  # then the block's P (`_p_tile`)
        raw_scales = gl.allocate_shared_memory(gl.float32, [NS, BLOCK_N, SW], SC)
        alphas = gl.allocate_shared_memory(gl.float32, [NS, BLOCK_M], PLAIN)  # each block's rescale factors
        W32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        W16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
        RAW: gl.constexpr = BLOCK_N if TBQ4 else 1  # tbq4's raw rows: codes [keys, 64 words], norms [keys, 8]
        words = gl.allocate_shared_memory(gl.int32, [NS, RAW, 64], W32)
        norms = gl.allocate_shared_memory(gl.float16, [NS, RAW, 8], W16)
        ml = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], PLAIN)  # the rows' final max and sum
        # slots 3·NS + 1 + s (tbq4): stage s is decoded (both P·V warpgroups arrive)
        bars = gl.allocate_shared_memory(gl.int64, [4 * NS + 1, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(4 * NS + 1):
            mbarrier.init(bars.index(i), count=2 if (i >= 2 * NS and i < 3 * NS) or i > 3 * NS else 1)
        fence_async_shared()
        loads = (codes_desc, rope_desc, scale_desc, BT, stride_btb)
        ring = (b, start, end, n_blocks, q8, q_r, qs, raw_codes, raw_rope, raw_scales, alphas, ml, bars, words, norms)
        args = (Q, MID_O, MID_LSE, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_mob, stride_mos, stride_moh,
                stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb,
                stride_ls, scale_log2, S, H, g, seq_len)
        gl.warp_specialize([
            (_scorer, (ring, args, BLOCK_H, FOLD, CAUSAL, ROPE_I8, TBQ4)),
            (_multiplier, (0, ring, args, BLOCK_H, FOLD, DIRECT, TBQ4)),
            (_multiplier, (1, ring, args, BLOCK_H, FOLD, DIRECT, TBQ4)),
            (_loader, (loads, ring, PAGE_SIZE, SW, ROPE_I8, TBQ4)),
        ], [4, 4, 1], [MULTIPLIER_REGS, MULTIPLIER_REGS, LOADER_REGS])


def supported(q: torch.Tensor, kv_cache: torch.Tensor, kv_format: str, block_m: int, opts: Options = Options(), *,
              head_dim_v: int | None = None) -> bool:
    """Whether this kernel can take the call: Hopper, bf16 queries with Dc = 512 and Dr = 64, contiguous 16-byte
    aligned fp8 (608-byte), fp8_ds_mla (656-byte) or tbq4 (400-byte) rows in pages of a multiple of 64 keys, up to
    64 rows."""
    return (kv_format in FORMATS and block_m <= ROWS
            and QC.hopper_rows_supported(q, kv_cache, QC.ROW_BYTES[kv_format], head_dim_v)
            and kv_cache.shape[1] % QC.BLOCK_N == 0)


def launch(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2: float, plan: dict, *,
           causal: bool, num_splits: int, kv_format: str, opts: Options = Options()) -> None:
    """Stage 1 of the split-KV decode over an fp8, fp8_ds_mla or tbq4 cache (tbq4: q already rotated) for up to 64
    rows; writes out/lse itself when num_splits == 1, else mid_o/mid_lse."""
    rope_i8, tbq = kv_format == "fp8", kv_format == "tbq4"
    scale_words = 8 if rope_i8 else 4 if tbq else opts.scale_words
    if tbq:  # codes in one [64, 64]-word box, norms, rope
        views = T4._descriptors(kv_cache, 64)
        views = (views[0], views[2], views[1])  # in the kernel's (codes, rope, scales) order
    else:
        views = F8._rope_int8_descriptors(kv_cache) if rope_i8 else F8._descriptors(kv_cache, scale_words)
    grid, args, consts = QC.tma_launch_args(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2,
                                            plan, causal=causal, direct=num_splits == 1, num_splits=num_splits,
                                            block_m=ROWS, views=views)
    for k in ("BLOCK_M", "BLOCK_N"):
        consts.pop(k)
    _mla_decode_fp8_folded_kernel[grid](*args, **consts, MULTIPLIER_REGS=opts.regs[0], LOADER_REGS=opts.regs[1],
                                        SW=scale_words, ROPE_I8=rope_i8, TBQ4=tbq,
                                        SOURCE_KEY=_SOURCE_KEY, num_warps=4)
