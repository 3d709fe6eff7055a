"""Hopper MLA decode over a quantised latent cache (fp8 608-byte rows, fp8_ds_mla 656-byte rows, tbq4 400-byte rows)
at 64 query rows: a producer warpgroup dequantises each 32-key block once into a tile (latent part in fp16, rope in
bf16), and two consumer warpgroups run the seesaw schedule (`bf16_seesaw`) on the tiles. The codes are read once
per block whatever the rows, so S > 1 tokens folded into 64 rows cost what one token costs in bytes.

- Producer (4 warps): two blocks' codes are in registers, units of 32 keys × 128 codes, each unit's registers
  taking the same unit two blocks on once it is stored; the rope goes by cp.async, which takes no registers. Each
  pair of codes becomes fp16 in one instruction (fp8: `cvt.rn.f16x2.e4m3x2`, exact; tbq4: the byte-permute lookup
  of the fp16 centroids), times the key's chunk scale (fp8, rounded to fp16) or norm (tbq4, stored in fp16) in one
  `mul.rn.f16x2`: fp8's scale rounded to fp16 and the product rounded, within 2⁻¹⁰ relative (tbq4's product rounded
  once) while the values are fp16 normals: an fp8 chunk whose amax is under 0.027 has a subnormal scale and loses
  relative precision, and q's latent part must stay under fp16's 65504. The rope part goes into the stage's rope tile by
  cp.async (bf16 on fp8_ds_mla and tbq4 rows), or lands as int8 in the tile's second half with its fp16 scales
  beside and is converted in place (fp8 rows).
- Latent columns are permuted in the tile (`quant_common._latent_column`) so that each thread's unpacked pairs are
  16-byte stores; q and the output are permuted to match.
- Consumers: warpgroup w owns the blocks 2r + w (stage 2 (r % 2) + w), as in `bf16_seesaw`: S for its block (q's
  latent part in fp16 against the fp16 tile, its rope in bf16 against the bf16 rope tile, one fp32 accumulator),
  that block's softmax while the other warpgroup's matmuls run, its half of V times its own P (fp16) from
  registers, then the other warpgroup's P (handed over in the stage's rope tile) times the same half. A stage is
  free for the producer once both warpgroups have read it (two arrivals); the producer marks it ready once the
  tile and rope are in place. Four stages of 32 keys: the producer fills round r + 1 while the consumers read r.

Dc = 512, Dr = 64, bf16 queries, up to 64 query rows (tiles are 64 rows: wgmma's M). Same contract, grid, split rule
and partial layout as `mla_decode` (its combine merges the splits; tbq4: q rotated by the caller). Gluon does not
run in the Triton interpreter: GPU tests check it against the fp64 reference, a CPU test compiles it for sm_90.
"""

from __future__ import annotations

import dataclasses

import torch

from specmla.ops.decode.hopper import common as G
from specmla.ops.decode.hopper import dequant as DQ
from specmla.ops.decode.hopper import quant_common as QC
from specmla.ops.kv_cache import tbq4
from specmla.ops.kv_cache.layout import rope_offset, rope_scales_offset

if G.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    _cta_barrier = G._cta_barrier

FORMATS = {"fp8": 0, "fp8_ds_mla": 1, "tbq4": 2}  # the kernel's ROW

_SOURCE_KEY = (G.source_key(__file__) ^ QC._SOURCE_KEY ^ DQ._SOURCE_KEY ^ G.source_key(G.__file__)
               ^ G.source_key(tbq4.__file__))
