"""Hopper MLA decode for 16-bit caches in Gluon: one instruction stream of async wgmma over a cp.async ring.

- Q (BLOCK_M = 64 rows × D) sits in shared memory for the whole split; key blocks (BLOCK_N rows × D) land in a
  ring of NUM_STAGES buffers through masked cp.async (rows past the request's end read as zeros, so NaN garbage
  in a page's tail never reaches P·V); page ids come from the block table one block ahead.
- Eight warps = two warpgroups. S = Q·Kᵀ is split by key columns between them; P (16-bit) goes through shared
  memory so each warpgroup multiplies the whole P by its half of V's Dc columns (O split by columns).
- One buffer serves as K (transposed view) for S and as V for P·V.
- The next block's load is issued as soon as the P·V that read its buffer has completed, before the current
  block's S, so it overlaps a whole block of compute.

Takes Dc a multiple of 64 up to 512, Dr a multiple of 16 up to 64, 32- or 64-key blocks; tiles of fewer rows run
padded to 64 (wgmma's smallest M). Grid, split rule and partial layout are the Triton split kernel's (its combine
merges the splits). Gluon does not run in the Triton interpreter: GPU tests check the kernel against the fp64
reference, and a CPU test compiles it for sm_90 (`scripts/offline_sm90.py`).
"""

from __future__ import annotations

import dataclasses

import torch

from specmla.ops.decode.hopper import common as G

if G.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                  warpgroup_mma_init, warpgroup_mma_wait)

    _cp_async, _cta_barrier = G._cp_async, G._cta_barrier

BLOCK_M = G.BLOCK_M
FORMATS = ("auto", "native", "bf16", "fp16")  # kv_format names of a 16-bit cache


@dataclasses.dataclass(frozen=True)
class Options:
    """The one-stream kernel's tuning knobs; the defaults are the measured best."""
    num_stages: int = 2  # key blocks in the cp.async ring
    num_warps: int = 8  # two warpgroups


