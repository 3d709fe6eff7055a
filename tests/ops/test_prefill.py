"""MLA prefill (contract C2), its Triton and Hopper kernels vs the fp64 reference: ragged batches, prefixes, empty
requests; the schedule of ragged batches' row blocks (`prefill_schedule`)."""

import pytest
import torch
from helpers.mla_cases import rel_err
from helpers.offline_compile import offline_sm90_rows

from specmla.ops.decode.hopper import common as G
from specmla.ops.prefill import hopper as P
from specmla.ops.prefill import PrefillSchedule, mla_prefill, mla_prefill_torch, prefill_schedule


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


# the Gluon kernel compiled for sm_90 without a GPU: resources within H100's limits. Stack bytes: the persistent
# loops keep tile state across tiles; Triton 3.9 gives 32 B for one request or a ragged batch and 96 B for one
# program per tile at 192 / 128 causal (the TMA output path's state)
GLUON_COMPILE_CASES = [  # (H, dqk, dv, dtype, causal[, q lengths[, Options fields]]), most stack bytes
    ([128, 192, 128, "bfloat16", True, [300]], 64),  # DeepSeek's head dims (128 + 64), one request
    ([128, 192, 128, "bfloat16", True, [100, 0, 200]], 64),  # a ragged batch: row blocks from a schedule
    ([128, 192, 128, "bfloat16", True, [100, 200], {"persistent": False}], 128),  # one program per tile
    ([16, 128, 64, "float16", False, [37, 1000]], 48),  # no tail, narrow v, fp16, not causal, ragged
    ([4, 96, 64, "bfloat16", True, [1000, 1]], 32),  # a 64 + 32 split, ragged
]


def test_hopper_prefill_compiles_for_sm90():
    cases = [case for case, _ in GLUON_COMPILE_CASES]
    rows = offline_sm90_rows(cases, "prefill")
    assert [r["case"] for r in rows] == cases
    for r, (_, stack) in zip(rows, GLUON_COMPILE_CASES):
        (use,) = r["kernels"]
        assert use["name"] == "_mla_prefill_ws_kernel", r
        # two consumer warpgroups + the producer warp's warpgroup; registers are re-split by setmaxnreg
        assert use["warps"] == 12 and 0 < use["regs"] <= 168 and use["local"] == 0 and not use["wgmma_serialized"], r
        assert use["stack"] <= stack, r
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


