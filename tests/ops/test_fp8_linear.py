"""The FP8 block-scaled linear's Triton kernels (contract C7) against torch: `act_quant` against `act_quant_torch`
(bit-exact), the w8a8 product against its emulation in torch (`fp8_block_linear_w8a8_torch`: act_quant_torch, then
the dequantised product in fp32: tight) and against `fp8_block_linear_torch` (exact activations: loose). CPU runs
the kernels under TRITON_INTERPRET=1 at small odd shapes; the GPU tests run DeepSeek-V3's shapes, a CUDA-graph
replay and a no-sync check."""

from __future__ import annotations

import pytest
import torch

from specmla.ops import fp8_block_linear
from specmla.ops.linear import (act_quant, act_quant_torch, fp8_block_linear_torch, fp8_block_linear_triton,
                                weight_dequant, weight_quant)
from specmla.ops.linear.reference import act_quant_dequant_torch, fp8_block_linear_w8a8_torch


def make_linear(N, K, seed=0, device="cpu"):
    """A random fp8 weight [N, K] with block scales, the blocks' magnitudes spread (so a wrong scale index shows);
    quantised on `device`."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    spread = torch.exp(torch.randn(-(-N // 128), -(-K // 128), generator=g))
    w = w.to(device) * spread.to(device).repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    return weight_quant(w)


def make_x(shape, seed=1, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x = x * torch.exp(torch.randn(*shape[:-1], 1, generator=g))  # rows of different magnitudes
    return x.to(dtype).to(device)


def w8a8_emulation(x, weight, scale, bias=None):
    """fp32 [..., N]: the kernels' w8a8 arithmetic in torch (`fp8_block_linear_w8a8_torch`), not rounded to x's
    dtype."""
    return fp8_block_linear_w8a8_torch(x, weight, scale, bias=bias, out_dtype=torch.float32)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---- act_quant ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_act_quant_matches_torch_bit_exact(dtype):
    x = make_x((2, 5, 300), dtype=dtype)
    x[0, 1, 128:256] = 0  # a group of zeros: scale 1, codes 0
    x[1, 2, :128] = torch.linspace(-31.9, 31.9, 128).to(dtype)  # values that round across an exponent boundary
    q, s = act_quant(x)
    qr, sr = act_quant_torch(x)
    assert q.shape == (2, 5, 300) and q.dtype == torch.float8_e4m3fn and s.shape == (2, 5, 3)
    assert torch.equal(s, sr)
    assert s[0, 1, 1] == 1.0
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


def test_act_quant_bad_input():
    with pytest.raises(ValueError, match="x must be"):
        act_quant(torch.zeros(4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="block"):
        act_quant(torch.randn(4, 8), block=64)


# ---- the product ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("M,kw", [(1, {}), (5, {}), (20, {}), (3, {"split": 1}),
                                  (70, {})])
def test_triton_matches_w8a8_emulation(M, kw):
    """Decode (split-K and not) and prefill regimes, N and K not multiples of
    128, bias, NaN-poisoned output and workspace."""
    N, K = 200, 300
    w, s = make_linear(N, K)
    x = make_x((M, K), seed=M)
    bias = torch.randn(N)
    out = torch.full((M, N), float("nan"))
    work = torch.full((3 * M * N,), float("nan"))
    y = fp8_block_linear_triton(x, w, s, bias=bias, out=out, workspace=work, **kw)
    assert y.data_ptr() == out.data_ptr() and y.shape == (M, N) and y.dtype == torch.float32
    assert torch.isfinite(y).all()
    want = w8a8_emulation(x, w, s, bias)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert rel(y, fp8_block_linear_torch(x, w, s, bias=bias)) <= 3e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_backend_is_act_quant_then_the_dequantised_product(dtype):
    """backend="w8a8_torch" is `act_quant_torch`'s e4m3 values times their group scales, times the dequantised weight
    in fp32, plus the bias, rounded once to x's dtype (bit for bit); the rounded activations move x by about e4m3's
    2.6 % rms, so the output leaves the exact-activation reference by about as much; empty inputs keep their
    shapes."""
    N, K = 200, 300
    w, s = make_linear(N, K, seed=2)
    x = make_x((2, 3, K), seed=3, dtype=dtype)
    bias = torch.randn(N).to(dtype)
    y = fp8_block_linear(x, w, s, bias=bias, backend="w8a8_torch")
    q, qs = act_quant_torch(x)
    a = q.float() * qs.repeat_interleave(128, dim=-1)[..., :K]
    assert torch.equal(y, (a @ weight_dequant(w, s).T + bias.float()).to(dtype))
    assert torch.equal(act_quant_dequant_torch(x), a)
    assert 1e-2 <= rel(a, x) <= 4e-2
    exact = fp8_block_linear(x, w, s, bias=bias, backend="torch")
    assert 1e-2 <= rel(y, exact) <= 4e-2
    assert fp8_block_linear(x, w, s, bias=bias, backend="w8a8_torch", out_dtype=torch.float32).dtype == torch.float32
    assert fp8_block_linear(torch.randn(0, K), w, s, backend="w8a8_torch").shape == (0, N)
    w0, s0 = torch.empty(N, 0, dtype=torch.float8_e4m3fn), torch.empty(2, 0)
    torch.testing.assert_close(fp8_block_linear(torch.randn(3, 0).to(dtype), w0, s0, bias=bias, backend="w8a8_torch"),
                               bias.expand(3, N))
    with pytest.raises(ValueError, match="weight_scale_inv"):
        fp8_block_linear(x, w, s[:1], backend="w8a8_torch")


def test_split_k_is_deterministic_and_resets_its_counters():
    N, K = 200, 700  # 6 K blocks
    w, s = make_linear(N, K, seed=3)
    x = make_x((4, K), seed=4)
    runs = [fp8_block_linear_triton(x, w, s, split=sp) for sp in (3, 3, 6)]
    assert torch.equal(runs[0], runs[1])  # the same split: bit-identical
    torch.testing.assert_close(runs[2], runs[0], rtol=1e-5, atol=1e-5)
    from specmla.ops.scratch import zeroed_scratch
    from specmla.ops.linear.triton import SPLITK_COUNTERS
    assert not zeroed_scratch("fp8_linear_splitk", SPLITK_COUNTERS, torch.device("cpu")).any()


@pytest.mark.parametrize("N,K,want", [(7168, 2048, 2), (24576, 1536, 1), (18432, 7168, 1), (2112, 7168, 7),
                                      (7168, 18432, 2), (64, 300, 3), (100, 128, 1)])
def test_plan_split_gives_each_sm_about_two_programs_none_empty(N, K, want):
    from specmla.ops.linear.triton import plan_split
    split = plan_split(N, K, 64, 132)
    assert split == want
    kb = -(-K // 128)
    per = -(-kb // split)
    assert -(-kb // per) == split  # every program has K blocks
    if split > 1:  # the fewest splits reaching 1.6 programs per SM
        assert -(-N // 64) * (split - 1) < 1.6 * 132



def test_dispatch_out_dtype_3d_and_empty():
    N, K = 136, 260
    w, s = make_linear(N, K, seed=5)
    x = make_x((2, 3, K), seed=6, dtype=torch.float16)
    y = fp8_block_linear(x, w, s, out_dtype=torch.float32, backend="triton")
    assert y.shape == (2, 3, N) and y.dtype == torch.float32
    torch.testing.assert_close(y, w8a8_emulation(x, w, s), rtol=1e-4, atol=1e-4)
    y16 = fp8_block_linear(x, w, s, backend="triton")
    assert y16.dtype == torch.float16
    torch.testing.assert_close(y16.float(), y, rtol=2e-3, atol=2e-3)
    # CPU "auto" takes the torch reference (exact activations)
    assert torch.equal(fp8_block_linear(x, w, s), fp8_block_linear_torch(x, w, s))
    empty = fp8_block_linear(torch.randn(0, K), w, s, backend="triton")
    assert empty.shape == (0, N)
    assert fp8_block_linear(torch.randn(2, 0, K), w, s, backend="triton").shape == (2, 0, N)
    # K = 0: the bias alone (or zeros); act_quant of no columns
    w0, s0 = torch.empty(N, 0, dtype=torch.float8_e4m3fn), torch.empty(2, 0)
    bias = torch.randn(N)
    torch.testing.assert_close(fp8_block_linear(torch.randn(3, 0), w0, s0, bias=bias, backend="triton"),
                               bias.expand(3, N))
    assert not fp8_block_linear(torch.randn(2, 3, 0), w0, s0, backend="triton").any()
    q, qs = act_quant(torch.randn(4, 0))
    assert q.shape == (4, 0) and qs.shape == (4, 0)


def test_bad_inputs_raise_naming_the_argument():
    w, s = make_linear(136, 260)
    x = torch.randn(3, 260)
    with pytest.raises(ValueError, match="weight must"):
        fp8_block_linear_triton(x, w.float(), s)
    with pytest.raises(ValueError, match="x must"):
        fp8_block_linear_triton(torch.randn(3, 259), w, s)
    with pytest.raises(ValueError, match="weight_scale_inv"):
        fp8_block_linear_triton(x, w, s[:1])
    with pytest.raises(ValueError, match="bias"):
        fp8_block_linear_triton(x, w, s, bias=torch.randn(135))
    with pytest.raises(ValueError, match="out must"):
        fp8_block_linear_triton(x, w, s, out=torch.empty(3, 137))
    with pytest.raises(ValueError, match="workspace"):
        fp8_block_linear_triton(x, w, s, split=2, workspace=torch.empty(10))
    with pytest.raises(ValueError, match="PREFETCH"):
        fp8_block_linear_triton(x, w, s, config=dict(PREFETCH=3))
    with pytest.raises(ValueError, match=r"unknown backend 'cuda' \(auto \| triton \| deepgemm \| torch \| w8a8_torch\)"):
        fp8_block_linear(x, w, s, backend="cuda")


# ---- GPU ------------------------------------------------------------------------------------------------------
V3_SHAPES = [(7168, 18432), (18432, 7168), (2112, 7168), (24576, 1536), (7168, 2048)]
_GPU_WEIGHTS: dict = {}  # the last shape's weights, reused across M


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 64, 128, 4096])
@pytest.mark.parametrize("N,K", V3_SHAPES)
def test_gpu_deepseek_v3_shapes(N, K, M):
    if (N, K) not in _GPU_WEIGHTS:
        _GPU_WEIGHTS.clear()
        _GPU_WEIGHTS[(N, K)] = make_linear(N, K, seed=N + K, device="cuda")
    w, s = _GPU_WEIGHTS[(N, K)]
    x = make_x((M, K), seed=M, dtype=torch.bfloat16, device="cuda")
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16) if M == 16 else None
    y = fp8_block_linear(x, w, s, bias=bias)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    rows = slice(0, min(M, 256))  # the references at most 256 rows (fp32 dequantised weights)
    want = w8a8_emulation(x[rows], w, s, bias)
    assert rel(y[rows], want) <= 1e-2
    assert rel(y[rows], fp8_block_linear_torch(x[rows], w, s, bias=bias, out_dtype=torch.float32)) <= 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_act_quant_matches_torch_bit_exact(dtype):
    """On CUDA too, act_quant's codes and scales equal act_quant_torch's: 16-bit rows put many values exactly on an
    e4m3 tie, which a scale one ulp off (a division done as a multiplication by the reciprocal) rounds the other
    way."""
    x = make_x((300, 1000), seed=5, dtype=dtype, device="cuda")
    q, s = act_quant(x)
    qr, sr = act_quant_torch(x)
    assert torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5, 64, 130])
def test_gpu_odd_shapes_and_poisoned_workspace(M):
    N, K = 1000, 1700
    w, s = make_linear(N, K, seed=7, device="cuda")
    x = make_x((M, K), seed=8, dtype=torch.bfloat16, device="cuda")
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    work = torch.full((16 * M * N,), float("nan"), device="cuda")
    y = fp8_block_linear_triton(x, w, s, out=out, workspace=work, split=4 if M <= 64 else None)
    assert torch.isfinite(y).all()
    assert rel(y, w8a8_emulation(x, w, s)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 64, 256])
def test_gpu_cuda_graph_replay_and_no_sync(M):
    N, K = 2112, 7168
    w, s = make_linear(N, K, seed=9, device="cuda")
    xs = [make_x((M, K), seed=10 + i, dtype=torch.bfloat16, device="cuda") for i in range(2)]
    x = xs[0].clone()
    fp8_block_linear(x, w, s)  # eager first: the split-K counters exist before the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y_eager = fp8_block_linear(x, w, s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = fp8_block_linear(x, w, s)
            y2 = fp8_block_linear(x, w, s)  # two calls in one graph share the counters
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for i in (1, 0):
        x.copy_(xs[i])
        graph.replay()
        torch.cuda.synchronize()
        want = fp8_block_linear(xs[i], w, s)
        assert torch.equal(y, want) and torch.equal(y2, want)
    assert torch.equal(y, y_eager)  # the last replay read xs[0], as the eager call did


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 64])
def test_gpu_chained_linears_in_a_graph_wait_for_their_inputs(M, monkeypatch):
    """Each linear's input is written by the kernel right before it (a torch op, then the first linear): the
    programmatic dependent launches (act_quant, then the split-K GEMM prefetching its weights) must not read it
    early. Replays on fresh inputs equal the same chain run without PDL, bit for bit; against the emulation 3e-2,
    since h rounded to bf16 moves some of the second layer's e4m3 roundings."""
    import specmla.ops.linear.triton as lt
    w1, s1 = make_linear(7168, 2048, seed=11, device="cuda")
    w2, s2 = make_linear(2112, 7168, seed=12, device="cuda")
    xs = [make_x((M, 2048), seed=20 + i, dtype=torch.bfloat16, device="cuda") for i in range(4)]
    x = xs[0].clone()

    def chain():
        h = fp8_block_linear(x * 3.0, w1, s1)
        return fp8_block_linear(h, w2, s2) + 1.0

    def no_pdl(i):
        with monkeypatch.context() as m:
            m.setattr(lt, "use_pdl", lambda device: False)
            return (fp8_block_linear(fp8_block_linear(xs[i] * 3.0, w1, s1), w2, s2) + 1.0)

    assert lt.use_pdl(x.device) == (torch.cuda.get_device_capability()[0] >= 9)
    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = chain()
    for rnd in range(3):
        for i in (1, 2, 3, 0):
            x.copy_(xs[i])
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, no_pdl(i)), (rnd, i)
    assert rel(y, w8a8_emulation(w8a8_emulation(xs[0] * 3.0, w1, s1).to(torch.bfloat16), w2, s2) + 1.0) <= 3e-2


def test_bench_fp8_smoke(tmp_path, monkeypatch):
    """benchmarks/bench_fp8.py --smoke runs the linear section on CPU and writes its JSON."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_fp8.py"
    spec = importlib.util.spec_from_file_location("bench_fp8", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "SMOKE_SHAPES", [(136, 260)])
    monkeypatch.setattr(bench, "SMOKE_TOKENS", [3, 66])
    bench.main(["--smoke", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bench_fp8_linear.json").read_text())["linear"]
    assert [(r["M"], r["check"], r["result"]) for r in rows] == [(3, "ok", "PASS"), (66, "ok", "PASS")]
