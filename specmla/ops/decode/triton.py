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

import dataclasses
import math
import os

import torch
import triton
import triton.language as tl

from specmla.ops.kv_cache import FP8_FORMATS, rope_offset, rope_scales_offset, tbq4
from specmla.ops.online_softmax import online_softmax_finish, online_softmax_step, split_merge_weights
from specmla.ops.pdl import launch_dependents, pdl_args, wait

LOG2E = 1.4426950408889634


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
    gather elsewhere. They stay eight tiles: interleaved back into column order they take a register
    layout whose shared-memory stores conflict; the kernel reads q's columns 8w + k instead."""
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
    ROPE_I8: tl.constexpr = False, RS_AT: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    """Native (bf16/fp16/fp32) rows, or fp8 rows dequantised in registers (FP8); ROPE_I8 (608-byte fp8 rows): the
    rope in int8 (KVR the int8 view, ROPE_AT in bytes) with one fp16 scale per 8 values at word RS_AT of KVS."""
    wait(PDL)  # q, the cache, the table and the lengths all come from earlier kernels / copies
    launch_dependents(PDL)
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
    KV_ALIGN: tl.constexpr = 1, S_ALIGN: tl.constexpr = 1, R_ALIGN: tl.constexpr = 1, PDL: tl.constexpr = False,
):
    """tbq4 rows (KV = the cache as int32 words, 8 codes each), attention in the rotated domain.
    Code k of word w is rotated coordinate 8w + k; the kernel keeps the eight code positions as
    eight key tiles and eight accumulators against q's columns 8w + k (see `_tbq4_values`)."""
    wait(PDL)  # q, the cache, the table and the lengths all come from earlier kernels / copies
    launch_dependents(PDL)
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
    MID_O, MID_LSE, OUT, LSE,
    stride_mob, stride_mos, stride_moh, stride_mosp,
    stride_mlb, stride_mls, stride_mlh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_ls,
    S, H, NUM_SPLITS,
    DC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program per (request·token, head, BLOCK_D columns). Columns are split only when B·S·H
    alone would leave SMs idle (B=1 decodes split the most); otherwise one program per row."""
    wait(PDL)  # the partials of the split kernel before
    launch_dependents(PDL)
    pid = tl.program_id(0)
    h = tl.program_id(1)
    d0 = tl.program_id(2) * BLOCK_D
    b = pid // S
    s = pid % S
    lse_base = MID_LSE + b * stride_mlb + s * stride_mls + h * stride_mlh
    offs_sp = tl.arange(0, BLOCK_SPLITS)
    lse = tl.load(lse_base + offs_sp, mask=offs_sp < NUM_SPLITS, other=float("-inf"))
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
    tl.store(OUT + b * stride_ob + s * stride_os + h * stride_oh + offs_d, acc.to(OUT.dtype.element_ty), mask=d_ok)
    if d0 == 0:
        tl.store(LSE + b * stride_lb + s * stride_ls + h, lse2 / 1.4426950408889634)  # natural log


@dataclasses.dataclass(frozen=True)
class Options:
    """The Triton kernel's tiles. None takes the planned value (`dispatch.default_tiles`); `max_rows` caps the
    rows (folded tokens × heads) of a program; `prefetch` (default: on under 64 rows) loads the next key block's
    bytes of a quantised cache while this one computes; `kv_align` caps the vector width of the codes' loads."""

    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    max_rows: int = 64
    prefetch: bool | None = None
    kv_align: int | None = None


def supported(q, kv_cache, kv_format: str, block_m: int, opts: Options = Options(), *,
              head_dim_v: int | None = None) -> bool:
    """The Triton kernel takes every call that passes the argument checks (any device, the interpreter too)."""
    return True


