"""The one-replay greedy MTP step (`GraphedSpecStep`: verify, on-device acceptance, MTP catch-up and
drafts with device-computed positions and slots), run eagerly on CPU: lossless, and step for step the
same tokens, cache lengths and drafts as the two-graph path it replaces."""

import inspect
import json.encoder

import pytest
from test_mtp_graph import run_in_lockstep, spec_llm
from test_spec_engine import mixed_prompts

from specmla import LLM, SamplingParams
from specmla.engine.spec_graph import GraphedSpecStep
from specmla.model.default import ASSETS


def code_prompts(n: int) -> list[list[int]]:
    """Slices of a stdlib module of mixed lengths, tokenised: the embedded model drafts them well,
    so steps accept anywhere from 0 to k drafts."""
    src = inspect.getsource(json.encoder)
    tok = LLM(ASSETS, device="cpu", num_pages=8).tokenizer
    return [tok.encode(src[300 * i : 300 * i + 30 + 41 * i]) for i in range(n)]


def with_spec_step(llm, k, max_num_seqs=16, pages=64, chained=None):
    """Gives the engine a static-buffer (eager on CPU) whole-step graph; returns the batch sizes of its steps
    launched from the host (and appends those of the steps it chained on the device to `chained`)."""
    runner = llm.engine.runner
    g = runner.graphed_spec = GraphedSpecStep(llm.model, llm.kv_pool, max_num_seqs, pages, k, use_graphs=False)
    sizes = []
    launch, launch_chained = g.launch, g.launch_chained
    g.launch = lambda **kw: sizes.append(len(kw["seq_lens"])) or launch(**kw)
    g.launch_chained = lambda tables: (chained if chained is not None else []).append(len(tables)) or \
        launch_chained(tables)
    return sizes


@pytest.mark.parametrize("k", [1, 2, 4])
def test_one_replay_step_equals_the_two_graph_step_every_step(k):
    """The embedded model, two engines in lockstep over 11 code prompts whose max_tokens end them at different steps
    (padded sizes shrink 16 → 1): after every step the requests' tokens, cache lengths and next
    drafts are identical, the drafts equal a cache-free recomputation, the output equals plain
    greedy, and every page comes back."""
    prompts = code_prompts(11)
    max_tokens = [5 + 3 * (i % 6) for i in range(11)]
    plain = LLM(ASSETS, device="cpu", page_size=4, num_pages=1024).generate(
        prompts, [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens])
    fused, two = spec_llm(ASSETS, "mtp", k), spec_llm(ASSETS, "mtp", k)
    sizes = with_spec_step(fused, k)
    seqs, checked = run_in_lockstep((fused, two), prompts, max_tokens, k, max_checks=12)  # recomputing is slow
    assert [s.output_ids for s in seqs[0]] == [o.token_ids for o in plain]
    assert fused.engine.spec_stats.as_dict() == two.engine.spec_stats.as_dict()
    stats = fused.engine.spec_stats
    # some steps took every draft, some not
    assert len(stats.accepted_per_position) == k and stats.accepted_per_position[-1] > 0
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    assert max(sizes) == 11 and min(sizes) == 1 and len(set(sizes)) > 3  # the batch shrank through padded sizes
    assert checked >= 6
    assert fused.kv_pool.num_free_pages() == fused.kv_pool.num_pages


def test_sampled_or_logprob_batches_and_small_tables_take_the_two_graph_path(tiny_model_dir):
    """A batch with a sampled request, one asking for logprobs, or requests outgrowing the static
    table (8 pages = 32 tokens) runs the two-graph path; greedy requests stay lossless throughout."""
    prompts = [p for p in mixed_prompts(12, seed=3) if len(p) < 20][:4]
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=1024).generate(prompts, greedy)
    llm = spec_llm(tiny_model_dir, "mtp", 3)
    sizes = with_spec_step(llm, 3, pages=8)
    outs = llm.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    n_small_table = len(sizes)
    assert n_small_table > 0  # the short early steps fit the table; the later ones fell back
    assert llm.engine.spec_stats.num_drafts > n_small_table

    llm = spec_llm(tiny_model_dir, "mtp", 3)
    sizes = with_spec_step(llm, 3)
    mixed = [greedy, SamplingParams(max_tokens=20, temperature=0.8, seed=1, ignore_eos=True), greedy,
             SamplingParams(max_tokens=20, temperature=0, logprobs=2, ignore_eos=True)]
    outs = llm.generate(prompts, mixed)
    assert sizes == []  # every step held a sampled or a logprob request
    assert outs[0].token_ids == plain[0].token_ids and outs[2].token_ids == plain[2].token_ids
    assert outs[3].token_ids == plain[3].token_ids and len(outs[3].logprobs) == 20
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages


def test_bad_batches_are_refused_with_a_clear_error(tiny_model_dir):
    llm = spec_llm(tiny_model_dir, "mtp", 2)
    g = GraphedSpecStep(llm.model, llm.kv_pool, 4, 8, 2, use_graphs=False)
    with pytest.raises(ValueError, match="does not fit"):  # more requests than the largest padded size
        g.run(input_ids=[1] * 15, num_drafts=[2] * 5, positions=list(range(15)), slots=list(range(15)),
              seq_lens=[3] * 5, tables=[[0]] * 5)
    with pytest.raises(ValueError, match="does not fit"):  # a table wider than the static one
        g.run(input_ids=[1] * 3, num_drafts=[2], positions=[4, 5, 6], slots=[4, 5, 6], seq_lens=[7],
              tables=[list(range(9))])
    with pytest.raises(ValueError, match="k must be"):
        GraphedSpecStep(llm.model, llm.kv_pool, 4, 8, 0, use_graphs=False)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_gpu_one_replay_step_is_lossless_under_graph_capture(batch):
    """On the GPU the step is a captured CUDA graph: fp32 greedy output through it equals plain
    greedy decoding (fp32: no bf16 tile-shape rounding differences), and it is the path taken."""
    prompts = code_prompts(8)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = LLM(ASSETS, device="cuda", dtype="float32", max_num_seqs=batch).generate(prompts, params)
    llm = LLM(ASSETS, device="cuda", dtype="float32", max_num_seqs=batch, speculative="mtp",
              num_speculative_tokens=3)
    g = llm.engine.runner.graphed_spec
    sizes = []
    launch, launch_chained = g.launch, g.launch_chained
    g.launch = lambda **kw: sizes.append(len(kw["seq_lens"])) or launch(**kw)
    g.launch_chained = lambda tables: sizes.append(len(tables)) or launch_chained(tables)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    # every spec step was graphed: 8 × 39 tokens after prefill, at most k + 1 = 4 per request and step
    assert len(sizes) >= 8 * 39 // (4 * batch) and g.graphs and g.chained
    assert llm.engine.spec_stats.mean_acceptance_length > 1.5


def test_one_draft_after_prefill_is_lossless_and_drafts_k_later(monkeypatch):
    """With graphed decode steps the MTP module drafts a single token after a prefill (further drafts there
    would be eager passes). Forced on here with the static buffers run eagerly: the first decode step sees
    one draft, later steps k, and the output equals plain greedy."""
    from specmla.engine.engine import LLMEngine

    k = 3
    prompts = code_prompts(5)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = LLM(ASSETS, device="cpu", page_size=4, num_pages=1024).generate(prompts, params)
    llm = spec_llm(ASSETS, "mtp", k)
    assert llm.engine._drafts_after_prefill() == k  # static buffers without CUDA graphs: every draft
    with_spec_step(llm, k)
    monkeypatch.setattr(LLMEngine, "_drafts_after_prefill", lambda self: 1)
    seqs = [llm.engine.add_request(p, params) for p in prompts]
    llm.engine.step()  # the prefill step (every prompt fits the token budget)
    assert all(s.num_cached == s.total_len - 1 and len(s.drafts) == 1 for s in seqs)
    llm.engine.step()
    assert all(len(s.drafts) == k for s in seqs if not s.is_finished)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert [s.output_ids for s in seqs] == [o.token_ids for o in plain]


@pytest.mark.parametrize("k", [1, 3])
def test_pipelined_steps_are_lossless_through_finishes_and_arrivals(k):
    """Pipelined (the default), each greedy MTP step launches the one after it before its result is read, the
    inputs derived on the device. Requests ending on max_tokens, on a stop string the device cannot see (the
    step launched after it is dropped), requests arriving while others decode: the output equals plain greedy
    token for token, with the same texts and finish reasons, both kinds of launch happen, and every page comes
    back. With pipeline_decode=False nothing is chained."""
    prompts = code_prompts(7)
    params = [SamplingParams(max_tokens=8 + 5 * i, temperature=0, ignore_eos=bool(i % 3),
                             stop=["\n\n", ":\n"] if i % 2 else None) for i in range(7)]
    plain = LLM(ASSETS, device="cpu", page_size=4, num_pages=1024).generate(prompts, params)
    for pipelined in (True, False):
        llm = spec_llm(ASSETS, "mtp", k, pipeline_decode=pipelined)
        chained = []
        host = with_spec_step(llm, k, chained=chained)
        eng = llm.engine
        seqs = [eng.add_request(p, sp) for p, sp in zip(prompts[:4], params[:4])]
        steps = 0
        while eng.has_unfinished():
            eng.step()
            steps += 1
            if steps == 3:  # arrivals while the first four decode
                seqs += [eng.add_request(p, sp) for p, sp in zip(prompts[4:], params[4:])]
        outs = [eng.output_of(s) for s in seqs]
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        assert [(o.text, o.finish_reason) for o in outs] == [(o.text, o.finish_reason) for o in plain]
        assert host and (len(chained) > len(host) if pipelined else not chained)
        assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages
    assert {o.finish_reason for o in plain} == {"stop", "length"}
