"""Triton MLA decode over the paged latent cache: split-KV + combine, query tokens folded into rows.

Stage 1: one program per (request, query-token group, head block, KV split). Its M rows are F
query tokens × BLOCK_H heads (TokenSpeed's fold: F = the largest divisor of S with F·BLOCK_H ≤ 64,
the fa3_mtp idea), so one pass over the KV pages serves every draft token of the request; each row
keeps its own bottom-right causal limit. Scores = q_c·c_kv + q_r·k_pe, online softmax in base 2,
acc += p·c_kv (fp32 inputs use IEEE fp32 dots, not tf32: the fp32 path is the exact one). It writes the split's normalised output and its log2-sum-exp.
Stage 2: one program per (request, query token, head, 128 output columns) merges the splits.

The number of splits comes from shapes only (B, S, H, SM count, the block table's capacity), never
from the device-side lengths, so there is no host synchronisation, the workspace has a fixed size,
and the pair of launches can be captured in a CUDA graph. Each program derives its KV range from
the request's actual length on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmla.ops import tbq4
from specmla.ops.online_softmax import online_softmax_finish, online_softmax_step

LOG2E = 1.4426950408889634
MAX_ROWS = 64  # rows (folded tokens × heads) per program


@triton.jit
def _per_block(x, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """[BLOCK_N, NB] per-block scalars → [BLOCK_N, NB·128], each repeated over its block's columns."""
    return tl.reshape(tl.broadcast_to(tl.expand_dims(x, 2), (BLOCK_N, NB, 128)), (BLOCK_N, NB * 128))


@triton.jit
def _mla_decode_split_kernel(
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
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, DIRECT: tl.constexpr, FP8: tl.constexpr, TBQ4: tl.constexpr,
):
    pid_bg = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_sp = tl.program_id(2)
    n_groups = S // FOLD
    b = pid_bg // n_groups
    g = pid_bg % n_groups

    rows = tl.arange(0, BLOCK_M)
    s_idx = g * FOLD + rows // BLOCK_H
    h_idx = pid_h * BLOCK_H + rows % BLOCK_H
    row_ok = (rows < FOLD * BLOCK_H) & (h_idx < H)

    seq_len = tl.load(SEQ + b)
    # this split's share of the request's KV range, in whole BLOCK_N blocks
    n_blocks = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(n_blocks, NUM_SPLITS)
    start = pid_sp * per_split * BLOCK_N
    end = tl.minimum(start + per_split * BLOCK_N, seq_len)
    if CAUSAL:
        limit = seq_len - S + s_idx + 1  # row sees positions < limit
        end = tl.minimum(end, seq_len - S + g * FOLD + FOLD)
    else:
        limit = tl.zeros([BLOCK_M], dtype=tl.int32) + seq_len

    # Dc/Dr that are not powers of two are padded to one (DC_PAD/DR_PAD) and masked
    offs_c = tl.arange(0, DC_PAD)
    offs_r = tl.arange(0, DR_PAD)
    c_ok = offs_c < DC
    r_ok = offs_r < DR
    offs_b = tl.arange(0, DC_PAD // 128 if DC_PAD >= 128 else 1)  # quantised formats: per-128-block scalars
    b_ok = offs_b < DC // 128
    q_row = Q + b * stride_qb + s_idx * stride_qs + h_idx * stride_qh
    q_c = tl.load(q_row[:, None] + offs_c[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0.0)
    q_r = tl.load(q_row[:, None] + DC + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DC_PAD], dtype=tl.float32)
    offs_n0 = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_n0
        n_ok = offs_n < end
        if PAGE_SIZE % BLOCK_N == 0:  # the block lies in one page: one page id, contiguous rows
            page = tl.load(BT + b * stride_btb + n0 // PAGE_SIZE).to(tl.int64)
            tok = n0 % PAGE_SIZE + offs_n0
        else:
            page = tl.load(BT + b * stride_btb + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            tok = offs_n % PAGE_SIZE
        kv_row = KV + page * stride_kvp + tok * stride_kvt
        if FP8:  # e4m3 codes × the fp32 scale of their 128-block, bf16 rope: dequantised in registers
            codes = tl.load(kv_row[:, None] + offs_c[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0)
            s_row = KVS + page * stride_ksp + tok * stride_kst + DC // 4
            # one load per (token, block), broadcast over the block's 128 columns in registers
            scale = tl.load(s_row[:, None] + offs_b[None, :], mask=n_ok[:, None] & b_ok[None, :], other=0.0)
            k_c = (codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                   * _per_block(scale, BLOCK_N, DC_PAD // 128)).to(Q.dtype.element_ty)
            r_row = KVR + page * stride_krp + tok * stride_krt + (DC + 4 * (DC // 128)) // 2
            k_r = tl.load(r_row[:, None] + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :],
                          other=0.0).to(Q.dtype.element_ty)
        elif TBQ4:  # 4-bit centroid codes × the block's corrected norm, in the rotated domain
            blk = offs_c // 128
            w = offs_c % 128
            byte = tl.load(kv_row[:, None] + (blk * 66 + 2 + w // 2)[None, :], mask=n_ok[:, None] & c_ok[None, :],
                           other=0).to(tl.int32)
            code = (byte >> (4 * (w % 2))[None, :]) & 0xF
            n_row = KVS + page * stride_ksp + tok * stride_kst
            norm = tl.load(n_row[:, None] + (offs_b * 33)[None, :], mask=n_ok[:, None] & b_ok[None, :], other=0.0)
            k_c = (tl.load(CENT + code) * _per_block(norm.to(tl.float32), BLOCK_N, DC_PAD // 128)).to(
                Q.dtype.element_ty)
            r_row = KVR + page * stride_krp + tok * stride_krt + (DC // 128) * 33
            k_r = tl.load(r_row[:, None] + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :],
                          other=0.0).to(Q.dtype.element_ty)
        elif DC_PAD == DC:
            k_c = tl.load(kv_row[:, None] + offs_c[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_c = tl.load(kv_row[:, None] + offs_c[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0)
        if FP8 or TBQ4:
            pass
        elif DR_PAD == DR:
            k_r = tl.load(kv_row[:, None] + DC + offs_r[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_r = tl.load(kv_row[:, None] + DC + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        qk = tl.dot(q_c, tl.trans(k_c), input_precision=PRECISION)
        qk = tl.dot(q_r, tl.trans(k_r), qk, input_precision=PRECISION)
        qk = qk * scale_log2
        visible = n_ok[None, :] & (offs_n[None, :] < limit[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(qk, m_i, l_i)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(k_c.dtype), k_c, acc, input_precision=PRECISION)

    out, lse = online_softmax_finish(acc, m_i, l_i)
    if DIRECT:  # a single split: this is the final result, no combine pass
        o_ptr = OUT + b * stride_ob + s_idx * stride_os + h_idx * stride_oh
        tl.store(o_ptr[:, None] + offs_c[None, :], out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & c_ok[None, :])
        tl.store(LSE + b * stride_lb + s_idx * stride_ls + h_idx, lse / 1.4426950408889634, mask=row_ok)
    else:
        mo = MID_O + b * stride_mob + s_idx * stride_mos + h_idx * stride_moh + pid_sp * stride_mosp
        tl.store(mo[:, None] + offs_c[None, :], out, mask=row_ok[:, None] & c_ok[None, :])
        ml = MID_LSE + b * stride_mlb + s_idx * stride_mls + h_idx * stride_mlh + pid_sp
        tl.store(ml, lse, mask=row_ok)


@triton.jit
def _mla_decode_combine_kernel(
    MID_O, MID_LSE, OUT, LSE,
    stride_mob, stride_mos, stride_moh, stride_mosp,
    stride_mlb, stride_mls, stride_mlh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_ls,
    S, H, NUM_SPLITS,
    DC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
):
    """One program per (request·token, head, BLOCK_D columns). Columns are split only when B·S·H
    alone would leave SMs idle (B=1 decodes split the most); otherwise one program per row."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    d0 = tl.program_id(2) * BLOCK_D
    b = pid // S
    s = pid % S
    lse_base = MID_LSE + b * stride_mlb + s * stride_mls + h * stride_mlh
    offs_sp = tl.arange(0, BLOCK_SPLITS)
    lse = tl.load(lse_base + offs_sp, mask=offs_sp < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2(lse - m_safe), 0)
    inv_total = 1.0 / tl.where(total > 0, total, 1.0)
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
        lse_out = tl.where(total > 0, (m_safe + tl.log2(tl.where(total > 0, total, 1.0))) / 1.4426950408889634,
                           float("-inf"))
        tl.store(LSE + b * stride_lb + s * stride_ls + h, lse_out)


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


SMEM_BUDGET = 224 * 1024  # estimate (stages·block_n·d + block_m·d)·elem overcounts Triton's use a little


def default_tiles(block_m: int, d: int, elem: int, kv_format: str = "auto") -> dict:
    """Tile/pipeline choice measured best on H100 for bf16 (docs/benchmarks.md), shrunk until the
    K-tile pipeline (stages × block_n × d) plus the query tile fits the shared-memory budget.
    tbq4's in-register dequantisation needs shared memory of its own: 64-row tiles take 32-key
    blocks (64 × 576 at 2 stages asked for 272 KiB on H100)."""
    if block_m >= 64:
        block_n, warps, stages = (32 if kv_format == "tbq4" else 64), 8, 2
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
         max_rows: int = MAX_ROWS) -> dict:
    """Tile shapes and the split count, from shapes only (no device data read)."""
    block_h = min(max_rows, triton.next_power_of_2(H))
    fold = fold_factor(S, block_h, max_rows)
    block_m = max(16, triton.next_power_of_2(fold * block_h))
    head_blocks = triton.cdiv(H, block_h)
    programs = B * (S // fold) * head_blocks
    # One program per SM at a time (a program's K pipeline takes most of the shared memory), so
    # split only as far as one wave allows: more splits would add a tail wave and partial traffic.
    sms = _sm_count(device)
    max_useful = max(1, triton.cdiv(max_seq_len, 2 * block_n))  # keep ≥ 2 KV blocks per split
    # measured (docs/benchmarks.md): a second wave balances large batches of small (≤ 32-row) tiles;
    # 64-row tiles are compute-heavy and do best in one wave, written directly
    waves = 2 if programs >= 32 and block_m < 64 else 1
    splits = max(1, min(waves * sms // programs, max_useful, 128))
    return dict(BLOCK_H=block_h, FOLD=fold, BLOCK_M=block_m, head_blocks=head_blocks, num_splits=splits,
                BLOCK_N=block_n)


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
):
    """Same contract as `mla_decode_torch`; `workspace` = (mid_o, mid_lse) preallocated for graphs.
    kv_format "fp8": uint8 rows in FlashMLA's layout, dequantised inside the kernel's loop."""
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
    block_h = min(max_rows, triton.next_power_of_2(H))
    block_m = max(16, triton.next_power_of_2(fold_factor(S, block_h, max_rows) * block_h))
    tiles = default_tiles(block_m, D, max(q.element_size(), kv_cache.element_size()), kv_format)
    block_n = block_n or tiles["block_n"]
    cfg = plan(B, S, H, max_seq, q.device, block_n, max_rows)
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
    fp8, tbq = kv_format == "fp8", kv_format == "tbq4"
    cent = kv_cache  # unused unless tbq4
    if fp8 or tbq:
        if kv_cache.dtype != torch.uint8 or not kv_cache.is_contiguous() or dc % 128:
            raise ValueError(f"the {kv_format} cache must be contiguous uint8 rows with Dc a multiple of 128")
        # the same bytes viewed three ways: codes (uint8), fp8 scales (fp32) / tbq4 norms (fp16), rope (bf16)
        scales, rope = kv_cache.view(torch.float32 if fp8 else torch.float16), kv_cache.view(torch.bfloat16)
    elif kv_format not in ("auto", "native", "bf16", "fp16", "fp32"):
        raise ValueError(f"unknown kv_format {kv_format!r}")
    else:
        scales = rope = kv_cache
    if tbq:  # attention runs in the rotated domain: rotate q's latent part once (and the output back)
        q = torch.cat([tbq4.rotate_blocks(q[..., :dc].float()).to(q.dtype), q[..., dc:]], dim=-1)
        cent = tbq4.centroids(q.device)
    _mla_decode_split_kernel[grid](
        q, kv_cache, scales, rope, cent, block_table, seq_lens, mid_o, mid_lse, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        kv_cache.stride(0), kv_cache.stride(1),
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
        CAUSAL=causal, PRECISION=precision, DIRECT=direct, FP8=fp8, TBQ4=tbq, num_warps=warps,
        num_stages=stages,
    )
    if direct:
        return _finish(out, lse, return_lse, tbq)
    # one program per row, unless rows are too few for the SMs: B=1 merges 4 MB of partials, which
    # 64 programs of 128 columns read at half the copy rate (5.7 µs measured); 32 columns give 256
    block_d = triton.next_power_of_2(dc)
    while block_d > 32 and B * S * H * (dc // block_d) < 4 * _sm_count(q.device) and dc % (block_d // 2) == 0:
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
        num_warps=4,
    )
    return _finish(out, lse, return_lse, tbq)


def _finish(out, lse, return_lse, rotated):
    if rotated:  # tbq4: the output was accumulated in the rotated domain
        out.copy_(tbq4.rotate_blocks(out.float()).to(out.dtype))
    return (out, lse) if return_lse else out


def decode_bytes(seq_lens_sum: int, B: int, S: int, H: int, D: int = 576, dv: int = 512, elem: int = 2) -> int:
    """FlashMLA's byte count: every cached row once, q in, out back."""
    return (seq_lens_sum * D + B * S * H * (D + dv)) * elem


def decode_flops(seq_lens_sum: int, S: int, H: int, D: int = 576, dv: int = 512) -> float:
    return 2.0 * S * seq_lens_sum * H * (D + dv)


