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


@pytest.mark.parametrize("static_verify", [False, True])
def test_mtp_drafts_equal_a_cache_free_recomputation(tiny_model_dir, static_verify):
    """After prefill and after every verify step, the drafts built from the paged MTP cache equal
    the ones recomputed from scratch (so the catch-up pass fills the MTP cache right), also when the
    verify step goes through the graphed decoder's static buffers."""
    from specmla.engine.cuda_graphs import GraphedDecoder

    k = 3
    llm = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=256, speculative="mtp", num_speculative_tokens=k)
    if static_verify:
        llm.engine.runner.graphed_verify = GraphedDecoder(llm.model, llm.kv_pool, 8, 64, use_graphs=False,
                                                          query_len=k + 1)
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


def test_speculative_sampling_follows_the_target_distribution_end_to_end(tiny_model_dir):
    """Many seeded requests sample two tokens (top-k 3 keeps the support small). Token 2 comes from
    verifying a one-token draft that is the target's own most likely token (so drafts are accepted
    with probability p(draft), and rejected ones are resampled from the residual). The joint
    distribution of (token 1, token 2) must match the model's, computed exactly from its logits
    (χ², 8 degrees of freedom, below the 0.1 % critical value)."""
    import torch

    from specmla.model.metadata import AttentionMetadata
    from specmla.ops.sampling import apply_top_k_top_p

    prompt = [11, 45, 200, 3, 99, 7]
    temp, k_top, N = 1.5, 3, 1500
    llm = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=4096, max_num_seqs=N,
              max_num_batched_tokens=2048, speculative="ngram", num_speculative_tokens=1)

    def dist(ids):
        with torch.no_grad():
            hidden = llm.model(torch.tensor(ids), AttentionMetadata.for_contiguous([len(ids)]))
            logits = llm.model.compute_logits(hidden)
        masked = apply_top_k_top_p(logits[-1:] / temp, torch.tensor([k_top]), torch.tensor([1.0]))
        return masked.softmax(-1)[0]

    best = {}

    class TargetArgmaxProposer:  # drafts the target's most likely next token
        uses_mtp, k = False, 1

        def propose_for(self, seqs, caps, device):
            drafts = []
            for s in seqs:
                key = tuple(s.all_ids)
                if key not in best:
                    best[key] = int(dist(s.all_ids).argmax())
                drafts.append([best[key]])
            return torch.tensor(drafts), torch.tensor([min(1, c) for c in caps], dtype=torch.int32)

        def observe(self, seq, emitted):
            pass

        def forget(self, seq_id):
            pass

    llm.engine.proposer = TargetArgmaxProposer()
    params = [SamplingParams(max_tokens=3, temperature=temp, top_k=k_top, seed=s, ignore_eos=True) for s in range(N)]
    outs = llm.generate([prompt] * N, params)
    stats = llm.engine.spec_stats
    assert stats.num_drafts == N and 0.2 * N < stats.num_accepted_tokens < 0.95 * N  # both paths taken

    p1 = dist(prompt)
    expected = {}
    for t1 in p1.nonzero().flatten().tolist():
        p2 = dist(prompt + [t1])
        for t2 in p2.nonzero().flatten().tolist():
            expected[(t1, t2)] = (p1[t1] * p2[t2]).item()
    counts = {}
    for o in outs:
        key = tuple(o.token_ids[:2])
        assert key in expected, key
        counts[key] = counts.get(key, 0) + 1
    chi2 = sum((counts.get(key, 0) - N * p) ** 2 / (N * p) for key, p in expected.items())
    assert len(expected) == 9 and chi2 < 26.1


@pytest.mark.parametrize("kind", ["ngram", "mtp"])
def test_static_buffer_verify_path_with_padding_is_lossless(tiny_model_dir, kind):
    """The graphed verify path (S = 1 + k static buffers, padded batches on the scratch page), run
    eagerly on CPU, keeps speculation lossless and feeds the MTP catch-up the same hidden states."""
    from specmla.engine.cuda_graphs import GraphedDecoder

    prompts = mixed_prompts(11, seed=5)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=1024).generate(prompts, params)
    llm = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=1024, max_num_seqs=16, speculative=kind,
              num_speculative_tokens=3)
    runner = llm.engine.runner
    runner.graphed_verify = GraphedDecoder(llm.model, llm.kv_pool, 16, 64, use_graphs=False, query_len=4)
    calls = []
    run = runner.graphed_verify.run
    runner.graphed_verify.run = lambda **k: calls.append(len(k["seq_lens"])) or run(**k)
    outs = llm.generate(prompts, params)
    assert calls and max(calls) == 11  # padded to 16
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages


def test_spec_sweep_reports_output_and_decode_speedups(tiny_model_dir):
    """`specmla bench spec`'s sweep: each speculative row carries both speedups over the no-spec row (whole
    requests, and decode alone with first tokens left out), which are the ratios of the reported rates, and
    greedy outputs equal no-spec's."""
    from specmla.bench import format_spec_rows, run_spec_sweep

    def make_llm(mode, k):
        return LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=256, speculative=mode,
                   num_speculative_tokens=k)

    rows = run_spec_sweep(make_llm, mixed_prompts(3, seed=4), 6, ["none", "ngram"], [2], batch=2)
    base, spec = rows
    assert base["speedup"] == 1.0 and base["decode_speedup"] == 1.0 and spec["same_output"]
    assert spec["speedup"] == pytest.approx(spec["output_tok_per_s"] / base["output_tok_per_s"])
    assert spec["decode_speedup"] == pytest.approx(
        spec["decode_tok_per_s_per_request"] / base["decode_tok_per_s_per_request"])
    table = format_spec_rows(rows)
    assert "decode" in table.splitlines()[0] and f"{spec['decode_speedup']:.2f}x" in table.splitlines()[2]


def test_spec_sweep_rounds_report_medians_of_interleaved_runs(tiny_model_dir):
    """--rounds: every configuration timed once per round; its rates are the medians of its runs, and every
    run produced the same tokens."""
    import statistics

    from specmla.bench import run_spec_sweep

    built = []

    def make_llm(mode, k):
        built.append(mode)
        return LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=256, speculative=mode,
                   num_speculative_tokens=k)

    rows = run_spec_sweep(make_llm, mixed_prompts(2, seed=5), 5, ["none", "ngram"], [1, 2], batch=2, rounds=3)
    assert built == [None, "ngram", "ngram"] and [(r["mode"], r["k"]) for r in rows] == [("none", 0), ("ngram", 1),
                                                                                         ("ngram", 2)]
    for r in rows:
        assert len(r["runs"]) == 3 and r["same_across_runs"] and r["same_output"]
        assert r["output_tok_per_s"] == statistics.median(x["output_tok_per_s"] for x in r["runs"])
        assert r["decode_tok_per_s_per_request"] == statistics.median(x["decode_tok_per_s_per_request"]
                                                                       for x in r["runs"])
    assert rows[1]["speedup"] == pytest.approx(rows[1]["output_tok_per_s"] / rows[0]["output_tok_per_s"])


def test_first_token_and_finish_times_count_the_whole_step(tiny_model_dir, monkeypatch):
    """The caller gets a token when step() returns, so the MTP catch-up after a prefill (work done after
    the first token is sampled) belongs to TTFT, not to the decode time; same for the finishing step."""
    import time

    llm = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=256, speculative="mtp",
              num_speculative_tokens=2)
    runner, engine = llm.engine.runner, llm.engine
    catch_up, step = runner.mtp_catch_up_and_draft, engine.step
    pause, caught_up, stamped = 0.05, [], []

    def slow_catch_up(*a, **kw):
        catch_up(*a, **kw)
        time.sleep(pause)
        caught_up.append(time.perf_counter())

    def checked_step():
        start = time.perf_counter()
        out = step()
        end = time.perf_counter()
        for s in out:  # every time taken in this step lies after its last piece of work
            for t in (s.first_token_time, s.finish_time):
                if t is not None and t >= start:
                    assert max([start] + caught_up) <= t <= end
                    stamped.append(t)
        return out

    monkeypatch.setattr(runner, "mtp_catch_up_and_draft", slow_catch_up)
    monkeypatch.setattr(engine, "step", checked_step)
    outs = llm.generate(mixed_prompts(3, seed=5), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert caught_up and len(stamped) == 6  # 3 first tokens, 3 finishes
    for o in outs:
        assert o.metrics["ttft_s"] >= pause  # the prefill step's catch-up is inside TTFT
        assert o.metrics["e2e_s"] >= o.metrics["ttft_s"] and len(o.token_ids) == 6


@pytest.mark.parametrize("mode", ["mtp", "auto"])
def test_mtp_drafts_on_a_full_pool_take_only_the_pages_left(tiny_model_dir, mode):
    """A pool far smaller than the requests want (the scheduler preempts): after each verify the MTP module drafts
    only for the requests whose draft rows still fit, one after the other; no step fails, every request ends
    normally and every page comes back."""
    llm = LLM(tiny_model_dir, device="cpu", num_pages=16, page_size=16, max_num_seqs=64, speculative=mode)
    eng = llm.engine
    rng = random.Random(38)
    for r in range(3):
        seqs = [eng.add_request([rng.randrange(3, 250) for _ in range(rng.randint(1, 40))],
                                SamplingParams(max_tokens=rng.randint(4, 24), temperature=rng.choice([0, 0.8]),
                                               seed=r * 100 + i))
                for i in range(24)]
        while eng.has_unfinished():
            eng.step()
        assert all(s.finish_reason in ("length", "stop") for s in seqs), [s.error for s in seqs]
    assert eng.num_failed_steps == 0 and eng.scheduler.num_preemptions > 0
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages
