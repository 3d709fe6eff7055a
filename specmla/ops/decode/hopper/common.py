"""Gluon helpers shared by the Hopper decode kernels: Triton-version shims, the split rule, key-block page
lookups, the online-softmax step, the seesaw schedule's shared steps, result stores and the launch arguments
common to every split kernel.

Every kernel here shares the Triton split kernel's grid (request × token group, head block, split), its split
rule and its partial layout, so one combine kernel merges any of them.
"""

from __future__ import annotations

import functools
import os

import torch

try:  # Gluon is experimental and absent from old Triton releases; the engine never needs it on CPU
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    # cp.async global → shared: `async_load` after Triton 3.6, `async_copy_global_to_shared` up to it
    _cp_async = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # the CTA barrier, renamed likewise

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

BLOCK_M = 64  # query rows of the 16-bit kernels' tiles: wgmma's smallest M


if HAVE_GLUON:

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
        and row sums."""
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
        [start, end) of the keys in whole BLOCK_N blocks: the Triton split kernel's rule."""
        return _range_keys(SEQ, S, NUM_SPLITS, gl.program_id(0), gl.program_id(2), FOLD, BLOCK_N, CAUSAL)

    @gluon.jit
    def _range_keys(SEQ, S, NUM_SPLITS, pid_bg, split, FOLD: gl.constexpr, BLOCK_N: gl.constexpr,
                    CAUSAL: gl.constexpr):
        """`_program_keys` of the program (pid_bg, ·, split), for scalars or tensors of them."""
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
    def _seesaw_softmax(s, r, acc, l_i, offs_n, end, limit, scale_log2, m_smem, scale_smem, bars, own_v, p_tile,
                        ROLE: gl.constexpr, M_READY: gl.constexpr, P_READY: gl.constexpr, ROW_S: gl.constexpr,
                        ROW_O: gl.constexpr, P_OPERAND: gl.constexpr):
        """The seesaw schedule's step from warpgroup ROLE's S_j (block j = 2r + ROLE) to its hand-over
        (`bf16_seesaw`): the softmax of block j against the max after block j-1 (read from the other warpgroup,
        this block's max and rescale factor published to it), O_half rescaled and P_j·V_j[:, half] issued from
        registers (own_v: block j's half of V), then P_j handed over at the newest max in p_tile, which only S_j
        read. Returns acc, l_i, the max m_i and (warpgroup 0) the factor by which block 2r+1 moved the max."""
        BLOCK_M: gl.constexpr = s.shape[0]
        phase = r & 1
        if ROLE == 0:  # block j-1 was warpgroup 1's, in the previous round
            mbarrier.wait(bars.index(M_READY + 1), (r + 1) & 1, pred=r > 0)
            m_prev = gl.where(r > 0, m_smem.load(ROW_S), float("-inf"))
        else:  # block j-1 was warpgroup 0's, this round
            mbarrier.wait(bars.index(M_READY), phase)
            m_prev = m_smem.load(ROW_S)
            scale_other = scale_smem.slice(0, BLOCK_M).load(ROW_S)
        p, scale_own, m_i, l_own = _softmax_rows(s, m_prev, l_i, offs_n, end, limit, scale_log2)
        m_smem.store(m_i)
        scale_smem.slice(ROLE * BLOCK_M, BLOCK_M).store(scale_own)
        mbarrier.arrive(bars.index(M_READY + ROLE))

        # ---- O_half = O_half·scale + P_j·V_j[:, half] (P from registers) ----
        if ROLE == 0:
            rescale = scale_own
            l_i = l_own
        else:  # warpgroup 0's block of this round moved the max too
            rescale = scale_other * scale_own
            l_i = l_i * rescale + gl.sum(p, axis=1)
        acc = acc * gl.expand_dims(gl.convert_layout(rescale, ROW_O), 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(own_v.dtype), P_OPERAND), own_v, acc, is_async=True)

        # ---- hand P_j over (at the newest max) ----
        if ROLE == 0:
            mbarrier.wait(bars.index(M_READY + 1), phase)
            scale_next = scale_smem.slice(BLOCK_M, BLOCK_M).load(ROW_S)
            p_tile.store((p * gl.expand_dims(scale_next, 1)).to(p_tile.dtype))
        else:
            scale_next = scale_own  # (unused: block 2r+1 is this warpgroup's own)
            p_tile.store(p.to(p_tile.dtype))
        fence_async_shared()
        mbarrier.arrive(bars.index(P_READY + ROLE))
        return acc, l_i, m_i, scale_next

    @gluon.jit
    def _seesaw_other_ready(acc, l_i, scale_next, r, bars, ROLE: gl.constexpr, P_READY: gl.constexpr,
                            ROW_O: gl.constexpr):
        """Before P_other·V_other[:, half]: wait for the other warpgroup's P; warpgroup 0 first rescales O_half and
        its sums by the factor block 2r+1 moved the max by (after its own P·V has landed)."""
        mbarrier.wait(bars.index(P_READY + 1 - ROLE), r & 1)
        if ROLE == 0:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            acc = acc * gl.expand_dims(gl.convert_layout(scale_next, ROW_O), 1)
            l_i = l_i * scale_next
        return acc, l_i

    @gluon.jit
    def _seesaw_finish(acc, l_i, m_i, l_smem, bars, ROLE: gl.constexpr, L_READY: gl.constexpr, ROW_S: gl.constexpr,
                       ROW_O: gl.constexpr):
        """After the last round: both warpgroups' row sums added, this warpgroup's O_half normalised; returns it and
        the rows' log2-sum-exp (warpgroup 1's is the final one: it holds the final max)."""
        BLOCK_M: gl.constexpr = acc.shape[0]
        l_smem.slice(ROLE * BLOCK_M, BLOCK_M).store(l_i)
        mbarrier.arrive(bars.index(L_READY + ROLE))
        mbarrier.wait(bars.index(L_READY + 1 - ROLE), 0)
        l_i = l_i + l_smem.slice((1 - ROLE) * BLOCK_M, BLOCK_M).load(ROW_S)
        has = l_i > 0
        inv_l = gl.convert_layout(1.0 / gl.where(has, l_i, 1.0), ROW_O)
        lse2 = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
        return acc * gl.expand_dims(inv_l, 1), lse2

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


