"""The three MoE dispatch paths (grouped / gather / dense) compute the same function."""

import pytest
import torch

from helpers.moe_cases import make_moe

from specmla.model.deepseek import MoE


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
