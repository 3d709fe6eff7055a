"""The static-buffer MTP drafter (`GraphedMtpDrafter`: catch-up over S = 1 + k rows + k - 1 draft
steps, one CUDA graph replay on a GPU), run eagerly on CPU: lossless, and its drafts equal those of
the eager `ModelRunner.mtp_catch_up_and_draft` step for step."""

import pytest
import torch
from test_spec_engine import mixed_prompts, reference_mtp_drafts

from specmla import LLM, SamplingParams
from specmla.engine.cuda_graphs import GraphedDecoder
from specmla.engine.mtp_graph import GraphedMtpDrafter
from specmla.engine.spec import MtpProposer
from specmla.model.default import ASSETS


def spec_llm(model_dir, kind, k, static_mtp=True, static_verify=True, max_num_seqs=16, mtp_pages=64, **kw):
    llm = LLM(model_dir, device="cpu", page_size=4, num_pages=1024, max_num_seqs=max_num_seqs, speculative=kind,
              num_speculative_tokens=k, **kw)
    runner = llm.engine.runner
    if static_verify:
        runner.graphed_verify = GraphedDecoder(llm.model, llm.kv_pool, max_num_seqs, 64, use_graphs=False,
                                               query_len=k + 1)
    if static_mtp:
        runner.graphed_mtp = GraphedMtpDrafter(llm.model, llm.kv_pool, max_num_seqs, mtp_pages, k, use_graphs=False,
                                               num_draft=llm.engine.proposer.num_mtp_drafts)
    return llm


def count_calls(llm):
    """Batch sizes of the static drafter's steps and the number of eager catch-up calls."""
    runner = llm.engine.runner
    sizes, eager = [], []
    run, catch_up = runner.graphed_mtp.run, runner.mtp_catch_up_and_draft
    runner.graphed_mtp.run = lambda **kw: sizes.append(len(kw["seq_lens"])) or run(**kw)
    runner.mtp_catch_up_and_draft = lambda items, k: eager.append(len(items)) or catch_up(items, k)
    return sizes, eager


@pytest.mark.parametrize("kind,k", [("mtp", 1), ("mtp", 2), ("mtp", 3), ("hybrid", 2), ("hybrid", 3)])
def test_static_mtp_drafter_is_lossless_and_drafts_like_the_eager_one(tiny_model_dir, kind, k):
    """Mixed prompt lengths, different max_tokens (requests finish mid-batch, the batch shrinks
    through padded sizes 16 → 8 → 4 → 2 → 1): greedy output equals plain greedy, and the spec
    counters equal those of the eager MTP proposer (so every draft was the same)."""
    prompts = mixed_prompts(11, seed=7)
    params = [SamplingParams(max_tokens=6 + 3 * (i % 5), temperature=0, ignore_eos=True) for i in range(11)]
    plain = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=1024).generate(prompts, params)
    eager = spec_llm(tiny_model_dir, kind, k, static_mtp=False)
    ref = eager.generate(prompts, params)
    llm = spec_llm(tiny_model_dir, kind, k)
    sizes, eager_calls = count_calls(llm)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [o.token_ids for o in ref] == [o.token_ids for o in plain]
    assert llm.engine.spec_stats.as_dict() == eager.engine.spec_stats.as_dict()
    assert [o.metrics["spec"] for o in outs] == [o.metrics["spec"] for o in ref]
    assert max(sizes) == 11 and len(set(sizes)) > 2  # shrinking, padded batches
    assert len(eager_calls) <= 2  # only the prefill steps' catch-up runs eagerly
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages


def run_in_lockstep(engines, prompts, max_tokens, k, max_checks=None):
    """Step two engines side by side over the same greedy requests; after every step each request's
    tokens, cache length and next drafts must be equal, and (up to max_checks times) the drafts
    must equal a cache-free recomputation. Returns (the first engine's and the second's requests,
    the number of recomputations checked)."""
    seqs = [[llm.engine.add_request(p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
             for p, m in zip(prompts, max_tokens)] for llm in engines]
    checked = 0
    while engines[0].engine.has_unfinished():
        for llm in engines:
            llm.engine.step()
        for a, b in zip(*seqs):
            assert a.output_ids == b.output_ids and a.num_cached == b.num_cached
            if not a.is_finished:
                assert a.drafts == b.drafts
                if a.drafts and (max_checks is None or checked < max_checks):
                    assert a.drafts == reference_mtp_drafts(engines[0].model, a.all_ids, k)
                    checked += 1
    assert not engines[1].engine.has_unfinished()
    return seqs, checked


class OracleMtpProposer(MtpProposer):
    """Drafts a varying number of the true greedy continuation's tokens, then the MTP drafts, so
    verify steps emit anywhere from 1 to k + 1 tokens."""

    whole_step_graph = False  # its drafts come from propose_for, not from the graphed step

    def __init__(self, k, truth):
        super().__init__(k)
        self.truth = truth  # prompt tuple → plain greedy output

    def propose_for(self, seqs, caps, device):
        drafts = torch.zeros(len(seqs), self.k, dtype=torch.long)
        num = []
        for i, (s, cap) in enumerate(zip(seqs, caps)):
            n_true = (len(s.prompt_ids) * 7 + len(s.output_ids) * 3) % (self.k + 1)
            true = self.truth[tuple(s.prompt_ids)][len(s.output_ids) : len(s.output_ids) + n_true]
            d = (true + s.drafts[len(true) :])[: min(cap, self.k)]
            drafts[i, : len(d)] = torch.tensor(d, dtype=torch.long)
            num.append(len(d))
        return drafts.to(device), torch.tensor(num, dtype=torch.int32, device=device)


@pytest.mark.parametrize("k", [2, 3])
def test_static_mtp_drafts_equal_eager_drafts_every_step(tiny_model_dir, k):
    """Two engines in lockstep, one drafting through the static buffers and one eagerly, with an
    oracle that makes the verify steps accept 0..k drafts: after every step each request's drafts
    are identical, and equal a cache-free recomputation of the MTP module."""
    prompts = mixed_prompts(3, seed=9)  # 3 requests → padded to 4
    max_tokens = [14, 9, 17]
    plain = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=1024).generate(
        prompts, [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)] * 3)
    truth = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    engines = []
    for static in (True, False):
        llm = spec_llm(tiny_model_dir, "mtp", k, static_mtp=static, max_num_seqs=4)
        llm.engine.proposer = OracleMtpProposer(k, truth)
        engines.append(llm)
    sizes, _ = count_calls(engines[0])
    seqs, checked = run_in_lockstep(engines, prompts, max_tokens, k)
    for a, p, m in zip(seqs[0], prompts, max_tokens):
        assert a.output_ids == truth[tuple(p)][:m]
    acc = engines[0].engine.spec_stats.accepted_per_position
    assert len(acc) == k and acc[-1] > 0  # some steps emitted k + 1 tokens
    assert engines[0].engine.spec_stats.as_dict() == engines[1].engine.spec_stats.as_dict()
    assert checked >= 10 and sizes and set(sizes) >= {3, 2, 1}


def test_static_mtp_drafter_falls_back_to_eager_when_the_table_is_too_small(tiny_model_dir):
    """Requests whose pages outgrow the drafter's static table (6 pages = 24 tokens here) take the
    eager path; the output stays lossless."""
    prompts = [p for p in mixed_prompts(12, seed=3) if len(p) < 16][:5]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=1024).generate(prompts, params)
    llm = spec_llm(tiny_model_dir, "mtp", 2, mtp_pages=6)
    sizes, eager_calls = count_calls(llm)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sizes and len(eager_calls) > 2  # both paths were taken
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages


def test_a_one_token_prefill_chunk_catches_the_mtp_module_up_on_its_own_states():
    """A prompt whose leading pages are cached computes its last token alone, through the decode graph, in a step
    beside another request's verify pass. The MTP module must catch up on that token's own trunk state (not the
    verify pass's, which the step computed before it): the request then drafts exactly what the request that
    computed the same prompt whole drafted, no step fails, and the output equals plain greedy decoding."""
    from test_spec_graph import code_prompts

    prompt = code_prompts(6)[5]
    prompt = prompt[: (len(prompt) - 1) // 4 * 4 + 1]  # full pages and one token: a cached prefix leaves that one
    assert len(prompt) > 12
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = LLM(ASSETS, device="cpu", page_size=4, num_pages=1024).generate([prompt], params)[0].token_ids
    llm = spec_llm(ASSETS, "mtp", 3, static_mtp=False)
    llm.engine.runner.graphed = GraphedDecoder(llm.model, llm.kv_pool, 16, 64, use_graphs=False)
    eng = llm.engine
    first = eng.add_request(prompt, params)
    eng.step()  # the whole prompt: its drafts follow
    drafts_whole = list(first.drafts)
    eng.step()  # a verify step: the runner's last trunk states are now the verify pass's
    again = eng.add_request(prompt, params)
    eng.step()  # its cached prefix leaves one token, computed by the decode graph after the first's verify
    assert again.num_cached == len(prompt) and again.output_ids == first.output_ids[:1]
    assert again.drafts == drafts_whole
    while eng.has_unfinished():
        eng.step()
    assert eng.num_failed_steps == 0
    assert first.output_ids == want and again.output_ids == want
    assert llm.kv_pool.prefix_hit_tokens == len(prompt) - 1
