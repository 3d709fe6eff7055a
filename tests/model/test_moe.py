"""The model's MoE module: one path (router + fused experts) that equals the per-expert math, views that write
through to the stacked tensors, and expert-parallel shards that add up to the whole layer."""

import pytest
import torch
from helpers.moe_cases import make_moe

from specmla.model.sharding import _split_moe
from specmla.ops.moe import fused_moe_torch


def _loop(moe, x):
    """Per token and slot in float64: the module's function written out."""
    weights, idx = moe.gate(x)
    I, out = moe.inter, torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            gu = moe.w_gate_up[idx[t, j]].double() @ x[t].double()
            act = torch.nn.functional.silu(gu[:I]) * gu[I:]
            out[t] += weights[t, j].double() * (moe.w_down[idx[t, j]].double() @ act)
        Is = moe.shared_down.shape[1]
        gu = moe.shared_gate_up.double() @ x[t].double()
        out[t] += moe.shared_down.double() @ (torch.nn.functional.silu(gu[:Is]) * gu[Is:])
    return out


def test_module_equals_the_per_token_loop():
    for kind in ("v3", "v2"):
        moe = make_moe(kind, seed=2)
        x = torch.randn(7, 48)
        with torch.no_grad():
            got, want = moe(x).double(), _loop(moe, x)
        assert ((got - want).norm() / want.norm()).item() <= 1e-5


def test_checkpoint_views_write_through_to_the_stacked_tensors():
    moe = make_moe("v3")
    views = moe.checkpoint_tensors()
    assert len(views) == 3 * 12 + 3
    with torch.no_grad():
        views["experts.7.down_proj.weight"].fill_(3.0)
        views["shared_experts.up_proj.weight"].fill_(2.0)
    assert (moe.w_down[7] == 3.0).all() and (moe.w_down[6] != 3.0).all()
    Is = moe.shared_down.shape[1]
    assert (moe.shared_gate_up[Is:] == 2.0).all() and (moe.shared_gate_up[:Is] != 2.0).all()


def test_expert_parallel_shards_add_up_to_the_layer():
    """Each rank keeps its experts and a column slice of the shared experts; the ranks' outputs (before the
    all-reduce) sum to the whole layer, and a rank's output equals the reference on its local experts."""
    x = torch.randn(9, 48)
    with torch.no_grad():
        want = make_moe("v2", seed=4)(x)
        parts = []
        for rank in range(3):
            moe = make_moe("v2", seed=4)
            _split_moe(moe, rank, 3)
            moe.tp_reduce = False  # no process group here: sum the partial outputs by hand
            assert moe.w_down.shape[0] == 4 and moe.local_experts == (4 * rank, 4 * rank + 4)
            parts.append(moe(x))
            weights, idx = moe.gate(x)
            local = fused_moe_torch(x, moe.w_gate_up, moe.w_down, weights, idx - 4 * rank,
                                    shared=(moe.shared_gate_up, moe.shared_down))
            assert torch.allclose(parts[-1], local)
    got = sum(parts)
    assert ((got - want).norm() / want.norm()).item() <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_gpu_moe_layer_never_syncs_and_matches_the_loop(tokens):
    """bf16 on the GPU, decode- and prefill-sized batches: the module's router + fused experts run with
    host synchronisation forbidden, and agree with the float64 loop."""
    for kind in ("v3", "v2"):
        moe = make_moe(kind, seed=tokens).cuda().to(torch.bfloat16)
        if moe.gate.e_score_correction_bias is not None:  # fp32, as the loader keeps it
            moe.gate.e_score_correction_bias = moe.gate.e_score_correction_bias.float()
        x = torch.randn(tokens, 48, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            moe(x)  # compiles the kernels first (compilation may sync)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = moe(x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            want = _loop(moe.cpu().float(), x.cpu().float())
        assert ((got.cpu().double() - want).norm() / want.norm()).item() <= 2e-2
