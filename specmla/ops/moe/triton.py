"""Fused MoE in Triton: (token, slot) pairs aligned by expert, two grouped GEMMs, one sum.

A token's slots are its top-k routed experts followed by the shared experts, cut into pseudo-experts
of the routed width I (expert ids E, E+1, ...; the activation is per intermediate unit, so the cut is
exact; the last one may be narrower). Pair p = t·S + j (S = k + shared slots).

1. `align_pairs` (skipped at T = 1, where each pair is its own block): counts the pairs per
   expert, pads each expert's run to BLOCK_M rows, and writes the pair ids grouped by expert plus each
   block's expert (-1 past the real blocks). Sizes come from the static bound
   Σ_e ⌈n_e / BLOCK_M⌉ ≤ (P + min(P, E_slots)·(BLOCK_M − 1)) / BLOCK_M, so no host sync and the
   launch is CUDA-graph capturable; programs of the unused blocks exit at once.
2. `_gate_up_kernel`: per (block, BLOCK_N intermediate units) silu(x·Wg)·(x·Wu) with both
   accumulators in one program, stored per pair.
3. `_down_kernel`: per (block, BLOCK_N output columns) the down projection times the pair's routing
   weight, stored per pair.
4. `_sum_kernel`: out[t] = residual[t] + Σ_j of the token's valid pairs (ids outside [0, E) add nothing; no
   residual: 0), summed in fp32 and rounded once.

The GEMMs load their weight tiles through tensor descriptors (the copy engine: TMA) where `weights_tma_rule` says
(16-bit experts on sm_90+, row blocks of 64 or more), pointer loads elsewhere; the token rows are gathered by pointer
loads either way. With descriptors each GEMM is two launches, the routed experts' blocks and the shared ones'
(one descriptor each); a program whose block belongs to the other launch exits at once.

On sm_90+ every launch is a programmatic dependent launch (`ops.pdl`): each program waits for the kernel before
at its start (every input here, the expert ids and the pair tables, is written by an earlier kernel) and lets the
next kernel launch at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from specmla.ops.linear.reference import BLOCK, E4M3_MAX
from specmla.ops.linear.triton import act_quant, interpreting, quant_tile
from specmla.ops.moe.reference import check_residual
from specmla.ops.moe.tuning import Config, fit, fit_fp8, lookup, shared_memory
from specmla.ops.pdl import launch_dependents, pdl_args, wait
from specmla.ops.scratch import zeroed_scratch


@triton.jit
def _expert_of(IDS, p, P, stride_ids, E: tl.constexpr, TOP_K: tl.constexpr, S: tl.constexpr, DROP: tl.constexpr):
    """Expert slot of pair p (routed id, E + c for shared pseudo-expert c), DROP for invalid pairs."""
    t = p // S
    j = p % S
    routed = j < TOP_K
    e = tl.load(IDS + t * stride_ids + j, mask=(p < P) & routed, other=-1)
    ok = (p < P) & ((~routed) | ((e >= 0) & (e < E)))  # checked in the ids' own width
    e = tl.where(routed, e.to(tl.int32), E + j - TOP_K)
    return tl.where(ok, e, DROP)


@triton.jit
def _align_count_kernel(
    IDS, SORTED, BLOCK_EXPERT, REL, START, COUNTS, ARRIVED, P, stride_ids, max_blocks,
    E: tl.constexpr, TOP_K: tl.constexpr, N_SHARED: tl.constexpr, BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr, CH: tl.constexpr, BB: tl.constexpr, SINGLE: tl.constexpr, PDL: tl.constexpr,
):
    """Program c takes pairs c·CH..: reserves their rows inside each expert's run (atomic per-expert
    counts) and keeps each pair's rank there (REL). The last program to arrive turns the totals into
    the block table, the runs' first rows (START) and the padding rows, then zeroes the counts. With a
    single program (SINGLE) it also places the pairs."""
    wait(PDL)  # before the ids and the counts (the previous call's last program zeroes them)
    launch_dependents(PDL)
    S: tl.constexpr = TOP_K + N_SHARED
    DROP: tl.constexpr = E_PAD - 1  # bin of dropped pairs (E_PAD > E + N_SHARED)
    offs_e = tl.arange(0, E_PAD)
    offs_c = tl.arange(0, CH)
    p = tl.program_id(0) * CH + offs_c
    ex = _expert_of(IDS, p, P, stride_ids, E, TOP_K, S, DROP)
    hist = tl.histogram(ex, E_PAD)
    before = tl.atomic_add(COUNTS + offs_e, hist, sem="relaxed")
    rank = tl.sum(((ex[:, None] == ex[None, :]) & (offs_c[None, :] < offs_c[:, None])).to(tl.int32), 1)
    rel = tl.gather(before, ex, 0) + rank
    if not SINGLE:
        tl.store(REL + p, rel, mask=p < P)
        tl.debug_barrier()  # every thread's counts and ranks are issued before the arrival is announced
        if tl.atomic_add(ARRIVED, 1, sem="acq_rel") != tl.num_programs(0) - 1:
            return
    counts = tl.load(COUNTS + offs_e, cache_modifier=".cg")
    counts = tl.where(offs_e == DROP, 0, counts)
    nblk = (counts + BLOCK_M - 1) // BLOCK_M
    blk_end = tl.cumsum(nblk, 0)  # inclusive
    blk_start = blk_end - nblk
    total = tl.sum(nblk, 0)
    # block → expert: the number of experts whose run ends at or before the block
    for b0 in range(0, max_blocks, BB):
        b = b0 + tl.arange(0, BB)
        e_of_b = tl.sum((blk_end[None, :] <= b[:, None]).to(tl.int32), 1)
        tl.store(BLOCK_EXPERT + b, tl.where(b < total, e_of_b, -1), mask=b < max_blocks)
    # padding rows of each expert's last block point past the pairs (P: masked in the GEMMs)
    offs_r = tl.arange(0, BLOCK_M)
    pad_row = (blk_end * BLOCK_M - BLOCK_M)[:, None] + offs_r[None, :]
    is_pad = (nblk[:, None] > 0) & (pad_row >= (blk_start * BLOCK_M + counts)[:, None])
    tl.store(SORTED + pad_row, tl.zeros([E_PAD, BLOCK_M], dtype=tl.int32) + P, mask=is_pad)
    if SINGLE:
        dest = tl.gather(blk_start * BLOCK_M, ex, 0) + rel
        tl.store(SORTED + dest, p, mask=ex != DROP)
    else:
        tl.store(START + offs_e, blk_start * BLOCK_M)
        tl.store(ARRIVED, 0)
    tl.store(COUNTS + offs_e, tl.zeros([E_PAD], dtype=tl.int32))


@triton.jit
def _align_place_kernel(IDS, SORTED, REL, START, P, stride_ids,
                        E: tl.constexpr, TOP_K: tl.constexpr, N_SHARED: tl.constexpr, E_PAD: tl.constexpr,
                        CH: tl.constexpr, PDL: tl.constexpr):
    """Pair p goes to row START[its expert] + REL[p]."""
    wait(PDL)
    launch_dependents(PDL)
    p = tl.program_id(0) * CH + tl.arange(0, CH)
    ex = _expert_of(IDS, p, P, stride_ids, E, TOP_K, TOP_K + N_SHARED, E_PAD - 1)
    keep = ex != E_PAD - 1
    dest = tl.load(START + ex, mask=keep, other=0) + tl.load(REL + p, mask=keep, other=0)
    tl.store(SORTED + dest, p, mask=keep)


def max_blocks(pairs: int, expert_slots: int, block_m: int) -> int:
    """Upper bound of Σ_e ⌈n_e / block_m⌉ over experts with n_e pairs, Σ n_e ≤ pairs."""
    return (pairs + min(pairs, expert_slots) * (block_m - 1)) // block_m


MAX_EXPERT_SLOTS = 2047  # routed + shared pseudo-experts the align kernel's counts cover


def align_pairs(topk_ids: torch.Tensor, n_experts: int, n_shared: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] → (sorted_pairs int32 [max_blocks·block_m], block_expert int32 [max_blocks]):
    block b covers rows b·block_m.. of sorted_pairs, pairs of expert slot block_expert[b], padded with
    P = T·(k + n_shared); block_expert is -1 past the real blocks, whose rows are left unwritten. The
    order of pairs inside a run is unspecified (each row's result does not depend on it). One launch
    up to 256 pairs, two beyond."""
    T, k = topk_ids.shape
    P = T * (k + n_shared)
    nb = max_blocks(P, n_experts + n_shared, block_m)
    dev = topk_ids.device
    sorted_pairs = torch.empty(max(nb, 1) * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max(nb, 1), dtype=torch.int32, device=dev)
    if P == 0:
        block_expert.fill_(-1)
        return sorted_pairs, block_expert
    e_pad = triton.next_power_of_2(n_experts + n_shared + 1)
    single = P <= 256
    ch = max(16, triton.next_power_of_2(P)) if single else 128
    chunks = triton.cdiv(P, ch)
    scratch = zeroed_scratch("moe_align", MAX_EXPERT_SLOTS + 2, dev)  # counts [e_pad], then the arrivals word
    rel = torch.empty(1 if single else P, dtype=torch.int32, device=dev)
    start = torch.empty(e_pad, dtype=torch.int32, device=dev)
    const = dict(E=n_experts, TOP_K=k, N_SHARED=n_shared, E_PAD=e_pad, CH=ch)
    pdl = pdl_args(topk_ids)
    _align_count_kernel[(chunks,)](
        topk_ids, sorted_pairs, block_expert, rel, start, scratch, scratch[MAX_EXPERT_SLOTS + 1:], P, topk_ids.stride(0), nb,
        BLOCK_M=block_m, BB=64, SINGLE=single, **const, num_warps=4, **pdl,
    )
    if not single:
        _align_place_kernel[(chunks,)](topk_ids, sorted_pairs, rel, start, P, topk_ids.stride(0), **const,
                                       num_warps=4, **pdl)
    return sorted_pairs, block_expert