# ---------------------------------------------------------------------------------------------
# ragged batches on the persistent grid: the schedule of row blocks, longest first
# ---------------------------------------------------------------------------------------------
def lpt_order(q_lens, kv_lens, causal=True):
    """Plain Python: every row block (request b, query block m) longest first by the keys it attends to (bottom-
    right causal), ties in batch order."""
    blocks = []
    for b, (lq, lk) in enumerate(zip(q_lens, kv_lens)):
        for m in range(-(-lq // P.BLOCK_M)):
            end = max(0, min(lk, lk - lq + (m + 1) * P.BLOCK_M)) if causal else lk
            blocks.append((end, b, m))
    return [(b, m) for _, b, m in sorted(blocks, key=lambda x: -x[0])]


def uniform_lens(n, lo, hi, seed):
    return torch.randint(lo, hi + 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SCHEDULE_CASES = [  # q_lens, kv_lens, q rows past the last request
    ([1000, 37, 3000, 1], [1000, 37, 3000, 1], 0),
    ([0, 128, 0, 129, 256, 1, 0], [5, 128, 0, 300, 256, 1, 0], 3),  # empty requests, equal work (ties)
    ([128] * 5, [128] * 5, 0),  # every block ties: batch order
    ([1] * 5, [1] * 5, 0),  # Σ ceil(q_len / 128) at its bound (T + 127·B) // 128
    ([200, 3, 7], [0, 90, 2], 1),  # queries without keys or with fewer keys than queries (end 0)
    ([0, 0], [0, 4], 2),  # no row block at all
    (uniform_lens(40, 0, 700, 1), [n + k for n, k in zip(uniform_lens(40, 0, 700, 1), uniform_lens(40, 0, 300, 2))],
     0),
]


@pytest.mark.parametrize("case", SCHEDULE_CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_schedule_is_longest_first(case, causal):
    """`prefill_schedule` (torch ops, no host sync) lists exactly the batch's row blocks, longest first, ties in
    batch order, with their count in front; table[1] is a real request's block even with no row block (the
    kernel decodes its stop id there)."""
    q_lens, kv_lens, extra = case
    B, T = len(q_lens), sum(q_lens) + extra
    cu_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + kv_lens).cumsum(0)  # int64: the two may differ in dtype
    s = prefill_schedule(cu_q, cu_k, T, causal=causal)
    want = lpt_order(q_lens, kv_lens, causal)
    assert isinstance(s, PrefillSchedule) and s.table.dtype == torch.int32
    assert (s.num_q_tokens, s.num_requests) == (T, B)
    assert s.max_row_blocks == max(1, (T + (P.BLOCK_M - 1) * B) // P.BLOCK_M) >= len(want)
    table = s.table.tolist()
    assert table[0] == len(want)
    mask = (1 << P.ROW_SHIFT) - 1
    assert [(e >> P.ROW_SHIFT, e & mask) for e in table[1:1 + len(want)]] == want
    assert 0 <= table[1] >> P.ROW_SHIFT < B


def test_prefill_schedule_bad_input_raises():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="different batches"):
        prefill_schedule(cu, cu[:2], 5)
    with pytest.raises(ValueError, match="fewer than"):
        prefill_schedule(torch.zeros(P.MAX_REQUESTS + 1, dtype=torch.int32), torch.zeros(P.MAX_REQUESTS + 1), 0)
    with pytest.raises(ValueError, match="fewer than"):
        prefill_schedule(cu, cu, P.MAX_Q_TOKENS)
    empty = prefill_schedule(cu[:1], cu[:1], 0)  # no request
    assert empty.table.tolist() == [0, 0] and empty.num_requests == 0


RAGGED_CASES = [  # q_lens, kv_lens, H, dqk, dv, heads per group (None: `head_group`)
    (uniform_lens(16, 1, 600, 3), uniform_lens(16, 1, 600, 3), 16, 192, 128, None),  # 16 × U(1, 600)
    ([1000, 37, 3000, 1], [1000, 37, 3000, 1], 4, 192, 128, None),  # an odd mix
    ([0, 300, 0, 129, 5, 0], [0, 300, 7, 129, 5, 0], 5, 192, 128, 2),  # empty requests; heads in groups 2, 2, 1
    ([100, 1, 700, 64, 128], [400, 1000, 700, 3000, 129], 8, 192, 128, 3),  # prefixes (q_len < kv_len)
    ([200, 3, 0, 50], [0, 90, 0, 20], 3, 192, 128, None),  # queries without keys, or before any key
    (uniform_lens(256, 0, 40, 4), uniform_lens(256, 40, 100, 5), 2, 128, 64, None),  # 256 requests, no tail
]


def padded_ragged(q_lens, kv_lens, H, dqk, dv, seed, pad=5):
    """A bf16 ragged batch on the GPU whose q has `pad` rows past the last request (rows no request owns)."""
    q, k, v, cu_q, cu_k = ragged(q_lens, kv_lens, H, dqk, dv, torch.bfloat16, device="cuda", seed=seed)
    extra = torch.randn(pad, H, dqk, generator=torch.Generator().manual_seed(seed + 1)).to(q)
    return torch.cat([q, extra]), k, v, cu_q, cu_k


@pytest.mark.gpu
@pytest.mark.parametrize("case", RAGGED_CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_hopper_prefill_ragged_schedule_matches_reference(case, causal):
    """A ragged batch on the persistent grid, row blocks from its schedule longest first: the fp64 reference's
    output and lse, written exactly where the reference writes (NaN-poisoned rows past the last request stay
    NaN), what one program per tile gives, and the tile counter left at zero."""
    q_lens, kv_lens, H, dqk, dv, group = case
    q, k, v, cu_q, cu_k = padded_ragged(q_lens, kv_lens, H, dqk, dv, seed=len(q_lens) + H)
    args = (q, k, v, cu_q, cu_k, max(q_lens), max(kv_lens), 0.09)
    assert P.supported(q, k, v, 0.09)
    ref = torch.full((q.shape[0], H, dv), float("nan"), dtype=torch.float64, device="cuda")
    want, want_lse = mla_prefill_torch(*(t.double() for t in args[:3]), *args[3:], causal=causal, return_lse=True,
                                       out=ref)
    out = torch.full((q.shape[0], H, dv), float("nan"), dtype=q.dtype, device="cuda")
    opts = P.Options(heads_per_group=group)
    got, lse = P.mla_prefill_hopper(*args, causal=causal, return_lse=True, out=out, opts=opts)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(torch.isnan(got), torch.isnan(want))  # written exactly where the reference writes
    written = ~torch.isnan(want)
    assert rel_err(got[written], want[written]) <= 1e-2
    rows = int(cu_q[-1])  # lse of rows past the last request is not part of the contract
    fin = torch.isfinite(want_lse[:rows])
    assert torch.equal(fin, torch.isfinite(lse[:rows]))
    assert (lse[:rows][fin].double() - want_lse[:rows][fin]).abs().max().item() <= 1e-3
    grid, grid_lse = P.mla_prefill_hopper(*args, causal=causal, return_lse=True,
                                          opts=P.Options(persistent=False, heads_per_group=group))
    assert rel_err(got[:rows].float(), grid[:rows].float()) <= 1e-3
    assert (lse[:rows][fin] - grid_lse[:rows][fin]).abs().max().item() <= 1e-4
    assert P._tile_counter(q.device).tolist() == [0, 0]


@pytest.mark.gpu
def test_gpu_hopper_prefill_schedule_passed_or_built_agree():
    """The schedule passed explicitly (through `mla_prefill`) or built inside gives the same bits, twice in a row
    (each launch leaves its tile counter at zero for the next); the schedule built on the GPU is the one built on
    the CPU; a schedule of another batch is refused."""
    q_lens, kv_lens = [1000, 37, 3000, 1, 0, 513], [1000, 37, 3100, 1, 9, 513]
    q, k, v, cu_q, cu_k = padded_ragged(q_lens, kv_lens, 16, 192, 128, seed=11, pad=3)
    args = (q, k, v, cu_q, cu_k, max(q_lens), max(kv_lens), 0.09)
    sched = prefill_schedule(cu_q, cu_k, q.shape[0])
    assert torch.equal(sched.table.cpu(), prefill_schedule(cu_q.cpu(), cu_k.cpu(), q.shape[0]).table)
    rows = int(cu_q[-1])
    runs = [mla_prefill(*args, return_lse=True, backend="hopper", schedule=sched),
            mla_prefill(*args, return_lse=True, backend="hopper"),
            P.mla_prefill_hopper(*args, return_lse=True, schedule=sched),
            P.mla_prefill_hopper(*args, return_lse=True)]
    for got, lse in runs:
        assert torch.equal(got[:rows], runs[0][0][:rows]) and torch.equal(lse[:rows], runs[0][1][:rows])
        assert P._tile_counter(q.device).tolist() == [0, 0]
    want = mla_prefill_torch(*(t.double() for t in args[:3]), *args[3:])
    assert rel_err(runs[0][0][:rows], want[:rows]) <= 1e-2
    other = prefill_schedule(cu_q[:-1], cu_k[:-1], q.shape[0])
    with pytest.raises(ValueError, match="prefill schedule"):
        mla_prefill(*args, backend="hopper", schedule=other)


@pytest.mark.gpu
def test_gpu_model_builds_one_prefill_schedule_per_forward(monkeypatch):
    """`MLAttention._naive` builds the ragged batch's schedule once (in the metadata) and every layer reuses it;
    the layer's output on the ragged batch is what it gives request by request."""
    from specmla.config import ModelConfig
    from specmla.model import deepseek
    from specmla.model.metadata import AttentionMetadata
    from specmla.model.rope import rope_cos_sin_cache

    cfg = ModelConfig.from_dict(dict(
        vocab_size=101, hidden_size=256, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, max_position_embeddings=4096, model_type="deepseek_v3", n_routed_experts=None,
        n_shared_experts=None, num_experts_per_tok=None))
    torch.manual_seed(0)
    layer = deepseek.MLAttention(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.05) if p.dim() > 1 else p.fill_(1.0)
    layer = layer.to("cuda", torch.bfloat16).eval()
    built = []
    monkeypatch.setattr(deepseek, "prefill_schedule", lambda *a, **kw: built.append(1) or prefill_schedule(*a, **kw))
    lens = [300, 1, 77, 1000]
    cos_sin = rope_cos_sin_cache(cfg.rope, cfg.qk_rope_head_dim, 1024, device="cuda")
    x = torch.randn(sum(lens), cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    meta = AttentionMetadata.for_contiguous(lens, device="cuda")
    with torch.no_grad():
        y = layer(x, meta, cos_sin, None)
        sched = meta.prefill_schedule
        again = layer(x, meta, cos_sin, None)
        offs = [0] + torch.tensor(lens).cumsum(0).tolist()
        alone = torch.cat([layer(x[a:b], AttentionMetadata.for_contiguous([b - a], device="cuda"), cos_sin, None)
                           for a, b in zip(offs, offs[1:])])
    assert isinstance(sched, PrefillSchedule) and meta.prefill_schedule is sched and len(built) == 1
    assert torch.equal(y, again)
    assert rel_err(y.float(), alone.float()) <= 2e-2
