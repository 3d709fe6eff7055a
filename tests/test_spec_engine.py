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


@pytest.mark.parametrize("kind,k", [("ngram", 1), ("ngram", 3), ("ngram", 5), ("mtp", 1), ("mtp", 3),
                                    ("hybrid", 4)])
def test_greedy_speculation_equals_plain_greedy(tiny_model_dir, kind, k):
    prompts = mixed_prompts()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=1024).generate(prompts, params)
    spec = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=1024, speculative=kind,
               num_speculative_tokens=k)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stats = spec.engine.spec_stats
    assert stats.num_drafts > 0  # drafts were verified
    if kind != "mtp":  # the random model's untrained MTP module rarely guesses right; n-gram drafts do
        assert stats.num_accepted_tokens > 0
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


def test_unknown_speculation_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ValueError, match="speculative"):
        LLM(tiny_model_dir, device="cpu", speculative="medusa")


def reference_mtp_drafts(model, ids: list[int], k: int) -> list[int]:
    """Cache-free recomputation: the trunk over all tokens but the last, the MTP module over the
    same positions (hidden at p with token p+1), then k recursive steps from the last position."""
    import torch

    from specmla.model.metadata import AttentionMetadata

    L = len(ids)
    x = torch.tensor(ids)
    with torch.no_grad():
        trunk = model(x[: L - 1], AttentionMetadata.for_contiguous([L - 1]))
        prev, nxt, drafts = trunk, x[1:L], []
        for j in range(k):
            h = model.mtp_forward(j % len(model.mtp), nxt, prev, AttentionMetadata.for_contiguous([len(nxt)]))
            d = int(model.mtp_logits(j % len(model.mtp), h[-1:]).argmax(-1))
            drafts.append(d)
            prev = torch.cat([trunk, h[-1:]]) if j == 0 else torch.cat([prev, h[-1:]])
            nxt = torch.cat([nxt, torch.tensor([d])])
    return drafts


def test_mtp_drafts_equal_a_cache_free_recomputation(tiny_model_dir):
    """After prefill and after every verify step, the drafts built from the paged MTP cache equal
    the ones recomputed from scratch (so the catch-up pass fills the MTP cache right)."""
    k = 3
    llm = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=256, speculative="mtp", num_speculative_tokens=k)
    eng = llm.engine
    seqs = [eng.add_request(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
            for p in mixed_prompts(5, seed=4)]
    checked = 0
    while eng.has_unfinished():
        eng.step()
        for s in seqs:
            if not s.is_finished and s.drafts:
                assert s.drafts == reference_mtp_drafts(llm.model, s.all_ids, k)
                checked += 1
    assert checked >= 10
