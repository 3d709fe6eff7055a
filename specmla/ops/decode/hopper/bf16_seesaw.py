"""Hopper MLA decode for 16-bit caches with two warp-specialised warpgroups (FlashMLA's "seesaw" schedule).

Each warpgroup runs its own program (`gl.warp_specialize`) and owns alternate 64-key blocks
(docs/20250422-new-kernel-deep-dive.md in deepseek-ai/FlashMLA): warpgroup w computes S = Q·K_jᵀ for its
block j (all 64 keys, N = 64), runs that block's softmax while the other warpgroup's matmuls run, and
multiplies P_j by its half of V_j's Dc columns straight from registers; P_j also goes through shared memory
so the other warpgroup multiplies it by the other half. O stays split by columns. Both warpgroups read Q
once per block, and the softmax of one overlaps the tensor-core work of the other.

Online softmax across the two instruction streams: the running row max m passes between them
through shared memory, in block order. Warpgroup 0's block 2r takes m from block 2r-1, warpgroup 1's
block 2r+1 takes it from block 2r. Each publishes its block's rescale factor. Warpgroup 0 rescales
its P by warpgroup 1's factor before handing it over, so both halves of O always sit at the newest
max. Each warpgroup sums the rows of its own blocks' P; the two sums meet at the end.

Shared memory (bf16, Dc = 512, Dr = 64): Q 72 KB + two key stages of 72 KB. A warpgroup loads its
own stage (by TMA where pages hold whole 64-key blocks: [64, 64] boxes on one mbarrier per batch, rows past
the end zeroed once landed; else cp.async, rows past the end zero-filled, one group per 64-column chunk) in two batches:
its own half of the columns, free as soon as its own P·V is done, then the other half and the rope
part, free once the other warpgroup's P·V has read them. P_j is stored in stage j's rope columns,
which only S_j reads. The next S consumes the chunks in that order, each as it lands. mbarriers
(one arrival per warpgroup) order the hand-offs; each completes once per round of two blocks, so
every wait uses the round's parity.

Grid, split rule and partial layout are the Triton split kernel's (its combine merges the splits); Dr must be
64 and Dc a multiple of 128 up to 512.
"""

from __future__ import annotations

import dataclasses

import torch

from specmla.ops.decode.hopper import bf16
from specmla.ops.decode.hopper import common as G

if G.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # renamed after Triton 3.6

    _cp_async, _cta_barrier = G._cp_async, G._cta_barrier

_SOURCE_KEY = G.source_key(__file__) ^ G.source_key(G.__file__)  # in the kernel's cache key (G.source_key)

# mbarrier slots: one arrival each (a warpgroup's elected thread after a warpgroup-wide sync)
_c = getattr(gl, "constexpr", int) if G.HAVE_GLUON else int
M_READY = _c(0)  # +w: warpgroup w published its block's max and rescale factor
P_READY = _c(2)  # +w: warpgroup w's P is in its stage's rope buffer
KV_FREE = _c(4)  # +w: the other warpgroup is done reading stage w
L_READY = _c(6)  # +w: warpgroup w's row sums are in shared memory (after the last round)
Q_READY = _c(8)  # Q has landed (loaded by warpgroup 0)
OWN_LANDED = _c(9)  # +w (TMA loads): stage w's own half of the latent columns has landed
REST_LANDED = _c(11)  # +w (TMA loads): stage w's other half and rope part have landed
NUM_BARRIERS = _c(13)
BLOCK_N = 64  # keys per block: P_j [64 rows, BLOCK_N] lives in block j's rope buffer, so Dr = BLOCK_N


@dataclasses.dataclass(frozen=True)
class Options:
    """The seesaw kernel's tuning knobs; the defaults are the measured best."""
    worker_regs: int = 240  # registers per thread of each warpgroup's partition
    # key blocks by TMA (one thread issues [64, 64] boxes) instead of every thread's cp.async; None: TMA wherever the
    # cache takes it (`takes_tma`), which matches cp.async with one head block and is 3-6 % faster with several
    tma: bool | None = None


