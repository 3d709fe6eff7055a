"""16-bit products of at most SMALL_M rows (decode at batch 1–16), bound by the weight stream.

At T ≤ 16 rows cuBLAS runs MLA's projections at a third to two thirds of the copy rate: too few programs, each with
too few weight bytes in flight, and a fixed cost per call that a 2–15 MB weight does not amortise. Here one kernel
serves both ops: `linear_small_m` (y = x @ weightᵀ) is `head_matmul_small_m` (out[t, g] = x[t, g] @ w[g]) with one
head and w = weightᵀ, every operand taken through its strides. A program owns a [BLOCK_N] slice of one head's
output columns and a K range: it streams its [BLOCK_N, BLOCK_K] weight tiles through a pipelined loop (every tile
of a short slice in flight at once) and multiplies each by the [BLOCK_K, 16] x tile on the tensor cores, rows past
T masked (swap-AB: the weight rows are the MMA's M). CUDA-core FMAs at T ≤ 2 measured 1.0–2.0× slower on the H200.

Where one program per output slice leaves SMs idle, K is split: the fp32 partials go to a workspace and the
slice's last program to arrive (an arrival counter in `zeroed_scratch`, put back to 0 by that program) sums them in
split order: deterministic, no host sync, graph-capturable once run eagerly. Programmatic dependent launch (sm_90+,
`ops.pdl`): each program asks L2 for its first `prefetch` weight tiles before it waits for the kernel before
(weights are constant; x is that kernel's output and is read only after the wait).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from specmla.ops.linear.triton import _num_sms, _prefetch_l2
from specmla.ops.pdl import launch_dependents, pdl_args, wait
from specmla.ops.scratch import zeroed_scratch

SMALL_M = 16  # rows the kernels take; above, the caller runs cuBLAS
SPLITK_COUNTERS = 1 << 16  # arrival counters (one per head × N tile) kept zeroed for split-K
LINE_BYTES = 128  # an L2 line: the prefetch asks for one address per line
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Tiles of one launch. block_n / block_k: the weight tile [block_n output columns, block_k reduction terms]
    (powers of two, ≥ 16); num_stages: tiles the pipelined loop keeps in flight (+ 1); split_k: K ranges per
    output slice (≥ 1; fewer when K has fewer tiles); prefetch: weight tiles a program asks L2 for before its PDL
    wait (0, or a power of two)."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1
    prefetch: int = 2

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemvConfig: {name} must be a power of two ≥ 16, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1 or self.split_k < 1:
            raise ValueError(f"GemvConfig: bad num_warps / num_stages / split_k in {self}")
        if self.prefetch < 0 or self.prefetch & (self.prefetch - 1):
            raise ValueError(f"GemvConfig: prefetch must be 0 or a power of two, got {self.prefetch}")


SMEM_BUDGET = 200 << 10  # shared memory the default rule fills with stages (H100 / H200: 227 KB a block)
SMEM_RESERVE = 16 << 10  # kept free of stages below a smaller device's limit (the kernel's other buffers)


@functools.cache
def _smem_optin(index: int) -> int:
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def stage_budget(device: torch.device) -> int:
    """Shared memory the default rule may fill with pipeline stages on `device`: SMEM_BUDGET, less on GPUs whose
    per-block limit is lower (A100 163 KB, sm_86 / sm_89 99 KB), SMEM_RESERVE below that limit."""
    if device.type != "cuda":
        return SMEM_BUDGET
    limit = _smem_optin(device.index if device.index is not None else torch.cuda.current_device())
    return min(SMEM_BUDGET, limit - SMEM_RESERVE)


def default_config(T: int, G: int, N: int, K: int, sms: int = 132, itemsize: int = 2,
                   smem: int = SMEM_BUDGET) -> GemvConfig:
    """The rule per shape (T rows, G heads, N output columns, K reduction terms, itemsize bytes an element), from
    the H200 sweeps (benchmarks/bench_gemv.py): about one program per SM, each with as much of its weight slice in
    flight as shared memory holds. 64-column tiles where they give about a wave of programs (or K ≥ 4096, where
    a K split is worth its fp32 partials), else 32 or 16 columns with 256-term tiles for long rows: a split's
    reduction costs more than it gains on short K. Stages: every tile of a program's slice in flight at once, up
    to 8 and `smem` bytes of shared memory per SM (half a program where two or more take turns on an SM;
    `stage_budget` gives a device's)."""
    wave = 0.8 * sms
    if G * triton.cdiv(N, 64) >= wave or K >= 4096:
        block_n = 64
    elif G * triton.cdiv(N, 32) >= wave:
        block_n = 32
    else:
        block_n = 16
    block_n = min(block_n, max(16, triton.next_power_of_2(N)))
    block_k = 256 if block_n <= 32 and K >= 2048 else 128
    block_k = min(block_k, max(16, triton.next_power_of_2(K)))
    slices = G * triton.cdiv(N, block_n)
    k_tiles = triton.cdiv(K, block_k)
    split = 1
    if slices < wave:  # too few programs: split K to about one wave (bounded fp32 partials at 16 rows)
        split = max(1, min(k_tiles, round(sms / slices), K // (32 * max(T, 1))))
    per_sm = min(2, triton.cdiv(slices * split, sms))
    stage_bytes = (block_n + 16) * block_k * itemsize
    stages = min(8, triton.cdiv(k_tiles, split) + 1, smem // per_sm // stage_bytes)
    return GemvConfig(block_n=block_n, block_k=block_k, num_warps=4, num_stages=max(2, stages), split_k=split)


@triton.jit
def _k_loop(w_ptrs, x_ptrs, n_ok, m_ok, offs_k, n_full, k_left, stride_wk, stride_xk,
            BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr,
            EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """Σ over n_full tiles and a k_left-term tail of w[BLOCK_N, BLOCK_K] @ xt[BLOCK_K, BLOCK_M] on the tensor
    cores → fp32 [BLOCK_N, BLOCK_M]; x_ptrs: [BLOCK_K, BLOCK_M]."""
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for _ in range(0, n_full):
        if EVEN_N:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        acc = tl.dot(w, xt, acc, input_precision=PRECISION)
        w_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K * stride_xk
    if not EVEN_K:  # a partial tile (fully masked, so no traffic, where k_left is 0)
        k_ok = offs_k < k_left
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.load(x_ptrs, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        acc = tl.dot(w, xt, acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["T"])
def _gemv_kernel(X, W, OUT, WORK, COUNT, T, N, K, K_PER,
                 stride_xt, stride_xg, stride_xk, stride_wg, stride_wk, stride_wn, stride_ot, stride_og, stride_on,
                 SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                 PREFETCH: tl.constexpr, PF_ROWS: tl.constexpr, PF_COLS: tl.constexpr, PF_ALONG_K: tl.constexpr,
                 PDL: tl.constexpr):
    """Program (n tile, head g, split s): out[:, g, n tile] (s's share of it) = Σ_k x[:, g, k] · w[g, k, n tile]
    over k in [s·K_PER, min((s+1)·K_PER, K)); K_PER is a multiple of BLOCK_K, so only the last split has a partial
    tile. SPLIT > 1: the partial goes to WORK [SPLIT, T, G, N]; the slice's last program to arrive sums them."""
    pid_n = tl.program_id(0)
    g = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    n0 = pid_n * BLOCK_N
    k0 = pid_s * K_PER
    k1 = tl.minimum(k0 + K_PER, K)
    n_ok = offs_n < N - n0
    # the tile's base in int64, offsets inside a tile in int32 (< BLOCK · stride)
    w_base = W + g.to(tl.int64) * stride_wg + n0.to(tl.int64) * stride_wn + k0.to(tl.int64) * stride_wk
    w_ptrs = w_base + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
    if PDL:
        if PREFETCH > 0:
            # one address per line of the first PREFETCH tiles, stepping along the weight's unit-stride axis
            if PF_ALONG_K:  # lines along K: [BLOCK_N rows, PF_COLS lines of a row]
                pn = tl.arange(0, PF_ROWS)
                pk = tl.arange(0, PF_COLS) * (BLOCK_K * PREFETCH // PF_COLS)
            else:  # lines along N: [PF_ROWS lines of a K row, PREFETCH · BLOCK_K rows]
                pn = tl.arange(0, PF_ROWS) * (BLOCK_N // PF_ROWS)
                pk = tl.arange(0, PF_COLS)
            pf_ok = (pn[:, None] < N - n0) & (pk[None, :] < k1 - k0)
            _prefetch_l2(tl.where(pf_ok, w_base + pn[:, None] * stride_wn + pk[None, :] * stride_wk, w_base))
    wait(PDL)
    launch_dependents(PDL)
    m_ok = offs_m < T
    x_base = X + g.to(tl.int64) * stride_xg + k0.to(tl.int64) * stride_xk
    n_full = (k1 - k0) // BLOCK_K
    k_left = k1 - k0 - n_full * BLOCK_K
    acc = _k_loop(w_ptrs, x_base + offs_k[:, None] * stride_xk + offs_m[None, :] * stride_xt, n_ok, m_ok, offs_k,
                  n_full, k_left, stride_wk, stride_xk, BLOCK_N, BLOCK_M, BLOCK_K, EVEN_N, EVEN_K, PRECISION)
    out_ptrs = (OUT + g.to(tl.int64) * stride_og + n0.to(tl.int64) * stride_on
                + offs_n[:, None] * stride_on + offs_m[None, :] * stride_ot)
    out_ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT == 1:
        tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=out_ok)
    else:
        G = tl.num_programs(1)
        # WORK [SPLIT, T, G, N]: this program's partial at [pid_s, :, g, n tile]
        work = WORK + (g * N + n0).to(tl.int64) + offs_m[None, :].to(tl.int64) * G * N + offs_n[:, None]
        split_stride = T.to(tl.int64) * G * N
        tl.store(work + pid_s * split_stride, acc, mask=out_ok)
        tl.debug_barrier()  # every thread's partial is issued before the arrival is announced
        count = COUNT + g * tl.num_programs(0) + pid_n
        if tl.atomic_add(count, 1, sem="acq_rel") == SPLIT - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(0, SPLIT):  # split order: the sum does not depend on the arrival order
                total += tl.load(work + s * split_stride, mask=out_ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(OUT.dtype.element_ty), mask=out_ok)
            tl.atomic_xchg(count, 0)


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: GemvConfig | None) -> torch.Tensor:
    """out[t, g, n] = Σ_k x[t, g, k] · w[g, k, n] for x [T, G, K], w [G, K, N], out [T, G, N] (any strides)."""
    T, G, K = x.shape
    N = w.shape[2]
    if T == 0 or G == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    cfg = config or default_config(T, G, N, K, _num_sms(x.device), x.element_size(), stage_budget(x.device))
    k_tiles = triton.cdiv(K, cfg.block_k)
    per = triton.cdiv(k_tiles, min(cfg.split_k, k_tiles))
    split = triton.cdiv(k_tiles, per)  # no empty split
    tiles_n = triton.cdiv(N, cfg.block_n)
    if split > 1:
        if G * tiles_n > SPLITK_COUNTERS:
            raise ValueError(f"gemv: {G} × {tiles_n} output slices exceed the {SPLITK_COUNTERS} split-K counters")
        work = torch.empty(split * T * G * N, dtype=torch.float32, device=x.device)
        count = zeroed_scratch("gemv_splitk", SPLITK_COUNTERS, x.device)
    else:
        work = count = out  # unused
    # the prefetch steps along the weight's unit-stride axis, one address per line (none for other layouts)
    line = max(1, LINE_BYTES // w.element_size())
    along_k = w.stride(1) == 1
    prefetch = cfg.prefetch if along_k or w.stride(2) == 1 else 0
    span = max(1, prefetch) * cfg.block_k
    if along_k:
        pf_rows, pf_cols = cfg.block_n, max(1, span // line)
    else:
        pf_rows, pf_cols = max(1, cfg.block_n // line), span
    pdl = pdl_args(x)
    _gemv_kernel[(tiles_n, G, split)](
        x, w, out, work, count, T, N, K, per * cfg.block_k,
        x.stride(0), x.stride(1), x.stride(2), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        SPLIT=split, BLOCK_M=SMALL_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_N=N % cfg.block_n == 0, EVEN_K=K % cfg.block_k == 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PREFETCH=prefetch, PF_ROWS=pf_rows, PF_COLS=pf_cols, PF_ALONG_K=along_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl)
    return out


def _check_dtypes(name: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None):
    if a.dtype not in _DTYPES or b.dtype != a.dtype:
        raise ValueError(f"{name}: operands must share a dtype among bf16 / fp16 / fp32, got {a.dtype} and {b.dtype}")
    if out is not None and (out.dtype != a.dtype or out.device != a.device):
        raise ValueError(f"{name}: out must be {a.dtype} on {a.device}, got {out.dtype} on {out.device}")
    if b.device != a.device:
        raise ValueError(f"{name}: operands on {a.device} and {b.device}")


def _check_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None):
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_small_m: x [T, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if out is not None and tuple(out.shape) != (x.shape[0], weight.shape[0]):
        raise ValueError(f"linear_small_m: out must be [{x.shape[0]}, {weight.shape[0]}], got {tuple(out.shape)}")
    _check_dtypes("linear_small_m", x, weight, out)


def _check_heads(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None):
    if x.dim() != 3 or w.dim() != 3 or x.shape[1] != w.shape[0] or x.shape[2] != w.shape[1]:
        raise ValueError(f"head_matmul_small_m: x [T, G, K] and w [G, K, N], got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if out is not None and tuple(out.shape) != (x.shape[0], w.shape[0], w.shape[2]):
        raise ValueError(f"head_matmul_small_m: out must be [{x.shape[0]}, {w.shape[0]}, {w.shape[2]}], got "
                         f"{tuple(out.shape)}")
    _check_dtypes("head_matmul_small_m", x, w, out)


def _check_rows(name: str, T: int):
    if T > SMALL_M:
        raise ValueError(f"{name}: {T} rows > SMALL_M = {SMALL_M} (run cuBLAS there)")


def linear_small_m(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                   config: GemvConfig | None = None) -> torch.Tensor:
    """y [T, N] = x [T, K] @ weight [N, K]ᵀ, fp32 accumulation, in x's dtype (bf16 / fp16 / fp32, weight the
    same); T ≤ SMALL_M (ValueError above). Any strides (x's and out's rows unit-stride stream best); written into
    `out` [T, N] when given. config: tiles (default `default_config`)."""
    _check_linear(x, weight, out)
    T, N = x.shape[0], weight.shape[0]
    _check_rows("linear_small_m", T)
    if out is None:
        out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    _launch(x.unsqueeze(1), weight.t().unsqueeze(0), out.unsqueeze(1), config)
    return out


def head_matmul_small_m(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                        config: GemvConfig | None = None) -> torch.Tensor:
    """out [T, G, N]: out[t, g] = x[t, g] @ w[g] for x [T, G, K], w [G, K, N] (any strides, all three), fp32
    accumulation, in x's dtype; T ≤ SMALL_M (ValueError above). Written into `out` when given (e.g. a column slice
    of a wider buffer). config: tiles (default `default_config`)."""
    _check_heads(x, w, out)
    T, G, N = x.shape[0], w.shape[0], w.shape[2]
    _check_rows("head_matmul_small_m", T)
    if out is None:
        out = torch.empty(T, G, N, dtype=x.dtype, device=x.device)
    return _launch(x, w, out, config)


def linear_small_m_torch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                         config: GemvConfig | None = None) -> torch.Tensor:
    """`linear_small_m` in fp32 torch math, cast to x's dtype (any T; config is ignored)."""
    _check_linear(x, weight, out)
    y = (x.float() @ weight.float().t()).to(x.dtype)
    return y if out is None else out.copy_(y)


def head_matmul_small_m_torch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                              config: GemvConfig | None = None) -> torch.Tensor:
    """`head_matmul_small_m` in fp32 torch math, cast to x's dtype (any T; config is ignored)."""
    _check_heads(x, w, out)
    y = torch.einsum("tgk,gkn->tgn", x.float(), w.float()).to(x.dtype)
    return y if out is None else out.copy_(y)
