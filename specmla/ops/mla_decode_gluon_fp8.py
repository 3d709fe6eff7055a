"""Hopper MLA decode that reads the fp8 latent cache (FlashMLA's 656-byte rows) in Gluon: each key
block is dequantised once, into the shared-memory tile both matmuls read, with the keys as the
matmuls' M dimension.

Why a third kernel: the Triton kernel dequantises in registers, and Triton stores the tile to
shared memory twice per block (once per dot-operand layout), so fp8 ran no faster than bf16
although it reads 1.76× fewer bytes (docs/benchmarks.md, issue 7: L1/shared-bound, DRAM 39 %).
Here:

- A program's next key block (128 keys: e4m3 codes, the fp32 scale of each 128 codes, the bf16
  rope part) is loaded into registers while the current block computes.
- Dequantising is code · scale in fp32, rounded to bf16 and stored once into a [128, 576] bf16 tile.
  S and P·V both read that tile.
- Keys are the M dimension ("swap AB"): Sᵀ = K·Qᵀ is [128 keys, R rows] and Oᵀ = Vᵀ·Pᵀ is
  [Dc, R]. With H = 16 (R = 16 query rows) nothing is padded to wgmma's M = 64, so the matmuls
  cost 4× less than in the 64-row kernels, and the softmax reduces over keys across the warps.

Same contract, split rule and partial layout as `mla_decode_triton` (its combine merges the
splits); Dc = 512, Dr = 64 (every MLA checkpoint in scope), row tiles of 16 or 32 rows, bf16
queries. Other shapes take the Triton kernel. Gluon does not run in the Triton interpreter: the
checks are GPU tests against the fp64 reference, plus a CPU test that compiles it for sm_90.
"""

from __future__ import annotations

import os

import torch

from specmla.ops import mla_decode_gluon as G

if G.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                  warpgroup_mma_init, warpgroup_mma_wait)

    _cta_barrier = G._cta_barrier

BLOCK_N = 128  # keys per block: two warpgroups × wgmma's M of 64
DC, DR, CHUNK_COLS = 512, 64, 128  # the layout this kernel reads: four 128-code chunks, one scale each
MAX_ROWS = 32  # the fp32 Oᵀ accumulator holds 2·R registers per thread


if G.HAVE_GLUON:
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

    @gluon.jit
    def _load_words(KV32, rows, ok, half: gl.constexpr, WORDS: gl.constexpr):
        """Half `half` of a key block's codes (256 per key) as 32-bit words of four e4m3 codes."""
        w = half * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, WORDS))
        at = gl.multiple_of(rows // 4, 4)  # rows start on 16 bytes (656-byte rows): 16-byte vector loads
        return gl.load(KV32 + gl.expand_dims(at, 1) + gl.expand_dims(w, 0), mask=gl.expand_dims(ok, 1), other=0)

    @gluon.jit
    def _load_scales(KV32, rows, ok, DC: gl.constexpr, WORDS: gl.constexpr):
        """The four fp32 scales of each key (one per 128 codes)."""
        at = rows // 4 + DC // 4
        return (gl.load(KV32 + at, mask=ok, other=0).to(gl.float32, bitcast=True),
                gl.load(KV32 + at + 1, mask=ok, other=0).to(gl.float32, bitcast=True),
                gl.load(KV32 + at + 2, mask=ok, other=0).to(gl.float32, bitcast=True),
                gl.load(KV32 + at + 3, mask=ok, other=0).to(gl.float32, bitcast=True))

    @gluon.jit
    def _load_rope(KV16, k_r_buf, rows, ok, DC: gl.constexpr, DR: gl.constexpr, ROPE: gl.constexpr):
        """cp.async a key block's bf16 rope part into its shared buffer (rows past the end: zeros)."""
        cols = gl.arange(0, DR, layout=gl.SliceLayout(0, ROPE))
        at = gl.multiple_of(rows // 2 + (DC + 4 * (DC // 128)) // 2, 8)  # 16-byte aligned (byte 528 of the row)
        G._cp_async(k_r_buf, KV16 + gl.expand_dims(at, 1) + gl.expand_dims(cols, 0), mask=gl.expand_dims(ok, 1))
        cp.commit_group()

    @gluon.jit
    def _load_block(KV32, KV16, k_r_buf, BT, b, stride_btb, n0, end, stride_kvp, stride_kvt,
                    PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, DC: gl.constexpr, DR: gl.constexpr,
                    WORDS: gl.constexpr, ROPE: gl.constexpr):
        """Start the key block at n0: its codes and scales into registers (returned), its rope part
        into k_r_buf by cp.async."""
        rows_w, ok_w = G._block_page_rows(BT, b, stride_btb, n0, end, stride_kvp, stride_kvt,
                                           PAGE_SIZE, BLOCK_N, WORDS)
        w0 = _load_words(KV32, rows_w, ok_w, 0, WORDS)
        w1 = _load_words(KV32, rows_w, ok_w, 1, WORDS)
        sc0, sc1, sc2, sc3 = _load_scales(KV32, rows_w, ok_w, DC, WORDS)
        rows_r, ok_r = G._block_page_rows(BT, b, stride_btb, n0, end, stride_kvp, stride_kvt,
                                           PAGE_SIZE, BLOCK_N, ROPE)
        _load_rope(KV16, k_r_buf, rows_r, ok_r, DC, DR, ROPE)
        return w0, w1, sc0, sc1, sc2, sc3

    @gluon.jit
    def _store_half(k_c_smem, words, s_lo, s_hi, half: gl.constexpr, dtype: gl.constexpr, WORDS: gl.constexpr):
        """Dequantise half a key block into the shared tile. Byte k of word w is latent column
        256·half + 4w + k; it goes to tile column 256·half + 64k + w (`latent_column` inverts this),
        so each byte position is one whole 64-column slice. Code · scale in fp32, rounded once."""
        w = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, WORDS)), 0)
        scale = gl.where(w < 32, gl.expand_dims(s_lo, 1), gl.expand_dims(s_hi, 1))  # 4w + k < 128
        for k in gl.static_range(4):
            code = ((words >> (8 * k)) & 0xFF).to(gl.uint8).to(gl.float8e4nv, bitcast=True)
            k_c_smem.slice(half * 256 + k * 64, 64, dim=1).store((code.to(gl.float32) * scale).to(dtype))

    @gluon.jit
    def _latent_column(j):
        """The latent column held in tile column j (the inverse of `_store_half`'s placement)."""
        return (j // 256) * 256 + 4 * (j % 64) + (j % 256) // 64

    @gluon.jit
    def _mla_decode_fp8_kernel(
        Q, KV16, KV32, BT, SEQ, MID_O, MID_LSE, OUT, LSE,
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
        P_SMEM: gl.constexpr, num_warps: gl.constexpr,
    ):
        dtype: gl.constexpr = Q.dtype.element_ty
        # Sᵀ [BLOCK_N keys, BLOCK_M] and Oᵀ [DC, BLOCK_M]: the two warpgroups stack along M (keys / latent columns)
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BLOCK_M, 16])
        WORDS: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[2, 16],
                                               warps_per_cta=[num_warps, 1], order=[1, 0])
        ROPE: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                              warps_per_cta=[num_warps, 1], order=[1, 0])
        KEY: gl.constexpr = gl.SliceLayout(1, ACC)  # along keys (or tile columns)
        ROW: gl.constexpr = gl.SliceLayout(0, ACC)  # along query rows

        b, g, seq_len, start, end = G._program_keys(SEQ, S, NUM_SPLITS, FOLD, BLOCK_N, CAUSAL)

        q_c_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, DC], Q_C_SMEM)
        q_r_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, DR], Q_R_SMEM)
        k_c_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, DC], K_C_SMEM)
        k_r_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, DR], K_R_SMEM)  # the rope part is stored bf16
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], P_SMEM)

        # Q rows: FOLD tokens × BLOCK_H heads, latent columns in the tile's order; padded rows are zeros
        rows_q = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ROPE))
        s_q = g * FOLD + rows_q // BLOCK_H
        h_q = gl.program_id(1) * BLOCK_H + rows_q % BLOCK_H
        ok_q = gl.expand_dims((rows_q < FOLD * BLOCK_H) & (h_q < H), 1)
        q_at = gl.expand_dims(b * stride_qb + s_q * stride_qs + h_q * stride_qh, 1)
        cols_qc = _latent_column(gl.arange(0, DC, layout=gl.SliceLayout(0, ROPE)))
        cols_qr = gl.arange(0, DR, layout=gl.SliceLayout(0, ROPE))
        q_c_smem.store(gl.load(Q + q_at + gl.expand_dims(cols_qc, 0), mask=ok_q, other=0.0))
        q_r_smem.store(gl.load(Q + q_at + DC + gl.expand_dims(cols_qr, 0), mask=ok_q, other=0.0).to(gl.bfloat16))

        # the first block: codes and scales into registers, rope into its shared buffer
        w0, w1, sc0, sc1, sc2, sc3 = _load_block(KV32, KV16, k_r_smem.index(0), BT, b, stride_btb, start, end,
                                                 stride_kvp, stride_kvt, PAGE_SIZE, BLOCK_N, DC, DR, WORDS, ROPE)

        cols_r = gl.arange(0, BLOCK_M, layout=ROW)
        s_idx = g * FOLD + cols_r // BLOCK_H
        if CAUSAL:
            limit = seq_len - S + s_idx + 1
        else:
            limit = gl.full([BLOCK_M], 0, gl.int32, layout=ROW) + seq_len
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=ROW)
        l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=ROW)
        # carried through the loop as an in-flight wgmma accumulator (each iteration waits on it first)
        acc = warpgroup_mma_init(gl.zeros([DC, BLOCK_M], gl.float32, layout=ACC))
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=ACC)
        keys = gl.arange(0, BLOCK_N, layout=KEY)

        n_iters = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
        for it in range(n_iters):
            # the previous P·V has read the tile, P and the other rope buffer: overwrite them
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _store_half(k_c_smem, w0, sc0, sc1, 0, dtype, WORDS)
            _store_half(k_c_smem, w1, sc2, sc3, 1, dtype, WORDS)
            # the next block's bytes fly while this one computes
            n1 = start + (it + 1) * BLOCK_N
            w0, w1, sc0, sc1, sc2, sc3 = _load_block(KV32, KV16, k_r_smem.index((it + 1) % 2), BT, b, stride_btb,
                                                     n1, end, stride_kvp, stride_kvt, PAGE_SIZE, BLOCK_N, DC, DR,
                                                     WORDS, ROPE)
            cp.wait_group(1)  # this block's rope has landed
            fence_async_shared()
            _cta_barrier()

            # Sᵀ = K·Qᵀ
            s = warpgroup_mma(k_c_smem, q_c_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(k_r_smem.index(it % 2), q_r_smem.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))

            offs_n = start + it * BLOCK_N + keys
            visible = gl.expand_dims(offs_n < end, 1) & (gl.expand_dims(offs_n, 1) < gl.expand_dims(limit, 0))
            s = gl.where(visible, s * scale_log2, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=0))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(s - gl.expand_dims(m_safe, 0))
            l_i = l_i * alpha + gl.sum(p, axis=0)
            m_i = m_new
            p_smem.store(p.to(dtype))
            fence_async_shared()
            _cta_barrier()
            # Oᵀ = Oᵀ·alpha + Vᵀ·Pᵀ
            acc = acc * gl.expand_dims(alpha, 0)
            acc = warpgroup_mma(k_c_smem.permute((1, 0)), p_smem, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        cp.wait_group(0)

        # ---- finish: normalise; the output (one split) or this split's partial + log2-sum-exp ----
        has = l_i > 0
        lse2 = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
        out = acc * gl.expand_dims(1.0 / gl.where(has, l_i, 1.0), 0)
        s_o = g * FOLD + cols_r // BLOCK_H
        h_o = gl.program_id(1) * BLOCK_H + cols_r % BLOCK_H
        ok_o = (cols_r < FOLD * BLOCK_H) & (h_o < H)
        d = gl.expand_dims(_latent_column(gl.arange(0, DC, layout=KEY)), 1)
        mask = gl.expand_dims(ok_o, 0) & (d < DC)
        if DIRECT:
            o_at = OUT + b * stride_ob + s_o * stride_os + h_o * stride_oh
            gl.store(gl.expand_dims(o_at, 0) + d, out.to(OUT.dtype.element_ty), mask=mask)
            gl.store(LSE + b * stride_lb + s_o * stride_ls + h_o, lse2 * 0.6931471805599453, mask=ok_o)
        else:
            split = gl.program_id(2)
            mo_at = MID_O + b * stride_mob + s_o * stride_mos + h_o * stride_moh + split * stride_mosp
            gl.store(gl.expand_dims(mo_at, 0) + d, out, mask=mask)
            gl.store(MID_LSE + b * stride_mlb + s_o * stride_mls + h_o * stride_mlh + split, lse2, mask=ok_o)


def fp8_supported(q: torch.Tensor, kv_cache: torch.Tensor, dc: int, block_m: int) -> bool:
    """Whether this kernel takes an fp8-cache call: Hopper, bf16 queries (the rope part is bf16), Dc = 512, Dr = 64,
    row tiles of at most MAX_ROWS, contiguous uint8 rows."""
    if not G.HAVE_GLUON or not q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    return (q.dtype == torch.bfloat16 and dc == DC and q.shape[-1] == DC + DR
            and block_m <= MAX_ROWS and kv_cache.dtype == torch.uint8 and kv_cache.is_contiguous()
            and kv_cache.data_ptr() % 16 == 0)  # the kernel reads the rows in 16-byte vectors


def auto_takes(cfg: dict, B: int, S: int) -> bool:
    """Whether `mla_decode_triton(gluon=None)` sends a supported fp8 call here rather than to the
    Triton kernel. Measured on the H100 (fp8 time vs bf16 time, this kernel / Triton's): 32-row
    tiles (two folded tokens at H=16) 0.81 / 0.35; few programs with long splits (B=4 T=80k,
    33 splits of ~20 blocks) 0.85 / 0.71. Triton stays ahead with 32 programs of 16 rows
    (B=32 T=32k: 0.89 / 0.95) and with one-block splits (B=1 T=8k: 0.60 / 0.96)."""
    if not G.AUTO:
        return False
    programs = B * (S // cfg["FOLD"]) * cfg["head_blocks"]
    return cfg["BLOCK_M"] == 32 or (programs < 32 and cfg["keys_per_split"] >= 8 * BLOCK_N)


def launch_fp8_split(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2, cfg, *,
                     causal: bool, direct: bool, num_splits: int):
    """Stage 1 of `mla_decode_triton` for an fp8 cache (grid, split rule and outputs as the others):
    the kernel reads the uint8 rows as bf16 (rope) and 32-bit words (codes, scales)."""
    rows = max(16, cfg["BLOCK_M"])
    grid, args, consts = G.split_launch_args(q, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, lse, scale_log2,
                                             cfg, dc=DC, causal=causal, direct=direct, num_splits=num_splits,
                                             block_n=BLOCK_N, block_m=rows,
                                             kv_views=(kv_cache.view(torch.bfloat16), kv_cache.view(torch.int32)))
    _mla_decode_fp8_kernel[grid](*args, **consts, P_SMEM=G._smem_layout([BLOCK_N, rows], q.dtype), num_warps=8)
