"""Triton MoE routing and small-batch experts (ops/moe.py) against their torch references: on CPU in
the interpreter (fp32/fp16, odd sizes), on the GPU in bf16 and through the model's MoE module."""

import pytest
import torch
from helpers.moe_cases import make_moe

from specmla.model.deepseek import MoE
from specmla.ops.moe import RouteSpec, moe_experts_torch, moe_experts_triton, moe_route_torch, moe_route_triton

SPECS = {
    "v3_noaux": RouteSpec(top_k=3, n_group=4, topk_group=2, method="noaux_tc", sigmoid=True, norm_topk_prob=True,
                          scaling=2.5),
    "v2_group_limited": RouteSpec(top_k=3, n_group=4, topk_group=2, method="group_limited_greedy", scaling=16.0,
                                  v2=True),
    "v2_greedy_norm": RouteSpec(top_k=2, method="greedy", norm_topk_prob=True, v2=True),
    "v3_one_group_top1": RouteSpec(top_k=1, sigmoid=True, method="noaux_tc", norm_topk_prob=True),
    "softmax_unnormalised": RouteSpec(top_k=4, scaling=0.7),
}


def sorted_route(weights, idx):
    """Expert order within a token is not part of the contract: sort by expert id."""
    order = idx.argsort(dim=1)
    return weights.gather(1, order), idx.gather(1, order)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("T,E,H", [(1, 12, 48), (5, 20, 40), (9, 8, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_route_matches_reference_in_interpreter(name, T, E, H, dtype):
    spec = SPECS[name]  # 12, 20 and 8 experts all split into 4 groups (3, 5 and 2 per group)
    g = torch.Generator().manual_seed(T * 100 + E)
    x = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(E, H, generator=g) * 0.3).to(dtype)
    bias = torch.randn(E, generator=g) * 0.1 if spec.method == "noaux_tc" else None
    want = sorted_route(*moe_route_torch(x, w, bias, spec))
    got = sorted_route(*moe_route_triton(x, w, bias, spec))
    assert torch.equal(got[1], want[1])
    assert torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-6)


def test_route_group_limit_excludes_the_weaker_groups():
    """A V3 rule with one group of four allowed: every chosen expert lies in the group whose two
    best biased scores sum highest, even when a stronger single expert sits in another group."""
    spec = RouteSpec(top_k=2, n_group=4, topk_group=1, method="noaux_tc", sigmoid=True, norm_topk_prob=True)
    H, E = 16, 8
    x = torch.ones(1, H)
    logits = torch.tensor([4.0, -4.0, 1.5, 1.5, -3, -3, -3, -3])  # group 0: 4 + -4; group 1: 1.5 + 1.5
    w = (logits / H)[:, None].repeat(1, H)
    weights, idx = moe_route_triton(x, w, torch.zeros(E), spec)
    assert sorted(idx[0].tolist()) == [2, 3]
    assert torch.allclose(weights.sum(1), torch.ones(1))
    assert torch.equal(sorted_route(weights, idx)[1], sorted_route(*moe_route_torch(x, w, torch.zeros(E), spec))[1])


@pytest.mark.parametrize("T,k,E,I,H,n_shared", [(1, 2, 5, 24, 40, 1), (4, 3, 7, 16, 33, 2), (3, 1, 4, 40, 64, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_experts_match_reference_in_interpreter(T, k, E, I, H, n_shared, dtype):
    g = torch.Generator().manual_seed(T + 10 * k + E)
    rnd = lambda *s: (torch.randn(*s, generator=g) * 0.2).to(dtype)  # noqa: E731
    x = rnd(T, H)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    wgu, wd = rnd(E, 2 * I, H), rnd(E, H, I)
    shared = (rnd(n_shared * I, H), rnd(n_shared * I, H), rnd(H, n_shared * I)) if n_shared else None
    want = moe_experts_torch(x, idx, weights, wgu, wd, shared)
    got = moe_experts_triton(x, idx, weights, wgu, wd, shared)
    assert got.dtype == dtype and got.shape == (T, H)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() <= tol


def test_experts_reference_equals_the_module_math():
    """The fused contract is the MoE module's function: the reference on the module's own weights
    equals the module's grouped (eager) path, shared expert included."""
    moe = make_moe("v3", seed=3)
    x = torch.randn(6, 48)
    with torch.no_grad():
        want = moe(x)
        weights, idx = moe.gate(x)
        s = moe.shared_experts
        got = moe_experts_torch(x, idx, weights, moe.w_gate_up, moe.w_down,
                                (s.gate_proj.weight, s.up_proj.weight, s.down_proj.weight))
    assert ((got - want).norm() / want.norm()).item() <= 1e-5


def test_bad_shapes_are_clear_errors():
    x, idx, w = torch.randn(2, 8), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2)
    with pytest.raises(ValueError, match="w_gate_up"):
        moe_experts_triton(x, idx, w, torch.randn(3, 10, 8), torch.randn(3, 8, 4))  # 2I != 10
    with pytest.raises(ValueError, match="shared"):
        moe_experts_triton(x, idx, w, torch.randn(3, 8, 8), torch.randn(3, 8, 4),
                           (torch.randn(6, 8), torch.randn(6, 8), torch.randn(8, 6)))  # 6 not a multiple of 4
    with pytest.raises(ValueError, match="groups"):
        moe_route_triton(x, torch.randn(6, 8), None, RouteSpec(top_k=2, n_group=4, method="noaux_tc"))
    with pytest.raises(ValueError, match="top_k"):
        moe_route_triton(x, torch.randn(6, 8), None, RouteSpec(top_k=7))


def test_empty_batch():
    w, idx = moe_route_triton(torch.randn(0, 8), torch.randn(4, 8), None, RouteSpec(top_k=2))
    assert w.shape == (0, 2) and idx.shape == (0, 2)
    out = moe_experts_triton(torch.randn(0, 8), idx, w, torch.randn(4, 8, 8), torch.randn(4, 8, 4))
    assert out.shape == (0, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["v3", "v2"])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_gpu_fused_module_path_equals_grouped(kind, tokens):
    """bf16 on the GPU: the module's fused path (router kernel + 2 expert kernels) equals its grouped
    path (taken when expert parallelism is set, here covering all 12 experts); routing equals the torch reference exactly on random data."""
    moe = make_moe(kind, seed=tokens).cuda().to(torch.bfloat16)
    moe.gate.float()
    x = torch.randn(tokens, 48, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        assert moe._fusable(x, torch.zeros(tokens, 3))
        got = moe(x)
        moe.local_experts = (0, 12)  # expert parallelism covering every expert: the grouped path
        assert not moe._dense_is_cheap(x)
        assert not moe._fusable(x, torch.zeros(tokens, 3))
        want = moe(x)
        moe.local_experts = None
        r_want = sorted_route(*moe_route_torch(x, moe.gate.weight, moe.gate.e_score_correction_bias, moe.gate.spec))
        r_got = sorted_route(*moe_route_triton(x, moe.gate.weight, moe.gate.e_score_correction_bias, moe.gate.spec))
    assert torch.equal(r_got[1], r_want[1]) and torch.allclose(r_got[0], r_want[0], rtol=1e-5)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["v3", "v2"])
@pytest.mark.parametrize("tokens", [9, 23, 300])  # T·k past the fused kernels' 2E = 24
def test_gpu_eager_mid_batches_take_the_dense_path(kind, tokens):
    """bf16 on the GPU, batches past the fused kernels' limit: eager calls compute every expert densely
    (no host sync) while the intermediate is small, and agree with the grouped path; past the limit they
    keep the grouped path."""
    moe = make_moe(kind, seed=tokens).cuda().to(torch.bfloat16)
    moe.gate.float()
    x = torch.randn(tokens, 48, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        assert not moe._fusable(x, torch.zeros(tokens, 3)) and moe._dense_is_cheap(x)
        calls = []
        moe._grouped = lambda *a: calls.append(1) or MoE._grouped(moe, *a)
        got = moe(x)
        assert not calls  # the dense (or gather) path ran
        moe.dense_max_elements = 0
        assert not moe._dense_is_cheap(x)
        want = moe(x)
        assert calls == [1]
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() <= 2e-2
