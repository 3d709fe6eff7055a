"""Triton MLA prefill: ragged (varlen) flash attention with a bottom-right causal mask and the lse.

One program per (query block, request, head) runs an online softmax over the request's keys up to each row's
causal limit; key blocks left of the diagonal take an unmasked path. Portable: runs on any CUDA GPU and in the
Triton interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmla.ops.online_softmax import online_softmax_finish, online_softmax_step


@triton.jit
def _attend_block(q, q_t, acc, m_i, l_i, K, V, k_base, v_base, n0, k_len, limit, rows_ok, scale_log2,
                  stride_kt, stride_vt, D1: tl.constexpr, DT: tl.constexpr, DT_PAD: tl.constexpr,
                  DV: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                  CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """One BLOCK_N block of keys into the online softmax. MASKED=False: every key of the block is
    visible to every row (the blocks left of the causal diagonal), so no compare/select is spent."""
    cols = n0 + tl.arange(0, BLOCK_N)
    d1 = tl.arange(0, D1)
    dv = tl.arange(0, DV_PAD)
    if MASKED:
        col_ok = cols < k_len
        k = tl.load(K + k_base + cols[:, None] * stride_kt + d1[None, :], mask=col_ok[:, None], other=0.0)
    else:
        k = tl.load(K + k_base + cols[:, None] * stride_kt + d1[None, :])
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if DT > 0:  # the head dim's tail (e.g. the 64 rope dims of 192): a second dot, no padding to 256
        dt = tl.arange(0, DT_PAD)
        kt_mask = (dt < DT)[None, :]
        if MASKED:
            kt_mask = kt_mask & col_ok[:, None]
        k_t = tl.load(K + k_base + cols[:, None] * stride_kt + D1 + dt[None, :], mask=kt_mask, other=0.0)
        s = tl.dot(q_t, tl.trans(k_t), s, input_precision=PRECISION)
    s = s * scale_log2
    if MASKED:
        visible = col_ok[None, :] & rows_ok[:, None]
        if CAUSAL:
            visible = visible & (cols[None, :] <= limit[:, None])
        s = tl.where(visible, s, float("-inf"))
    p, alpha, m_new, l_i = online_softmax_step(s, m_i, l_i)
    if MASKED or DV_PAD != DV:
        v_mask = (dv < DV)[None, :]
        if MASKED:
            v_mask = v_mask & col_ok[:, None]
        v = tl.load(V + v_base + cols[:, None] * stride_vt + dv[None, :], mask=v_mask, other=0.0)
    else:
        v = tl.load(V + v_base + cols[:, None] * stride_vt + dv[None, :])
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lt,
    scale_log2,
    D1: tl.constexpr, DT: tl.constexpr, DT_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    WARP_SPEC: tl.constexpr = False,
):
    """One program per (query block, request, head): online softmax over the request's keys up to
    each row's bottom-right causal limit (kv_len − q_len + t). Query blocks run last-first (the
    longest causal rows start first). Keys left of the diagonal take the unmasked path."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q0 = tl.load(CU_Q + b)
    q_len = tl.load(CU_Q + b + 1) - q0
    k0 = tl.load(CU_K + b)
    k_len = tl.load(CU_K + b + 1) - k0
    start_m = pid_m * BLOCK_M
    if start_m < q_len:
        rows = start_m + tl.arange(0, BLOCK_M)
        rows_ok = rows < q_len
        d1 = tl.arange(0, D1)
        dv = tl.arange(0, DV_PAD)
        q_ptr = Q + (q0 + rows)[:, None] * stride_qt + h * stride_qh
        q = tl.load(q_ptr + d1[None, :], mask=rows_ok[:, None], other=0.0)
        q_t = q  # unused unless DT > 0
        if DT > 0:
            dt = tl.arange(0, DT_PAD)
            q_t = tl.load(q_ptr + D1 + dt[None, :], mask=rows_ok[:, None] & (dt < DT)[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
        limit = k_len - q_len + rows  # row t sees keys j <= limit
        k_base = k0.to(tl.int64) * stride_kt + h * stride_kh
        v_base = k0.to(tl.int64) * stride_vt + h * stride_vh
        end = k_len
        full_end = k_len  # keys every row of this block sees
        if CAUSAL:
            end = tl.minimum(k_len, k_len - q_len + start_m + BLOCK_M)
            full_end = tl.maximum(k_len - q_len + start_m + 1, 0)
        full_end = tl.minimum(full_end, end) // BLOCK_N * BLOCK_N
        for n0 in tl.range(0, full_end, BLOCK_N, warp_specialize=WARP_SPEC):
            acc, m_i, l_i = _attend_block(q, q_t, acc, m_i, l_i, K, V, k_base, v_base, n0, k_len, limit, rows_ok,
                                          scale_log2, stride_kt, stride_vt, D1, DT, DT_PAD, DV, DV_PAD, BLOCK_N,
                                          False, CAUSAL, PRECISION)
        for n0 in range(full_end, end, BLOCK_N):
            acc, m_i, l_i = _attend_block(q, q_t, acc, m_i, l_i, K, V, k_base, v_base, n0, k_len, limit, rows_ok,
                                          scale_log2, stride_kt, stride_vt, D1, DT, DT_PAD, DV, DV_PAD, BLOCK_N,
                                          True, CAUSAL, PRECISION)
        out, lse2 = online_softmax_finish(acc, m_i, l_i)
        tl.store(O + (q0 + rows)[:, None] * stride_ot + h * stride_oh + dv[None, :], out.to(O.dtype.element_ty),
                 mask=rows_ok[:, None] & (dv < DV)[None, :])
        tl.store(LSE + (q0 + rows) * stride_lt + h, lse2 / 1.4426950408889634, mask=rows_ok)


def head_dim_split(dqk: int) -> tuple[int, int]:
    """dqk = D1 + DT with D1 the largest power of two ≤ dqk (192 → 128 + 64, 576 → 512 + 64)."""
    d1 = 1 << (dqk.bit_length() - 1)
    return d1, dqk - d1


def default_prefill_config(dqk: int, dv: int, elem: int, cuda: bool) -> dict:
    """GPU tiles (the best of docs/benchmarks.md's bf16 sweep), with as many pipeline stages as fit in shared
    memory; small tiles elsewhere (the interpreter)."""
    if not cuda:
        return dict(block_m=64, block_n=64, num_warps=4, num_stages=2)
    cfg = dict(block_m=128, block_n=64, num_warps=8, num_stages=3)
    while cfg["num_stages"] > 1 and (cfg["num_stages"] * cfg["block_n"] * (dqk + dv) + cfg["block_m"] * dqk) * elem \
            > 200 * 1024:
        cfg["num_stages"] -= 1
    return cfg


def mla_prefill_triton(
    q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, softmax_scale,
    *, causal: bool = True, return_lse: bool = False, out: torch.Tensor | None = None,
    block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, warp_specialize: bool = False,
):
    """Same contract as `mla_prefill_torch` (arguments checked by `mla_prefill`). Grid: (query blocks of the
    longest request, B, H). Tiles default to `default_prefill_config`; `warp_specialize` asks Triton to split the
    unmasked key loop into producer / consumer warps."""
    T, H, dqk = q.shape
    dv = v.shape[-1]
    B = cu_seqlens_q.shape[0] - 1
    o = out if out is not None else q.new_empty(T, H, dv)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T and B and max_seqlen_q:
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        cfg = default_prefill_config(dqk, dv, q.element_size(), q.is_cuda)
        block_m, block_n = block_m or cfg["block_m"], block_n or cfg["block_n"]
        num_warps, num_stages = num_warps or cfg["num_warps"], num_stages or cfg["num_stages"]
        d1, dt = head_dim_split(dqk)
        grid = (triton.cdiv(max_seqlen_q, block_m), B, H)
        _prefill_kernel[grid](
            q, k, v, o, lse, cu_seqlens_q, cu_seqlens_kv,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            o.stride(0), o.stride(1), lse.stride(0),
            softmax_scale * 1.4426950408889634,
            D1=d1, DT=dt, DT_PAD=triton.next_power_of_2(dt) if dt else 1, DV=dv, DV_PAD=triton.next_power_of_2(dv),
            BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, PRECISION=precision,
            num_warps=num_warps, num_stages=num_stages, WARP_SPEC=warp_specialize,
        )
    return (o, lse) if return_lse else o

