"""The three MoE dispatch paths (grouped / gather / dense) compute the same function."""

import pytest
import torch

from specmla.config import ModelConfig
from specmla.model.deepseek import MoE


def make_moe(kind: str, seed: int = 0) -> MoE:
    cfg = ModelConfig.from_dict({
        "architectures": ["DeepseekV3ForCausalLM" if kind == "v3" else "DeepseekV2ForCausalLM"],
        "vocab_size": 10, "hidden_size": 48, "intermediate_size": 64, "moe_intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 2, "n_routed_experts": 12, "n_shared_experts": 1,
        "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 0,
        "topk_method": "noaux_tc" if kind == "v3" else "group_limited_greedy",
    })
    torch.manual_seed(seed)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
        if moe.gate.e_score_correction_bias is not None:
            moe.gate.e_score_correction_bias.normal_(0, 0.1)
    return moe


@pytest.mark.parametrize("kind", ["v3", "v2"])
@pytest.mark.parametrize("tokens", [1, 2, 4, 9, 33])  # T·k ≤ 12 takes the gather path, above it the dense one
def test_sync_free_paths_equal_grouped(kind, tokens):
    moe = make_moe(kind, seed=tokens)
    x = torch.randn(tokens, 48)
    with torch.no_grad():
        want = moe(x)
        moe.sync_free = True
        got = moe(x)
    assert ((got - want).norm() / want.norm()).item() <= 1e-5


def test_cpu_batches_keep_the_grouped_path():
    """The eager dense shortcut is for CUDA only: on CPU the extra expert FLOPs cost real time."""
    moe = make_moe("v3")
    x = torch.randn(40, 48)
    assert not moe._dense_is_cheap(x)
    calls = []
    moe._grouped = lambda *a: calls.append(1) or MoE._grouped(moe, *a)
    with torch.no_grad():
        moe(x)
    assert calls == [1]


def test_checkpoint_views_write_through_to_the_stacked_tensors():
    moe = make_moe("v3")
    views = moe.checkpoint_tensors()
    assert len(views) == 3 * 12
    with torch.no_grad():
        views["experts.7.down_proj.weight"].fill_(3.0)
    assert (moe.w_down[7] == 3.0).all() and not (moe.w_down[6] == 3.0).all()
    with torch.no_grad():
        views["experts.2.up_proj.weight"].fill_(-1.0)
    assert (moe.w_gate_up[2, 24:] == -1.0).all() and not (moe.w_gate_up[2, :24] == -1.0).any()
