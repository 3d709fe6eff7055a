"""Hostile and malformed requests against the real server (uvicorn on loopback): every failure is an
OpenAI-shaped error with the right status, never a 500 or a dropped connection, and the server keeps serving."""

import json

import httpx
import pytest

from test_server import KEY, MODEL

H = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def assert_openai_error(r, status, fragment=""):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert err["type"] and fragment in err["message"], err
    return err


def still_serves(base):
    r = httpx.post(base + "/v1/completions", headers=H, json={"model": MODEL, "prompt": "y", "max_tokens": 2})
    assert r.status_code == 200, r.text


RAW = [  # (raw body bytes, fragment)
    (b"{not json", "malformed"),
    (b'{"model": "tiny", "prompt": "\xff\xfe bad utf-8"}', "malformed"),
    (b'{"model": "tiny", "prompt": "lone \\ud800 surrogate"}', "surrogate"),
    (b'{"model": "tiny", "prompt": "x", "stop": ["\\udfff"]}', "surrogate"),
    (b"[1, 2, 3]", "invalid request"),
    (b"", "invalid request"),
]


@pytest.mark.parametrize("content,fragment", RAW)
def test_malformed_bodies_are_400(srv, content, fragment):
    r = httpx.post(srv + "/v1/completions", content=content, headers=H, timeout=10)
    assert_openai_error(r, 400, fragment)
    still_serves(srv)


def test_lone_surrogate_in_a_chat_message_is_400(srv):
    content = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud83d"}]}'
    r = httpx.post(srv + "/v1/chat/completions", content=content, headers=H, timeout=10)
    assert_openai_error(r, 400, "surrogate")


def test_unknown_route_and_wrong_method(srv):
    assert_openai_error(httpx.get(srv + "/v1/nope", headers=H), 404, "/v1/nope")
    assert_openai_error(httpx.get(srv + "/nope", headers=H), 404)
    err = assert_openai_error(httpx.get(srv + "/v1/completions", headers=H), 405, "GET")
    assert err["type"] == "invalid_request_error"
    assert_openai_error(httpx.delete(srv + "/v1/chat/completions", headers=H), 405)


def test_a_500_carries_no_internal_text(tiny_model_dir):
    import time

    from fastapi.testclient import TestClient

    from specmla import LLM
    from specmla.server.app import create_app

    def load():
        llm = LLM(tiny_model_dir, device="cpu")
        encode = llm.tokenizer.encode

        def broken(text, *a, **k):  # the start-up check's text still encodes; a request's text breaks it
            if text == "x":
                raise RuntimeError(f"secret detail {tiny_model_dir}")
            return encode(text, *a, **k)

        llm.tokenizer.encode = broken
        return llm

    with TestClient(create_app(load, MODEL), raise_server_exceptions=False) as c:
        deadline = time.time() + 30
        while c.get("/health").status_code != 200 and time.time() < deadline:
            time.sleep(0.05)
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        err = assert_openai_error(r, 500)
        assert "secret" not in r.text and str(tiny_model_dir) not in r.text
        assert err["type"] == "server_error"


