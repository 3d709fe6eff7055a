"""Hopper MLA decode over a tbq4 cache: the producer turns each block's 4-bit codes into e4m3 centroids, and the
consumers of `mla_decode_gluon_fp8reg` (e4m3 matmuls, Vᵀ from registers) run on them.

Why: the unpacking kernel (`mla_decode_gluon_quant`) writes a bf16 tile per block and runs bf16 matmuls on it;
it reads tbq4 rows at 1.0× bf16's speed, against 2.9× fewer bytes. Here:
- The producer copies each 64-key block of 400-byte rows with TMA (the codes as one [64, 64]-word box, the
  norms as [64, 8] fp16, the rope as [64, 64] bf16): the row layout (`tbq4.cache_row_bytes`) keeps every field
  16-byte aligned for that. (392-byte rows allowed only 8-byte cp.async through L1: 385 against 308 µs.)
- The producer warpgroup loads a block's 32 words per thread at once, then decodes each word of 8 codes into 8
  e4m3 bytes with 9 instructions (`tbq4.e4m3_lookup_ptx`: codes are sign·8 + magnitude rank, so one byte permute
  on an 8-entry table gives four magnitudes and a second one the four signs; the centroids times k are rounded to
  e4m3 within 2 %), copies the rope tile and writes the per-key scales norm/k, normalised by one factor per block
  (a warp's reduction). That is the fp8 kernel's stage, so its consumers run unchanged: Q·Kᵀ as e4m3 wgmmas on
  the stage, Vᵀ loaded from it into registers, P·V in e4m3.
- Two rings: raw stages (codes and norms, 17 KB, refilled once the producer has decoded them) and decoded stages
  (40 KB, freed by the consumers). Three of each fit beside q and Pᵀ. The rope goes by TMA straight into its decoded
  stage (`ROPE_DIRECT`), so the producer no longer copies it: that stage is ready once the rope's copy and the
  producer's arrive are both in (its barrier counts two). 3 % faster (H100, B=32 T=32k: 209–212 against
  216–218 µs in four runs, seventeenth session).
- q is one e4m3 term (`Q_SPLIT`) and so is Pᵀ: their rounding (≈ 3 % per element) is small beside the 4-bit
  codes' 9.6 %, and the second terms would cost a third of the consumers' time (docs/benchmarks.md, issue 7).
- Attention runs in the rotated domain: the caller rotates q's latent part and the output (`mla_decode_triton`).

Status (H100, H=16, docs/benchmarks.md issue 7, seventeenth session): 2–4 % from the exact tbq4 attention, every
row's cosine > 0.999 (GPU tests); the whole call (with the rotations of `tbq4_rotate`) takes 208 µs at B=32 T=32k
against bf16's 414 (1.98×), 83 against 139 at B=4 T=80k (1.67×). What bounds it: the copies alone took 161–164 µs
(87 % of the copy rate, 2.55–2.6× bf16; measured with the rope through the raw ring), the consumers alone 183 µs,
and the producer's decode beside them adds the rest.

16 query rows (H = 16, S = 1), Dc = 512, Dr = 64, pages of a multiple of 64 keys; other calls go to the other
kernels. Same contract, grid, split rule and partials as `mla_decode_triton`. Gluon does not run in the Triton
interpreter: GPU tests check it against the fp64 reference, a CPU test compiles it for sm_90.
"""

from __future__ import annotations

import torch

from specmla.ops.decode.hopper import common as G
from specmla.ops.decode.hopper import fp8 as R
from specmla.ops.decode.hopper import quant_common as QC
from specmla.ops.kv_cache import tbq4

if G.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _cta_barrier = G._cta_barrier

