"""`specmla serve`: the real server on a loopback port, driven by the official openai client and raw
HTTP; errors are OpenAI-shaped; a bounded load test with disconnecting clients and preemption."""

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key"
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, *extra, api_key=KEY):
    port = free_port()
    cmd = [sys.executable, "-m", "specmla.cli", "serve", str(model_dir), "--port", str(port), "--device", "cpu",
           "--served-model-name", MODEL, "--page-size", "4", *extra]
    if api_key:
        cmd += ["--api-key", api_key]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    saw_503 = False
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()}")
        try:
            r = httpx.get(base + "/health", timeout=2)
            if r.status_code == 200:
                return proc, base, saw_503
            saw_503 |= r.status_code == 503
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("server did not become healthy")


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def server(tiny_model_dir, request):
    """The server on one rank, and on two tensor-parallel ranks (gloo): every test here runs against both."""
    proc, base, saw_503 = start_server(tiny_model_dir, "--num-pages", "512", "--max-num-seqs", "32",
                                       "--tp", str(request.param))
    yield base, saw_503
    proc.terminate()
    proc.wait(timeout=30)


def client(base):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)


def test_models_and_health(server):
    base, _ = server
    models = client(base).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(base + "/health").json() == {"status": "ok"}


def test_completion_matches_llm_generate(server, tiny_model_dir):
    from specmla import LLM, SamplingParams

    base, _ = server
    r = client(base).completions.create(model=MODEL, prompt="def f(x):", max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
    want = LLM(tiny_model_dir, device="cpu").generate("def f(x):", SamplingParams(max_tokens=12, temperature=0,
                                                                                    ignore_eos=True))[0]
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(want.prompt_token_ids)


def test_streaming_completion_and_usage(server):
    base, _ = server
    c = client(base)
    full = c.completions.create(model=MODEL, prompt="import os", max_tokens=10, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    chunks = list(c.completions.create(model=MODEL, prompt="import os", max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


def test_chat_and_chat_streaming(server):
    base, _ = server
    c = client(base)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 8
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_raw_sse_format(server):
    base, _ = server
    with httpx.stream("POST", base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True, "ignore_eos": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "text_completion"


BAD = [  # (body or raw bytes, expected status, fragment of the message)
    (b"{not json", 400, "malformed"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10 ** 6}, 400, "context"),
    ({"model": MODEL, "prompt": "x" * 600}, 400, "context"),
    ({"model": MODEL, "prompt": "x", "n": 2}, 400, "n > 1"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": [1, 2, 10 ** 7]}, 400, "token ids"),
]


@pytest.mark.parametrize("body,status,fragment", BAD)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, fragment):
    base, _ = server
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(base + "/v1/completions", content=content, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"]
    ok = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 2}, headers=headers)
    assert ok.status_code == 200


def test_bad_api_key_is_401(server):
    base, _ = server
    r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x"},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(base + "/v1/models").status_code == 401
    assert httpx.get(base + "/health").status_code == 200  # health and metrics need no key


def test_metrics_exposes_the_counters(server):
    base, _ = server
    text = httpx.get(base + "/metrics").text
    for name in ("specmla:requests_total", "specmla:prompt_tokens_total", "specmla:generation_tokens_total",
                 "specmla:time_to_first_token_seconds_bucket", "specmla:time_per_output_token_seconds_bucket",
                 "specmla:num_requests_running", "specmla:num_requests_waiting", "specmla:kv_pages_used",
                 "specmla:spec_decode_num_drafts_total", "specmla:spec_decode_num_draft_tokens_total",
                 "specmla:spec_decode_num_accepted_tokens_total"):
        assert name in text, name


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_until_idle(base: str, timeout: float = 30.0) -> str:
    """The server's /metrics once no request runs and no KV page is used (or when `timeout` runs out)."""
    deadline = time.time() + timeout
    while True:
        m = httpx.get(base + "/metrics").text
        idle = metric(m, "specmla:kv_pages_used") == 0 and metric(m, "specmla:num_requests_running") == 0
        if idle or time.time() > deadline:
            return m
        time.sleep(0.1)


def test_load_with_disconnects_and_preemption(tiny_model_dir):
    """64 concurrent streaming clients (a quarter hang up mid-stream) on a pool small enough to
    preempt: every other request completes with LLM.generate's greedy output, nothing returns 5xx,
    and afterwards no KV page is in use."""
    from specmla import LLM, SamplingParams

    proc, base, saw_503 = start_server(tiny_model_dir, "--num-pages", "40", "--max-num-seqs", "64",
                                       "--speculative", "ngram", "--num-speculative-tokens", "2", api_key=None)
    rng = random.Random(0)
    prompts = ["".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 30))) for _ in range(64)]
    leave = set(rng.sample(range(64), 16))
    try:
        async def one(i, http):
            body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 16, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            text, n = [], 0
            async with http.stream("POST", base + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line or line == "data: [DONE]":
                        continue
                    payload = json.loads(line[6:])
                    assert "error" not in payload, payload
                    text.append(payload["choices"][0]["text"])
                    n += 1
                    if i in leave and n >= rng.randint(1, 4):
                        return None  # hang up mid-stream
            return "".join(text)

        async def main():
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(*(one(i, http) for i in range(64)))

        results = asyncio.run(main())
        want = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=2048).generate(
            prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        for i, (got, w) in enumerate(zip(results, want)):
            if i not in leave:
                assert got == w.text, i
        m = wait_until_idle(base)
        assert metric(m, "specmla:kv_pages_used") == 0
        assert metric(m, "specmla:num_preemptions") > 0  # the pool was small enough to preempt
        assert metric(m, "specmla:spec_decode_num_drafts_total") > 0
        assert httpx.get(base + "/health").status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_health_is_503_while_the_model_loads_and_requests_wait(tiny_model_dir):
    import threading

    from fastapi.testclient import TestClient

    from specmla import LLM
    from specmla.server.app import create_app

    gate, warming = threading.Event(), threading.Event()
    phases = []

    def slow_load():
        def on_phase(p):
            phases.append(p)
            app.state.specmla.update(phase=p)
        on_phase("warming up")  # what a GPU's LLM reports while it compiles and captures (a CPU has no warm-up)
        warming.set()
        gate.wait(30)
        return LLM(tiny_model_dir, device="cpu", on_phase=on_phase)

    app = create_app(slow_load, MODEL)
    with TestClient(app) as c:
        assert warming.wait(30)
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "warming up"
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 503 and "warming up" in r.json()["error"]["message"]
        gate.set()
        deadline = time.time() + 30
        while c.get("/health").status_code != 200 and time.time() < deadline:
            time.sleep(0.05)
        assert c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 200
    assert phases == ["warming up", "loading"]  # the CPU LLM reported its load; it has nothing to warm up


def test_the_start_up_heap_is_frozen_once_ready(tiny_model_dir):
    """Once the model is loaded, the server moves the start-up heap out of the collector's view (gc.freeze): the
    oldest generation's collections then walk only what requests allocate, instead of every object of the model,
    its graphs and kernels while every stream waits."""
    import gc

    from fastapi.testclient import TestClient

    from specmla import LLM
    from specmla.server.app import create_app

    loaded = []

    def load():
        loaded.append(LLM(tiny_model_dir, device="cpu"))
        return loaded[0]

    gc.unfreeze()
    try:
        with TestClient(create_app(load, MODEL)) as c:
            deadline = time.time() + 60
            while c.get("/health").status_code != 200 and time.time() < deadline:
                time.sleep(0.05)
            assert gc.get_freeze_count() > 0
            engine = loaded[0].engine
            assert not any(o is engine for o in gc.get_objects())  # tracked, but frozen
            assert gc.is_tracked(engine)
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        gc.unfreeze()
