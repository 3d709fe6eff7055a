"""The fused MLA decode prologue (latent norm, q_pe / k_pe rope, cache write, q_pe into the absorbed query) against
its torch reference, and the reference against the unfused ops it replaces."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specmla.config import RopeConfig
from specmla.model.rope import rope_cos_sin_cache
from specmla.ops.decode_prologue import mla_decode_prologue, mla_decode_prologue_torch
from specmla.ops.kv_cache import row_spec, write_kv_cache
from specmla.ops.norm import rms_norm_torch
from specmla.ops.rope import apply_rope

PAGES, PAGE = 4, 16
EPS = 1e-6
# an ulp or two: the norm's sum may reduce in another order (and the GPU contracts the rope into FMAs)
TOL = {torch.float32: dict(rtol=2e-6, atol=1e-6), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
SMALL, REAL = (3, 24, 96, 32), (16, 128, 512, 64)  # (H, Dn, Dc, Dr)


def _case(T, H, dn, dc, dr, dtype, pos_dtype=torch.int64, device="cpu", seed=0):
    """Inputs as the model has them: q and latent strided slices of one fused projection output y (q's heads padded
    too), rows of random data, a YaRN cos/sin table, and q_out's first Dc columns NaN (written later elsewhere)."""
    g = torch.Generator().manual_seed(seed)
    qw = H * (dn + dr + 8)
    y = (torch.randn(T, qw + dc + dr + 24, generator=g) * 2).to(dtype).to(device)
    q = y[:, :qw].view(T, H, dn + dr + 8)[..., : dn + dr]
    latent = y[:, qw: qw + dc + dr]
    w = (1 + 0.2 * torch.randn(dc, generator=g)).to(dtype).to(device)
    cs = rope_cos_sin_cache(RopeConfig(type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=0.707,
                                       mscale_all_dim=0.707), dr, 300).to(device)
    pos = torch.randint(0, 300, (T,), generator=g).to(pos_dtype).to(device)
    slots = torch.randperm(PAGES * PAGE, generator=g)[:T].to(device)
    q_out = torch.full((T, H, dc + dr), float("nan"), dtype=dtype, device=device)
    return y, q, latent, w, cs, pos, slots, q_out


def _run(backend, y, q, latent, w, cs, pos, cache, slots, q_out, fmt, interleave):
    """Call on copies (the same views into a fresh y); returns (y, cache, q_out, latent view) after the call."""
    y2 = y.clone()
    q2 = y2.as_strided(q.shape, q.stride(), q.storage_offset())
    lat2 = y2.as_strided(latent.shape, latent.stride(), latent.storage_offset())
    cache2 = None if cache is None else cache.clone()
    q_out2 = q_out.clone()
    mla_decode_prologue(q2, lat2, w, EPS, pos, cs, cache2, slots, q_out2, kv_format=fmt, interleave=interleave,
                        backend=backend)
    return y2, cache2, q_out2, lat2


def _close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype], equal_nan=True)


