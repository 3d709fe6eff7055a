"""Hopper MLA decode over an fp8 cache with e4m3 matmuls, Vᵀ transposed in registers, one key block per consumer.

Why: `mla_decode_gluon_fp8mma` runs both matmuls in e4m3 on the raw codes but pays twice for it: its producer
writes a Vᵀ copy of every block through shared memory (the transpose's loads and stores conflict), and its two
consumers split each block's columns, so they swap partial scores and wait on each other every block (alone they
take 268 µs at B=32 T=32k, 1.54× bf16). Here:
- P·V takes Vᵀ as the wgmma's register operand (A). Each thread loads 32-bit words of the raw codes (4 columns of
  one key, conflict-free: lanes cover 8 swizzle units × 4 keys of distinct phases) and a 4 × 4 byte transpose (8
  byte permutes per 4 words) gives the wgmma's fragment (4 keys of one column per register): no Vᵀ copy, no
  shared-memory stores. That works because the fragment's row and key orders are ours to choose: the load
  layout `V_LOAD` and the index permutation in `_vt_fragment` match the fragment; Pᵀ is stored in the same key
  order (`_store_pt`) and the output's rows are put back when stored (`_latent_column`'s FMT 3).
- The two consumer warpgroups take alternate key blocks whole (all 512 columns), each with its own online softmax
  and accumulator; they merge once at the end through shared memory. No exchange per block: one consumer's
  softmax overlaps the other's matmuls.
- The producer warpgroup issues the TMA copies (whole 656-byte rows, boxes 128 to 512 bytes wide), normalises
  each block's scales per chunk (P·scale/f in e4m3's range, as in `mla_decode_gluon_fp8mma`) and zeroes the codes
  of rows past the end. It refills the stage of the block two behind the one it hands over: refilling the
  previous block's stage waited on the other consumer every block (375 against 255 µs).
- Q·Kᵀ: e4m3 wgmmas on the raw codes with q split in hi + lo (one scale per row, which saves the consumers 12
  registers). The two terms are one 32-row operand (`Q_CAT`: chunk c's hi and lo tiles side by side), so each
  chunk's codes feed one m64n32k32 wgmma instead of two m64n16k32 ones (the shared-memory A operand was their cost);
  each thread holds both halves of the accumulator and adds them (`_fold_terms`).
- P·V in fp16 (`P16`): each Vᵀ fragment is converted from e4m3 to fp16 in registers (exact; `_f16_fragment` only
  relabels keys, so the conversion is one cvt per pair and no data moves between threads) and Pᵀ·scale/f is stored
  in fp16 (11 bits). That is the exact path's quality at the cost of P in one e4m3 term: the same number of wgmmas as
  two e4m3 terms, without splitting P. Measured together with `Q_CAT` (H100, B=32 T=32k, H=16): 254.8 µs, 1.62×
  bf16 (P in two e4m3 terms and q in two matmuls: 341.7 µs, 1.24×); the embedded model's attention cosine through
  its arithmetic (`mla_decode_e4m3`) 0.99954, as the exact fp8 path. docs/benchmarks.md, issue 7, sixteenth session.
- The older P formats stay as options: P in two e4m3 terms (`P16 = False`, `P_SPLIT`), or one (cosine 0.99898, under
  issue 7's 0.999 bar).
- `LOADER` (off): a one-warp partition issues the copies as soon as a stage is handed back, instead of the producer
  refilling after it hands over the next block. Measured: no gain (258.9 µs; its producer alone 248.4).
- Where the time goes (seventeenth session): the steady state runs at the copy rate; the rest is fixed cost (q, the
  first block, the drain, the stores: about 17 µs) and the programs' uneven ends, because some SMs read HBM up to
  20 % more slowly than others, the same ones in every run (`PROBE 7` and `benchmarks/fp8reg_timeline.py`).
- `STEAL` (off): split calls even the ends out. A one-warp loader takes each block from its share's counter
  (atomics, two blocks at a time, the next claim in flight); a program whose share is done helps the share with the
  most blocks left (one helper per share) and stores into that share's helper slot, which the combine adds
  (`combine_splits`). Correct (GPU tests against the reference, in CUDA graphs), but slower: 280.4 against 255.3 µs
  at B=32 T=32k on an H100, and its producer alone (255.9) is no faster than the static kernel whole. Its producer
  is the warp-specialised default partition: with consumer 0 there (as in the static kernel), ptxas built that
  consumer's wgmma descriptors in regular registers and spilled them (144 R2UR per block against 60; 298.6 µs on
  an H200). docs/benchmarks.md, eighteenth and nineteenth sessions.
- fp8 rows (608 bytes, called fp8_rope_int8 in the nineteenth session: the rope in int8 with one fp16 scale per 8
  values, `ops.kv_cache`; the 656-byte rows are fp8_ds_mla): the rope's int8 box lands in the second half of the
  stage's bf16 rope tile and the producer converts it in place (`_convert_rope`), so the consumers are unchanged; the loader warp issues the copies (`ROPE_INT8_LOADER`), because the conversion
  delayed the producer's refills (263.1 against 237.0 µs at B=32 T=32k on an H100: 1.74× bf16). docs/benchmarks.md,
  nineteenth session.

16 query rows (H = 16, S = 1); other calls go to the other kernels. Same contract, grid, split rule and partials as
`mla_decode_triton`. Gluon does not run in the Triton interpreter: GPU tests check it against the fp64 reference,
a CPU test compiles it for sm_90.
"""

from __future__ import annotations

import torch
import triton

from specmla.ops.decode.hopper import common as G
from specmla.ops.decode.hopper import quant_common as QC
from specmla.ops.kv_cache import row_spec

if G.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _cta_barrier = G._cta_barrier

BLOCK_N = 64
BLOCK_M = 16  # query rows: the register budget (Oᵀ 64 + Vᵀ fragments 64 registers per thread) fits 16
NUM_RAW = 4  # raw stages (41 KB each): two consumers hold one each, two stay in flight
REGS = (224, 56)  # (consumer, producer) registers per thread (with the loader warp: REGS_WITH_LOADER and its 24 fill
# 64K)
USE = True  # mla_decode_triton sends the fp8 calls this kernel takes here (else the other Gluon kernels)
SCALE_WORDS = 4  # the scales' TMA box width in 32-bit words (4: the scales alone; wider boxes read into the rope)
P16 = True  # P·V in fp16: Vᵀ's e4m3 codes converted in registers (exact), Pᵀ·scale/f in fp16 (one term, 11 bits)
P_SPLIT = True  # (P16 False) Pᵀ·scale/f as two e4m3 terms (hi + lo, two P·V matmuls): output error about 0.2 % (the
# unpacking kernel's) instead of 2.5 %, at 267 instead of 252 µs (B=32 T=32k, with Q_CAT)
LOADER = False  # a one-warp partition issues the copies as stages free up (else the producer refills them)
LOADER_REGS = 24
REGS_WITH_LOADER = (224, 40)  # (consumer, producer) registers when the loader warp runs too
# fp8 rows (608 bytes): the loader warp issues the copies, because the producer's rope conversion delayed its refills
# (H100, B=32 T=32k: 237.0 µs with the loader, 263.1 without, 249.2 refilling before converting)
ROPE_INT8_LOADER = True
REFILL_LAG = 2  # (LOADER False) the producer refills the stage of block j - REFILL_LAG after handing over block j
REFILL_EARLY = False  # (LOADER False) … before preparing block j (its scales; 608-byte fp8 rows: the rope)
PROBE = 0  # timing probes (wrong results): 1 no P·V, 2 no Vᵀ loads (P·V on zeros), 3 no softmax, 4 no Q·Kᵀ,
# 5 the consumers hand every stage straight back (the producer alone), 6 no key blocks (the fixed costs), 7 the
# default kernel that also writes each program's timeline (`_stamp`) past STAMPS_AT words of the workspace
REG_A = False  # Q·Kᵀ takes the codes from registers (loaded from the stage by ldmatrix) instead of as a shared-memory
# operand: no faster (H100, B=32 T=32k: fp8 244.2 against 236.5 µs; tbq4 251.4 against 213.3, its consumers spill)
NO_COPY = False  # timing probe (wrong results): no TMA copies, the consumers alone on whatever the ring holds
Q_SPLIT = True  # q as two e4m3 terms (hi + lo) in Q·Kᵀ; False: one term (half the score matmuls)
STAMPS_AT = 1 << 21  # (PROBE 7) where the stamps go in the workspace, in int64 words: 16 per program
Q_CAT = True  # (Q_SPLIT) both terms as one 32-row operand: each chunk's codes read by one matmul instead of two
STEAL = False  # split calls: a program whose share is done helps the share with the most blocks left (its own partial)
STEAL_SEGMENTS = 2  # (STEAL) the own share, then at most this many minus one shares helped (one helper per share)
STEAL_MIN_BLOCKS = 4  # (STEAL) help only a share with at least this many blocks left (a restart costs about two)
STEAL_CLAIM = 2  # (STEAL) blocks taken per atomic: the next claim's latency hides behind this many copies
STEAL_REGS = (224, 40, 24)  # (STEAL) consumer, producer (the default partition: what is left), loader registers:
# 16 warps (3 idle) must fit 64K

