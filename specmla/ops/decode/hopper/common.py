"""Hopper MLA decode for 64-row tiles in Gluon (Triton's explicit-layout dialect): async wgmma on an
explicit cp.async pipeline.

Why a second kernel: with 64 query rows per program (H = 128, or H = 16 with S = 4 folded tokens)
decode is compute-bound, and the Triton kernel's dots reach about a third of the GEMM rate. Triton
3.6 decides the shared-memory pipeline, the wgmma waits and the layout round trips itself; here they
are written out:

- Q (64 rows × 576) sits in shared memory for the whole split; key blocks (BLOCK_N rows × 576) land
  in a ring of NUM_STAGES buffers through masked cp.async (rows past the request's end read as
  zeros, so NaN garbage in a page's tail never reaches p·V); page ids come from the block table one
  block ahead.
- Eight warps = two warpgroups. S = q·kᵀ is split by key columns between them; P (bf16) goes
  through shared memory so each warpgroup multiplies the whole P by its half of V's 512 columns
  (FlashMLA's split of the output between warpgroups; 128 fp32 registers of O per thread).
- One buffer serves as K (transposed view) for S and as V for P·V, as in every MLA kernel.
- The next block's load is issued as soon as the P·V that read its buffer has completed, before the
  current block's S is computed, so it overlaps a whole block of compute.

Same contract, split rule and partial layout as `mla_decode_triton` (its combine kernel merges the
splits), for bf16/fp16 caches with Dc, Dr multiples of 64 / 16. Gluon does not run in the Triton
interpreter: this kernel's checks are GPU tests against the fp64 reference, plus a CPU test that
compiles it for sm_90 (`scripts/offline_sm90.py`); the Triton kernel stays the portable path.
"""

from __future__ import annotations

import functools
import os

import torch

try:  # Gluon is experimental and absent from old Triton releases; the engine never needs it on CPU
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                  warpgroup_mma_init, warpgroup_mma_wait)
    # cp.async global → shared: renamed async_load after Triton 3.6 (the GPU machine has 3.6, CPU machines newer)
    _cp_async = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed likewise

    @gluon.jit
    def _reinterpret(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
        """The same shared memory under another dtype / shape / layout (`_reinterpret` in Triton 3.6,
        `reinterpret` after)."""
        if hasattr(smem, "reinterpret"):
            return smem.reinterpret(dtype, shape, layout)
        else:
            return smem._reinterpret(dtype, shape, layout)
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - older Triton
    HAVE_GLUON = False

BLOCK_M = 64
AUTO = True  # mla_decode_triton(gluon=None) takes these kernels wherever they are supported: 64-row tiles,
# and smaller tiles padded to 64 rows in one wave of splits (H100, H=16 S=1, % of copy, ours vs the Triton
# kernel's best wave count: B=4 T=80k 91.1 vs 89.3, B=8 T=32k 89.9 vs 84.8, B=16 T=32k 95.4 vs 92.4)
AUTO_MIN_PROGRAMS = 32  # padded tiles take the seesaw kernel from this many (request, row tile) programs, the
# one-stream kernel below it (fewer programs mean many short splits, where the one-stream start-up is cheaper:
# B=4 T=80k 91.1 % vs 86.0 %; with 32 or more, one split or a few long ones: B=32 T=32k seesaw 99.4 %)
SEESAW = True  # 64-key blocks with Dr = 64 run the warp-specialised schedule (`ops.mla_decode_seesaw`)


if HAVE_GLUON:

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
    def _block_page_rows(BT, b, stride_btb, n0, end, stride_kvp, stride_kvt,
                         PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, LOAD_LAYOUT: gl.constexpr):
        """Element offsets of the key block starting at n0 (its rows' pages from the block table) and
        which of its rows lie before `end`."""
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD_LAYOUT))
        n_ok = offs_n < end
        page = gl.load(BT + b * stride_btb + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(gl.int64)
        return page * stride_kvp + (offs_n % PAGE_SIZE) * stride_kvt, n_ok

    @gluon.jit
    def _softmax_rows(s, m_i, l_i, offs_n, end, limit, scale_log2):
        """Online softmax of S [rows, keys] (keys offs_n; hidden at or past `end` and past each row's causal
        `limit`), the query rows along the matmul's M: P at the new max, the old rows' rescale factor, the new max
        and row sums (`mla_decode_gluon_quant._softmax_keys` is its keys-along-M twin)."""
        visible = gl.expand_dims(offs_n < end, 0) & (gl.expand_dims(offs_n, 0) < gl.expand_dims(limit, 1))
        s = gl.where(visible, s * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - gl.expand_dims(m_safe, 1))
        return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)

    @gluon.jit
    def _program_keys(SEQ, S, NUM_SPLITS, FOLD: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """This program's request b, its query-token group g, the request's length and its share
        [start, end) of the keys in whole BLOCK_N blocks: the Triton kernel's rule (`_program_rows`)."""
        return _range_keys(SEQ, S, NUM_SPLITS, gl.program_id(0), gl.program_id(2), FOLD, BLOCK_N, CAUSAL)

    @gluon.jit
    def _range_keys(SEQ, S, NUM_SPLITS, pid_bg, split, FOLD: gl.constexpr, BLOCK_N: gl.constexpr,
                    CAUSAL: gl.constexpr):
        """`_program_keys` of the program (pid_bg, ·, split), scalars or tensors of them: the kernels that take
        blocks from other programs' shares (`mla_decode_gluon_fp8reg`'s STEAL) need every program's."""
        n_groups = S // FOLD
        b = pid_bg // n_groups
        g = pid_bg % n_groups
        seq_len = gl.load(SEQ + b)
        n_blocks = gl.cdiv(seq_len, BLOCK_N)
        per_split = gl.cdiv(n_blocks, NUM_SPLITS)
        start = split * per_split * BLOCK_N
        end = gl.minimum(start + per_split * BLOCK_N, seq_len)
        if CAUSAL:
            end = gl.minimum(end, seq_len - S + g * FOLD + FOLD)
        return b, g, seq_len, start, end

    @gluon.jit
    def _store_result(out, cols_o, lse2, b, g, H, MID_O, MID_LSE, OUT, LSE,
                      stride_mob, stride_mos, stride_moh, stride_mosp, stride_mlb, stride_mls, stride_mlh,
                      stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
                      BLOCK_H: gl.constexpr, FOLD: gl.constexpr, BLOCK_M: gl.constexpr, DC: gl.constexpr,
                      DIRECT: gl.constexpr, STORE_LSE: gl.constexpr, ROW_O: gl.constexpr, ROW_S: gl.constexpr):
        """Store normalised rows (columns cols_o) and, when STORE_LSE, their log2-sum-exp: the final
        output with a natural-log lse (a single split), or this split's partial."""
        rows_o = gl.arange(0, BLOCK_M, layout=ROW_O)
        s_o = g * FOLD + rows_o // BLOCK_H
        h_o = gl.program_id(1) * BLOCK_H + rows_o % BLOCK_H
        ok_o = (rows_o < FOLD * BLOCK_H) & (h_o < H)
        mask = gl.expand_dims(ok_o, 1) & gl.expand_dims(cols_o < DC, 0)
        rows_s = gl.arange(0, BLOCK_M, layout=ROW_S)
        s_idx = g * FOLD + rows_s // BLOCK_H
        h_s = gl.program_id(1) * BLOCK_H + rows_s % BLOCK_H
        ok_s = (rows_s < FOLD * BLOCK_H) & (h_s < H)
        if DIRECT:
            o_rows = OUT + b * stride_ob + s_o * stride_os + h_o * stride_oh
            gl.store(gl.expand_dims(o_rows, 1) + gl.expand_dims(cols_o, 0), out.to(OUT.dtype.element_ty), mask=mask)
            if STORE_LSE:  # natural log for the caller
                gl.store(LSE + b * stride_lb + s_idx * stride_ls + h_s, lse2 * 0.6931471805599453, mask=ok_s)
        else:
            split = gl.program_id(2)
            mo_rows = MID_O + b * stride_mob + s_o * stride_mos + h_o * stride_moh + split * stride_mosp
            gl.store(gl.expand_dims(mo_rows, 1) + gl.expand_dims(cols_o, 0), out, mask=mask)
            if STORE_LSE:
                gl.store(MID_LSE + b * stride_mlb + s_idx * stride_mls + h_s * stride_mlh + split, lse2, mask=ok_s)

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

        b, g, seq_len, start, end = _program_keys(SEQ, S, NUM_SPLITS, FOLD, BLOCK_N, CAUSAL)

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
            rows_i, ok_i = _block_page_rows(BT, b, stride_btb, start + i * BLOCK_N, end, stride_kvp, stride_kvt,
                                            PAGE_SIZE, BLOCK_N, LOAD)
            _issue_block_load(KV, k_c_smem.index(i), k_r_smem.index(i), rows_i, ok_i, DC, DR, LOAD)
            cp.commit_group()
        # page rows of the next block to issue, looked up one block ahead
        nx_rows, nx_ok = _block_page_rows(BT, b, stride_btb, start + (NUM_STAGES - 1) * BLOCK_N, end, stride_kvp,
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
            nx_rows, nx_ok = _block_page_rows(BT, b, stride_btb, start + (it + NUM_STAGES) * BLOCK_N, end,
                                              stride_kvp, stride_kvt, PAGE_SIZE, BLOCK_N, LOAD)
            # this block's group has landed (NUM_STAGES - 1 younger groups may still fly)
            cp.wait_group(NUM_STAGES - 1)
            _cta_barrier()
            fence_async_shared()
            s = warpgroup_mma(q_c_smem, k_c.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(q_r_smem, k_r.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))

            p, alpha, m_i, l_i = _softmax_rows(s, m_i, l_i, start + it * BLOCK_N + cols_n, end, limit, scale_log2)
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
        _store_result(out, gl.arange(0, DC, layout=gl.SliceLayout(0, O_LAYOUT)), lse2, b, g, H, MID_O, MID_LSE, OUT,
                      LSE, stride_mob, stride_mos, stride_moh, stride_mosp, stride_mlb, stride_mls, stride_mlh,
                      stride_ob, stride_os, stride_oh, stride_lb, stride_ls, BLOCK_H, FOLD, BLOCK_M, DC, DIRECT, True,
                      ROW_O, ROW_S)

def source_key(path: str) -> int:
    """A checksum of a kernel module's source, passed to its warp-specialised kernels as a constexpr: Triton's
    cache key misses the partition functions handed to `gl.warp_specialize` (Triton 3.6 and 3.9), so an
    edited partition would otherwise reuse the stale compiled kernel."""
    import zlib

    with open(path, "rb") as f:
        return zlib.crc32(f.read())


def _smem_layout(shape, dtype):
    """The NVMMA shared layout of a 16-bit [shape] tile, built once per shape and dtype (about 10 µs of host
    time each, on every launch otherwise)."""
    return _nvmma_layout(tuple(shape), dtype)


@functools.lru_cache(maxsize=None)
def _nvmma_layout(shape: tuple, dtype: torch.dtype):
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for(list(shape), gdt)


def gluon_decode_supported(q: torch.Tensor, kv_cache: torch.Tensor, head_dim_v: int | None, kv_format: str,
                           block_m: int) -> bool:
    """Whether the Gluon kernel can take this call: Hopper, 16-bit cache and q of one dtype, Dc a
    multiple of 64 up to 512 and Dr a multiple of 16 up to 64. Tiles of fewer rows run padded to 64
    (wgmma's smallest M)."""
    if (not HAVE_GLUON or not q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
            or kv_format not in ("auto", "native", "bf16", "fp16")):
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    D = q.shape[-1]
    dc = D - 64 if head_dim_v is None else head_dim_v
    dr = D - dc
    return (q.dtype in (torch.bfloat16, torch.float16) and kv_cache.dtype == q.dtype and block_m <= BLOCK_M
            and dc % 64 == 0 and 64 <= dc <= 512 and dr % 16 == 0 and 16 <= dr <= 64
            and kv_cache.shape[-1] == D and kv_cache.stride(-1) == 1)


def takes_seesaw(cfg: dict, B: int, S: int, dc: int, dr: int, block_n: int) -> bool:
    """Whether a Gluon split runs the seesaw kernel (else the one-stream kernel in this file)."""
    from specmla.ops.decode.hopper import bf16_seesaw as mla_decode_seesaw
    if not (SEESAW and mla_decode_seesaw.seesaw_supported(dc, dr, block_n)):
        return False
    return cfg["BLOCK_M"] >= BLOCK_M or B * (S // cfg["FOLD"]) * cfg["head_blocks"] >= AUTO_MIN_PROGRAMS


def launch_gluon_split(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2, cfg, *,
                       dc: int, causal: bool, direct: bool, num_splits: int, block_n: int = 64, num_stages: int = 2,
                       num_warps: int = 8):
    """Stage 1 of `mla_decode_triton` through the Gluon kernel (same grid, arguments and outputs;
    num_splits is the workspace's, which may differ from cfg's plan)."""
    from specmla.ops.decode.hopper import bf16_seesaw as mla_decode_seesaw
    B, S = q.shape[:2]
    if takes_seesaw(cfg, B, S, dc, q.shape[-1] - dc, block_n):
        return mla_decode_seesaw.launch_seesaw_split(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse,
                                                     scale_log2, cfg, dc=dc, causal=causal, direct=direct,
                                                     num_splits=num_splits)
    grid, args, consts = split_launch_args(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2,
                                           cfg, dc=dc, causal=causal, direct=direct, num_splits=num_splits,
                                           block_n=block_n)
    _mla_decode_wgmma_kernel[grid](*args, **consts, NUM_STAGES=num_stages,
                                   P_SMEM=_smem_layout([BLOCK_M, block_n], q.dtype), num_warps=num_warps)


def split_launch_args(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2, cfg, *, dc: int,
                      causal: bool, direct: bool, num_splits: int, block_n: int, block_m: int = BLOCK_M,
                      kv_views: tuple | None = None):
    """Grid, positional arguments and common constexprs of the Gluon split kernels (this file's,
    `ops.mla_decode_seesaw`'s and `ops.mla_decode_gluon_quant`'s), which share the Triton kernel's grid,
    split rule and outputs. kv_views: the cache as the kernel takes it (default: the cache itself);
    its strides are the cache's."""
    B, S, H, D = q.shape
    dr = D - dc
    grid = (B * (S // cfg["FOLD"]), cfg["head_blocks"], num_splits)
    mo_strides = (0, 0, 0, 0) if direct else mid_o.stride()[:4]
    ml_strides = (0, 0, 0) if direct else mid_lse.stride()[:3]
    args = (q, *(kv_views or (kv_cache,)), block_table, seq_lens, mid_o, mid_lse, out, lse,
            q.stride(0), q.stride(1), q.stride(2),
            kv_cache.stride(0), kv_cache.stride(1),
            block_table.stride(0),
            *mo_strides, *ml_strides,
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1),
            scale_log2, S, H, num_splits)
    dt = q.dtype
    consts = dict(PAGE_SIZE=kv_cache.shape[1], DC=dc, DR=dr, BLOCK_H=cfg["BLOCK_H"], FOLD=cfg["FOLD"], BLOCK_M=block_m,
                  BLOCK_N=block_n, CAUSAL=causal, DIRECT=direct,
                  Q_C_SMEM=_smem_layout([block_m, dc], dt), Q_R_SMEM=_smem_layout([block_m, dr], dt),
                  K_C_SMEM=_smem_layout([block_n, dc], dt), K_R_SMEM=_smem_layout([block_n, dr], dt))
    return grid, args, consts
