"""Hopper MLA decode over an fp8 cache (608-byte `fp8` rows or 656-byte `fp8_ds_mla` rows) with e4m3 matmuls on the
codes themselves, 16 query rows per program. Warp-specialised: a producer warpgroup and two consumer warpgroups
(`quant_common.e4m3_consumer`).

- TMA copies whole rows of each 64-key block into a ring of raw stages: the codes as four [64, 128] e4m3 tiles (in
  the layout wgmma reads), the rope part as a [64, 64] bf16 tile, the per-chunk scales. Boxes are 128 to 512 bytes
  wide, so the copies run near the copy bandwidth.
- The producer normalises each block's scales per chunk (P·scale/f within e4m3's range), zeroes the codes of rows
  past the end (NaN codes would reach P·V) and hands the stage over. On 656-byte rows it also refills the stage of
  the block `Options.refill_lag` behind the one it hands over (refilling the previous block's stage would wait on
  the other consumer every block). On 608-byte rows the rope arrives in int8 with fp16 scales: the producer
  converts it into the stage's bf16 rope tile (`_convert_rope`), so the consumers are the same, and a one-warp
  loader issues the copies, because the conversion would delay the producer's refills.
- The consumers take alternate key blocks whole: Q·Kᵀ as e4m3 wgmmas on the raw codes with q in two e4m3 terms
  (hi + lo, one 32-row operand), P·V with Vᵀ as the wgmma's register operand (a byte transpose of the raw codes,
  converted to fp16, exact) and Pᵀ·scale/f in fp16: the exact path's quality at the matmul count of one e4m3 term.

Dc = 512, Dr = 64, bf16 queries, pages of a multiple of 64 keys. Same contract, grid, split rule and partials as
`mla_decode`. Gluon does not run in the Triton interpreter: GPU tests check it against the fp64 reference,
a CPU test compiles it for sm_90.
"""

from __future__ import annotations

import dataclasses

import torch

from specmla.ops.decode.hopper import common as G
from specmla.ops.decode.hopper import quant_common as QC

if G.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _cta_barrier = G._cta_barrier

BLOCK_N = QC.BLOCK_N
BLOCK_M = QC.E4M3_ROWS
FORMATS = ("fp8", "fp8_ds_mla")


@dataclasses.dataclass(frozen=True)
class Options:
    """The fp8 kernel's tuning knobs; the defaults are the measured best."""

    num_raw: int = 4  # raw stages (41 KB each): the two consumers hold one each, two stay in flight
    regs: tuple[int, int] = (224, 56)  # (consumer, producer) registers per thread on 656-byte rows
    loader_regs: tuple[int, int, int] = (224, 40, 24)  # (consumer, producer, loader) on 608-byte rows: 64K in all
    refill_lag: int = 2  # (656-byte rows) the producer refills the stage of block j - refill_lag after handing over j
    scale_words: int = 4  # (656-byte rows) the scales' TMA box width in 32-bit words; wider boxes read into the rope


_SOURCE_KEY = G.source_key(__file__) ^ QC._SOURCE_KEY

