"""Hopper MLA decode over a quantised latent cache — fp8_ds_mla (656-byte rows) or tbq4 (400-byte rows, attention in
the FWHT-rotated domain) — that dequantises each key block into a bf16 tile. Warp-specialised: a producer warpgroup
unpacks the codes into shared memory and two consumer warpgroups run bf16 matmuls on the tile, with the keys as the
matmuls' M dimension. It takes 16 or 32 query rows.

- Producer (8 warps): each block's codes (and the four fp32 scales or fp16 norms of each key) go into registers two
  blocks ahead, so HBM stays busy; block-table lookups run a block further ahead, so no load waits on another. The
  rope part (bf16 already) goes by cp.async into a ring of ROPE_STAGES.
- Unpacking is exact and leaves the scales out. fp8: a code's bits become the bf16 of the same value with integer
  operations only (`_E4M3_TO_BF16`, 10 per four codes), which spares the conversion unit. Subnormal codes
  (|code| < 2⁻⁶) come out as 2⁻⁷·(1 + m/8) instead of 2⁻⁶·m/8: an error of at most 2⁻⁷ in code units. tbq4: a
  byte-permute table lookup gives each 4-bit code's centroid in bf16 (`_TBQ4_PAIRS`); the block norms take the
  scales' place.
- The scales are applied where they are cheap: Sᵀ is summed from one accumulator per 128-column chunk, each
  multiplied by its per-key scale; P·V uses Pᵀ multiplied by the chunk's per-key scale (four Pᵀ tiles, one per
  chunk). No bf16 rounding of code·scale.
- Keys are the M dimension: Sᵀ = K·Qᵀ is [64 keys, R rows], Oᵀ = Vᵀ·Pᵀ is [512, R], so 16 rows are not padded to
  wgmma's M = 64.
- Consumer w owns latent chunks 2w and 2w+1 (and w = 1 the rope part): its partial scores, then its half of Oᵀ.
  The consumers swap partial scores through shared memory and both run the same softmax, so neither waits for
  the other's.
- Two tile stages of 64 keys; a stage is freed as soon as both consumers' P·V on it completed. Latent columns are
  permuted in the tile (`quant_common._latent_column`) so that each thread's unpacked pairs are 16-byte stores;
  q and the output are permuted to match.

Dc = 512, Dr = 64, bf16 queries. Same contract, split rule and partial layout as `mla_decode` (its combine
merges the splits). Gluon does not run in the Triton interpreter: GPU tests check it against the fp64 reference,
a CPU test compiles it for sm_90.
"""

from __future__ import annotations

import dataclasses

import torch

from specmla.ops.decode.hopper import common as G
from specmla.ops.decode.hopper import quant_common as QC
from specmla.ops.kv_cache import tbq4

if G.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_init, warpgroup_mma_wait)

    _cta_barrier = G._cta_barrier

BLOCK_N = QC.BLOCK_N  # keys per stage (wgmma's M): two bf16 stages of 64 × 576 fit beside Q
DC, DR = QC.DC, QC.DR  # four 128-code chunks, one scale or norm each, then the rope part
MAX_ROWS = 32  # query rows per program (16 or 32)
NUM_STAGES = 2
ROPE_STAGES = 3  # the rope part of block j+1 loads while block j is unpacked (see _producer)
FORMATS = {"fp8_ds_mla": 0, "tbq4": 1}  # the kernel's FMT: QC.FMT_FP8, QC.FMT_TBQ4 (tbq4: q rotated by the caller)


@dataclasses.dataclass(frozen=True)
class Options:
    """The dequant kernel's tuning knobs; the defaults are the measured best."""

    producer_warps: int = 8  # the producer holds two blocks of codes in registers
    # (consumer, producer) registers per thread at 16 and 32 rows: the consumers' accumulators grow with the rows,
    # and the file holds 2 × 128 × consumer + 32 × producer_warps × producer ≤ 64K
    regs16: tuple[int, int] = (120, 136)
    regs32: tuple[int, int] = (144, 112)