BLOCK_N = 64
BLOCK_M = 16
ROW = QC.ROW_BYTES["tbq4"]  # 400 bytes: 256 of codes, 4 fp16 norms, 8 of padding, 64 bf16 rope values
NUM_DECODED = 3  # decoded stages (40 KB): each consumer holds one, the producer writes the third
NUM_RAW = 3  # raw stages (17 KB with ROPE_DIRECT, else 25.6 KB): two in flight while the producer decodes one
REGS = (216, 72)  # (consumer, producer) registers per thread
CODE_BOX = 64  # 32-bit words per row of a code TMA box: 64, all four chunks (256 bytes; 16, a box per chunk: 3 % slower)
ROPE_DIRECT = True  # the rope copied by TMA straight into its decoded stage (else through the raw ring); with it a raw
# stage is 17 KB and NUM_RAW = 4 fits: it crashed at B=32 T=32k in the seventeenth session, runs since (twentieth),
# but gains nothing (H100, B=32 T=32k: 211.9 against 212.5 µs; B=4 T=80k 83.3 against 82.5), so NUM_RAW stays 3
USE = True  # True: mla_decode_triton sends the tbq4 calls this kernel takes here (else `mla_decode_gluon_quant`)
Q_SPLIT = False  # q as two e4m3 terms in Q·Kᵀ (True) or one
REG_A = False  # Q·Kᵀ's codes from registers (`mla_decode_gluon_fp8reg.REG_A`): bit for bit the same, slower (its
# consumers spill; H100, B=32 T=32k: 251.4 against 213.3 µs)
PROBE = 0  # timing probes (wrong results), bits: 1 the producer decodes nothing, 2 copies nothing, 4 the consumers
# hand every stage straight back, 8 no scales. Bit 4 (4, 5, 12, 13) hangs or fails at launch from B=8 T=8k on the H100
# (passes at B=2 T=4k, and under compute-sanitizer, which reports no error): a race that only consumers doing nothing
# expose, not found (twentieth session); the kernel's tests and benchmarks pass

