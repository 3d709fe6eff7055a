"""Serving under a request stream: `specmla serve` on the DeepSeek-V2-Lite-shaped directory, measured by `specmla bench
serve` per request rate, and the same prompts through HTTP at a fixed concurrency against `LLM.generate`.

The directory holds DeepSeek-V2-Lite's config.json (27 layers, 64 routed experts; with `--mtp-layers 1` one MTP
layer as DeepSeek-V3 has, so that `--speculative auto` drafts with MTP), random bf16 weights under the hub's tensor
names (`--load-format dummy`: the same shapes and N(0, 0.02) built on the device instead of read from disk) and a
synthetic byte-level BPE tokenizer of the model's 102,400 ids, so that every generated token is detokenised and
streamed as a real tokenizer's would be.

Per `--speculative` mode: `LLM(path, max_num_seqs=C).generate` on a set of prompts (tokens a step as the
server's; output tok/s of the engine alone), then `specmla serve` launched on a free port: the same prompts
streamed at concurrency C (the server's cost is the ratio of the two), then one run per `--rates` entry (Poisson
arrivals; inf = all at once) on prompts of its own (no run meets another's in the prefix cache), with its TTFT /
TPOT / ITL / E2E percentiles. Writes `bench_serving.json` (summaries), `bench_serving_records.json` (per-request
records), the servers' logs `serve_MODE.log` and `bench_serving.png` (TTFT and TPOT p50 / p99 against output
throughput, one line per mode).

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_serving.py --checkpoint-dir /tmp/v2lite27mtp --out DIR  (H200)
    PYTHONPATH=.:benchmarks python3 benchmarks/bench_serving.py --tiny --out DIR              (CPU: a check of it)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench_engine import TINY, V2_LITE, ensure_checkpoint, step_read_bytes
from limits import copy_bandwidth
from specmla import LLM, SamplingParams
from specmla import serving_bench as sb
from specmla.cli import SERVE_GPU_MAX_NUM_BATCHED_TOKENS
from specmla.engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS
from specmla.model.default import _chars_in_byte_order

LETTERS = "etaoinshrdlucmfwypvbgkjqxz"


def write_synthetic_tokenizer(path: Path, vocab_size: int, bos_id: int, eos_id: int, seed: int = 0) -> None:
    """A byte-level BPE tokenizer of exactly `vocab_size` ids: the 256 bytes, bos / eos / pad at bos_id, eos_id and
    eos_id + 1, and random merges of lowercase letters (with and without a leading space) into word pieces of
    2–8 letters, so a random model's tokens decode to valid text of a real vocabulary's length per token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = _chars_in_byte_order()
    space = chars[ord(" ")]
    specials = {bos_id: "<|begin_of_text|>", eos_id: "<|end_of_text|>", eos_id + 1: "<|pad|>"}
    if not (256 <= min(specials) and max(specials) < vocab_size):
        raise ValueError(f"special ids {sorted(specials)} must lie in [256, {vocab_size})")
    vocab = {c: i for i, c in enumerate(chars)}
    rng = random.Random(seed)
    merges, pieces, next_id = [], [], 256
    starts = [space + c for c in LETTERS]  # " e", " t", ...: the first merges make space-led letters
    for s in starts:
        merges.append((space, s[1]))
        pieces.append(s)
    for s in pieces:
        while next_id in specials:
            next_id += 1
        vocab[s] = next_id
        next_id += 1
    while next_id < vocab_size:
        if next_id in specials:
            next_id += 1
            continue
        left = rng.choice(pieces) if pieces and rng.random() < 0.8 else rng.choice(LETTERS)
        new = left + rng.choice(LETTERS)
        if new in vocab or len(new.lstrip(space)) > 8:
            continue
        merges.append((left, new[-1]))
        vocab[new] = next_id
        pieces.append(new)
        next_id += 1
    for i, name in specials.items():
        vocab[name] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials.values()))
    tok.save(str(path / "tokenizer.json"))
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": specials[bos_id], "eos_token": specials[eos_id], "pad_token": specials[eos_id + 1],
                   "add_bos_token": True, "add_eos_token": False}, f, indent=1)