_SOURCE_KEY = G.source_key(__file__) ^ QC._SOURCE_KEY  # in the kernel's cache key (see G.source_key)
_c = getattr(gl, "constexpr", int) if G.HAVE_GLUON else int
KV_READY = _c(0)  # +stage: the producer has unpacked a block into it
KV_FREE = _c(NUM_STAGES)  # +stage: both consumers' matmuls that read it have completed (one arrival each)
S_READY = _c(2 * NUM_STAGES)  # +w: consumer w's partial scores of its latest block are in shared memory
S_READ = _c(2 * NUM_STAGES + 2)  # +w: the other consumer has read consumer w's latest partial scores
Q_READY = _c(2 * NUM_STAGES + 4)  # consumer 0 has stored Q
NUM_BARRIERS = _c(2 * NUM_STAGES + 5)

# Four e4m3 codes (one 32-bit word, bytes b0..b3) → two bf16x2 words (b0, b1) and (b2, b3) of the same
# values: the byte's magnitude bits shifted into bf16's exponent/mantissa fields, the exponent rebiased by
# 127 - 7 = 120 (0x3C00 per 16-bit lane; no carry into the sign), the sign bit moved to bit 15.
_E4M3_TO_BF16 = _c("""{
.reg .b32 m, s, a, b;
and.b32 m, $2, 0x7f7f7f7f;
and.b32 s, $2, 0x80808080;
prmt.b32 a, m, 0, 0x1404;
shr.b32 a, a, 4;
prmt.b32 b, s, 0, 0x1404;
add.u32 a, a, b;
add.u32 $0, a, 0x3C003C00;
prmt.b32 a, m, 0, 0x3424;
shr.b32 a, a, 4;
prmt.b32 b, s, 0, 0x3424;
add.u32 a, a, b;
add.u32 $1, a, 0x3C003C00;
}""")


_TBQ4_PAIRS = _c(tbq4.centroid_lookup_ptx(scaled=False))  # centroids, 4 bf16x2 pairs per word