_c = getattr(gl, "constexpr", int) if G.HAVE_GLUON else int
BLOCK_N = _c(32)  # keys per stage; P [64 rows, 32 keys] fits the stage's rope tile [32 keys, 64]
NUM_STAGES = _c(4)  # two rounds of two blocks: the producer fills one round while the consumers read the other
ROWS = 64  # query rows of a program's tile (wgmma's M)
BLOCK_M = _c(ROWS)
DC, DR = _c(QC.DC), _c(QC.DR)
ROW_FP8, ROW_DS_MLA, ROW_TBQ4 = _c(0), _c(1), _c(2)
FP8_ROPE_AT = _c(rope_offset("fp8", DC, DR))  # byte offsets in a 608-byte row: int8 rope values, their fp16 scales
FP8_ROPE_SCALES_AT = _c(rope_scales_offset(DC))
DS_ROPE_AT = _c(rope_offset("fp8_ds_mla", DC, DR))  # bf16 rope of a 656-byte row
TBQ4_ROPE_AT = _c(tbq4.rope_offset(DC))  # bf16 rope of a 400-byte row

# mbarrier slots
M_READY = _c(0)  # +w: warpgroup w published its block's max and rescale factor (one arrival)
P_READY = _c(2)  # +w: warpgroup w's P is in its stage's rope tile (one arrival)
L_READY = _c(4)  # +w: warpgroup w's row sums are in shared memory, after the last round (one arrival)
KV_READY = _c(6)  # +s: the producer has filled stage s (one arrival)
KV_FREE = _c(10)  # +s: both warpgroups are done reading stage s (two arrivals)
Q_READY = _c(14)  # Q is in shared memory (stored by warpgroup 0)
NUM_BARRIERS = _c(15)

# Four e4m3 codes (one word) → two f16x2 words of code · scale: each pair of codes converted exactly to f16x2, times
# $3 (the key's chunk scale rounded to fp16, in both halves), the products rounded once
_E4M3_TO_F16_SCALED = _c("""{
.reg .b16 l, h;
.reg .b32 a, b;
mov.b32 {l, h}, $2;
cvt.rn.f16x2.e4m3x2 a, l;
cvt.rn.f16x2.e4m3x2 b, h;
mul.rn.f16x2 $0, a, $3;
mul.rn.f16x2 $1, b, $3;
}""")
_TBQ4_PAIRS = _c(tbq4.centroid_lookup_ptx(scaled=False, dtype=torch.float16))  # 8 codes → 4 fp16 centroid pairs
_MUL_F16X2 = _c("mul.rn.f16x2 $0, $1, $2;")
_F16X2_OF_F32 = _c("cvt.rn.f16x2.f32 $0, $1, $1;")  # a scale rounded to fp16, in both halves


@dataclasses.dataclass(frozen=True)
class Options:
    """The kernel's tuning knobs; the register split must keep 2 · 128 · consumer + 128 · producer ≤ 64K. None: the
    format's default (`REGISTERS`)."""

    consumer_regs: int | None = None  # each consumer holds half of O [64, 256] fp32: 128 registers
    producer_regs: int | None = None  # two blocks' codes in flight (fp8: 64 registers, tbq4: 32)


# (consumer, producer) registers per format, measured on an H100 (B=32 T=32k S=4): fp8's producer spills below 128
# (749 µs at 200 / 112 against 613 at 192 / 128); tbq4's fits 112 and its consumers run faster at 200
REGISTERS = {"fp8": (192, 128), "fp8_ds_mla": (192, 128), "tbq4": (200, 112)}


