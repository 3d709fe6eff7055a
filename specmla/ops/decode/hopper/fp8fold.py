"""Hopper MLA decode over an fp8 cache for 64 query rows (several query tokens folded: H = 16, S = 2…4, the MTP
verify step), with e4m3 score matmuls whose M is the query rows.

Why: the 16-row e4m3 kernel (`mla_decode_gluon_fp8reg`) runs one program per query token when S > 1, so each
token's program reads the keys again: at S = 4 fp8 was 0.57× bf16 (H100, B=32 T=32k), while bf16's 64-row tiles
read them once. Its registers cannot hold more rows (Oᵀ for all 512 latent columns is 64 registers per thread at 16
rows). Here the rows are the matmuls' M or N dimension at 64, and the two consumer warpgroups split the latent
columns instead of the key blocks:
- Consumer w owns latent chunks 2w and 2w + 1 (w = 1 also the rope part). Per block it computes its partial scores
  S_w = Σ q_c·K_cᵀ·scale_c [64 rows, 64 keys] with e4m3 wgmmas on the raw codes (q as A from shared memory in two
  e4m3 terms, hi + lo, one scale per row: the 16-row kernel's quality; the codes as a K-major B), the rope part in
  bf16 accumulating onto it. The consumers swap partials through shared memory and both run the same softmax, over
  the keys within each warp's 16 rows (quad shuffles, no cross-warp reduction).
- P·V per owned chunk: Oᵀ [128 columns, 64 rows] += Vᵀ·Pᵀ with Vᵀ the wgmma's register operand
  (`mla_decode_gluon_fp8reg._vt_fragment`: 32-bit words of codes and a 4 × 4 byte transpose) and Pᵀ·scale/f in two
  e4m3 terms (hi + lo: the fp16 path's accuracy with the same number of matmuls and 16 fewer registers per
  fragment). Oᵀ is 2 × 64 registers per thread; the scores are computed 32 keys at a time (`_half_scores`), so that
  two chunks' accumulators take 32 registers beside it, not 64 (with 64 the consumers spilled in the loop).
- The producer warpgroup and the loader warp are the 16-row kernel's (`_producer` without refills, `_loader`):
  TMA copies of whole rows, per-chunk scales normalised into e4m3's range, codes past the end zeroed, 608-byte
  rows' int8 rope converted to bf16. Both consumers read every stage, so a stage is free after two arrivals.
- Shared memory: q (72 KB: two e4m3 terms and the bf16 rope part at 64 rows), Pᵀ (32 KB), the partial scores
  (32 KB) and two raw stages of 42 KB.

Status (H100, docs/benchmarks.md issue 7, twenty-first session): correct (GPU tests against the fp64 reference:
within 1 %, every row's cosine over 0.999), but slow, so the route is off (`mla_decode_triton.FOLDED_E4M3_FORMATS`):
B=32 T=32k S=4 829 µs against bf16's 419 (0.51×; one token per program on the 16-row kernel: 0.58×). Its copies
alone take 290 µs (two stages: 1.45× bf16). The consumers are the limit: both take every block in lock step (the
swap), each step waits on the one before (score matmuls, swap, softmax, Pᵀ, P·V), and there are no registers left to
overlap blocks: 11k cycles per block against about 2k of tensor-core work. Without P·V: 643 µs; without the swap: 669.

64 rows (fewer are padded), fp8 (608-byte) and fp8_ds_mla (656-byte) rows, Dc = 512, Dr = 64, pages of a multiple
of 64 keys. Same contract, grid, split rule and partials as `mla_decode_triton`. Gluon does not run in the Triton
interpreter: GPU tests check it against the fp64 reference, a CPU test compiles it for sm_90.
"""

from __future__ import annotations

import torch

from specmla.ops.decode.hopper import common as G
from specmla.ops.decode.hopper import fp8mma as M
from specmla.ops.decode.hopper import fp8 as R
from specmla.ops.decode.hopper import dequant as Q8

if G.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    _cta_barrier = G._cta_barrier

