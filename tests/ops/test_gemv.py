import pytest
import torch

from specmla.ops.linear.gemv import (SMALL_M, GemvConfig, default_config, head_matmul_small_m,
                                     head_matmul_small_m_torch, linear_small_m, linear_small_m_torch)

# every path of the kernel: one split and several (with and without a partial last tile), tiles narrower and
# wider than N and K, shallow and deep pipelines
CONFIGS = [
    None,
    GemvConfig(block_n=16, block_k=16, split_k=1),
    GemvConfig(block_n=32, block_k=32, split_k=3),
    GemvConfig(block_n=64, block_k=128, split_k=1),
    GemvConfig(block_n=16, block_k=64, split_k=2, num_warps=2),
    GemvConfig(block_n=16, block_k=256, num_stages=8, split_k=1, prefetch=0),
    GemvConfig(block_n=32, block_k=16, num_stages=2, split_k=7, prefetch=8),
]
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _close(y, x_ref, dtype):
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), x_ref.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 3, 8, 16])
def test_linear_matches_reference(T, dtype):
    N, K = 100, 72  # K not a multiple of 16 / 32 / 64 / 128, N not a multiple of any block
    x = _randn(T, K, dtype=dtype, seed=T)
    w = _randn(N, K, dtype=dtype, seed=100 + T) * 0.3
    ref = linear_small_m_torch(x, w)
    _close(ref, x.double() @ w.double().t(), dtype)
    for cfg in CONFIGS:
        _close(linear_small_m(x, w, config=cfg), ref, dtype)


@pytest.mark.parametrize("cfg", [None, GemvConfig(block_n=32, block_k=32, split_k=4),
                                 GemvConfig(block_n=16, block_k=16, split_k=3)])
def test_linear_strided_views_write_only_their_columns(cfg):
    dtype, T, N, K = torch.float32, 2, 48, 80
    wide_x = _randn(T, 3 * K, dtype=dtype, seed=1)
    x = wide_x[:, K:2 * K]  # rows 3K apart
    w = _randn(N, K, dtype=dtype, seed=2)
    buf = torch.full((T, N + 24), float("nan"), dtype=dtype)
    out = buf[:, 8:8 + N]
    y = linear_small_m(x, w, out=out, config=cfg)
    assert y.data_ptr() == out.data_ptr()
    _close(out, linear_small_m_torch(x, w), dtype)
    assert buf[:, :8].isnan().all() and buf[:, 8 + N:].isnan().all()


@pytest.mark.parametrize("layout", ["uk", "uv"])
@pytest.mark.parametrize("G,K,N", [(3, 40, 24), (2, 64, 48)])
@pytest.mark.parametrize("T", [1, 5])
def test_head_matmul_model_layouts(layout, G, K, N, T):
    """w_uk: a [G, K, N] view of kv_b_proj [G·(K + V), N] (unit stride along N); w_uv: wᵀ per head of a
    [G, N, K] view (unit stride along K); x a column slice of q; out a column slice of the absorbed query."""
    dtype = torch.float16
    if layout == "uk":
        kv_b = _randn(G * (K + 16), N, dtype=dtype, seed=3).view(G, K + 16, N)
        w = kv_b[:, :K]
    else:
        kv_b = _randn(G * (16 + N), K, dtype=dtype, seed=4).view(G, 16 + N, K)
        w = kv_b[:, 16:].transpose(1, 2)
    assert tuple(w.shape) == (G, K, N)
    q = _randn(T, G, K + 8, dtype=dtype, seed=5)
    x = q[..., :K]
    ref = head_matmul_small_m_torch(x, w)
    _close(ref, torch.einsum("tgk,gkn->tgn", x.double(), w.double()), dtype)
    for cfg in CONFIGS:
        buf = torch.full((T, G, N + 10), float("nan"), dtype=dtype)
        out = buf[..., :N]
        head_matmul_small_m(x, w, out=out, config=cfg)
        _close(out, ref, dtype)
        assert buf[..., N:].isnan().all()
        _close(head_matmul_small_m(x, w, config=cfg), ref, dtype)


def test_head_matmul_any_strides_fp32():
    T, G, K, N = 3, 4, 40, 24
    x = _randn(G, K, T, dtype=torch.float32, seed=6).permute(2, 0, 1)  # no unit stride at all
    w = _randn(N, G, K, dtype=torch.float32, seed=7).permute(1, 2, 0)
    out = torch.full((N, T, G), float("nan")).permute(1, 2, 0)
    head_matmul_small_m(x, w, out=out, config=GemvConfig(block_n=16, block_k=16, split_k=2))
    _close(out, torch.matmul(x.transpose(0, 1), w).transpose(0, 1), torch.float32)


def test_split_counters_are_left_zeroed():
    from specmla.ops.scratch import zeroed_scratch

    x = _randn(4, 256, dtype=torch.float32, seed=8)
    w = _randn(40, 256, dtype=torch.float32, seed=9)
    cfg = GemvConfig(block_n=16, block_k=32, split_k=5)
    first = linear_small_m(x, w, config=cfg)
    assert not zeroed_scratch("gemv_splitk", 1, x.device).any()
    assert torch.equal(linear_small_m(x, w, config=cfg), first)  # deterministic


def test_default_rule():
    # V2-Lite's projections: ~one wave of programs without a split on short K, a split on long K
    assert default_config(1, 1, 2048, 2048) == GemvConfig(block_n=16, block_k=256, num_stages=8, split_k=1)
    assert default_config(1, 1, 3648, 2048) == GemvConfig(block_n=32, block_k=256, num_stages=8, split_k=1)
    assert default_config(1, 1, 2112, 7168) == GemvConfig(block_n=64, block_k=128, num_stages=8, split_k=4)
    assert default_config(1, 1, 102400, 2048).split_k == 1
    for T, G, N, K in [(1, 16, 512, 128), (8, 16, 128, 512), (4, 128, 128, 512), (16, 1, 2112, 7168),
                       (1, 1, 24, 40), (16, 1, 7168, 16384)]:
        c = default_config(T, G, N, K)
        assert 16 <= c.block_n <= max(16, N) and 16 <= c.block_k and 2 <= c.num_stages <= 8 and c.split_k >= 1
        assert (c.block_n + 16) * c.block_k * 2 * c.num_stages <= 200 << 10
        for smem in (147 << 10, 83 << 10):  # A100's and sm_89's per-block limits less the reserve
            c = default_config(T, G, N, K, smem=smem)
            assert (c.block_n + 16) * c.block_k * 2 * max(1, c.num_stages - 1) <= smem and c.num_stages >= 2


def test_empty_rows_k_zero_and_limits():
    w = _randn(24, 40, dtype=torch.float32, seed=10)
    assert linear_small_m(torch.empty(0, 40), w).shape == (0, 24)
    assert head_matmul_small_m(torch.empty(0, 2, 40), w.view(2, 12, 40).transpose(1, 2)).shape == (0, 2, 12)
    assert torch.equal(linear_small_m(torch.empty(2, 0), torch.empty(5, 0)), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="SMALL_M"):
        linear_small_m(torch.randn(SMALL_M + 1, 40), w)
    with pytest.raises(ValueError, match="SMALL_M"):
        head_matmul_small_m(torch.randn(SMALL_M + 1, 2, 40), torch.randn(2, 40, 8))


@pytest.mark.parametrize("call", [
    lambda: linear_small_m(torch.randn(2, 40), torch.randn(24, 41)),
    lambda: linear_small_m(torch.randn(2, 3, 40), torch.randn(24, 40)),
    lambda: linear_small_m(torch.randn(2, 40), torch.randn(24, 40), out=torch.empty(2, 25)),
    lambda: linear_small_m(torch.randn(2, 40), torch.randn(24, 40).half()),
    lambda: linear_small_m(torch.randn(2, 40), torch.randn(24, 40), out=torch.empty(2, 24).half()),
    lambda: linear_small_m(torch.randn(2, 40).int(), torch.randn(24, 40).int()),
    lambda: head_matmul_small_m(torch.randn(2, 3, 40), torch.randn(2, 40, 8)),
    lambda: head_matmul_small_m(torch.randn(2, 3, 40), torch.randn(3, 41, 8)),
    lambda: head_matmul_small_m(torch.randn(2, 3, 40), torch.randn(3, 40, 8), out=torch.empty(2, 3, 9)),
    lambda: head_matmul_small_m_torch(torch.randn(2, 3, 40), torch.randn(3, 40)),
    lambda: GemvConfig(block_n=24),
    lambda: GemvConfig(block_n=8),
    lambda: GemvConfig(block_k=8),
    lambda: GemvConfig(split_k=0),
    lambda: GemvConfig(prefetch=3),
])
def test_bad_arguments(call):
    with pytest.raises(ValueError):
        call()


@pytest.mark.gpu
def test_gpu_bf16_at_model_shapes():
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    for T in (1, 4, 16):
        for N, K in [(3648, 2048), (2048, 2048), (2112, 7168), (1000, 300)]:
            x = torch.randn(T, K, device=dev, dtype=bf)
            w = torch.randn(N, K, device=dev, dtype=bf) * K ** -0.5
            ref = linear_small_m_torch(x, w)
            for cfg in (None, GemvConfig(block_n=32, split_k=1), GemvConfig(block_n=64, block_k=256, split_k=4,
                                                                            num_stages=3)):
                torch.testing.assert_close(linear_small_m(x, w, config=cfg).float(), ref.float(), rtol=2e-2,
                                           atol=2e-2)
        xf, wf = x[:, :300].float(), torch.randn(1000, 300, device=dev) * 300 ** -0.5  # fp32: no tf32 rounding
        torch.testing.assert_close(linear_small_m(xf, wf), xf @ wf.t(), rtol=1e-4, atol=1e-4)
        for H in (16, 128):
            kv_b = torch.randn(H, 256, 512, device=dev, dtype=bf) * 0.05
            w_uk, w_uv = kv_b[:, :128], kv_b[:, 128:]
            q = torch.randn(T, H, 192, device=dev, dtype=bf)
            q_abs = torch.full((T, H, 576), float("nan"), device=dev, dtype=bf)
            head_matmul_small_m(q[..., :128], w_uk, out=q_abs[..., :512])
            torch.testing.assert_close(q_abs[..., :512].float(),
                                       torch.einsum("thn,hnc->thc", q[..., :128].float(), w_uk.float()),
                                       rtol=2e-2, atol=2e-2)
            assert q_abs[..., 512:].isnan().all()
            o = torch.randn(T, H, 512, device=dev, dtype=bf)
            torch.testing.assert_close(head_matmul_small_m(o, w_uv.transpose(1, 2)).float(),
                                       torch.einsum("thc,hvc->thv", o.float(), w_uv.float()), rtol=2e-2, atol=2e-2)