if G.HAVE_GLUON:

    @gluon.jit
    def _load_q(Q, q_c_smem, q_r_smem, b, g, H, stride_qb, stride_qs, stride_qh, BLOCK_H: gl.constexpr,
                FOLD: gl.constexpr, BLOCK_M: gl.constexpr, DC: gl.constexpr, DR: gl.constexpr, FMT: gl.constexpr,
                LAYOUT: gl.constexpr):
        """Q rows (FOLD tokens × BLOCK_H heads) into shared memory, latent columns in the tile's order;
        padded rows are zeros."""
        rows_q = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LAYOUT))
        s_q = g * FOLD + rows_q // BLOCK_H
        h_q = gl.program_id(1) * BLOCK_H + rows_q % BLOCK_H
        ok_q = gl.expand_dims((rows_q < FOLD * BLOCK_H) & (h_q < H), 1)
        q_at = gl.expand_dims(b * stride_qb + s_q * stride_qs + h_q * stride_qh, 1)
        cols_qc = QC._latent_column(gl.arange(0, DC, layout=gl.SliceLayout(0, LAYOUT)), FMT)
        cols_qr = gl.arange(0, DR, layout=gl.SliceLayout(0, LAYOUT))
        q_c_smem.store(gl.load(Q + q_at + gl.expand_dims(cols_qc, 0), mask=ok_q, other=0.0))
        q_r_smem.store(gl.load(Q + q_at + DC + gl.expand_dims(cols_qr, 0), mask=ok_q, other=0.0).to(gl.bfloat16))

    # ---------------------------------------------------------------- producer -----------------------------

    @gluon.jit
    def _fetch_codes(KV16, KV32, rows, ok, DC: gl.constexpr, FMT: gl.constexpr, WORDS: gl.constexpr):
        """A key block's codes as four [keys, words] tensors of 32-bit words (one per 128-code chunk: fp8 32
        words, tbq4 16) and each key's four fp32 scales (fp8) or norms (tbq4, stored fp16), into registers;
        rows not ok read zeros."""
        # fp8: 656-byte rows, 16-byte aligned, [codes 512 | 4 fp32 scales | rope], 32 words per chunk;
        # tbq4: 400-byte rows, [codes 256 | 4 fp16 norms | pad | rope | pad], 16 words per chunk
        NW: gl.constexpr = 32 if FMT == QC.FMT_FP8 else 16
        ALIGN: gl.constexpr = 4 if FMT == QC.FMT_FP8 else 2
        at = gl.expand_dims(gl.multiple_of(rows // 4, ALIGN), 1)
        w = gl.expand_dims(gl.arange(0, NW, layout=gl.SliceLayout(0, WORDS)), 0)
        ok2 = gl.expand_dims(ok, 1)
        c0 = gl.load(KV32 + at + w, mask=ok2, other=0)
        c1 = gl.load(KV32 + at + NW + w, mask=ok2, other=0)
        c2 = gl.load(KV32 + at + 2 * NW + w, mask=ok2, other=0)
        c3 = gl.load(KV32 + at + 3 * NW + w, mask=ok2, other=0)
        if FMT == QC.FMT_FP8:
            s_at = rows // 4 + DC // 4
            s0 = gl.load(KV32 + s_at, mask=ok, other=0).to(gl.float32, bitcast=True)
            s1 = gl.load(KV32 + s_at + 1, mask=ok, other=0).to(gl.float32, bitcast=True)
            s2 = gl.load(KV32 + s_at + 2, mask=ok, other=0).to(gl.float32, bitcast=True)
            s3 = gl.load(KV32 + s_at + 3, mask=ok, other=0).to(gl.float32, bitcast=True)
        else:
            n_at = rows // 2 + DC // 4
            s0 = gl.load(KV16 + n_at, mask=ok, other=0.0).to(gl.float16, bitcast=True).to(gl.float32)
            s1 = gl.load(KV16 + n_at + 1, mask=ok, other=0.0).to(gl.float16, bitcast=True).to(gl.float32)
            s2 = gl.load(KV16 + n_at + 2, mask=ok, other=0.0).to(gl.float16, bitcast=True).to(gl.float32)
            s3 = gl.load(KV16 + n_at + 3, mask=ok, other=0.0).to(gl.float16, bitcast=True).to(gl.float32)
        return c0, c1, c2, c3, s0, s1, s2, s3

    @gluon.jit
    def _unpack_chunk(tile32, words, c: gl.constexpr, FMT: gl.constexpr):
        """Chunk c's codes → exact bf16 values (fp8: the code; tbq4: its centroid) in the tile, viewed as
        32-bit words of bf16 pairs. fp8: pair 0 of word v at word 64c + v, pair 1 at 64c + 32 + v; tbq4:
        pair k of word v at 64c + 16k + v."""
        if FMT == QC.FMT_FP8:
            lo, hi = gl.inline_asm_elementwise(_E4M3_TO_BF16, "=r,=r,r", [words], dtype=(gl.int32, gl.int32),
                                               is_pure=True, pack=1)
            tile32.slice(64 * c, 32, dim=1).store(lo)
            tile32.slice(64 * c + 32, 32, dim=1).store(hi)
        else:
            p0, p1, p2, p3 = gl.inline_asm_elementwise(_TBQ4_PAIRS, "=r,=r,=r,=r,r", [words],
                                                       dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True,
                                                       pack=1)
            tile32.slice(64 * c, 16, dim=1).store(p0)
            tile32.slice(64 * c + 16, 16, dim=1).store(p1)
            tile32.slice(64 * c + 32, 16, dim=1).store(p2)
            tile32.slice(64 * c + 48, 16, dim=1).store(p3)

    @gluon.jit
    def _load_rope(KV16, k_r_buf, rows, ok, DC: gl.constexpr, DR: gl.constexpr, FMT: gl.constexpr,
                   ROPE: gl.constexpr):
        """cp.async a key block's bf16 rope part into its shared buffer (rows past the end: zeros). It
        starts at byte 528 of an fp8 row, 272 of a tbq4 row (both 16-byte aligned)."""
        cols = gl.arange(0, DR, layout=gl.SliceLayout(0, ROPE))
        if FMT == QC.FMT_FP8:
            at = gl.multiple_of(rows // 2 + (DC + 4 * (DC // 128)) // 2, 8)
        else:
            at = gl.multiple_of(rows // 2 + QC.TBQ4_ROPE_AT, 4)
        G._cp_async(k_r_buf, KV16 + gl.expand_dims(at, 1) + gl.expand_dims(cols, 0), mask=gl.expand_dims(ok, 1))
        cp.commit_group()

    @gluon.jit
    def _producer(shared, PAGE_SIZE: gl.constexpr, DC: gl.constexpr, DR: gl.constexpr, BLOCK_N: gl.constexpr,
                  NUM_STAGES: gl.constexpr, ROPE_STAGES: gl.constexpr, WARPS: gl.constexpr, FMT: gl.constexpr):
        """Block j: its codes went into registers two blocks ago (one block in flight is too little to
        keep HBM busy) and its rope part was cp.async'd into rope buffer j % ROPE_STAGES. Wait until both
        consumers have freed tile stage j % NUM_STAGES, start block j+1's rope (its buffer last held block
        j+1-ROPE_STAGES, whose scores were done before block j-2 was freed), unpack block j and its scales,
        load block j+2's codes into the registers just freed (its rows were looked up a block earlier, so
        no load waits on another) and mark the stage ready once the rope has landed."""
        (Q, KV16, KV32, BT, stride_kvp, stride_kvt, stride_btb, b, start, end, n_blocks,
         q_c_smem, q_r_smem, k_c_smem, k_c32_smem, k_r_smem, sc_smem, p_smem, s_smem, bars) = shared
        # 32-bit words per load (tbq4: 8 bytes, so that 8 threads cover a chunk)
        VEC: gl.constexpr = 4 if FMT == QC.FMT_FP8 else 2
        WORDS: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, VEC], threads_per_warp=[4, 8],
                                               warps_per_cta=[WARPS, 1], order=[1, 0])
        ROPE: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2 * VEC], threads_per_warp=[4, 8],
                                              warps_per_cta=[WARPS, 1], order=[1, 0])
        KEYS: gl.constexpr = gl.SliceLayout(1, WORDS)
        # blocks 0 and 1 in flight; block 2's rows looked up; block 0's rope started, block 1's rows for it
        rows_w, ok_w = G._block_page_rows(BT, b, stride_btb, start, end, stride_kvp, stride_kvt, PAGE_SIZE, BLOCK_N,
                                           WORDS)
        c0, c1, c2, c3, s0, s1, s2, s3 = _fetch_codes(KV16, KV32, rows_w, ok_w, DC, FMT, WORDS)
        rows_w, ok_w = G._block_page_rows(BT, b, stride_btb, start + BLOCK_N, end, stride_kvp, stride_kvt, PAGE_SIZE,
                                           BLOCK_N, WORDS)
        d0, d1, d2, d3, t0, t1, t2, t3 = _fetch_codes(KV16, KV32, rows_w, ok_w, DC, FMT, WORDS)
        rows_w, ok_w = G._block_page_rows(BT, b, stride_btb, start + 2 * BLOCK_N, end, stride_kvp, stride_kvt,
                                           PAGE_SIZE, BLOCK_N, WORDS)
        rows_r, ok_r = G._block_page_rows(BT, b, stride_btb, start, end, stride_kvp, stride_kvt, PAGE_SIZE, BLOCK_N,
                                           ROPE)
        _load_rope(KV16, k_r_smem.index(0), rows_r, ok_r, DC, DR, FMT, ROPE)
        rows_r, ok_r = G._block_page_rows(BT, b, stride_btb, start + BLOCK_N, end, stride_kvp, stride_kvt, PAGE_SIZE,
                                           BLOCK_N, ROPE)
        for j in range(n_blocks):
            st = j % NUM_STAGES
            mbarrier.wait(bars.index(KV_FREE + st), ((j // NUM_STAGES) + 1) & 1, pred=j >= NUM_STAGES)
            _load_rope(KV16, k_r_smem.index((j + 1) % ROPE_STAGES), rows_r, ok_r, DC, DR, FMT, ROPE)
            tile = k_c32_smem.index(st)
            _unpack_chunk(tile, c0, 0, FMT)
            _unpack_chunk(tile, c1, 1, FMT)
            _unpack_chunk(tile, c2, 2, FMT)
            _unpack_chunk(tile, c3, 3, FMT)
            sc_smem.index(4 * st).store(gl.convert_layout(s0, KEYS))
            sc_smem.index(4 * st + 1).store(gl.convert_layout(s1, KEYS))
            sc_smem.index(4 * st + 2).store(gl.convert_layout(s2, KEYS))
            sc_smem.index(4 * st + 3).store(gl.convert_layout(s3, KEYS))
            # block j's registers are free: block j+2's codes go in flight (block j+1's have been since block j-1)
            e0, e1, e2, e3, u0, u1, u2, u3 = _fetch_codes(KV16, KV32, rows_w, ok_w, DC, FMT, WORDS)
            nx = start + (j + 2) * BLOCK_N
            rows_w, ok_w = G._block_page_rows(BT, b, stride_btb, nx + BLOCK_N, end, stride_kvp, stride_kvt, PAGE_SIZE,
                                               BLOCK_N, WORDS)
            rows_r, ok_r = G._block_page_rows(BT, b, stride_btb, nx, end, stride_kvp, stride_kvt, PAGE_SIZE, BLOCK_N,
                                               ROPE)
            cp.wait_group(1)  # block j's rope has landed (block j+1's may still fly)
            fence_async_shared()
            _cta_barrier()
            mbarrier.arrive(bars.index(KV_READY + st))
            c0, c1, c2, c3, s0, s1, s2, s3 = d0, d1, d2, d3, t0, t1, t2, t3
            d0, d1, d2, d3, t0, t1, t2, t3 = e0, e1, e2, e3, u0, u1, u2, u3
        cp.wait_group(0)

    # ---------------------------------------------------------------- consumers ----------------------------

    @gluon.jit
    def _scores(k_c, k_r, q_c_smem, q_r_smem, s_zero, ROLE: gl.constexpr):
        """Issue consumer ROLE's partial Sᵀ: one accumulator per 128-column chunk of its half (they take
        different scales), and for consumer 1 the rope part (unscaled)."""
        c0: gl.constexpr = 256 * ROLE
        sa = warpgroup_mma(k_c.slice(c0, 128, dim=1), q_c_smem.slice(c0, 128, dim=1).permute((1, 0)), s_zero,
                           use_acc=False, is_async=True)
        sb = warpgroup_mma(k_c.slice(c0 + 128, 128, dim=1), q_c_smem.slice(c0 + 128, 128, dim=1).permute((1, 0)),
                           s_zero, use_acc=False, is_async=True)
        if ROLE == 1:
            sr = warpgroup_mma(k_r, q_r_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        else:
            sr = s_zero
        return sa, sb, sr

    @gluon.jit
    def _consumer(ROLE: gl.constexpr, shared, args, DC: gl.constexpr, DR: gl.constexpr, BLOCK_H: gl.constexpr,
                  FOLD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                  ROPE_STAGES: gl.constexpr, CAUSAL: gl.constexpr, DIRECT: gl.constexpr, FMT: gl.constexpr):
        """Consumer ROLE (latent chunks 2·ROLE, 2·ROLE+1). Block j: issue its partial Sᵀ_j once stage j is
        ready, free stage j-1 as soon as its P_{j-1}·V_{j-1} is done, scale each chunk's scores per key, swap
        partials with the other consumer through shared memory, and run the same softmax on the same sums
        (a + b = b + a, so both hold identical P, max and row sums). Then store Pᵀ scaled for its own two
        chunks and issue Vᵀ_j·Pᵀ_j for them. Both run the softmax, so neither waits for the other's."""
        (Q, KV16, KV32, BT, stride_kvp, stride_kvt, stride_btb, b, start, end, n_blocks,
         q_c_smem, q_r_smem, k_c_smem, k_c32_smem, k_r_smem, sc_smem, p_smem, s_smem, bars) = shared
        (MID_O, MID_LSE, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_mob, stride_mos, stride_moh, stride_mosp,
         stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
         scale_log2, S, H, g, seq_len) = args
        dtype: gl.constexpr = k_c_smem.dtype
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_M, 16])
        ROPE: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                              warps_per_cta=[4, 1], order=[1, 0])
        ROW: gl.constexpr = gl.SliceLayout(0, ACC)
        KEY: gl.constexpr = gl.SliceLayout(1, ACC)
        OTHER: gl.constexpr = 1 - ROLE
        OUTSTANDING: gl.constexpr = 2 + ROLE  # the partial-score groups issued after this consumer's last P·V
        if ROLE == 0:
            _load_q(Q, q_c_smem, q_r_smem, b, g, H, stride_qb, stride_qs, stride_qh, BLOCK_H, FOLD, BLOCK_M, DC, DR,
                    FMT, ROPE)
            fence_async_shared()
            _cta_barrier()
            mbarrier.arrive(bars.index(Q_READY))
        else:
            mbarrier.wait(bars.index(Q_READY), 0)

        limit = QC._row_limits(seq_len, S, g, FOLD, BLOCK_H, BLOCK_M, CAUSAL, ROW)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=ROW)
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=ACC)
        l_keys = s_zero
        oa = warpgroup_mma_init(gl.zeros([128, BLOCK_M], gl.float32, layout=ACC))  # Oᵀ rows of chunk 2·ROLE
        ob = warpgroup_mma_init(gl.zeros([128, BLOCK_M], gl.float32, layout=ACC))  # ... and of chunk 2·ROLE+1
        keys = gl.arange(0, BLOCK_N, layout=KEY)
        for j in range(n_blocks):
            st = j % NUM_STAGES
            mbarrier.wait(bars.index(KV_READY + st), (j // NUM_STAGES) & 1)
            k_c = k_c_smem.index(st)
            sa, sb, sr = _scores(k_c, k_r_smem.index(j % ROPE_STAGES), q_c_smem, q_r_smem, s_zero, ROLE)
            oa, ob = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(oa, ob))  # this consumer's P_{j-1}·V_{j-1}
            # free stage j-1 now: the producer unpacks block j+1 into it while this block computes
            _cta_barrier()
            mbarrier.arrive(bars.index(KV_FREE + (j - 1) % NUM_STAGES), pred=j > 0)
            sa, sb, sr = warpgroup_mma_wait(num_outstanding=0, deps=(sa, sb, sr))
            s = (sa * gl.expand_dims(sc_smem.index(4 * st + 2 * ROLE).load(KEY), 1)
                 + sb * gl.expand_dims(sc_smem.index(4 * st + 2 * ROLE + 1).load(KEY), 1))
            if ROLE == 1:
                s = s + sr
            # swap partial scores: this buffer is free once the other consumer has read block j-1's
            mbarrier.wait(bars.index(S_READ + ROLE), (j + 1) & 1, pred=j > 0)
            s_smem.index(ROLE).store(s)
            _cta_barrier()
            mbarrier.arrive(bars.index(S_READY + ROLE))
            mbarrier.wait(bars.index(S_READY + OTHER), j & 1)
            s = s + s_smem.index(OTHER).load(ACC)
            _cta_barrier()
            mbarrier.arrive(bars.index(S_READ + OTHER))
            p, alpha, m_i, l_keys = QC._softmax_keys(s, m_i, l_keys, start + j * BLOCK_N + keys, end, limit,
                                                     scale_log2)
            p_smem.index(2 * ROLE).store((p * gl.expand_dims(sc_smem.index(4 * st + 2 * ROLE).load(KEY), 1))
                                         .to(dtype))
            p_smem.index(2 * ROLE + 1).store(
                (p * gl.expand_dims(sc_smem.index(4 * st + 2 * ROLE + 1).load(KEY), 1)).to(dtype))
            fence_async_shared()
            _cta_barrier()  # every warp's Pᵀ is stored
            oa = oa * gl.expand_dims(alpha, 0)
            ob = ob * gl.expand_dims(alpha, 0)
            c0: gl.constexpr = 256 * ROLE
            oa = warpgroup_mma(k_c.slice(c0, 128, dim=1).permute((1, 0)), p_smem.index(2 * ROLE), oa,
                               is_async=True)
            ob = warpgroup_mma(k_c.slice(c0 + 128, 128, dim=1).permute((1, 0)), p_smem.index(2 * ROLE + 1), ob,
                               is_async=True)
        oa, ob = warpgroup_mma_wait(num_outstanding=0, deps=(oa, ob))
        l_i = gl.sum(l_keys, axis=0)
        QC._store_out(oa, m_i, l_i, b, g, H, MID_O, MID_LSE, OUT, LSE, stride_mob, stride_mos, stride_moh,
                      stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb,
                      stride_ls, BLOCK_H, FOLD, BLOCK_M, DC, 256 * ROLE, 128, ROLE == 0, DIRECT, FMT, ACC)
        QC._store_out(ob, m_i, l_i, b, g, H, MID_O, MID_LSE, OUT, LSE, stride_mob, stride_mos, stride_moh,
                      stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb,
                      stride_ls, BLOCK_H, FOLD, BLOCK_M, DC, 256 * ROLE + 128, 128, False, DIRECT, FMT, ACC)

    @gluon.jit
    def _mla_decode_quant_kernel(
        Q, KV16, KV32, BT, SEQ, MID_O, MID_LSE, OUT, LSE,
        stride_qb, stride_qs, stride_qh,
        stride_kvp, stride_kvt,
        stride_btb,
        stride_mob, stride_mos, stride_moh, stride_mosp,
        stride_mlb, stride_mls, stride_mlh,
        stride_ob, stride_os, stride_oh,
        stride_lb, stride_ls,
        scale_log2,
        S, H, NUM_SPLITS,
        PAGE_SIZE: gl.constexpr, DC: gl.constexpr, DR: gl.constexpr,
        BLOCK_H: gl.constexpr, FOLD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        CAUSAL: gl.constexpr, DIRECT: gl.constexpr,
        Q_C_SMEM: gl.constexpr, Q_R_SMEM: gl.constexpr, K_C_SMEM: gl.constexpr, K_R_SMEM: gl.constexpr,
        K_C32_SMEM: gl.constexpr, P_SMEM: gl.constexpr, NUM_STAGES: gl.constexpr, ROPE_STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, FMT: gl.constexpr,
        SOURCE_KEY: gl.constexpr, num_warps: gl.constexpr,
    ):
        dtype: gl.constexpr = Q.dtype.element_ty
        b, g, seq_len, start, end = G._program_keys(SEQ, S, NUM_SPLITS, FOLD, BLOCK_N, CAUSAL)
        n_blocks = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
        q_c_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, DC], Q_C_SMEM)
        q_r_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, DR], Q_R_SMEM)
        # the unpacked tiles: written as 32-bit words (bf16 pairs) by the producer, read as bf16 by the matmuls
        k_c32_smem = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, BLOCK_N, DC // 2], K_C32_SMEM)
        k_c_smem = G._reinterpret(k_c32_smem, dtype, [NUM_STAGES, BLOCK_N, DC], K_C_SMEM)
        k_r_smem = gl.allocate_shared_memory(gl.bfloat16, [ROPE_STAGES, BLOCK_N, DR], K_R_SMEM)
        VEC: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        sc_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES * 4, BLOCK_N], VEC)  # [stage · 4 + chunk, key]
        p_smem = gl.allocate_shared_memory(dtype, [4, BLOCK_N, BLOCK_M], P_SMEM)  # Pᵀ · each chunk's scales
        # each consumer's partial scores of its latest block
        s_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        bars = gl.allocate_shared_memory(gl.int64, [NUM_BARRIERS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BARRIERS):
            mbarrier.init(bars.index(i), count=2 if i >= KV_FREE and i < S_READY else 1)
        fence_async_shared()

        shared = (Q, KV16, KV32, BT, stride_kvp, stride_kvt, stride_btb, b, start, end, n_blocks,
                  q_c_smem, q_r_smem, k_c_smem, k_c32_smem, k_r_smem, sc_smem, p_smem, s_smem, bars)
        args = (MID_O, MID_LSE, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_mob, stride_mos, stride_moh,
                stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb,
                stride_ls, scale_log2, S, H, g, seq_len)
        gl.warp_specialize([
            (_consumer, (0, shared, args, DC, DR, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, NUM_STAGES, ROPE_STAGES, CAUSAL,
                         DIRECT, FMT)),
            (_consumer, (1, shared, args, DC, DR, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, NUM_STAGES, ROPE_STAGES, CAUSAL,
                         DIRECT, FMT)),
            (_producer, (shared, PAGE_SIZE, DC, DR, BLOCK_N, NUM_STAGES, ROPE_STAGES, PRODUCER_WARPS, FMT)),
        ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


def supported(q: torch.Tensor, kv_cache: torch.Tensor, kv_format: str, block_m: int, opts: Options = Options(), *,
              head_dim_v: int | None = None) -> bool:
    """Whether this kernel can take the call: Hopper, bf16 queries with Dc = 512 and Dr = 64 (the rope part is
    bf16), contiguous 16-byte aligned fp8_ds_mla or tbq4 rows, row tiles of at most MAX_ROWS."""
    return (kv_format in FORMATS and block_m <= MAX_ROWS
            and QC.hopper_rows_supported(q, kv_cache, QC.ROW_BYTES[kv_format], head_dim_v))


def launch(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2: float, plan: dict, *,
           causal: bool, num_splits: int, kv_format: str, opts: Options = Options()) -> None:
    """Stage 1 of the split-KV decode over an fp8_ds_mla or tbq4 cache (tbq4: q already rotated); writes out/lse
    itself when num_splits == 1, else mid_o/mid_lse. The kernel reads the uint8 rows as bf16 (rope, tbq4 norms)
    and 32-bit words (codes, fp8 scales)."""
    rows = max(16, plan["BLOCK_M"])
    grid, args, consts = G.split_launch_args(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2,
                                             plan, dc=DC, causal=causal, direct=num_splits == 1,
                                             num_splits=num_splits, block_n=BLOCK_N, block_m=rows,
                                             kv_views=(kv_cache.view(torch.bfloat16), kv_cache.view(torch.int32)))
    consts["K_C32_SMEM"] = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    consumer_regs, producer_regs = opts.regs16 if rows == 16 else opts.regs32
    _mla_decode_quant_kernel[grid](*args, **consts, P_SMEM=G._smem_layout([BLOCK_N, rows], q.dtype),
                                   NUM_STAGES=NUM_STAGES, ROPE_STAGES=ROPE_STAGES, CONSUMER_REGS=consumer_regs,
                                   PRODUCER_WARPS=opts.producer_warps, PRODUCER_REGS=producer_regs,
                                   FMT=FORMATS[kv_format], SOURCE_KEY=_SOURCE_KEY, num_warps=4)
