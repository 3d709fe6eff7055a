"""The fused MoE (`fused_moe`, contract C6), its pair alignment and the router (`moe_route`) against their
torch references and a float64 loop: on CPU in the Triton interpreter (fp32 / fp16, odd shapes, NaN-poisoned
unused memory, expert-parallel ids, bad input), on the GPU in bf16 at model shapes (CUDA graphs, no host sync)."""

import math

import pytest
import torch
from helpers.moe_cases import fro_err, make_moe_case, moe_oracle, random_ids, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

import specmla.ops.moe as moe_ops
import specmla.ops.moe.route as route_mod
from specmla.ops import fused_moe, fused_moe_torch, moe_route, moe_route_torch
from specmla.ops.moe import RouteSpec, moe_route_triton
from specmla.ops.linear.reference import weight_dequant
import specmla.ops.moe.triton as moe_triton
from specmla.ops.moe.triton import MAX_EXPERT_SLOTS, align_pairs, align_pairs_torch, fused_moe_triton, max_blocks
import specmla.ops.moe.tuning as moe_tuning
from specmla.ops.moe.tuning import Config
from specmla.ops.scratch import zeroed_scratch

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOL = {F32: 1e-5, F16: 3e-3}


def snapshot(tensors):
    return [t.clone() for t in tensors]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and values, NaN where the other has NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.double(), b.double()
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def unchanged(tensors, copies) -> bool:
    return all(same_bits(t, c) for t, c in zip(tensors, copies))


# ---- fused_moe on CPU (interpreter) -------------------------------------------------------------------
# T, E, k, H, I, Is (None: no shared experts), dtype. T = 1 takes the pair-per-block path, T > 1 the aligned one.
CASES = [
    (1, 7, 1, 40, 24, None, F32),
    (1, 66, 8, 33, 24, 48, F16),  # Is = 2I: two shared pseudo-experts
    (1, 7, 4, 24, 33, 41, F32),  # Is = I + 8: the second pseudo-expert is 8 wide
    (3, 7, 3, 40, 33, 20, F16),  # Is < I
    (3, 66, 5, 33, 24, 24, F32),  # Is = I
    (17, 7, 7, 40, 24, 32, F16),  # k = E; Is = I + 8
    (17, 66, 6, 24, 40, 80, F32),
    (127, 66, 8, 33, 24, 48, F16),
    (127, 7, 2, 40, 33, None, F32),
    (127, 7, 4, 64, 64, 128, F32),  # H, I and Is multiples of the K tiles: K loops without masks
]


def case_id(c):
    T, E, k, H, I, Is, dtype = c
    return f"T{T}-E{E}-k{k}-H{H}-I{I}-Is{Is}-{str(dtype)[6:]}"


@pytest.mark.parametrize("T,E,k,H,I,Is,dtype", CASES, ids=[case_id(c) for c in CASES])
def test_triton_matches_reference_and_float64_loop(T, E, k, H, I, Is, dtype):
    case = make_moe_case(T, E, k, H, I, Is, dtype, seed=T * 1000 + E * 10 + k)
    before = snapshot(case.tensors())
    got = fused_moe(*case.args, shared=case.shared, backend="triton")
    assert got.dtype == dtype and got.shape == (T, H)
    assert unchanged(case.tensors(), before)
    want = fused_moe_torch(*case.args, shared=case.shared)
    oracle = moe_oracle(*case.args, shared=case.shared)
    assert rel_err(want, oracle) <= TOL[dtype]  # the reference itself against the float64 loop
    assert rel_err(got, oracle) <= TOL[dtype]
    assert rel_err(got, want) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("Is", [None, 24])
def test_empty_batch(dtype, Is):
    case = make_moe_case(0, 7, 2, 40, 24, Is, dtype)
    for backend in ("triton", "torch"):
        got = fused_moe(*case.args, shared=case.shared, backend=backend)
        assert got.shape == (0, 40) and got.dtype == dtype
        out = torch.empty(0, 40, dtype=dtype)
        assert fused_moe(*case.args, shared=case.shared, out=out, backend=backend) is out


def test_repeated_ids_in_a_token_add_up():
    """The contract sums over slots: an expert named twice in a token counts twice (both kernel paths)."""
    for T in (1, 6):
        case = make_moe_case(T, 5, 4, 40, 24, 24, F32, seed=T)
        case.topk_ids[:, 1] = case.topk_ids[:, 0]
        case.topk_ids[:, 3] = case.topk_ids[:, 0]
        oracle = moe_oracle(*case.args, shared=case.shared)
        assert rel_err(fused_moe(*case.args, shared=case.shared, backend="triton"), oracle) <= 1e-5
        assert rel_err(fused_moe_torch(*case.args, shared=case.shared), oracle) <= 1e-5


@pytest.mark.parametrize("up,down", [
    (Config(16, 16, 16, 1), Config(16, 16, 16, 1)),
    (Config(32, 32, 32, 2), Config(32, 64, 16, 4)),
    (Config(64, 64, 64, 8), Config(64, 16, 32, 1)),
    (Config(128, 32, 64, 8), Config(128, 64, 32, 8)),
])
def test_tile_configurations(up, down):
    """Any valid tile configuration gives the same result: H = 64 and I = 48 are multiples of some tiles and not
    of others; Is = I + 8 leaves a narrow shared pseudo-expert."""
    case = make_moe_case(40, 7, 3, 64, 48, 56, F32, seed=5)
    oracle = moe_oracle(*case.args, shared=case.shared)
    got = fused_moe_triton(*case.args, shared=case.shared, up_config=up, down_config=down)
    assert rel_err(got, oracle) <= 1e-5


def test_tile_configurations_must_share_block_m():
    case = make_moe_case(8, 7, 3, 40, 24, None, F32)
    with pytest.raises(ValueError, match="block_m"):
        fused_moe_triton(*case.args, up_config=Config(16, 16, 16), down_config=Config(32, 16, 16))


# ---- weight tiles through tensor descriptors (weights_tma) --------------------------------------------------
# T, E, k, H, I, Is, dtype, up, down: N tiles that do not divide I or H run past an expert's rows (into its up rows,
# the next expert, or past the tensor: zeros), K tiles that do not divide H or I run past the row (zeros), and
# Is = 2I + 8 (or I + 8) leaves a narrow last shared pseudo-expert whose K range stops inside the shared weights.
TMA_CASES = [
    (1, 7, 4, 24, 32, 40, F32, None, None),  # one pair per block
    (17, 7, 7, 40, 24, 32, F16, Config(16, 32, 32, 1), Config(16, 32, 16, 1)),
    (40, 9, 3, 72, 40, 88, F32, Config(32, 64, 32, 2), Config(32, 64, 32, 4)),
    (127, 66, 8, 32, 24, 48, F16, Config(64, 16, 16, 8), Config(64, 16, 16, 8)),
    (33, 9, 3, 64, 64, None, F32, Config(16, 64, 64, 1), Config(16, 64, 64, 1)),
]


@pytest.mark.parametrize("T,E,k,H,I,Is,dtype,up,down", TMA_CASES, ids=[case_id(c[:7]) for c in TMA_CASES])
def test_weight_descriptors_match_pointer_loads(T, E, k, H, I, Is, dtype, up, down, monkeypatch):
    case = make_moe_case(T, E, k, H, I, Is, dtype, seed=T + E)
    before = snapshot(case.tensors())
    tiles = dict(up_config=up, down_config=down)
    got = fused_moe_triton(*case.args, shared=case.shared, weights_tma=True, **tiles)
    assert unchanged(case.tensors(), before)
    plain = fused_moe_triton(*case.args, shared=case.shared, weights_tma=False, **tiles)
    oracle = moe_oracle(*case.args, shared=case.shared)
    assert rel_err(got, oracle) <= TOL[dtype]
    assert rel_err(got, plain) <= TOL[dtype]
    # each launch keeps to its slots: with the shared launch first, a routed launch that also ran the shared blocks
    # (through the routed descriptor) would overwrite their rows
    passes = moe_triton._gemm_passes
    monkeypatch.setattr(moe_triton, "_gemm_passes", lambda *a: passes(*a)[::-1])
    assert torch.equal(fused_moe_triton(*case.args, shared=case.shared, weights_tma=True, **tiles), got)


@pytest.mark.parametrize("dtype", [F32, F16])
def test_weight_descriptors_never_use_unused_experts(dtype):
    """Every expert but 2 and 5 is NaN and the down tiles (16 columns of H = 40) run past each expert into the next
    one: the columns that reach a NaN expert are never stored, so the result is finite and right."""
    T, E, k, H, I, Is = 24, 8, 2, 40, 24, 32
    case = make_moe_case(T, E, k, H, I, Is, dtype, seed=3)
    chosen = torch.tensor([2, 5])
    case.topk_ids = chosen[random_ids(T, 2, k, torch.Generator().manual_seed(3))]
    oracle = moe_oracle(*case.args, shared=case.shared)
    unused = torch.ones(E, dtype=torch.bool)
    unused[chosen] = False
    case.w_gate_up[unused], case.w_down[unused] = float("nan"), float("nan")
    got = fused_moe_triton(*case.args, shared=case.shared, weights_tma=True,
                           up_config=Config(16, 16, 16, 1), down_config=Config(16, 16, 16, 1))
    assert torch.isfinite(got).all()
    assert rel_err(got, oracle) <= TOL[dtype]


@pytest.mark.parametrize("what", ["routed base", "shared base", "H rows", "Is rows", "strided out"])
def test_weight_descriptors_need_aligned_weights(what):
    """Descriptors need 16-byte aligned bases and rows: asked for where they cannot be built (a base 20 bytes off,
    fp16 rows of 72 or 40 bytes), a clear error that writes nothing; also through a strided `out`."""
    H, Is, dtype = (36, 24, F16) if what == "H rows" else (40, 20, F16) if what == "Is rows" else (40, 24, F32)
    case = make_moe_case(9, 7, 3, H, 24, Is, dtype, seed=1)
    wgu, shared = case.w_gate_up, case.shared
    if what in ("routed base", "strided out"):
        wgu = embedded(wgu, 5, float("nan"))
    if what == "shared base":
        shared = (embedded(shared[0], 5, float("nan")), shared[1])
    out = torch.full((H, 9), 7.0, dtype=dtype).T if what == "strided out" else torch.full((9, H), 7.0, dtype=dtype)
    with pytest.raises(ValueError, match="weights_tma"):
        fused_moe_triton(case.x, wgu, case.w_down, case.topk_weights, case.topk_ids, shared=shared, out=out,
                         weights_tma=True)
    assert (out == 7.0).all()


def test_weight_descriptors_are_preferred_for_wide_16_bit_blocks():
    assert moe_triton.prefers_weight_tma(64, BF16) and moe_triton.prefers_weight_tma(128, F16)
    assert not moe_triton.prefers_weight_tma(32, BF16)  # decode-sized blocks keep pointer loads
    assert not moe_triton.prefers_weight_tma(128, F32)
    case = make_moe_case(9, 7, 3, 40, 24, 24, BF16, seed=1)
    assert not moe_triton.weights_tma_rule(case.x, 128, case.w_gate_up, case.w_down, *case.shared)  # on the CPU


