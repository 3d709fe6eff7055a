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
- Q·Kᵀ is as in `mla_decode_gluon_fp8mma`: e4m3 wgmmas on the raw codes with q split in hi + lo (here one scale
  per row, which saves the consumers 12 registers).
- Pᵀ·scale/f is split in hi + lo e4m3 terms too (`P_SPLIT`): the output error is then the unpacking kernel's
  (0.2 %), at the price of spills. With one term the kernel takes 1.63× less time than bf16 at B=32 T=32k, H=16
  (H100), but at 2.5 % error, and through its arithmetic (`mla_decode_e4m3`) the embedded model's attention cosine
  falls to 0.99898, under issue 7's 0.999 bar; with two, 1.23× (the unpacking kernel: 1.10×). docs/benchmarks.md,
  issue 7, twelfth and fifteenth sessions.

16 query rows (H = 16, S = 1); other calls go to the other kernels. Same contract, grid, split rule and partials as
`mla_decode_triton`. Gluon does not run in the Triton interpreter: GPU tests check it against the fp64 reference,
a CPU test compiles it for sm_90.
"""

from __future__ import annotations

import torch

from specmla.ops import mla_decode_gluon as G
from specmla.ops import mla_decode_gluon_fp8mma as M
from specmla.ops import mla_decode_gluon_quant as Q8

if G.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    _cta_barrier = G._cta_barrier

BLOCK_N = 64
BLOCK_M = 16  # query rows: the register budget (Oᵀ 64 + Vᵀ fragments 64 registers per thread) fits 16
NUM_RAW = 4  # raw stages (41 KB each): two consumers hold one each, two stay in flight
REGS = (224, 56)  # (consumer, producer) registers per thread
USE = True  # mla_decode_triton sends the fp8 calls this kernel takes here (else the other Gluon kernels)
SCALE_WORDS = 4  # the scales' TMA box width in 32-bit words (4: the scales alone; wider boxes read into the rope)
P_SPLIT = True  # Pᵀ·scale/f as two e4m3 terms (hi + lo, two P·V matmuls): output error about 0.2 % (the unpacking
# kernel's) instead of 2.5 %, at 339 instead of 257 µs (B=32 T=32k: the extra terms make the consumers spill)
REFILL_LAG = 2  # the producer refills the stage of block j - REFILL_LAG after handing over block j
PROBE = 0  # timing probes (wrong results): 1 no P·V, 2 no Vᵀ loads (P·V on zeros), 3 no softmax, 4 no Q·Kᵀ,
# 5 the consumers hand every stage straight back (the producer alone), 6 no key blocks (the fixed costs)
NO_COPY = False  # timing probe (wrong results): no TMA copies, the consumers alone on whatever the ring holds
Q_SPLIT = True  # q as two e4m3 terms (hi + lo) in Q·Kᵀ; False: one term (half the score matmuls)

_SOURCE_KEY = G.source_key(__file__) ^ M._SOURCE_KEY
_c = getattr(gl, "constexpr", int) if G.HAVE_GLUON else int

if G.HAVE_GLUON:
    # Sᵀ / Oᵀ accumulators: rows of the tile along M (keys for Q·Kᵀ, latent columns for P·V), query rows along N
    ACC = _c(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 32]))
    ACC16 = _c(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]))
    VT_FRAG = _c(gl.DotOperandLayout(operand_index=0, parent=ACC.value, k_width=4))
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
        t = gl.inline_asm_elementwise(M._TRANSPOSE4, "=r,=r,=r,=r,r,r,r,r", [t], dtype=gl.float8e4nv, is_pure=True,
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
    def _store_pt(p8_chunk, p):
        """Pᵀ·scale/f [64 keys, rows] (e4m3) → p8_chunk [rows, 64 tile keys] in the fragment's key order."""
        BM: gl.constexpr = p.shape[1]
        t = gl.reshape(p, [2, 2, 2, 2, 2, 2, BM])
        # Sᵀ [64 keys, rows] as 7 index bits (e5 … e0, row) → (k5 … k0, row): the fragment's key order
        t = gl.reshape(gl.permute(t, (0, 1, 3, 4, 2, 5, 6)), [64, BM])
        p8_chunk.permute((1, 0)).store(t)

    @gluon.jit
    def _producer(shared, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, NR: gl.constexpr,
                  LAG: gl.constexpr, SW: gl.constexpr, NO_COPY: gl.constexpr):
        """Keep NR blocks in flight; per block wait for its bytes, write the per-key scales normalised per chunk
        (and the chunk factors f) for its raw stage, zero the codes of rows past the end and hand it over; then
        refill the stage of the block LAG behind once its consumer has read it."""
        (codes_desc, rope_desc, scale_desc, BT, stride_btb, b, start, end, n_blocks,
         q_hi, q_lo, q_r, qs, raw_codes, raw_rope, raw_scales, sc, fs, p8, bars) = shared
        RAW_FREE: gl.constexpr = NR
        KV_READY: gl.constexpr = 2 * NR
        SCL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32, 1], warps_per_cta=[4, 1],
                                             order=[1, 0])
        FL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[4], order=[0])
        for i in gl.static_range(NR):
            if not NO_COPY:
                if i < n_blocks:
                    M._issue_block(codes_desc, rope_desc, scale_desc, BT, b, stride_btb, start + i * BLOCK_N,
                                   raw_codes, raw_rope, raw_scales, bars, i, PAGE_SIZE, BLOCK_N, SW)
        ZL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                            order=[1, 0])
        keys_z = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ZL))
        keys_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SCL))
        for j in range(n_blocks):
            rs = j % NR
            if not NO_COPY:
                mbarrier.wait(bars.index(rs), (j // NR) & 1)
            _store_scales(raw_scales.index(rs).slice(0, 4, dim=1).load(SCL), start + j * BLOCK_N + keys_s < end, sc,
                          fs, rs, BLOCK_M, SCL, FL)
            n_valid = end - start - j * BLOCK_N
            if n_valid < BLOCK_N:  # rows past the end may hold NaN codes, and 0 · NaN = NaN in P·V: zero them
                for c in gl.static_range(4):
                    t = raw_codes.index(rs * 4 + c).load(ZL)
                    raw_codes.index(rs * 4 + c).store(gl.where(gl.expand_dims(keys_z < n_valid, 1), t, gl.zeros_like(t)))
                fence_async_shared()
            _cta_barrier()
            mbarrier.arrive(bars.index(KV_READY + rs))
            if j >= LAG:  # refill the stage block j-LAG used, once its consumer has read it
                nxt = j - LAG + NR
                if nxt < n_blocks:
                    prev = (j - LAG) % NR
                    mbarrier.wait(bars.index(RAW_FREE + prev), ((j - LAG) // NR) & 1)
                    if not NO_COPY:
                        M._issue_block(codes_desc, rope_desc, scale_desc, BT, b, stride_btb, start + nxt * BLOCK_N,
                                       raw_codes, raw_rope, raw_scales, bars, prev, PAGE_SIZE, BLOCK_N, SW)

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
    def _issue_chunk_scores(raw_codes, q_hi, q_lo, rs, c: gl.constexpr, s_zero, Q_SPLIT: gl.constexpr):
        """Issue chunk c's partial Sᵀ on stage rs's codes: the hi and (Q_SPLIT) lo terms of q into one
        accumulator."""
        s = warpgroup_mma(raw_codes.index(rs * 4 + c), q_hi.index(c).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        if Q_SPLIT:
            s = warpgroup_mma(raw_codes.index(rs * 4 + c), q_lo.index(c).permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _issue_scores(raw_codes, raw_rope, q_hi, q_lo, q_r, rs, s_zero, s_zero16, Q_SPLIT: gl.constexpr):
        """Issue stage rs's partial Sᵀ per 128-column chunk and its rope part's."""
        s0 = _issue_chunk_scores(raw_codes, q_hi, q_lo, rs, 0, s_zero, Q_SPLIT)
        s1 = _issue_chunk_scores(raw_codes, q_hi, q_lo, rs, 1, s_zero, Q_SPLIT)
        s2 = _issue_chunk_scores(raw_codes, q_hi, q_lo, rs, 2, s_zero, Q_SPLIT)
        s3 = _issue_chunk_scores(raw_codes, q_hi, q_lo, rs, 3, s_zero, Q_SPLIT)
        sr = warpgroup_mma(raw_rope.index(rs), q_r.permute((1, 0)), s_zero16, use_acc=False, is_async=True)
        return s0, s1, s2, s3, sr

    @gluon.jit
    def _consumer(ROLE: gl.constexpr, shared, args, BLOCK_H: gl.constexpr, FOLD: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NR: gl.constexpr, CAUSAL: gl.constexpr,
                  DIRECT: gl.constexpr, PROBE: gl.constexpr, P_SPLIT: gl.constexpr, Q_SPLIT: gl.constexpr):
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
        RAW_FREE: gl.constexpr = NR
        KV_READY: gl.constexpr = 2 * NR
        Q_READY: gl.constexpr = 3 * NR
        DONE0: gl.constexpr = 3 * NR + 1
        WROTE1: gl.constexpr = 3 * NR + 2
        ROW: gl.constexpr = gl.SliceLayout(0, ACC)
        KEY: gl.constexpr = gl.SliceLayout(1, ACC)
        # q's prologue split between the consumers: each quantises two chunks (the row scale needs the whole
        # row, so each reads all of it), consumer 0 the rope part too; Q_READY counts both arrivals
        M._load_q(Q, q_hi, q_lo, q_r, qs, b, g, H, stride_qb, stride_qs, stride_qh, BLOCK_H, FOLD, BLOCK_M, 512,
                  64, True, Q_SPLIT, 2 * ROLE, 2, ROLE == 0)
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(bars.index(Q_READY))
        mbarrier.wait(bars.index(Q_READY), 0)
        q0 = qs.index(0).load(ROW)  # one scale per row for every chunk: fewer registers
        cols_r = gl.arange(0, BLOCK_M, layout=ROW)
        if CAUSAL:
            limit = seq_len - S + g * FOLD + cols_r // BLOCK_H + 1
        else:
            limit = gl.full([BLOCK_M], 0, gl.int32, layout=ROW) + seq_len
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=ROW)
        # each block's chunk factors f are scalars (the producer writes one per row): the previous block's are kept
        f0p = gl.max(gl.full([BLOCK_M], 1.0, gl.float32, layout=ROW), axis=0)
        f1p = f0p
        f2p = f0p
        f3p = f0p
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=ACC)
        s_zero16 = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=ACC16)
        l_keys = s_zero
        o0 = gl.zeros([128, BLOCK_M], gl.float32, layout=ACC)
        o1 = o0
        o2 = o0
        o3 = o0
        keys = gl.arange(0, BLOCK_N, layout=KEY)
        for j in range(ROLE, n_blocks, 2):
            rs = j % NR
            n0 = start + j * BLOCK_N
            mbarrier.wait(bars.index(KV_READY + rs), (j // NR) & 1)
            if PROBE == 5:  # the producer alone: hand every stage straight back
                _cta_barrier()
                mbarrier.arrive(bars.index(RAW_FREE + rs))
            else:
                if PROBE != 4:
                    s0, s1, s2, s3, sr = _issue_scores(raw_codes, raw_rope, q_hi, q_lo, q_r, rs, s_zero, s_zero16,
                                                        Q_SPLIT)
                else:
                    s0, s1, s2, s3, sr = s_zero, s_zero, s_zero, s_zero, s_zero16
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
                s = ((s0 * (sc0 * f0) + s1 * (sc1 * f1) + s2 * (sc2 * f2) + s3 * (sc3 * f3)) * gl.expand_dims(q0, 0)
                     + gl.convert_layout(sr, ACC))
                if PROBE != 3:
                    p, alpha, m_i, l_keys = Q8._softmax_keys(s, m_i, l_keys, n0 + keys, end, limit, scale_log2)
                else:  # no reductions
                    p = gl.minimum(gl.abs(s), 1.0)
                    alpha = q0 / q0
                    l_keys = l_keys + p
                _store_p(p8, ROLE * 8 + 0, p * sc0, P_SPLIT)
                _store_p(p8, ROLE * 8 + 1, p * sc1, P_SPLIT)
                _store_p(p8, ROLE * 8 + 2, p * sc2, P_SPLIT)
                _store_p(p8, ROLE * 8 + 3, p * sc3, P_SPLIT)
                fence_async_shared()
                _cta_barrier()  # every warp's Pᵀ is stored
                o0 = o0 * gl.expand_dims(alpha * (f0p / f0), 0)
                o1 = o1 * gl.expand_dims(alpha * (f1p / f1), 0)
                o2 = o2 * gl.expand_dims(alpha * (f2p / f2), 0)
                o3 = o3 * gl.expand_dims(alpha * (f3p / f3), 0)
                f0p = f0
                f1p = f1
                f2p = f2
                f3p = f3
                # Vᵀ fragments loaded late: fewer registers live through the softmax (loaded while the score
                # matmuls run, they spill: 329 against 255 µs at B=32 T=32k)
                a0, a1, a2, a3 = _vt_fragments(raw_codes, rs, BLOCK_N, PROBE)
                _cta_barrier()  # every warp has read the stage
                mbarrier.arrive(bars.index(RAW_FREE + rs))
                if PROBE != 1:
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
        l_i = gl.sum(l_keys, axis=0)
        o0 = o0 * f0p
        o1 = o1 * f1p
        o2 = o2 * f2p
        o3 = o3 * f3p
        # merge: consumer 1's state goes through stage 0's code tiles once both consumers are done with the ring
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
            o0 = o0 * a_self + G._reinterpret(raw_codes.index(0), gl.float32, [128, BLOCK_M], PLAIN2).load(ACC) * a_other
            o1 = o1 * a_self + G._reinterpret(raw_codes.index(1), gl.float32, [128, BLOCK_M], PLAIN2).load(ACC) * a_other
            o2 = o2 * a_self + G._reinterpret(raw_codes.index(2), gl.float32, [128, BLOCK_M], PLAIN2).load(ACC) * a_other
            o3 = o3 * a_self + G._reinterpret(raw_codes.index(3), gl.float32, [128, BLOCK_M], PLAIN2).load(ACC) * a_other
            for c in gl.static_range(4):
                Q8._store_out(M.pick4(c, o0, o1, o2, o3), m_new, l_i, b, g, H, MID_O, MID_LSE, OUT, LSE, stride_mob, stride_mos, stride_moh,
                              stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh,
                              stride_lb, stride_ls, BLOCK_H, FOLD, BLOCK_M, 512, c * 128, 128, c == 0, DIRECT, 3, ACC)

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
        PAGE_SIZE: gl.constexpr, BLOCK_H: gl.constexpr, FOLD: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, DIRECT: gl.constexpr, NR: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PROBE: gl.constexpr, LAG: gl.constexpr,
        SW: gl.constexpr, P_SPLIT: gl.constexpr, Q_SPLIT: gl.constexpr, NO_COPY: gl.constexpr,
        SOURCE_KEY: gl.constexpr, num_warps: gl.constexpr,
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
        q_hi = gl.allocate_shared_memory(gl.float8e4nv, [4, BLOCK_M, 128], Q8L)
        q_lo = gl.allocate_shared_memory(gl.float8e4nv, [4, BLOCK_M, 128], Q8L)
        q_r = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, 64], QR)
        qs = gl.allocate_shared_memory(gl.float32, [4, BLOCK_M], PLAIN)
        raw_codes = gl.allocate_shared_memory(gl.float8e4nv, [NR * 4, BLOCK_N, 128], Q8L)
        raw_rope = gl.allocate_shared_memory(gl.bfloat16, [NR, BLOCK_N, 64], QR)
        raw_scales = gl.allocate_shared_memory(gl.float32, [NR, BLOCK_N, SW], SC)
        sc = gl.allocate_shared_memory(gl.float32, [NR * 4, BLOCK_N], PLAIN)  # [stage · 4 + chunk, key]
        fs = gl.allocate_shared_memory(gl.float32, [NR * 4, BLOCK_M], PLAIN)  # each chunk's f, per row
        p8 = gl.allocate_shared_memory(gl.float8e4nv, [16, BLOCK_M, BLOCK_N], P8)  # [consumer · 8 + term · 4 + chunk]
        n_bars: gl.constexpr = 3 * NR + 3
        bars = gl.allocate_shared_memory(gl.int64, [n_bars, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(n_bars):
            mbarrier.init(bars.index(i), count=2 if i == 3 * NR else 1)  # Q_READY: both consumers arrive
        fence_async_shared()
        shared = (codes_desc, rope_desc, scale_desc, BT, stride_btb, b, start, end, n_blocks,
                  q_hi, q_lo, q_r, qs, raw_codes, raw_rope, raw_scales, sc, fs, p8, bars)
        args = (Q, MID_O, MID_LSE, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_mob, stride_mos, stride_moh,
                stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb,
                stride_ls, scale_log2, S, H, g, seq_len)
        gl.warp_specialize([
            (_consumer, (0, shared, args, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, NR, CAUSAL, DIRECT, PROBE, P_SPLIT,
                         Q_SPLIT)),
            (_consumer, (1, shared, args, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, NR, CAUSAL, DIRECT, PROBE, P_SPLIT,
                         Q_SPLIT)),
            (_producer, (shared, PAGE_SIZE, BLOCK_N, BLOCK_M, NR, LAG, SW, NO_COPY)),
        ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def fp8reg_supported(q: torch.Tensor, kv_cache: torch.Tensor, dc: int, block_m: int) -> bool:
    """Whether this kernel takes an fp8-cache call: what `mla_decode_gluon_fp8mma` takes, with 16 query rows."""
    return M.fp8mma_supported(q, kv_cache, dc, block_m) and max(16, block_m) == BLOCK_M


def launch_fp8reg_split(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2, cfg, *,
                        causal: bool, direct: bool, num_splits: int):
    """Stage 1 of `mla_decode_triton` for an fp8 cache (grid, split rule and outputs as the other kernels)."""
    grid, args, consts = M.tma_launch_args(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2,
                                           cfg, causal=causal, direct=direct, num_splits=num_splits, block_m=BLOCK_M,
                                           scale_words=SCALE_WORDS)
    _mla_decode_fp8reg_kernel[grid](*args, **consts, NR=NUM_RAW, CONSUMER_REGS=REGS[0], PRODUCER_REGS=REGS[1],
                                    PROBE=PROBE, LAG=REFILL_LAG, SW=SCALE_WORDS, P_SPLIT=P_SPLIT,
                                    Q_SPLIT=Q_SPLIT, NO_COPY=NO_COPY,
                                    SOURCE_KEY=_SOURCE_KEY,
                                    num_warps=4)
