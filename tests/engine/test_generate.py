"""LLM.generate on a tiny random model: batching, sampling options, stops, pool accounting, bad input."""

import math

import pytest
import torch

from specmla import LLM, SamplingParams
from specmla.engine.kv_pool import KVPool
from specmla.model.metadata import AttentionMetadata

PROMPTS = ["def f(x):", "import os\nimport sys\n", "a", "class Foo:\n    def __init__(self):\n        self.x = 1\n"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=256)


def test_batch_equals_each_prompt_alone(llm):
    together = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, together):
        alone = llm.generate(prompt, GREEDY)[0]
        assert alone.token_ids == out.token_ids
        assert len(out.token_ids) == 12 and out.finish_reason == "length"
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages


def test_absorbed_decode_equals_naive_decode(llm):
    absorbed = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0))
    llm.engine.naive_decode = True
    try:
        naive = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0))
    finally:
        llm.engine.naive_decode = False
    for a, n in zip(absorbed, naive):
        assert a.token_ids == n.token_ids
        for la, ln in zip(a.logprobs, n.logprobs):
            assert la["logprob"] == pytest.approx(ln["logprob"], abs=1e-4)


def test_nan_poisoned_pool_changes_nothing(tiny_model_dir, llm):
    clean = llm.generate(PROMPTS, GREEDY)
    poisoned = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=256)
    poisoned.engine.pool.__init__(poisoned.model.num_cache_layers, 256, 4, poisoned.model.config.latent_dim,
                                  torch.float32, "cpu", fill=float("nan"))
    assert torch.isnan(poisoned.kv_pool.caches[0]).all()
    got = poisoned.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in clean]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    a = llm.generate(PROMPTS[0], params)[0]
    b = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], params)[1]
    assert a.token_ids == b.token_ids
    others = {tuple(llm.generate(PROMPTS[0], SamplingParams(max_tokens=10, temperature=1.0, seed=s,
                                                              ignore_eos=True))[0].token_ids) for s in range(5)}
    assert len(others) > 1


def test_seeded_requests_repeat_alone_and_in_the_same_batch(llm):
    """The README's determinism sentence: a seeded, sampled request repeated alone samples the same tokens, and so
    does a batch repeated as the same batch (the draws depend on (seed, step) only: tests/ops/test_sampling.py)."""
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=50, seed=s, ignore_eos=True)
              for s in (11, 12, 13, 14)]
    batch = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == batch
    for prompt, p in zip(PROMPTS, params):
        assert llm.generate(prompt, p)[0].token_ids == llm.generate(prompt, p)[0].token_ids


def test_top_p_that_float32_takes_as_zero_is_refused():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1e-300)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1e-40)  # a float32 subnormal
    assert SamplingParams(top_p=2.0**-126).top_p == 2.0**-126


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate(PROMPTS, GREEDY)
    k1 = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.9, top_k=1, seed=3, ignore_eos=True))
    p0 = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.9, top_p=1e-6, seed=3, ignore_eos=True))
    assert [o.token_ids for o in k1] == [o.token_ids for o in greedy]
    assert [o.token_ids for o in p0] == [o.token_ids for o in greedy]


def test_logprobs_are_log_softmax_of_the_model(llm):
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=3))[0]
    assert len(out.logprobs) == 3
    ids = list(out.prompt_token_ids)
    for tok, entry in zip(out.token_ids, out.logprobs):
        with torch.no_grad():
            hidden = llm.model(torch.tensor(ids), AttentionMetadata.for_contiguous([len(ids)]))
            logits = llm.model.compute_logits(hidden)
        ref = torch.log_softmax(logits[-1], -1)
        assert entry["token_id"] == tok
        assert entry["logprob"] == pytest.approx(ref[tok].item(), abs=1e-4)
        top = sorted(entry["top"].items(), key=lambda kv: -kv[1])
        assert [t for t, _ in top] == ref.topk(3).indices.tolist()
        ids.append(tok)


def test_stop_string_truncates_text(llm):
    full = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert len(full.text) >= 4
    stop = full.text[2:4]
    cut = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert stop not in cut.text


def test_eos_stops_unless_ignored(llm):
    full = llm.generate(PROMPTS[2], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    fake_eos = full.token_ids[3]
    first = full.token_ids.index(fake_eos)
    saved = llm.engine.eos_ids
    llm.engine.eos_ids = {fake_eos}
    try:
        stopped = llm.generate(PROMPTS[2], SamplingParams(max_tokens=10, temperature=0))[0]
        ignored = llm.generate(PROMPTS[2], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    finally:
        llm.engine.eos_ids = saved
    assert stopped.token_ids == full.token_ids[: first + 1] and stopped.finish_reason == "stop"
    assert ignored.token_ids == full.token_ids


def test_stream_yields_the_final_text(llm):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    pieces = list(llm.stream(PROMPTS[3], params))
    assert "".join(pieces) == llm.last_output.text == llm.generate(PROMPTS[3], params)[0].text
    assert llm.last_output.metrics["generated_tokens"] == 12


def test_bad_input_is_rejected_and_engine_keeps_working(llm):
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 2, 10**6]], GREEDY)
    with pytest.raises(ValueError, match="context"):
        llm.generate([[5] * 600], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="speculative"):
        LLM(llm.model_path, device="cpu", speculative="eagle")
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids  # still serving