# ---- expert parallelism: ids outside [0, E) -------------------------------------------------------------
def ep_ids(T, E, k, g, dtype):
    """The local ids of rank 1 of 3 (global ids minus E: many are negative or ≥ E), plus -1 and extreme values."""
    ids = random_ids(T, 3 * E, k, g) - E
    ids[0, 0] = -1
    ids[0, 1] = 2  # at least one local expert
    ids[-1, -1] = 2**31 - 1 if dtype == torch.int32 else 2**32 + 1  # the latter's low 32 bits would be a valid id
    ids[T // 2, k // 2] = -(2**31) if dtype == torch.int32 else -(2**32) + 2
    return ids.to(dtype)


@pytest.mark.parametrize("T,Is,ids_dtype,dtype", [
    (1, 32, torch.int64, F32), (1, None, torch.int32, F16), (9, 32, torch.int32, F32), (40, None, torch.int64, F16),
])
def test_ids_outside_the_local_experts_add_nothing(T, Is, ids_dtype, dtype):
    """Slots whose id is outside [0, E) contribute nothing, whatever their weight (NaN here): the result equals
    the reference with those slots dropped (weight 0 on a valid id)."""
    E, k, H, I = 7, 4, 40, 24
    case = make_moe_case(T, E, k, H, I, Is, dtype, seed=T)
    case.topk_ids = ep_ids(T, E, k, torch.Generator().manual_seed(T), ids_dtype)
    valid = (case.topk_ids >= 0) & (case.topk_ids < E)
    assert valid.any() and (~valid).any()
    dropped_ids = torch.where(valid, case.topk_ids, 0)
    dropped_wts = torch.where(valid, case.topk_weights, 0.0)
    want = fused_moe_torch(case.x, case.w_gate_up, case.w_down, dropped_wts, dropped_ids, shared=case.shared)
    oracle = moe_oracle(*case.args, shared=case.shared)
    case.topk_weights = torch.where(valid, case.topk_weights, float("nan"))
    got = fused_moe(*case.args, shared=case.shared, backend="triton")
    assert rel_err(got, oracle) <= TOL[dtype]
    assert rel_err(got, want) <= TOL[dtype]
    assert rel_err(fused_moe_torch(*case.args, shared=case.shared), want) <= TOL[dtype]


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("Is", [None, 24, 33])
def test_tokens_without_a_local_expert(T, Is):
    """A token whose ids are all outside [0, E) gets just the shared experts, or exactly zero without them."""
    E, k, H, I = 7, 3, 40, 24
    case = make_moe_case(T, E, k, H, I, Is, F32, seed=Is or 0)
    outside = torch.tensor([-1, E, -5, 3 * E])
    case.topk_ids[0] = outside[:k]
    case.topk_ids[-1] = outside[1:k + 1]
    for backend in ("triton", "torch"):
        got = fused_moe(*case.args, shared=case.shared, backend=backend)
        if Is is None:
            assert torch.equal(got[0], torch.zeros(H)) and torch.equal(got[-1], torch.zeros(H))
        else:
            shared_only = moe_oracle(case.x, case.w_gate_up, case.w_down, case.topk_weights,
                                     torch.full_like(case.topk_ids, -1), shared=case.shared)
            assert rel_err(got[[0, -1]], shared_only[[0, -1]]) <= 1e-5
        if T > 2:
            assert rel_err(got, moe_oracle(*case.args, shared=case.shared)) <= 1e-5


# ---- NaN-poisoned memory ----------------------------------------------------------------------------------
def padded(t: torch.Tensor, extra: tuple, fill) -> torch.Tensor:
    """A view of t inside a larger tensor whose other elements are `fill` (the last dimension stays contiguous)."""
    big = torch.full([n + e for n, e in zip(t.shape, extra)], fill, dtype=t.dtype)
    view = big[tuple(slice(0, n) for n in t.shape)]
    view.copy_(t)
    return view


@pytest.mark.parametrize("T,dtype", [(1, F32), (6, F16), (33, F32)])
def test_unused_experts_and_padding_are_never_read(T, dtype):
    """Experts no token chose are NaN, every input is a strided view into NaN-padded storage (padding ids name a
    NaN expert) and `out` is a NaN-filled view: the result is finite, equals the reference on clean weights, fills
    all of `out` (the object returned), and leaves the padding around it alone."""
    E, k, H, I, Is = 9, 2, 40, 24, 32
    case = make_moe_case(T, E, k, H, I, Is, dtype, seed=T)
    chosen = torch.tensor([1, 4, 6])
    case.topk_ids = chosen[random_ids(T, 3, k, torch.Generator().manual_seed(T))]
    want = fused_moe_torch(*case.args, shared=case.shared)
    oracle = moe_oracle(*case.args, shared=case.shared)
    unused = torch.ones(E, dtype=torch.bool)
    unused[chosen] = False
    nan = float("nan")
    wgu, wd = case.w_gate_up.clone(), case.w_down.clone()
    wgu[unused], wd[unused] = nan, nan
    x = padded(case.x, (2, 5), nan)
    wgu = embedded(wgu, 37, nan)  # the kernels take contiguous weights: NaN before and after them
    wd = embedded(wd, 11, nan)
    wts = padded(case.topk_weights, (1, 3), nan)
    ids = padded(case.topk_ids, (1, 3), 0)  # expert 0 is NaN
    shared = (embedded(case.shared[0], 5, nan), embedded(case.shared[1], 8, nan))
    for backend in ("triton", "torch"):
        out = padded(torch.empty(T, H, dtype=dtype), (3, 6), nan)
        got = fused_moe(x, wgu, wd, wts, ids, shared=shared, out=out, backend=backend)
        assert got is out
        assert torch.isfinite(out).all()
        assert out._base.isnan().sum() == out._base.numel() - T * H  # the padding is untouched
        assert rel_err(out, want) <= TOL[dtype] and rel_err(out, oracle) <= TOL[dtype]


def embedded(t, pad, fill):
    """A contiguous copy of t inside a larger buffer of `fill` (pad elements on each side)."""
    buf = torch.full((t.numel() + 2 * pad,), fill, dtype=t.dtype)
    view = buf[pad:pad + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def test_strided_weights_are_a_clear_error():
    case = make_moe_case(3, 7, 2, 40, 24, 24, F16, seed=1)
    wgu = padded(case.w_gate_up, (1, 3, 7), float("nan"))
    with pytest.raises(ValueError, match="contiguous"):
        fused_moe(case.x, wgu, case.w_down, case.topk_weights, case.topk_ids, backend="triton")


def test_out_is_overwritten_not_accumulated():
    for T in (1, 12):
        case = make_moe_case(T, 7, 3, 40, 24, 24, F16, seed=T)
        want = fused_moe_torch(*case.args, shared=case.shared)
        out = torch.full((T, 40), float("nan"), dtype=F16)
        for _ in range(2):
            assert fused_moe(*case.args, shared=case.shared, out=out, backend="triton") is out
            assert rel_err(out, want) <= 3e-3


# ---- the residual added in the top-k sum ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("Is", [None, 24])
@pytest.mark.parametrize("T", [1, 5, 33])
def test_residual_is_added_in_the_sum(T, Is, dtype):
    """residual: out = residual + the MoE (a decoder layer's x + mlp(normed)), as the reference (the residual in its
    fp32 sum, one rounding) and the float64 loop; into a new tensor, a NaN-filled out, a strided out, and out =
    residual itself (the residual stream updated in place); a strided residual is read right; a zero residual
    changes no bit."""
    E, k, H, I = 7, 3, 40, 24
    case = make_moe_case(T, E, k, H, I, Is, dtype, seed=T + (Is or 0))
    residual = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(dtype)
    before = snapshot([*case.tensors(), residual])
    want = fused_moe_torch(*case.args, shared=case.shared, residual=residual)
    oracle = moe_oracle(*case.args, shared=case.shared) + residual.double()
    assert rel_err(want, oracle) <= TOL[dtype]
    got = fused_moe(*case.args, shared=case.shared, residual=residual, backend="triton")
    assert unchanged([*case.tensors(), residual], before)
    assert got.dtype == dtype and got.shape == (T, H)
    assert rel_err(got, want) <= TOL[dtype] and rel_err(got, oracle) <= TOL[dtype]
    assert rel_err(got, fused_moe_torch(*case.args, shared=case.shared)) > 0.1  # the residual is really there
    nan = float("nan")
    for backend in ("triton", "torch"):
        out = padded(torch.empty(T, H, dtype=dtype), (2, 3), nan)
        assert fused_moe(*case.args, shared=case.shared, residual=residual, out=out, backend=backend) is out
        assert torch.isfinite(out).all() and out._base.isnan().sum() == out._base.numel() - T * H
        assert rel_err(out, want) <= TOL[dtype]
        strided = torch.full((H, T), nan, dtype=dtype).t()  # [T, H] with H strided: through a temporary
        assert fused_moe(*case.args, shared=case.shared, residual=residual, out=strided, backend=backend) is strided
        assert rel_err(strided, want) <= TOL[dtype]
        in_place = residual.clone()
        assert fused_moe(*case.args, shared=case.shared, residual=in_place, out=in_place, backend=backend) is in_place
        assert rel_err(in_place, want) <= TOL[dtype]
    strided_res = torch.full((H, T), nan, dtype=dtype).t()
    strided_res.copy_(residual)
    assert rel_err(fused_moe(*case.args, shared=case.shared, residual=strided_res, backend="triton"), want) \
        <= TOL[dtype]
    zero = fused_moe(*case.args, shared=case.shared, residual=torch.zeros_like(residual), backend="triton")
    assert torch.equal(zero, fused_moe(*case.args, shared=case.shared, backend="triton"))


def test_residual_of_another_shape_or_dtype_is_a_clear_error():
    case = make_moe_case(4, 7, 2, 40, 24, 24, F32, seed=1)
    for bad in (torch.randn(4, 41), torch.randn(5, 40), torch.randn(40), torch.randn(4, 40, dtype=F16)):
        with pytest.raises(ValueError, match=r"\bresidual must"):
            fused_moe_triton(*case.args, shared=case.shared, residual=bad)


# ---- the pair alignment -----------------------------------------------------------------------------------
def pair_expert(ids: torch.Tensor, E: int, n_shared: int) -> list:
    """Expert slot of each pair t·S + j (E + c for shared slot c), or None for an id outside [0, E)."""
    T, k = ids.shape
    out = []
    for t in range(T):
        out += [e if 0 <= e < E else None for e in ids[t].tolist()] + [E + c for c in range(n_shared)]
    return out


@pytest.mark.parametrize("T,E,k,n_shared,block_m,invalid", [
    (1, 7, 3, 0, 16, False),
    (5, 7, 3, 2, 16, True),
    (9, 3, 2, 0, 64, False),
    (40, 66, 8, 1, 16, True),
    (100, 5, 2, 1, 16, False),  # several blocks per expert
    (127, 66, 6, 2, 64, True),  # P = 1016 pairs: many chunks of the align loop
])
def test_align_pairs(T, E, k, n_shared, block_m, invalid):
    g = torch.Generator().manual_seed(T + E)
    lo, hi = (-E, 2 * E) if invalid else (0, E)
    ids = torch.randint(lo, hi, (T, k), generator=g)  # repeats within a token included
    if invalid:
        ids[0, 0], ids[-1, -1] = 2**32 + 1, -(2**31)  # outside [0, E) in int64, inside it if cut to int32
    P = T * (k + n_shared)
    sorted_pairs, block_expert = align_pairs(ids, E, n_shared, block_m)
    want_pairs, want_blocks = align_pairs_torch(ids, E, n_shared, block_m)
    assert block_expert.shape == want_blocks.shape and torch.equal(block_expert, want_blocks)
    nb = int((block_expert >= 0).sum())
    assert nb <= max_blocks(P, E + n_shared, block_m) == block_expert.numel()
    assert sorted_pairs.numel() >= nb * block_m
    # pairs of a run in any order (each row's result does not depend on it): compare runs as sets
    got_runs, want_runs = {}, {}
    for b in range(nb):
        e = block_expert[b].item()
        got_runs.setdefault(e, []).extend(sorted_pairs[b * block_m:(b + 1) * block_m].tolist())
        want_runs.setdefault(e, []).extend(want_pairs[b * block_m:(b + 1) * block_m].tolist())
    assert {e: sorted(r) for e, r in got_runs.items()} == {e: sorted(r) for e, r in want_runs.items()}
    # the properties themselves
    assert (block_expert[:nb] >= 0).all() and (block_expert[nb:] == -1).all()
    assert (block_expert[:nb].diff() >= 0).all()
    experts = pair_expert(ids, E, n_shared)
    rows = sorted_pairs[: nb * block_m].view(nb, block_m).tolist()
    seen = []
    for b, row in enumerate(rows):
        real = [p for p in row if p != P]
        assert all(0 <= p < P for p in real)
        assert row == real + [P] * (block_m - len(real))  # padding only at the end of a block
        assert all(experts[p] == block_expert[b].item() for p in real)
        seen += real
    assert sorted(seen) == [p for p, e in enumerate(experts) if e is not None]  # every valid pair exactly once
    for e in set(x for x in experts if x is not None):  # the fewest blocks per expert
        n = sum(x == e for x in experts)
        assert (block_expert == e).sum().item() == math.ceil(n / block_m)


def test_align_pairs_without_pairs():
    ids = torch.empty(0, 3, dtype=torch.int64)
    _, block_expert = align_pairs(ids, 7, 1, 16)
    assert (block_expert == -1).all()


@given(counts=st.lists(st.integers(0, 300), min_size=1, max_size=80), dropped=st.integers(0, 50),
       block_m=st.sampled_from([16, 32, 64, 128]))
@settings(max_examples=200, deadline=None)
def test_max_blocks_bounds_every_distribution(counts, dropped, block_m):
    """Σ_e ⌈n_e / block_m⌉ ≤ max_blocks(P, slots, block_m) for any split of at most P pairs over the slots."""
    need = sum(math.ceil(n / block_m) for n in counts)
    assert need <= max_blocks(sum(counts) + dropped, len(counts), block_m)


# ---- the router -------------------------------------------------------------------------------------------
ROUTES = {  # top-k 1..8 across the rules
    "v2_greedy": RouteSpec(top_k=6, method="greedy", v2=True),
    "v2_greedy_norm": RouteSpec(top_k=2, method="greedy", norm_topk_prob=True, v2=True),
    "v2_top1_norm": RouteSpec(top_k=1, method="greedy", norm_topk_prob=True, scaling=2.0, v2=True),
    "v2_group_limited": RouteSpec(top_k=3, n_group=4, topk_group=2, method="group_limited_greedy", scaling=16.0,
                                  v2=True),
    "v2_group_limited_norm": RouteSpec(top_k=7, n_group=4, topk_group=3, method="group_limited_greedy",
                                       norm_topk_prob=True, v2=True),
    "v3_noaux": RouteSpec(top_k=8, n_group=4, topk_group=2, method="noaux_tc", sigmoid=True, norm_topk_prob=True,
                          scaling=2.5),
    "v3_noaux_unnormalised": RouteSpec(top_k=4, n_group=2, topk_group=1, method="noaux_tc", sigmoid=True,
                                       scaling=1.5),
    "v3_one_group_top5": RouteSpec(top_k=5, method="noaux_tc", sigmoid=True, norm_topk_prob=True, scaling=2.5),
}


def sorted_route(weights, ids):
    """Expert order within a token is not part of the contract: sort each token's slots by expert id."""
    order = ids.argsort(dim=1)
    return weights.gather(1, order), ids.gather(1, order)


def route_case(T, E, H, dtype, spec, seed, device="cpu", w_dtype=None):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, H, generator=g, device=device).to(dtype)
    w = (torch.randn(E, H, generator=g, device=device) / H ** 0.5 * 2).to(w_dtype or dtype)
    bias = torch.randn(E, generator=g, device=device) * 0.1 if spec.method == "noaux_tc" else None
    return x, w, bias


@pytest.mark.parametrize("name", list(ROUTES))
@pytest.mark.parametrize("T,E,H", [(1, 20, 40), (5, 40, 33), (17, 20, 33)])  # 17 tokens: two 16-token blocks
@pytest.mark.parametrize("dtype", [F32, F16])
def test_route_matches_reference(name, T, E, H, dtype):
    spec = ROUTES[name]
    x, w, bias = route_case(T, E, H, dtype, spec, seed=T * 100 + E)
    want_w, want_i = moe_route_torch(x, w, bias, spec)
    got_w, got_i = moe_route_triton(x, w, bias, spec)
    assert got_i.dtype == want_i.dtype == torch.int64 and got_w.dtype == want_w.dtype == F32
    assert got_i.shape == got_w.shape == (T, spec.top_k)
    got_w, got_i = sorted_route(got_w, got_i)
    want_w, want_i = sorted_route(want_w, want_i)
    assert torch.equal(got_i, want_i)
    assert torch.allclose(got_w, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["v3_noaux", "v2_greedy"])
@pytest.mark.parametrize("T,E,H", [(1, 20, 600), (5, 20, 300), (17, 24, 1000)])
def test_route_split_over_the_hidden_size(name, T, E, H):
    """Hidden sizes past one block: programs over slices of H, the last to arrive sums their partial logits;
    its arrival counters are back at zero after the call."""
    spec = ROUTES[name]
    x, w, bias = route_case(T, E, H, F32, spec, seed=T + H)
    got = sorted_route(*moe_route_triton(x, w, bias, spec))
    want = sorted_route(*moe_route_torch(x, w, bias, spec))
    assert torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert (zeroed_scratch("moe_route", route_mod._COUNTERS, x.device) == 0).all()


def test_align_scratch_is_zero_after_a_call():
    ids = random_ids(300, 9, 3, torch.Generator().manual_seed(5))  # 1200 pairs: many programs, two launches
    align_pairs(ids, 9, 1, 16)
    assert (zeroed_scratch("moe_align", MAX_EXPERT_SLOTS + 2, ids.device) == 0).all()


def test_strided_out_is_filled():
    case = make_moe_case(5, 7, 2, 40, 24, 24, F32, seed=2)
    want = fused_moe_torch(*case.args, shared=case.shared)
    out = torch.full((40, 5), float("nan")).t()  # [T, H] with H strided
    assert fused_moe(*case.args, shared=case.shared, out=out, backend="triton") is out
    assert rel_err(out, want) <= 1e-5


@pytest.mark.parametrize("T", [1, 2])
def test_too_many_expert_slots_is_a_clear_error(T):
    E = MAX_EXPERT_SLOTS
    x, ids = torch.randn(T, 4), torch.zeros(T, 1, dtype=torch.int64)
    shared = (torch.randn(2, 4), torch.randn(4, 1))  # one more slot
    with pytest.raises(ValueError, match="expert slots"):
        fused_moe(x, torch.randn(E, 2, 4), torch.randn(E, 4, 1), torch.ones(T, 1), ids, shared=shared,
                  backend="triton")


@pytest.mark.parametrize("offset", [7, 20])
def test_route_ids_relative_to_an_expert_parallel_rank(offset):
    """id_offset (a rank's first expert under expert parallelism): every id minus the offset, negative for the
    experts before the rank's, the same weights; Triton (int64 and int32 ids) as the reference."""
    spec = ROUTES["v3_noaux"]
    x, w, bias = route_case(17, 40, 33, F32, spec, seed=offset)
    plain = sorted_route(*moe_route_torch(x, w, bias, spec))
    want = sorted_route(*moe_route_torch(x, w, bias, spec, id_offset=offset))
    assert torch.equal(want[1], plain[1] - offset) and torch.equal(want[0], plain[0])
    assert (want[1] < 0).any() and (want[1] >= 0).any()
    for ids_dtype in (torch.int64, torch.int32):
        got = sorted_route(*moe_route_triton(x, w, bias, spec, ids_dtype=ids_dtype, id_offset=offset))
        assert torch.equal(got[1].long(), want[1]) and torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-6)


