"""The `auto` draft length: the policy's acceptance estimate and choice against its cost model, and an engine that
switches between speculative and plain steps (MTP and n-gram) staying lossless."""

import random

import pytest
from test_spec_graph import code_prompts, with_spec_step
from test_spec_engine import mixed_prompts

from specmla import LLM, SamplingParams
from specmla.engine.cuda_graphs import GraphedDecoder
from specmla.engine.draft_policy import DraftPolicy
from specmla.model.default import ASSETS, build_random_model_dir
from helpers.tiny_config import TINY_TEST_CONFIG


def test_running_acceptance_follows_a_geometric_run_and_its_changes():
    """Each draft accepted with probability α while the ones before it were: the estimate lands near α, moves to a
    new α within a few dozen steps (decayed counts), and a new request starts from the engine's rate."""
    rng = random.Random(0)
    pol = DraftPolicy(4)

    def steps(seq, alpha, n):
        for _ in range(n):
            acc = 0
            while acc < 4 and rng.random() < alpha:
                acc += 1
            pol.observe(seq, 4, acc)

    steps(1, 0.85, 400)
    assert abs(pol.alpha(1) - 0.85) < 0.08
    steps(1, 0.3, 60)
    assert abs(pol.alpha(1) - 0.3) < 0.12
    assert abs(pol.alpha(2) - pol.alpha(1)) < 0.15  # never seen: the engine's running rate
    a = pol.alpha(1)
    assert pol.expected_tokens(1) == pytest.approx(1 + a + a * a + a ** 3 + a ** 4)
    pol.observe(1, 0, 0)  # a step without drafts teaches nothing
    assert pol.alpha(1) == a
    pol.mark_stale(1)
    assert pol.expected_tokens(1) == 1.0
    pol.forget(1)
    assert 1 not in pol.stale


def test_choice_compares_tokens_per_second_with_a_margin():
    pol = DraftPolicy(3, online=False, margin=0.1)
    for b in (1, 2, 4):
        pol.seed(True, b, 2.0)
        pol.seed(False, b, 1.0)
    for s in range(4):
        for _ in range(50):
            pol.observe(s, 3, 3)  # every draft accepted: E → 4 tokens a step
    assert pol.choose([0]) is True  # ~4 tokens / 2 s against 1 / 1 s
    for _ in range(50):
        pol.observe(0, 3, 0)  # nothing accepted: E → 1
    assert pol.choose([0]) is False
    # near the tie the side taken last stays
    pol2 = DraftPolicy(1, online=False, margin=0.1, prior=0.0, prior_weight=1e-9)
    pol2.seed(True, 1, 2.4)
    pol2.seed(False, 1, 1.0)
    for _ in range(30):
        pol2.observe(7, 10, 9)  # α = 0.9 (k = 1: E = 1.9)
    assert pol2.choose([7]) is False  # 0.79 tok/s against 1: plain
    pol2.seed(True, 1, 1.85)  # 1.03 against 1: within the margin, plain stays
    assert pol2.choose([7]) is False
    pol2.seed(True, 1, 1.6)  # 1.19 against 1: speculate
    assert pol2.choose([7]) is True
    pol2.seed(True, 1, 1.85)  # within the margin again: speculation stays
    assert pol2.choose([7]) is True
    assert pol2.as_dict()["speculative_steps"] == 2 and pol2.as_dict()["plain_steps"] == 2


def test_online_costs_follow_measured_steps_and_the_other_side_is_retried():
    pol = DraftPolicy(2, online=True, explore_every=5, ema=0.5)
    assert pol.choose([1]) is True  # nothing measured: speculate first
    pol.record(True, 1, 3.0)
    assert pol.choose([1]) is False  # then measure the plain side
    pol.record(False, 1, 1.0)
    picks = [pol.choose([1]) for _ in range(12)]  # E ≈ 1.96 / 3 s < 1 / 1 s: plain, the other side now and then
    assert picks.count(False) >= 9 and picks.count(True) >= 1
    for _ in range(6):
        pol.record(True, 1, 0.5)  # speculation got cheap
    assert pol.costs[(True, 1)] < 0.6
    assert pol.choose([1]) is True


def test_a_new_request_gets_the_prompt_catch_up_only_where_speculation_would_pay():
    """`admit`: a request at the engine's running rate must make a speculative step pay at the batch it joins; the
    prior admits, a run of rejected drafts stops it, a size where speculation is cheap still admits; unmeasured
    sizes admit."""
    pol = DraftPolicy(3, online=False)
    for b in (1, 2):
        pol.seed(True, b, 2.0)
        pol.seed(False, b, 1.0)
    pol.seed(True, 4, 1.0)
    pol.seed(False, 4, 1.0)
    assert pol.admit(1) and pol.admit(2)  # prior 0.6: E = 2.18 tokens / 2 s against 1 / 1 s
    for s in range(4):
        for _ in range(30):
            pol.observe(s, 3, 0)
    assert pol.engine_alpha() < 0.11  # the prior alone is left: E ≈ 1.1
    assert not pol.admit(1) and not pol.admit(0) and not pol.admit(2)  # E ≈ 1.1 / 2 s: plain, so no catch-up
    assert pol.admit(4)  # equal costs: a draft that may be accepted is free
    assert pol.admit(3)  # unmeasured
    for s in range(4):
        for _ in range(60):
            pol.observe(s, 3, 3)
    assert pol.admit(1)  # acceptance came back (requests already admitted taught it)


def test_requests_refused_the_catch_up_decode_plainly_and_pipelined_losslessly():
    """MTP auto on the embedded model: three requests speculate; then plain steps win at every size and the
    engine's rate falls to nothing, so requests arriving start stale: the MTP module never sees their prompts and
    their prefill steps run pipelined. Greedy output equals plain decoding and every page comes back."""
    prompts = code_prompts(8)
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0, ignore_eos=True) for i in range(8)]
    ref = LLM(ASSETS, device="cpu", page_size=4, num_pages=1024).generate(prompts, params)
    llm = LLM(ASSETS, device="cpu", page_size=4, num_pages=1024, max_num_seqs=16, speculative="auto",
              num_speculative_tokens=3)
    runner = llm.engine.runner
    runner.graphed = GraphedDecoder(llm.model, llm.kv_pool, 16, 64, use_graphs=False)
    pol = _switching(llm)  # speculation pays at every size
    eng = llm.engine
    caught_up, catch_up = [], runner.mtp_catch_up_and_draft
    runner.mtp_catch_up_and_draft = lambda items, k: caught_up.extend(
        s.seq_id for s, start, _ in items if start < len(s.prompt_ids) - 1) or catch_up(items, k)
    pipelined_prefill, run_pipelined = [], eng._run_pipelined
    eng._run_pipelined = lambda batch: pipelined_prefill.extend(s.seq_id for s, _ in batch.prefill) or run_pipelined(
        batch)
    seqs = [eng.add_request(p, sp) for p, sp in zip(prompts[:3], params[:3])]
    for _ in range(3):
        eng.step()
    _switching(llm, plain_sizes=set(range(1, 33)))  # from here plain steps win at every size
    for _ in range(40):
        pol.observe(-1, 3, 0)  # and the engine's rate falls to nothing (a request seen by no other)
    seqs += [eng.add_request(p, sp) for p, sp in zip(prompts[3:], params[3:])]
    while eng.has_unfinished():
        eng.step()
    early, late = {s.seq_id for s in seqs[:3]}, {s.seq_id for s in seqs[3:]}
    assert early <= set(caught_up) and not late & set(caught_up)  # the late prompts never reached the MTP module
    assert late <= set(pipelined_prefill)  # and their prefill ran in pipelined steps
    assert pol.steps[True] > 0 and pol.steps[False] > 0
    outs = [eng.output_of(s) for s in seqs]
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages and not pol.stale


def test_bad_policy_arguments_are_refused():
    with pytest.raises(ValueError, match="k_max"):
        DraftPolicy(0)
    with pytest.raises(ValueError, match="prior"):
        DraftPolicy(2, prior=1.0)


def _switching(llm, plain_below=None, plain_sizes=()):
    """Seed the engine's policy so that plain steps win at `plain_sizes` (padded = the batch) and speculation wins
    elsewhere, its costs fixed (not followed online)."""
    pol = llm.engine.policy
    pol.online = False
    pol.padded = lambda b: b
    for b in range(1, 33):
        pol.seed(True, b, 1.0)
        pol.seed(False, b, 0.05 if b in plain_sizes else 10.0)
    return pol


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_auto_switching_both_ways_is_lossless(k):
    """The embedded model, greedy requests of staggered lengths with arrivals and stop strings: the policy takes
    plain steps at even batch sizes and speculative ones at odd sizes, so the engine passes between the pipelined
    plain decode and the pipelined whole MTP step many times; requests decoded plainly stop drafting. The output
    equals plain greedy decoding token for token, and every page comes back."""
    prompts = code_prompts(7)
    params = [SamplingParams(max_tokens=6 + 5 * i, temperature=0, ignore_eos=bool(i % 3),
                             stop=["\n\n"] if i % 2 else None) for i in range(7)]
    ref = LLM(ASSETS, device="cpu", page_size=4, num_pages=1024).generate(prompts, params)
    llm = LLM(ASSETS, device="cpu", page_size=4, num_pages=1024, max_num_seqs=16, speculative="auto",
              num_speculative_tokens=k)
    assert llm.speculative == "mtp" and llm.engine.policy is not None
    runner = llm.engine.runner
    runner.graphed = GraphedDecoder(llm.model, llm.kv_pool, 16, 64, use_graphs=False)  # the plain side, static
    chained = []
    spec_steps = with_spec_step(llm, k, chained=chained)
    ahead, decode_ahead = [], runner.decode_ahead
    runner.decode_ahead = lambda seqs, ids: ahead.append(len(seqs)) or decode_ahead(seqs, ids)
    pol = _switching(llm, plain_sizes={2, 4, 6})
    eng = llm.engine
    seqs = [eng.add_request(p, sp) for p, sp in zip(prompts[:5], params[:5])]
    stale_seen, n = set(), 0
    while eng.has_unfinished():
        eng.step()
        stale_seen |= pol.stale
        n += 1
        if n == 4:
            seqs += [eng.add_request(p, sp) for p, sp in zip(prompts[5:], params[5:])]
    outs = [eng.output_of(s) for s in seqs]
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [(o.text, o.finish_reason) for o in outs] == [(o.text, o.finish_reason) for o in ref]
    assert pol.steps[True] > 0 and pol.steps[False] > 0
    assert spec_steps and chained and ahead  # both sides ran pipelined
    assert stale_seen and not pol.stale  # finished requests are forgotten
    assert eng.spec_stats.num_accepted_tokens > 0
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages


def test_ngram_auto_on_a_model_without_mtp_measures_and_switches(tmp_path):
    """A model without MTP layers: auto drafts with n-grams and follows measured step times; with plain steps
    forced at some sizes and sampled requests in the mix, greedy output equals plain decoding."""
    cfg = dict(TINY_TEST_CONFIG, num_nextn_predict_layers=0)
    path = build_random_model_dir(tmp_path / "no_mtp", cfg, seed=1)
    prompts = mixed_prompts(9, seed=3)
    greedy = [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True) for i in range(9)]
    ref = LLM(path, device="cpu", page_size=4, num_pages=512).generate(prompts, greedy)
    llm = LLM(path, device="cpu", page_size=4, num_pages=512, max_num_seqs=16, speculative="auto",
              num_speculative_tokens=3)
    assert llm.speculative == "ngram" and llm.engine.policy.online
    llm.engine.runner.graphed = GraphedDecoder(llm.model, llm.kv_pool, 16, 64, use_graphs=False)
    pol = _switching(llm, plain_sizes={3, 5, 8})
    pol.online = True  # followed online from here: the measured times move the costs
    out = llm.generate(prompts, greedy)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert pol.steps[True] > 0 and pol.steps[False] > 0
    assert any(c not in (0.05, 1.0, 10.0) for c in pol.costs.values())  # measured steps moved them
    sampled = llm.generate(prompts[:3], SamplingParams(max_tokens=12, temperature=0.9, seed=5))
    assert all(len(o.token_ids) == 12 for o in sampled)
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages


def test_auto_takes_the_models_mtp_and_bad_modes_are_refused(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", num_pages=64, speculative="auto", num_speculative_tokens=2)
    assert llm.speculative == "mtp" and llm.engine.proposer.k == 2 and llm.engine.policy.k == 2
    with pytest.raises(ValueError, match="speculative='fast'"):
        LLM(tiny_model_dir, device="cpu", num_pages=64, speculative="fast")


def test_warm_up_measures_both_sides_with_the_engines_own_steps():
    """`warmup.measure_step_costs` runs greedy requests at every padded size with each side forced and seeds the
    policy with the timed steps; the engine is left as it was (no request, every page free, no history)."""
    from specmla.engine import warmup

    llm = LLM(ASSETS, device="cpu", page_size=4, num_pages=512, max_num_seqs=5, speculative="auto",
              num_speculative_tokens=2)
    eng = llm.engine
    eng.runner.graphed = GraphedDecoder(llm.model, llm.kv_pool, 5, 64, use_graphs=False)
    with_spec_step(llm, 2, max_num_seqs=5)
    pol = eng.policy
    pol.padded = eng.runner.graphed.padded_size
    spec_steps = []
    whole = eng._whole_spec_step
    eng._whole_spec_step = lambda *a, **kw: spec_steps.append(1) or whole(*a, **kw)
    assert warmup.measure_step_costs(eng, steps=2)
    sizes = eng.runner.graphed.sizes
    assert sizes == [1, 2, 4, 5]
    assert set(pol.costs) == {(spec, b) for spec in (True, False) for b in sizes}
    assert all(t > 0 for t in pol.costs.values()) and spec_steps
    assert not eng.has_unfinished() and llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages
    assert not pol.steps and not pol.stale and pol.force is None and eng.spec_stats.num_drafts == 0
    small = LLM(ASSETS, device="cpu", page_size=4, num_pages=20, max_num_seqs=5, speculative="auto")
    small.engine.runner.graphed = GraphedDecoder(small.model, small.kv_pool, 5, 64, use_graphs=False)
    assert not warmup.measure_step_costs(small.engine) and not small.engine.policy.costs  # no room: nothing


class _Req:
    def __init__(self, seq_id, ids, drafts):
        self.seq_id, self.all_ids, self.drafts = seq_id, ids, drafts


def test_hybrid_scores_both_sources_and_takes_the_better_per_request():
    """Request 1 repeats itself (its n-gram drafts come true, its MTP drafts do not); request 2 the other way: after a
    few steps each takes the other source, scored on the tokens each step emitted."""
    from specmla.engine.spec import HybridProposer

    hp = HybridProposer(3, 1, 2)
    loop = [11, 12, 13, 14]
    r1, r2 = _Req(1, loop * 3, [90, 91, 92]), _Req(2, [5, 6, 7, 8], [40, 41, 42])
    assert hp.prefers_mtp(r1) and hp.prefers_mtp(r2)  # nothing seen: the MTP drafts
    for _ in range(4):
        hp.candidates([r1, r2], [3, 3])
        hp.observe(r1, loop[:4])  # continues the loop: n-gram [11, 12, 13] all match, MTP none
        hp.observe(r2, [40, 41, 3])  # two MTP drafts come true; no n-gram draft (nothing recurs)
    assert not hp.prefers_mtp(r1) and hp.prefers_mtp(r2)
    assert hp.candidates([r1, r2], [2, 3]) == [[11, 12], [40, 41, 42]]
    hp.observe(_Req(9, [], []), [1])  # no candidates recorded: nothing to score
    hp.forget(1)
    assert hp.prefers_mtp(r1) and 1 not in hp.ngram._index


@pytest.mark.parametrize("k", [2, 3])
def test_hybrid_mixing_sources_per_request_is_lossless(k):
    """The embedded model, the hybrid proposer with its preference forced to change per request and step: batches
    where every request takes MTP drafts run the one-replay step (chained ahead), the others the verify path with
    n-gram drafts for some; the output equals plain greedy and every page comes back."""
    prompts = code_prompts(6)
    params = [SamplingParams(max_tokens=8 + 4 * i, temperature=0, ignore_eos=True) for i in range(6)]
    ref = LLM(ASSETS, device="cpu", page_size=4, num_pages=1024).generate(prompts, params)
    llm = LLM(ASSETS, device="cpu", page_size=4, num_pages=1024, max_num_seqs=16, speculative="hybrid",
              num_speculative_tokens=k)
    chained = []
    whole = with_spec_step(llm, k, chained=chained)
    hp = llm.engine.proposer
    calls = [0]

    def prefers(seq):
        calls[0] += 1
        return calls[0] // 13 % 2 == 0 or seq.seq_id % 2 == 0  # phases: all MTP, then mixed

    hp.prefers_mtp = prefers
    out = llm.generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert whole and calls[0] > 26 and llm.engine.spec_stats.num_accepted_tokens > 0  # both phases ran
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages
