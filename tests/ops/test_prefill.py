"""MLA prefill (contract C2), its Triton and Hopper kernels vs the fp64 reference: ragged batches, prefixes, empty
requests."""

import pytest
import torch
from helpers.mla_cases import rel_err
from helpers.offline_compile import offline_sm90_rows

from specmla.ops.decode.hopper import common as G
from specmla.ops.prefill import hopper as P
from specmla.ops.prefill import mla_prefill, mla_prefill_torch


def ragged(q_lens, kv_lens, H, dqk, dv, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + kv_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), H, dqk, generator=g)
    k = torch.randn(sum(kv_lens), H, dqk, generator=g)
    v = torch.randn(sum(kv_lens), H, dv, generator=g)
    return [t.to(dtype).to(device) for t in (q, k, v)] + [cu_q.to(device), cu_k.to(device)]


CASES = [  # q_lens, kv_lens, H, dqk, dv
    ([5, 1, 17], [5, 1, 17], 2, 192, 128),  # plain prefill, DeepSeek head dims
    ([3, 0, 9, 1], [10, 4, 9, 70], 3, 64, 32),  # prefixes (q_len < kv_len) and an empty request
    ([33], [100], 1, 48, 24),  # odd head dims (not powers of two)
    ([70, 2], [70, 2], 4, 32, 32),  # longer than one block
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_prefill_matches_reference(case, causal, dtype):
    q_lens, kv_lens, H, dqk, dv = case
    q, k, v, cu_q, cu_k = ragged(q_lens, kv_lens, H, dqk, dv, dtype, seed=len(q_lens))
    want, want_lse = mla_prefill_torch(q.double(), k.double(), v.double(), cu_q, cu_k, max(q_lens), max(kv_lens),
                                       0.11, causal=causal, return_lse=True)
    got, got_lse = mla_prefill(q, k, v, cu_q, cu_k, max(q_lens), max(kv_lens), 0.11, causal=causal,
                               return_lse=True, backend="triton")
    assert got.dtype == dtype and not torch.isnan(got).any()
    assert rel_err(got, want) <= (1e-4 if dtype == torch.float32 else 1e-2)
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(got_lse))
    assert (got_lse[fin].double() - want_lse[fin]).abs().max() <= 1e-3


def test_bad_shapes_raise():
    q, k, v, cu_q, cu_k = ragged([3], [3], 2, 32, 16, torch.float32)
    with pytest.raises(ValueError):
        mla_prefill(q, k[:, :1], v, cu_q, cu_k, 3, 3, 0.1, backend="triton")
    with pytest.raises(ValueError, match="unknown backend"):
        mla_prefill(q, k, v, cu_q, cu_k, 3, 3, 0.1, backend="gluon")


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 128])
def test_gpu_prefill_bf16_ragged(H):
    q_lens = [1, 128, 777, 4096, 3000, 0, 2048]
    kv_lens = [1, 300, 777, 4096, 5000, 64, 8192]
    q, k, v, cu_q, cu_k = ragged(q_lens, kv_lens, H, 192, 128, torch.bfloat16, device="cuda")
    # fp32 reference on the GPU from the same bf16 values (an fp64 CPU reference at H=128 takes minutes)
    want, want_lse = mla_prefill_torch(q.float(), k.float(), v.float(), cu_q, cu_k, max(q_lens), max(kv_lens), 0.07,
                                       return_lse=True)
    got, lse = mla_prefill(q, k, v, cu_q, cu_k, max(q_lens), max(kv_lens), 0.07, return_lse=True)
    assert rel_err(got.float(), want) <= 1e-2
    assert (lse - want_lse).abs().max().item() <= 1e-3


def test_hopper_required_but_unsupported_raises():
    """backend="hopper" on a call the Hopper kernel cannot take (here: a CPU tensor) is a clear error, not a
    silent fallback."""
    q, k, v, cu_q, cu_k = ragged([3], [3], 2, 192, 128, torch.float32)
    assert not P.supported(q, k, v, 0.1)
    with pytest.raises(ValueError, match="Hopper prefill"):
        mla_prefill(q, k, v, cu_q, cu_k, 3, 3, 0.1, backend="hopper")


# the Gluon kernel compiled for sm_90 without a GPU: resources within H100's limits
GLUON_COMPILE_CASES = [  # H, dqk, dv, dtype, causal
    [128, 192, 128, "bfloat16", True],  # DeepSeek's head dims: a 128 + 64 split of q·k
    [16, 128, 64, "float16", False],  # no tail, narrow v, fp16, not causal
    [4, 96, 64, "bfloat16", True],  # a 64 + 32 split
]
GLUON_STACK_BYTES = 32  # 24 B with Triton 3.6 (the GPU machine's), 0 B with 3.9 at 192 / 128 causal


