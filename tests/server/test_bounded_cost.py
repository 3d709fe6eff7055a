"""Bounded cost per request, against the real server on loopback: oversized prompts are refused before they cost
memory or stall the event loop; stalled uploads are closed; a model directory that would fail every request fails at
start (or, for chat alone, answers 503 naming why); the README's determinism sentence holds."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from test_server import KEY, MODEL, ROOT, free_port, start_server

from specmla.model.default import default_model_path

H = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
BODY_TIMEOUT_S = 8  # (20 s by default) long enough for 16 concurrent 16 MB uploads on two loaded cores


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module", params=[None, 200_000], ids=["context-512", "context-200k"])
def big_srv(tiny_model_dir, request):
    """The tiny model's server as it is (a 15 MB body is more than any request to it can use: refused as it
    arrives) and with a 200k-token context (such bodies are parsed, within the parser's limits); "embedded": the
    embedded model's server (context 4096), the battery's own setting."""
    model = default_model_path() if request.param == "embedded" else tiny_model_dir
    extra = ["--max-model-len", str(request.param)] if isinstance(request.param, int) else []
    proc, base, _ = start_server(model, "--num-pages", "256", "--max-num-seqs", "16",
                                 "--read-timeout", str(BODY_TIMEOUT_S), *extra)
    yield proc, base, request.param == 200_000
    proc.terminate()
    proc.wait(timeout=30)


def _victim_text(base: str, stream: bool) -> str:
    body = {"model": MODEL, "prompt": "the victim says", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    if not stream:
        return httpx.post(base + "/v1/completions", json=body, headers=H, timeout=60).json()["choices"][0]["text"]
    text = []
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, headers=H, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


# run in processes of their own, so that neither waits on the other's interpreter lock: the /health prober (every
# 0.25 s until told to stop on stdin) and the uploader (all bodies at once from asyncio, one connection each)
PROBER = """
import sys, threading, time, json, httpx
base, out, stop = sys.argv[1], [], threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
while not stop.is_set():
    t0 = time.perf_counter()
    r = httpx.get(base + "/health", timeout=5)
    out.append((r.status_code, time.perf_counter() - t0))
    time.sleep(0.25)
print(json.dumps(out))
"""
UPLOADER = """
import asyncio, sys, time, json, httpx
base, key, model = sys.argv[1:4]
text = json.dumps({"model": model, "prompt": "ab " * 5_242_880}).encode()
ids = json.dumps({"model": model, "prompt": [5] * 5_442_880}).encode()
assert 15 << 20 < len(text) < 16 << 20 and 15 << 20 < len(ids) < 16 << 20
headers = {"Authorization": "Bearer " + key, "Content-Type": "application/json"}
async def one(client, body):
    t0 = time.perf_counter()
    r = await client.post(base + "/v1/completions", content=body, headers=headers)
    return r.status_code, time.perf_counter() - t0, r.json()["error"]
async def main():
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=16)) as client:
        print(json.dumps(await asyncio.gather(*[one(client, b) for b in [text] * 8 + [ids] * 8])))
print("ready", flush=True)
sys.stdin.readline()
asyncio.run(main())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the server's RSS from /proc")
@pytest.mark.parametrize("big_srv", [None, 200_000, "embedded"], indirect=True,
                         ids=["context-512", "context-200k", "embedded"])
def test_oversized_prompts_are_refused_cheaply_beside_a_stream(big_srv):
    """Eight 15.7 MB text prompts and eight 16 MB token-id prompts at once (under the 16 MiB body limit, far past
    the context): each a 400 within 2 s; the server grows by < 500 MB at its peak and comes back within 100 MB;
    /health answers every 0.25 s probe within 0.5 s; a greedy stream beside them is unchanged. Where a 200k
    context makes the server parse such bodies, on the same two cores as the client uploading 256 MB: each a 400
    within 6 s and every probe within 1 s."""
    proc, base, long_context = big_srv
    solo = _victim_text(base, stream=False)
    run = lambda code, *args: subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE,  # noqa
                                               stdout=subprocess.PIPE, text=True)
    uploader = run(UPLOADER, base, KEY, MODEL)
    assert uploader.stdout.readline().strip() == "ready"  # the bodies are built
    start = rss(proc.pid)
    stop, peak, victim = threading.Event(), [start], {}

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], rss(proc.pid))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    prober = run(PROBER, base)
    time.sleep(0.3)
    stream = threading.Thread(target=lambda: victim.update(text=_victim_text(base, stream=True)))
    stream.start()
    results = json.loads(uploader.communicate("go\n", timeout=120)[0])
    stream.join(60)
    time.sleep(1.0)
    health = json.loads(prober.communicate("", timeout=30)[0])
    stop.set()
    watcher.join(10)
    after = rss(proc.pid)
    print(f"\n400s in at most {max(dt for _, dt, _ in results):.2f} s; RSS {start >> 20} MB, peak +"
          f"{(peak[0] - start) >> 20} MB, after +{(after - start) >> 20} MB; /health worst "
          f"{max(dt for _, dt in health) * 1e3:.0f} ms over {len(health)} probes")
    assert len(results) == 16 and all(s == 400 for s, _, _ in results), [(s, e) for s, _, e in results if s != 400]
    assert all("context" in e["message"] for _, _, e in results), results
    if long_context:  # parsed: the prompt named
        assert all(e["param"] == "prompt" for _, _, e in results), results
    assert max(dt for _, dt, _ in results) < (6.0 if long_context else 2.0), sorted(dt for _, dt, _ in results)
    assert peak[0] - start < 500 << 20, (peak[0] - start) >> 20
    assert after - start < 100 << 20, (after - start) >> 20
    assert len(health) >= 4 and all(s == 200 and dt < (1.0 if long_context else 0.5) for s, dt in health), health
    assert victim["text"] == solo