if G.HAVE_GLUON:

    @gluon.jit
    def _load_chunks(KV, stage_c, stage_r, page_rows, n_ok, C0: gl.constexpr, NC: gl.constexpr,
                     ROPE: gl.constexpr, DC: gl.constexpr, CHUNK: gl.constexpr, PER_CHUNK: gl.constexpr):
        """cp.async 64-column chunks C0 .. C0+NC-1 of one key block (then its rope part when ROPE)
        into a stage, rows not n_ok zero-filled; PER_CHUNK: one cp.async group per chunk (else one group)."""
        cols = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, CHUNK)), 0)
        rows = KV + gl.expand_dims(page_rows, 1) + cols
        ok = gl.expand_dims(n_ok, 1)
        for c in gl.static_range(NC):
            _cp_async(stage_c.slice((C0 + c) * 64, 64, dim=1), rows + (C0 + c) * 64, mask=ok)
            if PER_CHUNK:
                cp.commit_group()
        if ROPE:
            _cp_async(stage_r, rows + DC, mask=ok)
            if PER_CHUNK:
                cp.commit_group()
        if not PER_CHUNK:
            cp.commit_group()

    @gluon.jit
    def _issue_own_half(KV, stage_c, page_rows, n_ok, ROLE: gl.constexpr, DC: gl.constexpr, CHUNK: gl.constexpr):
        """The block's columns this warpgroup multiplies by its own P (free once that P·V is done)."""
        NH: gl.constexpr = DC // 128
        _load_chunks(KV, stage_c, stage_c, page_rows, n_ok, ROLE * NH, NH, False, DC, CHUNK, True)

    @gluon.jit
    def _issue_rest(KV, stage_c, stage_r, page_rows, n_ok, ROLE: gl.constexpr, DC: gl.constexpr,
                    CHUNK: gl.constexpr):
        """The other warpgroup's half and the rope part (free once the other warpgroup's P·V is done)."""
        NH: gl.constexpr = DC // 128
        _load_chunks(KV, stage_c, stage_r, page_rows, n_ok, (1 - ROLE) * NH, NH, True, DC, CHUNK, True)

    @gluon.jit
    def _landed(num_outstanding: gl.constexpr):
        """This warpgroup's cp.async groups but the newest num_outstanding are in shared memory, for
        every thread of the warpgroup and for the tensor cores."""
        cp.wait_group(num_outstanding)
        fence_async_shared()
        _cta_barrier()

    @gluon.jit
    def _tma_row(BT, b, stride_btb, n0, end, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr):
        """The cache row of request b's key block at n0 (a whole page block); a block at or past `end` reads the
        block holding key end - 1 instead (its rows are zeroed before use), so no page past the request is read."""
        n = gl.minimum(n0, gl.maximum(end - 1, 0)) // BLOCK_N * BLOCK_N
        page = gl.load(BT + b * stride_btb + n // PAGE_SIZE)
        return page * PAGE_SIZE + n % PAGE_SIZE

    @gluon.jit
    def _tma_own_half(desc, bar, stage_c, row, ROLE: gl.constexpr, DC: gl.constexpr):
        """TMA the block's columns this warpgroup multiplies by its own P: NH [64, 64] boxes on `bar`."""
        NH: gl.constexpr = DC // 128
        mbarrier.expect(bar, NH * 64 * 64 * 2)
        for c in gl.static_range(NH):
            _tma_load(desc, [row, (ROLE * NH + c) * 64], bar, stage_c.slice((ROLE * NH + c) * 64, 64, dim=1))

    @gluon.jit
    def _tma_rest(desc, bar, stage_c, stage_r, row, ROLE: gl.constexpr, DC: gl.constexpr):
        """TMA the other warpgroup's half and the rope part: NH + 1 [64, 64] boxes on `bar`."""
        NH: gl.constexpr = DC // 128
        mbarrier.expect(bar, (NH + 1) * 64 * 64 * 2)
        for c in gl.static_range(NH):
            _tma_load(desc, [row, ((1 - ROLE) * NH + c) * 64], bar,
                      stage_c.slice(((1 - ROLE) * NH + c) * 64, 64, dim=1))
        _tma_load(desc, [row, DC], bar, stage_r)

    @gluon.jit
    def _zero_rows(stage_c, n_valid, DC: gl.constexpr, CHUNK: gl.constexpr):
        """Rows at or past n_valid of a landed stage's latent columns set to zero (a TMA block reads the page's
        tail, which may hold NaN, and 0 · NaN = NaN in P·V; their scores are masked)."""
        rows = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, CHUNK)), 1)
        for c in gl.static_range(DC // 64):
            t = stage_c.slice(c * 64, 64, dim=1).load(CHUNK)
            stage_c.slice(c * 64, 64, dim=1).store(gl.where(rows < n_valid, t, gl.zeros_like(t)))

    @gluon.jit
    def _seesaw_warpgroup(
        ROLE: gl.constexpr, shared,
        PAGE_SIZE: gl.constexpr, DC: gl.constexpr, DR: gl.constexpr,
        BLOCK_H: gl.constexpr, FOLD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        CAUSAL: gl.constexpr, DIRECT: gl.constexpr, TMA: gl.constexpr,
    ):
        """One warpgroup's program; `shared` = the kernel's pointers, strides, scalars and shared memory."""
        (Q, KV, KV_DESC, BT, MID_O, MID_LSE, OUT, LSE,
         stride_qb, stride_qs, stride_qh, stride_kvp, stride_kvt, stride_btb,
         stride_mob, stride_mos, stride_moh, stride_mosp, stride_mlb, stride_mls, stride_mlh,
         stride_ob, stride_os, stride_oh, stride_lb, stride_ls, scale_log2, S, H, b, g, seq_len, start, end,
         n_rounds, q_c_smem, q_r_smem, k_c_smem, k_r_smem, m_smem, scale_smem, l_smem, bars) = shared
        HALF: gl.constexpr = DC // 2
        NH: gl.constexpr = DC // 128  # 64-column chunks per half
        GROUPS: gl.constexpr = 2 * NH + 1  # cp.async groups per key block: one per chunk, one for the rope part
        OTHER: gl.constexpr = 1 - ROLE
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])
        P_OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
        CHUNK: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                               warps_per_cta=[4, 1], order=[1, 0])
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        own_c = k_c_smem.index(ROLE)
        own_r = k_r_smem.index(ROLE)

        # ---- first loads: Q (warpgroup 0), then this warpgroup's first block ----
        if ROLE == 0:
            rows_q = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, CHUNK))
            s_q = g * FOLD + rows_q // BLOCK_H
            h_q = gl.program_id(1) * BLOCK_H + rows_q % BLOCK_H
            ok_q = (rows_q < FOLD * BLOCK_H) & (h_q < H)
            _load_chunks(Q, q_c_smem, q_r_smem, b * stride_qb + s_q * stride_qs + h_q * stride_qh, ok_q, 0,
                         DC // 64, True, DC, CHUNK, False)
        if TMA:
            if n_rounds > 0:  # (no copy may still fly when the program ends)
                row_j = _tma_row(BT, b, stride_btb, start + ROLE * BLOCK_N, end, PAGE_SIZE, BLOCK_N)
                _tma_own_half(KV_DESC, bars.index(OWN_LANDED + ROLE), own_c, row_j, ROLE, DC)
                _tma_rest(KV_DESC, bars.index(REST_LANDED + ROLE), own_c, own_r, row_j, ROLE, DC)
            if ROLE == 0:
                _landed(0)
                mbarrier.arrive(bars.index(Q_READY))
            else:
                mbarrier.wait(bars.index(Q_READY), 0)
        else:
            rows_j, ok_j = G._block_page_rows(BT, b, stride_btb, start + ROLE * BLOCK_N, end, stride_kvp, stride_kvt,
                                              PAGE_SIZE, BLOCK_N, CHUNK)
            _issue_own_half(KV, own_c, rows_j, ok_j, ROLE, DC, CHUNK)
            _issue_rest(KV, own_c, own_r, rows_j, ok_j, ROLE, DC, CHUNK)
            if ROLE == 0:
                _landed(GROUPS)
                mbarrier.arrive(bars.index(Q_READY))
            else:
                mbarrier.wait(bars.index(Q_READY), 0)
        nx_rows, nx_ok = G._block_page_rows(BT, b, stride_btb, start + (ROLE + 2) * BLOCK_N, end, stride_kvp,
                                            stride_kvt, PAGE_SIZE, BLOCK_N, CHUNK)

        # ---- per-row state ----
        rows_s = gl.arange(0, BLOCK_M, layout=ROW_S)
        s_idx = g * FOLD + rows_s // BLOCK_H
        if CAUSAL:
            limit = seq_len - S + s_idx + 1
        else:
            limit = gl.full([BLOCK_M], 0, gl.int32, layout=ROW_S) + seq_len
        cols_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=ROW_S)
        l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=ROW_S)
        acc = gl.zeros([BLOCK_M, HALF], gl.float32, layout=O_LAYOUT)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_LAYOUT)

        for r in range(n_rounds):
            phase = r & 1
            # ---- S = Q·K_jᵀ for this warpgroup's block j = 2r + ROLE (own half of the columns first) ----
            # chunks in the order they were issued, each once it lands: own half, other half, rope
            s = s_zero
            if TMA:
                n_valid = end - (start + (2 * r + ROLE) * BLOCK_N)
                if n_valid < BLOCK_N:  # the split's last block: its rows past the end zeroed before any use
                    mbarrier.wait(bars.index(OWN_LANDED + ROLE), phase)
                    mbarrier.wait(bars.index(REST_LANDED + ROLE), phase)
                    _zero_rows(own_c, n_valid, DC, CHUNK)
                    fence_async_shared()
                    _cta_barrier()
            for c in gl.static_range(NH):
                if TMA:
                    if c == 0:
                        mbarrier.wait(bars.index(OWN_LANDED + ROLE), phase)
                else:
                    _landed(GROUPS - 1 - c)
                s = warpgroup_mma(q_c_smem.slice(ROLE * HALF + c * 64, 64, dim=1),
                                  own_c.slice(ROLE * HALF + c * 64, 64, dim=1).permute((1, 0)), s, use_acc=c > 0,
                                  is_async=True)
            for c in gl.static_range(NH):
                if TMA:
                    if c == 0:
                        mbarrier.wait(bars.index(REST_LANDED + ROLE), phase)
                else:
                    _landed(NH - c)
                s = warpgroup_mma(q_c_smem.slice(OTHER * HALF + c * 64, 64, dim=1),
                                  own_c.slice(OTHER * HALF + c * 64, 64, dim=1).permute((1, 0)), s, is_async=True)
            if not TMA:
                _landed(0)
            s = warpgroup_mma(q_r_smem, own_r.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))

            offs_n = start + (2 * r + ROLE) * BLOCK_N + cols_n
            acc, l_i, m_i, scale_next = G._seesaw_softmax(s, r, acc, l_i, offs_n, end, limit, scale_log2, m_smem,
                                                          scale_smem, bars, own_c.slice(ROLE * HALF, HALF, dim=1),
                                                          own_r, ROLE, M_READY, P_READY, ROW_S, ROW_O, P_OPERAND)

            # ---- O_half += P_other·V_other[:, half] ----
            acc, l_i = G._seesaw_other_ready(acc, l_i, scale_next, r, bars, ROLE, P_READY, ROW_O)
            acc = warpgroup_mma(k_r_smem.index(OTHER), k_c_smem.index(OTHER).slice(ROLE * HALF, HALF, dim=1), acc,
                                is_async=True)

            # ---- refill: own half as soon as this warpgroup's P_j·V_j is done, the rest once the other's is ----
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if TMA:  # the next round's block, where there is a next round (no copy flies past the last)
                nx_row = _tma_row(BT, b, stride_btb, start + (2 * r + ROLE + 2) * BLOCK_N, end, PAGE_SIZE, BLOCK_N)
                if r + 1 < n_rounds:
                    _tma_own_half(KV_DESC, bars.index(OWN_LANDED + ROLE), own_c, nx_row, ROLE, DC)
            else:
                _issue_own_half(KV, own_c, nx_rows, nx_ok, ROLE, DC, CHUNK)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(bars.index(KV_FREE + OTHER))
            mbarrier.wait(bars.index(KV_FREE + ROLE), phase)
            if TMA:
                if r + 1 < n_rounds:
                    _tma_rest(KV_DESC, bars.index(REST_LANDED + ROLE), own_c, own_r, nx_row, ROLE, DC)
            else:
                _issue_rest(KV, own_c, own_r, nx_rows, nx_ok, ROLE, DC, CHUNK)
                nx_rows, nx_ok = G._block_page_rows(BT, b, stride_btb, start + (2 * r + ROLE + 4) * BLOCK_N, end,
                                                    stride_kvp, stride_kvt, PAGE_SIZE, BLOCK_N, CHUNK)
        cp.wait_group(0)

        # ---- finish: both warpgroups' row sums, normalise, store this warpgroup's half ----
        out, lse2 = G._seesaw_finish(acc, l_i, m_i, l_smem, bars, ROLE, L_READY, ROW_S, ROW_O)
        G._store_result(out, ROLE * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, O_LAYOUT)), lse2, b, g, H,
                        MID_O, MID_LSE, OUT, LSE, stride_mob, stride_mos, stride_moh, stride_mosp, stride_mlb,
                        stride_mls, stride_mlh, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
                        BLOCK_H, FOLD, BLOCK_M, DC, DIRECT, ROLE == 1, ROW_O, ROW_S)  # warpgroup 1 holds the final max

    @gluon.jit
    def _mla_decode_seesaw_kernel(
        Q, KV, KV_DESC, BT, SEQ, MID_O, MID_LSE, OUT, LSE,
        stride_qb, stride_qs, stride_qh,
        stride_kvp, stride_kvt,
        stride_btb,
        stride_mob, stride_mos, stride_moh, stride_mosp,
        stride_mlb, stride_mls, stride_mlh,
        stride_ob, stride_os, stride_oh,
        stride_lb, stride_ls,
        scale_log2,
        S, H, NUM_SPLITS,
        PAGE_SIZE: gl.constexpr, DC: gl.constexpr, DR: gl.constexpr,
        BLOCK_H: gl.constexpr, FOLD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        CAUSAL: gl.constexpr, DIRECT: gl.constexpr,
        Q_C_SMEM: gl.constexpr, Q_R_SMEM: gl.constexpr, K_C_SMEM: gl.constexpr, K_R_SMEM: gl.constexpr,
        TMA: gl.constexpr, WORKER_REGS: gl.constexpr, SOURCE_KEY: gl.constexpr, num_warps: gl.constexpr,
    ):
        dtype: gl.constexpr = Q.dtype.element_ty
        b, g, seq_len, start, end = G._program_keys(SEQ, S, NUM_SPLITS, FOLD, BLOCK_N, CAUSAL)
        n_rounds = gl.cdiv(gl.maximum(end - start, 0), 2 * BLOCK_N)

        q_c_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, DC], Q_C_SMEM)
        q_r_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, DR], Q_R_SMEM)
        k_c_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, DC], K_C_SMEM)
        k_r_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, DR], K_R_SMEM)
        VEC: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        m_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], VEC)
        scale_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_M], VEC)  # per warpgroup
        l_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_M], VEC)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_BARRIERS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BARRIERS):
            mbarrier.init(bars.index(i), count=1)

        shared = (Q, KV, KV_DESC, BT, MID_O, MID_LSE, OUT, LSE,
                  stride_qb, stride_qs, stride_qh, stride_kvp, stride_kvt, stride_btb,
                  stride_mob, stride_mos, stride_moh, stride_mosp, stride_mlb, stride_mls, stride_mlh,
                  stride_ob, stride_os, stride_oh, stride_lb, stride_ls, scale_log2, S, H, b, g, seq_len, start, end,
                  n_rounds, q_c_smem, q_r_smem, k_c_smem, k_r_smem, m_smem, scale_smem, l_smem, bars)
        gl.warp_specialize([(_seesaw_warpgroup, (0, shared, PAGE_SIZE, DC, DR, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, CAUSAL,
                                                 DIRECT, TMA)),
                            (_seesaw_warpgroup, (1, shared, PAGE_SIZE, DC, DR, BLOCK_H, FOLD, BLOCK_M, BLOCK_N, CAUSAL,
                                                 DIRECT, TMA))], [4], [WORKER_REGS])