def prepare_dir(args) -> Path:
    cfg = dict(TINY if args.tiny else V2_LITE, torch_dtype="bfloat16", num_nextn_predict_layers=args.mtp_layers)
    if args.tiny:
        cfg.update(num_hidden_layers=2, vocab_size=400, bos_token_id=300, eos_token_id=301)
    path = Path(args.checkpoint_dir)
    dev = torch.device("cpu" if args.tiny else "cuda")
    if args.load_format == "safetensors":
        secs = ensure_checkpoint(path, cfg, dev, torch.float32 if args.tiny else torch.bfloat16)
        if secs:
            print(f"checkpoint written in {secs:.1f} s", flush=True)
    else:
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(cfg, indent=1))
    if not (path / "tokenizer.json").exists():
        write_synthetic_tokenizer(path, cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"])
    return path


def offline(path: Path, args, mode: str, requests: list[sb.Request]) -> dict:
    """LLM.generate on the requests with at most --concurrency in flight: output tok/s of the engine alone."""
    tokens_a_step = args.max_num_batched_tokens or (
        DEFAULT_MAX_NUM_BATCHED_TOKENS if args.tiny else SERVE_GPU_MAX_NUM_BATCHED_TOKENS)  # as the server's
    llm = LLM(path, load_format=args.load_format, max_num_seqs=args.concurrency, speculative=_spec(mode),
              max_num_batched_tokens=tokens_a_step, **_device_kwargs(args))
    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in requests]
    llm.generate([requests[0].prompt[:8]], SamplingParams(max_tokens=2, ignore_eos=True))  # as the client's warm-up
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in requests], params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    floor_bytes = step_read_bytes(llm.model, 1)  # the weights a batch-1 decode step reads
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"output_tokens": tokens, "duration_s": wall, "output_throughput": tokens / wall,
            "b1_step_read_bytes": floor_bytes}


def _spec(mode: str) -> str | None:
    return None if mode == "none" else mode


def _device_kwargs(args) -> dict:
    return dict(device="cpu", dtype="float32") if args.tiny else {}


def serve_args(path: Path, args, mode: str) -> str:
    line = f"--model {path} --load-format {args.load_format} --speculative {mode}"
    if args.max_num_seqs:
        line += f" --max-num-seqs {args.max_num_seqs}"
    if args.max_num_batched_tokens:
        line += f" --max-num-batched-tokens {args.max_num_batched_tokens}"
    if args.tiny:
        line += " --device cpu --dtype float32"
    return line + (" " + args.serve_args if args.serve_args else "")


def stream(base: str, model: str, requests, rate: float, concurrency: int | None, seed: int) -> tuple[dict, list]:
    records, wall = asyncio.run(sb.run_stream(base, model, requests, rate, max_concurrency=concurrency, seed=seed,
                                              progress=False))
    return sb.summarize(records, wall), records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint-dir", default="/tmp/v2lite27mtp")
    ap.add_argument("--load-format", choices=["safetensors", "dummy"], default="safetensors")
    ap.add_argument("--mtp-layers", type=int, default=1, help="MTP layers in config.json (V2-Lite has 0)")
    ap.add_argument("--speculative", nargs="+", default=["none", "auto"])
    ap.add_argument("--rates", default="1,4,16,64,inf")
    ap.add_argument("--num-prompts", type=int, default=512, help="prompts per rate")
    ap.add_argument("--prompts-at", default="", help="per-rate overrides, e.g. 1=128,4=256")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--concurrency", type=int, default=64, help="the HTTP-against-LLM.generate comparison")
    ap.add_argument("--compare-prompts", type=int, default=512, help="prompts of that comparison (0: skip it)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="the server's (default: serve's default)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the server's and LLM.generate's (default: serve's default)")
    ap.add_argument("--serve-args", default="", help="more `specmla serve` arguments")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: a check of this script")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.tiny:
        args.checkpoint_dir = args.checkpoint_dir.rstrip("/") + "_tiny"
    path = prepare_dir(args)
    rates = [float(r) for r in args.rates.split(",")]
    at = {float(k): int(v) for k, _, v in (p.partition("=") for p in args.prompts_at.split(",") if p)}
    vocab = 1000 if not args.tiny else 250

    def requests(n: int, seed: int) -> list[sb.Request]:
        """Random prompts of their own per run (seed): a server's prefix cache never serves one it has seen."""
        return sb.random_requests(n, args.input_len, args.output_len, args.range_ratio, seed, False, vocab)

    device = "cpu" if args.tiny else torch.cuda.get_device_name(0)
    copy = None if args.tiny else copy_bandwidth()
    report = {"device": device, "dir": str(path), "load_format": args.load_format, "args": vars(args),
              "copy_GBps": copy / 1e9 if copy else None, "modes": {}}
    records = {}
    compare = requests(args.compare_prompts, 0)

    def save() -> None:
        """The report and records so far: a run cut short (a time limit) keeps the rates it finished. Each file is
        written beside and moved into place, so a run killed while writing leaves the previous whole one."""
        for name, data, indent in (("bench_serving.json", report, 1), ("bench_serving_records.json", records, None)):
            path = os.path.join(args.out, name)
            with open(path + ".tmp", "w") as f:
                json.dump(data, f, indent=indent)
            os.replace(path + ".tmp", path)

    for mode in args.speculative:
        res: dict = {}
        report["modes"][mode] = res
        if args.compare_prompts:
            res["offline"] = offline(path, args, mode, compare)
            print(f"[{mode}] LLM.generate, {args.compare_prompts} prompts, max_num_seqs {args.concurrency}: "
                  f"{res['offline']['output_throughput']:.0f} output tok/s", flush=True)
            if copy:
                res["b1_step_floor_ms"] = res["offline"]["b1_step_read_bytes"] / copy * 1e3
                print(f"[{mode}] batch-1 decode step floor (weights it reads / copy {copy / 1e9:.0f} GB/s): "
                      f"{res['b1_step_floor_ms']:.2f} ms", flush=True)
        proc, base, startup = sb.launch_server(serve_args(path, args, mode),
                                              log_path=os.path.join(args.out, f"serve_{mode}.log"))
        res["server_startup_s"] = startup
        print(f"[{mode}] server ready in {startup:.1f} s", flush=True)
        try:
            model = sb.httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
            if args.compare_prompts:
                s, _ = stream(base, model, compare, math.inf, args.concurrency, 0)
                res["http_concurrency"] = s
                res["http_over_offline"] = s["output_throughput"] / res["offline"]["output_throughput"]
                print(f"[{mode}] HTTP streaming at concurrency {args.concurrency}: {s['output_throughput']:.0f} "
                      f"output tok/s = {res['http_over_offline']:.3f}x LLM.generate; failed {s['failed']}", flush=True)
            res["rates"] = []
            for i, rate in enumerate(rates):
                n = at.get(rate, args.num_prompts)
                s, recs = stream(base, model, requests(n, 1 + i), rate, None, 1 + i)
                res["rates"].append({"rate": rate, "num_prompts": n, "summary": s})
                records[f"{mode}@{rate:g}#{i}"] = [asdict(r) for r in recs]
                print(f"[{mode}] " + sb.format_summary(rate, s), flush=True)
                save()
        finally:
            sb.stop_server(proc)
        save()
    sb.plot_sweep({mode: res.get("rates", []) for mode, res in report["modes"].items()},
                  os.path.join(args.out, "bench_serving.png"),
                  "specmla serve, V2-Lite-shaped, random 512 in / 128 out (labels: request rate)")


if __name__ == "__main__":
    main()