def test_a_long_chat_is_refused_before_it_is_rendered(big_srv):
    _, base, _ = big_srv
    messages = [{"role": "user", "content": "word " * 200_000}]
    r = httpx.post(base + "/v1/chat/completions", json={"model": MODEL, "messages": messages}, headers=H, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    many = [{"role": "user", "content": ""}] * 50_000  # more messages than the context has tokens
    r = httpx.post(base + "/v1/chat/completions", json={"model": MODEL, "messages": many}, headers=H, timeout=30)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"], r.text
    r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "stop": ["s"] * 100_000},
                   headers=H, timeout=30)
    assert r.status_code == 400 and "strings" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("big_srv", [None], indirect=True, ids=["context-512"])
def test_stalled_uploads_are_answered_408_and_closed(big_srv):
    """Twenty connections send their headers and part of a body, then nothing: each gets a 408 and is closed within
    the read deadline (8 s here; 20 s by default); ten that send nothing, or part of their headers, are closed in the
    same time; the server keeps serving."""
    _, base, _ = big_srv
    port = int(base.rsplit(":", 1)[1])
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
    conns = []
    for i in range(30):  # 20 with part of a body; 5 with nothing; 5 with part of their headers
        s = socket.create_connection(("127.0.0.1", port), timeout=BODY_TIMEOUT_S + 10)
        s.sendall(head + b'{"model": "tiny", "prompt": "par' if i < 20 else b"" if i < 25 else head[:30])
        conns.append(s)
    t0 = time.perf_counter()
    for i, s in enumerate(conns):
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:  # closed by the server
                break
            data += chunk
        s.close()
        if i < 20:
            assert data.startswith(b"HTTP/1.1 408"), data[:200]
            assert b"did not arrive" in data
        else:  # no request to answer: closed
            assert data == b"", data[:200]
    assert time.perf_counter() - t0 < BODY_TIMEOUT_S + 3
    assert httpx.get(base + "/health", timeout=5).status_code == 200


def _copy(src, dst, **changes):
    shutil.copytree(src, dst)
    for name, edit in changes.items():
        path = dst / name
        data = json.loads(path.read_text())
        data.update(edit)
        path.write_text(json.dumps(data))
    return dst


def test_a_broken_chat_template_makes_chat_alone_unavailable(tiny_model_dir, tmp_path):
    from fastapi.testclient import TestClient

    from specmla import LLM
    from specmla.server.app import create_app

    model = _copy(tiny_model_dir, tmp_path / "m", **{"tokenizer_config.json": {"chat_template": "{% for %}"}})
    with TestClient(create_app(lambda: LLM(model, device="cpu"), MODEL), raise_server_exceptions=False) as c:
        deadline = time.time() + 60
        while c.get("/health").status_code != 200 and time.time() < deadline:
            time.sleep(0.05)
        for _ in range(3):
            r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 503, r.text
            assert "chat template" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("edit,fragment", [({"config.json": {"max_position_embeddings": 0}}, "max_position_embeddings"),
                                           ({"config.json": {"vocab_size": 200}}, "do not fit the model's vocabulary")],
                         ids=["zero-context", "tokenizer-past-vocab"])
def test_a_directory_that_fails_every_request_fails_at_start_with_one_line(tiny_model_dir, tmp_path, edit, fragment):
    model = _copy(tiny_model_dir, tmp_path / "m", **edit)
    cmd = [sys.executable, "-m", "specmla.cli", "serve", str(model), "--device", "cpu", "--port", str(free_port())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT),
                                                                                  "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and fragment in lines[0], proc.stderr


def test_a_zero_context_is_refused_by_the_api_too(tiny_model_dir, tmp_path):
    from specmla import LLM

    model = _copy(tiny_model_dir, tmp_path / "m", **{"config.json": {"max_position_embeddings": 0}})
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(model, device="cpu")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_model_dir, device="cpu", max_model_len=1)