def on_hopper(t: torch.Tensor) -> bool:
    """Whether `t` lives where the Gluon kernels run: a Hopper GPU (sm_90), outside Triton's interpreter."""
    return (HAVE_GLUON and t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(t.device)[0] == 9)


def source_key(path: str) -> int:
    """A checksum of a kernel module's source, passed to its warp-specialised kernels as a constexpr: Triton's
    cache key misses the partition functions handed to `gl.warp_specialize` (Triton 3.6 and 3.9), so an
    edited partition would otherwise reuse the stale compiled kernel."""
    import zlib

    with open(path, "rb") as f:
        return zlib.crc32(f.read())


def _smem_layout(shape, dtype):
    """The NVMMA shared layout of a 16-bit [shape] tile, built once per shape and dtype (building one is slow
    host work)."""
    return _nvmma_layout(tuple(shape), dtype)


@functools.lru_cache(maxsize=None)
def _nvmma_layout(shape: tuple, dtype: torch.dtype):
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for(list(shape), gdt)


def split_launch_args(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2, cfg, *, dc: int,
                      causal: bool, direct: bool, num_splits: int, block_n: int, block_m: int = BLOCK_M,
                      kv_views: tuple | None = None):
    """Grid, positional arguments and common constexprs of the Gluon split kernels, which share the Triton split
    kernel's grid, split rule and outputs. kv_views: the cache as the kernel takes it (default: the cache
    itself); its strides are the cache's."""
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
