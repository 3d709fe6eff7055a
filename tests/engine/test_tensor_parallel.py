"""Tensor parallelism on CPU: 2 gloo ranks give the same greedy tokens as one process."""

import pytest

from specmla import LLM, SamplingParams


def prompts(n=8):
    return [[(7 * i + j) % 250 + 3 for j in range(2 + 5 * i)] for i in range(n)]


def run(model_dir, tp, **kw):
    llm = LLM(model_dir, device="cpu", page_size=4, num_pages=512, tensor_parallel_size=tp, **kw)
    try:
        outs = llm.generate(prompts(), SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
        assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages
        return [o.token_ids for o in outs]
    finally:
        llm.shutdown()


def test_tp2_equals_tp1_on_a_random_tiny_model(tiny_model_dir):
    assert run(tiny_model_dir, 2) == run(tiny_model_dir, 1)


def test_tp2_equals_tp1_on_the_embedded_model_with_mtp_speculation_and_fp8_cache():
    from specmla.model.default import default_model_path

    path = default_model_path()  # production latent shapes (Dc 512): fp8 rows apply (608 bytes, the int8 rope)
    kw = dict(speculative="mtp", num_speculative_tokens=2, kv_cache_dtype="fp8")
    assert run(path, 2, **kw) == run(path, 1, **kw)


def test_shards_split_heads_and_experts(tiny_model_dir):
    from specmla.model.loader import load_model
    from specmla.model.sharding import shard_model_

    full = load_model(tiny_model_dir, device="cpu", progress=False)
    part = load_model(tiny_model_dir, device="cpu", progress=False)
    shard_model_(part, 1, 2)
    a_full, a_part = full.model.layers[0].self_attn, part.model.layers[0].self_attn
    assert a_part.num_heads == a_full.num_heads // 2
    assert a_part.kv_b_proj.weight.shape[0] == a_full.kv_b_proj.weight.shape[0] // 2
    assert a_part.o_proj.weight.shape[1] == a_full.o_proj.weight.shape[1] // 2
    moe = part.model.layers[1].mlp
    assert moe.local_experts == (2, 4)
    with pytest.raises(ValueError, match="heads"):
        shard_model_(load_model(tiny_model_dir, device="cpu", progress=False), 0, 3)


def test_load_model_with_shard_gives_the_shard_only(tiny_model_dir):
    """A tensor-parallel rank loads its shard (staged on the host): the same tensors as cutting the
    full model, and fewer parameters than the full model."""
    import torch

    from specmla.model.loader import load_model
    from specmla.model.sharding import shard_model_

    full = load_model(tiny_model_dir, device="cpu", progress=False)
    cut = load_model(tiny_model_dir, device="cpu", progress=False)
    shard_model_(cut, 1, 2)
    rank1 = load_model(tiny_model_dir, device="cpu", progress=False, shard=(1, 2))
    want, got = dict(cut.named_parameters()), dict(rank1.named_parameters())
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert sum(p.numel() for p in got.values()) < sum(p.numel() for p in full.parameters())