BLOCK_N = 64
BLOCK_M = 64  # query rows per program (folded tokens × heads; fewer are padded with zero rows)
NUM_RAW = 2  # raw stages (42 KB each): what is left of shared memory beside q, Pᵀ and the partial scores
REGS = (232, 40)  # (consumer, producer) registers per thread (the loader warp, if on, takes LOADER_REGS)
LOADER_REGS = 24
LOADER = False  # a one-warp partition issues the copies (else the producer refills each stage): its warpgroup's
# registers (setmaxnreg counts whole warpgroups) left consumer 0 216, which spilled
PROBE = 0  # timing probes (wrong results): 1 the consumers hand every stage straight back (the copies and the
# producer alone), 2 no P·V, 3 no partial-score swap (each consumer's softmax on its own partial)

_SOURCE_KEY = G.source_key(__file__) ^ R._SOURCE_KEY

if G.HAVE_GLUON:

    @gluon.jit
    def _half_scores(q_hi, q_lo, q_r, raw_codes, raw_rope, sc, rs, q0, fa, fb, h: gl.constexpr, ca: gl.constexpr,
                     cb: gl.constexpr, ROPE: gl.constexpr, HACC: gl.constexpr, HACC16: gl.constexpr):
        """Keys 32h … 32h + 31 of stage rs: chunks ca and cb's scores (q's hi and lo terms on the raw codes) times
        each key's chunk scale, the chunks' factors f and the row scale q0, and (ROPE) the rope part's bf16 scores added
        by a matmul that accumulates onto them [rows, 32 keys]. (Each consumer adding half of the rope columns, to even
        out their work, was no faster: 856 against 836 µs at B=32 T=32k S=4 on an H100.)"""
        KEYL: gl.constexpr = gl.SliceLayout(0, HACC)
        BM: gl.constexpr = q_hi.shape[1]
        zero = gl.zeros([BM, 32], gl.float32, layout=HACC)
        ka = raw_codes.index(rs * 4 + ca).slice(32 * h, 32, dim=0).permute((1, 0))
        kb = raw_codes.index(rs * 4 + cb).slice(32 * h, 32, dim=0).permute((1, 0))
        sa = warpgroup_mma(q_hi.index(ca), ka, zero, use_acc=False, is_async=True)
        sa = warpgroup_mma(q_lo.index(ca), ka, sa, is_async=True)
        sb = warpgroup_mma(q_hi.index(cb), kb, zero, use_acc=False, is_async=True)
        sb = warpgroup_mma(q_lo.index(cb), kb, sb, is_async=True)
        sca = gl.expand_dims(sc.index(rs * 4 + ca).slice(32 * h, 32).load(KEYL), 0)
        scb = gl.expand_dims(sc.index(rs * 4 + cb).slice(32 * h, 32).load(KEYL), 0)
        sa, sb = warpgroup_mma_wait(num_outstanding=0, deps=(sa, sb))
        part = (sa * (sca * fa) + sb * (scb * fb)) * gl.expand_dims(q0, 1)
        if ROPE:
            kr = raw_rope.index(rs).slice(32 * h, 32, dim=0).permute((1, 0))
            part = warpgroup_mma(q_r, kr, gl.convert_layout(part, HACC16), is_async=True)
            part = gl.convert_layout(warpgroup_mma_wait(num_outstanding=0, deps=(part,)), HACC)
        return part

    @gluon.jit
    def _partial_scores(q_hi, q_lo, q_r, raw_codes, raw_rope, sc, fs, rs, q0, ca: gl.constexpr, cb: gl.constexpr,
                        ROPE: gl.constexpr, SACC: gl.constexpr):
        """This consumer's partial scores of stage rs [rows, 64 keys] (`_half_scores` per 32 keys: one half's two
        accumulators live at a time, 16 registers each, where 64 keys' took 64 registers beside Oᵀ's 128), and the
        chunks' factors f (for Oᵀ)."""
        ROWL: gl.constexpr = gl.SliceLayout(1, SACC)
        HACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 32])
        HACC16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 32, 16])
        fa = gl.max(fs.index(rs * 4 + ca).load(ROWL), axis=0)
        fb = gl.max(fs.index(rs * 4 + cb).load(ROWL), axis=0)
        qh = gl.convert_layout(q0, gl.SliceLayout(1, HACC))
        p0 = _half_scores(q_hi, q_lo, q_r, raw_codes, raw_rope, sc, rs, qh, fa, fb, 0, ca, cb, ROPE, HACC, HACC16)
        p1 = _half_scores(q_hi, q_lo, q_r, raw_codes, raw_rope, sc, rs, qh, fa, fb, 1, ca, cb, ROPE, HACC, HACC16)
        # [rows, 2, 32] → [rows, 64]: each thread holds the same keys of both halves as of the whole (column 8j + …
        # with j's top bit the half), so this only renames registers
        BM: gl.constexpr = p0.shape[0]
        part = gl.reshape(gl.permute(gl.join(p0, p1), (0, 2, 1)), [BM, 64])
        return gl.convert_layout(part, SACC), fa, fb

    @gluon.jit
    def _consumer(ROLE: gl.constexpr, shared, s_smem, args, BLOCK_H: gl.constexpr, FOLD: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NR: gl.constexpr, CAUSAL: gl.constexpr,
                  DIRECT: gl.constexpr, PROBE: gl.constexpr):
        """Consumer ROLE: latent chunks 2·ROLE and 2·ROLE + 1 (ROLE 1 also the rope part) of every key block:
        partial scores, the swap, the softmax (the same in both), Pᵀ·scale/f in two e4m3 terms for its chunks,
        Oᵀ += Vᵀ·Pᵀ with Vᵀ from the stage's codes in registers; the stage is handed back once both
        chunks' Vᵀ are loaded. Stores its chunks' columns of the output (consumer 0 also the log-sum-exp)."""
        (codes_desc, rope_desc, scale_desc, BT, stride_btb, b, start, end, n_blocks,
         q_hi, q_lo, q_r, qs, raw_codes, raw_rope, raw_scales, sc, fs, p8, bars) = shared
        (Q, MID_O, MID_LSE, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_mob, stride_mos, stride_moh,
         stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
         scale_log2, S, H, g, seq_len) = args
        RAW_FREE: gl.constexpr = NR
        KV_READY: gl.constexpr = 2 * NR
        Q_READY: gl.constexpr = 3 * NR
        S_READY: gl.constexpr = 3 * NR + 1
        S_READ: gl.constexpr = 3 * NR + 3
        OTHER: gl.constexpr = 1 - ROLE
        ca: gl.constexpr = 2 * ROLE
        cb: gl.constexpr = 2 * ROLE + 1
        # S [rows, keys] (e4m3 Q·Kᵀ, k 32; the rope's bf16, k 16); Oᵀ [128 columns, rows] (e4m3 P·V, k 32)
        SACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
        OACC8: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 32])
        VT_FRAG: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=OACC8, k_width=4)
        ROWL: gl.constexpr = gl.SliceLayout(1, SACC)
        KEYL: gl.constexpr = gl.SliceLayout(0, SACC)
        OROW: gl.constexpr = gl.SliceLayout(0, OACC8)
        # q's prologue split between the consumers (two chunks each, one scale per row; consumer 0 the rope part)
        M._load_q(Q, q_hi, q_lo, q_r, qs, b, g, H, stride_qb, stride_qs, stride_qh, BLOCK_H, FOLD, BLOCK_M, 512,
                  64, True, True, 2 * ROLE, 2, ROLE == 0, False, True)
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(bars.index(Q_READY))
        mbarrier.wait(bars.index(Q_READY), 0)
        q0 = qs.index(0).load(ROWL)
        limit = Q8._row_limits(seq_len, S, g, FOLD, BLOCK_H, BLOCK_M, CAUSAL, ROWL)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=ROWL)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=ROWL)
        fa_prev = gl.max(gl.full([BLOCK_M], 1.0, gl.float32, layout=ROWL), axis=0)
        fb_prev = fa_prev
        oa = gl.zeros([128, BLOCK_M], gl.float32, layout=OACC8)
        ob = oa
        keys = gl.arange(0, BLOCK_N, layout=KEYL)
        for j in range(n_blocks):
            rs = j % NR
            mbarrier.wait(bars.index(KV_READY + rs), (j // NR) & 1)
            if PROBE == 1:
                _cta_barrier()
                mbarrier.arrive(bars.index(RAW_FREE + rs))
            else:
                part, fa, fb = _partial_scores(q_hi, q_lo, q_r, raw_codes, raw_rope, sc, fs, rs, q0, ca, cb,
                                               ROLE == 1, SACC)
                if PROBE != 3:  # swap partials: wait until the other consumer has read our previous one
                    mbarrier.wait(bars.index(S_READ + ROLE), (j + 1) & 1, pred=j > 0)
                    s_smem.index(ROLE).store(part)
                    _cta_barrier()
                    mbarrier.arrive(bars.index(S_READY + ROLE))
                    mbarrier.wait(bars.index(S_READY + OTHER), j & 1)
                    s = part + s_smem.index(OTHER).load(SACC)
                    _cta_barrier()
                    mbarrier.arrive(bars.index(S_READ + OTHER))
                else:
                    s = part
                p, alpha, m_i, l_i = G._softmax_rows(s, m_i, l_i, start + j * BLOCK_N + keys, end, limit, scale_log2)
                # Pᵀ·scale/f per chunk in two e4m3 terms (the scales read again: fewer registers live)
                R._store_p(p8, ca, gl.permute(p * gl.expand_dims(sc.index(rs * 4 + ca).load(KEYL), 0), (1, 0)), True)
                R._store_p(p8, cb, gl.permute(p * gl.expand_dims(sc.index(rs * 4 + cb).load(KEYL), 0), (1, 0)), True)
                fence_async_shared()
                _cta_barrier()  # every warp's Pᵀ is stored
                alpha_o = gl.convert_layout(alpha, OROW)
                oa = oa * gl.expand_dims(alpha_o * (fa_prev / fa), 0)
                ob = ob * gl.expand_dims(alpha_o * (fb_prev / fb), 0)
                fa_prev = fa
                fb_prev = fb
                if PROBE != 2:  # Oᵀ += Vᵀ·Pᵀ_hi + Vᵀ·Pᵀ_lo per chunk, Vᵀ from the codes in registers
                    va = R._vt_fragment(raw_codes.index(rs * 4 + ca), R.V_LOAD, VT_FRAG)
                    oa = warpgroup_mma(va, p8.index(ca).permute((1, 0)), oa, is_async=True)
                    oa = warpgroup_mma(va, p8.index(ca + 4).permute((1, 0)), oa, is_async=True)
                    vb = R._vt_fragment(raw_codes.index(rs * 4 + cb), R.V_LOAD, VT_FRAG)
                    _cta_barrier()  # every warp has read the stage
                    mbarrier.arrive(bars.index(RAW_FREE + rs))
                    ob = warpgroup_mma(vb, p8.index(cb).permute((1, 0)), ob, is_async=True)
                    ob = warpgroup_mma(vb, p8.index(cb + 4).permute((1, 0)), ob, is_async=True)
                    oa, ob = warpgroup_mma_wait(num_outstanding=0, deps=(oa, ob))
                else:
                    _cta_barrier()
                    mbarrier.arrive(bars.index(RAW_FREE + rs))
        oa = oa * fa_prev
        ob = ob * fb_prev
        m_o = gl.convert_layout(m_i, OROW)
        l_o = gl.convert_layout(l_i, OROW)
        Q8._store_out(oa, m_o, l_o, b, g, H, MID_O, MID_LSE, OUT, LSE, stride_mob, stride_mos, stride_moh, stride_mosp,
                      stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
                      BLOCK_H, FOLD, BLOCK_M, 512, ca * 128, 128, ROLE == 0, DIRECT, 3, OACC8)
        Q8._store_out(ob, m_o, l_o, b, g, H, MID_O, MID_LSE, OUT, LSE, stride_mob, stride_mos, stride_moh, stride_mosp,
                      stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
                      BLOCK_H, FOLD, BLOCK_M, 512, cb * 128, 128, False, DIRECT, 3, OACC8)

    @gluon.jit
    def _mla_decode_fp8fold_kernel(
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
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, SW: gl.constexpr,
        ROPE_I8: gl.constexpr, LOADER: gl.constexpr, PROBE: gl.constexpr, SOURCE_KEY: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        b, g, seq_len, start, end = G._program_keys(SEQ, S, NUM_SPLITS, FOLD, BLOCK_N, CAUSAL)
        n_blocks = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
        Q8L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        QR: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        SC: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        P8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
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
        p8 = gl.allocate_shared_memory(gl.float8e4nv, [8, BLOCK_M, BLOCK_N], P8)  # Pᵀ·scale/f: [term · 4 + chunk]
        s_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        # [0, NR) bytes landed, [NR, 2NR) stage read by both consumers, [2NR, 3NR) stage prepared, 3NR q ready (both
        # consumers), then S_READY and S_READ per consumer
        n_bars: gl.constexpr = 3 * NR + 5
        bars = gl.allocate_shared_memory(gl.int64, [n_bars, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(n_bars):
            mbarrier.init(bars.index(i), count=2 if (NR <= i and i < 2 * NR) or i == 3 * NR else 1)
        fence_async_shared()
        shared = (codes_desc, rope_desc, scale_desc, BT, stride_btb, b, start, end, n_blocks,
                  q_hi, q_lo, q_r, qs, raw_codes, raw_rope, raw_scales, sc, fs, p8, bars)
        args = (Q, MID_O, MID_LSE, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_mob, stride_mos, stride_moh,
                stride_mosp, stride_mlb, stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb,
                stride_ls, scale_log2, S, H, g, seq_len)
        if LOADER:
            gl.warp_specialize([
                (_consumer, (0, shared, s_smem, args, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, NR, CAUSAL, DIRECT, PROBE)),
                (_consumer, (1, shared, s_smem, args, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, NR, CAUSAL, DIRECT, PROBE)),
                (R._producer, (shared, PAGE_SIZE, BLOCK_N, BLOCK_M, NR, 1, SW, False, False, ROPE_I8, False)),
                (R._loader, (shared, PAGE_SIZE, BLOCK_N, NR, SW, ROPE_I8)),
            ], [4, 4, 1], [CONSUMER_REGS, PRODUCER_REGS, LOADER_REGS])
        else:  # the producer refills the stage of the block before the one it hands over
            gl.warp_specialize([
                (_consumer, (0, shared, s_smem, args, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, NR, CAUSAL, DIRECT, PROBE)),
                (_consumer, (1, shared, s_smem, args, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, NR, CAUSAL, DIRECT, PROBE)),
                (R._producer, (shared, PAGE_SIZE, BLOCK_N, BLOCK_M, NR, 1, SW, False, True, ROPE_I8, False)),
            ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def fp8fold_supported(q: torch.Tensor, kv_cache: torch.Tensor, dc: int, block_m: int, kv_format: str) -> bool:
    """Whether this kernel takes an fp8-cache call of block_m rows: 17 to 64 rows (16 go to the 16-row kernel),
    fp8 (608-byte) or fp8_ds_mla (656-byte) rows under the 16-row kernel's conditions for either."""
    if not 16 < block_m <= BLOCK_M or kv_format not in ("fp8", "fp8_ds_mla"):
        return False
    row_bytes = R.ROPE_INT8_ROW_BYTES if kv_format == "fp8" else Q8.ROW_BYTES["fp8_ds_mla"]
    return Q8.hopper_rows_supported(q, kv_cache, dc, row_bytes) and kv_cache.shape[1] % BLOCK_N == 0


def launch_fp8fold_split(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2, cfg, *,
                         causal: bool, direct: bool, num_splits: int, kv_format: str):
    """Stage 1 of `mla_decode_triton` for an fp8 or fp8_ds_mla cache, cfg's rows (FOLD tokens × BLOCK_H heads) in one
    64-row program (grid, split rule and outputs as the other kernels)."""
    rope_i8 = kv_format == "fp8"
    scale_words = 8 if rope_i8 else R.SCALE_WORDS
    grid, args, consts = M.tma_launch_args(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2,
                                           cfg, causal=causal, direct=direct, num_splits=num_splits, block_m=BLOCK_M,
                                           scale_words=scale_words,
                                           views=R._rope_int8_descriptors(kv_cache) if rope_i8 else None)
    _mla_decode_fp8fold_kernel[grid](*args, **consts, NR=NUM_RAW, CONSUMER_REGS=REGS[0], PRODUCER_REGS=REGS[1],
                                     LOADER_REGS=LOADER_REGS, SW=scale_words, ROPE_I8=rope_i8, LOADER=LOADER,
                                     PROBE=PROBE,
                                     SOURCE_KEY=_SOURCE_KEY, num_warps=4)
