"""Triton MLA decode over the paged latent cache: split-KV + combine, query tokens folded into rows.

Stage 1: one program per (request, query-token group, head block, KV split). Its M rows are F
query tokens × BLOCK_H heads (TokenSpeed's fold: F = the largest divisor of S with F·BLOCK_H ≤ 64,
the fa3_mtp idea), so one pass over the KV pages serves every draft token of the request; each row
keeps its own bottom-right causal limit. Scores = q_c·c_kv + q_r·k_pe, online softmax in base 2,
acc += p·c_kv (fp32 inputs use IEEE fp32 dots, not tf32: the fp32 path is the exact one). It writes the split's
normalised output and its log2-sum-exp.
Stage 2: one program per (request, query token, head, 128 output columns) merges the splits.

The number of splits comes from shapes only (B, S, H, SM count, the block table's capacity), never
from the device-side lengths, so there is no host synchronisation, the workspace has a fixed size,
and the pair of launches can be captured in a CUDA graph. Each program derives its KV range from
the request's actual length on the device.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from specmla.ops.decode.hopper import common as mla_decode_gluon
from specmla.ops.decode.hopper import fp8 as mla_decode_gluon_fp8reg
from specmla.ops.decode.hopper import dequant as mla_decode_gluon_quant
from specmla.ops.decode.hopper import tbq4 as mla_decode_gluon_tbq4reg
from specmla.ops.kv_cache import tbq4
from specmla.ops.kv_cache import FP8_FORMATS, rope_offset, rope_scales_offset
from specmla.ops.online_softmax import (online_softmax_finish, online_softmax_step, split_merge_weights,
                                        split_merge_weights_two)
from specmla.ops.kv_cache.rotation import combine_rotate, rotate_rows

LOG2E = 1.4426950408889634
MAX_ROWS = 64  # rows (folded tokens × heads) per program


@triton.jit
def _per_block(x, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """[BLOCK_N, NB] per-block scalars → [BLOCK_N, NB·128], each repeated over its block's columns."""
    return tl.reshape(tl.broadcast_to(tl.expand_dims(x, 2), (BLOCK_N, NB, 128)), (BLOCK_N, NB * 128))


TBQ4_LUT_ASM = tl.constexpr(tbq4.centroid_lookup_ptx(scaled=True))  # centroid · norm, 8 bf16 values per word


@triton.jit
def _block_rows(BT, b, stride_btb, n0, end, offs_n0, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Page ids and in-page rows of the key block starting at n0, and which of its keys lie before
    `end`. A block inside one page loads one page id (contiguous rows); nothing of the table is
    read past `end` (the prefetch of the block after the last)."""
    offs_n = n0 + offs_n0
    n_ok = offs_n < end
    if PAGE_SIZE % BLOCK_N == 0:
        page = tl.load(BT + b * stride_btb + n0 // PAGE_SIZE, mask=n0 < end, other=0).to(tl.int64)
        tok = n0 % PAGE_SIZE + offs_n0
    else:
        page = tl.load(BT + b * stride_btb + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        tok = offs_n % PAGE_SIZE
    return page, tok, n_ok


@triton.jit
def _load_quant_block(KV, KVS, page, tok, n_ok, stride_kvp, stride_kvt, stride_ksp, stride_kst,
                      DC: tl.constexpr, DC_PAD: tl.constexpr, FP8: tl.constexpr, KV_ALIGN: tl.constexpr,
                      S_ALIGN: tl.constexpr):
    """The quantised bytes of a key block (`_block_rows`; rows not n_ok read as zeros): fp8 codes
    [BLOCK_N, Dc] with their per-128 fp32 scales, or tbq4 code words [BLOCK_N, Dc/8] (int32, 8
    codes each) with their per-128 fp16 norms. Aligned row starts (KV_ALIGN / S_ALIGN elements)
    let the loads vectorise."""
    row = tl.multiple_of(page * stride_kvp + tok * stride_kvt, KV_ALIGN)
    width: tl.constexpr = DC if FP8 else DC // 8
    offs = tl.arange(0, DC_PAD if FP8 else DC_PAD // 8)
    codes = tl.load(KV + row[:, None] + offs[None, :], mask=n_ok[:, None] & (offs < width)[None, :], other=0)
    offs_b = tl.arange(0, DC_PAD // 128)
    s_row = tl.multiple_of(page * stride_ksp + tok * stride_kst + DC // 4, S_ALIGN)  # scales / norms follow the codes
    side = tl.load(KVS + s_row[:, None] + offs_b[None, :], mask=n_ok[:, None] & (offs_b < DC // 128)[None, :],
                   other=0.0)
    return codes, side


@triton.jit
def _fp8_values(codes, scale, BLOCK_N: tl.constexpr, DC_PAD: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """[BLOCK_N, DC_PAD] e4m3 codes × their 128-block's scale, in OUT_DTYPE."""
    return (codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _per_block(scale, BLOCK_N, DC_PAD // 128)
            ).to(OUT_DTYPE)


@triton.jit
def _tbq4_values(words, norms, CENT, BLOCK_N: tl.constexpr, DC_PAD: tl.constexpr, LUT_ASM: tl.constexpr,
                 OUT_DTYPE: tl.constexpr):
    """Eight [BLOCK_N, DC_PAD/8] tiles: tile k holds coordinate 8w + k of every word w, as
    centroid · block norm in the rotated domain — the PTX table lookup on the GPU (bf16), a centroid
    gather elsewhere. They stay eight tiles: interleaving them back into column order made a
    register layout whose shared-memory stores conflicted (measured: 50 M of 68 M store wavefronts
    at B=32, T=32k); the kernel reads q's columns 8w + k instead."""
    NW: tl.constexpr = DC_PAD // 8
    norm = tl.reshape(tl.broadcast_to(tl.expand_dims(norms, 2), (BLOCK_N, DC_PAD // 128, 16)), (BLOCK_N, NW))
    if LUT_ASM:
        nb = norm.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
        n2 = (nb | (nb << 16)).to(tl.int32, bitcast=True)
        o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
            TBQ4_LUT_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, n2],
            dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
                   tl.bfloat16), is_pure=True, pack=1)
    else:
        nf = norm.to(tl.float32)
        o0 = (tl.load(CENT + (words & 0xF)) * nf).to(OUT_DTYPE)
        o1 = (tl.load(CENT + ((words >> 4) & 0xF)) * nf).to(OUT_DTYPE)
        o2 = (tl.load(CENT + ((words >> 8) & 0xF)) * nf).to(OUT_DTYPE)
        o3 = (tl.load(CENT + ((words >> 12) & 0xF)) * nf).to(OUT_DTYPE)
        o4 = (tl.load(CENT + ((words >> 16) & 0xF)) * nf).to(OUT_DTYPE)
        o5 = (tl.load(CENT + ((words >> 20) & 0xF)) * nf).to(OUT_DTYPE)
        o6 = (tl.load(CENT + ((words >> 24) & 0xF)) * nf).to(OUT_DTYPE)
        o7 = (tl.load(CENT + ((words >> 28) & 0xF)) * nf).to(OUT_DTYPE)
    return o0, o1, o2, o3, o4, o5, o6, o7


@triton.jit
def _program_rows(SEQ, S, H, NUM_SPLITS, BLOCK_H: tl.constexpr, FOLD: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """This program's request b, its rows (FOLD query tokens × BLOCK_H heads: s_idx, h_idx, row_ok),
    its share [start, end) of the request's keys in whole BLOCK_N blocks, and each row's causal
    limit (a row sees positions < limit)."""
    pid_bg = tl.program_id(0)
    n_groups = S // FOLD
    b = pid_bg // n_groups
    g = pid_bg % n_groups
    rows = tl.arange(0, BLOCK_M)
    s_idx = g * FOLD + rows // BLOCK_H
    h_idx = tl.program_id(1) * BLOCK_H + rows % BLOCK_H
    row_ok = (rows < FOLD * BLOCK_H) & (h_idx < H)
    seq_len = tl.load(SEQ + b)
    n_blocks = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(n_blocks, NUM_SPLITS)
    start = tl.program_id(2) * per_split * BLOCK_N
    end = tl.minimum(start + per_split * BLOCK_N, seq_len)
    if CAUSAL:
        limit = seq_len - S + s_idx + 1
        end = tl.minimum(end, seq_len - S + g * FOLD + FOLD)
    else:
        limit = tl.zeros([BLOCK_M], dtype=tl.int32) + seq_len
    return b, s_idx, h_idx, row_ok, start, end, limit


@triton.jit
def _store_rows(out, cols, col_ok, b, s_idx, h_idx, row_ok, MID_O, OUT,
                stride_mob, stride_mos, stride_moh, stride_mosp, stride_ob, stride_os, stride_oh,
                DIRECT: tl.constexpr):
    """The finished rows' columns `cols`: the final output (a single split) or this split's partial."""
    mask = row_ok[:, None] & col_ok[None, :]
    if DIRECT:
        o_ptr = OUT + b * stride_ob + s_idx * stride_os + h_idx * stride_oh
        tl.store(o_ptr[:, None] + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)
    else:
        mo = MID_O + b * stride_mob + s_idx * stride_mos + h_idx * stride_moh + tl.program_id(2) * stride_mosp
        tl.store(mo[:, None] + cols[None, :], out, mask=mask)


@triton.jit
def _store_lse(lse, b, s_idx, h_idx, row_ok, MID_LSE, LSE, stride_mlb, stride_mls, stride_mlh, stride_lb,
               stride_ls, DIRECT: tl.constexpr):
    if DIRECT:  # natural log for the caller; partials stay in log2 for the combine
        tl.store(LSE + b * stride_lb + s_idx * stride_ls + h_idx, lse / 1.4426950408889634, mask=row_ok)
    else:
        tl.store(MID_LSE + b * stride_mlb + s_idx * stride_mls + h_idx * stride_mlh + tl.program_id(2), lse,
                 mask=row_ok)


@triton.jit
def _mla_decode_split_kernel(
    Q, KV, KVS, KVR, BT, SEQ, MID_O, MID_LSE, OUT, LSE,
    stride_qb, stride_qs, stride_qh,
    stride_kvp, stride_kvt,
    stride_ksp, stride_kst, stride_krp, stride_krt,
    stride_btb,
    stride_mob, stride_mos, stride_moh, stride_mosp,
    stride_mlb, stride_mls, stride_mlh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_ls,
    scale_log2,
    S, H, NUM_SPLITS,
    PAGE_SIZE: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr, DC_PAD: tl.constexpr, DR_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, FOLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, DIRECT: tl.constexpr, FP8: tl.constexpr,
    PREFETCH: tl.constexpr = False, ROPE_AT: tl.constexpr = 0,
    KV_ALIGN: tl.constexpr = 1, S_ALIGN: tl.constexpr = 1, R_ALIGN: tl.constexpr = 1,
    ROPE_I8: tl.constexpr = False, RS_AT: tl.constexpr = 0,
):
    """Native (bf16/fp16/fp32) rows, or fp8 rows dequantised in registers (FP8); ROPE_I8 (608-byte fp8 rows): the
    rope in int8 (KVR the int8 view, ROPE_AT in bytes) with one fp16 scale per 8 values at word RS_AT of KVS."""
    b, s_idx, h_idx, row_ok, start, end, limit = _program_rows(SEQ, S, H, NUM_SPLITS, BLOCK_H, FOLD, BLOCK_M,
                                                              BLOCK_N, CAUSAL)
    # Dc/Dr that are not powers of two are padded to one (DC_PAD/DR_PAD) and masked
    offs_c = tl.arange(0, DC_PAD)
    offs_r = tl.arange(0, DR_PAD)
    c_ok = offs_c < DC
    r_ok = offs_r < DR
    q_row = Q + b * stride_qb + s_idx * stride_qs + h_idx * stride_qh
    q_c = tl.load(q_row[:, None] + offs_c[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0.0)
    q_r = tl.load(q_row[:, None] + DC + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DC_PAD], dtype=tl.float32)
    offs_n0 = tl.arange(0, BLOCK_N)
    if FP8 and PREFETCH:
        page_nx, tok_nx, ok_nx = _block_rows(BT, b, stride_btb, start, end, offs_n0, PAGE_SIZE, BLOCK_N)
        codes_nx, scale_nx = _load_quant_block(KV, KVS, page_nx, tok_nx, ok_nx, stride_kvp, stride_kvt, stride_ksp,
                                            stride_kst, DC, DC_PAD, True, KV_ALIGN, S_ALIGN)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_n0
        page, tok, n_ok = _block_rows(BT, b, stride_btb, n0, end, offs_n0, PAGE_SIZE, BLOCK_N)
        kv_row = KV + page * stride_kvp + tok * stride_kvt
        if FP8:
            if PREFETCH:  # this block's bytes were loaded during the previous block; fetch the next
                codes, scale = codes_nx, scale_nx
                page_nx, tok_nx, ok_nx = _block_rows(BT, b, stride_btb, n0 + BLOCK_N, end, offs_n0, PAGE_SIZE,
                                                     BLOCK_N)
                codes_nx, scale_nx = _load_quant_block(KV, KVS, page_nx, tok_nx, ok_nx, stride_kvp, stride_kvt,
                                                    stride_ksp, stride_kst, DC, DC_PAD, True, KV_ALIGN, S_ALIGN)
            else:
                codes, scale = _load_quant_block(KV, KVS, page, tok, n_ok, stride_kvp, stride_kvt, stride_ksp,
                                              stride_kst, DC, DC_PAD, True, KV_ALIGN, S_ALIGN)
            k_c = _fp8_values(codes, scale, BLOCK_N, DC_PAD, Q.dtype.element_ty)
            r_row = tl.multiple_of(page * stride_krp + tok * stride_krt + ROPE_AT, R_ALIGN)
            k_r = tl.load(KVR + r_row[:, None] + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0)
            if ROPE_I8:  # each group of 8 values × its fp16 scale (two per 32-bit word of KVS)
                offs_g = tl.arange(0, DR_PAD // 8)
                s_row = page * stride_ksp + tok * stride_kst + RS_AT
                words = tl.load(KVS + s_row[:, None] + (offs_g // 2)[None, :],
                                mask=n_ok[:, None] & (offs_g < DR // 8)[None, :], other=0.0).to(tl.uint32, bitcast=True)
                half = (words >> (offs_g % 2 * 16).to(tl.uint32)[None, :]) & 0xFFFF
                scale = half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
                k_r = tl.reshape(tl.reshape(k_r.to(tl.float32), [BLOCK_N, DR_PAD // 8, 8]) * scale[:, :, None],
                                 [BLOCK_N, DR_PAD])
            k_r = k_r.to(Q.dtype.element_ty)
        else:
            if DC_PAD == DC:
                k_c = tl.load(kv_row[:, None] + offs_c[None, :], mask=n_ok[:, None], other=0.0)
            else:
                k_c = tl.load(kv_row[:, None] + offs_c[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0)
            if DR_PAD == DR:
                k_r = tl.load(kv_row[:, None] + DC + offs_r[None, :], mask=n_ok[:, None], other=0.0)
            else:
                k_r = tl.load(kv_row[:, None] + DC + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :],
                              other=0.0)
        qk = tl.dot(q_c, tl.trans(k_c), input_precision=PRECISION)
        qk = tl.dot(q_r, tl.trans(k_r), qk, input_precision=PRECISION)
        qk = qk * scale_log2
        visible = n_ok[None, :] & (offs_n[None, :] < limit[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(qk, m_i, l_i)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(k_c.dtype), k_c, acc, input_precision=PRECISION)

    out, lse = online_softmax_finish(acc, m_i, l_i)
    _store_rows(out, offs_c, c_ok, b, s_idx, h_idx, row_ok, MID_O, OUT, stride_mob, stride_mos, stride_moh,
                stride_mosp, stride_ob, stride_os, stride_oh, DIRECT)
    _store_lse(lse, b, s_idx, h_idx, row_ok, MID_LSE, LSE, stride_mlb, stride_mls, stride_mlh, stride_lb, stride_ls,
               DIRECT)


@triton.jit
def _mla_decode_split_tbq4_kernel(
    Q, KV, KVS, KVR, CENT, BT, SEQ, MID_O, MID_LSE, OUT, LSE,
    stride_qb, stride_qs, stride_qh,
    stride_kvp, stride_kvt,
    stride_ksp, stride_kst, stride_krp, stride_krt,
    stride_btb,
    stride_mob, stride_mos, stride_moh, stride_mosp,
    stride_mlb, stride_mls, stride_mlh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_ls,
    scale_log2,
    S, H, NUM_SPLITS,
    PAGE_SIZE: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr, DC_PAD: tl.constexpr, DR_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, FOLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, DIRECT: tl.constexpr,
    PREFETCH: tl.constexpr = False, LUT_ASM: tl.constexpr = False, ROPE_AT: tl.constexpr = 0,
    KV_ALIGN: tl.constexpr = 1, S_ALIGN: tl.constexpr = 1, R_ALIGN: tl.constexpr = 1,
):
    """tbq4 rows (KV = the cache as int32 words, 8 codes each), attention in the rotated domain.
    Code k of word w is rotated coordinate 8w + k; the kernel keeps the eight code positions as
    eight key tiles and eight accumulators against q's columns 8w + k (see `_tbq4_values`)."""
    b, s_idx, h_idx, row_ok, start, end, limit = _program_rows(SEQ, S, H, NUM_SPLITS, BLOCK_H, FOLD, BLOCK_M,
                                                              BLOCK_N, CAUSAL)
    offs_w = tl.arange(0, DC_PAD // 8)
    w_ok = offs_w < DC // 8
    offs_r = tl.arange(0, DR_PAD)
    r_ok = offs_r < DR
    q_row = Q + b * stride_qb + s_idx * stride_qs + h_idx * stride_qh
    q_mask = row_ok[:, None] & w_ok[None, :]
    q_at = q_row[:, None] + 8 * offs_w[None, :]
    q0 = tl.load(q_at, mask=q_mask, other=0.0)
    q1 = tl.load(q_at + 1, mask=q_mask, other=0.0)
    q2 = tl.load(q_at + 2, mask=q_mask, other=0.0)
    q3 = tl.load(q_at + 3, mask=q_mask, other=0.0)
    q4 = tl.load(q_at + 4, mask=q_mask, other=0.0)
    q5 = tl.load(q_at + 5, mask=q_mask, other=0.0)
    q6 = tl.load(q_at + 6, mask=q_mask, other=0.0)
    q7 = tl.load(q_at + 7, mask=q_mask, other=0.0)
    q_r = tl.load(q_row[:, None] + DC + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_M, DC_PAD // 8], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, DC_PAD // 8], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, DC_PAD // 8], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_M, DC_PAD // 8], dtype=tl.float32)
    acc4 = tl.zeros([BLOCK_M, DC_PAD // 8], dtype=tl.float32)
    acc5 = tl.zeros([BLOCK_M, DC_PAD // 8], dtype=tl.float32)
    acc6 = tl.zeros([BLOCK_M, DC_PAD // 8], dtype=tl.float32)
    acc7 = tl.zeros([BLOCK_M, DC_PAD // 8], dtype=tl.float32)
    offs_n0 = tl.arange(0, BLOCK_N)
    if PREFETCH:
        page_nx, tok_nx, ok_nx = _block_rows(BT, b, stride_btb, start, end, offs_n0, PAGE_SIZE, BLOCK_N)
        words_nx, norms_nx = _load_quant_block(KV, KVS, page_nx, tok_nx, ok_nx, stride_kvp, stride_kvt, stride_ksp,
                                            stride_kst, DC, DC_PAD, False, KV_ALIGN, S_ALIGN)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_n0
        page, tok, n_ok = _block_rows(BT, b, stride_btb, n0, end, offs_n0, PAGE_SIZE, BLOCK_N)
        if PREFETCH:
            words, norms = words_nx, norms_nx
            page_nx, tok_nx, ok_nx = _block_rows(BT, b, stride_btb, n0 + BLOCK_N, end, offs_n0, PAGE_SIZE,
                                                 BLOCK_N)
            words_nx, norms_nx = _load_quant_block(KV, KVS, page_nx, tok_nx, ok_nx, stride_kvp, stride_kvt,
                                                stride_ksp, stride_kst, DC, DC_PAD, False, KV_ALIGN, S_ALIGN)
        else:
            words, norms = _load_quant_block(KV, KVS, page, tok, n_ok, stride_kvp, stride_kvt, stride_ksp,
                                          stride_kst, DC, DC_PAD, False, KV_ALIGN, S_ALIGN)
        k0, k1, k2, k3, k4, k5, k6, k7 = _tbq4_values(words, norms, CENT, BLOCK_N, DC_PAD, LUT_ASM,
                                                      Q.dtype.element_ty)
        r_row = tl.multiple_of(page * stride_krp + tok * stride_krt + ROPE_AT, R_ALIGN)
        k_r = tl.load(KVR + r_row[:, None] + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :],
                      other=0.0).to(Q.dtype.element_ty)
        qk = tl.dot(q_r, tl.trans(k_r), input_precision=PRECISION)
        qk = tl.dot(q0, tl.trans(k0), qk, input_precision=PRECISION)
        qk = tl.dot(q1, tl.trans(k1), qk, input_precision=PRECISION)
        qk = tl.dot(q2, tl.trans(k2), qk, input_precision=PRECISION)
        qk = tl.dot(q3, tl.trans(k3), qk, input_precision=PRECISION)
        qk = tl.dot(q4, tl.trans(k4), qk, input_precision=PRECISION)
        qk = tl.dot(q5, tl.trans(k5), qk, input_precision=PRECISION)
        qk = tl.dot(q6, tl.trans(k6), qk, input_precision=PRECISION)
        qk = tl.dot(q7, tl.trans(k7), qk, input_precision=PRECISION)
        qk = qk * scale_log2
        visible = n_ok[None, :] & (offs_n[None, :] < limit[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(qk, m_i, l_i)
        p = p.to(k0.dtype)
        acc0 = tl.dot(p, k0, acc0 * alpha[:, None], input_precision=PRECISION)
        acc1 = tl.dot(p, k1, acc1 * alpha[:, None], input_precision=PRECISION)
        acc2 = tl.dot(p, k2, acc2 * alpha[:, None], input_precision=PRECISION)
        acc3 = tl.dot(p, k3, acc3 * alpha[:, None], input_precision=PRECISION)
        acc4 = tl.dot(p, k4, acc4 * alpha[:, None], input_precision=PRECISION)
        acc5 = tl.dot(p, k5, acc5 * alpha[:, None], input_precision=PRECISION)
        acc6 = tl.dot(p, k6, acc6 * alpha[:, None], input_precision=PRECISION)
        acc7 = tl.dot(p, k7, acc7 * alpha[:, None], input_precision=PRECISION)

    accs = (acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7)
    for k in tl.static_range(8):  # accumulator k holds the output's columns 8w + k
        out, lse = online_softmax_finish(accs[k], m_i, l_i)
        _store_rows(out, 8 * offs_w + k, w_ok, b, s_idx, h_idx, row_ok, MID_O, OUT, stride_mob, stride_mos,
                    stride_moh, stride_mosp, stride_ob, stride_os, stride_oh, DIRECT)
    _store_lse(lse, b, s_idx, h_idx, row_ok, MID_LSE, LSE, stride_mlb, stride_mls, stride_mlh, stride_lb, stride_ls,
               DIRECT)


@triton.jit
def _mla_decode_combine_kernel(
    MID_O, MID_LSE, OUT, LSE, HELP_O, HELP_LSE,
    stride_mob, stride_mos, stride_moh, stride_mosp,
    stride_mlb, stride_mls, stride_mlh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_ls,
    S, H, NUM_SPLITS,
    DC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
    HELPERS: tl.constexpr = False,
):
    """One program per (request·token, head, BLOCK_D columns). Columns are split only when B·S·H
    alone would leave SMs idle (B=1 decodes split the most); otherwise one program per row.
    HELPERS (`mla_decode_gluon_fp8reg`'s STEAL): each split may also have a helper's partial, HELP_O / HELP_LSE
    shaped as a contiguous workspace; −inf where none (those partials are not read)."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    d0 = tl.program_id(2) * BLOCK_D
    b = pid // S
    s = pid % S
    lse_base = MID_LSE + b * stride_mlb + s * stride_mls + h * stride_mlh
    offs_sp = tl.arange(0, BLOCK_SPLITS)
    lse = tl.load(lse_base + offs_sp, mask=offs_sp < NUM_SPLITS, other=float("-inf"))
    help_row = ((b * S + s) * H + h) * NUM_SPLITS
    if HELPERS:
        lse_h = tl.load(HELP_LSE + help_row + offs_sp, mask=offs_sp < NUM_SPLITS, other=float("-inf"))
        m_safe, inv_total, lse2 = split_merge_weights_two(lse, lse_h)
    else:
        m_safe, inv_total, lse2 = split_merge_weights(lse, 0)
    base = MID_O + b * stride_mob + s * stride_mos + h * stride_moh
    offs_d = d0 + tl.arange(0, BLOCK_D)
    d_ok = offs_d < DC
    offs_c = tl.arange(0, SPLIT_CHUNK)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for sp0 in range(0, NUM_SPLITS, SPLIT_CHUNK):  # a few splits per step: loads in flight together
        sp = sp0 + offs_c
        ok = sp < NUM_SPLITS
        w = tl.exp2(tl.load(lse_base + sp, mask=ok, other=float("-inf")) - m_safe) * inv_total
        o = tl.load(base + sp[:, None] * stride_mosp + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(o * w[:, None], 0)
        if HELPERS:  # the helpers' partials, where there are any
            lse_h = tl.load(HELP_LSE + help_row + sp, mask=ok, other=float("-inf"))
            has = lse_h > float("-inf")
            o = tl.load(HELP_O + (help_row + sp)[:, None] * DC + offs_d[None, :], mask=has[:, None] & d_ok[None, :],
                        other=0.0)
            acc += tl.sum(o * (tl.exp2(lse_h - m_safe) * inv_total)[:, None], 0)
    tl.store(OUT + b * stride_ob + s * stride_os + h * stride_oh + offs_d, acc.to(OUT.dtype.element_ty), mask=d_ok)
    if d0 == 0:
        tl.store(LSE + b * stride_lb + s * stride_ls + h, lse2 / 1.4426950408889634)  # natural log


def _e4m3_kernel_takes(q, kv_cache, dc: int, block_m: int, kv_format: str) -> bool:
    """Whether the 16-row e4m3 Gluon kernel of `kv_format` (fp8 / fp8_ds_mla: `hopper.fp8`, tbq4: `hopper.tbq4`)
    takes this call."""
    if kv_format in FP8_FORMATS:
        return dc == 512 and mla_decode_gluon_fp8reg.supported(q, kv_cache, kv_format, block_m)
    return kv_format == "tbq4" and dc == 512 and mla_decode_gluon_tbq4reg.supported(q, kv_cache, kv_format, block_m)


def _quant_auto_takes(cfg: dict) -> bool:
    """Whether `mla_decode_triton(gluon=None)` sends a supported fp8 / tbq4 call to the Gluon kernels rather than to
    the Triton kernel: splits of at least two key blocks, and the Gluon kernels' AUTO on."""
    return mla_decode_gluon.AUTO and cfg["keys_per_split"] >= 2 * mla_decode_gluon_quant.BLOCK_N


def fold_factor(S: int, block_h: int, max_rows: int = MAX_ROWS) -> int:
    """Largest F dividing S with F·block_h ≤ max_rows (TokenSpeed's rule)."""
    for f in range(S, 0, -1):
        if S % f == 0 and f * block_h <= max_rows:
            return f
    return 1


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


# quantised formats whose S > 1 calls (H ≤ 16) run one query token per program on the 16-row e4m3 Gluon kernels
UNFOLDED_FORMATS = ("fp8", "fp8_ds_mla", "tbq4")
TBQ4_COMBINE_ROTATE = True  # tbq4: the split combine also rotates the output back (else a kernel of its own)
SMEM_BUDGET = 224 * 1024  # estimate (stages·block_n·d + block_m·d)·elem overcounts Triton's use a little


def default_tiles(block_m: int, d: int, elem: int, kv_format: str = "auto") -> dict:
    """Tile/pipeline choice measured best on H100 (docs/benchmarks.md), shrunk until the K-tile
    pipeline (stages × block_n × d) plus the query tile fits the shared-memory budget. tbq4's
    small tiles (≤ 32 rows) do best unpipelined: only the rope part rides the pipeline, and the
    stages' shared memory costs occupancy (benchmarks/quant_probe.py)."""
    if block_m >= 64:
        block_n, warps, stages = 64, 8, 2
    elif kv_format == "tbq4":
        block_n, warps, stages = 32, 4, 1
    else:
        block_n, warps, stages = 32, 4, 5
    while stages * block_n * d * elem + block_m * d * elem > SMEM_BUDGET and (stages > 1 or block_n > 16):
        if stages > 2:
            stages -= 1
        elif block_n > 16:
            block_n //= 2
        else:
            stages -= 1
    return dict(block_n=block_n, num_warps=warps, num_stages=stages)


def plan(B: int, S: int, H: int, max_seq_len: int, device: torch.device, block_n: int = 32,
         max_rows: int = MAX_ROWS, waves: int | None = None) -> dict:
    """Tile shapes and the split count, from shapes only (no device data read). `waves`: how many
    waves of programs to fill (default: the Triton kernel's measured rule below)."""
    block_h = min(max_rows, triton.next_power_of_2(H))
    fold = fold_factor(S, block_h, max_rows)
    block_m = max(16, triton.next_power_of_2(fold * block_h))
    head_blocks = triton.cdiv(H, block_h)
    programs = B * (S // fold) * head_blocks
    # One program per SM at a time (a program's K pipeline takes most of the shared memory), so
    # split only as far as one wave allows: more splits would add a tail wave and partial traffic.
    sms = _sm_count(device)
    max_useful = max(1, triton.cdiv(max_seq_len, block_n))  # at least one KV block per split
    # measured (docs/benchmarks.md): a second wave balances large batches of small (≤ 32-row) tiles;
    # 64-row tiles are compute-heavy and do best in one wave, written directly
    if waves is None:
        waves = 2 if programs >= 32 and block_m < 64 else 1
    splits = max(1, min(waves * sms // programs, max_useful, 128))
    return dict(BLOCK_H=block_h, FOLD=fold, BLOCK_M=block_m, head_blocks=head_blocks, num_splits=splits,
                BLOCK_N=block_n, keys_per_split=triton.cdiv(triton.cdiv(max_seq_len, block_n), splits) * block_n)


def mla_decode_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    *,
    causal: bool = True,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    head_dim_v: int | None = None,
    num_splits: int | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    block_n: int | None = None,
    max_rows: int = MAX_ROWS,
    kv_format: str = "auto",
    prefetch: bool | None = None,
    kv_align: int | None = None,
    gluon: bool | None = None,
):
    """Same contract as `mla_decode_torch`; `workspace` = (mid_o, mid_lse) preallocated for graphs.
    kv_format "fp8" / "fp8_ds_mla" / "tbq4": uint8 rows (`ops.kv_cache`), dequantised in registers inside the
    kernel's loop; `prefetch` (default: on for tiles under 64 rows) loads the next key block's bytes
    while this one computes, since a register-dequantised tile cannot ride the dot's shared-memory
    pipeline. `kv_align` caps the codes' load vector (fp8: 8 bytes by default; 16-byte vectors made
    a register layout whose shared-memory stores conflict). `gluon`: run stage 1 through the Hopper
    Gluon kernels (`ops.mla_decode_gluon`, `ops.mla_decode_seesaw`, fp8 / tbq4: `ops.mla_decode_gluon_quant`);
    None takes them where supported (fp8 / tbq4: where measured faster, `_quant_auto_takes`)."""
    B, S, H, D = q.shape
    dc = D - 64 if head_dim_v is None else head_dim_v
    dr = D - dc
    if dc % 16 or dr % 16:
        raise ValueError(f"Dc={dc} and Dr={dr} must be multiples of 16")
    page_size = kv_cache.shape[1]
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q and kv_cache must be contiguous in their last dimension")
    # the table's width grows with the longest request in eager steps; a power-of-two bucket keeps
    # the split count (and the compiled combine variant) stable instead of changing every few pages
    max_seq = triton.next_power_of_2(block_table.shape[1]) * page_size
    if S > 1 and H <= 16 and gluon is not False and kv_format in UNFOLDED_FORMATS and (
            _e4m3_kernel_takes(q, kv_cache, dc, 16, kv_format)):
        # one query token per program, in the e4m3 kernels' 16 rows: each token's program reads the keys again, and
        # yet it beats the folded rows (H100, B=32 T=32k, S=2: 1.03-1.19× bf16 against 0.35-0.83×; S=4: 0.54-0.62×
        # against 0.45-0.59×; docs/benchmarks.md, issue 7, twentieth session)
        unfolded = plan(B, S, H, max_seq, q.device, mla_decode_gluon_quant.BLOCK_N, 16, waves=1)
        if gluon or _quant_auto_takes(unfolded):  # else the folded rows on Triton
            max_rows = 16
    block_h = min(max_rows, triton.next_power_of_2(H))
    block_m = max(16, triton.next_power_of_2(fold_factor(S, block_h, max_rows) * block_h))
    tiles = default_tiles(block_m, D, max(q.element_size(), kv_cache.element_size()), kv_format)
    gluon_block_n = block_n if block_n in (32, 64) else 64  # the Gluon kernel's key blocks: 64 unless asked
    block_n = block_n or tiles["block_n"]
    cfg = plan(B, S, H, max_seq, q.device, block_n, max_rows)
    if kv_format == "fp8":  # only the fp8 e4m3 kernel reads these rows
        gluon_quant = _e4m3_kernel_takes(q, kv_cache, dc, cfg["BLOCK_M"], kv_format)
    else:
        gluon_quant = dc == 512 and mla_decode_gluon_quant.supported(q, kv_cache, kv_format, cfg["BLOCK_M"])
    supported = gluon_quant or mla_decode_gluon.gluon_decode_supported(q, kv_cache, head_dim_v, kv_format,
                                                                     cfg["BLOCK_M"])
    if gluon and not supported:
        raise ValueError("the Gluon decode kernels take Hopper only: a 16-bit cache with Dc a multiple of 64 up to "
                         "512 and Dr a multiple of 16 up to 64, or an fp8 / tbq4 cache with Dc=512, Dr=64 and ≤ 32 "
                         "rows (fp8: 16 rows)")
    gluon_cfg = None
    if supported:  # one program per SM (shared memory), so one wave of programs, in 64-key blocks
        gluon_cfg = plan(B, S, H, max_seq, q.device, mla_decode_gluon_quant.BLOCK_N if gluon_quant else gluon_block_n,
                         max_rows, waves=1)
    if gluon is None:
        run_gluon = supported and (_quant_auto_takes(gluon_cfg) if gluon_quant
                                   else mla_decode_gluon.AUTO)
    else:
        run_gluon = supported and gluon
    if run_gluon:
        cfg = gluon_cfg
    if num_splits is not None:
        cfg["num_splits"] = num_splits
    ns = cfg["num_splits"]
    if workspace is not None:
        mid_o, mid_lse = workspace
        ns = mid_o.shape[3]
    if out is None:
        out = torch.empty(B, S, H, dc, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, S, H, dtype=torch.float32, device=q.device)
    direct = ns == 1  # stage 1 writes the result itself; no workspace, no combine
    if direct:
        mid_o, mid_lse = out, lse
    elif workspace is None:
        mid_o = torch.empty(B, S, H, ns, dc, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(B, S, H, ns, dtype=torch.float32, device=q.device)
    grid = (B * (S // cfg["FOLD"]), cfg["head_blocks"], ns)
    mo_strides = (0, 0, 0, 0) if direct else mid_o.stride()[:4]
    ml_strides = (0, 0, 0) if direct else mid_lse.stride()[:3]
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    warps, stages = num_warps or tiles["num_warps"], num_stages or tiles["num_stages"]
    fp8, tbq, i8 = kv_format in FP8_FORMATS, kv_format == "tbq4", kv_format == "fp8"
    kv, quant = kv_cache, {}
    if fp8 or tbq:
        if kv_cache.dtype != torch.uint8 or not kv_cache.is_contiguous() or dc % 128:
            raise ValueError(f"the {kv_format} cache must be contiguous uint8 rows with Dc a multiple of 128")
        # the same bytes viewed as codes (fp8: uint8, tbq4: int32 words), scales (fp32) / norms (fp16), rope (bf16;
        # fp8: int8, its scales read through the fp32 view)
        scales = kv_cache.view(torch.float32 if fp8 else torch.float16)
        rope = kv_cache.view(torch.int8 if i8 else torch.bfloat16)
        kv = kv_cache if fp8 else kv_cache.view(torch.int32)
        rope_at = rope_offset(kv_format, dc, dr)  # bytes into the row
        if i8:
            quant = dict(ROPE_I8=True, RS_AT=rope_scales_offset(dc) // 4)
        quant.update(
            # prefetching pays for small row tiles; 64-row tiles have no registers to spare for it
            PREFETCH=block_m < 64 if prefetch is None else prefetch, ROPE_AT=rope_at if i8 else rope_at // 2,
            # kv_align may only lower the hint: the register layout of the loaded codes follows the
            # vector width, and narrower vectors can store the dequantised tile with fewer bank conflicts
            KV_ALIGN=min(kv_align or (8 if fp8 else 16), _aligned_elements(kv, 0)),
            S_ALIGN=_aligned_elements(scales, dc),
            R_ALIGN=_aligned_elements(rope, rope_at))
    elif kv_format not in ("auto", "native", "bf16", "fp16", "fp32"):
        raise ValueError(f"unknown kv_format {kv_format!r}")
    else:
        scales = rope = kv_cache
    if tbq:  # attention runs in the rotated domain: rotate q's latent part once (and the output back)
        q = rotate_rows(q, dc)
        cent = tbq4.centroids(q.device)
        # on the GPU in bf16 the PTX table lookup (the interpreter runs no PTX)
        quant["LUT_ASM"] = q.is_cuda and q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") != "1"
    if run_gluon and gluon_quant and fp8 and _e4m3_kernel_takes(q, kv_cache, dc, cfg["BLOCK_M"], kv_format):
        mla_decode_gluon_fp8reg.launch(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse,
                                       softmax_scale * LOG2E, cfg, causal=causal, num_splits=ns, kv_format=kv_format)
    elif run_gluon and gluon_quant and tbq and _e4m3_kernel_takes(q, kv_cache, dc, cfg["BLOCK_M"], kv_format):
        mla_decode_gluon_tbq4reg.launch(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse,
                                        softmax_scale * LOG2E, cfg, causal=causal, num_splits=ns, kv_format=kv_format)
    elif run_gluon and gluon_quant:
        mla_decode_gluon_quant.launch(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse,
                                      softmax_scale * LOG2E, cfg, causal=causal, num_splits=ns, kv_format=kv_format)
    elif run_gluon:
        mla_decode_gluon.launch_gluon_split(
            q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, softmax_scale * LOG2E, cfg, dc=dc,
            causal=causal, direct=direct, num_splits=ns, block_n=gluon_block_n,
            num_stages=num_stages or 2)
    else:
        if tbq:
            kernel, fmt_args, fmt_flags = _mla_decode_split_tbq4_kernel, (cent,), {}
        else:
            kernel, fmt_args, fmt_flags = _mla_decode_split_kernel, (), dict(FP8=fp8)
        kernel[grid](
            q, kv, scales, rope, *fmt_args, block_table, seq_lens, mid_o, mid_lse, out, lse,
            q.stride(0), q.stride(1), q.stride(2),
            kv.stride(0), kv.stride(1),
            scales.stride(0), scales.stride(1), rope.stride(0), rope.stride(1),
            block_table.stride(0),
            *mo_strides,
            *ml_strides,
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1),
            softmax_scale * LOG2E,
            S, H, ns,
            PAGE_SIZE=page_size, DC=dc, DR=dr, DC_PAD=triton.next_power_of_2(dc), DR_PAD=triton.next_power_of_2(dr),
            BLOCK_H=cfg["BLOCK_H"], FOLD=cfg["FOLD"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=block_n,
            CAUSAL=causal, PRECISION=precision, DIRECT=direct, num_warps=warps, num_stages=stages,
            **fmt_flags, **quant,
        )
    if direct:
        return _finish(out, lse, return_lse, tbq)
    # tbq4: the combine rotates the output back as it merges (one kernel fewer), when its programs (16 heads ×
    # 128 columns each) fill half the SMs: B=32 saves 2.9 µs, while B=4's 16 programs took 9 µs longer
    if (tbq and TBQ4_COMBINE_ROTATE and out.stride(-1) == 1
            and B * S * triton.cdiv(H, 16) * (dc // 128) >= _sm_count(q.device) // 2):
        combine_rotate(mid_o, mid_lse, out, lse)
        return (out, lse) if return_lse else out
    combine_splits(mid_o, mid_lse, out, lse)
    return _finish(out, lse, return_lse, tbq)


def combine_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   helpers: tuple | None = None) -> None:
    """Stage 2: merge the splits' partials mid_o [B, S, H, splits, Dc] (log2-sum-exps mid_lse [B, S, H, splits])
    into out [B, S, H, Dc] and its natural-log lse [B, S, H]; `helpers` = (partials, log2-sum-exps) of the same
    shapes, contiguous, −inf where a split had no helper: the programs that helped with other splits' keys
    (`mla_decode_gluon_fp8reg`'s STEAL) add theirs."""
    B, S, H, ns, dc = mid_o.shape
    # one program per row, unless rows are too few for the SMs: B=1 merges 4 MB of partials, which
    # 64 programs of 128 columns read at half the copy rate (5.7 µs measured); 32 columns give 256
    block_d = triton.next_power_of_2(dc)
    while block_d > 32 and B * S * H * (dc // block_d) < 4 * _sm_count(mid_o.device) and dc % (block_d // 2) == 0:
        block_d //= 2
    help_o, help_lse = helpers or (mid_o, mid_lse)
    if helpers is not None and not (help_o.is_contiguous() and help_lse.is_contiguous()
                                    and help_o.shape == mid_o.shape and help_lse.shape == mid_lse.shape):
        raise ValueError("the helpers' partials must be contiguous and shaped as the workspace")
    _mla_decode_combine_kernel[(B * S, H, triton.cdiv(dc, block_d))](
        mid_o, mid_lse, out, lse, help_o, help_lse,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_o.stride(3),
        mid_lse.stride(0), mid_lse.stride(1), mid_lse.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        S, H, ns,
        DC=dc, BLOCK_D=block_d, BLOCK_SPLITS=max(2, triton.next_power_of_2(ns)),
        SPLIT_CHUNK=max(2, min(triton.next_power_of_2(ns), 4096 // block_d)),  # few, wide steps
        HELPERS=helpers is not None, num_warps=4,
    )


def combine_splits_torch(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                         helpers: tuple | None = None) -> None:
    """Reference for `combine_splits` (same arguments): each row's partials weighed by exp2 of their log2-sum-exps."""
    parts, lses = mid_o.float(), mid_lse.float()
    if helpers is not None:
        help_o, help_lse = helpers
        has = help_lse > float("-inf")
        parts = torch.cat([parts, torch.where(has[..., None], help_o.float(), 0.0)], 3)
        lses = torch.cat([lses, help_lse.float()], 3)
    merged = torch.logsumexp(lses * math.log(2), dim=3)  # natural log
    w = torch.exp(lses * math.log(2) - torch.where(torch.isinf(merged), 0.0, merged)[..., None])
    out.copy_(torch.einsum("bshp,bshpd->bshd", w, parts).to(out.dtype))
    lse.copy_(merged)


def _aligned_elements(view: torch.Tensor, offset_bytes: int, cap: int = 16) -> int:
    """How many elements of `view` every row start (+ offset) is aligned to, up to `cap` bytes:
    a hint that lets Triton vectorise loads of rows whose stride is not a multiple of 16."""
    g = math.gcd(view.data_ptr() + offset_bytes, *(st * view.element_size() for st in view.stride()[:2]))
    return max(1, min(cap, g & -g) // view.element_size())


def _finish(out, lse, return_lse, rotated):
    if rotated:  # tbq4: the output was accumulated in the rotated domain
        rotate_rows(out, out.shape[-1], out=out)
    return (out, lse) if return_lse else out


def decode_bytes(seq_lens_sum: int, B: int, S: int, H: int, D: int = 576, dv: int = 512, elem: int = 2) -> int:
    """FlashMLA's byte count: every cached row once, q in, out back."""
    return (seq_lens_sum * D + B * S * H * (D + dv)) * elem


def decode_flops(seq_lens_sum: int, S: int, H: int, D: int = 576, dv: int = 512) -> float:
    return 2.0 * S * seq_lens_sum * H * (D + dv)


