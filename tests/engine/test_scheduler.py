"""Continuous batching: chunked prefill, decode-first token budget, preemption, prefix caching."""

import pytest
import torch

from specmla import LLM, SamplingParams
from specmla.engine.scheduler import Scheduler

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def prompts_of(lengths, seed=0, vocab=250):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def make(tiny_model_dir, **kw):
    kw = dict(dict(device="cpu", page_size=4, num_pages=256), **kw)
    return LLM(tiny_model_dir, **kw)


def test_mixed_batch_with_chunked_prefill_equals_each_prompt_alone(tiny_model_dir):
    prompts = prompts_of([3, 41, 17, 1, 29, 8])
    llm = make(tiny_model_dir, max_num_batched_tokens=16)  # forces chunks and decode+prefill steps
    together = llm.generate(prompts, GREEDY)
    alone = make(tiny_model_dir)
    for p, out in zip(prompts, together):
        assert alone.generate([p], GREEDY)[0].token_ids == out.token_ids
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages
    assert alone.kv_pool.num_free_pages() == alone.kv_pool.num_pages


def test_chunked_prefill_gives_one_shot_logits(tiny_model_dir):
    prompt = prompts_of([53], seed=1)[0]
    llm = make(tiny_model_dir)
    runner, pool = llm.engine.runner, llm.kv_pool
    from specmla.engine.sequence import Sequence

    one = Sequence(prompt_ids=prompt, params=GREEDY)
    pool.allocate(one.seq_id, len(prompt))
    want = runner.forward_logits([one])
    chunked = Sequence(prompt_ids=prompt, params=GREEDY)
    pool.allocate(chunked.seq_id, len(prompt))
    for n in (7, 1, 20, 16, 9):
        got = runner.forward_logits([chunked], [n])
    assert chunked.num_cached == len(prompt)
    assert ((got - want).norm() / want.norm()).item() <= 1e-5
    for cache in pool.caches[: llm.model.config.num_hidden_layers]:  # the chunks wrote the same latents
        a = cache.view(-1, cache.shape[-1])[pool.slots(one.seq_id, 0, len(prompt))]
        b = cache.view(-1, cache.shape[-1])[pool.slots(chunked.seq_id, 0, len(prompt))]
        # fp32 rounding only: the chunks' GEMMs have other row counts, which CPU BLAS kernels block
        # differently, so later layers' latents may differ in the last bits
        assert ((a - b).norm() / b.norm()).item() <= 1e-5
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    pool.free(one.seq_id)
    pool.free(chunked.seq_id)
    assert pool.num_free_pages() == pool.num_pages


def test_long_prompt_never_stalls_running_decodes(tiny_model_dir):
    llm = make(tiny_model_dir, max_num_batched_tokens=8)
    eng = llm.engine
    first = eng.add_request(prompts_of([5], seed=2)[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    eng.step()  # prefill of the short request
    eng.add_request(prompts_of([60], seed=3)[0], GREEDY)
    steps = 0
    while not first.is_finished:
        before = len(first.output_ids)
        eng.step()
        assert len(first.output_ids) == before + 1  # one token every step while the long prompt is chunked
        steps += 1
    assert steps == 29
    while eng.has_unfinished():
        eng.step()
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_under_a_tiny_pool_completes_with_the_same_outputs(tiny_model_dir, prefix_caching):
    prompts = prompts_of([9, 14, 6, 11, 3], seed=4)
    params = [GREEDY, SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)] * 3
    big = make(tiny_model_dir).generate(prompts, params[:5])
    tiny = make(tiny_model_dir, num_pages=9, enable_prefix_caching=prefix_caching)  # 36 token slots, ~100 tokens
    outs = tiny.generate(prompts, params[:5])
    assert tiny.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in big]
    assert all(o.finish_reason == "length" for o in outs)
    assert tiny.kv_pool.num_free_pages() == 9


def test_request_that_can_never_fit_is_rejected_and_others_finish(tiny_model_dir):
    llm = make(tiny_model_dir, num_pages=6)
    outs = llm.generate(prompts_of([30, 4, 5], seed=5), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert outs[0].finish_reason == "error" and "KV pages" in outs[0].text
    assert [o.finish_reason for o in outs[1:]] == ["length", "length"]
    assert llm.kv_pool.num_free_pages() == 6


def test_prefix_cache_hits_are_counted_and_change_nothing(tiny_model_dir):
    shared = prompts_of([37], seed=6)[0]
    tails = prompts_of([5, 9, 1], seed=7)
    prompts = [shared + t for t in tails]
    cached = make(tiny_model_dir)
    first = cached.generate(prompts[:1], GREEDY)  # fills the cache with the shared prefix
    hits_before = cached.kv_pool.prefix_hit_tokens
    rest = cached.generate(prompts[1:], GREEDY)
    hit = cached.kv_pool.prefix_hit_tokens - hits_before
    assert hit >= 2 * (len(shared) // 4) * 4  # every shared full page, for both later requests
    plain = make(tiny_model_dir, enable_prefix_caching=False).generate(prompts, GREEDY)
    assert [o.token_ids for o in first + rest] == [o.token_ids for o in plain]
    assert cached.kv_pool.num_free_pages() == cached.kv_pool.num_pages
    # the same prompt again: everything but the last token comes from the cache
    before = cached.kv_pool.prefix_hit_tokens
    again = cached.generate(prompts[:1], GREEDY)
    assert cached.kv_pool.prefix_hit_tokens - before == (len(prompts[0]) - 1) // 4 * 4
    assert again[0].token_ids == first[0].token_ids


def test_shared_pages_are_reference_counted(tiny_model_dir):
    llm = make(tiny_model_dir)
    eng, pool = llm.engine, llm.kv_pool
    base = prompts_of([24], seed=8)[0]
    a = eng.add_request(base + [1], GREEDY)
    eng.step()
    b = eng.add_request(base + [2], GREEDY)
    eng.step()
    shared = set(pool.pages_of(a.seq_id)) & set(pool.pages_of(b.seq_id))
    assert len(shared) == 6  # 24 tokens = 6 full pages held by both
    eng.abort(a)
    assert all(p in pool.pages_of(b.seq_id) for p in shared)  # b still holds them
    while eng.has_unfinished():
        eng.step()
    assert pool.num_free_pages() == pool.num_pages


def test_max_num_seqs_and_fifo_admission(tiny_model_dir):
    llm = make(tiny_model_dir, max_num_seqs=2)
    eng = llm.engine
    seqs = [eng.add_request(p, GREEDY) for p in prompts_of([4, 5, 6, 7], seed=9)]
    admitted_order = []
    while eng.has_unfinished():
        eng.step()
        assert len(eng.running) <= 2
        for s in eng.running:
            if s not in admitted_order:
                admitted_order.append(s)
    assert admitted_order == seqs
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages


def test_scheduler_rejects_bad_limits(tiny_model_dir):
    llm = make(tiny_model_dir)
    with pytest.raises(ValueError):
        Scheduler(llm.kv_pool, max_num_seqs=0)
    with pytest.raises(ValueError):
        Scheduler(llm.kv_pool, max_num_batched_tokens=0)


def test_static_buffer_decode_path_with_padding_equals_eager(tiny_model_dir):
    """The graphed-decode path (static buffers, batch padded with scratch-page rows) run eagerly on
    CPU gives the same greedy tokens and logprobs as the plain path, at batch sizes that need padding."""
    from specmla.engine.cuda_graphs import GraphedDecoder, graph_batch_sizes

    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    prompts = prompts_of([3, 12, 7, 20, 5], seed=11)  # 5 and 3 running requests: padded to 8 and 4
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    plain = make(tiny_model_dir).generate(prompts, params)
    llm = make(tiny_model_dir, max_num_seqs=8)
    llm.engine.runner.graphed = GraphedDecoder(llm.model, llm.kv_pool, 8, 16, use_graphs=False)
    calls = []
    run = llm.engine.runner.graphed.run
    llm.engine.runner.graphed.run = lambda *a, **k: calls.append(len(k["input_ids"])) or run(*a, **k)
    outs = llm.generate(prompts, params)
    assert calls and max(calls) == 5  # the decode steps went through the static-buffer path
    for a, b in zip(outs, plain):
        assert a.token_ids == b.token_ids
        assert max(abs(x["logprob"] - y["logprob"]) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages
