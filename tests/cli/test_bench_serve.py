"""`specmla bench serve` (specmla/serving_bench.py): against a fake OpenAI server with injected delays it measures
those delays; against the real server with a tiny model its records are consistent with the server's own counts."""

import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from specmla import serving_bench
from specmla.serving_bench import Request, arrival_gaps, run_stream, summarize

TTFT, ITL = 0.5, 0.08  # the fake server's injected delays (s)
HELPERS = Path(__file__).parent.parent / "helpers"


@pytest.fixture(scope="module")
def fake_server():
    """The fake server in its own process (a thread would share this process's interpreter lock with the client)."""
    port = serving_bench.free_port()
    proc = subprocess.Popen([sys.executable, str(HELPERS / "fake_openai_server.py"), str(port), str(TTFT), str(ITL)])
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("the fake server did not start")
            time.sleep(0.05)
    yield base
    proc.terminate()
    proc.wait(timeout=30)


def test_the_injected_delays_are_what_it_measures(fake_server):
    reqs = [Request([5] * (10 + i), 9) for i in range(8)]
    records, wall = asyncio.run(run_stream(fake_server, "fake", reqs, float("inf"), max_concurrency=8,
                                           progress=False))
    s = summarize(records, wall, slo={"ttft": TTFT * 1e3 * 1.5, "tpot": ITL * 1e3 * 1.5})
    assert s["completed"] == 8 and s["failed"] == 0
    assert s["p50_ttft_ms"] == pytest.approx(TTFT * 1e3, rel=0.1)
    assert s["p50_itl_ms"] == pytest.approx(ITL * 1e3, rel=0.1)
    assert s["p50_tpot_ms"] == pytest.approx(ITL * 1e3, rel=0.1)
    one = TTFT + 8 * ITL  # every request is in flight at once: the run takes one request's time
    assert s["output_throughput"] == pytest.approx(8 * 9 / one, rel=0.1)
    assert s["input_tokens"] == sum(10 + i for i in range(8)) and s["output_tokens"] == 72
    assert s["goodput"] == pytest.approx(s["request_throughput"])
    # one at a time: the run takes four requests' time
    records, wall = asyncio.run(run_stream(fake_server, "fake", reqs[:4], float("inf"), max_concurrency=1,
                                           progress=False))
    assert wall == pytest.approx(4 * one, rel=0.1)


def test_poisson_arrivals_have_the_rate_and_burstiness_their_spread():
    gaps = arrival_gaps(4000, rate=20.0, burstiness=1.0, seed=1)
    assert statistics.fmean(gaps) == pytest.approx(1 / 20, rel=0.06)
    assert statistics.pstdev(gaps) == pytest.approx(1 / 20, rel=0.1)  # exponential: sd = mean
    bursty = arrival_gaps(4000, rate=20.0, burstiness=0.25, seed=1)
    assert statistics.fmean(bursty) == pytest.approx(1 / 20, rel=0.15)
    assert statistics.pstdev(bursty) > 1.6 * statistics.pstdev(gaps)  # shape 0.25: sd = 2 × mean
    assert arrival_gaps(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]


def test_failures_are_counted_not_measured(fake_server):
    records, wall = asyncio.run(run_stream(fake_server + "/nowhere", "fake", [Request([1, 2], 3)] * 2,
                                           float("inf"), progress=False, warmup=False))
    s = summarize(records, wall)
    with pytest.raises(RuntimeError, match="warm-up request failed: HTTP 404"):
        asyncio.run(run_stream(fake_server + "/nowhere", "fake", [Request([1, 2], 3)], float("inf"), progress=False))
    assert s["failed"] == 2 and s["completed"] == 0 and "404" in s["first_error"] and s["p50_ttft_ms"] is None


def test_percentiles_interpolate_like_numpy():
    assert serving_bench._pct([4, 1, 3, 2], 50) == 2.5
    assert serving_bench._pct([1, 2, 3, 4, 5], 90) == pytest.approx(4.6)
    assert serving_bench._pct([], 50) is None


def test_a_rate_sweep_against_the_real_server(tiny_model_dir, tmp_path):
    """`--launch` starts the server on the tiny model; two rates; every record is consistent: TTFT ≤ E2E, output
    tokens = the server's usage = max_tokens (ignore_eos), p50 ≤ p90 ≤ p99, no failure; the JSON and plot land."""
    out, png = tmp_path / "serve.json", tmp_path / "sweep.png"
    log = tmp_path / "server.log"
    rc = serving_bench.main([
        "--launch", f"{tiny_model_dir} --device cpu --num-pages 256 --page-size 4 --max-num-seqs 16 --log-level info",
        "--server-log", str(log),
        "--sweep-rates", "8,inf", "--num-prompts", "6", "--input-len", "12", "--output-len", "6", "--range-ratio",
        "0.5", "--random-vocab", "250", "--json", str(out), "--plot", str(png), "--no-progress",
        "--slo", "ttft_ms=60000,tpot_ms=60000"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["server_startup_s"] > 0 and len(data["runs"]) == 2 and png.stat().st_size > 1000
    assert "POST /v1/completions" in log.read_text()  # the server's own log, kept
    for run in data["runs"]:
        s = run["summary"]
        assert s["failed"] == 0 and s["completed"] == 6 and s["goodput"] == pytest.approx(s["request_throughput"])
        for name in ("ttft", "tpot", "itl", "e2e"):
            assert s[f"p50_{name}_ms"] <= s[f"p90_{name}_ms"] <= s[f"p99_{name}_ms"]
        for r in run["records"]:
            assert r["ok"] and 0 < r["ttft"] <= r["e2e"]
            assert r["output_tokens"] == r["max_tokens"] and 3 <= r["max_tokens"] <= 9
            assert 6 <= r["prompt_tokens"] <= 18
        assert s["output_tokens"] == sum(r["output_tokens"] for r in run["records"])


def test_a_server_that_cannot_start_fails_the_launch_with_its_reason(tmp_path):
    """`--launch` on a model directory that does not exist: the launch raises with the server's own error line,
    which its log also keeps."""
    log = tmp_path / "server.log"
    missing = tmp_path / "no-such-model"
    with pytest.raises(RuntimeError, match="does not exist"):
        serving_bench.launch_server(f"{missing} --device cpu", timeout_s=120, log_path=str(log))
    assert str(missing) in log.read_text()


def test_each_rate_of_a_sweep_draws_fresh_random_prompts(monkeypatch):
    """A server's prefix cache would serve a prompt it has seen: every rate of a random sweep gets its own
    prompts (same lengths distribution, none repeated)."""
    seen = []

    async def fake_stream(base, model, requests, rate, *args, **kwargs):
        seen.append([tuple(r.prompt) for r in requests])
        return [serving_bench.Record(ok=True, ttft=0.01, e2e=0.02, output_tokens=2, max_tokens=2)] * len(requests), 1.0

    monkeypatch.setattr(serving_bench, "run_stream", fake_stream)
    rc = serving_bench.main(["--base-url", "http://127.0.0.1:9", "--model", "m", "--sweep-rates", "1,4,inf",
                             "--num-prompts", "5", "--input-len", "70", "--no-progress"])
    assert rc == 0 and len(seen) == 3 and all(len(s) == 5 for s in seen)
    assert not set(seen[0]) & set(seen[1]) and not set(seen[1]) & set(seen[2])
