"""Piecewise prefill (engine/prefill_graphs.py): the forward cut at each layer's attention, pieces replayed
per padded token count. On CPU the pieces run eagerly through the same static buffers and padding."""

import pytest
import torch

from specmla import LLM, SamplingParams
from specmla.engine.prefill_graphs import PiecewisePrefill, prefill_buckets
from specmla.engine.sequence import Sequence

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)


def prompts_of(lengths, seed=0, vocab=250):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def make(tiny_model_dir, **kw):
    return LLM(tiny_model_dir, **dict(dict(device="cpu", page_size=4, num_pages=256), **kw))


def with_pieces(llm, max_tokens):
    """Gives the runner eager pieces and records the token count of every step they run."""
    runner = llm.engine.runner
    runner.prefill_graphs = PiecewisePrefill(llm.model, llm.kv_pool, max_tokens, use_graphs=False)
    calls = []
    fwd = runner.prefill_graphs.forward
    runner.prefill_graphs.forward = lambda ids, *a: calls.append(len(ids)) or fwd(ids, *a)
    return calls


def test_buckets_cover_every_count_with_at_most_a_third_of_padding():
    sizes = prefill_buckets(2048)
    assert sizes[:4] == [16, 32, 48, 64] and sizes[-1] == 2048 and sizes == sorted(set(sizes))
    for n in range(1, 2049):
        b = next(s for s in sizes if s >= n)
        assert b - n < max(16, b / 3 + 1)
    assert prefill_buckets(10) == [10] and prefill_buckets(100)[-1] == 100


def test_piecewise_prefill_equals_the_plain_path(tiny_model_dir):
    """Ragged prompts in chunks (budget 16: chunks after a cached prefix, several requests per step, decode
    steps mixed in): the same greedy tokens and logprobs as the plain engine, every prefill step ran through
    the pieces, and every page comes back."""
    prompts = prompts_of([3, 41, 17, 1, 29, 8], seed=5)
    plain = make(tiny_model_dir, max_num_batched_tokens=16).generate(prompts, GREEDY)
    llm = make(tiny_model_dir, max_num_batched_tokens=16)
    calls = with_pieces(llm, 16)
    outs = llm.generate(prompts, GREEDY)
    assert calls and max(calls) == 16 and min(calls) < 16
    for a, b in zip(outs, plain):
        assert a.token_ids == b.token_ids
        assert max(abs(x["logprob"] - y["logprob"]) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages


def test_padding_rows_touch_only_the_scratch_page_and_poisoned_buffers_do_not_leak(tiny_model_dir):
    """One 11-token prompt in a 16-token bucket, with every static buffer NaN-poisoned beforehand: the logits
    equal the plain forward's, the cache rows of every page but the scratch page equal the plain run's."""
    prompt = prompts_of([11], seed=2)[0]
    ref_llm, llm = make(tiny_model_dir), make(tiny_model_dir)
    pieces = PiecewisePrefill(llm.model, llm.kv_pool, 32, use_graphs=False)
    for t in (pieces.x, pieces.q, pieces.c_kv, pieces.k_pe, pieces.o, pieces.hidden):
        t.fill_(float("nan"))
    llm.engine.runner.prefill_graphs = pieces
    before = [c.clone() for c in llm.kv_pool.caches]
    outs, pages = [], []
    for engine_llm in (ref_llm, llm):
        seq = Sequence(prompt_ids=prompt, params=GREEDY)
        engine_llm.kv_pool.allocate(seq.seq_id, len(prompt))
        outs.append(engine_llm.engine.runner.forward_logits([seq]))
        pages.append(engine_llm.kv_pool.slots(seq.seq_id, 0, len(prompt)))
    assert torch.isfinite(outs[1]).all()
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    ps = llm.kv_pool.page_size
    scratch = llm.kv_pool.scratch_page
    trunk = llm.model.config.num_hidden_layers  # (the MTP layers' caches are not written by a trunk forward)
    for i, (c, c0, ref) in enumerate(zip(llm.kv_pool.caches, before, ref_llm.kv_pool.caches)):
        rows = c.view(-1, c.shape[-1])
        other = torch.ones(rows.shape[0], dtype=torch.bool)
        if i < trunk:
            torch.testing.assert_close(rows[pages[1]], ref.view(-1, ref.shape[-1])[pages[0]], rtol=1e-5,
                                       atol=1e-5)
            other[pages[1]] = False
        other[scratch * ps : (scratch + 1) * ps] = False
        # bit for bit (unwritten rows may hold NaN)
        assert torch.equal(rows[other].view(torch.int32), c0.view(-1, c0.shape[-1])[other].view(torch.int32))


def test_mtp_catch_up_through_the_pieces_drafts_what_the_plain_path_drafts(tiny_model_dir):
    """A speculative MTP engine whose prompt steps and MTP catch-ups run through the pieces: the same drafts
    after every prefill step (so the same acceptance counts) and the same greedy tokens as without them."""
    prompts = prompts_of([3, 41, 17, 1, 29], seed=9)
    kw = dict(speculative="mtp", num_speculative_tokens=2, max_num_batched_tokens=16)
    plain_llm = make(tiny_model_dir, **kw)
    plain = plain_llm.generate(prompts, GREEDY)
    llm = make(tiny_model_dir, **kw)
    with_pieces(llm, 16)
    mtp_calls = []
    fwd = llm.engine.runner.prefill_graphs.mtp_forward
    llm.engine.runner.prefill_graphs.mtp_forward = lambda k, ids, *a: mtp_calls.append(len(ids)) or fwd(k, ids, *a)
    outs = llm.generate(prompts, GREEDY)
    assert mtp_calls and max(mtp_calls) <= 16
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert llm.engine.spec_stats.as_dict() == plain_llm.engine.spec_stats.as_dict()
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages


def test_steps_over_the_largest_bucket_run_the_plain_path(tiny_model_dir):
    prompts = prompts_of([40], seed=3)
    plain = make(tiny_model_dir).generate(prompts, GREEDY)
    llm = make(tiny_model_dir)
    calls = with_pieces(llm, 32)  # the prompt (40 tokens, one step) does not fit
    outs = llm.generate(prompts, GREEDY)
    assert outs[0].token_ids == plain[0].token_ids
    assert 40 not in calls
    with pytest.raises(ValueError, match="exceed"):
        llm.engine.runner.prefill_graphs.forward([1] * 33, [0] * 33, [0] * 33, None)


@pytest.mark.gpu
def test_gpu_graphed_pieces_equal_the_eager_engine(tiny_model_dir):
    """On the GPU the pieces are CUDA graphs: fp32 greedy tokens through them equal the eager engine's for ragged
    prompts in chunks, with more than one bucket captured; with MTP speculation the catch-up runs through its
    graphed pieces too and the output is still plain greedy."""
    prompts = prompts_of([3, 41, 17, 1, 29, 8, 100], seed=7)
    kw = dict(device="cuda", dtype="float32", page_size=16, num_pages=128, max_num_batched_tokens=64)
    eager = LLM(tiny_model_dir, enforce_eager=True, **kw).generate(prompts, GREEDY)
    for spec in (None, "mtp"):
        llm = LLM(tiny_model_dir, speculative=spec, **kw)
        pieces = llm.engine.runner.prefill_graphs
        assert pieces is not None and pieces.use_graphs
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
        assert len(pieces.graphs) >= 2
        assert bool(pieces.mtp_graphs) == (spec == "mtp")