def align_pairs_torch(topk_ids: torch.Tensor, n_experts: int, n_shared: int, block_m: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `align_pairs` (rows past the real blocks are P here)."""
    T, k = topk_ids.shape
    S = k + n_shared
    P = T * S
    nb = max_blocks(P, n_experts + n_shared, block_m)
    shared_ids = n_experts + torch.arange(n_shared, device=topk_ids.device).expand(T, n_shared)
    ids = torch.cat([topk_ids.long(), shared_ids], 1).reshape(-1)
    valid = ids >= 0
    valid[: T * S].view(T, S)[:, :k] &= topk_ids < n_experts
    rows, experts = [], []
    for e in range(n_experts + n_shared):
        pairs = ((ids == e) & valid).nonzero().flatten().tolist()
        n = -(-len(pairs) // block_m)
        rows += pairs + [P] * (n * block_m - len(pairs))
        experts += [e] * n
    sorted_pairs = torch.full((max(nb, 1) * block_m,), P, dtype=torch.int32, device=topk_ids.device)
    sorted_pairs[: len(rows)] = torch.tensor(rows, dtype=torch.int32)
    block_expert = torch.full((max(nb, 1),), -1, dtype=torch.int32, device=topk_ids.device)
    block_expert[: len(experts)] = torch.tensor(experts, dtype=torch.int32)
    return sorted_pairs, block_expert


@triton.jit
def _block_rows(IDS, SORTED, BLOCK_EXPERT, pid_m, P, stride_ids,
                E: tl.constexpr, TOP_K: tl.constexpr, S: tl.constexpr, BLOCK_M: tl.constexpr,
                PAIR_BLOCKS: tl.constexpr):
    """(expert slot or -1, pair ids [BLOCK_M], row mask) of block pid_m."""
    offs_m = tl.arange(0, BLOCK_M)
    if PAIR_BLOCKS:  # block b is pair b alone
        e = _expert_of(IDS, pid_m, P, stride_ids, E, TOP_K, S, -1)
        rows = pid_m + offs_m * 0
        row_ok = offs_m == 0
    else:
        e = tl.load(BLOCK_EXPERT + pid_m)
        rows = tl.load(SORTED + pid_m * BLOCK_M + offs_m)
        row_ok = rows < P
    return e, rows, row_ok


@triton.jit
def _tile_ids(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M consecutive row blocks sweep the column tiles together (L2 reuse)."""
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _gate_up_slices(e, I, Is, H, shared_gu_off, E: tl.constexpr):
    """Where expert slot e's gate and up rows start (elements from the routed gate‖up base) and how many units it
    has. Shared pseudo-expert c = e − E: gate rows c·I.., up rows Is + c·I.. of the shared gate‖up (at
    shared_gu_off); one base pointer plus a selected offset keeps the loads' alignment known to the compiler."""
    routed = e < E
    c = e - E
    g_off = tl.where(routed, e.to(tl.int64) * (2 * I * H), shared_gu_off + c.to(tl.int64) * I * H)
    u_off = tl.where(routed, g_off + I * H, shared_gu_off + (Is + c.to(tl.int64) * I) * H)
    n_lim = tl.where(routed, I, tl.minimum(I, Is - c * I))
    return routed, c, g_off, u_off, n_lim


@triton.jit
def _down_slice(e, I, Is, H, shared_down_off, E: tl.constexpr):
    """Where expert slot e's down projection starts (elements from the routed base), its row stride and its K
    extent. Shared pseudo-expert c = e − E: columns c·I.. of the shared down projection [H, Is] (at
    shared_down_off)."""
    routed = e < E
    c = e - E
    b_off = tl.where(routed, e.to(tl.int64) * H * I, shared_down_off + c.to(tl.int64) * I)
    rs = tl.where(routed, I, Is)
    k_lim = tl.where(routed, I, tl.minimum(I, Is - c * I))
    return routed, c, b_off, rs, k_lim


@triton.jit
def _row_tile(a_ptrs, row_ok, k0, k_lim, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The activation tile at a_ptrs (columns k0..k0 + BLOCK_K): rows outside row_ok and, unless EVEN_K, columns
    past k_lim read as zero."""
    mask = row_ok[:, None]
    if not EVEN_K:
        mask = mask & (tl.arange(0, BLOCK_K) + k0 < k_lim)[None, :]
    return tl.load(a_ptrs, mask=mask, other=0.0)


@triton.jit
def _gate_up_tma(a_ptrs, row_ok, W_DESC, g_row, u_row, H, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """(x·Wgᵀ, x·Wuᵀ) of one tile, the weight tiles [BLOCK_N, BLOCK_K] at rows g_row / u_row of W_DESC (a tensor
    descriptor: the copy engine loads them; rows past the tensor and columns past H read as zero, rows past the
    expert's units only feed output columns the caller does not store)."""
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        a = _row_tile(a_ptrs, row_ok, k0, H, BLOCK_K, EVEN_K)
        wg = W_DESC.load([g_row, k0])
        wu = W_DESC.load([u_row, k0])
        acc_g = tl.dot(a, wg.T, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, wu.T, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
    return acc_g, acc_u


@triton.jit
def _down_tma(a_ptrs, row_ok, W_DESC, n_row, k_col, k_lim, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """h·Wdᵀ of one tile over K < k_lim, the weight tiles [BLOCK_N, BLOCK_K] at (n_row, k_col + k) of W_DESC. The
    activations past k_lim are masked to zero and the weight columns there are the descriptor's zero fill or the next
    shared pseudo-expert's finite values, so they add nothing."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_lim, BLOCK_K):
        a = _row_tile(a_ptrs, row_ok, k0, k_lim, BLOCK_K, EVEN_K)
        b = W_DESC.load([n_row, k_col + k0])
        acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
    return acc


@triton.jit
def _gate_up_kernel(
    X, IDS, SORTED, BLOCK_EXPERT, WGU, HB, W_DESC,
    P, H, I, Is, shared_gu_off, num_m, stride_ids, stride_x, stride_hb, slot_lo, slot_hi,
    E: tl.constexpr, TOP_K: tl.constexpr, N_SHARED: tl.constexpr, PAIR_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, W_TMA: tl.constexpr, PDL: tl.constexpr,
):
    """The launch covers the blocks of expert slots slot_lo ≤ e < slot_hi. W_TMA: the weight tiles come through the
    tensor descriptor W_DESC — the routed gate‖up as [E·2I, H] when the slots are routed experts, the shared gate‖up
    [2·Is, H] when they are shared pseudo-experts (one descriptor per launch: a kernel choosing between two at run
    time holds both pipelines' shared memory); else by pointer loads from WGU."""
    S: tl.constexpr = TOP_K + N_SHARED
    wait(PDL)  # before the block's expert (and its early exits)
    launch_dependents(PDL)
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    e, rows, row_ok = _block_rows(IDS, SORTED, BLOCK_EXPERT, pid_m, P, stride_ids, E, TOP_K, S, BLOCK_M,
                                  PAIR_BLOCKS)
    if e < 0:
        return
    if e < slot_lo:
        return
    if e >= slot_hi:
        return
    routed, c, g_off, u_off, n_lim = _gate_up_slices(e, I, Is, H, shared_gu_off, E)
    if pid_n * BLOCK_N >= n_lim:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_lim
    offs_k = tl.arange(0, BLOCK_K)
    tok = rows // S
    a_ptrs = X + tok[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    if W_TMA:  # routed: gate rows e·2I + n, up rows e·2I + I + n; shared: c·I + n and Is + c·I + n
        g_row = tl.where(routed, e * (2 * I), c * I) + pid_n * BLOCK_N
        acc_g, acc_u = _gate_up_tma(a_ptrs, row_ok, W_DESC, g_row, g_row + tl.where(routed, I, Is), H,
                                    BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
    else:
        g_ptrs = WGU + g_off + offs_n[None, :].to(tl.int64) * H + offs_k[:, None]
        u_ptrs = WGU + u_off + offs_n[None, :].to(tl.int64) * H + offs_k[:, None]
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                wg = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
                wu = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = offs_k + k0 < H
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                wg = tl.load(g_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
                wu = tl.load(u_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc_g = tl.dot(a, wg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, wu, acc_u, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out = HB + rows[:, None].to(tl.int64) * stride_hb + offs_n[None, :]
    tl.store(out, h.to(HB.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    HB, IDS, WTS, SORTED, BLOCK_EXPERT, WD, OUT, W_DESC,
    P, H, I, Is, shared_down_off, num_m, stride_ids, stride_wts, stride_hb, stride_o, slot_lo, slot_hi,
    E: tl.constexpr, TOP_K: tl.constexpr, N_SHARED: tl.constexpr, PAIR_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, W_TMA: tl.constexpr, PDL: tl.constexpr,
):
    """Slots and W_TMA as in `_gate_up_kernel`: W_DESC is the routed down projections as [E·H, I] or the shared
    one, [H, Is]."""
    S: tl.constexpr = TOP_K + N_SHARED
    wait(PDL)  # before the block's expert (and its early exit)
    launch_dependents(PDL)
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_m, tl.cdiv(H, BLOCK_N), GROUP_M)
    e, rows, row_ok = _block_rows(IDS, SORTED, BLOCK_EXPERT, pid_m, P, stride_ids, E, TOP_K, S, BLOCK_M,
                                  PAIR_BLOCKS)
    if e < 0:
        return
    if e < slot_lo:
        return
    if e >= slot_hi:
        return
    routed, c, b_off, rs, k_lim = _down_slice(e, I, Is, H, shared_down_off, E)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = HB + rows[:, None].to(tl.int64) * stride_hb + offs_k[None, :]
    if W_TMA:  # routed: rows e·H + n, columns k; shared: rows n, columns c·I + k
        acc = _down_tma(a_ptrs, row_ok, W_DESC, tl.where(routed, e * H, 0) + pid_n * BLOCK_N,
                        tl.where(routed, 0, c * I), k_lim, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
    else:
        b_ptrs = WD + b_off + offs_n[None, :].to(tl.int64) * rs + offs_k[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, k_lim, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = offs_k + k0 < k_lim
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
    j = rows % S
    w = tl.load(WTS + (rows // S) * stride_wts + j, mask=row_ok & (j < TOP_K), other=1.0)
    acc = acc * w[:, None]
    out = OUT + rows[:, None].to(tl.int64) * stride_o + offs_n[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_kernel(Y, IDS, RES, OUT, T, H, stride_ids, stride_y, stride_r, stride_o,
                E: tl.constexpr, TOP_K: tl.constexpr, N_SHARED: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_H: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr):
    """out = residual + Σ_j of the token's valid pairs (HAS_RES; else just the sum), fp32, one rounding at the end."""
    S: tl.constexpr = TOP_K + N_SHARED
    wait(PDL)
    launch_dependents(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = offs_t < T
    m = t_ok[:, None] & (offs_h < H)[None, :]
    if HAS_RES:
        # OUT may be RES itself (the residual stream updated in place): every element of RES is read only by the
        # program that writes that element of OUT, and its store depends on this load, so a row's residual is
        # always read before the row is written. (A partial overlap of OUT and RES is not supported.)
        acc = tl.load(RES + offs_t[:, None].to(tl.int64) * stride_r + offs_h[None, :], mask=m,
                      other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(S):
        if j < TOP_K:
            e = tl.load(IDS + offs_t * stride_ids + j, mask=t_ok, other=-1)
            ok = (e >= 0) & (e < E)
        else:
            ok = t_ok
        y = tl.load(Y + (offs_t * S + j)[:, None].to(tl.int64) * stride_y + offs_h[None, :],
                    mask=m & ok[:, None], other=0.0)
        acc += y.to(tl.float32)
    tl.store(OUT + offs_t[:, None].to(tl.int64) * stride_o + offs_h[None, :], acc.to(OUT.dtype.element_ty), mask=m)


def _offset(t: torch.Tensor, base: torch.Tensor) -> int:
    """Elements from base's storage to t's (the kernels reach the shared weights through the routed pointer)."""
    delta = t.data_ptr() - base.data_ptr()
    if delta % t.element_size():
        raise ValueError("fused_moe: shared and routed weights must be aligned to their element size")
    return delta // t.element_size()


def _unit_stride_residual(residual, x):
    """The residual as [T, H] rows contiguous in H (a copy if it is not), after checking it fits x."""
    check_residual(residual, x)
    if residual is None:
        return None
    return residual if residual.stride(-1) == 1 else residual.contiguous()


def _launch_sum(y, ids, residual, out, E: int, k: int, n_shared: int, pdl: dict) -> None:
    """out = residual (if any) + the per-pair outputs y of each token's valid slots."""
    T, H = out.shape
    block_t, block_h = (1, 1024) if T <= 16 else (4, 256)
    res = residual if residual is not None else out  # (not read without a residual)
    _sum_kernel[(triton.cdiv(T, block_t), triton.cdiv(H, block_h))](
        y, ids, res, out, T, H, ids.stride(0), y.stride(0), res.stride(0), out.stride(0),
        E=E, TOP_K=k, N_SHARED=n_shared, BLOCK_T=block_t, BLOCK_H=block_h, HAS_RES=residual is not None,
        num_warps=4, **pdl,
    )


def shared_slots(shared, inter: int) -> int:
    """Pseudo-experts of width `inter` the shared experts make (0 without shared experts)."""
    return 0 if shared is None else triton.cdiv(shared[1].shape[1], inter)


TMA_MIN_BLOCK_M = 64  # weight tiles through tensor descriptors from this row block up (measured faster there)


def _tma_ready(*weights: torch.Tensor) -> bool:
    """Whether tensor descriptors can cover these contiguous weights: 16-byte aligned bases and rows."""
    return all(w.data_ptr() % 16 == 0 and (w.shape[-1] * w.element_size()) % 16 == 0 for w in weights)


def prefers_weight_tma(block_m: int, dtype: torch.dtype) -> bool:
    """The measured half of `weights_tma_rule`: 16-bit experts in row blocks of ≥ TMA_MIN_BLOCK_M rows (prefill
    sizes, where descriptors measured faster on an H200; the narrow decode blocks keep pointer loads)."""
    return block_m >= TMA_MIN_BLOCK_M and dtype in (torch.bfloat16, torch.float16)


def weights_tma_rule(x: torch.Tensor, block_m: int, *weights: torch.Tensor) -> bool:
    """Whether the grouped GEMMs load their weight tiles through tensor descriptors (the copy engine, TMA) by
    default: compiled on sm_90+, `prefers_weight_tma`, weights `_tma_ready`."""
    return (x.is_cuda and not interpreting() and prefers_weight_tma(block_m, x.dtype)
            and torch.cuda.get_device_capability(x.device)[0] >= 9 and _tma_ready(*weights))


def _gemm_passes(weights_tma: bool, E: int, n_shared: int, w_gate_up, w_down, shared, up_cfg: Config,
                 down_cfg: Config) -> list[tuple]:
    """The GEMM launches as (first slot, end slot, gate‖up descriptor, down descriptor): all slots by pointer loads,
    or with descriptors the routed experts [0, E) and the shared pseudo-experts [E, E + n_shared) apart."""
    if not weights_tma:
        return [(0, E + n_shared, None, None)]
    _, twoI, H = w_gate_up.shape
    I = twoI // 2
    up_tile, down_tile = [up_cfg.block_n, up_cfg.block_k], [down_cfg.block_n, down_cfg.block_k]
    parts = [(0, E, w_gate_up.view(E * 2 * I, H), w_down.view(E * H, I))]
    if n_shared:
        parts.append((E, E + n_shared, *shared))
    return [(lo, hi, TensorDescriptor.from_tensor(gu, up_tile), TensorDescriptor.from_tensor(dn, down_tile))
            for lo, hi, gu, dn in parts]


def fused_moe_triton(x, w_gate_up, w_down, topk_weights, topk_ids, *, shared=None, out=None, residual=None,
                     up_config: Config | None = None, down_config: Config | None = None,
                     weights_tma: bool | None = None):
    """`fused_moe` on bf16 / fp16 / fp32 experts (tile configurations from `tuning.lookup` unless given).
    residual [T, H] (x's dtype): out = residual + the MoE, added in the sum's fp32 accumulator; out may be
    residual itself. weights_tma: load the weight tiles through tensor descriptors (True, which also runs under the
    interpreter; ValueError where the weights are not `_tma_ready`), by pointer loads (False), or as
    `weights_tma_rule` says (None). Both multiply the same tiles in the same K order."""
    T, H = x.shape
    E = w_gate_up.shape[0]
    I = w_down.shape[2]
    if x.stride(-1) != 1 or not all(w.is_contiguous() for w in (w_gate_up, w_down, *(shared or ()))):
        raise ValueError("fused_moe: the expert weights must be contiguous and x contiguous in its last dimension")
    if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype or any(w.dtype != x.dtype for w in shared or ()):
        raise ValueError(f"fused_moe: expert weights must have x's dtype {x.dtype}")
    k = topk_ids.shape[1]
    n_shared = shared_slots(shared, I)
    if E + n_shared > MAX_EXPERT_SLOTS:
        raise ValueError(f"fused_moe: at most {MAX_EXPERT_SLOTS} routed + shared expert slots, got {E + n_shared}")
    P = T * (k + n_shared)
    residual = _unit_stride_residual(residual, x)
    if out is None:
        out = torch.empty_like(x)
    elif out.stride(-1) != 1:  # the sum writes rows contiguous in H: go through a temporary
        return out.copy_(fused_moe_triton(x, w_gate_up, w_down, topk_weights, topk_ids, shared=shared,
                                          residual=residual, up_config=up_config, down_config=down_config,
                                          weights_tma=weights_tma))
    if T == 0:
        return out
    shared_gu, shared_down = shared if shared is not None else (w_gate_up, w_down)
    Is = shared_down.shape[1] if shared is not None else 0
    ids = topk_ids if topk_ids.stride(1) == 1 else topk_ids.contiguous()
    wts = topk_weights if topk_weights.stride(1) == 1 else topk_weights.contiguous()
    smem = shared_memory(x.device)
    up_cfg = fit(up_config or lookup("up", E, I, H, T, x.device, k), x.element_size(), 2, smem)
    down_cfg = fit(down_config or lookup("down", E, H, I, T, x.device, k), x.element_size(), 1, smem)
    weights = (w_gate_up, w_down, *(shared or ()))
    if weights_tma is None:
        weights_tma = T != 1 and weights_tma_rule(x, up_cfg.block_m, *weights)
    elif weights_tma and not _tma_ready(*weights):
        raise ValueError("fused_moe: weights_tma needs 16-byte aligned weights whose rows are multiples of 16 bytes")
    pair_blocks = T == 1  # every pair its own block: no align launch
    if pair_blocks:
        sorted_pairs = block_expert = ids
        num_blocks = P
    else:
        if up_cfg.block_m != down_cfg.block_m:
            raise ValueError("fused_moe: the up and down configurations must share block_m")
        sorted_pairs, block_expert = align_pairs(ids, E, n_shared, up_cfg.block_m)
        num_blocks = block_expert.shape[0]
    hb = torch.empty(P, I, dtype=x.dtype, device=x.device)
    y = torch.empty(P, H, dtype=x.dtype, device=x.device)
    pdl = pdl_args(x)
    # fp32 experts multiply in fp32 ("ieee"), not Triton's default tf32
    common = dict(E=E, TOP_K=k, N_SHARED=n_shared, PAIR_BLOCKS=pair_blocks,
                  PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **pdl)

    def tiles(c: Config) -> dict:
        return dict(BLOCK_M=16 if pair_blocks else c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                    GROUP_M=c.group_m, num_warps=c.num_warps, num_stages=c.num_stages)

    passes = _gemm_passes(weights_tma, E, n_shared, w_gate_up, w_down, shared, up_cfg, down_cfg)
    for lo, hi, desc, _ in passes:
        _gate_up_kernel[(num_blocks * triton.cdiv(I, up_cfg.block_n),)](
            x, ids, sorted_pairs, block_expert, w_gate_up, hb, desc,
            P, H, I, Is, _offset(shared_gu, w_gate_up), num_blocks, ids.stride(0), x.stride(0), hb.stride(0), lo, hi,
            **common, **tiles(up_cfg), EVEN_K=H % up_cfg.block_k == 0, W_TMA=weights_tma,
        )
    for lo, hi, _, desc in passes:
        _down_kernel[(num_blocks * triton.cdiv(H, down_cfg.block_n),)](
            hb, ids, wts, sorted_pairs, block_expert, w_down, y, desc,
            P, H, I, Is, _offset(shared_down, w_down), num_blocks, ids.stride(0), wts.stride(0), hb.stride(0),
            y.stride(0), lo, hi, **common, **tiles(down_cfg),
            EVEN_K=I % down_cfg.block_k == 0 and (shared is None or Is % I == 0), W_TMA=weights_tma,
        )
    _launch_sum(y, ids, residual, out, E, k, n_shared, pdl)
    return out


# ---- float8 block-scaled experts (w8a8) --------------------------------------------------------------------
# The same pipeline on float8_e4m3fn experts with fp32 scales per 128 × 128 weight block:
# 0. `ops.linear`'s `act_quant`: x per token and group of 128 columns → e4m3 + scale amax / 448 (DeepSeek's);
# 1. `_gate_up_fp8_kernel`: e4m3 × e4m3 dots per K step of 128, each product scaled by the token's group scale and
#    the weight block's scale, accumulated in fp32; silu(gate)·up is quantised per pair and group of 128 units
#    (one program owns one group: block_n = 128) and stored as e4m3 + scales;
# 2. `_down_fp8_kernel`: the same on the quantised intermediate and w_down, times the routing weight;
# 3. `_sum_kernel` as above.
QBLOCK = BLOCK  # the weight scale block and the activation group
_E4M3_MAX = tl.constexpr(E4M3_MAX)


@triton.jit
def _gate_up_fp8_kernel(
    XQ, XS, IDS, SORTED, BLOCK_EXPERT, WGU, WS, HQ, HS,
    P, H, I, Is, shared_gu_off, shared_s_off, num_m, stride_ids, stride_xq, stride_xs, stride_hq, stride_hs,
    E: tl.constexpr, TOP_K: tl.constexpr, N_SHARED: tl.constexpr, PAIR_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr,
):
    """Program (block, n): units n·128.. of the block's expert; I and Is are multiples of 128 (= BLOCK_N = BLOCK_K).
    Weight scales: WS [E, 2I/128, KB] (routed) and, at WS + shared_s_off, [2Is/128, KB] (shared), KB = ⌈H/128⌉."""
    S: tl.constexpr = TOP_K + N_SHARED
    wait(PDL)  # before the block's expert (and its early exits)
    launch_dependents(PDL)
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    e, rows, row_ok = _block_rows(IDS, SORTED, BLOCK_EXPERT, pid_m, P, stride_ids, E, TOP_K, S, BLOCK_M,
                                  PAIR_BLOCKS)
    if e < 0:
        return
    routed, c, g_off, u_off, n_lim = _gate_up_slices(e, I, Is, H, shared_gu_off, E)
    if pid_n * BLOCK_N >= n_lim:
        return
    KB = tl.cdiv(H, BLOCK_K)
    NB = I // BLOCK_N  # scale rows of one routed expert's gate (and of its up)
    c64 = c.to(tl.int64)  # (the shared offsets span two allocations: int64 before any product)
    gs_off = tl.where(routed, (e.to(tl.int64) * 2 * NB + pid_n) * KB, shared_s_off + (c64 * NB + pid_n) * KB)
    us_off = tl.where(routed, gs_off + NB * KB, shared_s_off + (Is // BLOCK_N + c64 * NB + pid_n) * KB)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    tok = rows // S
    a_ptrs = XQ + tok[:, None].to(tl.int64) * stride_xq + offs_k[None, :]
    as_ptrs = XS + tok.to(tl.int64) * stride_xs
    g_ptrs = WGU + g_off + offs_n[None, :].to(tl.int64) * H + offs_k[:, None]
    u_ptrs = WGU + u_off + offs_n[None, :].to(tl.int64) * H + offs_k[:, None]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, KB):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            wg = tl.load(g_ptrs)
            wu = tl.load(u_ptrs)
        else:
            k_ok = offs_k + kb * BLOCK_K < H
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            wu = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=row_ok, other=0.0)
        sg = tl.load(WS + gs_off + kb)
        su = tl.load(WS + us_off + kb)
        acc_g += tl.dot(a, wg) * (a_s * sg)[:, None]
        acc_u += tl.dot(a, wu) * (a_s * su)[:, None]
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    q, s = quant_tile(h, _E4M3_MAX, INTERP)
    tl.store(HQ + rows[:, None].to(tl.int64) * stride_hq + offs_n[None, :], q, mask=row_ok[:, None])
    tl.store(HS + rows.to(tl.int64) * stride_hs + pid_n, s, mask=row_ok)


@triton.jit
def _down_fp8_kernel(
    HQ, HS, IDS, WTS, SORTED, BLOCK_EXPERT, WD, WS, OUT,
    P, H, I, Is, shared_down_off, shared_s_off, num_m, stride_ids, stride_wts, stride_hq, stride_hs, stride_o,
    E: tl.constexpr, TOP_K: tl.constexpr, N_SHARED: tl.constexpr, PAIR_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
):
    """Program (block, n): output columns n·BLOCK_N.. (the last block partial when H is no multiple of it).
    Weight scales: WS [E, ⌈H/128⌉, I/128] (routed) and, at WS + shared_s_off, [⌈H/128⌉, Is/128] (shared)."""
    S: tl.constexpr = TOP_K + N_SHARED
    wait(PDL)  # before the block's expert (and its early exit)
    launch_dependents(PDL)
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_m, tl.cdiv(H, BLOCK_N), GROUP_M)
    e, rows, row_ok = _block_rows(IDS, SORTED, BLOCK_EXPERT, pid_m, P, stride_ids, E, TOP_K, S, BLOCK_M,
                                  PAIR_BLOCKS)
    if e < 0:
        return
    routed, c, b_off, rs, k_lim = _down_slice(e, I, Is, H, shared_down_off, E)
    NB = I // BLOCK_K
    s_off = tl.where(routed, e.to(tl.int64) * tl.cdiv(H, BLOCK_K) * NB, shared_s_off + c.to(tl.int64) * NB)
    s_rs = tl.where(routed, NB, Is // BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = HQ + rows[:, None].to(tl.int64) * stride_hq + offs_k[None, :]
    as_ptrs = HS + rows.to(tl.int64) * stride_hs
    b_ptrs = WD + b_off + offs_n[None, :].to(tl.int64) * rs + offs_k[:, None]
    bs_ptrs = WS + s_off + (offs_n // BLOCK_K) * s_rs
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, k_lim // BLOCK_K):
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=row_ok, other=0.0)
        b_s = tl.load(bs_ptrs + kb, mask=n_ok, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    j = rows % S
    w = tl.load(WTS + (rows // S) * stride_wts + j, mask=row_ok & (j < TOP_K), other=1.0)
    acc = acc * w[:, None]
    out = OUT + rows[:, None].to(tl.int64) * stride_o + offs_n[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _empty(shape, dtype, device) -> torch.Tensor:
    """The fp8 path's per-call intermediates (tests fill them with NaN through this hook)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check_fp8(x, w_gate_up, w_down, w_gate_up_scale, w_down_scale, shared, shared_scales, up, down) -> None:
    """The fp8 Triton path's own requirements (check_moe_args has checked the shapes)."""
    E, two_i, H = w_gate_up.shape
    I = two_i // 2
    FP8 = torch.float8_e4m3fn
    weights = (w_gate_up, w_down, *(shared or ()))
    if any(w.dtype != FP8 for w in weights):
        raise ValueError("fused_moe: the fp8 Triton path needs float8_e4m3fn routed and shared experts alike")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fused_moe: x must be bf16, fp16 or fp32 with fp8 experts, got {x.dtype}")
    Is = shared[1].shape[1] if shared is not None else 0
    if I % QBLOCK or Is % QBLOCK:
        raise ValueError(f"fused_moe: the fp8 Triton path needs I and Is multiples of {QBLOCK} (pad the experts at "
                         f"load), got I={I}, Is={Is}")
    kb = triton.cdiv(H, QBLOCK)
    want = [("w_gate_up_scale", w_gate_up_scale, (E, 2 * I // QBLOCK, kb)),
            ("w_down_scale", w_down_scale, (E, kb, I // QBLOCK))]
    if shared is not None:
        want += [("shared_scales[0]", shared_scales[0], (2 * Is // QBLOCK, kb)),
                 ("shared_scales[1]", shared_scales[1], (kb, Is // QBLOCK))]
    for name, s, shape in want:
        if tuple(s.shape) != shape or s.dtype != torch.float32 or not s.is_contiguous():
            raise ValueError(f"fused_moe: {name} must be contiguous float32 {list(shape)}, got {s.dtype} "
                             f"{tuple(s.shape)}")
    if x.stride(-1) != 1 or not all(w.is_contiguous() for w in weights):
        raise ValueError("fused_moe: the expert weights must be contiguous and x contiguous in its last dimension")
    if len({t.device for t in (x, *weights, w_gate_up_scale, w_down_scale, *(shared_scales or ()))}) != 1:
        raise ValueError("fused_moe: x, the experts and their scales must be on one device")
    for name, cfg in (("up_config", up), ("down_config", down)):
        if cfg.block_k != QBLOCK or (name == "up_config" and cfg.block_n != QBLOCK):
            raise ValueError(f"fused_moe: fp8 {name} needs block_k = {QBLOCK}" +
                             (f" and block_n = {QBLOCK}" if name == "up_config" else "") + f", got {cfg}")
    if up.block_m != down.block_m:
        raise ValueError("fused_moe: the up and down configurations must share block_m")


def fused_moe_fp8_triton(x, w_gate_up, w_down, topk_weights, topk_ids, *, w_gate_up_scale, w_down_scale,
                         shared=None, shared_scales=None, out=None, residual=None, up_config: Config | None = None,
                         down_config: Config | None = None):
    """`fused_moe` on float8_e4m3fn experts with fp32 128 × 128 block scales, w8a8: x and the intermediate are
    quantised per token (pair) and group of 128 columns, the products are e4m3 dots scaled per K step of 128 and
    accumulated in fp32; bf16 / fp16 / fp32 x, out in x's dtype. Needs I and Is multiples of 128 (H may be any).
    Tile configurations from `tuning.lookup("up_fp8" / "down_fp8", ...)` unless given (block_k 128; up block_n
    128; shared block_m). residual: as `fused_moe_triton`'s."""
    T, H = x.shape
    E = w_gate_up.shape[0]
    I = w_down.shape[2]
    k = topk_ids.shape[1]
    smem = shared_memory(x.device)
    up_cfg = fit_fp8(up_config or lookup("up_fp8", E, I, H, T, x.device, k), 2, smem)
    down_cfg = fit_fp8(down_config or lookup("down_fp8", E, H, I, T, x.device, k), 1, smem)
    _check_fp8(x, w_gate_up, w_down, w_gate_up_scale, w_down_scale, shared, shared_scales, up_cfg, down_cfg)
    n_shared = shared_slots(shared, I)
    if E + n_shared > MAX_EXPERT_SLOTS:
        raise ValueError(f"fused_moe: at most {MAX_EXPERT_SLOTS} routed + shared expert slots, got {E + n_shared}")
    P = T * (k + n_shared)
    residual = _unit_stride_residual(residual, x)
    if out is None:
        out = torch.empty_like(x)
    elif out.stride(-1) != 1:  # the sum writes rows contiguous in H: go through a temporary
        return out.copy_(fused_moe_fp8_triton(
            x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale=w_gate_up_scale,
            w_down_scale=w_down_scale, shared=shared, shared_scales=shared_scales, residual=residual,
            up_config=up_config, down_config=down_config))
    if T == 0:
        return out
    shared_gu, shared_down = shared if shared is not None else (w_gate_up, w_down)
    shared_gu_s, shared_down_s = shared_scales if shared is not None else (w_gate_up_scale, w_down_scale)
    Is = shared_down.shape[1] if shared is not None else 0
    ids = topk_ids if topk_ids.stride(1) == 1 else topk_ids.contiguous()
    wts = topk_weights if topk_weights.stride(1) == 1 else topk_weights.contiguous()
    pair_blocks = T == 1
    if pair_blocks:
        sorted_pairs = block_expert = ids
        num_blocks = P
    else:
        sorted_pairs, block_expert = align_pairs(ids, E, n_shared, up_cfg.block_m)
        num_blocks = block_expert.shape[0]
    pdl = pdl_args(x)
    xq, xs = act_quant(x, pdl=pdl["PDL"])
    hq = _empty((P, I), torch.float8_e4m3fn, x.device)
    hs = _empty((P, I // QBLOCK), torch.float32, x.device)
    y = _empty((P, H), x.dtype, x.device)
    common = dict(E=E, TOP_K=k, N_SHARED=n_shared, PAIR_BLOCKS=pair_blocks, **pdl)

    def tiles(c: Config) -> dict:
        return dict(BLOCK_M=16 if pair_blocks else c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                    GROUP_M=c.group_m, num_warps=c.num_warps, num_stages=c.num_stages)

    _gate_up_fp8_kernel[(num_blocks * (I // QBLOCK),)](
        xq, xs, ids, sorted_pairs, block_expert, w_gate_up, w_gate_up_scale, hq, hs,
        P, H, I, Is, _offset(shared_gu, w_gate_up), _offset(shared_gu_s, w_gate_up_scale), num_blocks,
        ids.stride(0), xq.stride(0), xs.stride(0), hq.stride(0), hs.stride(0),
        **common, **tiles(up_cfg), EVEN_K=H % QBLOCK == 0, INTERP=interpreting(),
    )
    _down_fp8_kernel[(num_blocks * triton.cdiv(H, down_cfg.block_n),)](
        hq, hs, ids, wts, sorted_pairs, block_expert, w_down, w_down_scale, y,
        P, H, I, Is, _offset(shared_down, w_down), _offset(shared_down_s, w_down_scale), num_blocks,
        ids.stride(0), wts.stride(0), hq.stride(0), hs.stride(0), y.stride(0), **common, **tiles(down_cfg),
    )
    _launch_sum(y, ids, residual, out, E, k, n_shared, pdl)
    return out
