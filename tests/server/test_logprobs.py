"""Logprobs in OpenAI's shapes through the real server: completions `logprobs: N` and chat
`logprobs` + `top_logprobs`, streaming and not, equal to what the engine computes."""

import json

import httpx
import pytest

from test_server import KEY, MODEL, client

H = {"Authorization": f"Bearer {KEY}"}
MSGS = [{"role": "user", "content": "hello"}]


def stream_chunks(base, route, body):
    with httpx.stream("POST", f"{base}/v1/{route}", headers=H, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]


def test_completion_logprobs_match_the_engine(srv, tiny_model_dir):
    from specmla import LLM, SamplingParams

    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 6, "temperature": 0, "logprobs": 3,
            "ignore_eos": True}
    r = httpx.post(srv + "/v1/completions", headers=H, json=body, timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 6
    want = LLM(tiny_model_dir, device="cpu").generate(
        "def f(x):", SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True))[0]
    assert lp["token_logprobs"] == pytest.approx([e["logprob"] for e in want.logprobs], abs=1e-4)
    offsets = [0]
    for tok, top, chosen in zip(lp["tokens"], lp["top_logprobs"], lp["token_logprobs"]):
        assert 1 <= len(top) <= 4 and top[tok] == chosen  # distinct ids may decode alike (a partial UTF-8 byte)
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely token
        offsets.append(offsets[-1] + len(tok))
    assert lp["text_offset"] == offsets[:-1]

    chunks = stream_chunks(srv, "completions", body)
    got = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert sum((g["tokens"] for g in got), []) == lp["tokens"]
    assert sum((g["token_logprobs"] for g in got), []) == pytest.approx(lp["token_logprobs"], abs=1e-4)
    assert sum((g["text_offset"] for g in got), []) == lp["text_offset"]


def test_completion_logprobs_zero_and_none(srv):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "logprobs": 0, "ignore_eos": True}
    lp = httpx.post(srv + "/v1/completions", headers=H, json=body, timeout=60).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3 and all(len(t) == 1 for t in lp["top_logprobs"])
    assert all(x <= 0 for x in lp["token_logprobs"])
    body.pop("logprobs")
    assert httpx.post(srv + "/v1/completions", headers=H, json=body).json()["choices"][0]["logprobs"] is None


def test_chat_logprobs_with_the_openai_client(srv):
    c = client(srv)
    r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, temperature=0, logprobs=True,
                                  top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for item in content:
        assert item.logprob <= 0 and item.token == bytes(item.bytes).decode("utf-8", "replace")
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy
    # the raw bytes of the tokens (some hold part of a UTF-8 character) join into the reply's text
    assert b"".join(bytes(x.bytes) for x in content).decode("utf-8", "replace") == r.choices[0].message.content
    r0 = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, temperature=0, logprobs=True,
                                   extra_body={"ignore_eos": True})
    assert [x.token for x in r0.choices[0].logprobs.content] == [x.token for x in content]
    assert all(x.top_logprobs == [] for x in r0.choices[0].logprobs.content)
    plain = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
    assert plain.choices[0].logprobs is None

    chunks = list(c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, temperature=0, logprobs=True,
                                            top_logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert [x.token for x in streamed] == [x.token for x in content]
    assert [x.logprob for x in streamed] == pytest.approx([x.logprob for x in content], abs=1e-4)
