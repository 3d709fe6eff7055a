"""Start-up and the first batches a user meets: does anything compile or capture on a live request?

Each case runs in a fresh process on the run's Triton cache directory (`TRITON_CACHE_DIR`, new for each run): "cold"
starts on the empty directory, "warm" is a second process on what the cold one filled (the case names say which
they met). A case measures

- start-up: `LLM(...)` from the call to its return (load + warm-up), and the engine's own split (`LLM.startup`:
  load, ready, graph and activation bytes, KV pool);
- the first batch at each batch size B (B fresh random prompts of --prompt-len tokens, --new-tokens each, greedy,
  EOS ignored) against the same-shaped batch run again right after (fresh prompts: no prefix-cache hits), and
  the late compiles / captures `engine.compile_guard` saw during each (armed in "warn" mode);
- one request growing its context from --grow-from to --grow-to tokens, against its repeat;
- memory once the batches ran: device memory in use, the KV pool, and the pool against what
  gpu_memory_utilization × the device's memory leaves after everything else in use.

Acceptance (issue 55): first ≤ 1.5 × again + 50 ms at every B; growth ≤ 1.1 × its repeat; start-up ≤ 90 s cold
and ≤ 25 s warm; the pool ≥ 95 % of what the memory allows (where memory, not max_num_seqs × max_model_len, caps
it).

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_startup.py --checkpoint-dir /tmp/v2lite27 --out DIR
    PYTHONPATH=.:benchmarks python3 benchmarks/bench_startup.py --embedded --speculative mtp --out DIR
    PYTHONPATH=.:benchmarks python3 benchmarks/bench_startup.py --embedded --device cpu --batches 1 2 --grow-to 96
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]


def child(spec: dict) -> dict:
    """One fresh process's measurements (see the module doc)."""
    import torch

    from specmla import LLM, SamplingParams
    from specmla.engine import compile_guard

    dev = torch.device(spec["device"])
    t0 = time.perf_counter()
    llm = LLM(spec["model"], device=spec["device"], dtype=spec["dtype"], load_format=spec["load_format"],
              max_num_seqs=spec["max_num_seqs"], max_model_len=spec["max_model_len"],
              speculative=spec["speculative"], num_speculative_tokens=spec["k"],
              gpu_memory_utilization=spec["gpu_memory_utilization"])
    out = {"startup_s": time.perf_counter() - t0, "startup": llm.startup, "case": spec["case"]}
    events = compile_guard.events
    rng = random.Random(spec["seed"])
    vocab = llm.model.config.vocab_size

    def prompts(B: int, L: int) -> list[list[int]]:
        return [[rng.randrange(vocab) for _ in range(L)] for _ in range(B)]

    def timed(batch, max_tokens: int) -> tuple[float, int]:
        seen = len(events)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(batch, params)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        bad = [o.error for o in outs if o.finish_reason == "error"]
        if bad:
            raise RuntimeError(f"a request failed: {bad[0]}")
        return time.perf_counter() - t, len(events) - seen

    rows = []
    for B in spec["batches"]:
        first, late = timed(prompts(B, spec["prompt_len"]), spec["new_tokens"])
        again, late_again = timed(prompts(B, spec["prompt_len"]), spec["new_tokens"])
        rows.append({"B": B, "first_s": first, "again_s": again, "late_first": late, "late_again": late_again})
        print(f"  B={B:4d}: first {first * 1e3:9.1f} ms, again {again * 1e3:8.1f} ms, late compiles {late}",
              file=sys.stderr, flush=True)
    out["batches"] = rows
    if spec["grow_to"] > spec["grow_from"]:
        n = spec["grow_to"] - spec["grow_from"]
        first, late = timed(prompts(1, spec["grow_from"]), n)
        again, _ = timed(prompts(1, spec["grow_from"]), n)
        out["grow"] = {"from": spec["grow_from"], "to": spec["grow_to"], "first_s": first, "again_s": again,
                       "late_first": late}
    if spec["long_prompt"]:  # a prompt of max_model_len - new tokens: chunked prefill at the longest context
        L = llm.engine.max_total_tokens - spec["new_tokens"]
        first, late = timed(prompts(1, L), spec["new_tokens"])
        out["long_prompt"] = {"tokens": L, "s": first, "late": late}
    out["late_events"] = list(events)[:20]
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        pool = llm.kv_pool
        kv = pool.bytes_per_page() * (pool.num_pages + 1)
        used = total - free
        util = spec["gpu_memory_utilization"]
        allowed = util * total - (used - kv)  # what the pool could have had with everything else as it is
        want = spec["max_num_seqs"] * -(-llm.engine.max_model_len // pool.page_size)
        out["memory"] = {"total": total, "used": used, "kv_bytes": kv, "allowed_kv_bytes": allowed,
                         "kv_share_of_allowed": kv / allowed if allowed > 0 else float("nan"),
                         "capped_by_max_len": pool.num_pages >= want, "kv_pages": pool.num_pages}
    return out


def run_case(spec: dict, cache_dir: str, timeout: float) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir, SPECMLA_COMPILE_GUARD="warn", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, stdout=subprocess.PIPE,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"case {spec['case']} failed (exit {proc.returncode})")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["process_s"] = time.perf_counter() - t0
    return res


def format_case(res: dict) -> str:
    st = res["startup"]
    lines = [f"### {res['case']}: LLM() {res['startup_s']:.1f} s"
             + (f" (load {st['load_s']:.1f} s, {st['graphs']} graphs, graphs {st['graph_bytes'] / 2**30:.2f} GiB, "
                f"activations {st['activation_bytes'] / 2**30:.2f} GiB, KV {st['kv_bytes'] / 2**30:.1f} GiB)"
                if st else ""),
             "", "| B | first batch | same batch again | first ÷ (1.5 × again + 50 ms) | late compiles |",
             "|---|---|---|---|---|"]
    for r in res["batches"]:
        bound = 1.5 * r["again_s"] + 0.05
        lines.append(f"| {r['B']} | {r['first_s'] * 1e3:.1f} ms | {r['again_s'] * 1e3:.1f} ms | "
                     f"{r['first_s'] / bound:.2f} {'ok' if r['first_s'] <= bound else 'MISS'} | {r['late_first']} |")
    g = res.get("grow")
    if g:
        ratio = g["first_s"] / g["again_s"]
        lines.append(f"\ncontext {g['from']} → {g['to']} tokens: {g['first_s']:.2f} s, again {g['again_s']:.2f} s: "
                     f"{ratio:.3f}× {'ok' if ratio <= 1.1 else 'MISS'} (late compiles {g['late_first']})")
    lp = res.get("long_prompt")
    if lp:
        lines.append(f"longest prompt ({lp['tokens']} tokens): {lp['s']:.2f} s, late compiles {lp['late']}")
    m = res.get("memory")
    if m:
        lines.append(f"memory: {m['used'] / 2**30:.1f} of {m['total'] / 2**30:.1f} GiB in use, KV pool "
                     f"{m['kv_bytes'] / 2**30:.1f} GiB = {100 * m['kv_share_of_allowed']:.1f} % of what the memory "
                     f"allows{' (capped by max_num_seqs × max_model_len)' if m['capped_by_max_len'] else ''}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint-dir", default=None,
                    help="the DeepSeek-V2-Lite-shaped 27-layer random checkpoint (written there once, 31 GB)")
    ap.add_argument("--embedded", action="store_true", help="the embedded model instead of a checkpoint")
    ap.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--speculative", default=None, choices=[None, "mtp", "ngram", "hybrid"])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--grow-from", type=int, default=64)
    ap.add_argument("--grow-to", type=int, default=1600)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--memory-max-model-len", type=int, default=0,
                    help="also a warm case with this max_model_len (large enough that memory caps the pool) and a "
                         "prompt at its longest context")
    ap.add_argument("--modes", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per case")
    ap.add_argument("--out", default=None, help="directory for bench_startup.json")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return
    if (args.checkpoint_dir is None) == (not args.embedded):
        ap.error("give --checkpoint-dir or --embedded")
    model = None
    if args.checkpoint_dir:
        model = args.checkpoint_dir
        if args.load_format == "safetensors":
            import torch
            from bench_engine import V2_LITE, ensure_checkpoint

            cfg = dict(V2_LITE, torch_dtype="bfloat16")
            ensure_checkpoint(Path(model), cfg, torch.device(args.device), torch.bfloat16)
            torch.cuda.empty_cache() if args.device.startswith("cuda") else None
        elif not (Path(model) / "config.json").exists():
            from bench_engine import V2_LITE

            Path(model).mkdir(parents=True, exist_ok=True)
            (Path(model) / "config.json").write_text(json.dumps(dict(V2_LITE, torch_dtype="bfloat16")))
    base = dict(model=model, device=args.device, dtype=args.dtype or ("bfloat16" if args.device != "cpu" else None),
                load_format=args.load_format, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                speculative=args.speculative, k=args.k, batches=args.batches, prompt_len=args.prompt_len,
                new_tokens=args.new_tokens, grow_from=args.grow_from, grow_to=args.grow_to, seed=0,
                gpu_memory_utilization=args.gpu_memory_utilization, long_prompt=False)
    name = ("embedded" if args.embedded else "V2-Lite-shaped 27 layers") + (
        f", speculative={args.speculative} k={args.k}" if args.speculative else "")
    cache = tempfile.mkdtemp(prefix="specmla-triton-")
    results = {"args": vars(args), "cases": []}
    try:
        results["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                           cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        results["commit"] = None
    for mode in args.modes:
        state = "filled" if any(Path(cache).iterdir()) else "empty"  # "warm" alone starts on an empty cache too
        res = run_case(dict(base, case=f"{name}, {state} Triton cache"), cache, args.timeout)
        results["cases"].append(res)
        print(format_case(res) + "\n", flush=True)
    if args.memory_max_model_len:
        spec = dict(base, case=f"{name}, max_model_len {args.memory_max_model_len}, memory", batches=[args.batches[-1]],
                    grow_to=0, max_model_len=args.memory_max_model_len, long_prompt=True)
        res = run_case(spec, cache, args.timeout)
        results["cases"].append(res)
        print(format_case(res) + "\n", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_startup.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
