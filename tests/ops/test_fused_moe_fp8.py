"""The fused MoE on float8_e4m3fn experts with 128 × 128 block scales (w8a8 Triton path of `fused_moe`): against the
torch emulation of the same quantisation (`fused_moe_torch(..., act_quant=True)`, `fused_moe`'s backend "w8a8_torch":
x and the intermediate per token and group of 128 columns, dequantised fp32 products) tightly, and against
`fused_moe_torch` on the fp8 weights (which leaves the activations unquantised) within the activations' e4m3
rounding. CPU: the Triton interpreter at small shapes (H no multiple of 128, shared experts narrower and wider than
I, ids outside [0, E), NaN-poisoned intermediates, bad input); GPU: DeepSeek-V3 expert shapes, the bf16 MoE on the
dequantised weights, CUDA graphs, no host sync.

Tolerances against the unquantised reference: e4m3 keeps 3 mantissa bits, so rounding an activation scaled to
amax = 448 costs about 2.6 % (rms) per element; x and the intermediate are both rounded, and the output of a
random expert layer moves by about 4.5 % of its norm. `ACT_TOL` = 7e-2 bounds that; the emulation, which rounds
the same way, is the tight check."""

import pytest
import torch
import torch.nn.functional as F
from helpers.moe_cases import fro_err, make_moe_case, random_ids, rel_err

import specmla.ops.moe as moe_ops
import specmla.ops.moe.triton as moe_triton
from specmla.ops import fused_moe, fused_moe_torch
from specmla.ops.linear.reference import (act_quant_dequant_torch, act_quant_torch, fp8_block_linear_w8a8_torch,
                                          weight_dequant)
from specmla.ops.linear.triton import act_quant
from specmla.ops.moe.triton import fused_moe_fp8_triton
from specmla.ops.moe.tuning import Config

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
FP8 = torch.float8_e4m3fn
ACT_TOL = 7e-2  # against the reference on unquantised activations (see the module docstring)
# against the w8a8 emulation: the sums' fp32 order differs, so now and then an intermediate within that rounding of
# an e4m3 rounding boundary lands on the other side (one element of a 128-group off by one e4m3 step, ~1e-4 of the
# output); fp16 / bf16 add the per-pair outputs' rounding
EMU_TOL = {F32: 1e-3, F16: 3e-3, BF16: 1.5e-2}


# ---- material -----------------------------------------------------------------------------------------------
def rand_fp8(shape, fan_in, g, device="cpu"):
    """(float8_e4m3fn weight [..., R, C], fp32 scales [..., ⌈R/128⌉, ⌈C/128⌉]) like a DeepSeek checkpoint: e4m3
    values spread over the format's range, block scales varying by 3x, the dequantised weight of std ≈ 1/√fan_in."""
    *lead, R, C = shape
    w = torch.empty(shape, dtype=FP8, device=device)
    for part in w.view(-1, R, C):  # one matrix at a time (V3's experts in fp32 at once would take 30 GB)
        part.copy_((torch.randn(R, C, generator=g, device=device) * 96).clamp(-448, 448))
    s = (torch.rand(*lead, -(-R // 128), -(-C // 128), generator=g, device=device) + 0.5) / (96 * fan_in ** 0.5)
    return w, s


class Fp8Case:
    """One fp8 `fused_moe` call: x, routing (make_moe_case's), fp8 experts with scales, shared experts of width Is."""

    def __init__(self, T, E, k, H, I, Is, dtype, seed=0, device="cpu"):
        base = make_moe_case(T, E, k, 8, 8, None, dtype, seed=seed, device=device)
        g = torch.Generator(device=device).manual_seed(seed + 1)
        self.x = torch.randn(T, H, generator=g, device=device).to(dtype)
        self.topk_weights, self.topk_ids = base.topk_weights, base.topk_ids
        self.w_gate_up, self.w_gate_up_scale = rand_fp8((E, 2 * I, H), H, g, device)
        self.w_down, self.w_down_scale = rand_fp8((E, H, I), I, g, device)
        self.shared = self.shared_scales = None
        if Is:
            (sgu, sgu_s), (sd, sd_s) = rand_fp8((2 * Is, H), H, g, device), rand_fp8((H, Is), Is, g, device)
            self.shared, self.shared_scales = (sgu, sd), (sgu_s, sd_s)

    @property
    def args(self):
        return self.x, self.w_gate_up, self.w_down, self.topk_weights, self.topk_ids

    @property
    def kwargs(self):
        return dict(shared=self.shared, w_gate_up_scale=self.w_gate_up_scale, w_down_scale=self.w_down_scale,
                    shared_scales=self.shared_scales)

    def tensors(self):
        return [*self.args, self.w_gate_up_scale, self.w_down_scale, *(self.shared or ()),
                *(self.shared_scales or ())]


def poisoned_empty(shape, dtype, device):
    if dtype == FP8:
        return torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(FP8)  # e4m3fn NaN
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


# ---- CPU (interpreter) --------------------------------------------------------------------------------------
# T, E, k, H, I, Is, dtype; T = 1 takes the pair-per-block path
CASES = [
    (1, 4, 2, 200, 128, 256, F32),  # two shared pseudo-experts
    (5, 4, 2, 130, 128, 128, F16),
    (33, 4, 2, 200, 128, None, F32),
    (33, 4, 3, 130, 256, 384, F16),  # Is = 1.5 I: the second shared pseudo-expert is 128 wide
    (6, 3, 2, 256, 128, 128, F32),  # H a multiple of 128: K loops without masks
]


@pytest.mark.parametrize("T,E,k,H,I,Is,dtype", CASES, ids=[f"T{c[0]}-H{c[3]}-I{c[4]}-Is{c[5]}-{c[6]}" for c in CASES])
def test_fp8_matches_emulation_and_reference(T, E, k, H, I, Is, dtype):
    case = Fp8Case(T, E, k, H, I, Is, dtype, seed=T + H + I)
    before = [t.clone() for t in case.tensors()]
    got = fused_moe(*case.args, **case.kwargs, backend="triton")
    assert got.dtype == dtype and got.shape == (T, H)
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a, b.view(torch.uint8) if b.dtype == FP8 else b)
               for a, b in zip(case.tensors(), before))
    emu = fused_moe_torch(*case.args, **case.kwargs, act_quant=True)
    ref = fused_moe_torch(*case.args, **case.kwargs)
    assert rel_err(got, emu) <= EMU_TOL[dtype]
    assert rel_err(got, ref) <= ACT_TOL
    assert rel_err(emu, ref) <= ACT_TOL
    assert rel_err(got, ref) > 10 * rel_err(got, emu)  # the activations really are quantised
    # the weights are read in their blocks: a scale off by one block changes the result
    wrong = case.w_gate_up_scale.roll(1, dims=-1)
    bad = fused_moe(case.x, case.w_gate_up, case.w_down, case.topk_weights, case.topk_ids, shared=case.shared,
                    w_gate_up_scale=wrong, w_down_scale=case.w_down_scale, shared_scales=case.shared_scales,
                    backend="triton")
    assert rel_err(bad, emu) > 0.1


def test_w8a8_backend_is_act_quant_composed_per_expert():
    """backend="w8a8_torch" is `fused_moe_torch(..., act_quant=True)`: each expert's MLP composed of the w8a8 linear
    emulation (`fp8_block_linear_w8a8_torch`: x, then silu(gate)·up, through act_quant_torch), weighted and summed,
    the shared experts (two slices of I here) added; it leaves the exact-activation reference by about the e4m3
    rounding of x and h. Other experts than float8 ones are refused."""
    T, E, k, H, I, Is = 9, 4, 2, 200, 128, 256
    case = Fp8Case(T, E, k, H, I, Is, F32, seed=21)
    got = fused_moe(*case.args, **case.kwargs, backend="w8a8_torch")
    assert torch.equal(got, fused_moe_torch(*case.args, **case.kwargs, act_quant=True))

    def mlp(x, w_gate_up, s_gate_up, w_down, s_down):
        gu = fp8_block_linear_w8a8_torch(x, w_gate_up, s_gate_up)
        n = w_down.shape[1]
        return fp8_block_linear_w8a8_torch(F.silu(gu[:, :n]) * gu[:, n:], w_down, s_down)

    want = mlp(case.x, *case.shared[:1], case.shared_scales[0], case.shared[1], case.shared_scales[1])
    for t in range(T):
        for j in range(k):
            e = case.topk_ids[t, j]
            y = mlp(case.x[t:t + 1], case.w_gate_up[e], case.w_gate_up_scale[e], case.w_down[e], case.w_down_scale[e])
            want[t] += case.topk_weights[t, j] * y[0]
    assert rel_err(got, want) <= 1e-5
    assert 1e-2 <= rel_err(got, fused_moe_torch(*case.args, **case.kwargs)) <= ACT_TOL
    assert rel_err(act_quant_dequant_torch(case.x), case.x) >= 1e-2
    bf16 = [w.float().to(BF16) for w in (case.w_gate_up, case.w_down)]
    with pytest.raises(ValueError, match="w8a8_torch"):
        fused_moe(case.x.to(BF16), *bf16, case.topk_weights, case.topk_ids, backend="w8a8_torch")
    with pytest.raises(ValueError, match=r"unknown backend 'w8a8' \(auto \| triton \| torch \| w8a8_torch\)"):
        fused_moe(*case.args, **case.kwargs, backend="w8a8")


def test_act_quant_matches_the_reference_bit_for_bit():
    """The quantisation kernel equals act_quant_torch (values, scales) for a partial last group, a group of zeros,
    and values that round up to the next power of two (the carry into the exponent)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 200, generator=g) * torch.logspace(-3, 3, 7)[:, None]
    x[2, 128:] = 0.0
    x[3, :128] = torch.linspace(-1, 1, 128) * 0.999
    x[3, 0] = -1.0  # amax 1: values 0.999·t / (1/448) straddle e4m3 binades
    for dtype in (F32, F16):
        xx = x.to(dtype)
        q, s = act_quant(xx)
        rq, rs = act_quant_torch(xx)
        assert q.dtype == FP8 and s.shape == (7, 2)
        assert torch.equal(s, rs)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.parametrize("T", [1, 9])
def test_ids_outside_the_local_experts_add_nothing(T):
    E, k, H, I, Is = 4, 3, 130, 128, 128
    case = Fp8Case(T, E, k, H, I, Is, F32, seed=T)
    ids = random_ids(T, 3 * E, k, torch.Generator().manual_seed(T)) - E
    ids[0, 0], ids[0, 1] = -1, 2
    ids[-1, -1] = 2**32 + 1  # its low 32 bits would be a valid id
    valid = (ids >= 0) & (ids < E)
    assert valid.any() and (~valid).any()
    case.topk_ids = ids
    want = fused_moe_torch(case.x, case.w_gate_up, case.w_down, torch.where(valid, case.topk_weights, 0.0),
                           torch.where(valid, ids, 0), **case.kwargs, act_quant=True)
    case.topk_weights = torch.where(valid, case.topk_weights, float("nan"))
    got = fused_moe(*case.args, **case.kwargs, backend="triton")
    assert rel_err(got, want) <= EMU_TOL[F32]


@pytest.mark.parametrize("T,dtype", [(1, F32), (20, F16)])
def test_nan_poisoned_intermediates_experts_and_out_do_not_leak(T, dtype, monkeypatch):
    """The intermediates (quantised x, h, scales, per-pair outputs) start as NaN, the experts no token chose are NaN
    (values and scales), `out` is a NaN-filled strided view: the result is finite and right, and fills `out`."""
    E, k, H, I, Is = 5, 2, 130, 128, 256
    case = Fp8Case(T, E, k, H, I, Is, dtype, seed=7 + T)
    chosen = torch.tensor([1, 3])
    case.topk_ids = chosen[random_ids(T, 2, k, torch.Generator().manual_seed(T))]
    want = fused_moe_torch(*case.args, **case.kwargs, act_quant=True)
    unused = torch.ones(E, dtype=torch.bool)
    unused[chosen] = False
    for w in (case.w_gate_up, case.w_down):
        w.view(torch.uint8)[unused] = 0x7F  # e4m3fn NaN
    for s in (case.w_gate_up_scale, case.w_down_scale):
        s[unused] = float("nan")
    monkeypatch.setattr(moe_triton, "_empty", poisoned_empty)
    big = torch.full((T + 2, H + 5), float("nan"), dtype=dtype)
    out = big[:T, :H]
    got = fused_moe(*case.args, **case.kwargs, out=out, backend="triton")
    assert got is out and torch.isfinite(out).all()
    assert big.isnan().sum() == big.numel() - T * H
    assert rel_err(out, want) <= EMU_TOL[dtype]


@pytest.mark.parametrize("Is", [None, 128])
@pytest.mark.parametrize("T", [1, 5, 33])
def test_residual_is_added_in_the_sum(T, Is):
    """residual: out = residual + the MoE, the residual in the sum's fp32 accumulator (the emulation plus the residual,
    one rounding), within the activations' rounding of the reference; into a NaN-poisoned out and into out =
    residual itself."""
    E, k, H, I, dtype = 4, 2, 130, 128, F16
    case = Fp8Case(T, E, k, H, I, Is, dtype, seed=3 * T + (Is or 0))
    residual = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(dtype)
    kept = residual.clone()
    emu = fused_moe_torch(*case.args, **case.kwargs, act_quant=True)
    want = fused_moe_torch(*case.args, **case.kwargs, residual=residual, act_quant=True)
    assert rel_err(want, emu.float() + residual.float()) <= 1e-3
    ref = fused_moe_torch(*case.args, **case.kwargs, residual=residual)
    assert rel_err(ref, (fused_moe_torch(*case.args, **case.kwargs).float() + residual.float())) <= 1e-3
    got = fused_moe(*case.args, **case.kwargs, residual=residual, backend="triton")
    assert torch.equal(residual, kept)
    assert rel_err(got, want) <= EMU_TOL[dtype] and rel_err(got, ref) <= ACT_TOL
    assert rel_err(got, emu) > 0.1  # the residual is really there
    out = torch.full((T, H), float("nan"), dtype=dtype)
    assert fused_moe(*case.args, **case.kwargs, residual=residual, out=out, backend="triton") is out
    assert torch.isfinite(out).all() and rel_err(out, want) <= EMU_TOL[dtype]
    in_place = residual.clone()
    assert fused_moe(*case.args, **case.kwargs, residual=in_place, out=in_place, backend="triton") is in_place
    assert torch.equal(in_place, out)


def test_residual_of_another_shape_is_a_clear_error():
    case = Fp8Case(3, 4, 2, 130, 128, 128, F32)
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError, match=r"\bresidual must"):
            fused_moe(*case.args, **case.kwargs, residual=torch.randn(3, 131), backend=backend)
    with pytest.raises(ValueError, match=r"\bresidual must"):
        fused_moe_fp8_triton(*case.args, **case.kwargs, residual=torch.randn(3, 130, dtype=F16))


def test_tile_configurations():
    """Other valid tiles give the same result: down block_n 64 (a scale block spans two programs) and 256 (a program
    spans two scale blocks, the last one partial at H = 200), block_m 16 / 32 / 64 / 128."""
    case = Fp8Case(40, 4, 2, 200, 256, 128, F32, seed=11)
    want = fused_moe_torch(*case.args, **case.kwargs, act_quant=True)
    for bm, dn, warps in ((16, 64, 4), (32, 256, 4), (64, 128, 8), (128, 64, 8)):
        got = fused_moe_fp8_triton(*case.args, **case.kwargs, up_config=Config(bm, 128, 128, 2, warps, 2),
                                   down_config=Config(bm, dn, 128, 1, 4, 3))
        assert rel_err(got, want) <= EMU_TOL[F32], (bm, dn)


def test_empty_batch_and_auto_on_cpu_takes_the_reference(monkeypatch):
    case = Fp8Case(0, 4, 2, 130, 128, 128, F16)
    assert fused_moe(*case.args, **case.kwargs, backend="triton").shape == (0, 130)
    case = Fp8Case(3, 4, 2, 130, 128, 128, F32, seed=2)
    want = fused_moe_torch(*case.args, **case.kwargs)

    def no_kernel(*a, **k):
        raise AssertionError("the Triton kernel ran on CPU tensors with backend='auto'")

    monkeypatch.setattr(moe_ops, "fused_moe_fp8_triton", no_kernel)
    assert torch.equal(fused_moe(*case.args, **case.kwargs), want)


def bad_fp8_calls():
    """(name, Fp8Case arguments, change to the call, error pattern)."""
    return [
        ("I_not_128", (3, 4, 2, 130, 64, None), {}, "multiples of 128"),
        ("Is_not_128", (3, 4, 2, 130, 128, 64), {}, "multiples of 128"),
        ("no_gate_up_scale", (3, 4, 2, 130, 128, 128), {"w_gate_up_scale": None}, "w_gate_up_scale"),
        ("no_down_scale", (3, 4, 2, 130, 128, 128), {"w_down_scale": None}, "w_down_scale"),
        ("no_shared_scales", (3, 4, 2, 130, 128, 128), {"shared_scales": None}, "shared_scales"),
        ("bf16_shared", (3, 4, 2, 130, 128, 128), "bf16_shared", "float8_e4m3fn routed and shared"),
        ("scale_shape", (3, 4, 2, 130, 128, 128), "scale_shape", r"w_down_scale must be contiguous float32"),
        ("scale_dtype", (3, 4, 2, 130, 128, None), "scale_dtype", r"w_gate_up_scale must be contiguous float32"),
    ]


@pytest.mark.parametrize("name,shape,change,pattern", bad_fp8_calls(), ids=[c[0] for c in bad_fp8_calls()])
def test_bad_input_is_a_clear_error(name, shape, change, pattern):
    case = Fp8Case(*shape, F32)
    kwargs = case.kwargs
    if change == "bf16_shared":
        kwargs.update(shared=tuple(w.float() for w in case.shared), shared_scales=None)
    elif change == "scale_shape":
        kwargs["w_down_scale"] = case.w_down_scale[:, :1]
    elif change == "scale_dtype":
        kwargs["w_gate_up_scale"] = case.w_gate_up_scale.double()
    else:
        kwargs.update(change)
    with pytest.raises(ValueError, match=pattern):
        fused_moe(*case.args, **kwargs, backend="triton")


def test_fp8_tile_configuration_rules():
    case = Fp8Case(4, 4, 2, 130, 128, None, F32)
    for up, down, pattern in ((Config(16, 64, 128), Config(16, 64, 128), "up_config"),
                              (Config(16, 128, 64), Config(16, 64, 128), "block_k"),
                              (Config(16, 128, 128), Config(16, 64, 64), "down_config"),
                              (Config(16, 128, 128), Config(32, 64, 128), "block_m")):
        with pytest.raises(ValueError, match=pattern):
            fused_moe_fp8_triton(*case.args, **case.kwargs, up_config=up, down_config=down)


# ---- GPU ------------------------------------------------------------------------------------------------------
GPU_SHAPES = {  # E, k, H, I, Is
    "v3": (256, 8, 7168, 2048, 2048),
    "small_odd_h": (64, 6, 2000, 256, 512),  # H no multiple of 128, two shared pseudo-experts
}
GPU_TOKENS = [1, 8, 128, 2048]


@pytest.fixture(scope="module")
def gpu_cases():
    cache = {}

    def get(shape):
        if shape not in cache:
            cache.clear()
            torch.cuda.empty_cache()
            cache[shape] = Fp8Case(max(GPU_TOKENS), *GPU_SHAPES[shape], BF16, seed=1, device="cuda")
        return cache[shape]

    return get


def first_tokens(case: Fp8Case, T: int) -> tuple:
    return case.x[:T], case.w_gate_up, case.w_down, case.topk_weights[:T], case.topk_ids[:T]


@pytest.mark.gpu
@pytest.mark.parametrize("T", GPU_TOKENS)
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_fp8_matches_reference_and_bf16_moe(shape, T, gpu_cases):
    """fp8 Triton (auto backend) against the w8a8 emulation, the fp8 reference and the bf16 fused MoE on the
    dequantised weights."""
    case = gpu_cases(shape)
    args = first_tokens(case, T)
    with torch.inference_mode():
        got = fused_moe(*args, **case.kwargs)
        assert torch.equal(got, fused_moe(*args, **case.kwargs, backend="triton"))
        emu = fused_moe_torch(*args, **case.kwargs, act_quant=True)
        ref = fused_moe_torch(*args, **case.kwargs)
        ids = args[4]
        used = ids.unique()
        wgu = torch.zeros(case.w_gate_up.shape, dtype=BF16, device="cuda")  # only the chosen experts
        wd = torch.zeros(case.w_down.shape, dtype=BF16, device="cuda")
        for e in used.tolist():
            wgu[e] = weight_dequant(case.w_gate_up[e], case.w_gate_up_scale[e]).to(BF16)
            wd[e] = weight_dequant(case.w_down[e], case.w_down_scale[e]).to(BF16)
        shared = tuple(weight_dequant(w, s).to(BF16) for w, s in zip(case.shared, case.shared_scales))
        bf16 = fused_moe(args[0], wgu, wd, args[3], ids, shared=shared)
    assert got.dtype == BF16 and got.shape == (T, GPU_SHAPES[shape][2])
    assert torch.isfinite(got).all()
    # 2e-2: the kernel's intermediate h comes from fp32 sums in another order than the emulation's; h values on an
    # e4m3 rounding boundary round to the other neighbour (one e4m3 step, ~6 %), which measured 1.1–1.5 % overall
    assert fro_err(got, emu) <= 2e-2
    assert fro_err(got, ref) <= ACT_TOL
    assert fro_err(got, bf16) <= ACT_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 300])
def test_gpu_fp8_cuda_graph_capture_and_replay(T):
    E, k, H, I, Is = GPU_SHAPES["small_odd_h"]
    case = Fp8Case(T, E, k, H, I, Is, BF16, seed=T, device="cuda")
    out = torch.empty_like(case.x)
    with torch.no_grad():
        fused_moe(*case.args, **case.kwargs, out=out)  # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fused_moe(*case.args, **case.kwargs, out=out)
        previous = None
        for step in range(3):
            new = Fp8Case(T, E, k, H, I, Is, BF16, seed=1000 + 10 * T + step, device="cuda")
            if step == 1:
                new.topk_ids[:, ::2] += E  # every other slot on another rank
            for dst, src in ((case.x, new.x), (case.topk_ids, new.topk_ids), (case.topk_weights, new.topk_weights),
                             (case.w_down, new.w_down), (case.w_down_scale, new.w_down_scale)):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, fused_moe(*case.args, **case.kwargs))  # the replay computes what a call does
            emu = fused_moe_torch(*case.args, **case.kwargs, act_quant=True)
            assert fro_err(out, emu) <= 2e-2  # see the test above
            assert previous is None or not torch.equal(previous, out)
            previous = out.clone()


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64])
def test_gpu_fp8_no_host_sync(T):
    E, k, H, I, Is = GPU_SHAPES["small_odd_h"]
    case = Fp8Case(T, E, k, H, I, Is, BF16, seed=T, device="cuda")
    with torch.inference_mode():
        first = fused_moe(*case.args, **case.kwargs)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = fused_moe(*case.args, **case.kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = fused_moe_torch(*case.args, **case.kwargs, act_quant=True)
    assert torch.equal(got, first)
    assert fro_err(got, want) <= 2e-2  # see test_gpu_fp8_matches_reference_and_bf16_moe