def test_route_without_bias_and_int32_ids():
    spec = RouteSpec(top_k=3, n_group=4, topk_group=2, method="noaux_tc", sigmoid=True, norm_topk_prob=True)
    x, w, _ = route_case(17, 24, 40, F32, spec, seed=3)
    want = sorted_route(*moe_route_torch(x, w, None, spec))
    got_w, got_i = moe_route_triton(x, w, None, spec, ids_dtype=torch.int32)
    assert got_i.dtype == torch.int32
    got = sorted_route(got_w, got_i)
    assert torch.equal(got[1].long(), want[1]) and torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-6)


def test_route_group_limit_excludes_the_weaker_groups():
    """V3 with one group of four allowed: every chosen expert lies in the group whose two best biased scores sum
    highest, even when a stronger single expert sits in another group."""
    spec = RouteSpec(top_k=2, n_group=4, topk_group=1, method="noaux_tc", sigmoid=True, norm_topk_prob=True)
    H, E = 16, 8
    x = torch.ones(1, H)
    logits = torch.tensor([4.0, -4.0, 1.5, 1.5, -3, -3, -3, -3])  # group 0: 4 + -4; group 1: 1.5 + 1.5
    w = (logits / H)[:, None].repeat(1, H)
    weights, ids = moe_route_triton(x, w, torch.zeros(E), spec)
    assert sorted(ids[0].tolist()) == [2, 3]
    assert torch.allclose(weights.sum(1), torch.ones(1))


def test_route_empty_batch_and_bad_rules():
    spec = RouteSpec(top_k=2)
    w, ids = moe_route_triton(torch.randn(0, 8), torch.randn(4, 8), None, spec)
    assert w.shape == ids.shape == (0, 2)
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="groups"):
        moe_route_triton(x, torch.randn(6, 8), None, RouteSpec(top_k=2, n_group=4, method="noaux_tc"))
    with pytest.raises(ValueError, match="top_k"):
        moe_route_triton(x, torch.randn(6, 8), None, RouteSpec(top_k=7))
    with pytest.raises(ValueError, match="weight"):
        moe_route_triton(x, torch.randn(6, 9), None, spec)


# ---- bad input --------------------------------------------------------------------------------------------
T0, E0, K0, H0, I0, IS0 = 3, 5, 2, 16, 8, 12
FP8 = torch.float8_e4m3fn


def bad_calls():
    """(name, change to the call's keyword arguments, error pattern, backends that must reject it)."""
    both = ("triton", "torch")

    def shared(gu, d):
        return {"shared": (torch.randn(*gu), torch.randn(*d))}

    return [
        ("x_3d", {"x": torch.randn(1, T0, H0)}, r"\bx must be", both),
        ("x_1d", {"x": torch.randn(H0)}, r"\bx must be", both),
        ("w_gate_up_2i", {"w_gate_up": torch.randn(E0, 2 * I0 + 2, H0)}, "w_gate_up", both),
        ("w_gate_up_h", {"w_gate_up": torch.randn(E0, 2 * I0, H0 + 1)}, "w_gate_up", both),
        ("w_gate_up_2d", {"w_gate_up": torch.randn(2 * I0, H0)}, "w_gate_up", both),
        ("w_down_i", {"w_down": torch.randn(E0, H0, I0 + 1)}, "w_down", both),
        ("w_down_e", {"w_down": torch.randn(E0 + 1, H0, I0)}, "w_down", both),
        ("topk_ids_t", {"topk_ids": torch.zeros(T0 + 1, K0, dtype=torch.int64)}, "topk_ids", both),
        ("topk_ids_1d", {"topk_ids": torch.zeros(T0, dtype=torch.int64)}, "topk_ids", both),
        ("topk_ids_float", {"topk_ids": torch.zeros(T0, K0)}, "topk_ids", both),
        ("topk_ids_k0", {"topk_ids": torch.zeros(T0, 0, dtype=torch.int64), "topk_weights": torch.zeros(T0, 0)},
         "topk_ids", both),
        ("topk_weights_k", {"topk_weights": torch.rand(T0, K0 + 1)}, "topk_weights", both),
        ("shared_odd_rows", shared((2 * IS0 + 1, H0), (H0, IS0)), "shared", both),
        ("shared_h", shared((2 * IS0, H0 + 1), (H0, IS0)), "shared", both),
        ("shared_down", shared((2 * IS0, H0), (H0, IS0 + 2)), "shared", both),
        ("shared_1d", shared((2 * IS0 * H0,), (H0, IS0)), "shared", both),
        ("fp8_no_scale", {"w_gate_up": torch.randn(E0, 2 * I0, H0).to(FP8)}, "w_gate_up_scale", both),
        ("fp8_down_no_scale", {"w_down": torch.randn(E0, H0, I0).to(FP8)}, "w_down_scale", both),
        ("scale_without_fp8", {"w_gate_up_scale": torch.ones(E0, 1, 1)}, "w_gate_up_scale", both),
        ("out_shape", {"out": torch.full((T0, H0 + 1), float("nan"))}, r"\bout must", both),
        ("out_dtype", {"out": torch.full((T0, H0), float("nan"), dtype=F16)}, r"\bout must", both),
        ("residual_shape", {"residual": torch.randn(T0, H0 + 1)}, r"\bresidual must", both),
        ("residual_rows", {"residual": torch.randn(T0 + 1, H0)}, r"\bresidual must", both),
        ("residual_dtype", {"residual": torch.randn(T0, H0, dtype=F16)}, r"\bresidual must", both),
        ("expert_dtype", {"w_gate_up": torch.randn(E0, 2 * I0, H0, dtype=F16)}, "dtype", ("triton",)),
        ("shared_dtype", {"shared": (torch.randn(2 * IS0, H0, dtype=F16), torch.randn(H0, IS0, dtype=F16))},
         "dtype", ("triton",)),
        ("w_down_not_contiguous", {"w_down": torch.randn(E0, I0, H0).transpose(1, 2)}, "contiguous", ("triton",)),
        ("fp8_on_triton", {"w_gate_up": torch.randn(E0, 2 * I0, H0).to(FP8), "w_gate_up_scale": torch.ones(E0, 1, 1),
                           "w_down": torch.randn(E0, H0, I0).to(FP8), "w_down_scale": torch.ones(E0, 1, 1)},
         "fp8 Triton path", ("triton",)),
        ("unknown_backend", {}, "backend", ("cuda",)),
    ]