MSG = [{"role": "user", "content": "hi"}]
INVALID = [  # (route, body, status, fragment of the message that names the param)
    ("completions", {"temperature": float("nan")}, 400, "temperature"),
    ("completions", {"temperature": float("inf")}, 400, "temperature"),
    ("completions", {"temperature": -1}, 400, "temperature"),
    ("completions", {"top_p": 1.5}, 400, "top_p"),
    ("completions", {"top_p": 0}, 400, "top_p"),
    ("completions", {"seed": 2**64}, 400, "seed"),
    ("completions", {"top_k": 2**63}, 400, "top_k"),
    ("completions", {"top_k": -2}, 400, "top_k"),
    ("completions", {"max_tokens": 2**70}, 400, "max_tokens"),
    ("completions", {"logprobs": 10000}, 400, "logprobs"),
    ("completions", {"echo": True}, 400, "echo is not supported"),
    ("completions", {"best_of": 3}, 400, "best_of > 1 is not supported"),
    ("completions", {"suffix": "}"}, 400, "suffix is not supported"),
    ("completions", {"n": 2}, 400, "n > 1 is not supported"),
    ("completions", {"presence_penalty": 0.5}, 400, "presence_penalty is not supported"),
    ("completions", {"prompt": "x" * 500, "max_tokens": 20}, 400, "context"),
    ("completions", {"stop": ["a"] * 33}, 400, "stop"),
    ("completions", {"stop": "a" * 513}, 400, "stop"),
    ("completions", {"stop": [""]}, 400, "stop"),
    ("completions", {"model": "gpt-4"}, 404, "does not exist"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"temperature": float("nan")}, 400, "temperature"),
    ("chat/completions", {"top_logprobs": 30, "logprobs": True}, 400, "top_logprobs"),
    ("chat/completions", {"top_logprobs": 2}, 400, "top_logprobs needs logprobs"),
    ("chat/completions", {"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("chat/completions", {"max_completion_tokens": 600}, 400, "max_completion_tokens"),
    ("chat/completions", {"n": 3}, 400, "n > 1"),
    # strict types, as OpenAI's API: no booleans for integers, no strings for numbers or booleans
    ("completions", {"max_tokens": True}, 400, "max_tokens"),
    ("completions", {"max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"temperature": "0.5"}, 400, "temperature"),
    ("completions", {"stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": [True, 5]}, 400, "prompt"),
    ("completions", {"stream": True, "stream_options": {"include_usage": 1}}, 400, "include_usage"),
    ("chat/completions", {"logprobs": 1}, 400, "logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400, "content"),
    # values the sampler's float32 would take as 0
    ("completions", {"top_p": 1e-300}, 400, "top_p"),
    ("completions", {"top_p": 1e-46}, 400, "top_p"),
]


@pytest.mark.parametrize("route,fields,status,fragment", INVALID)
def test_invalid_parameters_are_rejected_naming_them(srv, route, fields, status, fragment):
    body = {"model": MODEL, **({"prompt": "x"} if route == "completions" else {"messages": MSG}), **fields}
    # json.dumps writes NaN / Infinity, as clients in other languages may
    r = httpx.post(f"{srv}/v1/{route}", content=json.dumps(body).encode(), headers=H, timeout=10)
    err = assert_openai_error(r, status, fragment)
    if status == 400 and fragment in fields:  # a field of the request: named as the error's param too
        assert err["param"] and err["param"].split(".")[0] == fragment, err


def test_max_completion_tokens_wins_over_max_tokens(srv):
    body = {"model": MODEL, "messages": MSG, "max_tokens": 3, "max_completion_tokens": 5, "ignore_eos": True}
    r = httpx.post(srv + "/v1/chat/completions", json=body, headers=H, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    body = {"model": MODEL, "messages": MSG, "max_completion_tokens": 4, "ignore_eos": True}
    r = httpx.post(srv + "/v1/chat/completions", json=body, headers=H, timeout=30)
    assert r.json()["usage"]["completion_tokens"] == 4


def wait_healthy(c):
    import time

    deadline = time.time() + 30
    while c.get("/health").status_code != 200 and time.time() < deadline:
        time.sleep(0.05)


def test_a_request_that_cannot_fit_the_pool_is_rejected_up_front(tiny_model_dir):
    """8 pages of 4 tokens: a prompt that fits but whose max_tokens does not is a 400 before it runs;
    chat's default max_tokens is what is left, and the request runs to it."""
    from fastapi.testclient import TestClient

    from specmla import LLM
    from specmla.server.app import create_app

    with TestClient(create_app(lambda: LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=8), MODEL)) as c:
        wait_healthy(c)
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "abcdefgh", "max_tokens": 40})
        assert_openai_error(r, 400, "KV cache")
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG, "ignore_eos": True})
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        assert u["prompt_tokens"] + u["completion_tokens"] == 32


def test_the_api_key_guards_docs_and_openapi_too(srv):
    for path in ("/docs", "/openapi.json", "/redoc", "/v1/models", "/nope"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY}x"},
                        {"Authorization": KEY}):
            err = assert_openai_error(httpx.get(srv + path, headers=headers), 401)
            assert err["type"] == "authentication_error"
    assert httpx.get(srv + "/openapi.json", headers=H).json()["info"]["title"] == "specmla"
    assert httpx.get(srv + "/docs", headers=H).status_code == 200
    assert httpx.get(srv + "/health").status_code == 200 and httpx.get(srv + "/metrics").status_code == 200


def test_a_public_bind_without_a_key_warns(caplog):
    from specmla.server.app import warn_if_exposed

    with caplog.at_level("WARNING", logger="specmla.server"):
        assert warn_if_exposed("0.0.0.0", None)
        assert warn_if_exposed("::", None)
        assert warn_if_exposed("192.168.1.5", "") and warn_if_exposed("myhost.example", None)
        assert not warn_if_exposed("0.0.0.0", "k")
        assert not warn_if_exposed("127.0.0.1", None) and not warn_if_exposed("::1", None)
        assert not warn_if_exposed("localhost", None) and not warn_if_exposed(None, None)
    assert sum("without --api-key" in r.message for r in caplog.records) == 4


def test_a_body_over_the_limit_is_413(srv):
    big = json.dumps({"model": MODEL, "prompt": "x" * (17 * 2**20)}).encode()
    r = httpx.post(srv + "/v1/completions", content=big, headers=H, timeout=30)
    assert_openai_error(r, 413, "over")

    def chunks():  # no Content-Length: the limit holds while the body arrives
        for i in range(0, len(big), 2**20):
            yield big[i : i + 2**20]

    r = httpx.post(srv + "/v1/completions", content=chunks(), headers=H, timeout=30)
    assert_openai_error(r, 413, "over")
    still_serves(srv)


def test_health_answers_while_a_huge_prompt_is_tokenised(srv):
    """A 3 MB prompt (under the body limit, far over the context) tokenises in a worker thread:
    /health and a small request answer meanwhile, and the big one ends in a 400."""
    import threading
    import time

    result = {}

    def big():
        body = {"model": MODEL, "prompt": "ab cd ef " * 350_000}
        result["r"] = httpx.post(srv + "/v1/completions", json=body, headers=H, timeout=120)

    t = threading.Thread(target=big)
    t.start()
    worst, polls = 0.0, 0
    while t.is_alive() and polls < 200:
        t0 = time.perf_counter()
        assert httpx.get(srv + "/health", timeout=5).status_code == 200
        worst = max(worst, time.perf_counter() - t0)
        polls += 1
        time.sleep(0.02)
    t.join(120)
    assert_openai_error(result["r"], 400, "context")
    assert worst < 1.0, worst
    print(f"/health worst {worst * 1000:.0f} ms over {polls} polls")


def metric_value(base, name, label=""):
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + label + " ") or (not label and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_non_streaming_client_that_hangs_up_is_aborted(srv):
    """The client gives up after 0.1 s on a request that would decode ~480 tokens: the server notices within its
    disconnect poll, aborts it (counted as an abort) and frees its pages instead of decoding to the end."""
    import time

    aborts = metric_value(srv, "specmla:requests_total", '{finish_reason="abort"}')
    generated = metric_value(srv, "specmla:generation_tokens_total")
    body = {"model": MODEL, "messages": MSG, "ignore_eos": True}  # default max_tokens: the rest of the context
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv + "/v1/chat/completions", json=body, headers=H, timeout=httpx.Timeout(5, read=0.1))
    deadline = time.time() + 10
    while time.time() < deadline:
        if metric_value(srv, "specmla:requests_total", '{finish_reason="abort"}') > aborts:
            break
        time.sleep(0.05)
    assert metric_value(srv, "specmla:requests_total", '{finish_reason="abort"}') == aborts + 1
    assert metric_value(srv, "specmla:num_requests_running") == 0
    assert metric_value(srv, "specmla:kv_pages_used") == 0
    assert metric_value(srv, "specmla:generation_tokens_total") - generated < 450


def test_a_victim_stream_completes_unchanged_beside_hostile_requests(srv):
    """A greedy stream gives the same text as alone while malformed, invalid, oversized, logprob and
    disconnecting requests run beside it; every hostile one gets its 4xx (or is dropped by its client)."""
    import threading

    victim = {"model": MODEL, "prompt": "the victim", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(srv + "/v1/completions", json=victim, headers=H, timeout=60).json()["choices"][0]["text"]
    got = {}

    def stream():
        text = []
        with httpx.stream("POST", srv + "/v1/completions", json={**victim, "stream": True}, headers=H,
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    payload = json.loads(line[6:])
                    assert "error" not in payload, payload
                    text.append(payload["choices"][0]["text"])
        got["text"] = "".join(text)

    t = threading.Thread(target=stream)
    t.start()
    hostile = [
        (b'{"model": "tiny", "prompt": "\xff"}', 400),
        (b'{"model": "tiny", "prompt": "\\ud800"}', 400),
        (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400),
        (json.dumps({"model": MODEL, "prompt": "x", "stop": ["s"] * 200_000}).encode(), 400),
        (json.dumps({"model": MODEL, "prompt": "x", "logprobs": 10000}).encode(), 400),
        (json.dumps({"model": MODEL, "prompt": "x", "seed": 2**64, "top_k": 2**64}).encode(), 400),
        (json.dumps({"model": MODEL, "prompt": "y " * 400_000}).encode(), 400),
        (b"x" * (17 * 2**20), 413),
    ]
    for content, status in hostile:
        assert_openai_error(httpx.post(srv + "/v1/completions", content=content, headers=H, timeout=30), status)
    chat_lp = {"model": MODEL, "messages": MSG, "max_tokens": 4, "logprobs": True, "top_logprobs": 20}
    assert httpx.post(srv + "/v1/chat/completions", json=chat_lp, headers=H, timeout=30).status_code == 200
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv + "/v1/chat/completions", json={"model": MODEL, "messages": MSG, "ignore_eos": True},
                   headers=H, timeout=httpx.Timeout(5, read=0.3))
    t.join(60)
    assert got["text"] == alone


def test_a_failed_engine_step_is_a_500_without_internals_and_counted(tiny_model_dir):
    from fastapi.testclient import TestClient

    from specmla import LLM
    from specmla.server.app import create_app

    def load():
        llm = LLM(tiny_model_dir, device="cpu")

        def broken_step():
            raise RuntimeError(f"CUDA exploded in {tiny_model_dir}")

        llm.engine.step = broken_step
        return llm

    with TestClient(create_app(load, MODEL)) as c:
        wait_healthy(c)
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        err = assert_openai_error(r, 500, "internal error while generating")
        assert err["type"] == "server_error" and "exploded" not in r.text
        assert 'specmla:requests_total{finish_reason="error"} 1.0' in c.get("/metrics").text
        assert c.get("/health").status_code == 200
