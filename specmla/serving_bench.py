"""`specmla bench serve`: a request stream against any OpenAI-compatible server, measured as its users feel it.

Requests arrive as a Poisson process at `--request-rate` (gamma-distributed gaps with shape `--burstiness`, as
vLLM's `bench serve`; `inf` sends them all at once), at most `--max-concurrency` in flight, each streamed; per
request it records the time to the first token (TTFT), the gaps between streamed chunks (ITL), the time per output
token after the first (TPOT = (E2E − TTFT) / (tokens − 1)) and the end-to-end latency, with token counts from the
server's `usage`. The summary gives percentiles, request and token throughput and, with `--slo`, goodput (requests
a second meeting every bound). `--sweep-rates` repeats it per rate and plots TTFT / TPOT against throughput; each
rate draws fresh random prompts (a dataset file's prompts come again, which a server's prefix cache may serve).

This file imports nothing from specmla (only httpx, tqdm and, for `--plot`, matplotlib): copy it to a client
machine and run `python serving_bench.py --base-url http://server:8000 ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import httpx
from tqdm import tqdm

WORDS = ("the of and to in is for on that with as by this at from be are or an it was data model value return "
         "self list time code file user line error test run new next").split()


@dataclass
class Request:
    prompt: str | list[int]
    output_len: int


@dataclass
class Record:
    """One request's measurement (seconds from its send)."""

    ok: bool = False
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    max_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# ---- datasets ----------------------------------------------------------------------------------------------------
def random_requests(n: int, input_len: int, output_len: int, range_ratio: float, seed: int, chat: bool,
                    vocab: int) -> list[Request]:
    """n requests with lengths uniform in [len·(1 − r), len·(1 + r)]: random token ids in [vocab // 8, vocab) for
    completions (exact input lengths), random words for chat (about one token a word)."""
    rng = random.Random(seed)

    def length(x: int) -> int:
        return max(1, rng.randint(int(x * (1 - range_ratio)), int(x * (1 + range_ratio))))

    out = []
    for _ in range(n):
        m = length(input_len)
        prompt = (" ".join(rng.choice(WORDS) for _ in range(m)) if chat
                  else [rng.randrange(vocab // 8, vocab) for _ in range(m)])
        out.append(Request(prompt, length(output_len)))
    return out


def file_requests(path: str, n: int, output_len: int, seed: int) -> list[Request]:
    """JSON lines with "prompt" (and optionally "output_len"), or a ShareGPT JSON list (each item's first human
    turn is the prompt); n of them sampled with the seed (repeated when the file holds fewer)."""
    with open(path) as f:
        text = f.read()
    items: list[Request] = []
    if text.lstrip().startswith("["):
        for conv in json.loads(text):
            turns = conv.get("conversations") or conv.get("conversation") or []
            human = next((t.get("value") for t in turns if t.get("from") in ("human", "user")), None)
            if human:
                items.append(Request(human, output_len))
    else:
        for line in text.splitlines():
            if line.strip():
                row = json.loads(line)
                items.append(Request(row["prompt"], int(row.get("output_len", output_len))))
    if not items:
        raise ValueError(f"{path} holds no prompts")
    rng = random.Random(seed)
    rng.shuffle(items)
    return [items[i % len(items)] for i in range(n)]


# ---- one request -------------------------------------------------------------------------------------------------
async def send(http: httpx.AsyncClient, url: str, model: str, chat: bool, req: Request, ignore_eos: bool,
               headers: dict) -> Record:
    body = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    rec = Record(max_tokens=req.output_len)
    t0 = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with http.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if "error" in payload:
                    rec.error = str(payload["error"].get("message", payload["error"]))
                    return rec
                usage = payload.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens", 0)
                    rec.output_tokens = usage.get("completion_tokens", 0)
                choice = (payload.get("choices") or [{}])[0]
                piece = choice.get("text") if not chat else (choice.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter()
                    if last is None:
                        rec.ttft = now - t0
                    else:
                        rec.itl.append(now - last)
                    last = now
                    chunks += 1
        rec.e2e = time.perf_counter() - t0
        if not rec.output_tokens:
            rec.output_tokens = chunks  # a server without usage: one token a chunk
        rec.ok = rec.ttft is not None
        if not rec.ok:
            rec.error = "no token streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec


# ---- a run -------------------------------------------------------------------------------------------------------
def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds before each request: gamma gaps of mean 1/rate (shape `burstiness`; 1 = Poisson); 0 at rate inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


async def run_stream(base_url: str, model: str, requests: list[Request], rate: float, burstiness: float = 1.0,
                     max_concurrency: int | None = None, chat: bool = False, ignore_eos: bool = True,
                     seed: int = 0, api_key: str | None = None, progress: bool = True, warmup: bool = True
                     ) -> tuple[list[Record], float]:
    """Send the requests as a stream; returns (records in request order, wall seconds of the whole run). `warmup`:
    first one request of the first prompt and 2 tokens, not counted (the connection and the client's first-use costs
    stay out of the figures; a server that fails it raises RuntimeError with its answer). The warm-up sends only the
    prompt's first 8 tokens (or characters), so no page of a prompt measured later lands in a prefix cache."""
    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc=f"rate {rate:g}", unit="req", disable=not progress, leave=False)
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1, max_keepalive_connections=64)
    records: list[Record | None] = [None] * len(requests)

    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as http:
        async def one(i: int, req: Request) -> None:
            if gate is not None:
                async with gate:
                    records[i] = await send(http, url, model, chat, req, ignore_eos, headers)
            else:
                records[i] = await send(http, url, model, chat, req, ignore_eos, headers)
            bar.update()

        if warmup and requests:
            rec = await send(http, url, model, chat, Request(requests[0].prompt[:8], 2), ignore_eos, headers)
            if not rec.ok:
                raise RuntimeError(f"the warm-up request failed: {rec.error}")
        tasks = []
        t0 = time.perf_counter()
        for i, (req, gap) in enumerate(zip(requests, arrival_gaps(len(requests), rate, burstiness, seed))):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(i, req)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    bar.close()
    return records, wall


def _pct(xs: list[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation, as numpy's default)."""
    if not xs:
        return None
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(records: list[Record], wall: float, slo: dict[str, float] | None = None) -> dict:
    """Percentiles (ms) of TTFT, TPOT, ITL and E2E over the completed requests, throughputs, failures, goodput."""
    ok = [r for r in records if r.ok]
    out: dict = {"requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
                 "duration_s": wall,
                 "request_throughput": len(ok) / wall if wall > 0 else None,
                 "output_throughput": sum(r.output_tokens for r in ok) / wall if wall > 0 else None,
                 "total_token_throughput": sum(r.output_tokens + r.prompt_tokens for r in ok) / wall if wall else None,
                 "input_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": sum(r.output_tokens for r in ok)}
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [x for r in ok for x in r.itl], "e2e": [r.e2e for r in ok]}
    for name, xs in series.items():
        out[f"mean_{name}_ms"] = statistics.fmean(xs) * 1e3 if xs else None
        for q in (50, 90, 99):
            v = _pct(xs, q)
            out[f"p{q}_{name}_ms"] = v * 1e3 if v is not None else None
    if slo:
        good = [r for r in ok if all(_metric_ms(r, k) is not None and _metric_ms(r, k) <= v for k, v in slo.items())]
        out["slo"] = dict(slo)
        out["goodput"] = len(good) / wall if wall > 0 else None
    errors = [r.error for r in records if not r.ok]
    if errors:
        out["first_error"] = errors[0]
    return out


def _metric_ms(r: Record, name: str) -> float | None:
    v = {"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e}[name]
    return None if v is None else v * 1e3


def format_summary(rate: float, s: dict) -> str:
    def f(x, nd=1):
        return "n/a" if x is None else f"{x:.{nd}f}"

    lines = [f"============ Serving benchmark (rate {rate:g} req/s) ============",
             f"Successful requests:            {s['completed']}   failed: {s['failed']}",
             f"Duration (s):                   {f(s['duration_s'], 2)}",
             f"Request throughput (req/s):     {f(s['request_throughput'], 2)}",
             f"Output token throughput (tok/s):{f(s['output_throughput'])}",
             f"Total token throughput (tok/s): {f(s['total_token_throughput'])}"]
    if "goodput" in s:
        lines.append(f"Goodput (req/s, SLO {s['slo']}): {f(s['goodput'], 2)}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st)"),
                        ("itl", "Inter-token Latency"), ("e2e", "End-to-end Latency")):
        lines.append(f"---- {title} (ms): mean {f(s[f'mean_{name}_ms'], 2)}  p50 {f(s[f'p50_{name}_ms'], 2)}  "
                     f"p90 {f(s[f'p90_{name}_ms'], 2)}  p99 {f(s[f'p99_{name}_ms'], 2)}")
    if s.get("first_error"):
        lines.append(f"first error: {s['first_error']}")
    return "\n".join(lines)


def plot_sweep(results: list[dict] | dict[str, list[dict]], path: str, title: str | None = None) -> None:
    """TTFT and TPOT (p50, p99) against output throughput, one point per rate (labelled with it); `results` is one
    sweep, or {label: sweep} for several on the same axes."""
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib (pip install 'specmla[bench]' or matplotlib)") from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = results if isinstance(results, dict) else {"": results}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, runs in series.items():
        x = [r["summary"]["output_throughput"] or 0 for r in runs]
        for ax, name in zip(axes, ("ttft", "tpot")):
            for q, style in ((50, "o-"), (99, "s--")):
                ax.plot(x, [r["summary"][f"p{q}_{name}_ms"] for r in runs], style, label=f"{label} p{q}".strip())
            for xi, r in zip(x, runs):
                ax.annotate(f"{r['rate']:g}/s", (xi, r["summary"][f"p50_{name}_ms"] or 0), fontsize=7)
    for ax, name in zip(axes, ("TTFT", "TPOT")):
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- launching a server ------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(args_line: str, timeout_s: float = 1800.0, log_path: str | None = None
                  ) -> tuple[subprocess.Popen, str, float]:
    """Start `specmla serve ARGS` on a free loopback port; returns (process, base url, seconds until /health said
    ready). Its output goes to `log_path` (default: a temporary file), never to an undrained pipe that a chatty
    server would fill and block on; a server that exits first raises with the log's end."""
    port = free_port()
    cmd = [sys.executable, "-m", "specmla.cli", "serve", *args_line.split(), "--host", "127.0.0.1", "--port", str(port)]
    log = open(log_path, "w+") if log_path else tempfile.TemporaryFile("w+")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log = log  # closed by stop_server
    base = f"http://127.0.0.1:{port}"
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the server exited ({proc.returncode}): {log.read()[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    if getattr(proc, "log", None) is not None:
        proc.log.close()


# ---- command line ------------------------------------------------------------------------------------------------
def _rate(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError("a rate must be > 0 (or inf)")
    return v


def _slo(text: str) -> dict[str, float]:
    out = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        name = key.strip().removesuffix("_ms")
        if name not in ("ttft", "tpot", "e2e") or not value:
            raise argparse.ArgumentTypeError(f"--slo takes ttft_ms=…,tpot_ms=…,e2e_ms=…, got {part!r}")
        out[name] = float(value)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="the server (default: http://127.0.0.1:8000, or --launch's)")
    p.add_argument("--launch", default=None, metavar="ARGS",
                   help="start `specmla serve ARGS` on a free loopback port, run, stop it; reports its start-up")
    p.add_argument("--server-log", default=None, help="with --launch: the server's output goes here")
    p.add_argument("--model", default=None, help="the model name the server serves (default: its first)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--dataset", default="random", help="random, a JSONL file of prompts, or a ShareGPT JSON file")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0, help="random lengths in len·[1 − r, 1 + r]")
    p.add_argument("--random-vocab", type=int, default=1000, help="random token ids below this (completions)")
    p.add_argument("--request-rate", type=_rate, default=float("inf"), help="req/s (Poisson), or inf")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--slo", type=_slo, default=None, help="e.g. ttft_ms=200,tpot_ms=20: report goodput")
    p.add_argument("--sweep-rates", default=None,
                   help="comma-separated rates (inf allowed): one run each, on fresh random prompts")
    p.add_argument("--json", default=None, help="write the summaries and per-request records here")
    p.add_argument("--plot", default=None, help="with --sweep-rates: TTFT / TPOT against throughput (PNG)")
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    for name in ("input_len", "output_len", "num_prompts"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.range_ratio < 1 or args.burstiness <= 0:
        raise SystemExit("--range-ratio must be in [0, 1) and --burstiness > 0")
    rates = [_rate(r) for r in args.sweep_rates.split(",")] if args.sweep_rates else [args.request_rate]
    chat = args.endpoint == "chat"

    def requests_of(i: int) -> list[Request]:
        """Rate i's requests: random ones are drawn afresh per rate (a server's prefix cache would serve a prompt
        it has seen); a dataset's are its prompts again, in another order."""
        if args.dataset == "random":
            return random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed + i,
                                   chat, args.random_vocab)
        return file_requests(args.dataset, args.num_prompts, args.output_len, args.seed + i)

    requests_of(0)  # a bad dataset fails before a server starts
    proc, startup = None, None
    base = args.base_url or "http://127.0.0.1:8000"
    if args.launch is not None:
        proc, base, startup = launch_server(args.launch, log_path=args.server_log)
        print(f"server ready in {startup:.1f} s at {base}")
    try:
        model = args.model
        if model is None:
            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            model = httpx.get(base.rstrip("/") + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        results = []
        for i, rate in enumerate(rates):
            records, wall = asyncio.run(run_stream(base, model, requests_of(i), rate, args.burstiness,
                                                   args.max_concurrency, chat, args.ignore_eos, args.seed + i,
                                                   args.api_key, not args.no_progress))
            summary = summarize(records, wall, args.slo)
            print(format_summary(rate, summary))
            results.append({"rate": rate, "summary": summary, "records": [asdict(r) for r in records]})
    finally:
        if proc is not None:
            stop_server(proc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"base_url": base, "model": model, "endpoint": args.endpoint, "dataset": args.dataset,
                       "server_startup_s": startup, "runs": results}, f, indent=1, default=str)
    if args.plot:
        plot_sweep(results, args.plot)
    return 0 if all(r["summary"]["failed"] == 0 for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
