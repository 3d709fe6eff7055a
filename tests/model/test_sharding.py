"""A tensor-parallel rank's shard of the model: heads and MLP columns split, experts divided."""

import pytest
import torch

from specmla.model.loader import load_model
from specmla.model.sharding import shard_model_


def test_shards_split_heads_and_experts(tiny_model_dir):
    full = load_model(tiny_model_dir, device="cpu", progress=False)
    part = load_model(tiny_model_dir, device="cpu", progress=False)
    shard_model_(part, 1, 2)
    a_full, a_part = full.model.layers[0].self_attn, part.model.layers[0].self_attn
    assert a_part.num_heads == a_full.num_heads // 2
    assert a_part.kv_b_proj.weight.shape[0] == a_full.kv_b_proj.weight.shape[0] // 2
    assert a_part.o_proj.weight.shape[1] == a_full.o_proj.weight.shape[1] // 2
    moe, whole = part.model.layers[1].mlp, full.model.layers[1].mlp
    assert moe.local_experts == (2, 4)
    assert torch.equal(moe.w_down, whole.w_down[2:4]) and torch.equal(moe.w_gate_up, whole.w_gate_up[2:4])
    Is = whole.shared_down.shape[1]
    assert moe.shared_down.shape == (whole.shared_down.shape[0], Is // 2)
    gate_up = whole.shared_gate_up
    assert torch.equal(moe.shared_gate_up, torch.cat([gate_up[Is // 2:Is], gate_up[Is + Is // 2:]]))
    views = moe.checkpoint_tensors()
    assert set(views) >= {"experts.2.down_proj.weight", "experts.3.gate_proj.weight"}
    # the shared experts' views cover this rank's slice: gate and up rows apart, down columns
    assert torch.equal(views["shared_experts.gate_proj.weight"], gate_up[Is // 2:Is])
    assert torch.equal(views["shared_experts.up_proj.weight"], gate_up[Is + Is // 2:])
    assert torch.equal(views["shared_experts.down_proj.weight"], whole.shared_down[:, Is // 2:])
    with pytest.raises(ValueError, match="heads"):
        shard_model_(load_model(tiny_model_dir, device="cpu", progress=False), 0, 3)


def test_load_model_with_shard_gives_the_shard_only(tiny_model_dir):
    """A tensor-parallel rank loads its shard (staged on the host): the same tensors as cutting the
    full model, and fewer parameters than the full model."""
    full = load_model(tiny_model_dir, device="cpu", progress=False)
    cut = load_model(tiny_model_dir, device="cpu", progress=False)
    shard_model_(cut, 1, 2)
    rank1 = load_model(tiny_model_dir, device="cpu", progress=False, shard=(1, 2))
    want, got = dict(cut.named_parameters()), dict(rank1.named_parameters())
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert sum(p.numel() for p in got.values()) < sum(p.numel() for p in full.parameters())