@pytest.mark.parametrize("shape", [SMALL, REAL], ids=["small", "real"])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_native_cache_matches_reference(shape, T, dtype, interleave, pos_dtype):
    H, dn, dc, dr = shape
    y, q, latent, w, cs, pos, slots, q_out = _case(T, H, dn, dc, dr, dtype, pos_dtype, seed=T + H)
    if T > 1:
        slots[1] = -1  # skipped
    cache = torch.full((PAGES, PAGE, dc + dr), float("nan"), dtype=dtype)
    y_ref, c_ref, qo_ref, _ = _run("torch", y, q, latent, w, cs, pos, cache, slots, q_out, "auto", interleave)
    y_tri, c_tri, qo_tri, _ = _run("triton", y, q, latent, w, cs, pos, cache, slots, q_out, "bf16", interleave)
    assert torch.equal(y_ref, y) and torch.equal(y_tri, y)  # q and latent untouched (native caches)
    written = torch.zeros(PAGES * PAGE, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat_ref, flat_tri = c_ref.view(-1, dc + dr), c_tri.view(-1, dc + dr)
    assert not flat_ref[written].isnan().any() and flat_tri[~written].isnan().all()  # other rows stay NaN
    _close(flat_tri[written], flat_ref[written], dtype)
    assert qo_tri[..., :dc].isnan().all()  # the absorbed part is left to its own kernel
    assert not qo_ref[..., dc:].isnan().any()
    _close(qo_tri[..., dc:], qo_ref[..., dc:], dtype)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_native_cache_of_another_dtype_takes_cast_rows(cache_dtype):
    """An fp32 model over a 16-bit cache (as `write_kv_cache` allows): rows computed in fp32, cast on the store."""
    H, dn, dc, dr = SMALL
    y, q, latent, w, cs, pos, slots, q_out = _case(4, H, dn, dc, dr, torch.float32, seed=11)
    cache = torch.full((PAGES, PAGE, dc + dr), float("nan"), dtype=cache_dtype)
    _, c_ref, _, _ = _run("torch", y, q, latent, w, cs, pos, cache, slots, q_out, "auto", True)
    _, c_tri, _, _ = _run("triton", y, q, latent, w, cs, pos, cache, slots, q_out, "auto", True)
    flat_ref, flat_tri = c_ref.view(-1, dc + dr)[slots], c_tri.view(-1, dc + dr)[slots]
    # the reference row is the fp32 composition cast once
    c_kv = rms_norm_torch(latent[:, :dc], w, EPS)[0]
    k_pe = apply_rope(latent[:, dc:], pos, cs, True)
    assert torch.equal(flat_ref, torch.cat([c_kv, k_pe], -1).to(cache_dtype))
    torch.testing.assert_close(flat_tri.float(), flat_ref.float(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_ds_mla", "tbq4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleave", [True, False])
def test_quantised_cache_through_the_latent(fmt, dtype, interleave):
    """fp8 / tbq4: the kernel writes the normed c_kv and roped k_pe into the latent, `write_kv_cache` quantises
    them; the bytes equal the reference path's wherever the latents agree exactly (all of them in fp16)."""
    H, dn, dc, dr, T = 5, 32, 256, 64, 5
    y, q, latent, w, cs, pos, slots, q_out = _case(T, H, dn, dc, dr, dtype, seed=len(fmt))
    width, _ = row_spec(fmt, dc, dr, dtype)
    cache = torch.full((PAGES, PAGE, width), 0xAB, dtype=torch.uint8)
    y_ref, c_ref, qo_ref, lat_ref = _run("torch", y, q, latent, w, cs, pos, cache, slots, q_out, fmt, interleave)
    y_tri, c_tri, qo_tri, lat_tri = _run("triton", y, q, latent, w, cs, pos, cache, slots, q_out, fmt, interleave)
    _close(lat_tri, lat_ref, dtype)
    off = latent.storage_offset()  # y's columns before the latent hold q: untouched, as those after it
    assert torch.equal(y_tri[:, :off], y[:, :off]) and torch.equal(y_tri[:, off + dc + dr:], y[:, off + dc + dr:])
    _close(qo_tri[..., dc:], qo_ref[..., dc:], dtype)
    assert qo_tri[..., :dc].isnan().all()
    unwritten = torch.ones(PAGES * PAGE, dtype=torch.bool)
    unwritten[slots] = False
    assert (c_tri.view(-1, width)[unwritten] == 0xAB).all()
    same = (lat_tri == lat_ref).all(-1)  # tokens whose latent rows agree bit for bit
    if dtype == torch.float16:
        assert same.all()
    assert torch.equal(c_tri.view(-1, width)[slots[same]], c_ref.view(-1, width)[slots[same]])
    encoded = cache.clone()  # and every row is the encoding of the kernel's own latent
    write_kv_cache(encoded, lat_tri[:, :dc], lat_tri[:, dc:], slots, fmt)
    assert torch.equal(c_tri, encoded)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_no_cache_writes_the_latent_in_place(dtype):
    H, dn, dc, dr = SMALL
    y, q, latent, w, cs, pos, slots, q_out = _case(5, H, dn, dc, dr, dtype, seed=7)
    y_ref, _, qo_ref, lat_ref = _run("torch", y, q, latent, w, cs, pos, None, None, q_out, "auto", True)
    y_tri, _, qo_tri, lat_tri = _run("triton", y, q, latent, w, cs, pos, None, None, q_out, "auto", True)
    _close(lat_tri, lat_ref, dtype)
    _close(qo_tri, qo_ref, dtype)
    off = latent.storage_offset()
    outside = torch.ones_like(y, dtype=torch.bool)
    outside[:, off: off + dc + dr] = False
    assert torch.equal(y_tri[outside], y[outside]) and torch.equal(y_ref[outside], y[outside])
    assert not torch.equal(lat_tri, latent)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_zero_tokens(backend):
    H, dn, dc, dr = SMALL
    y, q, latent, w, cs, pos, slots, q_out = _case(0, H, dn, dc, dr, torch.float32)
    cache = torch.full((PAGES, PAGE, dc + dr), float("nan"))
    mla_decode_prologue(q, latent, w, EPS, pos, cs, cache, slots, q_out, kv_format="fp32", backend=backend)
    assert cache.isnan().all()


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "tbq4"])
def test_reference_is_the_unfused_composition(fmt):
    """kv_a_layernorm, the ropes, write_kv_cache and torch.cat([q_nope · W_UK, q_pe]), as the model ran them."""
    H, dn, dc, dr, T = 4, 32, 256, 64, 5
    dtype = torch.bfloat16
    y, q, latent, w, cs, pos, slots, q_out = _case(T, H, dn, dc, dr, dtype, seed=3)
    width, cdtype = row_spec(fmt, dc, dr, dtype)
    cache = torch.zeros(PAGES, PAGE, width, dtype=cdtype)
    want_cache = cache.clone()
    c_kv = rms_norm_torch(latent[:, :dc], w, EPS)[0]
    k_pe = apply_rope(latent[:, dc:], pos, cs)
    q_pe = apply_rope(q[..., dn:], pos, cs)
    write_kv_cache(want_cache, c_kv, k_pe, slots, fmt)
    q_lat = torch.randn(T, H, dc).to(dtype)
    want_q = torch.cat([q_lat, q_pe], dim=-1)
    q_out[..., :dc] = q_lat
    for fn in (mla_decode_prologue_torch, mla_decode_prologue):  # the latter's "auto": the reference on CPU
        got_cache, got_q = cache.clone(), q_out.clone()
        fn(q, latent.clone(), w, EPS, pos, cs, got_cache, slots, got_q, kv_format=fmt)
        assert torch.equal(got_cache, want_cache) and torch.equal(got_q, want_q)


def test_bad_inputs_raise():
    H, dn, dc, dr = SMALL
    T = 3
    y, q, latent, w, cs, pos, slots, q_out = _case(T, H, dn, dc, dr, torch.float32)
    cache = torch.zeros(PAGES, PAGE, dc + dr)
    args = dict(q=q, latent=latent, kv_norm_weight=w, eps=EPS, positions=pos, cos_sin=cs, kv_cache=cache,
                slot_mapping=slots, q_out=q_out)
    bad = [
        dict(latent=latent[:, :-1]),  # Dc + Dr does not fit the weight and cos_sin
        dict(q_out=q_out[..., 1:]),
        dict(positions=pos[:2]),
        dict(q=torch.randn(T, H, 2 * (dn + dr))[..., ::2]),  # non-unit last stride
        dict(latent=torch.randn(T, 2 * (dc + dr))[:, ::2]),
        dict(cos_sin=torch.randn(300, 24), latent=torch.randn(T, dc + 24), q_out=torch.randn(T, H, dc + 24),
             kv_cache=None),  # Dr not a power of two
        dict(kv_cache=torch.zeros(PAGES, PAGE, dc + dr + 1)),  # width
        dict(kv_cache=torch.zeros(PAGES, PAGE, dc + dr, dtype=torch.int16)),  # not a float dtype
        dict(kv_cache=torch.zeros(PAGES, dc + dr, PAGE).transpose(1, 2)),  # not contiguous
        dict(q_out=q_out.half()),
        dict(positions=pos.float()),
        dict(slot_mapping=None),
    ]
    for backend in ("torch", "triton"):
        for change in bad:
            with pytest.raises(ValueError):
                mla_decode_prologue(**{**args, **change}, backend=backend)
        with pytest.raises(ValueError):  # a native cache passed as fp8 rows
            mla_decode_prologue(**args, kv_format="fp8", backend=backend)


OFFLINE = r"""
import json, sys, torch
import specmla.ops.decode_prologue as dp
from scripts.offline_sm90 import offline_sm90, resource_usage
rows = []
for H, native in json.loads(sys.argv[1]):
    T, dn, dc, dr = 4, 128, 512, 64
    y = torch.randn(T, H * (dn + dr) + dc + dr, dtype=torch.bfloat16)
    q, lat = y[:, : H * (dn + dr)].view(T, H, dn + dr), y[:, H * (dn + dr):]
    cache = torch.zeros(8, 64, dc + dr, dtype=torch.bfloat16) if native else None
    with offline_sm90() as ks:
        dp.mla_decode_prologue(q, lat, torch.ones(dc, dtype=torch.bfloat16), 1e-6, torch.zeros(T, dtype=torch.int64),
                               torch.randn(64, dr), cache, torch.zeros(T, dtype=torch.int64),
                               torch.empty(T, H, dc + dr, dtype=torch.bfloat16), backend="triton")
    ptx = ks[0].asm["ptx"]
    pdl = "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    rows.append(dict(resource_usage(ks[0]), pdl=pdl))
print(json.dumps(rows))
"""


def test_compiles_for_hopper_with_pdl_and_no_spills():
    """sm_90 builds (a fresh process: the suite's interpreter cannot compile) at the real shapes, PDL on."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    cases = [[16, True], [128, True], [128, False]]
    proc = subprocess.run([sys.executable, "-c", OFFLINE, json.dumps(cases)], capture_output=True, text=True, env=env,
                          timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in json.loads(proc.stdout.strip().splitlines()[-1]):
        assert row["pdl"] and row["local"] == 0 and row["stack"] == 0 and 0 < row["regs"] <= 128, row


@pytest.mark.gpu
@pytest.mark.parametrize("H,T", [(16, 1), (16, 64), (128, 1), (128, 64)])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "tbq4"])
def test_gpu_bf16_matches_reference(H, T, fmt):
    """On CUDA (PDL on Hopper): bf16 at the model's shapes, native and quantised caches."""
    dn, dc, dr, dtype = 128, 512, 64, torch.bfloat16
    y, q, latent, w, cs, pos, slots, q_out = _case(T, H, dn, dc, dr, dtype, device="cuda", seed=H + T)
    pages = (T + PAGE - 1) // PAGE + PAGES
    slots = torch.randperm(pages * PAGE, device="cuda")[:T]
    if fmt == "bf16" and T > 1:
        slots[T // 2] = -1
    width, cdtype = row_spec(fmt, dc, dr, dtype)
    cache = torch.full((pages, PAGE, width), float("nan") if fmt == "bf16" else 0xAB, dtype=cdtype, device="cuda")
    y_ref, c_ref, qo_ref, lat_ref = _run("torch", y, q, latent, w, cs, pos, cache, slots, q_out, fmt, True)
    y_tri, c_tri, qo_tri, lat_tri = _run("auto", y, q, latent, w, cs, pos, cache, slots, q_out, fmt, True)
    torch.cuda.synchronize()
    assert qo_tri[..., :dc].isnan().all()
    _close(qo_tri[..., dc:], qo_ref[..., dc:], dtype)
    if fmt == "bf16":
        assert torch.equal(y_tri, y)
        flat_tri, flat_ref = c_tri.view(-1, width), c_ref.view(-1, width)
        written = torch.zeros(pages * PAGE, dtype=torch.bool, device="cuda")
        written[slots[slots >= 0]] = True
        assert flat_tri[~written].isnan().all() and not flat_tri[written].isnan().any()
        _close(flat_tri[written], flat_ref[written], dtype)
    else:
        _close(lat_tri, lat_ref, dtype)
        encoded = cache.clone()
        write_kv_cache(encoded, lat_tri[:, :dc], lat_tri[:, dc:], slots, fmt)
        assert torch.equal(c_tri, encoded)
