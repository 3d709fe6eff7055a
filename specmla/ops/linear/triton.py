"""Triton kernels of the FP8 block-scaled linear (contract C7): w8a8 with DeepSeek's scales.

The activations are quantised per token per 128-column group (scale = amax / 448, `act_quant_torch`'s rule), the
weights are e4m3 with one fp32 scale per 128 × 128 block. Each 128-wide K block is an e4m3 × e4m3 `tl.dot` whose
fp32 result is scaled by a_scale[row, kb] · w_scale[n // 128, kb] and added to an fp32 accumulator (the per-128-K
promotion of DeepGEMM and vLLM's w8a8_block_fp8_matmul).

Two regimes, chosen by the number of rows M (`fp8_block_linear_triton`):
- M ≤ 64 (decode, bound by the weight stream): `_splitk_kernel` computes outᵀ tiles (swap-AB: the weight rows fill
  the MMA's M, the tokens its N), K split so that the grid fills the SMs about twice, after `act_quant` (the kernel
  reads e4m3 rows: half the bytes that every N tile re-reads). Split partials go to an fp32 workspace [SPLIT, M, N];
  the last program of an N tile to arrive (a counter per tile in `zeroed_scratch`, put back to 0 by that program)
  sums them in split order, adds the bias and writes the output: deterministic, no host sync, graph-capturable.
  On sm_90+ both launches are programmatic dependent launches (PDL): `act_quant` lets the GEMM start at once, and
  the GEMM prefetches its first weight blocks into L2 before it waits for the quantised activations, so the
  weight stream overlaps the quantisation and the launch gap instead of following them;
- M > 64 (prefill, bound by the tensor cores): `act_quant`, then `_gemm_kernel`, a tiled GEMM in grouped tile order.

Under TRITON_INTERPRET=1 the interpreter's fp32 → e4m3 conversion carries no mantissa overflow into the exponent
(31.8 → 16), so the kernels round to e4m3 in fp32 arithmetic first (`INTERP`, set by the wrappers); compiled
kernels convert with the hardware's round-to-nearest-even.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from specmla.ops.linear import tuning
from specmla.ops.linear.reference import BLOCK, E4M3_MAX, check_fp8_linear_args
from specmla.ops.linear.tuning import DECODE_MAX_M, block_rows  # DECODE_MAX_M: rows of the split-K kernel
from specmla.ops.scratch import zeroed_scratch

SPLITK_COUNTERS = 1 << 16  # arrival counters (one per N tile) kept zeroed for the split-K kernel
PREFETCH_BLOCKS = 4  # K blocks of its weights a decode program asks L2 for before it waits on act_quant
ACT_QUANT_SMALL_M = 512  # act_quant's programs hold 8 rows up to here, 32 above (measured on an H200)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _to_e4m3(v, INTERP: tl.constexpr):
    """fp32 values in [-448, 448] → float8e4nv, round to nearest even."""
    if INTERP:
        # the e4m3 neighbours' spacing: 2^(e - 3) for |v| ≥ 2^-6 (e = v's exponent), 2^-9 below
        e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = tl.maximum(e, -6)
        ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
        inv = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)
        magic = 12582912.0  # 1.5 · 2^23: adding and subtracting it rounds |t| < 2^22 to an integer, ties to even
        t = v * inv
        v = ((t + magic) - magic) * ulp
    return v.to(tl.float8e4nv)


@triton.jit
def quant_tile(x, E4M3: tl.constexpr, INTERP: tl.constexpr):
    """x fp32 [R, 128] → (e4m3 [R, 128], fp32 scales [R]): scale = amax / 448 per row (1 for a row of zeros)."""
    amax = tl.max(tl.abs(x), axis=1)
    s = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, E4M3, tl.float32)), 1.0)
    q = tl.math.div_rn(x, tl.broadcast_to(s[:, None], x.shape))
    q = tl.minimum(tl.maximum(q, -E4M3), E4M3)
    return _to_e4m3(q, INTERP), s


def use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (griddepcontrol) exists from sm_90 on; never under the interpreter."""
    return device.type == "cuda" and not interpreting() and torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ptrs (a hint: no value is read into registers, no ordering implied)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _act_quant_kernel(X, Q, S, M, K, stride_xm, stride_sm, stride_sk, ROWS: tl.constexpr, GBLK: tl.constexpr,
                      E4M3: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr):
    """Program (i, j): rows i·ROWS.., column group j (GBLK columns) of x → e4m3 Q [M, K] and scales S[m, j] at
    m·stride_sm + j·stride_sk. PDL: x may come from the kernel before (wait for it), and the kernel after may
    launch at once."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * GBLK + tl.arange(0, GBLK)
    ok = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(X + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    q, s = quant_tile(x, E4M3, INTERP)
    tl.store(Q + rows[:, None].to(tl.int64) * K + cols[None, :], q, mask=ok)
    tl.store(S + rows.to(tl.int64) * stride_sm + tl.program_id(1) * stride_sk, s, mask=rows < M)


def act_quant(x: torch.Tensor, block: int = BLOCK, *, pdl: bool = False,
              scales_mn_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (bf16 / fp16 / fp32) → (float8_e4m3fn [..., K], fp32 scales [..., ⌈K/block⌉]): per row, per group
    of `block` columns (the last one partial), scale = amax / 448 (1 for a group of zeros); `act_quant_torch`'s rule.
    pdl: launch as a programmatic dependent launch that lets the next kernel start early (sm_90+; see `use_pdl`).
    scales_mn_major: x must be 2-D [M, K]; the scales come as an [M, KB] view with strides (1, M rounded up to 4)
    (column-major, each column 16-byte aligned: the layout DeepGEMM's sm_90 kernels load by TMA)."""
    if block != BLOCK:
        raise ValueError(f"act_quant: block must be {BLOCK}, got {block}")
    if not x.is_floating_point() or x.dtype == torch.float8_e4m3fn or x.dim() < 1:
        raise ValueError(f"act_quant: x must be a bf16 / fp16 / fp32 tensor [..., K], got {x.dtype} {tuple(x.shape)}")
    if scales_mn_major and x.dim() != 2:
        raise ValueError(f"act_quant: scales_mn_major needs x [M, K], got {tuple(x.shape)}")
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(math.prod(lead), K)
    if K > 0 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, KB = x2.shape[0], triton.cdiv(K, BLOCK)
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    if scales_mn_major:
        ma = -(-M // 4) * 4
        s = torch.empty(KB * ma, dtype=torch.float32, device=x.device).as_strided((M, KB), (1, ma))
    else:
        s = torch.empty(M, KB, dtype=torch.float32, device=x.device)
    if M > 0 and K > 0:
        rows = 8 if M <= ACT_QUANT_SMALL_M else 32  # more programs while few rows; fewer, fuller ones for many
        _act_quant_kernel[(triton.cdiv(M, rows), KB)](
            x2, q, s, M, K, x2.stride(0), s.stride(0), s.stride(1), ROWS=rows, GBLK=BLOCK, E4M3=E4M3_MAX,
            INTERP=interpreting(), PDL=pdl, num_warps=4, launch_pdl=pdl)
    return q.view(*lead, K), (s if scales_mn_major else s.view(*lead, KB))


@triton.jit
def _gemm_kernel(A, AS, W, WS, BIAS, OUT, M, N, K, KB, stride_om,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """out[M, N] = Σ_kb (A_q[:, kb] @ W_q[:, kb]ᵀ) · a_scale[:, kb] · w_scale[n // 128, kb] (+ bias): one
    [BLOCK_M, BLOCK_N] tile per program, tiles in groups of GROUP_M row tiles (L2 reuse of the weights)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptr = A + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    w_ptr = W + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    as_ptr = AS + offs_m.to(tl.int64) * KB
    if BLOCK_N <= BLOCK_K:  # one weight scale block per tile
        ws_ptr = WS + ((pid_n * BLOCK_N) // BLOCK_K) * KB
    else:
        ws_ptr = WS + (offs_n // BLOCK_K) * KB
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, KB):
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(as_ptr + kb, mask=m_ok, other=0.0)
        w_s = tl.load(ws_ptr + kb, mask=n_ok, other=0.0) if BLOCK_N > BLOCK_K else tl.load(ws_ptr + kb)
        part = tl.dot(a, tl.trans(w))
        if BLOCK_N > BLOCK_K:
            acc += part * a_s[:, None] * w_s[None, :]
        else:
            acc += part * (a_s * w_s)[:, None]
        a_ptr += BLOCK_K
        w_ptr += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], acc.to(OUT.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _splitk_kernel(A, AS, W, WS, BIAS, OUT, WORK, COUNT, M, N, K, KB, KB_PER, stride_om,
                   SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """Program (n tile, split s): outᵀ[BLOCK_N, BLOCK_M] over K blocks s·KB_PER.. (swap-AB: the weight tile is the
    MMA's A operand); A / AS hold `act_quant`'s output. SPLIT > 1: the
    partial goes to WORK[s]; the N tile's last program to arrive sums WORK[0..SPLIT) in order and writes OUT.
    PDL: the program asks L2 for its first PREFETCH weight blocks (read-only: safe before the wait), then waits
    for the kernel before (act_quant) to finish; everything it reads or writes besides W comes after the wait."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    kb0 = pid_s * KB_PER
    kb1 = tl.minimum(kb0 + KB_PER, KB)
    if PDL:
        if PREFETCH > 0:  # one 128-byte line per (weight row, K block): a row's K block is BLOCK_K e4m3 bytes
            pf_kb = kb0 + tl.arange(0, PREFETCH)
            pf_ok = n_ok[:, None] & (pf_kb[None, :] < kb1)
            _prefetch_l2(W + tl.where(pf_ok, offs_n[:, None].to(tl.int64) * K + pf_kb[None, :] * BLOCK_K, 0))
        gdc_wait()
    w_ptr = W + offs_n[:, None].to(tl.int64) * K + kb0 * BLOCK_K + offs_k[None, :]
    a_ptr = A + offs_m[:, None].to(tl.int64) * K + kb0 * BLOCK_K + offs_k[None, :]
    if BLOCK_N <= BLOCK_K:
        ws_ptr = WS + ((pid_n * BLOCK_N) // BLOCK_K) * KB
    else:
        ws_ptr = WS + (offs_n // BLOCK_K) * KB
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for kb in range(kb0, kb1):
        k_ok = offs_k < K - kb * BLOCK_K
        w = tl.load(w_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(AS + offs_m * KB + kb, mask=m_ok, other=0.0)
        a_ptr += BLOCK_K
        part = tl.dot(w, tl.trans(a))
        if BLOCK_N > BLOCK_K:
            w_s = tl.load(ws_ptr + kb, mask=n_ok, other=0.0)
            acc += part * w_s[:, None] * a_s[None, :]
        else:
            acc += part * (a_s * tl.load(ws_ptr + kb))[None, :]
        w_ptr += BLOCK_K
    if PDL:
        gdc_launch_dependents()
    out_ptr = OUT + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    out_ok = m_ok[None, :] & n_ok[:, None]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr, acc.to(OUT.dtype.element_ty), mask=out_ok)
    else:
        work_off = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        tl.store(WORK + pid_s.to(tl.int64) * M * N + work_off, acc, mask=out_ok)
        tl.debug_barrier()  # every thread's partial is issued before the arrival is announced
        if tl.atomic_add(COUNT + pid_n, 1, sem="acq_rel") == SPLIT - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(0, SPLIT):
                total += tl.load(WORK + (s * M).to(tl.int64) * N + work_off, mask=out_ok, other=0.0,
                                 cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr, total.to(OUT.dtype.element_ty), mask=out_ok)
            tl.atomic_xchg(COUNT + pid_n, 0)


_SMS: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def plan_split(N: int, K: int, block_n: int, sms: int, waves: float = 1.6) -> int:
    """Split count of the decode kernel: the fewest splits that give about `waves` programs per SM (one program
    holds too few weight bytes in flight to stream at an SM's share of the copy rate; two or more resident do),
    and never an empty program. Fewer splits also mean fewer fp32 partials. docs/benchmarks.md §9 has the sweep
    behind it (BLOCK_N 64: one split for 18432×7168 and 24576×1536, two for 7168×2048, seven for 2112×7168)."""
    kb = triton.cdiv(K, BLOCK)
    split = max(1, min(kb, math.ceil(waves * sms / triton.cdiv(N, block_n))))
    return triton.cdiv(kb, triton.cdiv(kb, split))


def _decode_config(M: int, split: int) -> dict:
    """Tiles of the split-K kernel for M ≤ 64 rows (the sweep of `bench_fp8.py --sweep`): 64 weight rows per
    program, so that more programs are resident per SM than with 128; 6 stages of weight tiles in flight up to 16
    rows, 4 with 64 rows (the activation tile grows to 8 KB per stage); 4 warps except 64 rows with a K split."""
    block_m = block_rows(M)
    return dict(BLOCK_M=block_m, BLOCK_N=64, num_warps=4 if block_m <= 32 or split == 1 else 8,
                num_stages=6 if block_m <= 16 else 4)


def _gemm_config(M: int, N: int) -> dict:
    """Tiles of the prefill GEMM: vLLM's tuned H100 block-fp8 tiles for M > 64 (64 × 128 × 128, 4 warps)."""
    return dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=16, num_warps=4, num_stages=3 if M <= 1024 else 4)


def fp8_block_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, *,
                            bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                            out: torch.Tensor | None = None, workspace: torch.Tensor | None = None,
                            split: int | None = None, config: dict | None = None) -> torch.Tensor:
    """Contract C7 on the Triton kernels: x [..., K] @ (weight · scale)ᵀ (+ bias) → [..., N] in out_dtype (default
    x's dtype), activations quantised per token per 128 columns. Extra knobs (the engine need not pass them):
    out: a contiguous [M, N] tensor of out_dtype to write (returned reshaped); workspace: fp32 with ≥ SPLIT·M·N
    elements for the split-K partials; split: the decode kernel's K split (default `plan_split`); config: tile
    overrides (BLOCK_M / BLOCK_N / GROUP_M / num_warps / num_stages; PREFETCH for the decode kernel)."""
    check_fp8_linear_args(x, weight, weight_scale_inv, bias)
    N, K = weight.shape
    lead = x.shape[:-1]
    out_dtype = out_dtype or x.dtype
    x2 = x.reshape(math.prod(lead), K)
    if K > 0 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if split is None and config is None:
        config = tuning.lookup(N, K, M, x.device)
        if config is not None:
            split = config.pop("split", None)
    if out is None:
        out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    elif tuple(out.shape) != (M, N) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"fp8_block_linear: out must be a contiguous {out_dtype} [{M}, {N}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    if M == 0 or N == 0:
        return out.view(*lead, N)
    if K == 0:
        out.zero_() if bias is None else out.copy_(bias.to(out_dtype).expand(M, N))
        return out.view(*lead, N)
    w = weight if weight.is_contiguous() else weight.contiguous()
    ws = weight_scale_inv if weight_scale_inv.is_contiguous() else weight_scale_inv.contiguous()
    KB = triton.cdiv(K, BLOCK)
    has_bias = bias is not None
    b = bias if has_bias else ws  # any pointer when there is no bias
    if M > DECODE_MAX_M:
        cfg = {**_gemm_config(M, N), **(config or {})}
        a, a_s = act_quant(x2)
        grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
        _gemm_kernel[grid](a, a_s, w, ws, b, out, M, N, K, KB, out.stride(0), HAS_BIAS=has_bias,
                           BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=BLOCK, GROUP_M=cfg["GROUP_M"],
                           num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return out.view(*lead, N)
    if split is None:
        split = plan_split(N, K, (config or {}).get("BLOCK_N", 64), _num_sms(x.device))
    per = triton.cdiv(KB, max(1, min(split, KB)))
    split = triton.cdiv(KB, per)  # no empty program
    cfg = {**_decode_config(M, split), **(config or {})}
    if cfg["BLOCK_M"] < M:
        raise ValueError(f"fp8_block_linear: config BLOCK_M {cfg['BLOCK_M']} < {M} rows")
    prefetch = cfg.get("PREFETCH", PREFETCH_BLOCKS)
    if prefetch < 0 or prefetch & (prefetch - 1):
        raise ValueError(f"fp8_block_linear: config PREFETCH must be 0 or a power of two, got {prefetch}")
    tiles_n = triton.cdiv(N, cfg["BLOCK_N"])
    pdl = use_pdl(x.device)
    a, a_s = act_quant(x2, pdl=pdl)
    if split > 1:
        if tiles_n > SPLITK_COUNTERS:
            raise ValueError(f"fp8_block_linear: {tiles_n} N tiles exceed the {SPLITK_COUNTERS} split-K counters")
        if workspace is None:
            workspace = torch.empty(split * M * N, dtype=torch.float32, device=x.device)
        elif workspace.dtype != torch.float32 or workspace.numel() < split * M * N or not workspace.is_contiguous():
            raise ValueError(f"fp8_block_linear: workspace must be contiguous float32 with ≥ {split * M * N} elements")
        count = zeroed_scratch("fp8_linear_splitk", SPLITK_COUNTERS, x.device)
    else:
        workspace = count = out  # unused
    _splitk_kernel[(tiles_n, split)](
        a, a_s, w, ws, b, out, workspace, count, M, N, K, KB, per, out.stride(0),
        SPLIT=split, HAS_BIAS=has_bias, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=BLOCK,
        PDL=pdl, PREFETCH=prefetch, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], launch_pdl=pdl)
    return out.view(*lead, N)
