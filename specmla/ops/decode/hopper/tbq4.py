"""Hopper MLA decode over a tbq4 cache (400-byte rows, attention in the FWHT-rotated domain), 16 query rows per
program: the producer turns each block's 4-bit codes into e4m3 centroids, and the e4m3 consumers
(`quant_common.e4m3_consumer`, as in `fp8`) run on them.

- TMA copies each 64-key block into a ring of raw stages: the codes as [64 keys, CODE_BOX words] boxes and the norms
  as [64, 8] fp16 (`tbq4.cache_row_bytes` keeps every field of a row 16-byte aligned for that). The rope part goes by
  TMA straight into its decoded stage, whose ready barrier counts two arrivals: that copy and the producer's.
- The producer warpgroup loads a block's words, decodes each word of 8 codes into 8 e4m3 bytes (`tbq4.e4m3_lookup_ptx`:
  codes are sign·8 + magnitude rank, so one byte permute on an 8-entry table gives four magnitudes and a second one
  the four signs; the centroids times k are e4m3 values within 2 %) and writes the per-key scales norm/k, normalised
  by one factor per block. That is the fp8 kernel's stage, so the consumers are the same.
- Two rings: raw stages (codes and norms, refilled once the producer has decoded them) and decoded stages (freed by
  the consumers).
- q is one e4m3 term and so is Pᵀ: their rounding is small beside the 4-bit codes' own error.
- The caller rotates q's latent part and the output (`mla_decode`).

Dc = 512, Dr = 64, bf16 queries, pages of a multiple of 64 keys. Same contract, grid, split rule and partials as
`mla_decode`. Gluon does not run in the Triton interpreter: GPU tests check it against the fp64 reference,
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
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _cta_barrier = G._cta_barrier

BLOCK_N = QC.BLOCK_N
BLOCK_M = QC.E4M3_ROWS
ROW = QC.ROW_BYTES["tbq4"]  # 400 bytes: 256 of codes, 4 fp16 norms, 8 of padding, 64 bf16 rope values


@dataclasses.dataclass(frozen=True)
class Options:
    """The tbq4 kernel's tuning knobs; the defaults are the measured best."""

    num_decoded: int = 3  # decoded stages (40 KB): each consumer holds one, the producer writes the third
    num_raw: int = 3  # raw stages (17 KB): two in flight while the producer decodes one
    regs: tuple[int, int] = (216, 72)  # (consumer, producer) registers per thread
    code_box: int = 64  # 32-bit words per row of a code TMA box: 64 (all four chunks), 32 or 16 (one chunk)