def test_prompt_that_can_never_fit_gets_an_error_others_complete(tiny_model_dir):
    small = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=8)
    outs = small.generate(["x" * 40, "y"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert outs[0].finish_reason == "error" and "pages" in outs[0].text
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 4
    assert small.kv_pool.num_free_pages() == 8


def test_paged_memory_is_far_below_static_preallocation(llm):
    """The ShallowMLA Table-4 measure on a real run: peak pages × page_size vs max_batch × max_len."""
    pool: KVPool = llm.kv_pool
    pool.peak_pages_used = 0
    llm.generate(PROMPTS, GREEDY)
    used_tokens = pool.peak_pages_used * pool.page_size
    static_tokens = len(PROMPTS) * llm.engine.max_model_len
    assert 0 < used_tokens < 0.25 * static_tokens
    assert math.isclose(pool.peak_pages_used, sum(-(-(len(llm.tokenizer.encode(p)) + 12) // 4) for p in PROMPTS),
                        abs_tol=len(PROMPTS))


@pytest.mark.gpu
def test_gpu_engine_with_triton_decode_matches_cpu(tiny_model_dir):
    """The whole engine on CUDA (Triton decode) gives the CPU reference's greedy tokens (fp32)."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    gpu = LLM(tiny_model_dir, device="cuda", dtype="float32", page_size=16, num_pages=64).generate(PROMPTS, params)
    cpu = LLM(tiny_model_dir, device="cpu", dtype="float32", page_size=16, num_pages=64).generate(PROMPTS, params)
    for g, c in zip(gpu, cpu):
        assert g.token_ids == c.token_ids
        assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(g.logprobs, c.logprobs)) < 1e-3
    bf16 = LLM(tiny_model_dir, device="cuda", dtype="bfloat16", page_size=16, num_pages=64)
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    outs = bf16.generate(PROMPTS, params)
    assert all(len(o.token_ids) == 16 for o in outs) and bf16.kv_pool.num_free_pages() == 64


@pytest.mark.gpu
def test_gpu_a_graph_captured_after_the_decode_graphs_reads_zeroed_moe_counters():
    """Decode graphs of several batch sizes share one memory pool. The fused MoE's counters must not come from
    that pool (its graphs' intermediates overwrite them between replays; the align kernel then wrote out of
    bounds): a graph captured later in its own pool, like the speculative verify step's, gives what the same
    step gives eagerly, after the decode graphs of B=1 and B=128 (the align's two-pass path) have run."""
    import random
    import sys
    from pathlib import Path

    from specmla.engine.cuda_graphs import GraphedDecoder

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_engine import V2_LITE, random_model

    # DeepSeek-V2-Lite's dimensions with 4 layers and 8704 positions: the shape in which the fault showed
    model = random_model(dict(V2_LITE, num_hidden_layers=4, max_position_embeddings=8704), "cuda", torch.bfloat16,
                         max_positions=8704)
    llm = LLM(model, max_num_seqs=128)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for batch in (1, 128):
        llm.generate([[rng.randrange(3, 1000) for _ in range(512)] for _ in range(batch)], params)
    pool, S, context = llm.kv_pool, 4, 512
    pool.allocate(-1, context + S)
    try:
        pages = pool.pages_of(-1)
        for c in pool.caches:
            c[torch.tensor(pages, device="cuda")] = torch.randn_like(c[:1]).expand(len(pages), *c.shape[1:])
        args = ([rng.randrange(3, 1000) for _ in range(S)], list(range(context, context + S)),
                pool.slots(-1, context, context + S), [context + S], [pages])
        max_pages = -(-model.max_positions // pool.page_size)
        graphed = []
        for q_len in (1, S):  # graphs in their own pools, captured after the engine's
            dec = GraphedDecoder(model, pool, 1, max_pages, query_len=q_len)
            for _ in range(3):  # capture, then replays
                hidden, _ = dec.run(args[0][:q_len], args[1][:q_len], args[2][:q_len], [context + q_len], args[4])
            graphed.append(hidden.float())
        torch.cuda.synchronize()
        eager = GraphedDecoder(model, pool, 1, max_pages, use_graphs=False, query_len=S).run(*args)[0].float()
        assert torch.isfinite(graphed[1]).all()
        torch.testing.assert_close(graphed[1], eager, rtol=2e-2, atol=2e-2)
    finally:
        pool.free(-1)
