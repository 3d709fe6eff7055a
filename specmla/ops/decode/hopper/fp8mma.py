"""Hopper MLA decode over an fp8_ds_mla cache (FlashMLA's 656-byte rows) with e4m3 matmuls on the codes themselves.

Why: the warp-specialised kernel of `mla_decode_gluon_quant` unpacks every code into a bf16 tile and runs
bf16 matmuls on it. Its consumers alone cap it at 1.47× bf16's speed and its register-load producer at 1.27×
(docs/benchmarks.md, issue 7, eleventh session); the goal is 1.7×. Here no bf16 tile exists:
- TMA copies each 64-key block into a ring of NUM_RAW raw stages: the codes as four [64, 128] e4m3 tiles
  in the layout wgmma reads, the rope part as a [64, 64] bf16 tile, the four fp32 scales per key. Boxes are
  128 to 512 bytes wide (16-byte-wide boxes stalled at 68 % of copy bandwidth, these reach 98 %).
- Q·Kᵀ is an e4m3 wgmma straight on the raw codes. q keeps about bf16's precision as two e4m3 terms,
  q ≈ (hi + lo)·sq with one scale sq per row and 128-column chunk (e4m3 q alone measured cosine 0.9984 on
  random rows, under the 0.999 bar): two matmuls of K = 32 per 32 columns, bf16's instruction count.
- P·V is an e4m3 wgmma too, which needs V K-major: the producer warpgroup writes Vᵀ per block, a 4 × 4 byte
  transpose (8 byte-permutes per 16 codes) with the keys past the end zeroed. Pᵀ carries each key's scale,
  normalised per block and chunk to e4m3's range (P·scale / f, f = the block's largest scale / 448); the
  output accumulator is kept in units of the latest f, so the ratio of two blocks' f joins the online
  softmax's rescale. Half the P·V instructions of the bf16 kernel.
- Two consumer warpgroups own two 128-column chunks each, swap partial scores through shared memory and
  both run the same softmax, as in `mla_decode_gluon_quant`.

Status (H100, H=16, `benchmarks/fp8mma_probe.py`): correct, and a little faster than the unpacking kernel:
366 µs against 375 at B=32 T=32k (bf16 411), 122 against 126 µs at B=4 T=80k. Alone, its consumers take 267 µs
(1.54× bf16) and its producer 256 µs; together 366, so they still get in each other's way through shared memory
(the transpose's loads and stores conflict 2-way). Its output error is about 2.5 % against the fp64 reference,
from P in e4m3 (cosine above 0.999, the issue's bar; the unpacking kernel: 0.2 %), so it stays opt-in (`USE`)
until the end-to-end quality checks have run through it.
A Triton 3.6 pitfall met on the way, which a GPU test pins: lo = y − hi with hi decoded from its e4m3 codes by
`.to(gl.float32)` held hi-sized values at some elements, so hi is rounded and decoded by inline PTX conversions
(`_ROUND_E4M3_PAIR`; first in fp32 arithmetic, which made the q prologue ~1400 instructions long).

Same contract, grid, split rule and partials as `mla_decode_triton` (its combine merges the splits); Dc = 512,
Dr = 64, 16 or 32 query rows, bf16 queries, page sizes that are multiples of 64. Gluon does not run in the
Triton interpreter: GPU tests check it against the fp64 reference, a CPU test compiles it for sm_90.
"""

from __future__ import annotations

import torch

from specmla.ops.decode.hopper import common as G
from specmla.ops.decode.hopper import dequant as Q8

if G.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_init, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # renamed after Triton 3.6
    _cta_barrier = G._cta_barrier
    _softmax_keys = Q8._softmax_keys  # the online softmax and the output store are the unpacking kernel's
    _store_out = Q8._store_out

BLOCK_N = 64  # keys per block (wgmma's M for Q·Kᵀ, its K for P·V)
DC = Q8.DC  # the row: four 128-code chunks (one scale each), then 4 fp32 scales, then the 64 rope values
ROW_BYTES = Q8.ROW_BYTES["fp8_ds_mla"]
PROBE = 0  # timing probes (wrong results): 1 the producer writes no Vᵀ or scales, 2 the consumers hand every
# stage straight back, 3 Pᵀ is stored keys-major
USE = False  # True: mla_decode_triton sends the fp8 calls it gives the Gluon kernels here (else `mla_decode_gluon_quant`)
NUM_STAGES = 2  # Vᵀ stages
NUM_RAW = {16: 3, 32: 2}  # raw stages by query rows: 41 KB each; 32 rows need more room for q, Pᵀ and scores
REGS = {16: (208, 96), 32: (208, 96)}  # (consumer, producer) registers per thread: the producer needs few

_SOURCE_KEY = G.source_key(__file__) ^ Q8._SOURCE_KEY  # its partitions call the unpacking kernel's helpers
_c = getattr(gl, "constexpr", int) if G.HAVE_GLUON else int

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
# Two fp32 values rounded to e4m3 (nearest, ties to even) and back to fp32 by the hardware's conversions: 5
# instructions per pair where rounding in fp32 arithmetic took ~10 per value (the q prologue of a decode
# program was ~1400 instructions long on one warp per scheduler). e4m3 → f16 is exact.
_ROUND_E4M3_PAIR = _c("""{
.reg .b16 q8, h0, h1;
.reg .b32 h2;
cvt.rn.satfinite.e4m3x2.f32 q8, $3, $2;
cvt.rn.f16x2.e4m3x2 h2, q8;
mov.b32 {h0, h1}, h2;
cvt.f32.f16 $0, h0;
cvt.f32.f16 $1, h1;
}""")



def _transpose16_ptx() -> str:
    """Four 4 × 4 byte transposes on a thread's 4 keys × 4 words (inputs $16 + 4k + w: key k, word w). Output
    $(4i + w): column 4w + i of the four keys (byte k = key k)."""
    lines = ["{", ".reg .b32 t0, t1, t2, t3;"]
    for w in range(4):
        a = [16 + 4 * k + w for k in range(4)]
        lines += [f"prmt.b32 t0, ${a[0]}, ${a[1]}, 0x5140;", f"prmt.b32 t1, ${a[0]}, ${a[1]}, 0x7362;",
                  f"prmt.b32 t2, ${a[2]}, ${a[3]}, 0x5140;", f"prmt.b32 t3, ${a[2]}, ${a[3]}, 0x7362;",
                  f"prmt.b32 ${w}, t0, t2, 0x5410;", f"prmt.b32 ${4 + w}, t0, t2, 0x7632;",
                  f"prmt.b32 ${8 + w}, t1, t3, 0x5410;", f"prmt.b32 ${12 + w}, t1, t3, 0x7632;"]
    return "\n".join(lines + ["}"])


_TRANSPOSE16 = _c(_transpose16_ptx())
_TRANSPOSE16_ARGS = _c(",".join(["=r"] * 16 + ["r"] * 16))
# TRANSPOSE_16: each thread transposes 4 keys × 4 words: 16-byte loads, 16 lanes along the keys and 2 along the
# words, 2-way conflicts on loads and stores (1024 wavefronts per block, against 1536 for one word per thread).
# Measured 366 against 399 µs (kernel, B=32 T=32k), 122 against 131 µs (B=4 T=80k).
TRANSPOSE_16 = True
TRANSPOSE_LAYOUT_16 = _c(gl.BlockedLayout(size_per_thread=[4, 4], threads_per_warp=[16, 2], warps_per_cta=[1, 4],
                                          order=[1, 0])) if G.HAVE_GLUON else None

# The one-word transpose's register layout (4 warps): four consecutive keys × one word per thread, keys fastest (the
# transpose takes each thread's four words). 8 lanes along the keys, 4 along the words. The loads then conflict
# 4-way (8 rows of two swizzle phases); 16 lanes along the words make the loads conflict-free but the Vᵀ stores
# worse: producer alone 299 against 254 µs, the kernel 461 against 398 (H100, B=32 T=32k).
TRANSPOSE_LAYOUT = _c(gl.BlockedLayout(size_per_thread=[4, 1], threads_per_warp=[8, 4], warps_per_cta=[2, 2],
                                       order=[0, 1])) if G.HAVE_GLUON else None

if G.HAVE_GLUON:

    @gluon.jit
    def _codes_to_vt(raw_chunk, vt_rows, ok, BLOCK_N: gl.constexpr, TL: gl.constexpr, WIDE: gl.constexpr):
        """One 128-column chunk of a block's codes (raw_chunk, [keys, 128] e4m3 as TMA wrote it) → its Vᵀ rows
        (vt_rows, [128, keys / 4] 32-bit words: row = column, byte k of word g = key 4g + k); keys not ok are
        zeroed (rows past the end hold stale bytes, maybe NaN codes, and 0 · NaN = NaN in P·V). TL: four
        consecutive keys × one word per thread, keys fastest, so the transpose takes each thread's four words."""
        RAW32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        words = G._reinterpret(raw_chunk, gl.int32, [BLOCK_N, 32], RAW32).load(TL)
        words = gl.where(ok, words, 0)
        if WIDE:  # a thread's 16 words: 4 keys × 4 words, words fastest
            cols = gl.inline_asm_elementwise(_TRANSPOSE16, _TRANSPOSE16_ARGS, [words],
                                             dtype=gl.int32, is_pure=True, pack=16)
        else:
            cols = gl.inline_asm_elementwise(_TRANSPOSE4, "=r,=r,=r,=r,r,r,r,r", [words], dtype=gl.int32,
                                             is_pure=True, pack=4)
        # (4g + i, w) holds column 4w + i of keys 4g … 4g+3 → Vᵀ row 4w + i, word g
        vt_rows.store(gl.reshape(gl.permute(gl.reshape(cols, [BLOCK_N // 4, 4, 32]), (2, 1, 0)), [128, BLOCK_N // 4]))

    @gluon.jit
    def _block_row(BT, b, stride_btb, n0, PAGE_SIZE: gl.constexpr):
        """The cache row (page · PAGE_SIZE + offset) of request b's key n0, through its block table."""
        page = gl.load(BT + b * stride_btb + n0 // PAGE_SIZE)
        return page * PAGE_SIZE + n0 % PAGE_SIZE

    @gluon.jit
    def _issue_block(codes_desc, rope_desc, scale_desc, BT, b, stride_btb, n0, raw_codes, raw_rope, raw_scales,
                     bars, rs, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, SW: gl.constexpr = 4,
                     ROPE_I8: gl.constexpr = False):
        """TMA the key block starting at key n0 (whole rows of its page) into raw stage rs: four [64, 128] code
        boxes, the rope's [64, 64] bf16 box and a [64, SW] fp32 box from the scales on (SW > 4 reads into the rope).
        ROPE_I8 (608-byte fp8 rows, SW = 8: the codes' and the rope's scales): the rope's [64, 64] int8 box lands in
        the second half of the stage's bf16 rope tile (`rope_landing`), where the producer converts it."""
        row = _block_row(BT, b, stride_btb, n0, PAGE_SIZE)
        bar = bars.index(rs)
        if ROPE_I8:
            mbarrier.expect(bar, BLOCK_N * (576 + 4 * SW))
        else:
            mbarrier.expect(bar, BLOCK_N * (640 + 4 * SW))
        for c in gl.static_range(4):
            _tma_load(codes_desc, [row, c * 128], bar, raw_codes.index(rs * 4 + c))
        if ROPE_I8:
            _tma_load(rope_desc, [row, 544], bar, rope_landing(raw_rope, rs))
        else:
            _tma_load(rope_desc, [row, 264], bar, raw_rope.index(rs))
        _tma_load(scale_desc, [row, 128], bar, raw_scales.index(rs))

    @gluon.jit
    def rope_landing(raw_rope, rs):
        """(608-byte fp8 rows) Where stage rs's int8 rope values land: [64 keys, 64] bytes, unswizzled, in the second
        half of its bf16 rope tile."""
        BLOCK_N: gl.constexpr = raw_rope.shape[1]
        R8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
        return G._reinterpret(raw_rope.index(rs), gl.int8, [2 * BLOCK_N, 64], R8).slice(BLOCK_N, BLOCK_N, dim=0)

    @gluon.jit
    def _producer(shared, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                  NR: gl.constexpr, NUM_STAGES: gl.constexpr, PROBE: gl.constexpr, WIDE: gl.constexpr):
        """Keep NR blocks in flight; per block wait for its bytes and for a free Vᵀ stage, write Vᵀ (keys at or
        past the end zeroed) and the per-key scales normalised per chunk (and the chunk factors f), then hand
        the stage over. Stage rs of block j-1 is refilled (with block j-1+NR) once both consumers' Q·Kᵀ on it
        has completed."""
        (codes_desc, rope_desc, scale_desc, BT, stride_btb, b, start, end, n_blocks,
         q_hi, q_lo, q_r, qs, raw_codes, raw_rope, raw_scales, vt, vt32, sc, fs, p8, s_smem, bars, p8n) = shared
        RAW_FREE: gl.constexpr = NR
        KV_READY: gl.constexpr = 2 * NR
        KV_FREE: gl.constexpr = 2 * NR + NUM_STAGES
        if WIDE:
            TL: gl.constexpr = TRANSPOSE_LAYOUT_16
        else:
            TL: gl.constexpr = TRANSPOSE_LAYOUT
        SCL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32, 1], warps_per_cta=[4, 1],
                                             order=[1, 0])
        FL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[4], order=[0])
        for i in gl.static_range(NR):
            if i < n_blocks:
                _issue_block(codes_desc, rope_desc, scale_desc, BT, b, stride_btb, start + i * BLOCK_N, raw_codes,
                             raw_rope, raw_scales, bars, i, PAGE_SIZE, BLOCK_N)
        keys_t = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, TL))
        keys_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SCL))
        cols_s = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, SCL)), 0)
        for j in range(n_blocks):
            if j >= 1:  # refill the stage block j-1 used, once its Q·Kᵀ is done everywhere
                nxt = j - 1 + NR
                if nxt < n_blocks:
                    prev = (j - 1) % NR
                    mbarrier.wait(bars.index(RAW_FREE + prev), ((j - 1) // NR) & 1)
                    _issue_block(codes_desc, rope_desc, scale_desc, BT, b, stride_btb, start + nxt * BLOCK_N,
                                 raw_codes, raw_rope, raw_scales, bars, prev, PAGE_SIZE, BLOCK_N)
            rs = j % NR
            st = j % NUM_STAGES
            n0 = start + j * BLOCK_N
            mbarrier.wait(bars.index(rs), (j // NR) & 1)
            mbarrier.wait(bars.index(KV_FREE + st), ((j // NUM_STAGES) + 1) & 1, pred=j >= NUM_STAGES)
            ok_t = gl.expand_dims(n0 + keys_t < end, 1)
            for c in gl.static_range(4 if PROBE != 1 else 0):
                _codes_to_vt(raw_codes.index(rs * 4 + c), vt32.index(st).slice(c * 128, 128, dim=0), ok_t, BLOCK_N, TL,
                             WIDE)
            s4 = raw_scales.index(rs).load(SCL)
            s4 = gl.where(gl.expand_dims(n0 + keys_s < end, 1), s4, 0.0)
            f4 = gl.maximum(gl.max(s4, axis=0), 1e-30) / 448.0  # P·scale / f stays within e4m3's 448
            s4 = s4 / gl.expand_dims(f4, 0)
            for c in gl.static_range(4):
                sc.index(st * 4 + c).store(gl.sum(gl.where(cols_s == c, s4, 0.0), axis=1))
                f_c = gl.sum(gl.where(gl.arange(0, 4, layout=gl.SliceLayout(0, SCL)) == c, f4, 0.0), axis=0)
                fs.index(st * 4 + c).store(gl.full([BLOCK_M], 0.0, gl.float32, layout=FL) + f_c)
            fence_async_shared()
            _cta_barrier()
            mbarrier.arrive(bars.index(KV_READY + st))
            mbarrier.arrive(bars.index(RAW_FREE + rs))

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
                ROW_SCALE: gl.constexpr = False, LO: gl.constexpr = True, FIRST: gl.constexpr = 0,
                COUNT: gl.constexpr = 4, ROPE: gl.constexpr = True, PAIRED: gl.constexpr = False,
                TWO_PASS: gl.constexpr = False):
        """q's latent part as two e4m3 terms per 128-column chunk, q ≈ (hi + lo)·sq (sq: the row's chunk
        maximum / 448; ROW_SCALE: the row's maximum / 448, the same for every chunk; LO False: hi alone, q_lo
        untouched), and (ROPE) its rope part in bf16; padded rows are zeros. Only chunks FIRST .. FIRST+COUNT-1
        are written: two warpgroups can share the work (with ROW_SCALE each still reads the whole row). PAIRED:
        chunk c's hi and lo tiles are q_hi's tiles 2c and 2c + 1 (one [2·rows, 128] operand; q_lo unused).
        TWO_PASS (with ROW_SCALE): the row maximum from one pass over the chunks, then each written chunk loaded
        again, so that one chunk at a time is in registers (64 rows: four would be 256 registers per thread)."""
        QL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                            order=[1, 0])
        rows_q = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, QL))
        s_q = g * FOLD + rows_q // BLOCK_H
        h_q = gl.program_id(1) * BLOCK_H + rows_q % BLOCK_H
        ok_q = gl.expand_dims((rows_q < FOLD * BLOCK_H) & (h_q < H), 1)
        q_at = gl.expand_dims(b * stride_qb + s_q * stride_qs + h_q * stride_qh, 1)
        cols = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, QL)), 0)
        if ROW_SCALE and TWO_PASS:
            row_max = gl.full([BLOCK_M], 1e-30, gl.float32, layout=gl.SliceLayout(1, QL))
            for c in gl.static_range(4):
                x = gl.load(Q + q_at + c * 128 + cols, mask=ok_q, other=0.0).to(gl.float32)
                row_max = gl.maximum(row_max, gl.max(gl.abs(x), axis=1))
            for c in gl.static_range(FIRST, FIRST + COUNT):
                x = gl.load(Q + q_at + c * 128 + cols, mask=ok_q, other=0.0).to(gl.float32)
                _store_q_chunk(x, 448.0 / row_max, row_max / 448.0, q_hi.index(c), q_lo.index(c), qs.index(c), LO)
        elif ROW_SCALE:  # the row's four chunks loaded once, then one scale for all of them
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
        else:
            for c in gl.static_range(FIRST, FIRST + COUNT):
                x = gl.load(Q + q_at + c * 128 + cols, mask=ok_q, other=0.0).to(gl.float32)
                chunk_max = gl.maximum(gl.max(gl.abs(x), axis=1), 1e-30)
                _store_q_chunk(x, 448.0 / chunk_max, chunk_max / 448.0, q_hi.index(2 * c if PAIRED else c),
                               q_hi.index(2 * c + 1) if PAIRED else q_lo.index(c), qs.index(c), LO)
        if ROPE:
            cols_r = gl.expand_dims(gl.arange(0, DR, layout=gl.SliceLayout(0, QL)), 0)
            q_r.store(gl.load(Q + q_at + DC + cols_r, mask=ok_q, other=0.0).to(gl.bfloat16))

    @gluon.jit
    def _consumer(ROLE: gl.constexpr, shared, args, BLOCK_H: gl.constexpr, FOLD: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NR: gl.constexpr, NUM_STAGES: gl.constexpr,
                  CAUSAL: gl.constexpr, DIRECT: gl.constexpr, PROBE: gl.constexpr):
        """Consumer ROLE (chunks 2·ROLE, 2·ROLE+1; ROLE 1 also the rope part). Block j: once its Vᵀ and scales are
        written, issue the partial Sᵀ (hi and lo terms per chunk) on the raw codes, wait for its own P_{j-1}·V_{j-1}
        and free that Vᵀ stage, wait for the scores and free the raw stage, scale, swap partials, softmax, store
        Pᵀ·scale/f in e4m3 for its chunks, rescale Oᵀ and issue Vᵀ_j·Pᵀ_j."""
        (codes_desc, rope_desc, scale_desc, BT, stride_btb, b, start, end, n_blocks,
         q_hi, q_lo, q_r, qs, raw_codes, raw_rope, raw_scales, vt, vt32, sc, fs, p8, s_smem, bars, p8n) = shared
        (Q, MID_O, MID_LSE, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_mob, stride_mos, stride_moh,
         stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
         scale_log2, S, H, g, seq_len) = args
        RAW_FREE: gl.constexpr = NR
        KV_READY: gl.constexpr = 2 * NR
        KV_FREE: gl.constexpr = 2 * NR + NUM_STAGES
        S_READY: gl.constexpr = 2 * NR + 2 * NUM_STAGES
        S_READ: gl.constexpr = S_READY + 2
        Q_READY: gl.constexpr = S_READY + 4
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_M, 32])
        ACC16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
        ROW: gl.constexpr = gl.SliceLayout(0, ACC)
        KEY: gl.constexpr = gl.SliceLayout(1, ACC)
        OTHER: gl.constexpr = 1 - ROLE
        OUTSTANDING: gl.constexpr = 4 + ROLE  # the score matmuls issued after this consumer's last P·V
        ca: gl.constexpr = 2 * ROLE
        cb: gl.constexpr = 2 * ROLE + 1
        if ROLE == 0:
            _load_q(Q, q_hi, q_lo, q_r, qs, b, g, H, stride_qb, stride_qs, stride_qh, BLOCK_H, FOLD, BLOCK_M, 512, 64)
            fence_async_shared()
            _cta_barrier()
            mbarrier.arrive(bars.index(Q_READY))
        else:
            mbarrier.wait(bars.index(Q_READY), 0)
        qa = qs.index(ca).load(ROW)
        qb = qs.index(cb).load(ROW)
        limit = Q8._row_limits(seq_len, S, g, FOLD, BLOCK_H, BLOCK_M, CAUSAL, ROW)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=ROW)
        fa_prev = gl.full([BLOCK_M], 1.0, gl.float32, layout=ROW)
        fb_prev = gl.full([BLOCK_M], 1.0, gl.float32, layout=ROW)
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=ACC)
        s_zero16 = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=ACC16)
        l_keys = s_zero
        oa = warpgroup_mma_init(gl.zeros([128, BLOCK_M], gl.float32, layout=ACC))
        ob = warpgroup_mma_init(gl.zeros([128, BLOCK_M], gl.float32, layout=ACC))
        keys = gl.arange(0, BLOCK_N, layout=KEY)
        qa_hi = q_hi.index(ca).permute((1, 0))
        qa_lo = q_lo.index(ca).permute((1, 0))
        qb_hi = q_hi.index(cb).permute((1, 0))
        qb_lo = q_lo.index(cb).permute((1, 0))
        for j in range(n_blocks):
            rs = j % NR
            st = j % NUM_STAGES
            mbarrier.wait(bars.index(KV_READY + st), (j // NUM_STAGES) & 1)
            if PROBE == 2:  # the producer alone: hand both stages straight back
                _cta_barrier()
                mbarrier.arrive(bars.index(KV_FREE + st))
                mbarrier.arrive(bars.index(RAW_FREE + rs))
            else:
                ka = raw_codes.index(rs * 4 + ca)
                kb = raw_codes.index(rs * 4 + cb)
                sa = warpgroup_mma(ka, qa_hi, s_zero, use_acc=False, is_async=True)
                sa = warpgroup_mma(ka, qa_lo, sa, is_async=True)
                sb = warpgroup_mma(kb, qb_hi, s_zero, use_acc=False, is_async=True)
                sb = warpgroup_mma(kb, qb_lo, sb, is_async=True)
                if ROLE == 1:
                    sr = warpgroup_mma(raw_rope.index(rs), q_r.permute((1, 0)), s_zero16, use_acc=False, is_async=True)
                else:
                    sr = s_zero16
                oa, ob = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(oa, ob))  # this consumer's P_{j-1}·V_{j-1}
                _cta_barrier()
                mbarrier.arrive(bars.index(KV_FREE + (j - 1) % NUM_STAGES), pred=j > 0)
                sa, sb, sr = warpgroup_mma_wait(num_outstanding=0, deps=(sa, sb, sr))
                _cta_barrier()
                mbarrier.arrive(bars.index(RAW_FREE + rs))
                fa = fs.index(st * 4 + ca).load(ROW)
                fb = fs.index(st * 4 + cb).load(ROW)
                sca = gl.expand_dims(sc.index(st * 4 + ca).load(KEY), 1)
                scb = gl.expand_dims(sc.index(st * 4 + cb).load(KEY), 1)
                s = sa * sca * gl.expand_dims(qa * fa, 0) + sb * scb * gl.expand_dims(qb * fb, 0)
                if ROLE == 1:
                    s = s + gl.convert_layout(sr, ACC)
                mbarrier.wait(bars.index(S_READ + ROLE), (j + 1) & 1, pred=j > 0)
                s_smem.index(ROLE).store(s)
                _cta_barrier()
                mbarrier.arrive(bars.index(S_READY + ROLE))
                mbarrier.wait(bars.index(S_READY + OTHER), j & 1)
                s = s + s_smem.index(OTHER).load(ACC)
                _cta_barrier()
                mbarrier.arrive(bars.index(S_READ + OTHER))
                p, alpha, m_i, l_keys = _softmax_keys(s, m_i, l_keys, start + j * BLOCK_N + keys, end, limit, scale_log2)
                if PROBE == 3:  # timing: Pᵀ stored keys-major (the wrong orientation for the matmul)
                    p8n.index(ca).store(gl.minimum(p * sca, 448.0).to(gl.float8e4nv))
                    p8n.index(cb).store(gl.minimum(p * scb, 448.0).to(gl.float8e4nv))
                else:
                    p8.index(ca).permute((1, 0)).store(gl.minimum(p * sca, 448.0).to(gl.float8e4nv))
                    p8.index(cb).permute((1, 0)).store(gl.minimum(p * scb, 448.0).to(gl.float8e4nv))
                fence_async_shared()
                _cta_barrier()  # every warp's Pᵀ is stored
                oa = oa * gl.expand_dims(alpha * fa_prev / fa, 0)
                ob = ob * gl.expand_dims(alpha * fb_prev / fb, 0)
                fa_prev = fa
                fb_prev = fb
                oa = warpgroup_mma(vt.index(st).slice(ca * 128, 128, dim=0), p8.index(ca).permute((1, 0)), oa,
                                   is_async=True)
                ob = warpgroup_mma(vt.index(st).slice(cb * 128, 128, dim=0), p8.index(cb).permute((1, 0)), ob,
                                   is_async=True)
        oa, ob = warpgroup_mma_wait(num_outstanding=0, deps=(oa, ob))
        l_i = gl.sum(l_keys, axis=0)
        oa = oa * gl.expand_dims(fa_prev, 0)
        ob = ob * gl.expand_dims(fb_prev, 0)
        _store_out(oa, m_i, l_i, b, g, H, MID_O, MID_LSE, OUT, LSE, stride_mob, stride_mos, stride_moh, stride_mosp,
                   stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
                   BLOCK_H, FOLD, BLOCK_M, 512, ca * 128, 128, ROLE == 0, DIRECT, 2, ACC)
        _store_out(ob, m_i, l_i, b, g, H, MID_O, MID_LSE, OUT, LSE, stride_mob, stride_mos, stride_moh, stride_mosp,
                   stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
                   BLOCK_H, FOLD, BLOCK_M, 512, cb * 128, 128, False, DIRECT, 2, ACC)

    @gluon.jit
    def _mla_decode_fp8mma_kernel(
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
        PAGE_SIZE: gl.constexpr, BLOCK_H: gl.constexpr, FOLD: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, DIRECT: gl.constexpr, NR: gl.constexpr,
        NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PROBE: gl.constexpr,
        WIDE: gl.constexpr, SOURCE_KEY: gl.constexpr, num_warps: gl.constexpr,
    ):
        b, g, seq_len, start, end = G._program_keys(SEQ, S, NUM_SPLITS, FOLD, BLOCK_N, CAUSAL)
        n_blocks = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
        Q8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        QR: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        V8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        V32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=32, rank=2)
        P8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        SC: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        # one [rows, 128] tile per chunk (the matmuls' operands)
        q_hi = gl.allocate_shared_memory(gl.float8e4nv, [4, BLOCK_M, 128], Q8)
        q_lo = gl.allocate_shared_memory(gl.float8e4nv, [4, BLOCK_M, 128], Q8)
        q_r = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, 64], QR)
        qs = gl.allocate_shared_memory(gl.float32, [4, BLOCK_M], PLAIN)
        raw_codes = gl.allocate_shared_memory(gl.float8e4nv, [NR * 4, BLOCK_N, 128], Q8)
        raw_rope = gl.allocate_shared_memory(gl.bfloat16, [NR, BLOCK_N, 64], QR)
        raw_scales = gl.allocate_shared_memory(gl.float32, [NR, BLOCK_N, 4], SC)
        vt32 = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, 512, BLOCK_N // 4], V32)
        vt = G._reinterpret(vt32, gl.float8e4nv, [NUM_STAGES, 512, BLOCK_N], V8)
        sc = gl.allocate_shared_memory(gl.float32, [NUM_STAGES * 4, BLOCK_N], PLAIN)  # [stage · 4 + chunk, key]
        fs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES * 4, BLOCK_M], PLAIN)  # each chunk's f, per row
        p8 = gl.allocate_shared_memory(gl.float8e4nv, [4, BLOCK_M, BLOCK_N], P8)  # P·scale/f per chunk, e4m3
        s_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        n_bars: gl.constexpr = 2 * NR + 2 * NUM_STAGES + 5
        bars = gl.allocate_shared_memory(gl.int64, [n_bars, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(n_bars):
            if i >= NR and i < 2 * NR:
                mbarrier.init(bars.index(i), count=3)  # RAW_FREE: producer and both consumers
            elif i >= 2 * NR + NUM_STAGES and i < 2 * NR + 2 * NUM_STAGES:
                mbarrier.init(bars.index(i), count=2)  # KV_FREE: both consumers
            else:
                mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        p8n = p8
        if PROBE == 3:
            p8n = gl.allocate_shared_memory(gl.float8e4nv, [4, BLOCK_N, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        shared = (codes_desc, rope_desc, scale_desc, BT, stride_btb, b, start, end, n_blocks,
                  q_hi, q_lo, q_r, qs, raw_codes, raw_rope, raw_scales, vt, vt32, sc, fs, p8, s_smem, bars, p8n)
        args = (Q, MID_O, MID_LSE, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_mob, stride_mos, stride_moh,
                stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb,
                stride_ls, scale_log2, S, H, g, seq_len)
        gl.warp_specialize([
            (_consumer, (0, shared, args, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, NR, NUM_STAGES, CAUSAL, DIRECT, PROBE)),
            (_consumer, (1, shared, args, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, NR, NUM_STAGES, CAUSAL, DIRECT, PROBE)),
            (_producer, (shared, PAGE_SIZE, BLOCK_N, BLOCK_M, NR, NUM_STAGES, PROBE, WIDE)),
        ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def fp8mma_supported(q: torch.Tensor, kv_cache: torch.Tensor, dc: int, block_m: int) -> bool:
    """Whether this kernel takes an fp8-cache call: whatever the unpacking kernel takes (Hopper, bf16 queries,
    Dc = 512, Dr = 64, ≤ 32 rows, contiguous 16-byte-aligned 656-byte rows), in pages of a multiple of 64 keys
    (one TMA box per block)."""
    return Q8.quant_supported(q, kv_cache, dc, block_m, "fp8_ds_mla") and kv_cache.shape[1] % BLOCK_N == 0


def _descriptors(kv_cache: torch.Tensor, scale_words: int = 4) -> tuple:
    """TMA views of the rows: codes [rows, 656] e4m3 in [64, 128] boxes, rope [rows, 328] bf16 in [64, 64]
    boxes, scales [rows, 164] fp32 in [64, scale_words] boxes."""
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    codes = kv_cache.view(torch.float8_e4m3fn).view(rows, ROW_BYTES)
    rope = kv_cache.view(torch.bfloat16).view(rows, ROW_BYTES // 2)
    scales = kv_cache.view(torch.float32).view(rows, ROW_BYTES // 4)
    q8 = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    qr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    sc = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return (TensorDescriptor.from_tensor(codes, [BLOCK_N, 128], q8),
            TensorDescriptor.from_tensor(rope, [BLOCK_N, 64], qr),
            TensorDescriptor.from_tensor(scales, [BLOCK_N, scale_words], sc))


def tma_launch_args(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2, cfg, *, causal: bool,
                    direct: bool, num_splits: int, block_m: int, scale_words: int = 4, views: tuple | None = None) -> tuple:
    """`split_launch_args` for the kernels that take no pointer-path layouts or widths: this one and
    `mla_decode_gluon_fp8reg` (the cache as TMA descriptors) and `mla_decode_gluon_tbq4reg` (its own `views`)."""
    grid, args, consts = G.split_launch_args(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2,
                                             cfg, dc=DC, causal=causal, direct=direct, num_splits=num_splits,
                                             block_n=BLOCK_N, block_m=block_m,
                                             kv_views=views or _descriptors(kv_cache, scale_words))
    for k in ("DC", "DR", "Q_C_SMEM", "Q_R_SMEM", "K_C_SMEM", "K_R_SMEM"):
        consts.pop(k)
    return grid, args, consts


def launch_fp8mma_split(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2, cfg, *,
                        causal: bool, direct: bool, num_splits: int):
    """Stage 1 of `mla_decode_triton` for an fp8 cache (grid, split rule and outputs as the other kernels)."""
    rows = max(16, cfg["BLOCK_M"])
    grid, args, consts = tma_launch_args(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2, cfg,
                                         causal=causal, direct=direct, num_splits=num_splits, block_m=rows)
    consumer_regs, producer_regs = REGS[rows]
    _mla_decode_fp8mma_kernel[grid](*args, **consts, NR=NUM_RAW[rows], NUM_STAGES=NUM_STAGES,
                                    CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs, PROBE=PROBE,
                                    WIDE=TRANSPOSE_16,
                                    SOURCE_KEY=_SOURCE_KEY, num_warps=4)