_SOURCE_KEY = G.source_key(__file__) ^ QC._SOURCE_KEY
_c = getattr(gl, "constexpr", int) if G.HAVE_GLUON else int
_DECODE = _c(tbq4.e4m3_lookup_ptx())
_INV_K = 1.0 / tbq4.e4m3_centroids()[0]
NORMS_AT = _c(tbq4.norms_offset(512) // 2)  # in fp16 units

if G.HAVE_GLUON:

    @gluon.jit
    def _issue_raw(codes_desc, norms_desc, BT, b, stride_btb, n0, raw_codes, raw_norms, tbars, rr,
                   PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, CB: gl.constexpr):
        """TMA the key block starting at key n0 (whole 400-byte rows of its page) into raw stage rr: each chunk's
        codes in [64 keys, CB words] boxes and the norms (and their padding) as [64, 8] fp16; the stage's barrier
        completes when all 272 bytes per key have landed."""
        row = QC._block_row(BT, b, stride_btb, n0, PAGE_SIZE)
        bar = tbars.index(rr)
        mbarrier.expect(bar, BLOCK_N * 272)
        for c in gl.static_range(64 // CB):
            QC._tma_load(codes_desc, [row, CB * c], bar, raw_codes.index(rr * (64 // CB) + c))
        QC._tma_load(norms_desc, [row, NORMS_AT], bar, raw_norms.index(rr))

    @gluon.jit
    def _issue_rope(rope_desc, BT, b, stride_btb, n0, dst, bar, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr):
        """TMA the block's rope [64, 64] bf16 straight into its decoded stage, on the stage's ready barrier (its
        expect is one of the barrier's two arrivals, the producer's arrive the other)."""
        row = QC._block_row(BT, b, stride_btb, n0, PAGE_SIZE)
        mbarrier.expect(bar, BLOCK_N * 128)
        QC._tma_load(rope_desc, [row, QC.TBQ4_ROPE_AT], bar, dst)

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
        one factor per block: a block's four chunks of a token have norms of one size, and one maximum is a warp's
        reduction, where one per chunk would be a warpgroup's (barriers)."""
        s4 = gl.where(gl.expand_dims(valid, 1), n4.to(gl.float32), 0.0)
        m = gl.maximum(gl.max(gl.max(s4, axis=1), axis=0), 1e-30)
        s4 = s4 * (448.0 / m)
        f = m * (INV_K / 448.0)
        chunks = gl.arange(0, 4, layout=gl.SliceLayout(0, NL))
        for c in gl.static_range(4):
            sc.index(ds * 4 + c).store(gl.sum(gl.where(gl.expand_dims(chunks, 0) == c, s4, 0.0), axis=1))
            fs.index(ds * 4 + c).store(gl.full([BLOCK_M], 0.0, gl.float32, layout=FL) + f)

    @gluon.jit
    def _producer(loads, raw, ring, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                  ND: gl.constexpr, NRAW: gl.constexpr, INV_K: gl.constexpr, CB: gl.constexpr):
        """Keep NRAW raw blocks in flight; per block wait for its bytes and for a free decoded stage, start the rope's
        copy into that stage, write the per-key scales (norm / k, normalised once per block), load the block's
        codes, decode them into e4m3, hand the stage over and refill the raw stage (after the decode: the words are
        read from it)."""
        codes_desc, norms_desc, rope_desc, BT, stride_btb = loads
        raw_codes, raw_norms, tbars = raw
        b, start, end, n_blocks, q8, q_r, qs, dec_codes, dec_rope, sc, fs, p8, bars = ring
        KV_READY: gl.constexpr = 2 * ND
        FL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[4], order=[0])
        # a chunk's codes [64 keys, 16 words] (64-byte rows), 8-byte loads: 4 keys per warp, conflict-free
        DL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                            order=[1, 0])
        for i in gl.static_range(NRAW):
            if i < n_blocks:
                _issue_raw(codes_desc, norms_desc, BT, b, stride_btb, start + i * BLOCK_N, raw_codes, raw_norms,
                           tbars, i, PAGE_SIZE, BLOCK_N, CB)
        # the norms [64 keys, 4] in each warp whole (the other warps hold copies): reductions within a warp
        NL: gl.constexpr = gl.BlockedLayout(size_per_thread=[2, 4], threads_per_warp=[32, 1], warps_per_cta=[1, 4],
                                            order=[1, 0])
        keys_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, NL))
        for j in range(n_blocks):
            rr = j % NRAW
            ds = j % ND
            mbarrier.wait(tbars.index(rr), (j // NRAW) & 1)
            if j >= ND:  # the consumer of block j - ND has read its stage
                mbarrier.wait(bars.index(ND + ds), ((j - ND) // ND) & 1)
            # the rope lands in the stage while the codes are decoded
            _issue_rope(rope_desc, BT, b, stride_btb, start + j * BLOCK_N, dec_rope.index(ds),
                        bars.index(KV_READY + ds), PAGE_SIZE, BLOCK_N)
            _store_block_scales(raw_norms.index(rr).slice(0, 4, dim=1).load(NL), start + j * BLOCK_N + keys_n < end,
                                sc, fs, ds, INV_K, BLOCK_M, NL, FL)
            # all four chunks' words loaded before any is decoded
            w0 = _chunk_words(raw_codes, rr, 0, CB).load(DL)
            w1 = _chunk_words(raw_codes, rr, 1, CB).load(DL)
            w2 = _chunk_words(raw_codes, rr, 2, CB).load(DL)
            w3 = _chunk_words(raw_codes, rr, 3, CB).load(DL)
            _decode_chunk(w0, dec_codes.index(ds * 4 + 0), BLOCK_N)
            _decode_chunk(w1, dec_codes.index(ds * 4 + 1), BLOCK_N)
            _decode_chunk(w2, dec_codes.index(ds * 4 + 2), BLOCK_N)
            _decode_chunk(w3, dec_codes.index(ds * 4 + 3), BLOCK_N)
            fence_async_shared()
            _cta_barrier()  # every warp has written the stage and read the raw one
            mbarrier.arrive(bars.index(KV_READY + ds))
            if j + NRAW < n_blocks:
                _issue_raw(codes_desc, norms_desc, BT, b, stride_btb, start + (j + NRAW) * BLOCK_N, raw_codes,
                           raw_norms, tbars, rr, PAGE_SIZE, BLOCK_N, CB)

    @gluon.jit
    def _mla_decode_tbq4_kernel(
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
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, INV_K: gl.constexpr, CB: gl.constexpr,
        SOURCE_KEY: gl.constexpr, num_warps: gl.constexpr,
    ):
        b, g, seq_len, start, end = G._program_keys(SEQ, S, NUM_SPLITS, FOLD, BLOCK_N, CAUSAL)
        n_blocks = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
        Q8L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        QR: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        P8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        q8 = gl.allocate_shared_memory(gl.float8e4nv, [4, BLOCK_M, 128], Q8L)
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
        n_bars: gl.constexpr = 3 * ND + 3
        bars = gl.allocate_shared_memory(gl.int64, [n_bars, 1], mbarrier.MBarrierLayout())
        tbars = gl.allocate_shared_memory(gl.int64, [NRAW, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(n_bars):
            # two arrivals: Q_READY (both consumers), a stage's KV_READY (the rope's copy and the producer)
            mbarrier.init(bars.index(i), count=2 if i == 3 * ND or (2 * ND <= i and i < 3 * ND) else 1)
        for i in gl.static_range(NRAW):
            mbarrier.init(tbars.index(i), count=1)
        fence_async_shared()
        loads = (codes_desc, norms_desc, rope_desc, BT, stride_btb)
        raw = (raw_codes, raw_norms, tbars)
        ring = (b, start, end, n_blocks, q8, q_r, qs, dec_codes, dec_rope, sc, fs, p8, bars)
        args = (Q, MID_O, MID_LSE, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_mob, stride_mos, stride_moh,
                stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb,
                stride_ls, scale_log2, S, H, g, seq_len)
        gl.warp_specialize([
            (QC.e4m3_consumer, (0, ring, args, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, ND, CAUSAL, DIRECT, False, False)),
            (QC.e4m3_consumer, (1, ring, args, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, ND, CAUSAL, DIRECT, False, False)),
            (_producer, (loads, raw, ring, PAGE_SIZE, BLOCK_N, BLOCK_M, ND, NRAW, INV_K, CB)),
        ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def supported(q: torch.Tensor, kv_cache: torch.Tensor, kv_format: str, block_m: int, opts: Options = Options(), *,
              head_dim_v: int | None = None) -> bool:
    """Whether this kernel can take the call: Hopper, bf16 queries with Dc = 512 and Dr = 64, contiguous 16-byte
    aligned tbq4 rows (400 bytes) in pages of a multiple of 64 keys, and 16 query rows."""
    return (kv_format == "tbq4" and max(16, block_m) == BLOCK_M
            and QC.hopper_rows_supported(q, kv_cache, ROW, head_dim_v) and kv_cache.shape[1] % BLOCK_N == 0)


def _descriptors(kv_cache: torch.Tensor, code_box: int) -> tuple:
    """TMA views of the 400-byte rows: codes as int32 words [rows, 100] in [64, code_box] boxes, norms as
    fp16 [rows, 200] in [64, 8] boxes (4 norms, 4 padding), rope as bf16 [rows, 200] in [64, 64] boxes."""
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    words = kv_cache.view(torch.int32).view(rows, ROW // 4)
    halves = kv_cache.view(torch.float16).view(rows, ROW // 2)
    rope = kv_cache.view(torch.bfloat16).view(rows, ROW // 2)
    w32 = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    w16 = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    qr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    return (TensorDescriptor.from_tensor(words, [BLOCK_N, code_box], w32),
            TensorDescriptor.from_tensor(halves, [BLOCK_N, 8], w16),
            TensorDescriptor.from_tensor(rope, [BLOCK_N, 64], qr))


def launch(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2: float, plan: dict, *,
           causal: bool, num_splits: int, kv_format: str, opts: Options = Options()) -> None:
    """Stage 1 of the split-KV decode over a tbq4 cache, q already rotated; writes out/lse itself when
    num_splits == 1, else mid_o/mid_lse."""
    grid, args, consts = QC.tma_launch_args(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2,
                                            plan, causal=causal, direct=num_splits == 1, num_splits=num_splits,
                                            block_m=BLOCK_M, views=_descriptors(kv_cache, opts.code_box))
    _mla_decode_tbq4_kernel[grid](*args, **consts, ND=opts.num_decoded, NRAW=opts.num_raw, CONSUMER_REGS=opts.regs[0],
                                  PRODUCER_REGS=opts.regs[1], INV_K=_INV_K, CB=opts.code_box, SOURCE_KEY=_SOURCE_KEY,
                                  num_warps=4)