_SOURCE_KEY = G.source_key(__file__) ^ R._SOURCE_KEY
_c = getattr(gl, "constexpr", int) if G.HAVE_GLUON else int
_DECODE = _c(tbq4.e4m3_lookup_ptx())
_INV_K = 1.0 / tbq4.e4m3_centroids()[0]
ROW_BYTES = _c(ROW)
NORMS_AT = _c(tbq4.norms_offset(512) // 2)  # in fp16 units
ROPE_AT = QC.TBQ4_ROPE_AT  # in bf16 units

if G.HAVE_GLUON:

    @gluon.jit
    def _issue_raw(codes_desc, norms_desc, rope_desc, BT, b, stride_btb, n0, raw_codes, raw_norms, raw_rope, tbars, rr,
                   PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, CB: gl.constexpr, ROPE_DIRECT: gl.constexpr):
        """TMA the key block starting at key n0 (whole 400-byte rows of its page) into raw stage rr: each chunk's
        codes in [64 keys, CB words] boxes, the norms (and their padding) as [64, 8] fp16 and, unless ROPE_DIRECT
        (`_issue_rope`), the rope as [64, 64] bf16; the stage's barrier completes when all bytes have landed
        (25.6 KB, or 17 KB)."""
        row = QC._block_row(BT, b, stride_btb, n0, PAGE_SIZE)
        bar = tbars.index(rr)
        mbarrier.expect(bar, BLOCK_N * (272 if ROPE_DIRECT else ROW_BYTES))
        for c in gl.static_range(64 // CB):
            QC._tma_load(codes_desc, [row, CB * c], bar, raw_codes.index(rr * (64 // CB) + c))
        QC._tma_load(norms_desc, [row, NORMS_AT], bar, raw_norms.index(rr))
        if not ROPE_DIRECT:
            QC._tma_load(rope_desc, [row, ROPE_AT], bar, raw_rope.index(rr))

    @gluon.jit
    def _issue_rope(rope_desc, BT, b, stride_btb, n0, dst, bar, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr):
        """TMA the block's rope [64, 64] bf16 straight into its decoded stage, on the stage's ready barrier (its
        expect is one of the barrier's two arrivals, the producer's arrive the other)."""
        row = QC._block_row(BT, b, stride_btb, n0, PAGE_SIZE)
        mbarrier.expect(bar, BLOCK_N * 128)
        QC._tma_load(rope_desc, [row, ROPE_AT], bar, dst)

    @gluon.jit
    def _chunk_words(raw_codes, rr, c: gl.constexpr, CB: gl.constexpr):
        """Raw stage rr's codes of chunk c ([64 keys, 16 words]) within its code box."""
        box = raw_codes.index(rr * (64 // CB) + (16 * c) // CB)
        if CB == 16:
            return box
        else:
            return box.slice((16 * c) % CB, 16, dim=1)

    @gluon.jit
    def _decode_chunk(words, dst, BLOCK_N: gl.constexpr):
        """A chunk's codes [64 keys, 16 words] → e4m3 centroids·k into its decoded tile (fp8 [64, 128])."""
        TILE32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        lo, hi = gl.inline_asm_elementwise(_DECODE, "=r,=r,r", [words], dtype=(gl.int32, gl.int32), is_pure=True,
                                           pack=1)
        G._reinterpret(dst, gl.int32, [BLOCK_N, 32], TILE32).store(gl.reshape(gl.join(lo, hi), [BLOCK_N, 32]))

    @gluon.jit
    def _store_block_scales(n4, valid, sc, fs, ds, INV_K: gl.constexpr, BLOCK_M: gl.constexpr, NL: gl.constexpr,
                            FL: gl.constexpr):
        """A block's norms n4 [keys, 4 chunks] (fp16; zeroed where not valid) as the consumers' scales, normalised by
        one factor per block instead of one per chunk (`fp8reg._store_scales`): a block's four chunks of a token
        have norms of one size, and one maximum is a warp's reduction, where four were a warpgroup's (barriers)."""
        s4 = gl.where(gl.expand_dims(valid, 1), n4.to(gl.float32), 0.0)
        m = gl.maximum(gl.max(gl.max(s4, axis=1), axis=0), 1e-30)
        s4 = s4 * (448.0 / m)
        f = m * (INV_K / 448.0)
        chunks = gl.arange(0, 4, layout=gl.SliceLayout(0, NL))
        for c in gl.static_range(4):
            sc.index(ds * 4 + c).store(gl.sum(gl.where(gl.expand_dims(chunks, 0) == c, s4, 0.0), axis=1))
            fs.index(ds * 4 + c).store(gl.full([BLOCK_M], 0.0, gl.float32, layout=FL) + f)

    @gluon.jit
    def _producer(shared, raw, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                  ND: gl.constexpr, NRAW: gl.constexpr, INV_K: gl.constexpr, PROBE: gl.constexpr, CB: gl.constexpr,
                  ROPE_DIRECT: gl.constexpr):
        """Keep NRAW raw blocks in flight; per block wait for its bytes and for a free decoded stage, write the
        per-key scales (norm / k, normalised once per block), load the block's codes, decode them into e4m3, copy
        the rope tile, hand the stage over and refill the raw stage. (Refilling it before the decode, once the
        words are in registers, was slower: 289 against 257 µs, docs/benchmarks.md issue 7.)"""
        (codes_desc, norms_desc, rope_desc, BT, stride_btb, b, start, end, n_blocks,
         q_hi, q_lo, q_r, qs, dec_codes, dec_rope, unused2, sc, fs, p8, bars) = shared
        raw_codes, raw_norms, raw_rope, tbars = raw
        KV_READY: gl.constexpr = 2 * ND
        FL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[4], order=[0])
        # a chunk's codes [64 keys, 16 words] (64-byte rows), 8-byte loads: 4 keys per warp, conflict-free
        DL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                            order=[1, 0])
        RL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[2, 16], warps_per_cta=[4, 1],
                                            order=[1, 0])
        for i in gl.static_range(NRAW):
            if (PROBE & 2) == 0:
                if i < n_blocks:
                    _issue_raw(codes_desc, norms_desc, rope_desc, BT, b, stride_btb, start + i * BLOCK_N, raw_codes,
                               raw_norms, raw_rope, tbars, i, PAGE_SIZE, BLOCK_N, CB, ROPE_DIRECT)
        # the norms [64 keys, 4] in each warp whole (the other warps hold copies): reductions within a warp
        NL: gl.constexpr = gl.BlockedLayout(size_per_thread=[2, 4], threads_per_warp=[32, 1], warps_per_cta=[1, 4],
                                            order=[1, 0])
        keys_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, NL))
        for j in range(n_blocks):
            rr = j % NRAW
            ds = j % ND
            if (PROBE & 2) == 0:
                mbarrier.wait(tbars.index(rr), (j // NRAW) & 1)
            if j >= ND:  # the consumer of block j - ND has read its stage
                mbarrier.wait(bars.index(ND + ds), ((j - ND) // ND) & 1)
            if ROPE_DIRECT:  # the rope lands in the stage while the codes are decoded
                if (PROBE & 2) == 0:
                    _issue_rope(rope_desc, BT, b, stride_btb, start + j * BLOCK_N, dec_rope.index(ds),
                                bars.index(KV_READY + ds), PAGE_SIZE, BLOCK_N)
                else:
                    mbarrier.arrive(bars.index(KV_READY + ds))
            if (PROBE & 8) == 0:  # the norms / k as the fp8 kernel's scales
                _store_block_scales(raw_norms.index(rr).slice(0, 4, dim=1).load(NL), start + j * BLOCK_N + keys_n < end,
                                    sc, fs, ds, INV_K, BLOCK_M, NL, FL)
            if (PROBE & 1) == 0:  # all four chunks' words loaded before any is decoded
                w0 = _chunk_words(raw_codes, rr, 0, CB).load(DL)
                w1 = _chunk_words(raw_codes, rr, 1, CB).load(DL)
                w2 = _chunk_words(raw_codes, rr, 2, CB).load(DL)
                w3 = _chunk_words(raw_codes, rr, 3, CB).load(DL)
                _decode_chunk(w0, dec_codes.index(ds * 4 + 0), BLOCK_N)
                _decode_chunk(w1, dec_codes.index(ds * 4 + 1), BLOCK_N)
                _decode_chunk(w2, dec_codes.index(ds * 4 + 2), BLOCK_N)
                _decode_chunk(w3, dec_codes.index(ds * 4 + 3), BLOCK_N)
                if not ROPE_DIRECT:
                    dec_rope.index(ds).store(raw_rope.index(rr).load(RL))
            fence_async_shared()
            _cta_barrier()  # every warp has written the stage and read the raw one
            mbarrier.arrive(bars.index(KV_READY + ds))
            if (PROBE & 2) == 0:
                if j + NRAW < n_blocks:
                    _issue_raw(codes_desc, norms_desc, rope_desc, BT, b, stride_btb, start + (j + NRAW) * BLOCK_N,
                               raw_codes, raw_norms, raw_rope, tbars, rr, PAGE_SIZE, BLOCK_N, CB, ROPE_DIRECT)

    @gluon.jit
    def _mla_decode_tbq4reg_kernel(
        Q, codes_desc, norms_desc, rope_desc, BT, SEQ, MID_O, MID_LSE, OUT, LSE,
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
        BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, DIRECT: gl.constexpr, ND: gl.constexpr, NRAW: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, Q_SPLIT: gl.constexpr, INV_K: gl.constexpr,
        PROBE: gl.constexpr, CB: gl.constexpr, ROPE_DIRECT: gl.constexpr, REG_A: gl.constexpr,
        SOURCE_KEY: gl.constexpr, num_warps: gl.constexpr,
    ):
        b, g, seq_len, start, end = G._program_keys(SEQ, S, NUM_SPLITS, FOLD, BLOCK_N, CAUSAL)
        n_blocks = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
        Q8L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        QR: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        P8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        q_hi = gl.allocate_shared_memory(gl.float8e4nv, [4, BLOCK_M, 128], Q8L)
        if Q_SPLIT:
            q_lo = gl.allocate_shared_memory(gl.float8e4nv, [4, BLOCK_M, 128], Q8L)
        else:
            q_lo = q_hi  # never written nor read
        q_r = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, 64], QR)
        qs = gl.allocate_shared_memory(gl.float32, [4, BLOCK_M], PLAIN)
        dec_codes = gl.allocate_shared_memory(gl.float8e4nv, [ND * 4, BLOCK_N, 128], Q8L)
        dec_rope = gl.allocate_shared_memory(gl.bfloat16, [ND, BLOCK_N, 64], QR)
        sc = gl.allocate_shared_memory(gl.float32, [ND * 4, BLOCK_N], PLAIN)  # [stage · 4 + chunk, key]
        fs = gl.allocate_shared_memory(gl.float32, [ND * 4, BLOCK_M], PLAIN)  # each chunk's f, per row
        p8 = gl.allocate_shared_memory(gl.float8e4nv, [12, BLOCK_M, BLOCK_N], P8)  # [consumer · 8 + chunk]
        W32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        W16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
        raw_codes = gl.allocate_shared_memory(gl.int32, [NRAW * (64 // CB), BLOCK_N, CB], W32)  # [stage, box][key]
        raw_norms = gl.allocate_shared_memory(gl.float16, [NRAW, BLOCK_N, 8], W16)  # 4 norms, 4 padding
        # (ROPE_DIRECT: the rope goes straight to the decoded stage; a token allocation, never used)
        raw_rope = gl.allocate_shared_memory(gl.bfloat16, [1 if ROPE_DIRECT else NRAW, 8 if ROPE_DIRECT else BLOCK_N, 64],
                                             QR)
        n_bars: gl.constexpr = 3 * ND + 3
        bars = gl.allocate_shared_memory(gl.int64, [n_bars, 1], mbarrier.MBarrierLayout())
        tbars = gl.allocate_shared_memory(gl.int64, [NRAW, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(n_bars):
            # Q_READY: both consumers arrive; with ROPE_DIRECT a stage's KV_READY: the rope's copy and the producer
            mbarrier.init(bars.index(i), count=2 if i == 3 * ND or (ROPE_DIRECT and 2 * ND <= i and i < 3 * ND) else 1)
        for i in gl.static_range(NRAW):
            mbarrier.init(tbars.index(i), count=1)
        fence_async_shared()
        raw = (raw_codes, raw_norms, raw_rope, tbars)
        shared = (codes_desc, norms_desc, rope_desc, BT, stride_btb, b, start, end, n_blocks,
                  q_hi, q_lo, q_r, qs, dec_codes, dec_rope, dec_rope, sc, fs, p8, bars)
        args = (Q, MID_O, MID_LSE, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_mob, stride_mos, stride_moh,
                stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb,
                stride_ls, scale_log2, S, H, g, seq_len)
        gl.warp_specialize([
            (R._consumer, (0, shared, args, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, ND, CAUSAL, DIRECT, 5 if (PROBE & 4) != 0 else 0,
                           False, Q_SPLIT, False, False, REG_A)),
            (R._consumer, (1, shared, args, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, ND, CAUSAL, DIRECT, 5 if (PROBE & 4) != 0 else 0,
                           False, Q_SPLIT, False, False, REG_A)),
            (_producer, (shared, raw, PAGE_SIZE, BLOCK_N, BLOCK_M, ND, NRAW, INV_K, PROBE, CB, ROPE_DIRECT)),
        ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def _descriptors(kv_cache: torch.Tensor) -> tuple:
    """TMA views of the 400-byte rows: codes as int32 words [rows, 100] in [64, CODE_BOX] boxes, norms as
    fp16 [rows, 200] in [64, 8] boxes (4 norms, 4 padding), rope as bf16 [rows, 200] in [64, 64] boxes."""
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    words = kv_cache.view(torch.int32).view(rows, ROW // 4)
    halves = kv_cache.view(torch.float16).view(rows, ROW // 2)
    rope = kv_cache.view(torch.bfloat16).view(rows, ROW // 2)
    w32 = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    w16 = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    qr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    return (TensorDescriptor.from_tensor(words, [BLOCK_N, CODE_BOX], w32),
            TensorDescriptor.from_tensor(halves, [BLOCK_N, 8], w16),
            TensorDescriptor.from_tensor(rope, [BLOCK_N, 64], qr))


def tbq4reg_supported(q: torch.Tensor, kv_cache: torch.Tensor, dc: int, block_m: int) -> bool:
    """Whether this kernel takes a tbq4-cache call: what the unpacking kernel takes (Hopper, bf16 queries,
    Dc = 512, Dr = 64, contiguous 392-byte rows), 16 query rows and pages of a multiple of 64 keys."""
    return (dc == QC.DC and QC.hopper_rows_supported(q, kv_cache, ROW) and kv_cache.shape[1] % BLOCK_N == 0
            and max(16, block_m) == BLOCK_M)


def launch_tbq4reg_split(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2, cfg, *,
                         causal: bool, direct: bool, num_splits: int):
    """Stage 1 of `mla_decode_triton` for a tbq4 cache, q already rotated (grid, split rule and outputs as the
    other kernels)."""
    grid, args, consts = QC.tma_launch_args(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2,
                                           cfg, causal=causal, direct=direct, num_splits=num_splits, block_m=BLOCK_M,
                                           views=_descriptors(kv_cache))
    _mla_decode_tbq4reg_kernel[grid](*args, **consts, ND=NUM_DECODED, NRAW=NUM_RAW, CONSUMER_REGS=REGS[0],
                                     PRODUCER_REGS=REGS[1], Q_SPLIT=Q_SPLIT, INV_K=_INV_K, PROBE=PROBE, CB=CODE_BOX,
                                     ROPE_DIRECT=ROPE_DIRECT, REG_A=REG_A,
                                     SOURCE_KEY=_SOURCE_KEY,
                                     num_warps=4)
