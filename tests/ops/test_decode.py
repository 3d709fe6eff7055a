"""Triton MLA decode (contract C1) vs the fp64 torch reference.

CPU: the kernel runs under TRITON_INTERPRET=1 on small shapes (fp16/fp32: the interpreter's bf16
dot is unreliable). GPU (@gpu): bf16 over the full grid of the issue, and CUDA-graph capture.
"""

import itertools
import random

import pytest
import torch
from helpers.mla_cases import assert_matches_reference, make_decode_case, reference, rel_err

from specmla.ops import mla_decode
from specmla.ops import decode
from specmla.ops.decode import mla_decode_torch
from specmla.ops.decode import triton as T
from specmla.ops.decode.dispatch import fold_factor, plan
from specmla.ops.decode.reference import combine_splits_torch


def check(case, causal, dc, out_tol, lse_tol=1e-3, backend="triton"):
    q, kv, table, seq = case
    got, got_lse = mla_decode(q, kv, table, seq, 0.0721, causal=causal, return_lse=True, backend=backend,
                              head_dim_v=dc)
    assert_matches_reference(case, causal, dc, got, got_lse, out_tol, lse_tol)


CPU_CASES = [
    # B, S, H, page, dc, dr, lens
    (1, 1, 1, 16, 32, 16, [37]),
    (2, 1, 16, 4, 64, 16, [1, 50]),
    (3, 2, 3, 8, 32, 16, [2, 9, 33]),
    (2, 4, 16, 64, 64, 16, [3, 70]),  # lengths < S·page, below S for one request
    (2, 3, 5, 1, 32, 16, [20, 7]),  # page size 1, S not a power of two
    (1, 8, 2, 128, 32, 32, [130]),
    (2, 2, 8, 16, 128, 64, [2, 40]),  # seq_len == S
    (2, 3, 5, 16, 48, 32, [7, 60]),  # Dc not a power of two
    (1, 2, 16, 64, 80, 48, [100]),  # Dc and Dr not powers of two
]


