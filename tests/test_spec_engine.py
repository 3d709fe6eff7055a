"""Speculative decoding in the engine: lossless against plain decoding, counters, pool accounting."""

import random

import pytest

from specmla import LLM, SamplingParams


def mixed_prompts(n=32, seed=0):
    """Mixed lengths, many with repeated spans (where n-gram drafts get accepted)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        base = [rng.randrange(3, 250) for _ in range(rng.randint(1, 12))]
        reps = rng.randint(1, 6) if i % 3 else 1
        out.append((base * reps)[: rng.randint(1, 70)] or base[:1])
    return out


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_ngram_speculation_equals_plain_greedy(tiny_model_dir, k):
    prompts = mixed_prompts()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=1024).generate(prompts, params)
    spec = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=1024, speculative="ngram",
               num_speculative_tokens=k)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stats = spec.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0  # the drafts did get used
    assert sum(o.metrics["spec"]["num_accepted_tokens"] for o in outs) == stats.num_accepted_tokens
    assert len(stats.accepted_per_position) <= k
    assert spec.kv_pool.num_free_pages() == spec.kv_pool.num_pages


def test_speculation_with_sampling_stops_and_preemption(tiny_model_dir):
    prompts = mixed_prompts(12, seed=1)
    llm = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=40, speculative="ngram",
              num_speculative_tokens=3, enable_prefix_caching=True)
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=i, ignore_eos=True) for i in range(12)]
    outs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == 20 and o.finish_reason == "length" for o in outs)
    again = llm.generate(prompts, params)  # seeded: the same draws
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages


def test_spec_respects_max_tokens_and_eos(tiny_model_dir):
    prompts = mixed_prompts(8, seed=2)
    plain = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=512)
    spec = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=512, speculative="ngram",
               num_speculative_tokens=4)
    ref = plain.generate(prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    eos = ref[0].token_ids[7]
    for llm in (plain, spec):
        llm.engine.eos_ids = {eos}
    a = plain.generate(prompts, SamplingParams(max_tokens=9, temperature=0))
    b = spec.generate(prompts, SamplingParams(max_tokens=9, temperature=0))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) <= 9 for o in b)


def test_unknown_or_unavailable_speculation_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ValueError, match="speculative"):
        LLM(tiny_model_dir, device="cpu", speculative="medusa")
    with pytest.raises(NotImplementedError, match="mtp"):
        LLM(tiny_model_dir, device="cpu", speculative="mtp")
