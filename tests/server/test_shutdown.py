"""Bounded shutdown of the real server (specmla.server.app.serve, uvicorn on loopback): after SIGTERM
the requests in flight get `shutdown_timeout` seconds, then end with an error and the process exits;
a second SIGTERM exits at once."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from test_server import MODEL, free_port

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
from specmla import LLM
from specmla.server.app import create_app, serve
model, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
app = create_app(lambda: LLM(model, device="cpu", page_size=4, num_pages=512), "tiny")
serve(app, "127.0.0.1", port, log_level="warning", shutdown_timeout=timeout)
"""


def start(model_dir, shutdown_timeout):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(model_dir), str(port), str(shutdown_timeout)],
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("server did not become healthy")


LONG = {"model": MODEL, "prompt": "a", "max_tokens": 500, "ignore_eos": True}


def first_token_seen(base, results, key, stream):
    """Run one long request in a thread; `results[key]` gets the status and the last SSE payload / body."""
    started = threading.Event()

    def go():
        try:
            if stream:
                with httpx.stream("POST", base + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
                    last = None
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            last = json.loads(line[6:])
                            started.set()
                    results[key] = (r.status_code, last)
            else:
                started.set()
                r = httpx.post(base + "/v1/completions", json=LONG, timeout=60)
                results[key] = (r.status_code, r.json())
        except httpx.HTTPError as e:
            results[key] = (None, repr(e))
        finally:
            started.set()

    t = threading.Thread(target=go)
    t.start()
    assert started.wait(30)
    return t


def test_sigterm_ends_requests_in_flight_after_the_timeout(tiny_model_dir):
    # a short drain: the tiny model writes its 500 tokens in about a second on an idle CPU, and every request
    # must still be running when the drain ends
    proc, base = start(tiny_model_dir, 0.2)
    try:
        results = {}
        threads = [first_token_seen(base, results, i, stream=i < 3) for i in range(6)]
        time.sleep(0.3)  # the non-streaming requests reach the server
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=20)
        took = time.time() - t0
        for t in threads:
            t.join(20)
    finally:
        proc.kill()
    assert took < 8, took  # 0.2 s of drain, then the requests end and the process exits
    assert rc in (0, -signal.SIGTERM), rc
    for i in range(3):  # streams: an SSE error event
        status, last = results[i]
        assert status == 200 and "shutting down" in last["error"]["message"], results[i]
    for i in range(3, 6):  # non-streaming: a 503 in OpenAI's shape
        status, body = results[i]
        assert status == 503 and "shutting down" in body["error"]["message"], results[i]


def test_a_second_sigterm_exits_at_once(tiny_model_dir):
    proc, base = start(tiny_model_dir, 60.0)
    try:
        results = {}
        t = first_token_seen(base, results, 0, stream=True)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None  # draining: the stream goes on
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=5)
        assert time.time() - t0 < 3
        t.join(10)
    finally:
        proc.kill()


def test_a_model_that_fails_to_load_stops_the_server_with_its_reason(tmp_path):
    port = free_port()
    script = ("import sys\nfrom specmla import LLM\nfrom specmla.server.app import create_app, serve\n"
              f"sys.exit(serve(create_app(lambda: LLM({str(tmp_path / 'nonexistent')!r}, device='cpu'), 'x'),"
              f" '127.0.0.1', {port}))\n")
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "the model failed to load" in proc.stderr and "nonexistent" in proc.stderr