@pytest.mark.parametrize("name,change,pattern,backends", bad_calls(), ids=[c[0] for c in bad_calls()])
def test_bad_input_is_a_clear_error_that_changes_nothing(name, change, pattern, backends):
    case = make_moe_case(T0, E0, K0, H0, I0, IS0, F32)
    kwargs = dict(x=case.x, w_gate_up=case.w_gate_up, w_down=case.w_down, topk_weights=case.topk_weights,
                  topk_ids=case.topk_ids, shared=case.shared, out=torch.full((T0, H0), float("nan")))
    kwargs.update(change)
    tensors = [t for v in kwargs.values() for t in (v if isinstance(v, tuple) else (v,)) if t is not None]
    copies = snapshot(tensors)
    for backend in backends:
        with pytest.raises(ValueError, match=pattern):
            fused_moe(**kwargs, backend=backend)
        assert unchanged(tensors, copies)
    if "torch" in backends:
        with pytest.raises(ValueError, match=pattern):
            fused_moe_torch(**kwargs)
        assert unchanged(tensors, copies)


# ---- backends on CPU --------------------------------------------------------------------------------------
def test_torch_and_auto_backends_on_cpu_run_the_reference(monkeypatch):
    case = make_moe_case(6, 7, 3, 40, 24, 24, F16, seed=2)
    want = fused_moe_torch(*case.args, shared=case.shared)
    assert rel_err(want, moe_oracle(*case.args, shared=case.shared)) <= 3e-3

    def no_kernel(*a, **k):
        raise AssertionError("the Triton kernel ran on CPU tensors with backend='auto'")

    monkeypatch.setattr(moe_ops, "fused_moe_triton", no_kernel)
    monkeypatch.setattr(route_mod, "moe_route_triton", no_kernel)
    assert torch.equal(fused_moe(*case.args, shared=case.shared, backend="torch"), want)
    assert torch.equal(fused_moe(*case.args, shared=case.shared), want)
    spec = ROUTES["v3_noaux"]
    x, w, bias = route_case(5, 20, 40, F32, spec, seed=1)
    for got, ref in zip(moe_route(x, w, bias, spec), moe_route_torch(x, w, bias, spec)):
        assert torch.equal(got, ref)


