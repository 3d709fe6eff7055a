"""Defect class 1 on the real server (uvicorn on loopback, in a thread): a request that breaks an engine step ends
alone with a 500 in OpenAI's shape, counted under finish_reason="error", while streams beside it finish with the
same text as on their own."""

import asyncio
import json
import threading
import time

import httpx
import uvicorn
from test_server import MODEL, free_port, metric

CULPRIT_SEED = 4242  # marks the request whose steps fail


def failing_step(seqs):
    """The engine's test hook: a step that samples the culprit's request raises."""
    if any(s.params.seed == CULPRIT_SEED for s in seqs):
        raise RuntimeError("injected fault")


def test_a_request_that_breaks_a_step_fails_alone(tiny_model_dir):
    from specmla import LLM
    from specmla.server.app import create_app

    def load():
        llm = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=512)
        llm.engine.fault_hook = failing_step
        return llm

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(load, MODEL), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        victims = ["def f(x):", "import os", "class A:"]
        body = {"model": MODEL, "max_tokens": 24, "temperature": 0, "ignore_eos": True}

        async def stream(http, prompt):
            text = []
            async with http.stream("POST", base + "/v1/completions",
                                   json={**body, "prompt": prompt, "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        payload = json.loads(line[6:])
                        assert "error" not in payload, payload
                        text.append(payload["choices"][0]["text"])
            return "".join(text)

        async def run(with_culprit):
            async with httpx.AsyncClient(timeout=60) as http:
                tasks = [stream(http, p) for p in victims]
                if with_culprit:
                    tasks.append(http.post(base + "/v1/completions",
                                           json={**body, "prompt": "import sys", "seed": CULPRIT_SEED}))
                return await asyncio.gather(*tasks)

        alone = asyncio.run(run(False))
        *beside, culprit = asyncio.run(run(True))
        assert beside == alone
        assert culprit.status_code == 500
        err = culprit.json()["error"]
        assert err["type"] == "server_error" and "injected" not in culprit.text
        m = httpx.get(base + "/metrics").text
        assert metric(m, 'specmla:requests_total{finish_reason="error"}') == 1
        assert metric(m, "specmla:kv_pages_used") == 0
        assert httpx.get(base + "/health").status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=30)