@pytest.mark.parametrize("case", CPU_CASES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_triton_matches_reference_in_interpreter(case, causal, dtype):
    B, S, H, ps, dc, dr, lens = case
    check(make_decode_case(B, S, H, ps, dc, dr, lens, dtype, seed=len(lens) + S), causal, dc,
          out_tol=1e-2 if dtype == torch.float16 else 1e-4)


def test_forced_split_counts_agree():
    case = make_decode_case(2, 2, 4, 16, 32, 16, [150, 61], torch.float32, seed=5)
    outs = [mla_decode(*case, 0.0721, head_dim_v=32, num_splits=n, backend="triton") for n in (1, 3, 7)]
    assert rel_err(outs[1], outs[0]) < 1e-5 and rel_err(outs[2], outs[0]) < 1e-5


def test_fewer_rows_per_program_keeps_the_result():
    case = make_decode_case(2, 4, 16, 64, 64, 16, [30, 150], torch.float32, seed=3)
    want = reference(*case, True, 64)[0]
    assert rel_err(mla_decode(*case, 0.0721, head_dim_v=64, opts=T.Options(max_rows=32)), want) <= 1e-5


def test_out_parameter_is_written_in_place():
    q, kv, table, seq = make_decode_case(2, 1, 4, 16, 32, 16, [10, 31], torch.float32, seed=9)
    out = torch.full((2, 1, 4, 32), float("nan"))
    res = mla_decode(q, kv, table, seq, 0.0721, out=out, backend="triton", head_dim_v=32)
    assert res.data_ptr() == out.data_ptr() and not torch.isnan(out).any()


def test_fold_rule_and_plan():
    assert fold_factor(4, 16) == 4  # H=16, S=4: 64 rows, one pass serves all four tokens
    assert fold_factor(8, 16) == 4  # two groups of four
    assert fold_factor(3, 16) == 3
    assert fold_factor(4, 64) == 1
    assert fold_factor(6, 16) == 3
    p = plan(1, 1, 16, 81920, 132)
    assert p["num_splits"] > 1  # B=1 must be split to fill the GPU
    big = plan(128, 1, 16, 4096, 132)
    assert big["num_splits"] <= p["num_splits"]


@pytest.mark.parametrize("B,S,H,ns,dc", [(3, 1, 5, 4, 96), (2, 4, 16, 3, 64), (1, 1, 16, 2, 512)])
def test_combine_matches_reference(B, S, H, ns, dc):
    """Stage 2: splits that saw no keys weigh nothing, and a row whose splits are all empty comes out zero
    with lse −inf."""
    g = torch.Generator().manual_seed(B * 100 + ns)
    mid_o = torch.randn(B, S, H, ns, dc, generator=g)
    mid_lse = torch.randn(B, S, H, ns, generator=g) * 4
    mid_lse[0, 0, 0, 1] = float("-inf")  # a split past its request's end (its partial is zeros, as the kernels write)
    mid_o[0, 0, 0, 1] = 0.0
    mid_lse[-1, -1, -1], mid_o[-1, -1, -1] = float("-inf"), 0.0  # a row with no keys
    got_o, got_lse = torch.full((B, S, H, dc), float("nan")), torch.full((B, S, H), float("nan"))
    want_o, want_lse = torch.empty(B, S, H, dc), torch.empty(B, S, H)
    T.combine_splits(mid_o, mid_lse, got_o, got_lse, sm_count=132)
    combine_splits_torch(mid_o, mid_lse, want_o, want_lse)
    assert torch.isfinite(got_o).all()
    assert rel_err(got_o, want_o) < 1e-5
    assert torch.allclose(got_lse, want_lse, atol=1e-5)
    assert torch.equal(got_o[-1, -1, -1], torch.zeros(dc)) and got_lse[-1, -1, -1] == float("-inf")


def test_dims_not_multiple_of_16_are_rejected():
    q, kv, table, seq = make_decode_case(1, 1, 2, 16, 40, 24, [5], torch.float32)
    with pytest.raises(ValueError, match="multiples of 16"):
        mla_decode(q, kv, table, seq, 0.1, head_dim_v=40, backend="triton")


def test_bad_shapes_raise():
    q, kv, table, seq = make_decode_case(1, 1, 2, 16, 32, 16, [5], torch.float32)
    with pytest.raises(ValueError):
        mla_decode(q[0], kv, table, seq, 0.1, backend="triton", head_dim_v=32)
    with pytest.raises(ValueError):
        mla_decode(q, kv[..., :40], table, seq, 0.1, backend="triton", head_dim_v=32)
    with pytest.raises(ValueError, match="unknown backend"):
        mla_decode(q, kv, table, seq, 0.1, backend="cuda", head_dim_v=32)
    with pytest.raises(TypeError, match="Options"):
        mla_decode(q, kv, table, seq, 0.1, head_dim_v=32, opts=dict(block_n=16))
    with pytest.raises(ValueError, match="no Hopper decode kernel"):  # no Hopper kernel runs on a CPU
        mla_decode(q, kv, table, seq, 0.1, backend="hopper", head_dim_v=32)


# ---------------------------------------------------------------- GPU -------------------------------------
GPU_GRID = list(itertools.product([1, 2, 6, 64], [1, 2, 4], [1, 3, 16, 64, 128], [True, False]))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("B,S,H,causal", GPU_GRID)
def test_gpu_bf16_full_grid(B, S, H, causal, backend):
    rng = random.Random(B * 1000 + S * 100 + H + causal)
    choices = [1, 2, 3, 63, 64, 65, 127, 200, 1000, 4095, 4096]
    lens = [rng.choice(choices) if b < 4 else rng.randint(1, 4096) for b in range(B)]
    case = make_decode_case(B, S, H, 64, 512, 64, lens, torch.bfloat16, device="cuda", seed=B + S + H)
    check(case, causal, 512, out_tol=1e-2, backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16, 128])
@pytest.mark.parametrize("dc,dr", [(256, 32), (80, 48)])
def test_gpu_page_sizes_and_odd_dims(page_size, dc, dr):
    case = make_decode_case(5, 2, 16, page_size, dc, dr, [1, 77, 300, 1025, 2000], torch.bfloat16, device="cuda")
    check(case, True, dc, out_tol=1e-2, backend="auto")
    check(case, True, dc, out_tol=1e-2, backend="triton")


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay():
    B, S, H, T = 8, 2, 16, 700
    q, kv, table, seq = make_decode_case(B, S, H, 64, 512, 64, [T] * B, torch.bfloat16, device="cuda", seed=1)
    cfg = decode.route(q, kv, table).plan
    ws = (torch.empty(B, S, H, cfg["num_splits"], 512, device="cuda"),
          torch.empty(B, S, H, cfg["num_splits"], device="cuda"))
    out = torch.empty(B, S, H, 512, dtype=torch.bfloat16, device="cuda")
    mla_decode(q, kv, table, seq, 0.0721, out=out, workspace=ws)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(q, kv, table, seq, 0.0721, out=out, workspace=ws)
    previous = None
    for step in range(3):  # new lengths and queries each replay, as a decode loop would bring
        seq.copy_(torch.randint(S, T + 1, (B,), dtype=torch.int32, device="cuda"))
        q.copy_(torch.randn_like(q))
        graph.replay()
        want = mla_decode_torch(q.double(), kv.double(), table, seq, 0.0721, head_dim_v=512)
        assert rel_err(out, want) <= 1e-2
        assert previous is None or not torch.equal(previous, out)
        previous = out.clone()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("H,S", [(4, 1), (16, 4), (128, 1), (64, 2)])
