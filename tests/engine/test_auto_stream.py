"""MTP auto under a request stream on the CPU, with the static-buffer decode, verify and whole-step paths the GPU
replays as graphs: requests arrive in bursts, some repeat a prompt (prefix-cache hits, some leaving one token to
compute), some are sampled, stopped by a string or aborted, and each decode step speculates or not at random.
No step may fail, greedy requests equal plain decoding, and every page comes back."""

import random

import pytest
from test_mtp_graph import spec_llm
from test_spec_graph import with_spec_step

from specmla import LLM, SamplingParams
from specmla.engine.cuda_graphs import GraphedDecoder


@pytest.mark.parametrize("seed", [0, 1])
def test_a_random_stream_of_mixed_requests_under_auto(tiny_model_dir, seed):
    rng = random.Random(seed)
    llm = spec_llm(tiny_model_dir, "auto", 3, max_num_batched_tokens=96)
    eng = llm.engine
    eng.runner.graphed = GraphedDecoder(llm.model, llm.kv_pool, 16, 64, use_graphs=False)
    with_spec_step(llm, 3)
    pol = eng.policy
    pol.online = False
    for b in range(1, 17):  # equal costs: every new request gets the MTP catch-up (`admit`)
        pol.seed(True, b, 1.0)
        pol.seed(False, b, 1.0)
    pol.choose = lambda ids: rng.random() < 0.5
    # prompts of 1 more than a multiple of the page (4) among others: a cached prefix leaves them one token
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (9, 13, 22, 30, 37, 41, 50)]
    seqs, greedy = [], []
    for step in range(70):
        if rng.random() < 0.4 or not eng.has_unfinished():
            for _ in range(rng.choice([1, 1, 2, 5])):
                prompt = rng.choice(prompts)
                sampled = rng.random() < 0.25
                params = SamplingParams(max_tokens=rng.randint(2, 20), temperature=0.8 if sampled else 0.0,
                                        seed=rng.randrange(99), ignore_eos=True,
                                        stop=["ab"] if rng.random() < 0.2 else None)
                s = eng.add_request(prompt, params)
                seqs.append(s)
                if not sampled:
                    greedy.append((s, prompt, params))
        live = [s for s in seqs if not s.is_finished]
        if live and rng.random() < 0.05:
            eng.abort(rng.choice(live))
        if eng.has_unfinished():
            eng.step()
    while eng.has_unfinished():
        eng.step()
    assert eng.num_failed_steps == 0 and not [s for s in seqs if s.finish_reason == "error"]
    assert llm.kv_pool.prefix_hit_tokens > 0
    done = [(s, p, sp) for s, p, sp in greedy if s.finish_reason != "abort"]
    ref = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=1024).generate([p for _, p, _ in done],
                                                                                  [sp for _, _, sp in done])
    assert [s.output_ids for s, _, _ in done] == [o.token_ids for o in ref]
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages
