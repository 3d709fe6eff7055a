"""Request isolation: a failure inside a step ends only the request it belongs to, aborts free pages at
once, and a request that can never fit the KV pool is refused at admission."""

import pytest

from specmla import LLM, SamplingParams

PROMPTS = [[5, 9, 13, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [7], [100, 101, 102, 103, 104, 105]]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=10, temperature=0.9, top_k=50, seed=11, ignore_eos=True)
PARAMS = [GREEDY, SEEDED, GREEDY, SEEDED]
CULPRIT = [200, 201, 202, 203, 204, 205, 206, 207, 208]  # 9 tokens: its prefill is chunked beside the others


def make(tiny_model_dir, **kw):
    return LLM(tiny_model_dir, **dict(dict(device="cpu", page_size=4, num_pages=64, max_num_batched_tokens=8), **kw))


def failing_on(culprit_ids, at_output_len):
    """A fault hook that raises when the request with prompt `culprit_ids` is sampled with that many
    output tokens already."""

    def hook(seqs):
        for s in seqs:
            if s.prompt_ids == culprit_ids and len(s.output_ids) == at_output_len:
                raise RuntimeError("injected fault")

    return hook


@pytest.fixture(scope="module")
def clean(tiny_model_dir):
    return [o.token_ids for o in make(tiny_model_dir).generate(PROMPTS + [CULPRIT], PARAMS + [GREEDY])]


# the culprit fails during its (chunked) prefill, or in the middle of its decode
@pytest.mark.parametrize("speculative,at", [(None, 0), (None, 3), ("ngram", 3)])
def test_a_failing_request_ends_alone_and_the_others_are_unchanged(tiny_model_dir, clean, at, speculative):
    llm = make(tiny_model_dir, speculative=speculative, num_speculative_tokens=2)
    llm.engine.fault_hook = failing_on(CULPRIT, at)
    outs = llm.generate(PROMPTS[:2] + [CULPRIT] + PROMPTS[2:], PARAMS[:2] + [GREEDY] + PARAMS[2:])
    bad = outs.pop(2)
    assert bad.finish_reason == "error" and bad.error_reason == "step_error"
    assert "failed inside the engine" in bad.error and bad.text == bad.error
    assert "injected fault" not in bad.error  # no internal exception text for clients
    assert bad.token_ids == clean[4][:at]  # the tokens it had before the failing step
    assert [o.token_ids for o in outs] == clean[:4]
    assert all(o.finish_reason == "length" and o.error is None for o in outs)
    assert llm.engine.failures["step_error"] == 1 and llm.engine.num_failed_steps >= 1
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages
    llm.engine.fault_hook = None
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == clean[0]  # the engine still serves


def test_a_parameter_broken_after_admission_fails_only_its_request(tiny_model_dir, clean):
    llm = make(tiny_model_dir)
    engine = llm.engine
    seqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    broken = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    bad = engine.add_request(CULPRIT, broken)
    broken.logprobs = 10**6  # past admission: more alternatives than the vocabulary breaks the sampler
    while engine.has_unfinished():
        engine.step()
    assert bad.finish_reason == "error" and bad.error_reason == "step_error"
    assert [s.output_ids for s in seqs] == clean[:4]
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages


def test_abort_by_id_frees_pages_at_once_running_or_waiting(tiny_model_dir):
    llm = make(tiny_model_dir, max_num_seqs=2)
    engine, pool = llm.engine, llm.kv_pool
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(p, long) for p in PROMPTS[:3]]
    for _ in range(4):
        engine.step()
    running, waiting = seqs[:2], seqs[2]
    assert all(s in engine.running for s in running) and waiting in engine.waiting
    used = pool.num_used_pages()
    assert engine.abort(running[0].seq_id) is True
    assert running[0].finish_reason == "abort" and running[0] not in engine.running
    assert pool.num_used_pages() < used and not pool.pages_of(running[0].seq_id)
    assert engine.abort(waiting.seq_id) is True and waiting not in engine.waiting
    assert engine.abort(running[1]) is True  # a Sequence works too
    assert pool.num_free_pages() == pool.num_pages and not engine.has_unfinished()
    assert engine.abort(running[1].seq_id) is False and engine.abort(10**9) is False
    assert llm.generate(PROMPTS[0], GREEDY)[0].finish_reason == "length"


def test_a_request_that_can_never_fit_the_pool_is_refused_at_admission(tiny_model_dir, clean):
    llm = make(tiny_model_dir, num_pages=8)  # 32 token slots
    engine = llm.engine
    assert engine.max_total_tokens == 33
    with pytest.raises(ValueError, match="KV pages"):
        engine.add_request([1] * 20, SamplingParams(max_tokens=14))  # 34 tokens
    assert not engine.has_unfinished() and engine.failures["kv_capacity"] == 1
    engine.add_request([1] * 20, SamplingParams(max_tokens=13))  # 33: fits
    engine.abort(next(iter(engine.waiting)))
    outs = llm.generate([[3] * 30] + PROMPTS[:2], [GREEDY] + PARAMS[:2])  # offline: an error output, the rest run
    assert outs[0].finish_reason == "error" and outs[0].error_reason == "kv_capacity"
    assert "KV pages" in outs[0].error and outs[0].token_ids == []
    assert [o.token_ids for o in outs[1:]] == clean[:2]
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages
