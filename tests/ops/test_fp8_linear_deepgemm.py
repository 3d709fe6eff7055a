"""The FP8 block-scaled linear on DeepGEMM (`ops.linear.deepgemm`, the optional extra `specmla[hopper]`).

CPU: what the wrapper hands DeepGEMM (act_quant's e4m3 rows and its column-major, 16-byte-aligned scales; the
weight and its block scales) checked through a stand-in module that multiplies in torch, against the w8a8
emulation; the rules (`supported`, `preferred`), and a clear error where DeepGEMM is missing. GPU (with deep_gemm
installed): DeepGEMM against the emulation on DeepSeek-V3's shapes, "auto" routing by rows, a CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch
from test_fp8_linear import make_linear, make_x, rel, w8a8_emulation

from specmla.ops import fp8_block_linear
from specmla.ops.linear import deepgemm, weight_dequant


class FakeDeepGemm:
    """Stands in for `deep_gemm`: fp8_gemm_nt checks the operand layouts DeepGEMM's sm_90 kernel loads (K-major e4m3
    rows; activation scales [M, K/128] column-major with each column 16-byte aligned; weight scales contiguous
    [N/128, K/128]) and writes the block-scaled product in fp32, rounded to d's dtype."""

    def __init__(self):
        self.calls = 0

    def fp8_gemm_nt(self, a, b, d):
        (q, s), (w, ws) = a, b
        M, K = q.shape
        assert q.dtype == torch.float8_e4m3fn and q.is_contiguous()
        assert s.dtype == torch.float32 and tuple(s.shape) == (M, K // 128)
        assert s.stride() == (1, -(-M // 4) * 4), s.stride()
        assert w.is_contiguous() and ws.is_contiguous() and d.dtype == torch.bfloat16
        self.calls += 1
        d.copy_((q.float() * s.repeat_interleave(128, dim=1)) @ weight_dequant(w, ws).T)


@pytest.fixture
def fake_deepgemm(monkeypatch):
    fake = FakeDeepGemm()
    monkeypatch.setattr(deepgemm, "module", lambda: fake)
    monkeypatch.setattr(deepgemm, "available", lambda device: True)
    return fake


@pytest.mark.parametrize("lead", [(5,), (37,), (2, 3), (0,)])
def test_the_wrapper_hands_deepgemm_act_quant_rows_and_aligned_column_major_scales(fake_deepgemm, lead):
    N, K = 192, 384
    w, s = make_linear(N, K, seed=3)
    x = make_x((*lead, K), seed=4, dtype=torch.bfloat16)
    bias = torch.randn(N).to(torch.bfloat16)
    y = deepgemm.fp8_block_linear_deepgemm(x, w, s, bias=bias)
    assert y.shape == (*lead, N) and y.dtype == torch.bfloat16
    assert fake_deepgemm.calls == (1 if x.numel() else 0)
    if x.numel():
        want = w8a8_emulation(x, w, s).to(torch.bfloat16).float() + bias.float()
        assert rel(y, want) <= 1e-2
        # the product itself is the emulation's, up to bf16 rounding
        y0 = deepgemm.fp8_block_linear_deepgemm(x, w, s)
        assert rel(y0, w8a8_emulation(x, w, s)) <= 4e-3


def test_backend_deepgemm_is_taken_when_asked(fake_deepgemm):
    w, s = make_linear(128, 256, seed=5)
    x = make_x((9, 256), seed=6, dtype=torch.bfloat16)
    y = fp8_block_linear(x, w, s, backend="deepgemm")
    assert fake_deepgemm.calls == 1 and rel(y, w8a8_emulation(x, w, s)) <= 4e-3


def test_rules_supported_and_preferred():
    w, _ = make_linear(128, 256)
    xb = torch.zeros(3, 256, dtype=torch.bfloat16)
    assert deepgemm.supported(xb, w)
    assert not deepgemm.supported(xb.float(), w)  # fp32 activations
    assert not deepgemm.supported(xb, w, out_dtype=torch.float32)  # DeepGEMM writes bf16
    assert not deepgemm.supported(torch.zeros(3, 300, dtype=torch.bfloat16), make_linear(128, 300)[0])  # K % 128
    assert not deepgemm.supported(xb, make_linear(136, 256)[0])  # N % 64
    assert not deepgemm.supported(xb, w, bias=torch.zeros(128, dtype=torch.float16))
    assert not deepgemm.preferred(16, 7168) and deepgemm.preferred(17, 7168)
    assert not deepgemm.preferred(128, 1536) and deepgemm.preferred(256, 1536)


def test_routes_to_takes_the_rows_deepgemm_wins_on_calls_it_fits(fake_deepgemm):
    w = make_linear(128, 256)[0]
    assert deepgemm.routes_to(torch.zeros(256, 256, dtype=torch.bfloat16), w)
    assert deepgemm.routes_to(torch.zeros(2, 128, 256, dtype=torch.bfloat16), w)  # rows of all leading dims
    assert not deepgemm.routes_to(torch.zeros(255, 256, dtype=torch.bfloat16), w)  # K < 2048: from 256 rows
    assert not deepgemm.routes_to(torch.zeros(256, 256), w)  # fp32 activations
    assert not deepgemm.supported(torch.zeros(3, 256, dtype=torch.bfloat16), w.flatten())  # not a matrix: no call


def test_missing_deepgemm_is_named_and_auto_stays_on_triton(monkeypatch):
    monkeypatch.setattr(deepgemm, "module", lambda: None)
    w, s = make_linear(128, 256, seed=7)
    x = make_x((20, 256), seed=8, dtype=torch.bfloat16)
    assert not deepgemm.available(torch.device("cpu"))
    assert not deepgemm.routes_to(torch.zeros(300, 256, dtype=torch.bfloat16), w)
    with pytest.raises(RuntimeError, match=r"specmla\[hopper\]"):
        fp8_block_linear(x, w, s, backend="deepgemm")
    with pytest.raises(ValueError, match="weight_scale_inv"):  # bad arguments are named before availability
        fp8_block_linear(x, w, s[:, :1], backend="deepgemm")


def test_unsupported_call_is_refused_with_the_reason(fake_deepgemm):
    w, s = make_linear(128, 256, seed=9)
    with pytest.raises(ValueError, match="bf16 x and output"):
        deepgemm.fp8_block_linear_deepgemm(make_x((4, 256), seed=10), w, s)


# ---- GPU (deep_gemm installed) --------------------------------------------------------------------------------
def _needs_deepgemm():
    if not deepgemm.available(torch.device("cuda")):
        pytest.skip("deep_gemm is not installed or not sm_90: " + deepgemm.INSTALL_HINT)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 17, 300, 4096])
@pytest.mark.parametrize("N,K", [(2112, 7168), (24576, 1536), (7168, 2048)])
def test_gpu_deepgemm_matches_w8a8_emulation(N, K, M):
    _needs_deepgemm()
    w, s = make_linear(N, K, seed=N + K, device="cuda")
    x = make_x((M, K), seed=M, dtype=torch.bfloat16, device="cuda")
    y = deepgemm.fp8_block_linear_deepgemm(x, w, s)
    rows = slice(0, min(M, 256))
    assert rel(y[rows], w8a8_emulation(x[rows], w, s)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,want", [(16, 7168, False), (17, 7168, True), (64, 1536, False), (256, 1536, True)])
def test_gpu_auto_routes_by_rows(M, K, want, monkeypatch):
    _needs_deepgemm()
    taken = []
    real = deepgemm.fp8_block_linear_deepgemm
    monkeypatch.setattr(deepgemm, "fp8_block_linear_deepgemm", lambda *a, **k: taken.append(1) or real(*a, **k))
    w, s = make_linear(2048, K, seed=1, device="cuda")
    x = make_x((M, K), seed=2, dtype=torch.bfloat16, device="cuda")
    y = fp8_block_linear(x, w, s)
    assert bool(taken) == want
    assert rel(y, w8a8_emulation(x, w, s)) <= 1e-2


@pytest.mark.gpu
def test_gpu_deepgemm_in_a_cuda_graph():
    _needs_deepgemm()
    w, s = make_linear(2112, 7168, seed=3, device="cuda")
    xs = [make_x((96, 7168), seed=4 + i, dtype=torch.bfloat16, device="cuda") for i in range(2)]
    x = xs[0].clone()
    deepgemm.fp8_block_linear_deepgemm(x, w, s)  # eager first: the JIT compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = deepgemm.fp8_block_linear_deepgemm(x, w, s)
    for i in (1, 0):
        x.copy_(xs[i])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, deepgemm.fp8_block_linear_deepgemm(xs[i], w, s))
