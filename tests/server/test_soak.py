"""Soak: 64 concurrent clients × 3 rounds against a 16-page pool, a quarter of them hanging up (streaming and not).
Every request completes or gets a clear error, the pool returns to empty, /health answers within 1 s throughout;
the p99 time to first token is printed."""

import asyncio
import json
import random
import statistics
import time

import httpx
from test_server import MODEL, metric, start_server, wait_until_idle

CLIENTS, ROUNDS = 64, 3


def test_soak_with_disconnects_on_a_tiny_pool(tiny_model_dir):
    proc, base, _ = start_server(tiny_model_dir, "--num-pages", "16", "--page-size", "16", "--max-num-seqs", "64",
                                 api_key=None)
    rng = random.Random(38)
    ttft, outcomes, health = [], [], []
    try:
        async def one(http, r, i):
            stream = i % 2 == 0
            leave = rng.random() < 0.25
            body = {"model": MODEL, "prompt": "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 40))),
                    "max_tokens": rng.randint(4, 24), "temperature": rng.choice([0, 0.8]), "stream": stream,
                    "seed": r * 1000 + i}
            t0 = time.perf_counter()
            if not stream:
                if leave:  # hang up before the answer
                    try:
                        await http.post(base + "/v1/completions", json=body, timeout=0.05)
                    except httpx.TimeoutException:
                        pass
                    return "left"
                resp = await http.post(base + "/v1/completions", json=body)
                assert resp.status_code in (200, 400, 503), resp.text
                if resp.status_code != 200:
                    assert resp.json()["error"]["message"]
                    return "error"
                ttft.append(time.perf_counter() - t0)
                assert resp.json()["choices"][0]["finish_reason"] in ("length", "stop")
                return "done"
            first = True
            async with http.stream("POST", base + "/v1/completions", json=body) as resp:
                assert resp.status_code in (200, 400, 503)
                if resp.status_code != 200:
                    return "error"
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    payload = json.loads(line[6:])
                    if "error" in payload:
                        assert payload["error"]["message"]
                        return "error"
                    if first:
                        ttft.append(time.perf_counter() - t0)
                        first = False
                    if leave and rng.random() < 0.3:
                        return "left"  # hang up mid-stream
            return "done"

        async def watch(http, stop):
            while not stop.is_set():
                t0 = time.perf_counter()
                r = await http.get(base + "/health", timeout=5)
                health.append((time.perf_counter() - t0, r.status_code))
                await asyncio.sleep(0.2)

        async def main():
            limits = httpx.Limits(max_connections=CLIENTS + 8)
            async with httpx.AsyncClient(timeout=120, limits=limits) as http, \
                    httpx.AsyncClient(timeout=5) as probe:
                stop = asyncio.Event()
                watcher = asyncio.create_task(watch(probe, stop))
                for r in range(ROUNDS):
                    outcomes.extend(await asyncio.gather(*(one(http, r, i) for i in range(CLIENTS))))
                stop.set()
                await watcher

        asyncio.run(asyncio.wait_for(main(), 240))
        assert len(outcomes) == CLIENTS * ROUNDS and outcomes.count("done") >= CLIENTS  # most complete
        assert health and max(t for t, _ in health) < 1.0 and all(code == 200 for _, code in health)
        m = wait_until_idle(base)
        assert metric(m, "specmla:kv_pages_used") == 0 and metric(m, "specmla:num_requests_running") == 0
        p99 = statistics.quantiles(ttft, n=100)[98]
        print(f"soak: {outcomes.count('done')} done, {outcomes.count('left')} left, {outcomes.count('error')} errors;"
              f" TTFT p50 {statistics.median(ttft) * 1e3:.0f} ms p99 {p99 * 1e3:.0f} ms;"
              f" /health max {max(t for t, _ in health) * 1e3:.0f} ms")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