def test_hopper_prefill_compiles_for_sm90():
    rows = offline_sm90_rows(GLUON_COMPILE_CASES, "prefill")
    assert [r["case"] for r in rows] == GLUON_COMPILE_CASES
    for r in rows:
        (use,) = r["kernels"]
        assert use["name"] == "_mla_prefill_ws_kernel", r
        # two consumer warpgroups + the producer warp's warpgroup; registers are re-split by setmaxnreg
        assert use["warps"] == 12 and 0 < use["regs"] <= 168 and use["local"] == 0, r
        assert use["stack"] <= GLUON_STACK_BYTES, r
        assert 0 < use["shared"] <= 227 * 1024, r


def test_hopper_prefill_descriptor_equals_checked_construction():
    """`hopper._descriptor` builds the TMA descriptor without TensorDescriptor's checks (host time); it must hold
    exactly what the checked constructor holds, in this Triton version's fields."""
    if not G.HAVE_GLUON:
        pytest.fail("this Triton has no Gluon")
    t = torch.randn(37, 3, 192, dtype=torch.float16)
    for rows, width in ((128, 128), (128, 64), (64, 16)):
        fast = P._descriptor(t, rows, width)
        layout = G._smem_layout((rows, width), t.dtype)
        checked = P.TensorDescriptor(t, [37, 3 * 192], [192 * 3, 1], [rows, width], layout)
        assert vars(fast).keys() == vars(checked).keys()
        for name, value in vars(checked).items():
            assert (getattr(fast, name) is value) if name == "base" else getattr(fast, name) == value, name


GLUON_CASES = [  # q_lens, kv_lens, H, dqk, dv
    ([1, 128, 777, 2048, 300, 0, 129], [1, 300, 777, 2048, 5000, 64, 129], 16, 192, 128),  # prefixes, empty, odd
    ([1000, 5, 64], [1000, 5, 64], 128, 192, 128),  # H=128
    ([200, 3, 0], [0, 90, 0], 3, 192, 128),  # a request with queries but no keys: zeros, lse -inf
    ([333, 17], [400, 17], 5, 128, 128),  # no tail
    ([250, 1], [513, 7], 2, 96, 64),  # 64 + 32
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GLUON_CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_hopper_prefill_matches_reference(case, causal):
    q_lens, kv_lens, H, dqk, dv = case
    q, k, v, cu_q, cu_k = ragged(q_lens, kv_lens, H, dqk, dv, torch.bfloat16, device="cuda", seed=H)
    assert P.supported(q, k, v, 0.09)
    want, want_lse = mla_prefill_torch(q.double(), k.double(), v.double(), cu_q, cu_k, max(q_lens), max(kv_lens), 0.09,
                                       causal=causal, return_lse=True)
    out = torch.full((q.shape[0], H, dv), float("nan"), dtype=q.dtype, device="cuda")  # every row is written
    got, lse = mla_prefill(q, k, v, cu_q, cu_k, max(q_lens), max(kv_lens), 0.09, causal=causal, return_lse=True,
                           out=out, backend="hopper")
    assert got.data_ptr() == out.data_ptr() and not torch.isnan(got).any()
    assert rel_err(got.double(), want) <= 1e-2
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse[fin].double() - want_lse[fin]).abs().max().item() <= 1e-3
    # the Triton kernel on the same call agrees too (the two paths the engine may take)
    tri = mla_prefill(q, k, v, cu_q, cu_k, max(q_lens), max(kv_lens), 0.09, causal=causal, backend="triton")
    assert rel_err(got.float(), tri.float()) <= 1e-2


