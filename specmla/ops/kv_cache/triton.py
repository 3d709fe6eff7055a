"""Fused cache writes: pack [c_kv | k_pe], quantise (fp8 / tbq4) and scatter by slot in one kernel, from strided
inputs. Checked byte for byte against `reference.encode_rows` and, for unquantised rows, torch's cat + index_copy."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmla.ops.kv_cache import tbq4
from specmla.ops.kv_cache.layout import QUANTIZED, ROPE_GROUP, rope_offset, row_spec
from specmla.ops.pdl import launch_dependents, pdl_args, wait


@triton.jit
def _bf16_rne(x):
    """fp32 → bf16, round to nearest even, by integer arithmetic (the interpreter's cast differs)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _e4m3_rne(x):
    """fp32 with |x| ≤ 448 → e4m3fn byte, round to nearest even (subnormals below 2^-6 included)."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = ((bits >> 31) & 1).to(tl.int32)
    exp = ((bits >> 23) & 0xFF).to(tl.int32) - 127
    man = (bits & 0x7FFFFF).to(tl.int32)
    # normal: keep 3 of 23 mantissa bits, ties to even; a carry bumps the exponent
    keep = man >> 20
    rest = man & 0xFFFFF
    up = (rest > 0x80000) | ((rest == 0x80000) & ((keep & 1) == 1))
    keep = keep + up.to(tl.int32)
    exp_n = exp + (keep >> 3)
    normal = ((exp_n + 7) << 3) | (keep & 7)
    # subnormal: multiples of 2^-9
    t = tl.abs(x) * 512.0
    f = tl.floor(t)
    frac = t - f
    fi = f.to(tl.int32)
    sub = fi + ((frac > 0.5) | ((frac == 0.5) & ((fi & 1) == 1))).to(tl.int32)
    code = tl.where(exp < -6, sub, normal)
    return ((sign << 7) | code).to(tl.uint8)


@triton.jit
def _hadamard_signs():
    """The 128×128 Sylvester Hadamard matrix's ±1 entries, (-1)^popcount(i & j), made in registers."""
    k = tl.arange(0, 128)
    v = k[:, None] & k[None, :]
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return 1.0 - 2.0 * (v & 1).to(tl.float32)


@triton.jit
def _tf32_part(x):
    """x with its 13 low mantissa bits cleared: exact in tf32."""
    return (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _rotate_block(x, PARTS: tl.constexpr):
    """x [T, 128] fp32 times the ±1 Hadamard signs on the tensor cores, the products exact and summed in fp32: x
    in PARTS tf32-exact parts (1: x came from bf16 / fp16, already exact in tf32; 3: fp32, 11 + 11 + 2 significant
    bits, exact for |x| ≥ 2⁻¹⁰⁰; smaller x lose bits below 2⁻¹³⁶)."""
    signs = _hadamard_signs()
    if PARTS == 1:
        return tl.dot(x, signs, input_precision="tf32")
    hi = _tf32_part(x)
    rest = x - hi
    mid = _tf32_part(rest)
    y = tl.dot(hi, signs, input_precision="tf32")
    y = tl.dot(mid, signs, y, input_precision="tf32")
    return tl.dot(rest - mid, signs, y, input_precision="tf32")


@triton.jit
def _write_quantized_kernel(
    CKV, KPE, SLOT, OUT_U8, OUT_W, OUT_BF, CENT,
    T, stride_ct, stride_pt, row_u8, row_w, row_bf,
    DC: tl.constexpr, DR: tl.constexpr, BLOCK_T: tl.constexpr, TBQ4: tl.constexpr, ROPE_AT: tl.constexpr,
    ROPE_I8: tl.constexpr = False, GROUP: tl.constexpr = 8, X_PARTS: tl.constexpr = 3, PDL: tl.constexpr = False,
):
    """One program per BLOCK_T tokens. fp8: per-128 amax scale, e4m3 codes, fp32 scales (OUT_W is
    the fp32 view of the rows). tbq4: per 128-block y = x·H (Hadamard as a matrix product, split into
    the even and odd output columns so that two codes pack into one byte; `_rotate_block` on the tensor cores,
    as an fp32 product on the CUDA cores spills its operand), unit coordinates coded by the
    nearest centroid, fp16 corrected norm (OUT_W is the fp16 view). Rope goes out as bf16 at ROPE_AT (in
    bf16 units), or (ROPE_I8, fp8) as int8 bytes at ROPE_AT after its fp16 scales (OUT_BF is then the
    fp16 view), one per GROUP values, as `rope_int8` codes them."""
    pid = tl.program_id(0)
    wait(PDL)  # the rows and their slots come from earlier kernels / copies
    launch_dependents(PDL)
    t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # int64: t · stride passes 2³¹ past ~3.7M tokens
    t_ok = t < T
    slot = tl.load(SLOT + t, mask=t_ok, other=0).to(tl.int64)
    offs = tl.arange(0, 128)
    for blk in tl.static_range(0, DC // 128):
        x = tl.load(CKV + t[:, None] * stride_ct + blk * 128 + offs[None, :], mask=t_ok[:, None], other=0.0)
        x = x.to(tl.float32)
        if TBQ4:
            half = tl.arange(0, 64)
            # coordinates 0, 2, 4, ... and 1, 3, 5, ... of the rotated block
            y = _rotate_block(x, X_PARTS) * 0.08838834764831845  # 1/√128
            y0, y1 = tl.split(tl.reshape(y, [BLOCK_T, 64, 2]))
            norm = tl.sqrt(tl.sum(y0 * y0, 1) + tl.sum(y1 * y1, 1))
            inv = 1.0 / tl.maximum(norm, 1e-30)
            u0, u1 = y0 * inv[:, None], y1 * inv[:, None]
            best0 = tl.zeros([BLOCK_T, 64], dtype=tl.int32)
            best1 = tl.zeros([BLOCK_T, 64], dtype=tl.int32)
            c0 = tl.load(CENT)
            d0, d1 = tl.abs(u0 - c0), tl.abs(u1 - c0)
            for k in tl.static_range(1, 16):
                ck = tl.load(CENT + k)
                e0, e1 = tl.abs(u0 - ck), tl.abs(u1 - ck)
                best0 = tl.where(e0 < d0, k, best0)
                best1 = tl.where(e1 < d1, k, best1)
                d0, d1 = tl.minimum(d0, e0), tl.minimum(d1, e1)
            r0, r1 = tl.load(CENT + best0), tl.load(CENT + best1)
            recon = tl.sqrt(tl.sum(r0 * r0, 1) + tl.sum(r1 * r1, 1))
            corrected = norm / tl.maximum(recon, 1e-30)
            packed = (best0 | (best1 << 4)).to(tl.uint8)
            tl.store(OUT_U8 + slot[:, None] * row_u8 + blk * 64 + half[None, :], packed, mask=t_ok[:, None])
            tl.store(OUT_W + slot * row_w + DC // 4 + blk, corrected.to(tl.float16), mask=t_ok)
        else:
            # IEEE round-to-nearest divisions (Triton's fp32 `/` is approximate on the GPU), so the
            # codes are the torch writer's byte for byte
            scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 1), tl.full([BLOCK_T], 448.0, tl.float32)), 1e-12)
            codes = _e4m3_rne(tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape)))
            tl.store(OUT_U8 + slot[:, None] * row_u8 + blk * 128 + offs[None, :], codes, mask=t_ok[:, None])
            tl.store(OUT_W + slot * row_w + DC // 4 + blk, scale, mask=t_ok)
    r = tl.arange(0, DR)
    pe = tl.load(KPE + t[:, None] * stride_pt + r[None, :], mask=t_ok[:, None], other=0.0)
    if ROPE_I8:
        g = tl.reshape(pe.to(tl.float32), [BLOCK_T, DR // GROUP, GROUP])
        scale = tl.math.div_rn(tl.max(tl.abs(g), 2), tl.full([BLOCK_T, DR // GROUP], 127.0, tl.float32))
        scale = tl.minimum(tl.maximum(scale, 2.0 ** -24), 65504.0).to(tl.float16)
        v = tl.math.div_rn(g, tl.broadcast_to(tl.expand_dims(scale.to(tl.float32), 2), g.shape))
        v = (v + 12582912.0) - 12582912.0  # round half to even (|v| < 2^22), as torch.round
        v = tl.reshape(tl.minimum(tl.maximum(v, -127.0), 127.0).to(tl.int32).to(tl.int8), [BLOCK_T, DR])
        gi = tl.arange(0, DR // GROUP)
        tl.store(OUT_BF + slot[:, None] * row_bf + (ROPE_AT - DR // GROUP * 2) // 2 + gi[None, :], scale,
                 mask=t_ok[:, None])
        tl.store(OUT_U8 + slot[:, None] * row_u8 + ROPE_AT + r[None, :], v.to(tl.uint8, bitcast=True),
                 mask=t_ok[:, None])
    else:
        tl.store(OUT_BF + slot[:, None] * row_bf + ROPE_AT + r[None, :], _bf16_rne(pe.to(tl.float32)),
                 mask=t_ok[:, None])


def write_kv_cache_triton(kv_cache: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                          slot_mapping: torch.Tensor, kv_format: str, block_t: int = 16) -> None:
    """Fused pack + quantise + scatter for fp8 / tbq4 caches (`write_kv_cache`'s reference semantics)."""
    T, dc = c_kv.shape
    dr = k_pe.shape[-1]
    width, _ = row_spec(kv_format, dc, dr, kv_cache.dtype)
    if kv_format not in QUANTIZED or kv_cache.dtype != torch.uint8 or kv_cache.shape[-1] != width:
        raise ValueError(f"write_kv_cache_triton writes fp8/tbq4 uint8 rows of width {width}")
    if not kv_cache.is_contiguous() or c_kv.stride(-1) != 1 or k_pe.stride(-1) != 1 or dr & (dr - 1):
        raise ValueError("need a contiguous cache, unit-stride last dims and a power-of-two Dr")
    if T == 0:
        return
    tbq, i8 = kv_format == "tbq4", kv_format == "fp8"
    flat = kv_cache.view(-1, width)
    wide = flat.view(torch.float16 if tbq else torch.float32)
    bf = flat.view(torch.float16 if i8 else torch.bfloat16)  # the rope (int8: its scales)
    cent = tbq4.centroids(c_kv.device) if tbq else flat
    rope_at = rope_offset(kv_format, dc, dr)
    _write_quantized_kernel[(triton.cdiv(T, block_t),)](
        c_kv, k_pe, slot_mapping, flat, wide, bf, cent,
        T, c_kv.stride(0), k_pe.stride(0), flat.stride(0), wide.stride(0), bf.stride(0),
        DC=dc, DR=dr, BLOCK_T=block_t, TBQ4=tbq, ROPE_AT=rope_at if i8 else rope_at // 2, ROPE_I8=i8,
        GROUP=ROPE_GROUP, X_PARTS=1 if c_kv.dtype in (torch.bfloat16, torch.float16) else 3, **pdl_args(c_kv),
    )


@triton.jit
def _write_rows_kernel(CKV, KPE, SLOT, OUT, T, stride_ct, stride_pt, stride_s, row,
                       DC: tl.constexpr, DR: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_T: tl.constexpr,
                       PDL: tl.constexpr = False):
    """One program per BLOCK_T tokens: row slot ← [c_kv | k_pe], same dtype (a copy, no rounding); tokens with a
    negative slot are not written."""
    wait(PDL)
    launch_dependents(PDL)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # int64: t · stride may pass 2³¹
    slot = tl.load(SLOT + t * stride_s, mask=t < T, other=-1).to(tl.int64)
    t_ok = slot >= 0
    c = tl.arange(0, BLOCK_DC)
    ok = t_ok[:, None] & (c[None, :] < DC)
    x = tl.load(CKV + t[:, None] * stride_ct + c[None, :], mask=ok)
    tl.store(OUT + slot[:, None] * row + c[None, :], x, mask=ok)
    r = tl.arange(0, DR)
    pe = tl.load(KPE + t[:, None] * stride_pt + r[None, :], mask=t_ok[:, None])
    tl.store(OUT + slot[:, None] * row + DC + r[None, :], pe, mask=t_ok[:, None])


def rows_kernel_takes(kv_cache: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> bool:
    """Whether `write_kv_rows_triton` takes these tensors: rows of width Dc + Dr in one dtype, a contiguous cache,
    unit-stride last dims and a power-of-two Dr."""
    dr = k_pe.shape[-1]
    return (kv_cache.shape[-1] == c_kv.shape[-1] + dr and kv_cache.dtype == c_kv.dtype == k_pe.dtype
            and kv_cache.is_contiguous() and c_kv.stride(-1) == 1 and k_pe.stride(-1) == 1 and not dr & (dr - 1))


def write_kv_rows_triton(kv_cache: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                         slot_mapping: torch.Tensor, block_t: int = 8) -> None:
    """Unquantised rows in one kernel (`write_kv_cache`'s cat + index_copy): c_kv, k_pe and the cache in one dtype;
    a negative slot skips its token."""
    T, dc = c_kv.shape
    dr = k_pe.shape[-1]
    if not rows_kernel_takes(kv_cache, c_kv, k_pe):
        raise ValueError(f"write_kv_rows_triton copies rows of width {dc + dr} in the cache's dtype: it needs a "
                         "contiguous cache, unit-stride last dims and a power-of-two Dr")
    if T == 0:
        return
    flat = kv_cache.view(-1, dc + dr)
    _write_rows_kernel[(triton.cdiv(T, block_t),)](
        c_kv, k_pe, slot_mapping, flat, T, c_kv.stride(0), k_pe.stride(0), slot_mapping.stride(0), flat.stride(0),
        DC=dc, DR=dr, BLOCK_DC=triton.next_power_of_2(dc), BLOCK_T=block_t, **pdl_args(c_kv),
    )
