"""The e4m3-matmul fp8 decode kernel (`ops.mla_decode_gluon_fp8mma`): its pieces one by one (the byte transpose
into Vᵀ, Q·Kᵀ on raw codes, P·V on Vᵀ with Pᵀ stored transposed) and the whole kernel against the fp64
reference on ragged lengths, with NaN bytes past each request's end. GPU (Hopper) only; a CPU test compiles it."""

import pytest
import torch
from helpers.offline_compile import offline_sm90_rows

from specmla.ops.decode.hopper import common as G
from specmla.ops.decode.hopper import fp8mma as M
from specmla.ops.decode.hopper import fp8 as R

hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
                                 and G.HAVE_GLUON), reason="needs a Hopper GPU and Gluon")

if G.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

    _Q8 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
    _R32 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
    _V8 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2))
    _V32 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=32, rank=2))

    @gluon.jit
    def _load2d(ptr, R: gl.constexpr, C: gl.constexpr, L: gl.constexpr):
        r = gl.arange(0, R, layout=gl.SliceLayout(1, L))
        c = gl.arange(0, C, layout=gl.SliceLayout(0, L))
        return gl.load(ptr + gl.expand_dims(r, 1) * C + gl.expand_dims(c, 0))

    @gluon.jit
    def _store2d(ptr, x, R: gl.constexpr, C: gl.constexpr, L: gl.constexpr):
        r = gl.arange(0, R, layout=gl.SliceLayout(1, L))
        c = gl.arange(0, C, layout=gl.SliceLayout(0, L))
        gl.store(ptr + gl.expand_dims(r, 1) * C + gl.expand_dims(c, 0), x)

    @gluon.jit
    def _vt_unit_kernel(IN, OUT, N_OK, WIDE: gl.constexpr):
        """IN: [64, 32] words of one chunk's codes → OUT: [128, 16] words of its Vᵀ (keys ≥ N_OK zeroed)."""
        L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
        if WIDE:
            TL: gl.constexpr = M.TRANSPOSE_LAYOUT_16
        else:
            TL: gl.constexpr = M.TRANSPOSE_LAYOUT
        raw = gl.allocate_shared_memory(gl.float8e4nv, [64, 128], _Q8)
        G._reinterpret(raw, gl.int32, [64, 32], _R32).store(_load2d(IN, 64, 32, L))
        vt32 = gl.allocate_shared_memory(gl.int32, [128, 16], _V32)
        G._cta_barrier()
        ok = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, TL)) < N_OK, 1)
        M._codes_to_vt(raw, vt32, ok, 64, TL, WIDE)
        G._cta_barrier()
        _store2d(OUT, vt32.load(L), 128, 16, L)

    @gluon.jit
    def _qk_unit_kernel(K, Q, OUT):
        """K: [64, 128] e4m3 codes (as int32 words), Q: [16, 128] e4m3 (words) → OUT [64, 16] = K·Qᵀ in fp32."""
        L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 32])
        k = gl.allocate_shared_memory(gl.float8e4nv, [64, 128], _Q8)
        q = gl.allocate_shared_memory(gl.float8e4nv, [16, 128], _Q8)
        G._reinterpret(k, gl.int32, [64, 32], _R32).store(_load2d(K, 64, 32, L))
        G._reinterpret(q, gl.int32, [16, 32], _R32).store(_load2d(Q, 16, 32, L))
        fence_async_shared()
        G._cta_barrier()
        acc = warpgroup_mma(k, q.permute((1, 0)), gl.zeros([64, 16], gl.float32, layout=ACC), use_acc=False)
        _store2d(OUT, gl.convert_layout(acc, L), 64, 16, L)

    @gluon.jit
    def _pv_unit_kernel(VT, P, OUT):
        """VT: [128, 64] e4m3 (words [128, 16]), P: [64, 16] fp32 → e4m3 Pᵀ stored transposed → OUT [128, 16] = VT·P."""
        L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 32])
        vt32 = gl.allocate_shared_memory(gl.int32, [128, 16], _V32)
        vt = G._reinterpret(vt32, gl.float8e4nv, [128, 64], _V8)
        vt32.store(_load2d(VT, 128, 16, L))
        p8 = gl.allocate_shared_memory(gl.float8e4nv, [16, 64], _V8)
        p = gl.convert_layout(_load2d(P, 64, 16, L), ACC)
        p8.permute((1, 0)).store(p.to(gl.float8e4nv))
        fence_async_shared()
        G._cta_barrier()
        acc = warpgroup_mma(vt, p8.permute((1, 0)), gl.zeros([128, 16], gl.float32, layout=ACC), use_acc=False)
        _store2d(OUT, gl.convert_layout(acc, L), 128, 16, L)