def test_gpu_default_tiles_fit_every_dtype(dtype, H, S):
    """The default tile choice must compile (shared memory) and be right for fp32/fp16/bf16 caches."""
    case = make_decode_case(3, S, H, 64, 512, 64, [S, 300, 2049], dtype, device="cuda", seed=H + S)
    check(case, True, 512, out_tol=1e-2 if dtype != torch.float32 else 1e-4, backend="auto")



# every kernel the route table can select, forced through its Options, against the fp64 reference on the
# (dequantised) cache; the e4m3 kernels round q and P to e4m3 terms, hence their wider bounds
KERNEL_CASES = [  # kernel, kv_format, B, S, H, tolerance
    ("triton", "bf16", 3, 2, 16, 1e-2), ("triton", "fp8", 3, 2, 16, 1e-2), ("triton", "fp8_ds_mla", 3, 1, 32, 1e-2),
    ("triton", "tbq4", 3, 4, 16, 1e-2), ("bf16", "bf16", 3, 1, 16, 1e-2), ("bf16", "bf16", 2, 2, 64, 1e-2),
    ("bf16_seesaw", "bf16", 3, 2, 16, 1e-2), ("bf16_seesaw", "bf16", 2, 1, 128, 1e-2),
    ("dequant", "fp8_ds_mla", 3, 1, 32, 1e-2), ("dequant", "tbq4", 3, 2, 16, 1e-2),
    ("fp8", "fp8", 3, 1, 16, 2e-2), ("fp8", "fp8_ds_mla", 3, 3, 16, 2e-2), ("tbq4", "tbq4", 3, 2, 16, 6e-2),
    ("dequant_seesaw", "fp8", 3, 4, 16, 1e-2), ("dequant_seesaw", "tbq4", 3, 1, 64, 1e-2),
    ("dequant_seesaw", "fp8_ds_mla", 2, 2, 32, 1e-2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,kv_format,B,S,H,tol", KERNEL_CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_every_kernel_matches_reference(kernel, kv_format, B, S, H, tol, causal):
    from specmla.ops.kv_cache import encode_rows

    lens = [S, 700, 4097][:B]
    q, kv, table, seq = make_decode_case(B, S, H, 64, 512, 64, lens, torch.float32, seed=B * S + H)
    flat = kv.view(-1, 576)
    cache = kv if kv_format == "bf16" else encode_rows(kv_format, flat[:, :512], flat[:, 512:]).view(*kv.shape[:2], -1)
    cache = (cache.bfloat16() if kv_format == "bf16" else cache).cuda()
    q, table, seq = q.bfloat16().cuda(), table.cuda(), seq.cuda()
    opts = decode.kernel_module(kernel).Options()
    assert decode.route(q, cache, table, kv_format=kv_format, opts=opts).kernel == kernel
    out = torch.full((B, S, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    got, got_lse = mla_decode(q, cache, table, seq, 0.0721, causal=causal, kv_format=kv_format, opts=opts,
                              out=out, return_lse=True)
    want, want_lse = mla_decode_torch(q.double().cpu(), cache.cpu(), table.cpu(), seq.cpu(), 0.0721, causal=causal,
                                      kv_format=kv_format, return_lse=True)
    assert got.data_ptr() == out.data_ptr() and not torch.isnan(got).any()
    assert rel_err(got.cpu(), want) <= tol
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(got_lse.cpu()))
    assert (got_lse.cpu()[finite].double() - want_lse[finite]).abs().max().item() <= 50 * tol


@pytest.mark.gpu
@pytest.mark.parametrize("B,S,H,T,kv_format,kernel", [
    (1, 1, 16, 8192, "bf16", "bf16"), (32, 1, 16, 32768, "bf16", "bf16_seesaw"),
    (1, 1, 128, 8192, "bf16", "bf16_seesaw"),
    (32, 1, 16, 32768, "fp8", "fp8"), (32, 1, 16, 32768, "fp8_ds_mla", "fp8"),
    (32, 4, 16, 32768, "tbq4", "dequant_seesaw"), (1, 4, 16, 4096, "tbq4", "tbq4"),
    (8, 1, 32, 16384, "fp8_ds_mla", "dequant"), (8, 1, 32, 16384, "fp8", "dequant_seesaw"),
])
def test_gpu_route_on_hopper(B, S, H, T, kv_format, kernel, monkeypatch):
    """On an H100 the real kernels' `supported` checks give the rules of the CPU test (measured routes aside)."""
    monkeypatch.setattr(decode, "_routes", lambda device: {})
    from specmla.ops.kv_cache import row_spec

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the route table is Hopper's")
    width, dtype = row_spec(kv_format, 512, 64, torch.bfloat16)
    cache = torch.zeros(B * T // 64, 64, width, dtype=dtype, device="cuda")
    table = torch.arange(B * T // 64, dtype=torch.int32, device="cuda").view(B, T // 64)
    q = torch.randn(B, S, H, 576, dtype=torch.bfloat16, device="cuda")
    assert decode.route(q, cache, table, kv_format=kv_format).kernel == kernel
