"""The tbq4 decode's rotations, one Triton kernel each: q's latent part before attention, the output after.

Attention over a tbq4 cache runs in the FWHT-rotated domain, so `mla_decode` rotates q's latent part once before
its kernel and the output back once after it, each in one kernel (in torch a rotation is several small kernels):
a [rows, 128] tile times the ±1 Sylvester Hadamard
matrix on the tensor cores (bf16 / fp16 values and ±1 are exact in tf32, so the products are exact and the sums
fp32), times 1/√128; the columns past `width` (q's rope part) are copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmla.ops.kv_cache import tbq4
from specmla.ops.online_softmax import split_merge_weights

BLOCK = tbq4.BLOCK
ROWS = 16  # rows per program: the smallest tile the tensor cores take
_SIGNS: dict = {}


def hadamard_signs(device) -> torch.Tensor:
    """The 128×128 Sylvester Hadamard matrix with ±1 entries (fp32, cached per device): √128 · `tbq4.hadamard`."""
    key = str(device)
    if key not in _SIGNS:
        i = torch.arange(BLOCK)
        parity = torch.zeros(BLOCK, BLOCK, dtype=torch.int64)
        for bit in range(7):  # (-1)^popcount(i & j)
            parity ^= ((i[:, None] & i[None, :]) >> bit) & 1
        _SIGNS[key] = (1 - 2 * parity).float().to(device).contiguous()
    return _SIGNS[key]


def _check(x: torch.Tensor, width: int, out: torch.Tensor | None) -> None:
    if width % BLOCK or not 0 < width <= x.shape[-1]:
        raise ValueError(f"width {width} must be a positive multiple of {BLOCK} within the last dim ({x.shape[-1]})")
    if out is not None and out.shape != x.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, x {tuple(x.shape)}")


def rotate_rows_torch(x: torch.Tensor, width: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: FWHT of each 128-wide block of x[..., :width] (fp32), x[..., width:] unchanged, in out's dtype
    (default x's). out may be x."""
    _check(x, width, out)
    res = torch.cat([tbq4.rotate_blocks(x[..., :width].float()), x[..., width:].float()], dim=-1)
    if out is None:
        return res.to(x.dtype)
    out.copy_(res)
    return out


@triton.jit
def _rotate_rows_kernel(X, OUT, SIGNS, R, stride_x, stride_o, WIDTH: tl.constexpr, D: tl.constexpr,
                        TAIL_PAD: tl.constexpr, ROWS: tl.constexpr, PRECISION: tl.constexpr):
    """Program (rows block, column block): column blocks below WIDTH / 128 rotate a [ROWS, 128] tile, the last one
    copies the columns past WIDTH."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    blk = tl.program_id(1)
    ok = rows < R
    if blk * 128 < WIDTH:
        cols = blk * 128 + tl.arange(0, 128)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        k = tl.arange(0, 128)
        signs = tl.load(SIGNS + k[:, None] * 128 + k[None, :])
        y = tl.dot(x, signs, input_precision=PRECISION) * 0.08838834764831845  # 1/√128
        tl.store(OUT + rows[:, None] * stride_o + cols[None, :], y.to(OUT.dtype.element_ty), mask=ok[:, None])
    else:  # (names of their own: Triton 3.6 wants a name's type equal in both branches)
        tail = WIDTH + tl.arange(0, TAIL_PAD)
        keep = ok[:, None] & (tail[None, :] < D)
        t = tl.load(X + rows[:, None] * stride_x + tail[None, :], mask=keep)
        tl.store(OUT + rows[:, None] * stride_o + tail[None, :], t.to(OUT.dtype.element_ty), mask=keep)


def rotate_rows(x: torch.Tensor, width: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """`rotate_rows_torch` in one kernel. x and out: [..., D] with unit column stride (other strides are taken
    through a reshape, which copies only when the rows are not one stride apart); out may be x."""
    _check(x, width, out)
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    res = torch.empty_like(x) if out is None else out
    o2 = res.view(-1, d) if res.is_contiguous() else torch.empty(x2.shape, dtype=res.dtype, device=res.device)
    R = x2.shape[0]
    tail = d - width
    if R:
        # bf16 / fp16 values and ±1 are exact in tf32; fp32 values need the exact (ieee) dot
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        _rotate_rows_kernel[(triton.cdiv(R, ROWS), width // BLOCK + (tail > 0))](
            x2, o2, hadamard_signs(x.device), R, x2.stride(0), o2.stride(0), WIDTH=width, D=d,
            TAIL_PAD=triton.next_power_of_2(max(tail, 1)), ROWS=ROWS, PRECISION=precision, num_warps=4)
    if o2.data_ptr() != res.data_ptr():
        res.copy_(o2.view(res.shape))
    return res


@triton.jit
def _combine_rotate_kernel(
    MID_O, MID_LSE, OUT, LSE, SIGNS,
    stride_mob, stride_mos, stride_moh, stride_mosp,
    stride_mlb, stride_mls, stride_mlh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_ls,
    S, H, NUM_SPLITS,
    BLOCK_SPLITS: tl.constexpr, ROWS: tl.constexpr, PRECISION: tl.constexpr,
):
    """`mla_decode`'s combine for a tbq4 cache with the output's rotation folded in. Program (request·token,
    ROWS heads, 128 columns): the splits' partials (log2-sum-exp weights) merged into a [ROWS, 128] tile in the
    rotated domain, rotated back as acc_hi·signs + acc_lo·signs (acc_hi: acc rounded to bf16, exact in tf32; the
    residual's tf32 rounding is 2⁻²⁰ of acc) and stored; the first column block stores the natural-log lse."""
    pid = tl.program_id(0)
    b = pid // S
    s = pid % S
    h = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    h_ok = h < H
    cols = tl.program_id(2) * 128 + tl.arange(0, 128)
    lse_rows = MID_LSE + b * stride_mlb + s * stride_mls + h * stride_mlh
    sp = tl.arange(0, BLOCK_SPLITS)
    lse = tl.load(lse_rows[:, None] + sp[None, :], mask=h_ok[:, None] & (sp[None, :] < NUM_SPLITS),
                  other=float("-inf"))
    m_safe, inv_total, lse2 = split_merge_weights(lse, 1)
    o_rows = MID_O + b * stride_mob + s * stride_mos + h[:, None] * stride_moh + cols[None, :]
    acc = tl.zeros([ROWS, 128], dtype=tl.float32)
    for i in range(NUM_SPLITS):
        w = tl.exp2(tl.load(lse_rows + i, mask=h_ok, other=float("-inf")) - m_safe) * inv_total
        acc += tl.load(o_rows + i * stride_mosp, mask=h_ok[:, None], other=0.0) * w[:, None]
    k = tl.arange(0, 128)
    signs = tl.load(SIGNS + k[:, None] * 128 + k[None, :])
    hi = acc.to(tl.bfloat16).to(tl.float32)
    y = tl.dot(hi, signs, input_precision=PRECISION) + tl.dot(acc - hi, signs, input_precision=PRECISION)
    y = y * 0.08838834764831845  # 1/√128
    tl.store(OUT + b * stride_ob + s * stride_os + h[:, None] * stride_oh + cols[None, :],
             y.to(OUT.dtype.element_ty), mask=h_ok[:, None])
    if tl.program_id(2) == 0:
        tl.store(LSE + b * stride_lb + s * stride_ls + h, lse2 / 1.4426950408889634, mask=h_ok)  # natural log


def combine_rotate(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge split partials mid_o [B, S, H, splits, Dc] (fp32, rotated domain; log2-sum-exp mid_lse [B, S, H,
    splits]) into out [B, S, H, Dc] rotated back, and lse [B, S, H] (natural log)."""
    B, S, H, ns, dc = mid_o.shape
    if dc % BLOCK or mid_o.stride(-1) != 1 or mid_lse.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("combine_rotate needs Dc a multiple of 128 and unit-stride last dims")
    precision = "ieee" if out.dtype == torch.float32 else "tf32"
    _combine_rotate_kernel[(B * S, triton.cdiv(H, ROWS), dc // BLOCK)](
        mid_o, mid_lse, out, lse, hadamard_signs(out.device),
        *mid_o.stride()[:4], *mid_lse.stride()[:3], *out.stride()[:3], *lse.stride()[:2],
        S, H, ns, BLOCK_SPLITS=max(2, triton.next_power_of_2(ns)), ROWS=ROWS, PRECISION=precision, num_warps=4)


def combine_rotate_torch(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Reference for `combine_rotate`: the log2-sum-exp merge in fp32, then `rotate_rows_torch`."""
    m = mid_lse.amax(-1, keepdim=True)
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    w = torch.exp2(mid_lse - m_safe)
    total = w.sum(-1, keepdim=True)
    merged = (mid_o * (w / torch.where(total > 0, total, torch.ones_like(total)))[..., None]).sum(-2)
    rotate_rows_torch(merged, merged.shape[-1], out=out)
    total, m_safe = total[..., 0], m_safe[..., 0]
    lse.copy_(torch.where(total > 0, (m_safe + torch.log2(torch.where(total > 0, total, torch.ones_like(total))))
                          / 1.4426950408889634, torch.full_like(total, float("-inf"))))
