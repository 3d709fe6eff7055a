"""Admission: every sampling field is checked for type and range, and a rejected request leaves the engine
state untouched while the requests already in flight go on unchanged."""

import math

import pytest

from specmla import LLM, SamplingParams
from specmla.sampling_params import MAX_LOGPROBS, MAX_STOP_LENGTH, MAX_STOP_STRINGS

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[5, 9, 13, 2], [40, 41, 42, 43, 44, 45, 46], [7]]

BAD_FIELDS = [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -0.5), ("temperature", "1"),
    ("temperature", True), ("top_p", 0), ("top_p", 1.5), ("top_p", math.nan), ("top_p", None),
    ("top_k", -2), ("top_k", 2**63), ("top_k", 1.5), ("top_k", True),
    ("seed", 2**63), ("seed", -(2**63) - 1), ("seed", 1.0), ("seed", "7"),
    ("max_tokens", 0), ("max_tokens", 2.0), ("max_tokens", None), ("max_tokens", 2**64),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", 10000), ("logprobs", True), ("logprobs", 1.0),
    ("stop", [""]), ("stop", [1]), ("stop", ["x"] * (MAX_STOP_STRINGS + 1)), ("stop", ["x" * (MAX_STOP_LENGTH + 1)]),
    ("stop", 5), ("ignore_eos", 1), ("ignore_eos", "yes"),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS)
def test_a_bad_field_is_a_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_boundary_values_are_accepted():
    SamplingParams(temperature=0, top_p=1, top_k=2**63 - 1, seed=-(2**63), logprobs=MAX_LOGPROBS,
                   stop=["x" * MAX_STOP_LENGTH] * MAX_STOP_STRINGS, max_tokens=1)
    assert SamplingParams(stop="ab").stop == ["ab"] and SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(top_k=0).top_k == 0  # 0 disables, like -1


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=128)


def test_a_rejected_request_touches_no_state_and_the_others_go_on(llm):
    clean = llm.generate(PROMPTS, GREEDY)
    engine, pool = llm.engine, llm.kv_pool
    seqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.step()
    engine.step()
    before = (list(engine.waiting), list(engine.running), pool.num_free_pages())
    for field, value in [("temperature", math.nan), ("seed", 2**64), ("top_k", 10**30), ("logprobs", 10000)]:
        bad = SamplingParams(max_tokens=4)
        setattr(bad, field, value)  # changed after construction: admission checks again
        with pytest.raises(ValueError, match=field):
            engine.add_request([1, 2, 3], bad)
    for prompt in ([], [1, True], [1, -1], None, 42):
        with pytest.raises(ValueError):
            engine.add_request(prompt, GREEDY)
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.add_request([1, 2], {"temperature": 0})
    assert (list(engine.waiting), list(engine.running), pool.num_free_pages()) == before
    while engine.has_unfinished():
        engine.step()
    assert [s.output_ids for s in seqs] == [o.token_ids for o in clean]
    assert pool.num_free_pages() == pool.num_pages


def test_extreme_but_valid_values_run(llm):
    params = [SamplingParams(max_tokens=5, temperature=0.7, top_k=2**63 - 1, seed=2**63 - 1, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=1.0, top_k=1, seed=-(2**63), ignore_eos=True,
                             logprobs=MAX_LOGPROBS)]
    outs = llm.generate(PROMPTS[:2], params)
    assert all(len(o.token_ids) == 5 and o.finish_reason == "length" for o in outs)
    assert len(outs[1].logprobs) == 5 and all(len(e["top"]) == MAX_LOGPROBS for e in outs[1].logprobs)
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages
