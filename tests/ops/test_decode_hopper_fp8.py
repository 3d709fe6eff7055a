"""The fp8 decode kernel (`ops.decode.hopper.fp8`): the whole kernel against the fp64 reference on 608- and 656-byte
rows, ragged lengths (one key block, an odd block per consumer, many blocks, several splits, several query tokens)
with NaN bytes past each request's end, and the calls it leaves to the other kernels; its e4m3 pieces on their own
(Q·Kᵀ on raw codes, q in two e4m3 terms). GPU (Hopper) only; on the CPU, an sm_90 compile and the check of its row
and key orders against the layouts it is built from."""

import pytest
import torch
from helpers.offline_compile import offline_sm90_rows
from helpers.decode_kernels import assert_tokens_match, hopper, quant_problem, run_kernel

from specmla.ops.decode.hopper import common as G
from specmla.ops.decode.hopper import fp8 as R
from specmla.ops.decode.hopper import quant_common as QC

SCALE = 576 ** -0.5

if G.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

    _Q8 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
    _R32 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))

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
    def _q_split_unit_kernel(Q, HI, LO, QS, K, OUT, stride_qb, stride_qs, stride_qh):
        """q [1, 1, 16, 576] → its hi / lo e4m3 tiles [4 chunks, 16, 128] and scales [4, 16] as `QC._load_q` stores
        them (two terms), and OUT [64, 16]: raw codes K [64, 128] times (hi + lo)ᵀ of chunk 1."""
        L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
        L8: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        FL: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 32])
        q8 = gl.allocate_shared_memory(gl.float8e4nv, [8, 16, 128], _Q8)
        q_r = gl.allocate_shared_memory(gl.bfloat16, [16, 64],
                                        gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
        qs = gl.allocate_shared_memory(gl.float32, [4, 16], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        QC._load_q(Q, q8, q_r, qs, 0, 0, 16, stride_qb, stride_qs, stride_qh, 16, 1, 16, 512, 64, True, 0, 4, True)
        k = gl.allocate_shared_memory(gl.float8e4nv, [64, 128], _Q8)
        G._reinterpret(k, gl.int32, [64, 32], _R32).store(_load2d(K, 64, 32, L))
        fence_async_shared()
        G._cta_barrier()
        for c in gl.static_range(4):
            _store2d(HI + c * 16 * 128, q8.index(2 * c).load(L8), 16, 128, L8)
            _store2d(LO + c * 16 * 128, q8.index(2 * c + 1).load(L8), 16, 128, L8)
        for c in gl.static_range(4):
            r = gl.arange(0, 16, layout=FL)
            gl.store(QS + c * 16 + r, qs.index(c).load(FL))
        zero = gl.zeros([64, 16], gl.float32, layout=ACC)
        a = warpgroup_mma(k, q8.index(2).permute((1, 0)), zero, use_acc=False)
        b = warpgroup_mma(k, q8.index(3).permute((1, 0)), zero, use_acc=False)
        _store2d(OUT, gl.convert_layout(a + b, L), 64, 16, L)


def _codes(*shape, seed=0):
    """Random finite e4m3 codes as bytes (NaN patterns 0x7f / 0xff avoided)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
    x = torch.where((x & 0x7F) == 0x7F, x - 1, x)
    return x.to(torch.uint8).cuda()


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
def test_q_split_in_two_e4m3_terms():
    """q ≈ (hi + lo)·sq with one scale per row, hi and lo as torch rounds them, and the two score matmuls on a chunk
    of the tiles give K·q within fp8 accumulation error. (hi is rounded by the hardware's conversion, so that
    lo = y − hi is taken against the stored hi.)"""
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
    sq = x.abs().amax((1, 2)) / 448  # one scale per row
    assert torch.allclose(qs.t(), sq[:, None].expand(16, 4), rtol=1e-6)
    y = x / sq[:, None, None]
    want_hi = y.clamp(-448, 448).to(torch.float8_e4m3fn)
    want_lo = (y - want_hi.float()).to(torch.float8_e4m3fn)
    got_hi, got_lo = hi.transpose(0, 1).float(), lo.transpose(0, 1).float()  # [16, 4, 128]

    def step(v):  # one e4m3 step at v
        return torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(2 ** -6))) - 3)

    # the kernel scales by 448 / amax (Triton's fp32 division is approximate) where torch divides by amax / 448, so a
    # value at a rounding midpoint may round one e4m3 step the other way; lo absorbs hi's step, so hi + lo stays y
    # to lo's precision
    want = want_hi.float()
    diff = (got_hi - want).abs()
    assert (diff <= step(want)).all() and (diff > 0).float().mean().item() < 0.01
    assert ((got_hi + got_lo - y).abs() <= step(y) / 8 + 2 ** -9).all()
    want = want_lo.float()
    diff = (got_lo - want).abs()
    assert (diff > 0).float().mean().item() < 0.03
    ref = k.view(torch.float8_e4m3fn).double() @ (want_hi[:, 1].double() + want_lo[:, 1].double()).t()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-3


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("lens,splits", [([1, 63, 64, 65, 300, 1000], None), ([4097, 77, 128], 1),
                                         ([4097, 77, 128], 3), ([130, 2], 1), ([8192, 5000], 2)])
@pytest.mark.parametrize("kv_format", ["fp8_ds_mla", "fp8"])
def test_fp8_kernel_matches_the_reference(lens, splits, kv_format):
    """fp8 rows (608 bytes): the same kernel, the rope's int8 values converted to bf16 by the producer
    (`_convert_rope`) in the stage's rope tile and the copies issued by the loader warp. P in fp16: about 0.2 %."""
    from specmla.ops.decode import mla_decode_torch

    q, cache, table, seq = quant_problem(lens, 1, kv_format=kv_format)
    ref = mla_decode_torch(q.double(), cache, table, seq, SCALE, head_dim_v=512, kv_format=kv_format)
    got = run_kernel(R, q, cache, table, seq, kv_format=kv_format, num_splits=splits).double()
    assert torch.isfinite(got).all()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2
    cos = torch.nn.functional.cosine_similarity(got.flatten(2), ref.flatten(2), dim=-1)
    assert cos.min().item() > 0.999


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("kv_format", ["fp8", "fp8_ds_mla"])
@pytest.mark.parametrize("lens,S,splits", [([700, 90, 3], 2, None), ([4097, 77], 3, 2), ([1, 64, 300], 4, None)])
def test_fp8_kernel_takes_several_query_tokens_one_per_program(lens, S, splits, kv_format):
    """S > 1 query tokens (H = 16), 608- and 656-byte rows: one token's 16 rows per program (no folding), each with
    its own causal limit; against the fp64 reference with NaN bytes past each request's end."""
    from specmla.ops.decode import mla_decode_torch

    q, cache, table, seq = quant_problem(lens, S, kv_format=kv_format)
    ref = mla_decode_torch(q.double(), cache, table, seq, SCALE, head_dim_v=512, kv_format=kv_format)
    got = run_kernel(R, q, cache, table, seq, kv_format=kv_format, num_splits=splits)
    assert_tokens_match(got, ref, lens, S, max_err=1e-2, min_cos=0.999)


@pytest.mark.gpu
@hopper
def test_fp8_kernel_leaves_32_row_calls_to_the_other_kernels():
    """32 heads make 32 rows: not this kernel's; the default route still matches the reference."""
    from specmla.ops.decode import mla_decode, mla_decode_torch, route

    q, cache, table, seq = quant_problem([700, 90], 1, H=32)
    assert not R.supported(q, cache, "fp8_ds_mla", 32)
    assert R.supported(q[:, :, :16].contiguous(), cache, "fp8_ds_mla", 16)
    assert route(q, cache, table, kv_format="fp8_ds_mla", backend="hopper").kernel == "dequant"
    got = mla_decode(q, cache, table, seq, SCALE, head_dim_v=512, kv_format="fp8_ds_mla", backend="hopper")
    ref = mla_decode_torch(q.double(), cache, table, seq, SCALE, head_dim_v=512, kv_format="fp8_ds_mla")
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2


def _bits(x: int, n: int) -> list[int]:
    return [(x >> i) & 1 for i in range(n)]


def _position(bases_by_level, index):
    """(register, lane, warp) → the (m, k) element a linear layout gives it (XOR of the set bits' bases)."""
    m = k = 0
    for bases, x in zip(bases_by_level, index):
        for bit, (bm, bk) in zip(_bits(x, len(bases)), bases):
            if bit:
                m ^= bm
                k ^= bk
    return m, k


# the e4m3 Vᵀ fragment [128, 64] (Triton's DotOperand layout, k_width 4, for an m64nNk32 wgmma, 4 warps): the
# (m, k) bases of its registers, lanes and warps
E4M3_FRAGMENT = ([(0, 1), (0, 2), (8, 0), (0, 16), (0, 32), (64, 0)], [(0, 4), (0, 8), (1, 0), (2, 0), (4, 0)],
                 [(16, 0), (32, 0)])


def _key_of_k(k):
    """The stage key of the e4m3 fragment's key index k (Pᵀ's order, `_store_pt`): k0 e0, k1 e3, k2 e1, k3 e2,
    k4 e4, k5 e5."""
    e = [0] * 6
    for kb, eb in zip(range(6), (0, 3, 1, 2, 4, 5)):
        e[eb] = (k >> kb) & 1
    return sum(b << i for i, b in enumerate(e))


@pytest.mark.skipif(not G.HAVE_GLUON, reason="needs Gluon")
def test_row_and_key_orders_follow_the_layouts():
    """The load layout, the 4 × 4 byte transpose and the index permutation give every tile element (m, k) the code of
    key `_key_of_k(k)` (Pᵀ's order) and column `column_of_m(m)` (`_latent_column`'s FMT_E4M3, the output's order),
    in the thread and byte position where the wgmma fragment expects it: checked thread by thread on the layouts'
    bases, in plain Python."""
    load = QC.V_LOAD.value
    loaded_at = (load.reg_bases, load.lane_bases, load.warp_bases)  # (register, lane, warp) → (key, column)

    # the transpose: register r = (byte b = r0 r1, word w = r2 r3, rest) receives the input at (byte w, word b)
    def after_transpose(reg):
        b, w, rest = reg & 3, (reg >> 2) & 3, reg >> 4
        return (rest << 4) | (b << 2) | w

    def column_of_m(m):  # `_latent_column`'s FMT_E4M3 within a chunk
        return ((m >> 3) & 1) | (((m >> 6) & 1) << 1) | ((m & 7) << 2) | (((m >> 4) & 3) << 5)

    def label(key, col):  # the (m, k) index `_vt_fragment`'s reshape + permute gives a loaded (key, col) label
        m = (((col >> 2) & 7) | ((key & 1) << 3) | (((col >> 5) & 3) << 4) | (((key >> 3) & 1) << 6))
        k = ((col & 3) | (((key >> 1) & 3) << 2) | (((key >> 4) & 3) << 4))
        return m, k

    frag = {}
    for warp in range(4):
        for lane in range(32):
            for reg in range(64):
                frag[_position(E4M3_FRAGMENT, (reg, lane, warp))] = (reg, lane, warp)
    assert len(frag) == 128 * 64
    for warp in range(4):
        for lane in range(32):
            for reg in range(64):
                m, k = label(*_position(loaded_at, (reg, lane, warp)))
                # what the register holds after the transpose
                key, col = _position(loaded_at, (after_transpose(reg), lane, warp))
                assert (key, col) == (_key_of_k(k), column_of_m(m)), (reg, lane, warp)
                # convert_layout to the fragment moves whole 32-bit registers within the thread, nothing else
                f_reg, f_lane, f_warp = frag[(m, k)]
                assert (f_lane, f_warp, f_reg & 3) == (lane, warp, reg & 3), (reg, lane, warp)


def test_f16_fragment_only_relabels_keys_and_renames_registers():
    """`_f16_fragment`: the e4m3 Vᵀ fragment [128, 64] (k_width 4, m64nNk32) converted element-wise to fp16 and its key
    bits permuted by `F16_KEY_ORDER` lands on the fp16 fragment (k_width 2, m64nNk16) in the same lanes and warps,
    each converted pair of codes in one 32-bit register; composed with `_vt_fragment`'s key order, the keys come out
    in stage order, so Pᵀ is stored unpermuted (`_store_p16`). Bases from the PTX wgmma fragment layouts."""
    frag16 = ([(0, 1), (8, 0), (0, 8), (0, 16), (0, 32), (64, 0)], [(0, 2), (0, 4), (1, 0), (2, 0), (4, 0)],
              [(16, 0), (32, 0)])
    # the permutation as the kernel applies it: dims (m, k5 … k0) → QC.F16_KEY_ORDER; new key index of each old one
    idx = torch.arange(64).view(1, 2, 2, 2, 2, 2, 2)
    new_of_old = torch.empty(64, dtype=torch.long)
    new_of_old[idx.permute(QC.F16_KEY_ORDER).reshape(64)] = torch.arange(64)
    where16 = {}
    for warp in range(4):
        for lane in range(32):
            for reg in range(64):
                where16[_position(frag16, (reg, lane, warp))] = (reg, lane, warp)
    assert len(where16) == 128 * 64
    pair_to_register = {}
    for warp in range(4):
        for lane in range(32):
            for reg in range(64):
                m, k = _position(E4M3_FRAGMENT, (reg, lane, warp))
                r16, l16, w16 = where16[(m, int(new_of_old[k]))]
                assert (l16, w16) == (lane, warp) and (r16 & 1) == (reg & 1), (reg, lane, warp)
                assert pair_to_register.setdefault((lane, warp, reg >> 1), r16 >> 1) == r16 >> 1
    # `_vt_fragment`'s key order, then the relabelling: the identity
    for k in range(64):
        assert _key_of_k(k) == int(new_of_old[k])


def test_fp8_kernel_compiles_for_sm90():
    """CPU: the kernel compiles for sm_90 on 656-byte rows (split and direct) and 608-byte rows, within an H100's
    shared memory."""
    for row in offline_sm90_rows([[16, 1, 512, 64, "e4m3_fp8_ds_mla", False], [16, 1, 512, 64, "e4m3_fp8_ds_mla", True],
                                  [16, 1, 512, 64, "e4m3_fp8", False]]):
        (k,) = row["kernels"]
        assert k["name"] == "_mla_decode_fp8_kernel" and k["shared"] <= 232448 and k["regs"] > 0
        assert not k["wgmma_serialized"], row


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("kv_format", ["fp8", "fp8_ds_mla"])
@pytest.mark.parametrize("H,S,lens", [(4, 4, [3000, 1, 64, 65, 700]), (8, 2, [1000, 129])])
def test_fp8_kernel_folds_tokens_whose_rows_fit_16(kv_format, H, S, lens):
    """S · H ≤ 16 (the embedded model's 4 heads under MTP): the default route folds the tokens into this kernel's own
    16 rows; against the fp64 reference with NaN bytes past each request's end (measured 2.5–3.0e-3)."""
    from helpers.decode_kernels import poisoned_case
    from helpers.mla_cases import rel_err

    from specmla.ops.decode import mla_decode, route

    q, cache, table, seq, want, _ = poisoned_case(kv_format, H + S, lens, S, H, 64, True)
    q, cache, table, seq = q.bfloat16().cuda(), cache.cuda(), table.cuda(), seq.cuda()
    r = route(q, cache, table, kv_format=kv_format, head_dim_v=512)
    assert r.kernel == "fp8" and r.plan["FOLD"] == S
    got = mla_decode(q, cache, table, seq, 0.0721, kv_format=kv_format, head_dim_v=512).float().cpu()
    assert not got.isnan().any()
    assert rel_err(got, want) < 1e-2