def launch(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2: float, plan: dict, *,
           causal: bool, num_splits: int, kv_format: str, opts: Options = Options(), tiles: dict | None = None):
    """Stage 1: one program per (request, query-token group, head block, split); writes out / lse itself when
    num_splits == 1, else the partials mid_o / mid_lse. tbq4: q is already rotated. `tiles`: the planned
    block_n / num_warps / num_stages, which `opts` overrides."""
    B, S, H, D = q.shape
    dc = out.shape[-1]
    dr = D - dc
    tiles = dict(tiles or {})
    warps = opts.num_warps or tiles.get("num_warps", 4)
    stages = opts.num_stages or tiles.get("num_stages", 1)
    direct = num_splits == 1
    grid = (B * (S // plan["FOLD"]), plan["head_blocks"], num_splits)
    mo_strides = (0, 0, 0, 0) if direct else mid_o.stride()[:4]
    ml_strides = (0, 0, 0) if direct else mid_lse.stride()[:3]
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
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
            PREFETCH=plan["BLOCK_M"] < 64 if opts.prefetch is None else opts.prefetch,
            ROPE_AT=rope_at if i8 else rope_at // 2,
            # kv_align may only lower the hint: narrower vectors store the dequantised tile with fewer bank conflicts
            KV_ALIGN=min(opts.kv_align or (8 if fp8 else 16), _aligned_elements(kv, 0)),
            S_ALIGN=_aligned_elements(scales, dc),
            R_ALIGN=_aligned_elements(rope, rope_at))
    elif kv_format not in ("auto", "native", "bf16", "fp16", "fp32"):
        raise ValueError(f"unknown kv_format {kv_format!r}")
    else:
        scales = rope = kv_cache
    if tbq:
        # on the GPU in bf16 the PTX table lookup (the interpreter runs no PTX)
        quant["LUT_ASM"] = q.is_cuda and q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") != "1"
        kernel, fmt_args, fmt_flags = _mla_decode_split_tbq4_kernel, (tbq4.centroids(q.device),), {}
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
        scale_log2,
        S, H, num_splits,
        PAGE_SIZE=kv_cache.shape[1], DC=dc, DR=dr, DC_PAD=triton.next_power_of_2(dc),
        DR_PAD=triton.next_power_of_2(dr), BLOCK_H=plan["BLOCK_H"], FOLD=plan["FOLD"], BLOCK_M=plan["BLOCK_M"],
        BLOCK_N=plan["BLOCK_N"], CAUSAL=causal, PRECISION=precision, DIRECT=direct, num_warps=warps,
        num_stages=stages, **fmt_flags, **quant, **pdl_args(q),
    )


def combine_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   sm_count: int) -> None:
    """Stage 2: merge the splits' partials mid_o [B, S, H, splits, Dc] (log2-sum-exps mid_lse [B, S, H, splits])
    into out [B, S, H, Dc] and its natural-log lse [B, S, H]."""
    B, S, H, ns, dc = mid_o.shape
    # one program per row, unless the rows are too few to fill the SMs: then narrower column blocks
    block_d = triton.next_power_of_2(dc)
    while block_d > 32 and B * S * H * (dc // block_d) < 4 * sm_count and dc % (block_d // 2) == 0:
        block_d //= 2
    _mla_decode_combine_kernel[(B * S, H, triton.cdiv(dc, block_d))](
        mid_o, mid_lse, out, lse,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_o.stride(3),
        mid_lse.stride(0), mid_lse.stride(1), mid_lse.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        S, H, ns,
        DC=dc, BLOCK_D=block_d, BLOCK_SPLITS=max(2, triton.next_power_of_2(ns)),
        SPLIT_CHUNK=max(2, min(triton.next_power_of_2(ns), 4096 // block_d)),  # few, wide steps
        num_warps=4, **pdl_args(mid_o),
    )


def _aligned_elements(view: torch.Tensor, offset_bytes: int, cap: int = 16) -> int:
    """How many elements of `view` every row start (+ offset) is aligned to, up to `cap` bytes:
    a hint that lets Triton vectorise loads of rows whose stride is not a multiple of 16."""
    g = math.gcd(view.data_ptr() + offset_bytes, *(st * view.element_size() for st in view.stride()[:2]))
    return max(1, min(cap, g & -g) // view.element_size())
