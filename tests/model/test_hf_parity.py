"""specmla's model vs transformers' DeepseekV2/V3ForCausalLM built from the same random weights (fp32)."""

import pytest
import torch
from helpers.hf_models import CONFIGS, build_hf_model, save_hf_model

from specmla import LLM, SamplingParams
from specmla.model.loader import load_model
from specmla.model.metadata import AttentionMetadata

PROMPT_LENS = [5, 17, 1, 33]


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    kind, overrides = CONFIGS[request.param]
    hf = build_hf_model(kind, overrides, seed=3)
    path = save_hf_model(hf, tmp_path_factory.mktemp(request.param), max_shard_size="100KB",
                         mtp_layers=1 if kind == "v3" else 0)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, overrides["vocab_size"], (n,), generator=g) for n in PROMPT_LENS]
    return hf, path, prompts


def test_logits_match_transformers_ragged_batch(pair):
    hf, path, prompts = pair
    ours = load_model(path, device="cpu", progress=False)
    with torch.no_grad():
        got = ours.compute_logits(ours(torch.cat(prompts), AttentionMetadata.for_contiguous(PROMPT_LENS)))
        want = torch.cat([hf(p[None]).logits[0] for p in prompts])
    assert got.shape == want.shape
    assert rel(got, want) <= 1e-4


def test_paged_prefill_and_decode_logits_match_transformers(pair):
    """Prefill through the paged cache, then absorbed decode steps: every step's logits == HF's."""
    hf, path, prompts = pair
    llm = LLM(path, device="cpu", page_size=4, num_pages=64)
    runner, recorded = llm.engine.runner, []
    forward = runner.forward_logits

    def recording_forward(seqs, q_lens=None, naive_context=False):
        ends = [s.num_cached + q for s, q in zip(seqs, q_lens)]
        ids = [list(s.all_ids[:e]) for s, e in zip(seqs, ends)]
        logits = forward(seqs, q_lens, naive_context)
        recorded.append((ids, logits))
        return logits

    runner.forward_logits = recording_forward
    llm.generate([p.tolist() for p in prompts], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(recorded) == 4  # one prefill step + three decode steps
    for ids, logits in recorded:
        with torch.no_grad():
            want = torch.stack([hf(torch.tensor([x]))[0][0, -1] for x in ids])
        assert rel(logits, want) <= 1e-4
    assert llm.kv_pool.num_free_pages() == 64


def test_greedy_generation_matches_transformers(pair):
    hf, path, prompts = pair
    llm = LLM(path, device="cpu", page_size=8, num_pages=128)
    outs = llm.generate([p.tolist() for p in prompts], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(p[None], max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0,
                              attention_mask=torch.ones(1, len(p), dtype=torch.long))
        assert o.token_ids == ref[0, len(p):].tolist()
        assert o.finish_reason == "length"
    assert llm.kv_pool.num_free_pages() == 128
