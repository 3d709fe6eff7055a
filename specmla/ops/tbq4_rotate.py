"""The tbq4 decode's rotations, one Triton kernel each: q's latent part before attention, the output after.

Why: attention over a tbq4 cache runs in the FWHT-rotated domain, so `mla_decode_triton` rotates q's latent part
once before its kernel and the output back once after it. In torch that was a slice, a cast, a matmul, a cast and
a cat for q and four kernels more for the output: 30 µs of a 254 µs call at B=32 T=32k, H=16 (H100,
docs/benchmarks.md issue 7). Here each rotation is one kernel: a [rows, 128] tile times the ±1 Sylvester Hadamard
matrix on the tensor cores (bf16 / fp16 values and ±1 are exact in tf32, so the products are exact and the sums
fp32), times 1/√128; the columns past `width` (q's rope part) are copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmla.ops import tbq4

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