if G.HAVE_GLUON:

    # ---------------------------------------------------------------- producer -----------------------------

    @gluon.jit
    def _fetch_unit(KV32, rows, ok, c: gl.constexpr, ROW: gl.constexpr, WORDS: gl.constexpr):
        """Chunk c of 32 keys (rows: their byte offsets; rows not ok read zeros): the codes as [keys, words] of 32-bit
        words, and each key's scale (fp8) or norm (tbq4) as fp32."""
        NW: gl.constexpr = 16 if ROW == ROW_TBQ4 else 32
        ALIGN: gl.constexpr = 2 if ROW == ROW_TBQ4 else 4
        at = gl.expand_dims(gl.multiple_of(rows // 4, ALIGN), 1)
        w = gl.expand_dims(gl.arange(0, NW, layout=gl.SliceLayout(0, WORDS)), 0)
        codes = gl.load(KV32 + at + c * NW + w, mask=gl.expand_dims(ok, 1), other=0)
        if ROW == ROW_TBQ4:  # four fp16 norms after the 256 code bytes
            pair = gl.load(KV32 + rows // 4 + DC // 8 + c // 2, mask=ok, other=0)
            half = (pair >> (16 * (c % 2))) & 0xFFFF
            scale = half.to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
        else:  # four fp32 scales after the 512 code bytes
            scale = gl.load(KV32 + rows // 4 + DC // 4 + c, mask=ok, other=0).to(gl.float32, bitcast=True)
        return codes, scale

    @gluon.jit
    def _dequant_unit(tile32, codes, scale, c: gl.constexpr, ROW: gl.constexpr, WORDS: gl.constexpr):
        """Chunk c's codes · scale of 32 keys in fp16 (fp8: the code times the scale rounded to fp16; tbq4: the
        centroid times the norm; the products rounded once), into their rows of the stage's tile (tile32: those
        rows, as words of fp16 pairs) at the columns `quant_common._latent_column` gives: fp8 pair 0 of word v at
        word 64c + v, pair 1 at 64c + 32 + v; tbq4 pair k of word v at 64c + 16k + v."""
        s2 = gl.inline_asm_elementwise(_F16X2_OF_F32, "=r,r", [scale], dtype=gl.int32, is_pure=True, pack=1)
        s2 = gl.expand_dims(s2, 1) + gl.zeros_like(codes)
        if ROW == ROW_TBQ4:  # centroid (fp16) · norm (fp16, as stored)
            p0, p1, p2, p3 = gl.inline_asm_elementwise(_TBQ4_PAIRS, "=r,=r,=r,=r,r", [codes],
                                                       dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True,
                                                       pack=1)
            tile32.slice(64 * c, 16, dim=1).store(
                gl.inline_asm_elementwise(_MUL_F16X2, "=r,r,r", [p0, s2], dtype=gl.int32, is_pure=True, pack=1))
            tile32.slice(64 * c + 16, 16, dim=1).store(
                gl.inline_asm_elementwise(_MUL_F16X2, "=r,r,r", [p1, s2], dtype=gl.int32, is_pure=True, pack=1))
            tile32.slice(64 * c + 32, 16, dim=1).store(
                gl.inline_asm_elementwise(_MUL_F16X2, "=r,r,r", [p2, s2], dtype=gl.int32, is_pure=True, pack=1))
            tile32.slice(64 * c + 48, 16, dim=1).store(
                gl.inline_asm_elementwise(_MUL_F16X2, "=r,r,r", [p3, s2], dtype=gl.int32, is_pure=True, pack=1))
        else:
            lo, hi = gl.inline_asm_elementwise(_E4M3_TO_F16_SCALED, "=r,=r,r,r", [codes, s2],
                                               dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
            tile32.slice(64 * c, 32, dim=1).store(lo)
            tile32.slice(64 * c + 32, 32, dim=1).store(hi)

    @gluon.jit
    def _start_rope(KV8, KV16, rope_tile, rope_scales, rows, ok, ROW: gl.constexpr):
        """cp.async a key block's rope part (rows not ok: zeros): bf16 rows straight into the stage's rope tile; fp8
        rows' int8 values into the tile's second half (`_rope_landing`) and their fp16 scales into rope_scales."""
        if ROW == ROW_FP8:
            L8: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[8, 4], warps_per_cta=[4, 1],
                                                order=[1, 0])
            cols = gl.arange(0, DR, layout=gl.SliceLayout(0, L8))
            r8 = gl.convert_layout(rows, gl.SliceLayout(1, L8))
            ok8 = gl.expand_dims(gl.convert_layout(ok, gl.SliceLayout(1, L8)), 1)
            G._cp_async(_rope_landing(rope_tile), KV8 + gl.expand_dims(r8 + FP8_ROPE_AT, 1) + gl.expand_dims(cols, 0),
                        mask=ok8)
            LS: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[8, 4],
                                                warps_per_cta=[4, 1], order=[1, 0])
            cs = gl.arange(0, 16, layout=gl.SliceLayout(0, LS))
            rs = gl.convert_layout(rows, gl.SliceLayout(1, LS))
            oks = gl.expand_dims(gl.convert_layout(ok, gl.SliceLayout(1, LS)), 1)
            G._cp_async(rope_scales, KV8 + gl.expand_dims(rs + FP8_ROPE_SCALES_AT, 1) + gl.expand_dims(cs, 0),
                        mask=oks)
        else:
            AT: gl.constexpr = DS_ROPE_AT if ROW == ROW_DS_MLA else TBQ4_ROPE_AT
            LR: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                                order=[1, 0])
            cols = gl.arange(0, DR, layout=gl.SliceLayout(0, LR))
            rr = gl.convert_layout(rows, gl.SliceLayout(1, LR))
            okr = gl.expand_dims(gl.convert_layout(ok, gl.SliceLayout(1, LR)), 1)
            G._cp_async(rope_tile, KV16 + gl.expand_dims(gl.multiple_of((rr + AT) // 2, 8), 1)
                        + gl.expand_dims(cols, 0), mask=okr)
        cp.commit_group()

    @gluon.jit
    def _rope_landing(rope_tile):
        """(fp8 rows) Where a stage's int8 rope values land: [32 keys, 64] bytes, unswizzled, in the second half of
        its bf16 rope tile."""
        R8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
        return G._reinterpret(rope_tile, gl.int8, [2 * BLOCK_N, DR], R8).slice(BLOCK_N, BLOCK_N, dim=0)

    @gluon.jit
    def _p_tile(rope_tile):
        """A stage's rope tile [32 keys, 64] once S has read it: a warpgroup's P [64 rows, 32 keys] in fp16, handed to
        the other warpgroup as its P·V's A operand."""
        P_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
        return G._reinterpret(rope_tile, gl.float16, [BLOCK_M, BLOCK_N], P_SMEM)

    @gluon.jit
    def _convert_rope(rope_tile, rope_scales):
        """(fp8 rows) The landed int8 rope values × their fp16 scales (one per 8) → the tile's bf16 values, 32 keys at
        a time: the first 32 keys' bf16 rows lie before the landing area, the last 32 keys' overwrite it, so they
        are all read first."""
        HALF: gl.constexpr = BLOCK_N // 2
        L3: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 8], threads_per_warp=[4, 8, 1],
                                            warps_per_cta=[4, 1, 1], order=[2, 1, 0])
        V3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3)
        S16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
        land = G._reinterpret(_rope_landing(rope_tile), gl.int8, [BLOCK_N, 8, 8], V3)
        scales = G._reinterpret(rope_scales, gl.float16, [BLOCK_N, 8], S16)
        for h in gl.static_range(2):
            v = land.slice(h * HALF, HALF, dim=0).load(L3).to(gl.float32)
            s = scales.slice(h * HALF, HALF, dim=0).load(gl.SliceLayout(2, L3)).to(gl.float32)
            y = gl.reshape((v * gl.expand_dims(s, 2)).to(gl.bfloat16), [HALF, DR])
            if h == 1:
                _cta_barrier()  # every thread has read the landing area
            rope_tile.slice(h * HALF, HALF, dim=0).store(y)

    @gluon.jit
    def _produce_block(j, shared, c0, s0, c1, s1, c2, s2, c3, s3, PAGE_SIZE: gl.constexpr, ROW: gl.constexpr,
                       WORDS: gl.constexpr):
        """Block j into stage j % NUM_STAGES: wait until both warpgroups have read the stage's previous block, start
        the rope's copy, dequantise the block's four units from registers (c, s), each unit's registers at once
        taking the same unit of block j + 2, finish the rope and mark the stage ready. Returns block j + 2's units."""
        (Q, KV8, KV16, KV32, BT, stride_kvp, stride_kvt, stride_btb, b, start, end, n_rounds,
         q_c_smem, q_r_smem, k_c_smem, k_c32_smem, k_r_smem, rope_scales, m_smem, scale_smem, l_smem, bars) = shared
        ROPE_ROWS: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[32, 1],
                                                   warps_per_cta=[4, 1], order=[1, 0])
        st = j % NUM_STAGES
        n0 = start + j * BLOCK_N
        nx, nx_ok = G._block_page_rows(BT, b, stride_btb, n0 + 2 * BLOCK_N, end, stride_kvp, stride_kvt, PAGE_SIZE,
                                       BLOCK_N, WORDS)
        rope_rows, rope_ok = G._block_page_rows(BT, b, stride_btb, n0, end, stride_kvp, stride_kvt, PAGE_SIZE,
                                                BLOCK_N, ROPE_ROWS)
        mbarrier.wait(bars.index(KV_FREE + st), ((j // NUM_STAGES) + 1) & 1, pred=j >= NUM_STAGES)
        rope_tile = k_r_smem.index(st)
        _start_rope(KV8, KV16, rope_tile, rope_scales.index(st), rope_rows, rope_ok, ROW)
        tile = k_c32_smem.index(st)
        _dequant_unit(tile, c0, s0, 0, ROW, WORDS)
        c0, s0 = _fetch_unit(KV32, nx, nx_ok, 0, ROW, WORDS)
        _dequant_unit(tile, c1, s1, 1, ROW, WORDS)
        c1, s1 = _fetch_unit(KV32, nx, nx_ok, 1, ROW, WORDS)
        _dequant_unit(tile, c2, s2, 2, ROW, WORDS)
        c2, s2 = _fetch_unit(KV32, nx, nx_ok, 2, ROW, WORDS)
        _dequant_unit(tile, c3, s3, 3, ROW, WORDS)
        c3, s3 = _fetch_unit(KV32, nx, nx_ok, 3, ROW, WORDS)
        cp.wait_group(0)  # the rope has landed
        if ROW == ROW_FP8:
            _cta_barrier()
            _convert_rope(rope_tile, rope_scales.index(st))
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(bars.index(KV_READY + st))
        return c0, s0, c1, s1, c2, s2, c3, s3

    @gluon.jit
    def _producer(shared, PAGE_SIZE: gl.constexpr, ROW: gl.constexpr):
        """Blocks 2r and 2r + 1 of round r into stages 2 (r % 2) and 2 (r % 2) + 1 (a split's odd last block is
        followed by one past its end, all masked). Two blocks' codes are in registers at a time: block j's, being
        dequantised, and block j + 1's, in flight; each of block j's units, once stored, takes block j + 2's. With
        four stages the producer fills round r + 1 while the consumers read round r. Page-table rows are looked up
        two blocks ahead."""
        (Q, KV8, KV16, KV32, BT, stride_kvp, stride_kvt, stride_btb, b, start, end, n_rounds,
         q_c_smem, q_r_smem, k_c_smem, k_c32_smem, k_r_smem, rope_scales, m_smem, scale_smem, l_smem, bars) = shared
        # registers of one unit, a 128-code chunk of 32 keys: fp8 [32 keys, 32 words] in 16-byte vectors, tbq4 [32, 16]
        # in 8-byte ones; 8 threads cover a key's chunk
        VEC: gl.constexpr = 2 if ROW == ROW_TBQ4 else 4
        WORDS: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, VEC], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                               order=[1, 0])
        ea, ea_ok = G._block_page_rows(BT, b, stride_btb, start, end, stride_kvp, stride_kvt, PAGE_SIZE, BLOCK_N,
                                       WORDS)
        od, od_ok = G._block_page_rows(BT, b, stride_btb, start + BLOCK_N, end, stride_kvp, stride_kvt, PAGE_SIZE,
                                       BLOCK_N, WORDS)
        a0, as0 = _fetch_unit(KV32, ea, ea_ok, 0, ROW, WORDS)
        a1, as1 = _fetch_unit(KV32, ea, ea_ok, 1, ROW, WORDS)
        a2, as2 = _fetch_unit(KV32, ea, ea_ok, 2, ROW, WORDS)
        a3, as3 = _fetch_unit(KV32, ea, ea_ok, 3, ROW, WORDS)
        b0, bs0 = _fetch_unit(KV32, od, od_ok, 0, ROW, WORDS)
        b1, bs1 = _fetch_unit(KV32, od, od_ok, 1, ROW, WORDS)
        b2, bs2 = _fetch_unit(KV32, od, od_ok, 2, ROW, WORDS)
        b3, bs3 = _fetch_unit(KV32, od, od_ok, 3, ROW, WORDS)
        for r in range(n_rounds):
            a0, as0, a1, as1, a2, as2, a3, as3 = _produce_block(2 * r, shared, a0, as0, a1, as1, a2, as2, a3, as3,
                                                                PAGE_SIZE, ROW, WORDS)
            b0, bs0, b1, bs1, b2, bs2, b3, bs3 = _produce_block(2 * r + 1, shared, b0, bs0, b1, bs1, b2, bs2, b3, bs3,
                                                                PAGE_SIZE, ROW, WORDS)

    # ---------------------------------------------------------------- consumers ----------------------------

    @gluon.jit
    def _load_q(Q, q_c_smem, q_r_smem, b, g, H, stride_qb, stride_qs, stride_qh, BLOCK_H: gl.constexpr,
                FOLD: gl.constexpr, FMT: gl.constexpr):
        """Q rows (FOLD tokens × BLOCK_H heads) into shared memory, latent columns in the tile's order
        (`quant_common._latent_column`); padded rows are zeros. Each 128-column chunk is read in 16-byte vectors and
        permuted in registers: fp8 latent column 4w + 2k + e goes to tile column 64k + 2w + e, tbq4's 8w + 2k + e to
        32k + 2w + e."""
        LAYOUT: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                                order=[1, 0])
        rows_q = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LAYOUT))
        s_q = g * FOLD + rows_q // BLOCK_H
        h_q = gl.program_id(1) * BLOCK_H + rows_q % BLOCK_H
        ok_q = gl.expand_dims((rows_q < FOLD * BLOCK_H) & (h_q < H), 1)
        q_at = gl.expand_dims(b * stride_qb + s_q * stride_qs + h_q * stride_qh, 1)
        cols = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, LAYOUT)), 0)
        W: gl.constexpr = 16 if FMT == QC.FMT_TBQ4 else 32  # words (pairs of pairs) per chunk
        K: gl.constexpr = 128 // (2 * W)  # pairs per word
        for c in gl.static_range(DC // 128):
            x = gl.load(Q + q_at + c * 128 + cols, mask=ok_q, other=0.0)  # latent order
            x = gl.reshape(gl.permute(gl.reshape(x, [BLOCK_M, W, K, 2]), [0, 2, 1, 3]), [BLOCK_M, 128])
            q_c_smem.slice(c * 128, 128, dim=1).store(x.to(gl.float16))
        cols_qr = gl.arange(0, DR, layout=gl.SliceLayout(0, LAYOUT))
        q_r_smem.store(gl.load(Q + q_at + DC + gl.expand_dims(cols_qr, 0), mask=ok_q, other=0.0))

    @gluon.jit
    def _consumer(ROLE: gl.constexpr, shared, args, BLOCK_H: gl.constexpr, FOLD: gl.constexpr, CAUSAL: gl.constexpr,
                  DIRECT: gl.constexpr, FMT: gl.constexpr):
        """Warpgroup ROLE of the seesaw schedule (see `bf16_seesaw`) on the producer's stages: its block j = 2r + ROLE
        is stage 2 (r % 2) + ROLE."""
        (Q, KV8, KV16, KV32, BT, stride_kvp, stride_kvt, stride_btb, b, start, end, n_rounds,
         q_c_smem, q_r_smem, k_c_smem, k_c32_smem, k_r_smem, rope_scales, m_smem, scale_smem, l_smem, bars) = shared
        (MID_O, MID_LSE, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_mob, stride_mos, stride_moh, stride_mosp,
         stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
         scale_log2, S, H, g, seq_len) = args
        HALF: gl.constexpr = DC // 2
        OTHER: gl.constexpr = 1 - ROLE
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])
        P_OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        if ROLE == 0:
            _load_q(Q, q_c_smem, q_r_smem, b, g, H, stride_qb, stride_qs, stride_qh, BLOCK_H, FOLD, FMT)
            fence_async_shared()
            _cta_barrier()
            mbarrier.arrive(bars.index(Q_READY))
        else:
            mbarrier.wait(bars.index(Q_READY), 0)

        rows_s = gl.arange(0, BLOCK_M, layout=ROW_S)
        if CAUSAL:
            limit = seq_len - S + g * FOLD + rows_s // BLOCK_H + 1
        else:
            limit = gl.full([BLOCK_M], 0, gl.int32, layout=ROW_S) + seq_len
        cols_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=ROW_S)
        l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=ROW_S)
        acc = gl.zeros([BLOCK_M, HALF], gl.float32, layout=O_LAYOUT)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_LAYOUT)

        for r in range(n_rounds):
            own = 2 * (r % 2) + ROLE  # the stages of round r: 2 (r % 2) + warpgroup
            other = 2 * (r % 2) + OTHER
            own_c = k_c_smem.index(own)
            own_r = k_r_smem.index(own)
            # ---- S = Q·K_jᵀ for this warpgroup's block j = 2r + ROLE, once the producer has filled its stage ----
            mbarrier.wait(bars.index(KV_READY + own), (r // 2) & 1)
            s = warpgroup_mma(q_c_smem, own_c.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(q_r_smem, own_r.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))

            offs_n = start + (2 * r + ROLE) * BLOCK_N + cols_n
            acc, l_i, m_i, scale_next = G._seesaw_softmax(s, r, acc, l_i, offs_n, end, limit, scale_log2, m_smem,
                                                          scale_smem, bars, own_c.slice(ROLE * HALF, HALF, dim=1),
                                                          _p_tile(own_r), ROLE, M_READY, P_READY, ROW_S, ROW_O,
                                                          P_OPERAND)

            # ---- O_half += P_other·V_other[:, half] ----
            acc, l_i = G._seesaw_other_ready(acc, l_i, scale_next, r, bars, ROLE, P_READY, ROW_O)
            acc = warpgroup_mma(_p_tile(k_r_smem.index(other)), k_c_smem.index(other).slice(ROLE * HALF, HALF, dim=1),
                                acc, is_async=True)

            # ---- hand the stages back: own once this warpgroup's reads of it are done, the other's after its P·V ----
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            _cta_barrier()
            mbarrier.arrive(bars.index(KV_FREE + own))
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _cta_barrier()
            mbarrier.arrive(bars.index(KV_FREE + other))

        # ---- finish: both warpgroups' row sums, normalise, store this warpgroup's half ----
        out, lse2 = G._seesaw_finish(acc, l_i, m_i, l_smem, bars, ROLE, L_READY, ROW_S, ROW_O)
        cols_o = QC._latent_column(ROLE * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, O_LAYOUT)), FMT)
        G._store_result(out, cols_o, lse2, b, g, H, MID_O, MID_LSE, OUT, LSE, stride_mob, stride_mos, stride_moh,
                        stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb,
                        stride_ls, BLOCK_H, FOLD, BLOCK_M, DC, DIRECT, ROLE == 1, ROW_O, ROW_S)  # 1 holds the final max

    @gluon.jit
    def _mla_decode_dequant_seesaw_kernel(
        Q, KV8, KV16, KV32, BT, SEQ, MID_O, MID_LSE, OUT, LSE,
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
        DIRECT: gl.constexpr, Q_C_SMEM: gl.constexpr, Q_R_SMEM: gl.constexpr, K_C_SMEM: gl.constexpr,
        K_R_SMEM: gl.constexpr, K_C32_SMEM: gl.constexpr, ROW: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr, SOURCE_KEY: gl.constexpr, num_warps: gl.constexpr,
    ):
        FMT: gl.constexpr = QC.FMT_TBQ4 if ROW == ROW_TBQ4 else QC.FMT_FP8
        b, g, seq_len, start, end = G._program_keys(SEQ, S, NUM_SPLITS, FOLD, BLOCK_N, CAUSAL)
        n_rounds = gl.cdiv(gl.maximum(end - start, 0), 2 * BLOCK_N)
        q_c_smem = gl.allocate_shared_memory(gl.float16, [BLOCK_M, DC], Q_C_SMEM)
        q_r_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, DR], Q_R_SMEM)
        # the dequantised tiles: written as 32-bit words (fp16 pairs) by the producer, read as fp16 by the matmuls
        k_c32_smem = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, BLOCK_N, DC // 2], K_C32_SMEM)
        k_c_smem = G._reinterpret(k_c32_smem, gl.float16, [NUM_STAGES, BLOCK_N, DC], K_C_SMEM)
        k_r_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_N, DR], K_R_SMEM)
        B8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
        rope_scales = gl.allocate_shared_memory(gl.int8, [NUM_STAGES, BLOCK_N, 16], B8)  # (fp8 rows) the rope's fp16 scales
        VEC: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        m_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], VEC)
        scale_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_M], VEC)  # per warpgroup
        l_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_M], VEC)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_BARRIERS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BARRIERS):
            mbarrier.init(bars.index(i), count=2 if i >= KV_FREE and i < Q_READY else 1)
        fence_async_shared()

        shared = (Q, KV8, KV16, KV32, BT, stride_kvp, stride_kvt, stride_btb, b, start, end, n_rounds,
                  q_c_smem, q_r_smem, k_c_smem, k_c32_smem, k_r_smem, rope_scales, m_smem, scale_smem, l_smem, bars)
        args = (MID_O, MID_LSE, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_mob, stride_mos, stride_moh,
                stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb,
                stride_ls, scale_log2, S, H, g, seq_len)
        gl.warp_specialize([
            (_consumer, (0, shared, args, BLOCK_H, FOLD, CAUSAL, DIRECT, FMT)),
            (_consumer, (1, shared, args, BLOCK_H, FOLD, CAUSAL, DIRECT, FMT)),
            (_producer, (shared, PAGE_SIZE, ROW)),
        ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def supported(q: torch.Tensor, kv_cache: torch.Tensor, kv_format: str, block_m: int, opts: Options = Options(), *,
              head_dim_v: int | None = None) -> bool:
    """Whether this kernel can take the call: Hopper, bf16 queries with Dc = 512 and Dr = 64, contiguous 16-byte
    aligned fp8, fp8_ds_mla or tbq4 rows, row tiles of at most 64 rows."""
    return (kv_format in FORMATS and block_m <= ROWS
            and QC.hopper_rows_supported(q, kv_cache, QC.ROW_BYTES[kv_format], head_dim_v))


def launch(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2: float, plan: dict, *,
           causal: bool, num_splits: int, kv_format: str, opts: Options = Options()) -> None:
    """Stage 1 of the split-KV decode over an fp8, fp8_ds_mla or tbq4 cache (tbq4: q already rotated); writes
    out/lse itself when num_splits == 1, else mid_o/mid_lse. The kernel reads the uint8 rows as bytes (rope) and
    32-bit words (codes, scales, norms)."""
    grid, args, consts = G.split_launch_args(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2,
                                             plan, dc=QC.DC, causal=causal, direct=num_splits == 1,
                                             num_splits=num_splits, block_n=BLOCK_N, block_m=ROWS,
                                             kv_views=(kv_cache.view(torch.int8), kv_cache.view(torch.bfloat16),
                                                       kv_cache.view(torch.int32)))
    for k in ("DC", "DR", "BLOCK_M", "BLOCK_N"):
        consts.pop(k)
    consumer_regs, producer_regs = REGISTERS[kv_format]
    consts["K_C32_SMEM"] = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    _mla_decode_dequant_seesaw_kernel[grid](*args, **consts, ROW=FORMATS[kv_format],
                                            CONSUMER_REGS=opts.consumer_regs or consumer_regs,
                                            PRODUCER_REGS=opts.producer_regs or producer_regs,
                                            SOURCE_KEY=_SOURCE_KEY, num_warps=4)