PERSISTENT_CASES = GLUON_CASES + [  # one request: the default for the persistent grid
    ([4097], [4097], 16, 192, 128),  # 33 × 16 tiles: some programs run several
    ([1500], [1500], 128, 192, 128),  # 12 × 128 tiles: every program runs several, claimed at run time
    ([300], [1000], 8, 192, 128),  # a prefix
    ([1], [1], 1, 192, 128),  # one tile
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", PERSISTENT_CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_hopper_prefill_persistent_grid_agrees(case, causal):
    """The persistent grid (programs claim tiles from a counter, K/V rings and barrier phases run on across
    tiles) gives what one program per tile gives and what the fp64 reference gives, on ragged batches too
    (tiles of empty or short requests are skipped); it leaves its tile counter at zero for the next call."""
    q_lens, kv_lens, H, dqk, dv = case
    q, k, v, cu_q, cu_k = ragged(q_lens, kv_lens, H, dqk, dv, torch.bfloat16, device="cuda", seed=H + 1)
    args = (q, k, v, cu_q, cu_k, max(q_lens), max(kv_lens), 0.09)
    want, want_lse = mla_prefill_torch(*(t.double() for t in args[:3]), *args[3:], causal=causal, return_lse=True)
    for reverse in (False, True):  # the second call finds the counter the first left; key blocks either way
        grid, grid_lse = P.mla_prefill_hopper(*args, causal=causal, return_lse=True,
                                              opts=P.Options(persistent=False, reverse=reverse))
        got, lse = P.mla_prefill_hopper(*args, causal=causal, return_lse=True,
                                        opts=P.Options(persistent=True, reverse=reverse))
        err, err_grid = rel_err(got.double(), want), rel_err(got.float(), grid.float())
        fin = torch.isfinite(want_lse)
        assert torch.equal(fin, torch.isfinite(lse)) and torch.equal(fin, torch.isfinite(grid_lse))
        lse_err = (lse[fin].double() - want_lse[fin]).abs().max().item()
        lse_grid = (lse[fin] - grid_lse[fin]).abs().max().item()
        # tile by tile the two grids do the same arithmetic: they agree to rounding
        assert err <= 1e-2 and lse_err <= 1e-3 and err_grid <= 1e-3 and lse_grid <= 1e-4, \
            (reverse, err, err_grid, lse_err, lse_grid)
        assert P._tile_counter(q.device).tolist() == [0, 0]


@pytest.mark.gpu
def test_gpu_hopper_prefill_persistent_streams_keep_their_own_counter():
    """Two persistent launches that may overlap (two streams) claim tiles from counters of their own."""
    q, k, v, cu_q, cu_k = ragged([2000], [2000], 32, 192, 128, torch.bfloat16, device="cuda", seed=5)
    q2, k2, v2 = (t.flip(0).contiguous() for t in (q, k, v))
    grid, persistent = P.Options(persistent=False), P.Options(persistent=True)
    want = P.mla_prefill_hopper(q, k, v, cu_q, cu_k, 2000, 2000, 0.09, opts=grid)
    want2 = P.mla_prefill_hopper(q2, k2, v2, cu_q, cu_k, 2000, 2000, 0.09, opts=grid)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    for _ in range(3):
        got = P.mla_prefill_hopper(q, k, v, cu_q, cu_k, 2000, 2000, 0.09, opts=persistent)
        with torch.cuda.stream(side):
            got2 = P.mla_prefill_hopper(q2, k2, v2, cu_q, cu_k, 2000, 2000, 0.09, opts=persistent)
        torch.cuda.synchronize()
        assert rel_err(got.float(), want.float()) <= 1e-3 and rel_err(got2.float(), want2.float()) <= 1e-3
    with torch.cuda.stream(side):
        side_counter = P._tile_counter(q.device)
    assert P._tile_counter(q.device) is not side_counter


@pytest.mark.gpu
def test_gpu_hopper_prefill_direct_launch_respecialises():
    """Later calls of a compiled specialisation go straight to its launcher (`hopper._launch`) and
    give the same answers as the first; calls that Triton specialises differently (H = 1, cu_seqlens at an
    address that is not 16-byte aligned, another head count) compile and keep their own kernel."""
    assert P.Options().fast_launch
    P._COMPILED.clear()
    for H, unaligned in ((16, False), (1, False), (16, True), (3, False), (16, False), (1, True)):
        q, k, v, cu_q, cu_k = ragged([300, 77], [300, 200], H, 192, 128, torch.bfloat16, device="cuda", seed=H)
        if unaligned:  # the same offsets one int32 past a 16-byte boundary
            cu_q, cu_k = (torch.cat([c.new_zeros(1), c])[1:] for c in (cu_q, cu_k))
            assert cu_q.data_ptr() % 16 and cu_k.data_ptr() % 16
        want = mla_prefill_torch(q.double(), k.double(), v.double(), cu_q, cu_k, 300, 300, 0.09, causal=True)
        first = P.mla_prefill_hopper(q, k, v, cu_q, cu_k, 300, 300, 0.09)
        again = P.mla_prefill_hopper(q, k, v, cu_q, cu_k, 300, 300, 0.09)
        assert rel_err(first.double(), want) <= 1e-2
        assert torch.equal(first, again)
    assert len(P._COMPILED) == 5  # (16), (1), (16, unaligned), (3), (1, unaligned)