if G.HAVE_GLUON:

    @gluon.jit
    def _q_split_unit_kernel(Q, HI, LO, QS, K, OUT, stride_qb, stride_qs, stride_qh):
        """q [1, 1, 16, 576] → its hi / lo e4m3 tiles [4 chunks, 16, 128] and scales [4, 16] as the kernel stores them, and
        OUT [64, 16]: raw codes K [64, 128] (chunk 1's columns) times (hi + lo)ᵀ of chunk 1, as the consumer runs it."""
        L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
        L8: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        FL: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 32])
        q_hi = gl.allocate_shared_memory(gl.float8e4nv, [4, 16, 128], _Q8)
        q_lo = gl.allocate_shared_memory(gl.float8e4nv, [4, 16, 128], _Q8)
        q_r = gl.allocate_shared_memory(gl.bfloat16, [16, 64],
                                        gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
        qs = gl.allocate_shared_memory(gl.float32, [4, 16], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        M._load_q(Q, q_hi, q_lo, q_r, qs, 0, 0, 16, stride_qb, stride_qs, stride_qh, 16, 1, 16, 512, 64)
        k = gl.allocate_shared_memory(gl.float8e4nv, [64, 128], _Q8)
        G._reinterpret(k, gl.int32, [64, 32], _R32).store(_load2d(K, 64, 32, L))
        fence_async_shared()
        G._cta_barrier()
        for c in gl.static_range(4):
            _store2d(HI + c * 16 * 128, q_hi.index(c).load(L8), 16, 128, L8)
            _store2d(LO + c * 16 * 128, q_lo.index(c).load(L8), 16, 128, L8)
        for c in gl.static_range(4):
            r = gl.arange(0, 16, layout=FL)
            gl.store(QS + c * 16 + r, qs.index(c).load(FL))
        zero = gl.zeros([64, 16], gl.float32, layout=ACC)
        a = warpgroup_mma(k, q_hi.index(1).permute((1, 0)), zero, use_acc=False)
        b = warpgroup_mma(k, q_lo.index(1).permute((1, 0)), zero, use_acc=False)
        _store2d(OUT, gl.convert_layout(a + b, L), 64, 16, L)


def _codes(*shape, seed=0):
    """Random finite e4m3 codes as bytes (NaN patterns 0x7f / 0xff avoided)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
    x = torch.where((x & 0x7F) == 0x7F, x - 1, x)
    return x.to(torch.uint8).cuda()


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("n_ok", [64, 37])
@pytest.mark.parametrize("wide", [False, True])
def test_codes_to_vt_is_a_byte_transpose(n_ok, wide):
    codes = _codes(64, 128)
    out = torch.zeros(128, 16, dtype=torch.int32, device="cuda")
    _vt_unit_kernel[(1,)](codes.view(torch.int32), out, n_ok, WIDE=wide, num_warps=4)
    want = codes.clone()
    want[n_ok:] = 0
    assert torch.equal(out.view(torch.uint8).view(128, 64), want.t().contiguous())


@pytest.mark.gpu
@hopper
def test_qk_on_raw_codes():
    k, q = _codes(64, 128, seed=1), _codes(16, 128, seed=2)
    out = torch.zeros(64, 16, device="cuda")
    _qk_unit_kernel[(1,)](k.view(torch.int32), q.view(torch.int32), out, num_warps=4)
    kf = k.view(torch.float8_e4m3fn).double()
    qf = q.view(torch.float8_e4m3fn).double()
    ref = kf @ qf.t()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-3  # fp8 wgmmas accumulate in about 22 bits


@pytest.mark.gpu
@hopper
def test_pv_on_transposed_v():
    vt = _codes(128, 64, seed=3)
    p = torch.rand(64, 16, device="cuda") * 3
    out = torch.zeros(128, 16, device="cuda")
    _pv_unit_kernel[(1,)](vt.view(torch.int32), p, out, num_warps=4)
    ref = vt.view(torch.float8_e4m3fn).double() @ p.to(torch.float8_e4m3fn).double()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-3


@pytest.mark.gpu
@hopper
def test_q_split_in_two_e4m3_terms():
    """q ≈ (hi + lo)·sq per 128-column chunk, hi and lo as torch rounds them, and the two score matmuls on a
    chunk of the [16, 512] tiles give K·q within fp8 accumulation error."""
    torch.manual_seed(0)
    q = torch.randn(1, 1, 16, 576, device="cuda", dtype=torch.bfloat16)
    hi = torch.empty(4, 16, 128, dtype=torch.float8_e4m3fn, device="cuda")
    lo = torch.empty_like(hi)
    qs = torch.empty(4, 16, device="cuda")
    k = _codes(64, 128, seed=4)
    out = torch.zeros(64, 16, device="cuda")
    _q_split_unit_kernel[(1,)](q, hi, lo, qs, k.view(torch.int32), out, q.stride(0), q.stride(1), q.stride(2),
                               num_warps=4)
    x = q[0, 0, :, :512].float().view(16, 4, 128)
    sq = x.abs().amax(-1) / 448
    assert torch.allclose(qs.t(), sq, rtol=1e-6)
    y = x / sq.unsqueeze(-1)
    want_hi = y.clamp(-448, 448).to(torch.float8_e4m3fn)
    want_lo = (y - want_hi.float()).to(torch.float8_e4m3fn)
    got_hi, got_lo = hi.transpose(0, 1).float(), lo.transpose(0, 1).float()  # [16, 4, 128]

    def step(v):  # one e4m3 step at v
        return torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(2 ** -6))) - 3)

    # the kernel scales by 448 / amax (Triton's fp32 division is approximate) where torch divides by amax / 448, so a
    # value at a rounding midpoint may round one e4m3 step the other way (seen on the H100: hi rarely, lo more
    # often: 10·2⁻⁹ for 11·2⁻⁹); lo absorbs hi's step, so hi + lo stays y to lo's precision
    want = want_hi.float()
    diff = (got_hi - want).abs()
    assert (diff <= step(want)).all() and (diff > 0).float().mean().item() < 0.01
    assert ((got_hi + got_lo - y).abs() <= step(y) / 8 + 2 ** -9).all()
    want = want_lo.float()
    diff = (got_lo - want).abs()
    assert (diff > 0).float().mean().item() < 0.03
    ref = k.view(torch.float8_e4m3fn).double() @ (want_hi[:, 1].double() + want_lo[:, 1].double()).t()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-3


def _problem(lens, S, H=16, seed=0, kv_format="fp8_ds_mla"):
    from specmla.ops.kv_cache import row_spec, write_kv_cache

    torch.manual_seed(seed)
    B = len(lens)
    pages = max(-(-n // 64) for n in lens) + 1
    num_pages = B * pages + 3
    latent = torch.randn(num_pages * 64, 576, device="cuda", dtype=torch.bfloat16)
    cache = torch.empty(num_pages, 64, row_spec(kv_format, 512, 64, torch.bfloat16)[0], dtype=torch.uint8,
                        device="cuda")
    write_kv_cache(cache, latent[:, :512], latent[:, 512:], torch.arange(num_pages * 64, device="cuda"), kv_format)
    table = torch.randperm(num_pages, device="cuda", dtype=torch.int32)[: B * pages].view(B, pages)
    for i, n in enumerate(lens):  # rows past a request's end: 0xFF bytes (NaN fp8 codes and scales, NaN tbq4
        # norms and rope), which must not leak
        cache[int(table[i, (n - 1) // 64]), (n - 1) % 64 + 1:] = 255
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(B, S, H, 576, device="cuda", dtype=torch.bfloat16)
    return q, cache, table, seq


def assert_tokens_match(got, ref, lens, S, max_err, min_cos):
    """S query tokens per request (`_problem`'s lengths) against the reference: finite, relative error under
    max_err, every row that sees a key with cosine over min_cos; a token before the request's first key (length < S)
    sees none, and its row is the reference's zeros."""
    got = got.double()
    assert torch.isfinite(got).all()
    assert ((got - ref).norm() / ref.norm()).item() < max_err
    empty = ref.flatten(2).norm(dim=-1) == 0
    assert empty.any() == (min(lens) < S) and (got.flatten(2)[empty].abs() <= 1e-6).all()
    cos = torch.nn.functional.cosine_similarity(got.flatten(2), ref.flatten(2), dim=-1)
    assert cos[~empty].min().item() > min_cos


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("lens,S,splits", [([1, 63, 64, 65, 300, 1000], 1, None), ([4097, 77, 128], 1, 1),
                                           ([4097, 77, 128], 1, 3), ([2000, 129], 2, None), ([2560, 3], 2, 1)])
def test_fp8mma_kernel_matches_the_reference(lens, S, splits, monkeypatch):
    from specmla.ops.decode import mla_decode_torch
    from specmla.ops.decode.triton import mla_decode_triton

    q, cache, table, seq = _problem(lens, S)
    scale = 576 ** -0.5
    ref = mla_decode_torch(q.double(), cache, table, seq, scale, head_dim_v=512, kv_format="fp8_ds_mla")
    monkeypatch.setattr(M, "USE", True)
    monkeypatch.setattr(R, "USE", False)  # the register-Vᵀ kernel would take these calls first
    launches = []
    launch = M.launch_fp8mma_split
    monkeypatch.setattr(M, "launch_fp8mma_split", lambda *a, **kw: launches.append(1) or launch(*a, **kw))
    got = mla_decode_triton(q, cache, table, seq, scale, head_dim_v=512, kv_format="fp8_ds_mla", gluon=True,
                            num_splits=splits).double()
    assert launches == [1]  # this kernel ran, not the unpacking one
    assert torch.isfinite(got).all()
    assert ((got - ref).norm() / ref.norm()).item() < 4e-2  # P in e4m3: about 2.5 %; the bar is the cosine
    cos = torch.nn.functional.cosine_similarity(got.flatten(2), ref.flatten(2), dim=-1)
    assert cos.min().item() > 0.999


def test_fp8mma_kernel_compiles_for_sm90():
    """CPU: the kernel compiles for sm_90."""
    cases = [[16, 1, 512, 64, "fp8mma", False], [16, 1, 512, 64, "fp8mma", True], [16, 2, 512, 64, "fp8mma", False]]
    for row in offline_sm90_rows(cases):
        (k,) = row["kernels"]
        assert k["shared"] <= 232448 and k["regs"] > 0