if G.HAVE_GLUON:

    @gluon.jit
    def _issue_block(codes_desc, rope_desc, scale_desc, BT, b, stride_btb, n0, raw_codes, raw_rope, raw_scales,
                     bars, rs, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, SW: gl.constexpr,
                     ROPE_I8: gl.constexpr):
        """TMA the key block starting at key n0 (whole rows of its page) into raw stage rs: four [64, 128] code
        boxes, the rope's [64, 64] bf16 box and a [64, SW] fp32 box from the scales on (SW > 4 reads into the rope).
        ROPE_I8 (608-byte rows, SW = 8: the codes' and the rope's scales): the rope's [64, 64] int8 box lands in
        the second half of the stage's bf16 rope tile (`rope_landing`), where the producer converts it."""
        row = QC._block_row(BT, b, stride_btb, n0, PAGE_SIZE)
        bar = bars.index(rs)
        if ROPE_I8:
            mbarrier.expect(bar, BLOCK_N * (576 + 4 * SW))
        else:
            mbarrier.expect(bar, BLOCK_N * (640 + 4 * SW))
        for c in gl.static_range(4):
            QC._tma_load(codes_desc, [row, c * 128], bar, raw_codes.index(rs * 4 + c))
        if ROPE_I8:
            QC._tma_load(rope_desc, [row, 544], bar, rope_landing(raw_rope, rs))
        else:
            QC._tma_load(rope_desc, [row, 264], bar, raw_rope.index(rs))
        QC._tma_load(scale_desc, [row, 128], bar, raw_scales.index(rs))

    @gluon.jit
    def rope_landing(raw_rope, rs):
        """(608-byte rows) Where stage rs's int8 rope values land: [64 keys, 64] bytes, unswizzled, in the second
        half of its bf16 rope tile."""
        BLOCK_N: gl.constexpr = raw_rope.shape[1]
        R8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
        return G._reinterpret(raw_rope.index(rs), gl.int8, [2 * BLOCK_N, 64], R8).slice(BLOCK_N, BLOCK_N, dim=0)

    @gluon.jit
    def _producer(loads, ring, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                  NR: gl.constexpr, LAG: gl.constexpr, SW: gl.constexpr, ROPE_I8: gl.constexpr):
        """Per block: wait for its bytes, prepare its raw stage (`_prepare_block`) and hand it over. On 656-byte rows
        the producer also issues the copies: NR blocks at the start, then the stage of the block LAG behind once its
        consumer has read it; on 608-byte rows (ROPE_I8) `_loader` issues them."""
        codes_desc, rope_desc, scale_desc, BT, stride_btb, raw_scales = loads
        b, start, end, n_blocks, q8, q_r, qs, raw_codes, raw_rope, sc, fs, p8, bars = ring
        KV_READY: gl.constexpr = 2 * NR
        if not ROPE_I8:
            for i in gl.static_range(NR):
                if i < n_blocks:
                    _issue_block(codes_desc, rope_desc, scale_desc, BT, b, stride_btb, start + i * BLOCK_N, raw_codes,
                                 raw_rope, raw_scales, bars, i, PAGE_SIZE, BLOCK_N, SW, ROPE_I8)
        for j in range(n_blocks):
            rs = j % NR
            mbarrier.wait(bars.index(rs), (j // NR) & 1)
            _prepare_block(raw_codes, raw_rope, raw_scales, sc, fs, rs, start + j * BLOCK_N, end, BLOCK_M, ROPE_I8)
            _cta_barrier()
            mbarrier.arrive(bars.index(KV_READY + rs))
            if not ROPE_I8:
                _refill(loads, ring, j, PAGE_SIZE, BLOCK_N, NR, LAG, SW)

    @gluon.jit
    def _refill(loads, ring, j, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, NR: gl.constexpr, LAG: gl.constexpr,
                SW: gl.constexpr):
        """(Producer, at block j) refill the stage block j - LAG used with block j - LAG + NR, once its consumer has
        read it."""
        codes_desc, rope_desc, scale_desc, BT, stride_btb, raw_scales = loads
        b, start, end, n_blocks, q8, q_r, qs, raw_codes, raw_rope, sc, fs, p8, bars = ring
        RAW_FREE: gl.constexpr = NR
        if j >= LAG:
            nxt = j - LAG + NR
            if nxt < n_blocks:
                prev = (j - LAG) % NR
                mbarrier.wait(bars.index(RAW_FREE + prev), ((j - LAG) // NR) & 1)
                _issue_block(codes_desc, rope_desc, scale_desc, BT, b, stride_btb, start + nxt * BLOCK_N, raw_codes,
                             raw_rope, raw_scales, bars, prev, PAGE_SIZE, BLOCK_N, SW, False)

    @gluon.jit
    def _loader(loads, ring, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, NR: gl.constexpr, SW: gl.constexpr):
        """(608-byte rows) One warp that only issues the copies: block j into stage j % NR as soon as the consumer of
        block j - NR has handed that stage back."""
        codes_desc, rope_desc, scale_desc, BT, stride_btb, raw_scales = loads
        b, start, end, n_blocks, q8, q_r, qs, raw_codes, raw_rope, sc, fs, p8, bars = ring
        RAW_FREE: gl.constexpr = NR
        for j in range(n_blocks):
            rs = j % NR
            if j >= NR:
                mbarrier.wait(bars.index(RAW_FREE + rs), ((j - NR) // NR) & 1)
            _issue_block(codes_desc, rope_desc, scale_desc, BT, b, stride_btb, start + j * BLOCK_N, raw_codes,
                         raw_rope, raw_scales, bars, rs, PAGE_SIZE, BLOCK_N, SW, True)

    @gluon.jit
    def _prepare_block(raw_codes, raw_rope, raw_scales, sc, fs, rs, n0, end, BLOCK_M: gl.constexpr,
                       ROPE_I8: gl.constexpr):
        """(Producer) raw stage rs holds the keys n0 …: its per-key scales normalised per chunk into sc / fs
        (`_store_scales`), (ROPE_I8) its int8 rope converted to bf16 (`_convert_rope`), and the codes of rows at or
        past `end` zeroed (they may hold NaN codes, and 0 · NaN = NaN in P·V; NaN scores are masked)."""
        if ROPE_I8:
            _convert_rope(raw_rope, raw_scales, rs)
        BLOCK_N: gl.constexpr = raw_scales.shape[1]
        SCL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32, 1], warps_per_cta=[4, 1],
                                             order=[1, 0])
        FL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[4], order=[0])
        ZL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                            order=[1, 0])
        keys_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SCL))
        _store_scales(raw_scales.index(rs).slice(0, 4, dim=1).load(SCL), n0 + keys_s < end, sc, fs, rs, BLOCK_M, SCL,
                      FL)
        n_valid = end - n0
        if n_valid < BLOCK_N:
            keys_z = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ZL))
            for c in gl.static_range(4):
                t = raw_codes.index(rs * 4 + c).load(ZL)
                raw_codes.index(rs * 4 + c).store(gl.where(gl.expand_dims(keys_z < n_valid, 1), t, gl.zeros_like(t)))
            fence_async_shared()

    @gluon.jit
    def _convert_rope(raw_rope, raw_scales, rs):
        """(Producer, 608-byte rows) Stage rs's int8 rope values (`rope_landing`: the second half of its bf16 tile)
        × their fp16 scales (scale words 4-7, two per word) → the tile's bf16 values, 32 keys at a time: the first
        32 keys' bf16 rows lie before the landing area, the last 32 keys' overwrite it, so they are all read first.
        Each thread converts 8 values (one scale) per pass and stores them as one 16-byte vector."""
        BLOCK_N: gl.constexpr = raw_rope.shape[1]
        HALF: gl.constexpr = BLOCK_N // 2
        L3: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 8], threads_per_warp=[4, 8, 1],
                                            warps_per_cta=[4, 1, 1], order=[2, 1, 0])
        V3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3)
        S16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
        land = G._reinterpret(rope_landing(raw_rope, rs), gl.int8, [BLOCK_N, 8, 8], V3)
        scales = G._reinterpret(raw_scales.index(rs), gl.float16, [BLOCK_N, 16], S16).slice(8, 8, dim=1)
        tile = raw_rope.index(rs)
        for h in gl.static_range(2):
            v = land.slice(h * HALF, HALF, dim=0).load(L3).to(gl.float32)
            s = scales.slice(h * HALF, HALF, dim=0).load(gl.SliceLayout(2, L3)).to(gl.float32)
            y = gl.reshape((v * gl.expand_dims(s, 2)).to(gl.bfloat16), [HALF, 64])
            if h == 1:
                _cta_barrier()  # every thread has read the landing area
            tile.slice(h * HALF, HALF, dim=0).store(y)
        fence_async_shared()  # the consumers' wgmma reads the tile

    @gluon.jit
    def _store_scales(s4, valid, sc, fs, rs, BLOCK_M: gl.constexpr, SCL: gl.constexpr, FL: gl.constexpr):
        """A block's per-key chunk scales s4 [keys, 4] (zeroed where not valid) normalised per chunk, so that
        P·scale / f stays within e4m3's 448: the scales into sc[rs·4 + chunk], each chunk's factor f into
        fs[rs·4 + chunk] (one per query row)."""
        s4 = gl.where(gl.expand_dims(valid, 1), s4, 0.0)
        f4 = gl.maximum(gl.max(s4, axis=0), 1e-30) / 448.0
        s4 = s4 / gl.expand_dims(f4, 0)
        chunks = gl.arange(0, 4, layout=gl.SliceLayout(0, SCL))
        for c in gl.static_range(4):
            sc.index(rs * 4 + c).store(gl.sum(gl.where(gl.expand_dims(chunks, 0) == c, s4, 0.0), axis=1))
            f_c = gl.sum(gl.where(chunks == c, f4, 0.0), axis=0)
            fs.index(rs * 4 + c).store(gl.full([BLOCK_M], 0.0, gl.float32, layout=FL) + f_c)

    @gluon.jit
    def _mla_decode_fp8_kernel(
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
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, LAG: gl.constexpr,
        SW: gl.constexpr, ROPE_I8: gl.constexpr, SOURCE_KEY: gl.constexpr, num_warps: gl.constexpr,
    ):
        b, g, seq_len, start, end = G._program_keys(SEQ, S, NUM_SPLITS, FOLD, BLOCK_N, CAUSAL)
        n_blocks = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
        Q8L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        QR: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        SC: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        q8 = gl.allocate_shared_memory(gl.float8e4nv, [8, BLOCK_M, 128], Q8L)  # chunk c's hi and lo: tiles 2c, 2c + 1
        q_r = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, 64], QR)
        qs = gl.allocate_shared_memory(gl.float32, [4, BLOCK_M], PLAIN)
        raw_codes = gl.allocate_shared_memory(gl.float8e4nv, [NR * 4, BLOCK_N, 128], Q8L)
        raw_rope = gl.allocate_shared_memory(gl.bfloat16, [NR, BLOCK_N, 64], QR)
        raw_scales = gl.allocate_shared_memory(gl.float32, [NR, BLOCK_N, SW], SC)
        sc = gl.allocate_shared_memory(gl.float32, [NR * 4, BLOCK_N], PLAIN)  # [stage · 4 + chunk, key]
        fs = gl.allocate_shared_memory(gl.float32, [NR * 4, BLOCK_M], PLAIN)  # each chunk's f, per row
        P16L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        p16 = gl.allocate_shared_memory(gl.float16, [8, BLOCK_M, BLOCK_N], P16L)  # Pᵀ: [consumer · 4 + chunk]
        n_bars: gl.constexpr = 3 * NR + 3
        bars = gl.allocate_shared_memory(gl.int64, [n_bars, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(n_bars):
            mbarrier.init(bars.index(i), count=2 if i == 3 * NR else 1)  # Q_READY: both consumers arrive
        fence_async_shared()
        loads = (codes_desc, rope_desc, scale_desc, BT, stride_btb, raw_scales)
        ring = (b, start, end, n_blocks, q8, q_r, qs, raw_codes, raw_rope, sc, fs, p16, bars)
        args = (Q, MID_O, MID_LSE, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_mob, stride_mos, stride_moh,
                stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb,
                stride_ls, scale_log2, S, H, g, seq_len)
        # (tuples of constexprs stay constexprs only when written in the call)
        if ROPE_I8:
            gl.warp_specialize([
                (QC.e4m3_consumer, (0, ring, args, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, NR, CAUSAL, DIRECT, True, True)),
                (QC.e4m3_consumer, (1, ring, args, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, NR, CAUSAL, DIRECT, True, True)),
                (_producer, (loads, ring, PAGE_SIZE, BLOCK_N, BLOCK_M, NR, LAG, SW, ROPE_I8)),
                (_loader, (loads, ring, PAGE_SIZE, BLOCK_N, NR, SW)),
            ], [4, 4, 1], [CONSUMER_REGS, PRODUCER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize([
                (QC.e4m3_consumer, (0, ring, args, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, NR, CAUSAL, DIRECT, True, True)),
                (QC.e4m3_consumer, (1, ring, args, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, NR, CAUSAL, DIRECT, True, True)),
                (_producer, (loads, ring, PAGE_SIZE, BLOCK_N, BLOCK_M, NR, LAG, SW, ROPE_I8)),
            ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def supported(q: torch.Tensor, kv_cache: torch.Tensor, kv_format: str, block_m: int, opts: Options = Options(), *,
              head_dim_v: int | None = None) -> bool:
    """Whether this kernel can take the call: Hopper, bf16 queries with Dc = 512 and Dr = 64, contiguous 16-byte
    aligned fp8 (608-byte) or fp8_ds_mla (656-byte) rows in pages of a multiple of 64 keys (one TMA box per block),
    and 16 query rows."""
    return (kv_format in FORMATS and max(16, block_m) == BLOCK_M
            and QC.hopper_rows_supported(q, kv_cache, QC.ROW_BYTES[kv_format], head_dim_v)
            and kv_cache.shape[1] % BLOCK_N == 0)


def _descriptors(kv_cache: torch.Tensor, scale_words: int) -> tuple:
    """TMA views of fp8_ds_mla rows (656 bytes): codes [rows, 656] e4m3 in [64, 128] boxes, rope [rows, 328] bf16 in
    [64, 64] boxes, scales [rows, 164] fp32 in [64, scale_words] boxes."""
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    width = QC.ROW_BYTES["fp8_ds_mla"]
    codes = kv_cache.view(torch.float8_e4m3fn).view(rows, width)
    rope = kv_cache.view(torch.bfloat16).view(rows, width // 2)
    scales = kv_cache.view(torch.float32).view(rows, width // 4)
    q8 = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    qr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    sc = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return (TensorDescriptor.from_tensor(codes, [BLOCK_N, 128], q8),
            TensorDescriptor.from_tensor(rope, [BLOCK_N, 64], qr),
            TensorDescriptor.from_tensor(scales, [BLOCK_N, scale_words], sc))


def _rope_int8_descriptors(kv_cache: torch.Tensor) -> tuple:
    """TMA views of fp8 rows (608 bytes): codes [rows, 608] e4m3 in [64, 128] boxes, the rope's int8 values [rows, 608]
    in unswizzled [64, 64] boxes, the scales [rows, 152] fp32 in [64, 8] boxes (4 codes' + 8 fp16 rope scales)."""
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    flat = kv_cache.view(rows, QC.ROW_BYTES["fp8"])
    return (TensorDescriptor.from_tensor(flat.view(torch.float8_e4m3fn), [BLOCK_N, 128],
                                         gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)),
            TensorDescriptor.from_tensor(flat.view(torch.int8), [BLOCK_N, 64],
                                         gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)),
            TensorDescriptor.from_tensor(flat.view(torch.float32), [BLOCK_N, 8],
                                         gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)))


def launch(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2: float, plan: dict, *,
           causal: bool, num_splits: int, kv_format: str, opts: Options = Options()) -> None:
    """Stage 1 of the split-KV decode over an fp8 or fp8_ds_mla cache; writes out/lse itself when num_splits == 1,
    else mid_o/mid_lse."""
    rope_i8 = kv_format == "fp8"
    scale_words = 8 if rope_i8 else opts.scale_words
    views = _rope_int8_descriptors(kv_cache) if rope_i8 else _descriptors(kv_cache, scale_words)
    grid, args, consts = QC.tma_launch_args(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2,
                                            plan, causal=causal, direct=num_splits == 1, num_splits=num_splits,
                                            block_m=BLOCK_M, views=views)
    consumer_regs, producer_regs, loader_regs = opts.loader_regs if rope_i8 else (*opts.regs, opts.loader_regs[2])
    _mla_decode_fp8_kernel[grid](*args, **consts, NR=opts.num_raw, CONSUMER_REGS=consumer_regs,
                                 PRODUCER_REGS=producer_regs, LOADER_REGS=loader_regs, LAG=opts.refill_lag,
                                 SW=scale_words, ROPE_I8=rope_i8, SOURCE_KEY=_SOURCE_KEY, num_warps=4)