# ---- fp8 experts (torch reference) --------------------------------------------------------------------------
def dequant_by_block(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """weight · scale per 128 × 128 block, block by block (fp32)."""
    out = w8.float()
    E, R, C = w8.shape
    for e in range(E):
        for bi in range(math.ceil(R / 128)):
            for bj in range(math.ceil(C / 128)):
                out[e, bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128] *= scale[e, bi, bj]
    return out


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_fp8_block_scaled_experts_in_the_reference(dtype):
    """float8_e4m3fn experts with fp32 block scales [E, ⌈rows/128⌉, ⌈cols/128⌉] (I = 136, H = 130: partial
    blocks on both axes) equal the computation on the dequantised weights."""
    T, E, k, H, I, Is = 5, 3, 2, 130, 136, 40
    case = make_moe_case(T, E, k, H, I, Is, dtype, seed=9)
    g = torch.Generator().manual_seed(9)
    wgu8 = torch.randn(E, 2 * I, H, generator=g).mul(8).to(FP8)
    wd8 = torch.randn(E, H, I, generator=g).mul(8).to(FP8)
    s_gu = torch.rand(E, 3, 2, generator=g) * 0.02 + 0.005  # 272 rows, 130 columns
    s_d = torch.rand(E, 2, 2, generator=g) * 0.02 + 0.005  # 130 rows, 136 columns
    wgu, wd = dequant_by_block(wgu8, s_gu), dequant_by_block(wd8, s_d)
    assert torch.equal(weight_dequant(wgu8, s_gu), wgu) and torch.equal(weight_dequant(wd8, s_d), wd)
    got = fused_moe_torch(case.x, wgu8, wd8, case.topk_weights, case.topk_ids, shared=case.shared,
                          w_gate_up_scale=s_gu, w_down_scale=s_d)
    assert got.dtype == dtype
    oracle = moe_oracle(case.x, wgu, wd, case.topk_weights, case.topk_ids, shared=case.shared)
    assert rel_err(got, oracle) <= (1e-5 if dtype == F32 else 1e-2)
    if dtype == F32:
        plain = fused_moe_torch(case.x, wgu, wd, case.topk_weights, case.topk_ids, shared=case.shared)
        assert rel_err(got, plain) <= 1e-6
    auto = fused_moe(case.x, wgu8, wd8, case.topk_weights, case.topk_ids, shared=case.shared,
                     w_gate_up_scale=s_gu, w_down_scale=s_d)
    assert torch.equal(auto, got)


# ---- GPU (bf16, model shapes) -------------------------------------------------------------------------------
GPU_SHAPES = {  # E, k, I, H, Is
    "v2_lite": (64, 6, 1408, 2048, 2816),
    "v3_small": (256, 8, 256, 512, 256),
}
GPU_TOKENS = [1, 3, 8, 127, 1000, 4097]


@pytest.mark.gpu
@pytest.mark.parametrize("T", GPU_TOKENS)
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_bf16_matches_reference(shape, T):
    E, k, I, H, Is = GPU_SHAPES[shape]
    case = make_moe_case(T, E, k, H, I, Is, BF16, seed=T, device="cuda")
    with torch.inference_mode():
        want = fused_moe_torch(*case.args, shared=case.shared)
        got = fused_moe(*case.args, shared=case.shared, backend="triton")
        auto = fused_moe(*case.args, shared=case.shared)
        out = torch.full_like(case.x, float("nan"))
        into = fused_moe(*case.args, shared=case.shared, out=out)
    assert got.dtype == BF16 and got.shape == (T, H)
    assert fro_err(got, want) <= 1e-2
    assert torch.equal(auto, got)
    assert into is out and torch.equal(out, got)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [127, 1000, 4097])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_weight_descriptors_are_the_default_at_prefill_sizes(shape, T):
    """Where the rule takes tensor descriptors (bf16, ≥ 64-row blocks on sm_90), the result equals pointer loads
    of the same tiles up to the accumulation's rounding, and the reference."""
    E, k, I, H, Is = GPU_SHAPES[shape]
    case = make_moe_case(T, E, k, H, I, Is, BF16, seed=T, device="cuda")
    up = moe_tuning.lookup("up", E, I, H, T, case.x.device, k)
    weights = (case.w_gate_up, case.w_down, *case.shared)
    if torch.cuda.get_device_capability()[0] >= 9:
        assert moe_triton.weights_tma_rule(case.x, up.block_m, *weights) == (up.block_m >= 64)
    with torch.inference_mode():
        want = fused_moe_torch(*case.args, shared=case.shared)
        tma = fused_moe_triton(*case.args, shared=case.shared, weights_tma=True)
        plain = fused_moe_triton(*case.args, shared=case.shared, weights_tma=False)
        default = fused_moe_triton(*case.args, shared=case.shared)
    assert fro_err(tma, want) <= 1e-2
    assert fro_err(tma, plain) <= 2e-3
    assert torch.equal(default, tma if up.block_m >= 64 and torch.cuda.get_device_capability()[0] >= 9 else plain)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 1000])