def supported(q: torch.Tensor, kv_cache: torch.Tensor, kv_format: str, block_m: int, opts: Options = Options(), *,
              head_dim_v: int | None = None) -> bool:
    """Whether this kernel can take the call: what the one-stream kernel takes (`bf16.supported`), with Dr = 64
    (P lives in a stage's rope buffer: Dr = BLOCK_N) and Dc a multiple of 128 up to 512 (each warpgroup's half of
    the latent columns is whole 64-column chunks). Its key blocks are BLOCK_N = 64 rows whatever the plan says."""
    if not bf16.supported(q, kv_cache, kv_format, block_m, head_dim_v=head_dim_v):
        return False
    dc = q.shape[-1] - 64 if head_dim_v is None else head_dim_v
    if opts.tma and not takes_tma(kv_cache):
        return False
    return q.shape[-1] - dc == BLOCK_N and dc % 128 == 0 and 128 <= dc <= 512


def launch(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2: float, plan: dict, *,
           causal: bool, num_splits: int, kv_format: str, opts: Options = Options()) -> None:
    """Stage 1 of the split-KV decode; writes out/lse itself when num_splits == 1, else mid_o/mid_lse."""
    tma = takes_tma(kv_cache) if opts.tma is None else opts.tma
    views = (kv_cache, _kv_descriptor(kv_cache) if tma else None)
    grid, args, consts = G.split_launch_args(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2,
                                             plan, dc=out.shape[-1], causal=causal, direct=num_splits == 1,
                                             num_splits=num_splits, block_n=BLOCK_N, kv_views=views)
    _mla_decode_seesaw_kernel[grid](*args, **consts, TMA=tma, WORKER_REGS=opts.worker_regs,
                                    SOURCE_KEY=_SOURCE_KEY, num_warps=4)


def takes_tma(kv_cache: torch.Tensor) -> bool:
    """Whether the cache's key blocks can come by TMA: whole 64-key blocks in a page, rows evenly strided across
    pages, 16-byte aligned."""
    return (kv_cache.shape[1] % BLOCK_N == 0 and kv_cache.stride(0) == kv_cache.shape[1] * kv_cache.stride(1)
            and kv_cache.stride(2) == 1 and (kv_cache.stride(1) * kv_cache.element_size()) % 16 == 0
            and kv_cache.data_ptr() % 16 == 0)


def _kv_descriptor(kv_cache: torch.Tensor):
    """The cache's rows [pages · page size, D] as a TMA view in [64, 64] boxes (128-byte swizzle: the layout of a
    64-column slice of the stages)."""
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    flat = kv_cache.as_strided((rows, kv_cache.shape[2]), (kv_cache.stride(1), 1))
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    return TensorDescriptor.from_tensor(flat, [BLOCK_N, 64], layout)
