"""The per-token part of an MLA decode step in one kernel: latent norm, both ropes, cache write, q_pe's placement.

Unfused (`MLAttention.project` + `_absorbed`), a decode step launches for each layer:
1. kv_a_layernorm: RMSNorm of c_kv = latent[:, :Dc];
2. rope of q_pe = q[:, :, Dn:] and of k_pe = latent[:, Dc:];
3. the cache write of [c_kv | k_pe] at slot_mapping;
4. torch.cat([q_nope · W_UK, q_pe]), which puts the roped q_pe beside the absorbed query.
`mla_decode_prologue` does all four in one launch, one program per token: it reads the token's latent row and q_pe
of all H heads once and writes the roped q_pe straight into q_out[:, :, Dc:], the absorbed query buffer whose first
Dc columns the q_nope · W_UK product fills afterwards (so no cat).

Where the normed c_kv and roped k_pe go, by kv_format:
- native caches ("auto", "native", "bf16", "fp16", "fp32": rows of Dc + Dr in a 16- or 32-bit float dtype):
  row slot_mapping[t] ← [normed c_kv | roped k_pe], computed in the latent's dtype and cast to the cache's (as
  `write_kv_cache`); a negative slot skips its token; `latent` is not written
  (the absorbed decode reads only the cache and q_out, so that store would be wasted bytes);
- quantised caches ("fp8", "fp8_ds_mla", "tbq4"): the kernel writes both back into `latent` in place, and
  `write_kv_cache` then quantises and scatters them (negative slots are not supported there);
- kv_cache None: the in-place write into `latent` only.
The math is that of `rms_norm_torch` (normalise in fp32, cast to the latent's dtype, scale by the weight) and of
`apply_rope` (fp32 rotation; interleave=True writes the de-interleaved V3 layout, False is rotate-half).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmla.ops.backend import pick_backend
from specmla.ops.kv_cache import QUANTIZED, row_spec, write_kv_cache
from specmla.ops.norm import _scaled_norm, rms_norm_torch
from specmla.ops.pdl import launch_dependents, pdl_args, wait
from specmla.ops.rope import apply_rope


def _check(q, latent, kv_norm_weight, positions, cos_sin, kv_cache, slot_mapping, q_out, kv_format):
    """(Dn, Dc, Dr, native cache?) of a call; ValueError on inputs that do not fit together."""
    if q.dim() != 3 or latent.dim() != 2 or kv_norm_weight.dim() != 1 or cos_sin.dim() != 2 or q_out.dim() != 3:
        raise ValueError(f"mla_decode_prologue needs q [T, H, Dn+Dr], latent [T, Dc+Dr], weight [Dc], cos_sin "
                         f"[P, Dr], q_out [T, H, Dc+Dr]; got {tuple(q.shape)}, {tuple(latent.shape)}, "
                         f"{tuple(kv_norm_weight.shape)}, {tuple(cos_sin.shape)}, {tuple(q_out.shape)}")
    (T, H, dq), dc, dr = q.shape, kv_norm_weight.shape[0], cos_sin.shape[1]
    if dr < 2 or dr & (dr - 1) or dq < dr:
        raise ValueError(f"mla_decode_prologue needs a power-of-two rope dim Dr ≤ q's {dq}, got Dr={dr}")
    if latent.shape != (T, dc + dr) or q_out.shape != (T, H, dc + dr) or positions.shape != (T,):
        raise ValueError(f"shapes do not fit (T={T}, H={H}, Dc={dc}, Dr={dr}): latent {tuple(latent.shape)}, "
                         f"q_out {tuple(q_out.shape)}, positions {tuple(positions.shape)}")
    if q_out.dtype != q.dtype or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"q_out must have q's dtype {q.dtype} (got {q_out.dtype}) and positions int32/int64 "
                         f"(got {positions.dtype})")
    if q.stride(-1) != 1 or latent.stride(-1) != 1 or q_out.stride(-1) != 1 or cos_sin.stride(-1) != 1:
        raise ValueError("mla_decode_prologue needs unit-stride last dims (q, latent, q_out, cos_sin)")
    native = kv_format not in QUANTIZED
    if kv_cache is not None:
        width, dtype = row_spec(kv_format, dc, dr, latent.dtype)
        if native and kv_cache.dtype in (torch.bfloat16, torch.float16, torch.float32):
            dtype = kv_cache.dtype  # a native cache may hold another float dtype: the rows are cast, as write_kv_cache
        if kv_cache.dim() != 3 or kv_cache.shape[-1] != width or kv_cache.dtype != dtype:
            raise ValueError(f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype}: kv_format {kv_format} with a "
                             f"{latent.dtype} latent (Dc={dc}, Dr={dr}) needs rows of {width} {dtype}")
        if not kv_cache.is_contiguous() or slot_mapping is None or slot_mapping.shape != (T,):
            raise ValueError("mla_decode_prologue needs a contiguous kv_cache and slot_mapping [T]")
    return dq - dr, dc, dr, native


def mla_decode_prologue_torch(q, latent, kv_norm_weight, eps, positions, cos_sin, kv_cache, slot_mapping, q_out,
                              kv_format="bf16", interleave=True, backend="torch") -> None:
    """Reference of `mla_decode_prologue` (the same effects; `backend` is accepted and ignored)."""
    dn, dc, dr, native = _check(q, latent, kv_norm_weight, positions, cos_sin, kv_cache, slot_mapping, q_out,
                                kv_format)
    c_kv = rms_norm_torch(latent[:, :dc], kv_norm_weight, eps)[0].to(latent.dtype)
    k_pe = apply_rope(latent[:, dc:], positions, cos_sin, interleave)
    q_out[:, :, dc:] = apply_rope(q[:, :, dn:], positions, cos_sin, interleave)
    if kv_cache is not None and native:
        keep = slot_mapping >= 0
        rows = torch.cat([c_kv, k_pe], -1)[keep].to(kv_cache.dtype)
        kv_cache.view(-1, dc + dr).index_copy_(0, slot_mapping[keep].long(), rows)
        return
    latent[:, :dc], latent[:, dc:] = c_kv, k_pe
    if kv_cache is not None:
        write_kv_cache(kv_cache, latent[:, :dc], latent[:, dc:], slot_mapping, kv_format)


@triton.jit
def _rope_halves(x, cos, sin, R: tl.constexpr, HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """x [R, 2·HALF] fp32 rotated by (cos, sin) [HALF]: the output's first and second halves, each [R, HALF]
    (`apply_rope`: pairs (x0, x1), (x2, x3), ... when INTERLEAVE, else (x_i, x_{i+HALF}))."""
    if INTERLEAVE:
        x1, x2 = tl.split(tl.reshape(x, [R, HALF, 2]))
    else:
        x1, x2 = tl.split(tl.permute(tl.reshape(x, [R, 2, HALF]), 0, 2, 1))
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :]


@triton.jit
def _prologue_kernel(QPE, LAT, W, POS, CS, SLOT, CACHE, QO, H, eps,
                     stride_qt, stride_qh, stride_lt, stride_p, stride_cs, stride_s, stride_ot, stride_oh,
                     DC: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DC: tl.constexpr,
                     INTERLEAVE: tl.constexpr, TO_CACHE: tl.constexpr, TO_LATENT: tl.constexpr, PDL: tl.constexpr):
    """Program t: token t's latent row and its H heads of q_pe (QPE, QO: views at q's / q_out's rope columns)."""
    HALF: tl.constexpr = DR // 2
    t = tl.program_id(0).to(tl.int64)  # int64: every row offset below is in int64
    c = tl.arange(0, BLOCK_DC)
    c_ok = c < DC
    w = tl.load(W + c, mask=c_ok, other=0.0)  # the only input no earlier kernel writes
    wait(PDL)
    launch_dependents(PDL)
    lat = LAT + t * stride_lt
    ckv = _scaled_norm(tl.load(lat + c, mask=c_ok, other=0.0), w, DC, eps).to(LAT.dtype.element_ty)
    pos = tl.load(POS + t * stride_p).to(tl.int64)
    i = tl.arange(0, HALF)
    cos = tl.load(CS + pos * stride_cs + i)
    sin = tl.load(CS + pos * stride_cs + HALF + i)
    r = tl.arange(0, DR)
    k1, k2 = _rope_halves(tl.load(lat + DC + r)[None, :].to(tl.float32), cos, sin, 1, HALF, INTERLEAVE)
    k1, k2 = k1.to(LAT.dtype.element_ty), k2.to(LAT.dtype.element_ty)
    # q_pe of all heads → q_out's rope columns (q_out has q's dtype)
    h = tl.arange(0, BLOCK_H)[:, None]
    h_ok = h < H
    x = tl.load(QPE + t * stride_qt + h * stride_qh + r[None, :], mask=h_ok, other=0.0).to(tl.float32)
    q1, q2 = _rope_halves(x, cos, sin, BLOCK_H, HALF, INTERLEAVE)
    qo = QO + t * stride_ot + h * stride_oh + i[None, :]
    tl.store(qo, q1.to(QO.dtype.element_ty), mask=h_ok)
    tl.store(qo + HALF, q2.to(QO.dtype.element_ty), mask=h_ok)
    if TO_CACHE:  # native row [c_kv | k_pe] at its slot; a negative slot writes nothing
        slot = tl.load(SLOT + t * stride_s).to(tl.int64)
        if slot >= 0:
            row = CACHE + slot * (DC + DR)
            tl.store(row + c, ckv.to(CACHE.dtype.element_ty), mask=c_ok)
            tl.store(row + DC + i[None, :], k1.to(CACHE.dtype.element_ty))
            tl.store(row + DC + HALF + i[None, :], k2.to(CACHE.dtype.element_ty))
    if TO_LATENT:  # in place, for the quantising cache writer (or no cache at all)
        tl.store(lat + c, ckv, mask=c_ok)
        tl.store(lat + DC + i[None, :], k1)
        tl.store(lat + DC + HALF + i[None, :], k2)


def mla_decode_prologue(q, latent, kv_norm_weight, eps, positions, cos_sin, kv_cache, slot_mapping, q_out,
                        kv_format="bf16", interleave=True, backend="auto") -> None:
    """Normalise c_kv = latent[:, :Dc], rope k_pe = latent[:, Dc:] and q_pe = q[:, :, Dn:], write the cache row(s)
    and the roped q_pe into q_out[:, :, Dc:] (its first Dc columns are left as they are); see the module docstring
    for where c_kv / k_pe go. q [T, H, Dn+Dr] and latent [T, Dc+Dr] may be strided views (unit-stride last dims);
    q is not modified. backend: "auto" (the kernel on CUDA), "triton" or "torch"."""
    if pick_backend(backend, q, latent, kv_norm_weight) == "torch":
        return mla_decode_prologue_torch(q, latent, kv_norm_weight, eps, positions, cos_sin, kv_cache, slot_mapping,
                                         q_out, kv_format, interleave)
    dn, dc, dr, native = _check(q, latent, kv_norm_weight, positions, cos_sin, kv_cache, slot_mapping, q_out,
                                kv_format)
    T, H = q.shape[:2]
    if T == 0:
        return
    to_cache = kv_cache is not None and native
    cache = kv_cache if to_cache else latent
    slots = slot_mapping if to_cache else positions
    q_pe, qo = q[:, :, dn:], q_out[:, :, dc:]
    _prologue_kernel[(T,)](
        q_pe, latent, kv_norm_weight, positions, cos_sin, slots, cache, qo, H, eps,
        q.stride(0), q.stride(1), latent.stride(0), positions.stride(0), cos_sin.stride(0), slots.stride(0),
        q_out.stride(0), q_out.stride(1),
        DC=dc, DR=dr, BLOCK_H=triton.next_power_of_2(H), BLOCK_DC=triton.next_power_of_2(dc),
        INTERLEAVE=interleave, TO_CACHE=to_cache, TO_LATENT=not to_cache,
        num_warps=8 if triton.next_power_of_2(H) * dr >= 8192 else 4,  # H=128 on sm_90: 73 registers, not 117
        **pdl_args(latent),
    )
    if kv_cache is not None and not native:
        write_kv_cache(kv_cache, latent[:, :dc], latent[:, dc:], slot_mapping, kv_format)