# `_f16_fragment`'s relabelling of the e4m3 fragment's key bits, as a permutation of the dims (m, k5 … k0): the new
# k3 is k1, k2 is k3, k1 is k2
F16_KEY_ORDER = (0, 1, 2, 5, 3, 4, 6)

_SOURCE_KEY = G.source_key(__file__) ^ QC._SOURCE_KEY
_c = getattr(gl, "constexpr", int) if G.HAVE_GLUON else int
STAMPS_AT_C = _c(STAMPS_AT)
# (one warp) lane 0 adds $2 to the int32 at $1 and gets the old value, the other lanes 0 (`_add_once`)
_ADD_LANE0 = _c("{ .reg .pred p; .reg .b32 l; mov.u32 l, %laneid; setp.eq.u32 p, l, 0; mov.u32 $0, 0; "
                "@p atom.global.add.u32 $0, [$1], $2; }")

if G.HAVE_GLUON:
    # Sᵀ / Oᵀ accumulators: rows of the tile along M (keys for Q·Kᵀ, latent columns for P·V), query rows along N
    ACC = _c(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 32]))
    ACC16 = _c(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]))
    ACC2 = _c(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 2 * BLOCK_M, 32]))
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
        fragment's order, which leaves only whole 32-bit registers to rename."""
        t = raw_chunk.load(VL)
        t = gl.inline_asm_elementwise(QC._TRANSPOSE4, "=r,=r,=r,=r,r,r,r,r", [t], dtype=gl.float8e4nv, is_pure=True,
                                      pack=16)
        t = gl.reshape(t, [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])
        # index bits (e5 e4 e3 e2 e1 e0 d6 … d0) now hold (e5 e4 d1 e2 e1 d0 d6 … d2 e3 e0) → (m6 … m0, k5 … k0)
        t = gl.reshape(gl.permute(t, (2, 6, 7, 5, 8, 9, 10, 0, 1, 3, 4, 11, 12)), [128, 64])
        return gl.convert_layout(t, FRAG)

    @gluon.jit
    def _vt_fragments(raw_codes, rs, BLOCK_N: gl.constexpr, PROBE: gl.constexpr):
        """Stage rs's four chunks as Vᵀ fragments (PROBE 2: zeros, no loads)."""
        if PROBE != 2:
            a0 = _vt_fragment(raw_codes.index(rs * 4 + 0), V_LOAD, VT_FRAG)
            a1 = _vt_fragment(raw_codes.index(rs * 4 + 1), V_LOAD, VT_FRAG)
            a2 = _vt_fragment(raw_codes.index(rs * 4 + 2), V_LOAD, VT_FRAG)
            a3 = _vt_fragment(raw_codes.index(rs * 4 + 3), V_LOAD, VT_FRAG)
        else:
            a0 = gl.zeros([128, BLOCK_N], gl.float8e4nv, layout=VT_FRAG)
            a1 = a0
            a2 = a0
            a3 = a0
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
    def _pv16_chunk(raw_codes, rs, p16, i, c: gl.constexpr, o, PROBE: gl.constexpr):
        """Issue chunk c's Oᵀ += Vᵀ·Pᵀ in fp16: its Vᵀ fragment loaded from stage rs and converted (PROBE 2:
        zeros, no loads)."""
        if PROBE != 2:
            a8 = _vt_fragment(raw_codes.index(rs * 4 + c), V_LOAD, VT_FRAG)
        else:
            a8 = gl.zeros([128, 64], gl.float8e4nv, layout=VT_FRAG)
        return warpgroup_mma(_f16_fragment(a8, VT16_FRAG), p16.index(i + c).permute((1, 0)), o, is_async=True)

    @gluon.jit
    def _pv16(raw_codes, rs, p16, ROLE: gl.constexpr, o0, o1, o2, o3, free_bar, PROBE: gl.constexpr):
        """P·V in fp16 chunk by chunk, at most two converted fragments (32 registers each) alive: each chunk's
        matmul runs while the next chunk is loaded and converted; the stage is handed back after the last load.
        (Loading all four chunks first, to hand the stage back sooner, spilled: 298 against 255 µs at B=32 T=32k.)"""
        o0 = _pv16_chunk(raw_codes, rs, p16, ROLE * 4, 0, o0, PROBE)
        o1 = _pv16_chunk(raw_codes, rs, p16, ROLE * 4, 1, o1, PROBE)
        o0 = warpgroup_mma_wait(num_outstanding=1, deps=(o0,))
        o2 = _pv16_chunk(raw_codes, rs, p16, ROLE * 4, 2, o2, PROBE)
        o1 = warpgroup_mma_wait(num_outstanding=1, deps=(o1,))
        o3 = _pv16_chunk(raw_codes, rs, p16, ROLE * 4, 3, o3, PROBE)
        _cta_barrier()  # every warp has read the stage
        mbarrier.arrive(free_bar)
        o2, o3 = warpgroup_mma_wait(num_outstanding=0, deps=(o2, o3))
        return o0, o1, o2, o3

    @gluon.jit
    def _store_p(p8, i, y, SPLIT: gl.constexpr):
        """Pᵀ·scale/f (y, [64 keys, rows], ≤ 448) into p8 tile i in e4m3, and with SPLIT its residual into tile
        i + 4: hi keeps y's top 3 mantissa bits (exact in e4m3 down to its subnormals, 2⁻⁶ of 448's scale), so
        hi + lo carries about 8 bits."""
        y = gl.minimum(y, 448.0)
        if SPLIT:
            hi = (((y.to(gl.int32, bitcast=True) + 0x80000) & -1048576)).to(gl.float32, bitcast=True)
            hi = gl.minimum(hi, 448.0)
            _store_pt(p8.index(i), hi.to(gl.float8e4nv))
            _store_pt(p8.index(i + 4), (y - hi).to(gl.float8e4nv))
        else:
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
    def _issue_block(codes_desc, rope_desc, scale_desc, BT, b, stride_btb, n0, raw_codes, raw_rope, raw_scales,
                     bars, rs, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, SW: gl.constexpr = 4,
                     ROPE_I8: gl.constexpr = False):
        """TMA the key block starting at key n0 (whole rows of its page) into raw stage rs: four [64, 128] code
        boxes, the rope's [64, 64] bf16 box and a [64, SW] fp32 box from the scales on (SW > 4 reads into the rope).
        ROPE_I8 (608-byte fp8 rows, SW = 8: the codes' and the rope's scales): the rope's [64, 64] int8 box lands in
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
        """(608-byte fp8 rows) Where stage rs's int8 rope values land: [64 keys, 64] bytes, unswizzled, in the second
        half of its bf16 rope tile."""
        BLOCK_N: gl.constexpr = raw_rope.shape[1]
        R8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
        return G._reinterpret(raw_rope.index(rs), gl.int8, [2 * BLOCK_N, 64], R8).slice(BLOCK_N, BLOCK_N, dim=0)

    @gluon.jit
    def _producer(shared, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, NR: gl.constexpr,
                  LAG: gl.constexpr, SW: gl.constexpr, NO_COPY: gl.constexpr, REFILL: gl.constexpr,
                  ROPE_I8: gl.constexpr, EARLY: gl.constexpr):
        """Keep NR blocks in flight; per block wait for its bytes, write the per-key scales normalised per chunk
        (and the chunk factors f) for its raw stage, zero the codes of rows past the end and hand it over; then
        (REFILL) refill the stage of the block LAG behind once its consumer has read it (else `_loader` issues the
        copies). EARLY: refill before preparing the block, so that the preparation's time (608-byte fp8 rows: the
        rope's conversion) does not delay the copies."""
        (codes_desc, rope_desc, scale_desc, BT, stride_btb, b, start, end, n_blocks,
         q_hi, q_lo, q_r, qs, raw_codes, raw_rope, raw_scales, sc, fs, p8, bars) = shared
        KV_READY: gl.constexpr = 2 * NR
        for i in gl.static_range(NR):
            if not NO_COPY:
                if REFILL:
                    if i < n_blocks:
                        _issue_block(codes_desc, rope_desc, scale_desc, BT, b, stride_btb, start + i * BLOCK_N,
                                       raw_codes, raw_rope, raw_scales, bars, i, PAGE_SIZE, BLOCK_N, SW, ROPE_I8)
        for j in range(n_blocks):
            rs = j % NR
            if not NO_COPY:
                mbarrier.wait(bars.index(rs), (j // NR) & 1)
            if REFILL and EARLY:
                _refill(shared, j, PAGE_SIZE, BLOCK_N, NR, LAG, SW, NO_COPY, ROPE_I8)
            _prepare_block(raw_codes, raw_rope, raw_scales, sc, fs, rs, start + j * BLOCK_N, end, BLOCK_M, ROPE_I8)
            _cta_barrier()
            mbarrier.arrive(bars.index(KV_READY + rs))
            if REFILL and not EARLY:
                _refill(shared, j, PAGE_SIZE, BLOCK_N, NR, LAG, SW, NO_COPY, ROPE_I8)

    @gluon.jit
    def _refill(shared, j, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, NR: gl.constexpr, LAG: gl.constexpr,
                SW: gl.constexpr, NO_COPY: gl.constexpr, ROPE_I8: gl.constexpr):
        """(Producer, at block j) refill the stage block j - LAG used with block j - LAG + NR, once its consumer has
        read it."""
        (codes_desc, rope_desc, scale_desc, BT, stride_btb, b, start, end, n_blocks,
         q_hi, q_lo, q_r, qs, raw_codes, raw_rope, raw_scales, sc, fs, p8, bars) = shared
        RAW_FREE: gl.constexpr = NR
        if j >= LAG:
            nxt = j - LAG + NR
            if nxt < n_blocks:
                prev = (j - LAG) % NR
                mbarrier.wait(bars.index(RAW_FREE + prev), ((j - LAG) // NR) & 1)
                if not NO_COPY:
                    _issue_block(codes_desc, rope_desc, scale_desc, BT, b, stride_btb, start + nxt * BLOCK_N,
                                   raw_codes, raw_rope, raw_scales, bars, prev, PAGE_SIZE, BLOCK_N, SW, ROPE_I8)

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
    def _loader(shared, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, NR: gl.constexpr, SW: gl.constexpr,
                ROPE_I8: gl.constexpr):
        """One warp that only issues the copies: block j into stage j % NR as soon as the consumer of block j - NR
        has handed that stage back, so every free stage is in flight (the producer's refills waited for the next
        block's bytes first)."""
        (codes_desc, rope_desc, scale_desc, BT, stride_btb, b, start, end, n_blocks,
         q_hi, q_lo, q_r, qs, raw_codes, raw_rope, raw_scales, sc, fs, p8, bars) = shared
        RAW_FREE: gl.constexpr = NR
        for j in range(n_blocks):
            rs = j % NR
            if j >= NR:
                mbarrier.wait(bars.index(RAW_FREE + rs), ((j - NR) // NR) & 1)
            _issue_block(codes_desc, rope_desc, scale_desc, BT, b, stride_btb, start + j * BLOCK_N, raw_codes,
                           raw_rope, raw_scales, bars, rs, PAGE_SIZE, BLOCK_N, SW, ROPE_I8)

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
    def _issue_chunk_scores(raw_codes, q_hi, q_lo, rs, c: gl.constexpr, s_zero, Q_SPLIT: gl.constexpr,
                            Q_CAT: gl.constexpr = False, REG_A: gl.constexpr = False):
        """Issue chunk c's partial Sᵀ on stage rs's codes: the hi and (Q_SPLIT) lo terms of q into one
        accumulator; Q_CAT: both terms as one [2·rows] operand (q_hi's tiles 2c, 2c + 1), so the codes are read
        once, into an accumulator of 2·rows columns (`_fold_terms`). REG_A: the codes go to the matmul from
        registers (loaded from the stage first) instead of from shared memory."""
        BM: gl.constexpr = q_hi.shape[1]
        QROWS: gl.constexpr = 2 * BM if Q_CAT else BM
        Q8L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        q_op = G._reinterpret(q_hi, gl.float8e4nv, [q_hi.shape[0] * BM // QROWS, QROWS, 128], Q8L).index(c)
        if REG_A:
            a = raw_codes.index(rs * 4 + c).load(gl.DotOperandLayout(operand_index=0, parent=s_zero.type.layout,
                                                                     k_width=4))
        else:
            a = raw_codes.index(rs * 4 + c)
        s = warpgroup_mma(a, q_op.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if Q_SPLIT and not Q_CAT:
            s = warpgroup_mma(a, q_lo.index(c).permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _fold_terms(s2, BM: gl.constexpr):
        """An Sᵀ accumulator [keys, 2·rows] of q's hi (first rows) and lo terms (`Q_CAT`) → their sum [keys, rows]
        (each thread holds both halves: no data moves); [keys, rows] stays as it is."""
        t = gl.reshape(s2, [s2.shape[0], s2.shape[1] // BM, BM])
        return gl.convert_layout(gl.sum(t, axis=1), ACC)

    @gluon.jit
    def _issue_scores(raw_codes, raw_rope, q_hi, q_lo, q_r, rs, s_zero, s_zero16, Q_SPLIT: gl.constexpr,
                      Q_CAT: gl.constexpr = False, REG_A: gl.constexpr = False):
        """Issue stage rs's partial Sᵀ per 128-column chunk and its rope part's."""
        s0 = _issue_chunk_scores(raw_codes, q_hi, q_lo, rs, 0, s_zero, Q_SPLIT, Q_CAT, REG_A)
        s1 = _issue_chunk_scores(raw_codes, q_hi, q_lo, rs, 1, s_zero, Q_SPLIT, Q_CAT, REG_A)
        s2 = _issue_chunk_scores(raw_codes, q_hi, q_lo, rs, 2, s_zero, Q_SPLIT, Q_CAT, REG_A)
        s3 = _issue_chunk_scores(raw_codes, q_hi, q_lo, rs, 3, s_zero, Q_SPLIT, Q_CAT, REG_A)
        sr = warpgroup_mma(raw_rope.index(rs), q_r.permute((1, 0)), s_zero16, use_acc=False, is_async=True)
        return s0, s1, s2, s3, sr

    @gluon.jit
    def _stamp(MID_O, i: gl.constexpr, SMID: gl.constexpr = False):
        """(PROBE 7) %globaltimer in ns (SMID: the SM's id) into this program's stamp i, past STAMPS_AT int64 words
        of the workspace: `benchmarks/fp8reg_timeline.py` reads them."""
        cta = (gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)) * gl.num_programs(2) + gl.program_id(2)
        if SMID:
            t = gl.inline_asm_elementwise("{ .reg .u32 t; mov.u32 t, %smid; cvt.u64.u32 $0, t; }", "=l,r", [cta],
                                          dtype=gl.int64, is_pure=False, pack=1)
        else:
            t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [cta], dtype=gl.int64, is_pure=False,
                                          pack=1)
        gl.store(MID_O.to(gl.pointer_type(gl.int64), bitcast=True) + STAMPS_AT_C + cta * 16 + i, t)

    @gluon.jit
    def _consume_block(ROLE: gl.constexpr, shared, rs, n0, end, limit, q0, scale_log2, keys, s_zero_q, s_zero16,
                       state, BLOCK_M: gl.constexpr, NR: gl.constexpr, PROBE: gl.constexpr, P_SPLIT: gl.constexpr,
                       Q_SPLIT: gl.constexpr, P16: gl.constexpr, Q_CAT: gl.constexpr, REG_A: gl.constexpr = False):
        """One key block (keys n0 …, handed over in raw stage rs) into a consumer's state: Sᵀ on the raw codes, the
        online softmax, Pᵀ·scale/f into shared memory, Oᵀ += Vᵀ·Pᵀ; the stage is handed back once read."""
        (codes_desc, rope_desc, scale_desc, BT, stride_btb, b, start, end_own, n_blocks,
         q_hi, q_lo, q_r, qs, raw_codes, raw_rope, raw_scales, sc, fs, p8, bars) = shared
        RAW_FREE: gl.constexpr = NR
        KEY: gl.constexpr = gl.SliceLayout(1, ACC)
        ROW: gl.constexpr = gl.SliceLayout(0, ACC)
        OL: gl.constexpr = ACC16 if P16 else ACC
        OROW: gl.constexpr = gl.SliceLayout(0, OL)
        BLOCK_N: gl.constexpr = raw_rope.shape[1]
        m_i, l_keys, o0, o1, o2, o3, f0p, f1p, f2p, f3p = state
        if PROBE == 5:  # the producer alone: hand every stage straight back
            _cta_barrier()
            mbarrier.arrive(bars.index(RAW_FREE + rs))
        else:
            if PROBE != 4:
                s0, s1, s2, s3, sr = _issue_scores(raw_codes, raw_rope, q_hi, q_lo, q_r, rs, s_zero_q, s_zero16,
                                                    Q_SPLIT, Q_CAT, REG_A)
            else:
                s0, s1, s2, s3, sr = s_zero_q, s_zero_q, s_zero_q, s_zero_q, s_zero16
            sc0 = gl.expand_dims(sc.index(rs * 4 + 0).load(KEY), 1)
            sc1 = gl.expand_dims(sc.index(rs * 4 + 1).load(KEY), 1)
            sc2 = gl.expand_dims(sc.index(rs * 4 + 2).load(KEY), 1)
            sc3 = gl.expand_dims(sc.index(rs * 4 + 3).load(KEY), 1)
            f0 = gl.max(fs.index(rs * 4 + 0).load(ROW), axis=0)
            f1 = gl.max(fs.index(rs * 4 + 1).load(ROW), axis=0)
            f2 = gl.max(fs.index(rs * 4 + 2).load(ROW), axis=0)
            f3 = gl.max(fs.index(rs * 4 + 3).load(ROW), axis=0)
            if PROBE != 4:
                s0, s1, s2, s3, sr = warpgroup_mma_wait(num_outstanding=0, deps=(s0, s1, s2, s3, sr))
            s0 = _fold_terms(s0, BLOCK_M)
            s1 = _fold_terms(s1, BLOCK_M)
            s2 = _fold_terms(s2, BLOCK_M)
            s3 = _fold_terms(s3, BLOCK_M)
            s = ((s0 * (sc0 * f0) + s1 * (sc1 * f1) + s2 * (sc2 * f2) + s3 * (sc3 * f3)) * gl.expand_dims(q0, 0)
                 + gl.convert_layout(sr, ACC))
            if PROBE != 3:
                p, alpha, m_i, l_keys = QC._softmax_keys(s, m_i, l_keys, n0 + keys, end, limit, scale_log2)
            else:  # no reductions
                p = gl.minimum(gl.abs(s), 1.0)
                alpha = q0 / q0
                l_keys = l_keys + p
            if P16:
                _store_p16(p8, ROLE * 4 + 0, p * sc0)
                _store_p16(p8, ROLE * 4 + 1, p * sc1)
                _store_p16(p8, ROLE * 4 + 2, p * sc2)
                _store_p16(p8, ROLE * 4 + 3, p * sc3)
            else:
                _store_p(p8, ROLE * 8 + 0, p * sc0, P_SPLIT)
                _store_p(p8, ROLE * 8 + 1, p * sc1, P_SPLIT)
                _store_p(p8, ROLE * 8 + 2, p * sc2, P_SPLIT)
                _store_p(p8, ROLE * 8 + 3, p * sc3, P_SPLIT)
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
            if P16 and PROBE != 1:
                o0, o1, o2, o3 = _pv16(raw_codes, rs, p8, ROLE, o0, o1, o2, o3, bars.index(RAW_FREE + rs), PROBE)
            else:
                # Vᵀ fragments loaded late: fewer registers live through the softmax (loaded while the score
                # matmuls run, they spill: 329 against 255 µs at B=32 T=32k)
                a0, a1, a2, a3 = _vt_fragments(raw_codes, rs, BLOCK_N, PROBE)
                _cta_barrier()  # every warp has read the stage
                mbarrier.arrive(bars.index(RAW_FREE + rs))
                if PROBE != 1:  # P in e4m3
                    o0 = warpgroup_mma(a0, p8.index(ROLE * 8 + 0).permute((1, 0)), o0, is_async=True)
                    o1 = warpgroup_mma(a1, p8.index(ROLE * 8 + 1).permute((1, 0)), o1, is_async=True)
                    o2 = warpgroup_mma(a2, p8.index(ROLE * 8 + 2).permute((1, 0)), o2, is_async=True)
                    o3 = warpgroup_mma(a3, p8.index(ROLE * 8 + 3).permute((1, 0)), o3, is_async=True)
                    if P_SPLIT:  # the lo terms, on the same fragments
                        o0 = warpgroup_mma(a0, p8.index(ROLE * 8 + 4).permute((1, 0)), o0, is_async=True)
                        o1 = warpgroup_mma(a1, p8.index(ROLE * 8 + 5).permute((1, 0)), o1, is_async=True)
                        o2 = warpgroup_mma(a2, p8.index(ROLE * 8 + 6).permute((1, 0)), o2, is_async=True)
                        o3 = warpgroup_mma(a3, p8.index(ROLE * 8 + 7).permute((1, 0)), o3, is_async=True)
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
        limit = QC._row_limits(seq_len, S, g, FOLD, BLOCK_H, BLOCK_M, CAUSAL, ROW)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=ROW)
        f0p = gl.max(gl.full([BLOCK_M], 1.0, gl.float32, layout=ROW), axis=0)
        o0 = gl.zeros([128, BLOCK_M], gl.float32, layout=ACC16 if P16 else ACC)
        return q0, limit, (m_i, gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=ACC), o0, o0, o0, o0, f0p, f0p, f0p,
                           f0p)

    @gluon.jit
    def _merge_consumers(ROLE: gl.constexpr, raw_codes, sc, bars, state, phase, NR: gl.constexpr,
                         PROBE: gl.constexpr, MID_O):
        """Both consumers' states → consumer 0's, merged (Oᵀ per chunk in ACC, the rows' max and sum; consumer 1
        gets its own back): consumer 1's state goes through stage 0's code tiles once both are done with the ring.
        `phase`: the barriers' phase (one merge per segment of keys)."""
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
        # merge: consumer 1's state goes through stage 0's code tiles once both consumers are done with the ring
        PLAIN2: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        if ROLE == 1:
            mbarrier.wait(bars.index(DONE0), phase)
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
            mbarrier.wait(bars.index(WROTE1), phase)
            if PROBE == 7:  # 10: consumer 1's state is in shared memory
                _stamp(MID_O, 10)
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
    def _consumer(ROLE: gl.constexpr, shared, args, BLOCK_H: gl.constexpr, FOLD: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NR: gl.constexpr, CAUSAL: gl.constexpr,
                  DIRECT: gl.constexpr, PROBE: gl.constexpr, P_SPLIT: gl.constexpr, Q_SPLIT: gl.constexpr,
                  P16: gl.constexpr, Q_CAT: gl.constexpr = False, REG_A: gl.constexpr = False):
        """Consumer ROLE takes blocks ROLE, ROLE + 2, …: Sᵀ on the raw codes (hi and lo terms per chunk, the rope
        part in bf16), its own online softmax, Pᵀ·scale/f per chunk into shared memory, then the Vᵀ fragments
        from the raw codes (the stage is freed once they are in registers) and Oᵀ += Vᵀ·Pᵀ per chunk. At the end
        consumer 1 hands its state to consumer 0 through the (then idle) raw ring, and consumer 0 merges and
        stores."""
        (codes_desc, rope_desc, scale_desc, BT, stride_btb, b, start, end, n_blocks,
         q_hi, q_lo, q_r, qs, raw_codes, raw_rope, raw_scales, sc, fs, p8, bars) = shared
        (Q, MID_O, MID_LSE, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_mob, stride_mos, stride_moh,
         stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
         scale_log2, S, H, g, seq_len) = args
        KV_READY: gl.constexpr = 2 * NR
        Q_READY: gl.constexpr = 3 * NR
        KEY: gl.constexpr = gl.SliceLayout(1, ACC)
        if PROBE == 7:  # stamps: 0/1 consumer 0/1 starts, 12 the SM
            _stamp(MID_O, ROLE)
            _stamp(MID_O, 12, True)
        # q's prologue split between the consumers: each quantises two chunks (the row scale needs the whole
        # row, so each reads all of it), consumer 0 the rope part too; Q_READY counts both arrivals
        QC._load_q(Q, q_hi, q_lo, q_r, qs, b, g, H, stride_qb, stride_qs, stride_qh, BLOCK_H, FOLD, BLOCK_M, 512,
                   64, Q_SPLIT, 2 * ROLE, 2, ROLE == 0, Q_CAT)
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(bars.index(Q_READY))
        mbarrier.wait(bars.index(Q_READY), 0)
        if PROBE == 7:  # 2/3: q is ready
            _stamp(MID_O, 2 + ROLE)
        q0, limit, state = _fresh_state(qs, seq_len, g, S, BLOCK_H, FOLD, BLOCK_N, P16, CAUSAL)
        m_i, l_keys, o0, o1, o2, o3, f0p, f1p, f2p, f3p = state
        s_zero16 = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=ACC16)
        s_zero_q = gl.zeros([BLOCK_N, 2 * BLOCK_M if Q_CAT else BLOCK_M], gl.float32, layout=ACC2 if Q_CAT else ACC)
        keys = gl.arange(0, BLOCK_N, layout=KEY)
        for j in range(ROLE, n_blocks, 2):
            rs = j % NR
            n0 = start + j * BLOCK_N
            mbarrier.wait(bars.index(KV_READY + rs), (j // NR) & 1)
            if PROBE == 7:  # 4/5: the consumer's first block is handed over; 6: the last block is
                if j == ROLE:
                    _stamp(MID_O, 4 + ROLE)
                if j == n_blocks - 1:
                    _stamp(MID_O, 6)
            state = _consume_block(ROLE, shared, rs, n0, end, limit, q0, scale_log2, keys, s_zero_q, s_zero16,
                                   (m_i, l_keys, o0, o1, o2, o3, f0p, f1p, f2p, f3p), BLOCK_M, NR, PROBE, P_SPLIT,
                                   Q_SPLIT, P16, Q_CAT, REG_A)
            m_i, l_keys, o0, o1, o2, o3, f0p, f1p, f2p, f3p = state
        if PROBE == 7:  # 8/9: the consumer's last block is done
            _stamp(MID_O, 8 + ROLE)
        o0, o1, o2, o3, m_new, l_i = _merge_consumers(ROLE, raw_codes, sc, bars, (m_i, l_keys, o0, o1, o2, o3, f0p, f1p,
                                                                                  f2p, f3p), 0, NR, PROBE, MID_O)
        if ROLE == 0:
            for c in gl.static_range(4):
                QC._store_out(QC.pick4(c, o0, o1, o2, o3), m_new, l_i, b, g, H, MID_O, MID_LSE, OUT, LSE, stride_mob,
                              stride_mos, stride_moh, stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob,
                              stride_os, stride_oh, stride_lb, stride_ls, BLOCK_H, FOLD, BLOCK_M, 512, c * 128, 128,
                              c == 0, DIRECT, QC.FMT_E4M3, ACC)
            if PROBE == 7:  # 11: the partial is stored
                _stamp(MID_O, 11)

    @gluon.jit
    def _add_start(ptr, inc):
        """(One warp) add inc (≥ 0) to the non-negative int32 at ptr with one atomic (lane 0); `_add_result` gives
        the old value. Apart, so that other work hides the atomic's latency (a microsecond or more while HBM is
        busy)."""
        L32: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[1], order=[0])
        addr = gl.full([32], 0, gl.int64, layout=L32) + ptr.to(gl.int64, bitcast=True)
        incs = gl.full([32], 0, gl.int32, layout=L32) + inc
        return gl.inline_asm_elementwise(_ADD_LANE0, "=r,l,r", [addr, incs], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _add_result(started):
        return gl.max(started, axis=0)  # lane 0's old value, the others' 0

    @gluon.jit
    def _add_once(ptr, inc):
        """(One warp) add inc to the int32 at ptr with one atomic and give every lane the old value."""
        return _add_result(_add_start(ptr, inc))

    @gluon.jit
    def _pick_victim(CLAIMS, SEQ, S, NUM_SPLITS, NUM_PROGRAMS, FOLD: gl.constexpr, BLOCK_N: gl.constexpr,
                     CAUSAL: gl.constexpr, RANGES: gl.constexpr, MIN_LEFT: gl.constexpr):
        """(One warp) the share to help (-1: none): the one with the most blocks left, at least MIN_LEFT, among
        those whose owner has started (its helper slot is cleared) and that no one helps yet (each share has one
        helper slot). Taking a share is an atomic on its helper count: a lost race tries the next best."""
        LR: gl.constexpr = gl.BlockedLayout(size_per_thread=[RANGES // 32], threads_per_warp=[32], warps_per_cta=[1],
                                            order=[0])
        idx = gl.arange(0, RANGES, layout=LR)
        ok = idx < NUM_PROGRAMS
        r = gl.minimum(idx, NUM_PROGRAMS - 1)
        _b, _g, _seq, start, end = G._range_keys(SEQ, S, NUM_SPLITS, r // NUM_SPLITS, r % NUM_SPLITS, FOLD, BLOCK_N,
                                                 CAUSAL)
        # other SMs' atomics land in L2: read past L1
        taken = gl.load(CLAIMS + idx, mask=ok, other=0, cache_modifier=".cg")
        helped = gl.load(CLAIMS + NUM_PROGRAMS + idx, mask=ok, other=1, cache_modifier=".cg")
        left = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N) - taken
        left = gl.where(ok & (taken > 0) & (helped == 0) & (left >= MIN_LEFT), left, 0)
        victim = -1
        tries = 0
        while tries < 4:
            best = gl.max(left, axis=0)
            pick = gl.min(gl.where(left == best, idx, RANGES), axis=0)
            if best > 0:
                if _add_once(CLAIMS + NUM_PROGRAMS + pick, 1) == 0:
                    victim = pick
                    tries = 4
                left = gl.where(idx == pick, 0, left)
            else:
                tries = 4
            tries += 1
        _fence_gpu()  # the owner cleared the slot before its first claim: our partial goes after
        return victim

    @gluon.jit
    def _all_lanes(pred):
        """1 where the predicate (a scalar) holds in every lane of the warp, through a vote: ptxas then knows the
        branch on it is warp-uniform and keeps the loop's shared-memory addresses in uniform registers (a loop
        exiting on a shuffled max ran the consumers 50 % slower: its descriptors went through R2UR, and spilled)."""
        return gl.inline_asm_elementwise("{ .reg .pred p, q; setp.ne.s32 p, $1, 0; vote.sync.all.pred q, p, -1; "
                                         "selp.s32 $0, 1, 0, q; }", "=r,r", [pred.to(gl.int32)], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _fence_gpu():
        L32: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[1], order=[0])
        gl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r,r",
                                  [gl.full([32], 0, gl.int32, layout=L32)], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _steal_loader(shared, steal, H, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_H: gl.constexpr, NR: gl.constexpr, SW: gl.constexpr, FOLD: gl.constexpr,
                      CAUSAL: gl.constexpr, RANGES: gl.constexpr, NSEG: gl.constexpr, MIN_LEFT: gl.constexpr,
                      CLAIM: gl.constexpr, ROPE_I8: gl.constexpr):
        """(STEAL, one warp) Segment 0 is the program's own share (whose helper slot it clears first), later ones
        another program's (`_pick_victim`). Per segment: publish it (the share, its end), then fill the ring
        position by position with blocks taken CLAIM at a time from the share's counter (the owner and its helper
        take from the same counter, so no block is taken twice; the next claim is in flight while a claim's blocks
        are issued) as stages are handed back; two end markers (key -1, no copy) close the segment, one per
        consumer. The next segment starts once the consumers have stored (the merge borrows the ring), from ring
        position 0 with the ring's barriers reset. The last program to finish puts the counters back to zero."""
        (codes_desc, rope_desc, scale_desc, BT, stride_btb, b, start, end, n_blocks,
         q_hi, q_lo, q_r, qs, raw_codes, raw_rope, raw_scales, sc, fs, p8, bars) = shared
        (CLAIMS, STEAL_O, STEAL_LSE, SEQ, S, NUM_SPLITS, NUM_PROGRAMS, info, segd) = steal
        RAW_FREE: gl.constexpr = NR
        SEG_READY: gl.constexpr = 3 * NR + 3
        SEG_DONE: gl.constexpr = 3 * NR + 4
        LI: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[1], order=[0])
        zero = gl.full([BLOCK_M], 0, gl.int32, layout=LI)
        me = gl.program_id(0) * NUM_SPLITS + gl.program_id(2)
        for seg in range(NSEG):
            if seg == 0:
                r = me
            else:
                r = _pick_victim(CLAIMS, SEQ, S, NUM_SPLITS, NUM_PROGRAMS, FOLD, BLOCK_N, CAUSAL, RANGES, MIN_LEFT)
            rr = gl.maximum(r, 0)
            b_v, g_v, seq_v, v_start, v_end = G._range_keys(SEQ, S, NUM_SPLITS, rr // NUM_SPLITS, rr % NUM_SPLITS,
                                                            FOLD, BLOCK_N, CAUSAL)
            if seg == 0:  # no helper yet: the share's helper slot weighs nothing until one stores there
                rows = gl.arange(0, BLOCK_M, layout=LI)
                s_o = g_v * FOLD + rows // BLOCK_H
                h_o = rows % BLOCK_H
                gl.store(STEAL_LSE + ((b_v * S + s_o) * H + h_o) * NUM_SPLITS + gl.program_id(2),
                         gl.full([BLOCK_M], float("-inf"), gl.float32, layout=LI),
                         mask=(rows < FOLD * BLOCK_H) & (h_o < H))
                _fence_gpu()
            v_n = gl.where(r >= 0, gl.cdiv(gl.maximum(v_end - v_start, 0), BLOCK_N), 0)
            segd.index(0).store(zero + r)
            pos = 0  # each segment starts the ring afresh (its barriers are reset below): uniform stage indices
            segd.index(1).store(zero + v_end)
            _cta_barrier()
            mbarrier.arrive(bars.index(SEG_READY))
            # blocks are taken CLAIM at a time, the next CLAIM's atomic in flight while these are issued
            pending = _add_start(CLAIMS + rr, gl.where(v_n > 0, CLAIM, 0))
            base = 0
            have = 0
            ended = 0
            while ended < 2:
                rs = pos % NR
                if pos >= NR:
                    mbarrier.wait(bars.index(RAW_FREE + rs), ((pos - NR) // NR) & 1)
                c = v_n
                if ended == 0:
                    if v_n > 0:
                        if have == 0:
                            base = _add_result(pending)
                            have = CLAIM
                            pending = _add_start(CLAIMS + rr, CLAIM)
                        c = base + CLAIM - have
                        have -= 1
                if c < v_n:
                    n0 = v_start + c * BLOCK_N
                    info.index(rs).store(zero + n0)
                    _cta_barrier()
                    _issue_block(codes_desc, rope_desc, scale_desc, BT, b_v, stride_btb, n0, raw_codes, raw_rope,
                                   raw_scales, bars, rs, PAGE_SIZE, BLOCK_N, SW, ROPE_I8)
                else:  # an end marker: no copy, the stage's barrier completes on this arrival
                    info.index(rs).store(zero - 1)
                    _cta_barrier()
                    mbarrier.arrive(bars.index(rs))
                    ended += 1
                pos += 1
            mbarrier.wait(bars.index(SEG_DONE), seg & 1)
            if seg < NSEG - 1:  # everyone is done with the ring's barriers: back to phase 0 for the next segment
                for i in gl.static_range(3 * NR):
                    mbarrier.invalidate(bars.index(i))
                    mbarrier.init(bars.index(i), count=1)
                fence_async_shared()
        if _add_once(CLAIMS + 2 * NUM_PROGRAMS, 1) == NUM_PROGRAMS - 1:  # the last program: counters back to zero
            LR: gl.constexpr = gl.BlockedLayout(size_per_thread=[RANGES // 32], threads_per_warp=[32],
                                                warps_per_cta=[1], order=[0])
            idx = gl.arange(0, RANGES, layout=LR)
            zeros = gl.full([RANGES], 0, gl.int32, layout=LR)
            gl.store(CLAIMS + idx, zeros, mask=idx < NUM_PROGRAMS)
            gl.store(CLAIMS + NUM_PROGRAMS + idx, zeros, mask=idx < NUM_PROGRAMS)
            gl.store(CLAIMS + 2 * NUM_PROGRAMS + idx, zeros, mask=idx < 1)

    @gluon.jit
    def _steal_producer(shared, steal, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, NR: gl.constexpr,
                        NSEG: gl.constexpr, ROPE_I8: gl.constexpr):
        """(STEAL) `_producer` on the loader's positions: per position wait for its bytes (or its end marker),
        write the scales, zero the codes past the segment's end, hand it over; two markers end a segment."""
        (codes_desc, rope_desc, scale_desc, BT, stride_btb, b, start, end, n_blocks,
         q_hi, q_lo, q_r, qs, raw_codes, raw_rope, raw_scales, sc, fs, p8, bars) = shared
        (CLAIMS, STEAL_O, STEAL_LSE, SEQ, S, NUM_SPLITS, NUM_PROGRAMS, info, segd) = steal
        KV_READY: gl.constexpr = 2 * NR
        SEG_READY: gl.constexpr = 3 * NR + 3
        FL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[4], order=[0])
        for seg in range(NSEG):
            mbarrier.wait(bars.index(SEG_READY), seg & 1)
            v_end = gl.max(segd.index(1).load(FL), axis=0)
            pos = 0
            ended = 0
            while ended < 2:
                rs = pos % NR
                mbarrier.wait(bars.index(rs), (pos // NR) & 1)
                n0 = gl.max(info.index(rs).load(FL), axis=0)
                if n0 >= 0:
                    _prepare_block(raw_codes, raw_rope, raw_scales, sc, fs, rs, n0, v_end, BLOCK_M, ROPE_I8)
                else:
                    ended += 1
                _cta_barrier()
                mbarrier.arrive(bars.index(KV_READY + rs))
                pos += 1

    @gluon.jit
    def _steal_consumer(ROLE: gl.constexpr, shared, args, steal, BLOCK_H: gl.constexpr, FOLD: gl.constexpr,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NR: gl.constexpr, CAUSAL: gl.constexpr,
                        PROBE: gl.constexpr, P_SPLIT: gl.constexpr, Q_SPLIT: gl.constexpr, P16: gl.constexpr,
                        Q_CAT: gl.constexpr, NSEG: gl.constexpr):
        """(STEAL) `_consumer` per segment: q of the segment's request, blocks until this consumer's end marker,
        the merge, and consumer 0 stores: segment 0 into the program's own partial, a helped share's into that
        share's helper slot (STEAL_O / STEAL_LSE, shaped as a contiguous workspace), which the combine adds."""
        (codes_desc, rope_desc, scale_desc, BT, stride_btb, b, start, end, n_blocks,
         q_hi, q_lo, q_r, qs, raw_codes, raw_rope, raw_scales, sc, fs, p8, bars) = shared
        (Q, MID_O, MID_LSE, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_mob, stride_mos, stride_moh,
         stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
         scale_log2, S, H, g, seq_len) = args
        (CLAIMS, STEAL_O, STEAL_LSE, SEQ, S_, NUM_SPLITS, NUM_PROGRAMS, info, segd) = steal
        RAW_FREE: gl.constexpr = NR
        KV_READY: gl.constexpr = 2 * NR
        Q_READY: gl.constexpr = 3 * NR
        SEG_READY: gl.constexpr = 3 * NR + 3
        SEG_DONE: gl.constexpr = 3 * NR + 4
        ROW: gl.constexpr = gl.SliceLayout(0, ACC)
        KEY: gl.constexpr = gl.SliceLayout(1, ACC)
        # every warp holds the whole key row (one warp reduction) and the loop exits on a warp vote (`_all_lanes`)
        WL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[4], order=[0])
        keys = gl.arange(0, BLOCK_N, layout=KEY)
        s_zero16 = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=ACC16)
        s_zero_q = gl.zeros([BLOCK_N, 2 * BLOCK_M if Q_CAT else BLOCK_M], gl.float32, layout=ACC2 if Q_CAT else ACC)
        for seg in range(NSEG):
            mbarrier.wait(bars.index(SEG_READY), seg & 1)
            share = gl.max(segd.index(0).load(ROW), axis=0)
            v_end = gl.max(segd.index(1).load(ROW), axis=0)
            pv = gl.maximum(share, 0) // NUM_SPLITS
            b_v = pv // (S // FOLD)
            g_v = pv % (S // FOLD)
            seq_v = gl.load(SEQ + b_v)
            if share >= 0:
                QC._load_q(Q, q_hi, q_lo, q_r, qs, b_v, g_v, H, stride_qb, stride_qs, stride_qh, BLOCK_H, FOLD, BLOCK_M,
                           512, 64, Q_SPLIT, 2 * ROLE, 2, ROLE == 0, Q_CAT)
            fence_async_shared()
            _cta_barrier()
            mbarrier.arrive(bars.index(Q_READY))
            mbarrier.wait(bars.index(Q_READY), seg & 1)
            q0, limit, state = _fresh_state(qs, seq_v, g_v, S, BLOCK_H, FOLD, BLOCK_N, P16, CAUSAL)
            m_i, l_keys, o0, o1, o2, o3, f0p, f1p, f2p, f3p = state
            pos = ROLE
            rs = pos % NR
            mbarrier.wait(bars.index(KV_READY + rs), 0)
            n0 = gl.max(info.index(rs).load(WL), axis=0)
            while _all_lanes(n0 >= 0) > 0:  # until this consumer's end marker
                state = _consume_block(ROLE, shared, rs, n0, v_end, limit, q0, scale_log2, keys, s_zero_q, s_zero16,
                                       (m_i, l_keys, o0, o1, o2, o3, f0p, f1p, f2p, f3p), BLOCK_M, NR, PROBE, P_SPLIT,
                                       Q_SPLIT, P16, Q_CAT)
                m_i, l_keys, o0, o1, o2, o3, f0p, f1p, f2p, f3p = state
                pos += 2
                rs = pos % NR
                mbarrier.wait(bars.index(KV_READY + rs), (pos // NR) & 1)
                n0 = gl.max(info.index(rs).load(WL), axis=0)
            _cta_barrier()
            mbarrier.arrive(bars.index(RAW_FREE + rs))  # the marker's stage
            o0, o1, o2, o3, m_new, l_i = _merge_consumers(ROLE, raw_codes, sc, bars, (m_i, l_keys, o0, o1, o2, o3, f0p,
                                                                                      f1p, f2p, f3p), seg & 1, NR,
                                                          PROBE, MID_O)
            if ROLE == 0:
                # segment 0: the own partial; later: the helped share's helper slot, in a buffer shaped as a
                # contiguous workspace [B, S, H, splits, 512] (`_store_out` puts it at split program_id(2): shifted)
                helped = (seg > 0).to(gl.int32)
                if seg == 0:
                    mo = MID_O
                    ml = MID_LSE
                else:
                    shift = share % NUM_SPLITS - gl.program_id(2)
                    mo = STEAL_O + shift * 512
                    ml = STEAL_LSE + shift
                s_mob = stride_mob + helped * (S * H * NUM_SPLITS * 512 - stride_mob)
                s_mos = stride_mos + helped * (H * NUM_SPLITS * 512 - stride_mos)
                s_moh = stride_moh + helped * (NUM_SPLITS * 512 - stride_moh)
                s_mosp = stride_mosp + helped * (512 - stride_mosp)
                s_mlb = stride_mlb + helped * (S * H * NUM_SPLITS - stride_mlb)
                s_mls = stride_mls + helped * (H * NUM_SPLITS - stride_mls)
                s_mlh = stride_mlh + helped * (NUM_SPLITS - stride_mlh)
                if share >= 0:
                    for c in gl.static_range(4):
                        QC._store_out(QC.pick4(c, o0, o1, o2, o3), m_new, l_i, b_v, g_v, H, mo, ml, OUT, LSE, s_mob,
                                      s_mos, s_moh, s_mosp, s_mlb, s_mls, s_mlh, stride_ob, stride_os, stride_oh,
                                      stride_lb, stride_ls, BLOCK_H, FOLD, BLOCK_M, 512, c * 128, 128, c == 0, False,
                                      QC.FMT_E4M3, ACC)
                _cta_barrier()
                mbarrier.arrive(bars.index(SEG_DONE))

    @gluon.jit
    def _mla_decode_fp8reg_kernel(
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
        CLAIMS, STEAL_O, STEAL_LSE, NUM_PROGRAMS,
        PAGE_SIZE: gl.constexpr, BLOCK_H: gl.constexpr, FOLD: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, DIRECT: gl.constexpr, NR: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PROBE: gl.constexpr, LAG: gl.constexpr,
        SW: gl.constexpr, P_SPLIT: gl.constexpr, Q_SPLIT: gl.constexpr, P16: gl.constexpr, Q_CAT: gl.constexpr,
        NO_COPY: gl.constexpr, LOADER: gl.constexpr, LOADER_REGS: gl.constexpr,
        STEAL: gl.constexpr, RANGES: gl.constexpr, NSEG: gl.constexpr, MIN_LEFT: gl.constexpr, CLAIM: gl.constexpr,
        ROPE_I8: gl.constexpr, EARLY: gl.constexpr, REG_A: gl.constexpr, SOURCE_KEY: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        b, g, seq_len, start, end = G._program_keys(SEQ, S, NUM_SPLITS, FOLD, BLOCK_N, CAUSAL)
        n_blocks = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
        if PROBE == 6:
            n_blocks = 0
        Q8L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        QR: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        P8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        SC: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        # q's e4m3 terms: hi and lo apart, or (Q_CAT) chunk c's hi and lo as tiles 2c, 2c + 1 of one buffer
        q_hi = gl.allocate_shared_memory(gl.float8e4nv, [8 if Q_CAT else 4, BLOCK_M, 128], Q8L)
        q_lo = gl.allocate_shared_memory(gl.float8e4nv, [1 if Q_CAT else 4, BLOCK_M, 128], Q8L)
        q_r = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, 64], QR)
        qs = gl.allocate_shared_memory(gl.float32, [4, BLOCK_M], PLAIN)
        raw_codes = gl.allocate_shared_memory(gl.float8e4nv, [NR * 4, BLOCK_N, 128], Q8L)
        raw_rope = gl.allocate_shared_memory(gl.bfloat16, [NR, BLOCK_N, 64], QR)
        raw_scales = gl.allocate_shared_memory(gl.float32, [NR, BLOCK_N, SW], SC)
        sc = gl.allocate_shared_memory(gl.float32, [NR * 4, BLOCK_N], PLAIN)  # [stage · 4 + chunk, key]
        fs = gl.allocate_shared_memory(gl.float32, [NR * 4, BLOCK_M], PLAIN)  # each chunk's f, per row
        P16L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        # Pᵀ tiles: e4m3 [consumer · 8 + term · 4 + chunk], or (P16) fp16 [consumer · 4 + chunk]
        p8 = gl.allocate_shared_memory(gl.float16 if P16 else gl.float8e4nv, [8 if P16 else 16, BLOCK_M, BLOCK_N],
                                       P16L if P16 else P8)
        # (STEAL) each ring position's first key (-1: an end marker), and the segment: its share, its end
        info = gl.allocate_shared_memory(gl.int32, [NR if STEAL else 1, BLOCK_M], PLAIN)
        segd = gl.allocate_shared_memory(gl.int32, [2 if STEAL else 1, BLOCK_M], PLAIN)
        n_bars: gl.constexpr = 3 * NR + 5 if STEAL else 3 * NR + 3  # STEAL: SEG_READY, SEG_DONE
        bars = gl.allocate_shared_memory(gl.int64, [n_bars, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(n_bars):
            mbarrier.init(bars.index(i), count=2 if i == 3 * NR else 1)  # Q_READY: both consumers arrive
        fence_async_shared()
        shared = (codes_desc, rope_desc, scale_desc, BT, stride_btb, b, start, end, n_blocks,
                  q_hi, q_lo, q_r, qs, raw_codes, raw_rope, raw_scales, sc, fs, p8, bars)
        args = (Q, MID_O, MID_LSE, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_mob, stride_mos, stride_moh,
                stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb,
                stride_ls, scale_log2, S, H, g, seq_len)
        if STEAL:
            steal = (CLAIMS, STEAL_O, STEAL_LSE, SEQ, S, NUM_SPLITS, NUM_PROGRAMS, info, segd)
            # the producer is the default partition (its registers are what the others leave: 40): a consumer
            # there kept its wgmma descriptors out of uniform registers (R2UR and spills every block)
            gl.warp_specialize([
                (_steal_producer, (shared, steal, BLOCK_N, BLOCK_M, NR, NSEG, ROPE_I8)),
                (_steal_consumer, (0, shared, args, steal, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, NR, CAUSAL, PROBE, P_SPLIT,
                                   Q_SPLIT, P16, Q_CAT, NSEG)),
                (_steal_consumer, (1, shared, args, steal, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, NR, CAUSAL, PROBE, P_SPLIT,
                                   Q_SPLIT, P16, Q_CAT, NSEG)),
                (_steal_loader, (shared, steal, H, PAGE_SIZE, BLOCK_N, BLOCK_M, BLOCK_H, NR, SW, FOLD, CAUSAL,
                                 RANGES, NSEG, MIN_LEFT, CLAIM, ROPE_I8)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
        elif LOADER and not NO_COPY:
            gl.warp_specialize([
                (_consumer, (0, shared, args, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, NR, CAUSAL, DIRECT, PROBE, P_SPLIT,
                             Q_SPLIT, P16, Q_CAT, REG_A)),
                (_consumer, (1, shared, args, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, NR, CAUSAL, DIRECT, PROBE, P_SPLIT,
                             Q_SPLIT, P16, Q_CAT, REG_A)),
                (_producer, (shared, PAGE_SIZE, BLOCK_N, BLOCK_M, NR, LAG, SW, NO_COPY, False, ROPE_I8, False)),
                (_loader, (shared, PAGE_SIZE, BLOCK_N, NR, SW, ROPE_I8)),
            ], [4, 4, 1], [CONSUMER_REGS, PRODUCER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (0, shared, args, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, NR, CAUSAL, DIRECT, PROBE, P_SPLIT,
                             Q_SPLIT, P16, Q_CAT, REG_A)),
                (_consumer, (1, shared, args, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, NR, CAUSAL, DIRECT, PROBE, P_SPLIT,
                             Q_SPLIT, P16, Q_CAT, REG_A)),
                (_producer, (shared, PAGE_SIZE, BLOCK_N, BLOCK_M, NR, LAG, SW, NO_COPY, True, ROPE_I8, EARLY)),
            ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def fp8reg_supported(q: torch.Tensor, kv_cache: torch.Tensor, dc: int, block_m: int,
                     kv_format: str = "fp8_ds_mla") -> bool:
    """Whether this kernel takes an fp8-cache call: what `mla_decode_gluon_fp8mma` takes, with 16 query rows;
    fp8 rows (608 bytes) under the same conditions."""
    if max(16, block_m) != BLOCK_M:
        return False
    if kv_format == "fp8":
        return (dc == QC.DC and QC.hopper_rows_supported(q, kv_cache, ROPE_INT8_ROW_BYTES)
                and kv_cache.shape[1] % BLOCK_N == 0)  # one TMA box per block
    return (kv_format == "fp8_ds_mla" and dc == QC.DC and QC.hopper_rows_supported(q, kv_cache, QC.ROW_BYTES[kv_format])
            and kv_cache.shape[1] % BLOCK_N == 0)


ROPE_INT8_ROW_BYTES = row_spec("fp8", 512, 64, torch.uint8)[0]  # 608 bytes


def _rope_int8_descriptors(kv_cache: torch.Tensor) -> tuple:
    """TMA views of fp8 rows (608 bytes): codes [rows, 608] e4m3 in [64, 128] boxes, the rope's int8 values [rows, 608]
    in unswizzled [64, 64] boxes, the scales [rows, 152] fp32 in [64, 8] boxes (4 codes' + 8 fp16 rope scales)."""
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    flat = kv_cache.view(rows, ROPE_INT8_ROW_BYTES)
    return (TensorDescriptor.from_tensor(flat.view(torch.float8_e4m3fn), [BLOCK_N, 128],
                                           gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)),
            TensorDescriptor.from_tensor(flat.view(torch.int8), [BLOCK_N, 64],
                                           gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)),
            TensorDescriptor.from_tensor(flat.view(torch.float32), [BLOCK_N, 8],
                                           gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)))


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


def launch_fp8reg_split(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2, cfg, *,
                        causal: bool, direct: bool, num_splits: int, kv_format: str = "fp8_ds_mla"):
    """Stage 1 of `mla_decode_triton` for an fp8 (608-byte) or fp8_ds_mla (656-byte) cache (grid, split rule and
    outputs as the other kernels)."""
    rope_i8 = kv_format == "fp8"
    scale_words = 8 if rope_i8 else SCALE_WORDS
    grid, args, consts = QC.tma_launch_args(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2,
                                           cfg, causal=causal, direct=direct, num_splits=num_splits, block_m=BLOCK_M,
                                           views=_rope_int8_descriptors(kv_cache) if rope_i8 else
                                           _descriptors(kv_cache, scale_words))
    if PROBE == 7 and mid_o.is_cuda:  # stamps go past the partials: the workspace must be a view of a larger buffer
        room = mid_o.untyped_storage().nbytes() - mid_o.storage_offset() * mid_o.element_size()
        if direct or room < 8 * (STAMPS_AT + 16 * grid[0] * grid[1] * grid[2]):
            raise ValueError("PROBE 7 needs a split call whose workspace has room for the stamps "
                             "(benchmarks/fp8reg_timeline.py allocates it)")
    steal = STEAL and not direct and grid[1] == 1 and PROBE != 7
    loader = ROPE_INT8_LOADER if rope_i8 else LOADER
    regs, loader_regs = ((STEAL_REGS[:2], STEAL_REGS[2]) if steal else
                         (REGS_WITH_LOADER if loader else REGS, LOADER_REGS))
    programs = grid[0] * grid[2]
    if steal:
        claims, steal_o, steal_lse = helper_buffers(q.device, programs, mid_o.shape[:4])
        steal_args = (claims, steal_o, steal_lse, programs)
    else:
        steal_args = (mid_lse, mid_o, mid_lse, 1)  # unused
    _mla_decode_fp8reg_kernel[grid](*args, *steal_args, **consts, NR=NUM_RAW, CONSUMER_REGS=regs[0],
                                    PRODUCER_REGS=regs[1], PROBE=PROBE, LAG=REFILL_LAG, SW=scale_words,
                                    P_SPLIT=P_SPLIT, Q_SPLIT=Q_SPLIT, P16=P16,
                                    Q_CAT=Q_CAT and Q_SPLIT,  # one term: nothing to join
                                    LOADER=loader, LOADER_REGS=loader_regs, NO_COPY=NO_COPY,
                                    STEAL=steal, REG_A=REG_A,
                                    RANGES=max(32, triton.next_power_of_2(programs)) if steal else 32,
                                    NSEG=STEAL_SEGMENTS, MIN_LEFT=STEAL_MIN_BLOCKS, CLAIM=STEAL_CLAIM,
                                    ROPE_I8=rope_i8, EARLY=REFILL_EARLY, SOURCE_KEY=_SOURCE_KEY,
                                    num_warps=4)
    return (steal_o, steal_lse) if steal else None


_HELPER_BUFFERS: dict = {}


def helper_buffers(device: torch.device, programs: int, shape: tuple) -> tuple:
    """(STEAL) int32 [blocks taken per share, helpers per share, programs done] (zero between calls: the last
    program resets them), and the shares' helper partials [B, S, H, splits, 512] with their log2-sum-exps [B, S, H,
    splits] (each owner sets its share's to −inf before the share can be helped). Kept per device and shape, never
    freed: CUDA graphs hold their addresses."""
    key = (str(device), programs, tuple(shape))
    if key not in _HELPER_BUFFERS:
        _HELPER_BUFFERS[key] = (torch.zeros(2 * programs + 1, dtype=torch.int32, device=device),
                                torch.empty(*shape, 512, dtype=torch.float32, device=device),
                                torch.empty(*shape, dtype=torch.float32, device=device))
    return _HELPER_BUFFERS[key]