def test_gpu_fp32_experts_multiply_in_fp32(T):
    """fp32 experts on the GPU are fp32 products (not tf32): the reference to 1e-5."""
    case = make_moe_case(T, 9, 3, 512, 256, 256, F32, seed=T, device="cuda")
    with torch.inference_mode():
        want = fused_moe_torch(*case.args, shared=case.shared)
        got = fused_moe(*case.args, shared=case.shared, backend="triton")
    assert fro_err(got, want) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 1000])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_gpu_expert_parallel_ids(T, ids_dtype):
    """Rank 2 of 4 holding 64 of 256 experts: its local ids are the global ones minus 128."""
    E_global, E, k, I, H, Is = 256, 64, 8, 256, 512, 256
    case = make_moe_case(T, E, k, H, I, Is, BF16, seed=T, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(T)
    case.topk_ids = (random_ids(T, E_global, k, g, "cuda") - 128).to(ids_dtype)
    case.topk_ids[0, 0] = -1
    with torch.inference_mode():
        want = fused_moe_torch(*case.args, shared=case.shared)
        got = fused_moe(*case.args, shared=case.shared)
    assert fro_err(got, want) <= 1e-2
    if T >= 8:
        valid = (case.topk_ids >= 0) & (case.topk_ids < E)
        assert valid.any() and (~valid).any()


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 300])
def test_gpu_cuda_graph_capture_and_replay(T):
    """Captured once on static tensors; each replay after new x, ids (some outside [0, E)), routing weights and
    expert weights are copied in equals the reference on the new inputs."""
    E, k, I, H, Is = GPU_SHAPES["v3_small"]
    case = make_moe_case(T, E, k, H, I, Is, BF16, seed=T, device="cuda")
    out = torch.empty_like(case.x)
    with torch.no_grad():
        fused_moe(*case.args, shared=case.shared, out=out)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fused_moe(*case.args, shared=case.shared, out=out)
        previous = None
        for step in range(3):
            new = make_moe_case(T, E, k, H, I, Is, BF16, seed=1000 + 10 * T + step, device="cuda")
            if step == 1:
                new.topk_ids[:, ::2] += E  # every other slot on another rank
            case.x.copy_(new.x)
            case.topk_ids.copy_(new.topk_ids)
            case.topk_weights.copy_(new.topk_weights)
            case.w_down.copy_(new.w_down)
            graph.replay()
            torch.cuda.synchronize()
            want = fused_moe_torch(*case.args, shared=case.shared)
            assert fro_err(out, want) <= 1e-2
            assert previous is None or not torch.equal(previous, out)
            previous = out.clone()


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64])
def test_gpu_no_host_sync(T):
    """After a warm-up call (Triton compiled), the router and the fused MoE never synchronise with the host."""
    E, k, I, H, Is = GPU_SHAPES["v3_small"]
    case = make_moe_case(T, E, k, H, I, Is, BF16, seed=T, device="cuda")
    spec = RouteSpec(top_k=k, n_group=8, topk_group=4, method="noaux_tc", sigmoid=True, norm_topk_prob=True,
                     scaling=2.5)
    _, router_w, bias = route_case(T, E, H, BF16, spec, seed=T, device="cuda")
    with torch.inference_mode():
        fused_moe(*case.args, shared=case.shared)
        moe_route(case.x, router_w, bias, spec)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            weights, ids = moe_route(case.x, router_w, bias, spec)
            got = fused_moe(case.x, case.w_gate_up, case.w_down, weights, ids, shared=case.shared)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = fused_moe_torch(case.x, case.w_gate_up, case.w_down, weights, ids, shared=case.shared)
    assert fro_err(got, want) <= 1e-2


@pytest.mark.gpu
def test_gpu_auto_backend_takes_the_reference_when_a_weight_needs_a_gradient():
    """The kernels have no backward: `auto` keeps the torch path on CUDA whenever a tensor of the call needs a
    gradient, and that path's gradient flows."""
    case = make_moe_case(8, 16, 2, 64, 32, 32, BF16, seed=1, device="cuda")
    w_down = case.w_down.clone().requires_grad_()
    out = fused_moe(case.x, case.w_gate_up, w_down, case.topk_weights, case.topk_ids, shared=case.shared)
    assert out.requires_grad
    out.float().square().sum().backward()
    assert w_down.grad is not None and w_down.grad.abs().sum() > 0
    with torch.no_grad():
        assert not fused_moe(case.x, case.w_gate_up, w_down, case.topk_weights, case.topk_ids).requires_grad


def route_choice(x, weight, bias, spec):
    """fp32 (choice scores after the group limit [T, E], group scores [T, n_group] or None): the quantities the
    reference ranks."""
    logits = x.float() @ weight.float().T
    scores = logits.sigmoid() if spec.sigmoid else logits.softmax(dim=-1)
    choice = scores if bias is None else scores + bias
    if not spec.group_mode:
        return choice, None
    grouped = choice.view(x.shape[0], spec.n_group, -1)
    gs = grouped.topk(2, dim=-1)[0].sum(-1) if spec.group_mode == 1 else grouped.max(-1).values
    keep = torch.zeros_like(gs).scatter_(1, gs.topk(spec.topk_group, dim=-1)[1], 1.0).bool()
    fill = float("-inf") if spec.group_mode == 1 else 0.0
    return grouped.masked_fill(~keep[:, :, None], fill).view_as(choice), gs


def assert_route_equal_up_to_near_ties(x, weight, bias, spec, got, tie=1e-5):
    """Ids equal the reference's token by token, except a token where the reference itself nearly ties: its k-th
    and (k+1)-th choice scores (or its last kept and first dropped group scores) within `tie`, and the kernel's
    extra experts within `tie` of the k-th score (or a group tie). Weights match wherever the ids do."""
    want_w, want_i = sorted_route(*moe_route_torch(x, weight, bias, spec))
    got_w, got_i = sorted_route(*got)
    assert got_i.dtype == torch.int64 and got_i.shape == want_i.shape
    k = spec.top_k
    differ = (got_i != want_i).any(dim=1)
    if differ.any():
        choice, gs = route_choice(x, weight, bias, spec)
        for t in differ.nonzero().flatten().tolist():
            c = choice[t].sort(descending=True).values
            expert_tie = bool(c[k - 1] - c[k] <= tie)
            extra = sorted(set(got_i[t].tolist()) - set(want_i[t].tolist()))
            near = all(choice[t, e] >= c[k - 1] - tie for e in extra)
            group_tie = False
            if gs is not None and spec.topk_group < spec.n_group:
                s = gs[t].sort(descending=True).values
                group_tie = bool(s[spec.topk_group - 1] - s[spec.topk_group] <= tie)
            assert (expert_tie and near) or group_tie, (
                f"token {t}: ids {got_i[t].tolist()} != {want_i[t].tolist()} without a near tie")
    same = ~differ
    assert torch.allclose(got_w[same], want_w[same], rtol=1e-4, atol=1e-5)


GPU_ROUTES = {  # E, H, spec
    "v2_lite": (64, 2048, RouteSpec(top_k=6, method="greedy", v2=True)),
    "v3": (256, 7168, RouteSpec(top_k=8, n_group=8, topk_group=4, method="noaux_tc", sigmoid=True,
                                norm_topk_prob=True, scaling=2.5)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 17, 1000, 4097])
@pytest.mark.parametrize("name", list(GPU_ROUTES))
def test_gpu_route_bf16_matches_reference(name, T):
    E, H, spec = GPU_ROUTES[name]
    x, w, bias = route_case(T, E, H, BF16, spec, seed=T, device="cuda")
    with torch.inference_mode():
        got = moe_route(x, w, bias, spec)
        assert_route_equal_up_to_near_ties(x, w, bias, spec, got)
        assert_route_equal_up_to_near_ties(x, w, bias, spec, moe_route_triton(x, w, bias, spec))