if G.HAVE_GLUON:

    @gluon.jit
    def _issue_block_load(KV, k_c_buf, k_r_buf, page_rows, n_ok, DC: gl.constexpr, DR: gl.constexpr,
                          LOAD_LAYOUT: gl.constexpr):
        """cp.async one key block (rows given by page_rows = page·stride_p + in-page row·stride_t) into a
        stage's two buffers; rows not n_ok are zero-filled."""
        cols_c = gl.arange(0, DC, layout=gl.SliceLayout(0, LOAD_LAYOUT))
        cols_r = gl.arange(0, DR, layout=gl.SliceLayout(0, LOAD_LAYOUT))
        rows = gl.expand_dims(page_rows, 1)
        ok = gl.expand_dims(n_ok, 1)
        _cp_async(k_c_buf, KV + rows + gl.expand_dims(cols_c, 0), mask=ok)
        _cp_async(k_r_buf, KV + rows + DC + gl.expand_dims(cols_r, 0), mask=ok)

    @gluon.jit
    def _mla_decode_wgmma_kernel(
        Q, KV, BT, SEQ, MID_O, MID_LSE, OUT, LSE,
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
        NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, DIRECT: gl.constexpr,
        Q_C_SMEM: gl.constexpr, Q_R_SMEM: gl.constexpr, K_C_SMEM: gl.constexpr, K_R_SMEM: gl.constexpr,
        P_SMEM: gl.constexpr, num_warps: gl.constexpr,
    ):
        dtype: gl.constexpr = Q.dtype.element_ty
        # S [BLOCK_M, BLOCK_N]: the two warpgroups take half the key columns each; O [BLOCK_M, DC]: half
        # the output columns each
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                           instr_shape=[16, BLOCK_N // (num_warps // 4), 16])
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                           instr_shape=[16, DC // (num_warps // 4), 16])
        LOAD: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                              warps_per_cta=[num_warps, 1], order=[1, 0])
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)

        b, g, seq_len, start, end = G._program_keys(SEQ, S, NUM_SPLITS, FOLD, BLOCK_N, CAUSAL)

        # ---- shared memory: Q, the key ring, P ----
        q_c_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, DC], Q_C_SMEM)
        q_r_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, DR], Q_R_SMEM)
        k_c_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, DC], K_C_SMEM)
        k_r_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, DR], K_R_SMEM)
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], P_SMEM)

        # Q rows: FOLD tokens × BLOCK_H heads; padded rows read zeros
        rows_l = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOAD))
        s_l = g * FOLD + rows_l // BLOCK_H
        h_l = gl.program_id(1) * BLOCK_H + rows_l % BLOCK_H
        ok_l = gl.expand_dims((rows_l < FOLD * BLOCK_H) & (h_l < H), 1)
        q_rows = gl.expand_dims(b * stride_qb + s_l * stride_qs + h_l * stride_qh, 1)
        cols_c = gl.arange(0, DC, layout=gl.SliceLayout(0, LOAD))
        cols_r = gl.arange(0, DR, layout=gl.SliceLayout(0, LOAD))
        _cp_async(q_c_smem, Q + q_rows + gl.expand_dims(cols_c, 0), mask=ok_l)
        _cp_async(q_r_smem, Q + q_rows + DC + gl.expand_dims(cols_r, 0), mask=ok_l)

        # prologue: blocks 0 .. NUM_STAGES-2 (with Q in the first group)
        for i in gl.static_range(NUM_STAGES - 1):
            rows_i, ok_i = G._block_page_rows(BT, b, stride_btb, start + i * BLOCK_N, end, stride_kvp, stride_kvt,
                                              PAGE_SIZE, BLOCK_N, LOAD)
            _issue_block_load(KV, k_c_smem.index(i), k_r_smem.index(i), rows_i, ok_i, DC, DR, LOAD)
            cp.commit_group()
        # page rows of the next block to issue, looked up one block ahead
        nx_rows, nx_ok = G._block_page_rows(BT, b, stride_btb, start + (NUM_STAGES - 1) * BLOCK_N, end, stride_kvp,
                                            stride_kvt, PAGE_SIZE, BLOCK_N, LOAD)

        # ---- per-row state ----
        rows_s = gl.arange(0, BLOCK_M, layout=ROW_S)
        s_idx = g * FOLD + rows_s // BLOCK_H
        if CAUSAL:
            limit = seq_len - S + s_idx + 1
        else:
            limit = gl.full([BLOCK_M], 0, gl.int32, layout=ROW_S) + seq_len
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=ROW_S)
        l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=ROW_S)
        # carried through the loop as an in-flight wgmma accumulator (each iteration waits on it first)
        acc = warpgroup_mma_init(gl.zeros([BLOCK_M, DC], gl.float32, layout=O_LAYOUT))
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_LAYOUT)
        cols_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))

        n_iters = gl.cdiv(end - start, BLOCK_N)
        for it in range(n_iters):
            st = it % NUM_STAGES
            k_c = k_c_smem.index(st)
            k_r = k_r_smem.index(st)
            nst = (it + NUM_STAGES - 1) % NUM_STAGES
            # the previous P·V has finished: its stage and P's buffer are free; refill the stage
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _issue_block_load(KV, k_c_smem.index(nst), k_r_smem.index(nst), nx_rows, nx_ok, DC, DR, LOAD)
            cp.commit_group()
            nx_rows, nx_ok = G._block_page_rows(BT, b, stride_btb, start + (it + NUM_STAGES) * BLOCK_N, end,
                                                stride_kvp, stride_kvt, PAGE_SIZE, BLOCK_N, LOAD)
            # this block's group has landed (NUM_STAGES - 1 younger groups may still fly)
            cp.wait_group(NUM_STAGES - 1)
            _cta_barrier()
            fence_async_shared()
            s = warpgroup_mma(q_c_smem, k_c.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(q_r_smem, k_r.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))

            p, alpha, m_i, l_i = G._softmax_rows(s, m_i, l_i, start + it * BLOCK_N + cols_n, end, limit, scale_log2)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
            p_smem.store(p.to(dtype))
            fence_async_shared()
            _cta_barrier()
            acc = warpgroup_mma(p_smem, k_c, acc, is_async=True)

        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        cp.wait_group(0)

        # ---- finish: normalise, store the output (one split) or the partial + log2-sum-exp ----
        has = l_i > 0
        lse2 = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
        inv_l = gl.convert_layout(1.0 / gl.where(has, l_i, 1.0), ROW_O)
        out = acc * gl.expand_dims(inv_l, 1)
        G._store_result(out, gl.arange(0, DC, layout=gl.SliceLayout(0, O_LAYOUT)), lse2, b, g, H, MID_O, MID_LSE,
                        OUT, LSE, stride_mob, stride_mos, stride_moh, stride_mosp, stride_mlb, stride_mls, stride_mlh,
                        stride_ob, stride_os, stride_oh, stride_lb, stride_ls, BLOCK_H, FOLD, BLOCK_M, DC, DIRECT,
                        True, ROW_O, ROW_S)


def supported(q: torch.Tensor, kv_cache: torch.Tensor, kv_format: str, block_m: int, opts: Options = Options(), *,
              head_dim_v: int | None = None) -> bool:
    """Whether this kernel can take the call: Hopper outside the interpreter, a 16-bit cache of q's dtype, Dc
    (`head_dim_v`, default D - 64) a multiple of 64 up to 512, Dr a multiple of 16 up to 64, row tiles of at most
    64 rows, rows contiguous in their last dimension."""
    if kv_format not in FORMATS or not G.on_hopper(q):
        return False
    D = q.shape[-1]
    dc = D - 64 if head_dim_v is None else head_dim_v
    dr = D - dc
    return (q.dtype in (torch.bfloat16, torch.float16) and kv_cache.dtype == q.dtype and block_m <= BLOCK_M
            and dc % 64 == 0 and 64 <= dc <= 512 and dr % 16 == 0 and 16 <= dr <= 64
            and kv_cache.shape[-1] == D and kv_cache.stride(-1) == 1)


def launch(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2: float, plan: dict, *,
           causal: bool, num_splits: int, kv_format: str, opts: Options = Options()) -> None:
    """Stage 1 of the split-KV decode; writes out/lse itself when num_splits == 1, else mid_o/mid_lse. Key blocks
    of plan["BLOCK_N"] rows; num_splits is the workspace's, which may differ from the plan's."""
    block_n = plan["BLOCK_N"]
    grid, args, consts = G.split_launch_args(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2,
                                             plan, dc=out.shape[-1], causal=causal, direct=num_splits == 1,
                                             num_splits=num_splits, block_n=block_n)
    _mla_decode_wgmma_kernel[grid](*args, **consts, NUM_STAGES=opts.num_stages,
                                   P_SMEM=G._smem_layout([BLOCK_M, block_n], q.dtype), num_warps=opts.num_warps)
