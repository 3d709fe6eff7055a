"""Tensor + expert parallelism: the decode step of TP = 1, 2, 4 on a DeepSeek-V2-Lite-shaped checkpoint directory
(27 layers, 64 experts, random bf16 weights written once and loaded with `LLM(path, tensor_parallel_size=tp)`),
CUDA graphs on every rank; fp32 greedy identity of TP with TP = 1.

- step per batch size: `bench_engine.decode_steps`, (t(129) − t(1)) / 128 on fresh random prompts, median of
  --rounds rounds; floor = (rank 0's weight bytes per step + the latent-cache bytes, which every rank reads for its
  heads) / the copy rate measured in the same run; step ÷ TP = 1's step;
- where the time goes, on rank 0 (torch.profiler, 16 decode steps at B = 1 and 32): GPU kernel time per step and
  the NCCL all-reduce kernels' share of it; the measured step (without the profiler, whose own host overhead
  inflates its wall time) minus the kernel time is the GPU idle per step: host time the step does not hide, incl.
  the other ranks' lag;
- --nccl: each TP > 1 once more with every all-reduce through NCCL (custom_all_reduce=False), the one-shot
  kernel's gain measured in the same run;
- --sync: each TP once more with pipeline_decode=False (each step launched after the previous one's tokens reached
  the host), the pipelining's gain measured in the same run;
- identity: TP greedy tokens == TP = 1's in fp32 (--identity; in bf16 the split sums round differently, so near-tied
  logits of a random model can flip).

    PYTHONPATH=. python3 benchmarks/bench_tp.py --checkpoint-dir /tmp/v2lite27 --tp 1 2 --out DIR   (2 GPUs)
    PYTHONPATH=. python3 benchmarks/bench_tp.py --tiny --tp 1 2 --out DIR                            (CPU smoke)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import TINY, V2_LITE, decode_steps, ensure_checkpoint  # noqa: E402
from limits import copy_bandwidth  # noqa: E402

from specmla import LLM, SamplingParams  # noqa: E402
from specmla.model.default import write_byte_tokenizer  # noqa: E402

TARGETS = {(2, 1): 0.7, (2, 32): 0.65, (4, 32): 0.5}  # (tp, B) → step ÷ TP=1's step, at most


def profile_steps(llm: LLM, B: int, prompt_len: int, steps: int = 16, seed: int = 5) -> dict:
    """Rank 0's view of `steps` decode steps at batch B: wall, GPU kernel time and all-reduce kernel time per step."""
    from torch.profiler import ProfilerActivity, profile

    rng = random.Random(seed)
    eng, V = llm.engine, llm.model.config.vocab_size
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for _ in range(B):
        eng.add_request([rng.randrange(3, V) for _ in range(prompt_len)], params)
    while any(s.num_cached == 0 for s in eng.running) or eng.waiting:  # the prefill steps
        eng.step()
    eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    while eng.has_unfinished():
        eng.step()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e6
    is_ar = lambda name: "nccl" in name.lower() or "all_reduce" in name  # noqa: E731  (NCCL's or the one-shot)
    nccl = sum(e.time_range.elapsed_us() for e in kernels if is_ar(e.name)) / 1e6
    return {"batch": B, "steps": steps, "wall_per_step_s": wall / steps, "kernel_per_step_s": busy / steps,
            "allreduce_per_step_s": nccl / steps,
            "allreduce_calls_per_step": sum(is_ar(e.name) for e in kernels) / steps}


def greedy_tokens(path: Path, tp: int, device: str, n: int = 8, tokens: int = 32) -> list[list[int]]:
    llm = LLM(path, device=device, dtype="float32", tensor_parallel_size=tp, max_num_seqs=n, max_model_len=256,
              gpu_memory_utilization=0.6)
    try:
        rng = random.Random(9)
        prompts = [[rng.randrange(3, llm.model.config.vocab_size) for _ in range(16 + 7 * i)] for i in range(n)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        return [o.token_ids for o in outs]
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint-dir", default="/tmp/specmla_v2lite27")
    ap.add_argument("--tp", type=int, nargs="+", default=None, help="default: 1, 2 and 4 as the GPUs allow")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--identity", action="store_true", help="also fp32 greedy TP == TP=1 (a small 4-layer model)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--nccl", action="store_true",
                    help="also each TP > 1 with custom_all_reduce=False (every all-reduce through NCCL), as 'N-nccl'")
    ap.add_argument("--sync", action="store_true",
                    help="also each TP with pipeline_decode=False (every step after the last), as 'N-sync'")
    ap.add_argument("--tiny", action="store_true", help="tiny dims on CPU (a smoke run of this script)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    dev = "cpu" if args.tiny else "cuda"
    gpus = torch.cuda.device_count() if dev == "cuda" else 4
    tps = args.tp or [t for t in (1, 2, 4) if t <= gpus]
    cfg = dict(TINY if args.tiny else V2_LITE, num_hidden_layers=2 if args.tiny else 27, torch_dtype="bfloat16")
    path = Path(args.checkpoint_dir + ("_tiny" if args.tiny else ""))
    ensure_checkpoint(path, cfg, dev, torch.bfloat16 if dev == "cuda" else torch.float32)
    if not (path / "tokenizer.json").exists():
        write_byte_tokenizer(path)
    copy_bw = copy_bandwidth(dev)
    report = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "gpus": gpus,
              "layers": cfg["num_hidden_layers"], "copy_GBps": copy_bw / 1e9, "prompt_len": args.prompt_len,
              "tp": {}}
    print(f"{report['device']} × {gpus}: copy {copy_bw / 1e9:.0f} GB/s", flush=True)
    batches = [1, 4] if args.tiny else args.batches
    configs = [(str(tp), tp, True, True) for tp in tps]
    configs += [(f"{tp}-nccl", tp, False, True) for tp in tps if tp > 1 and args.nccl]
    configs += [(f"{tp}-sync", tp, True, False) for tp in tps if args.sync]
    llm = None
    for key, tp, custom, pipeline in configs:
        llm = None  # the previous LLM's weights, pool and graphs go before this one sizes its pool
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
        llm = LLM(path, device=dev, dtype="bfloat16" if dev == "cuda" else "float32", tensor_parallel_size=tp,
                  max_num_seqs=max(batches), max_model_len=args.prompt_len + 160, gpu_memory_utilization=0.6,
                  custom_all_reduce=custom, pipeline_decode=pipeline)
        try:
            steps = decode_steps(llm, batches, args.prompt_len, 1 if args.tiny else args.rounds, copy_bw)
            entry = {"decode": steps}
            if dev == "cuda" and not args.no_profile:
                step_of = {r["batch"]: r["step_s"] for r in steps["rows"]}
                entry["profile"] = [profile_steps(llm, B, args.prompt_len) for B in (1, 32) if B in step_of]
                for p in entry["profile"]:
                    p["idle_per_step_s"] = step_of[p["batch"]] - p["kernel_per_step_s"]
        finally:
            llm.shutdown()
        report["tp"][key] = entry
        for r in steps["rows"]:
            print(f"TP={key} B={r['batch']}: step {r['step_s'] * 1e3:.2f} ms, floor {r['floor_step_s'] * 1e3:.2f} ms",
                  flush=True)
        for p in entry.get("profile", []):
            print(f"TP={key} B={p['batch']} rank 0: profiled wall {p['wall_per_step_s'] * 1e3:.2f} ms/step, kernels "
                  f"{p['kernel_per_step_s'] * 1e3:.2f}, all-reduce {p['allreduce_per_step_s'] * 1e3:.3f} "
                  f"({p['allreduce_calls_per_step']:.0f} kernels), idle {p['idle_per_step_s'] * 1e3:.2f}", flush=True)
    llm = None
    base = {r["batch"]: r["step_s"] for r in report["tp"][str(tps[0])]["decode"]["rows"]} if tps[0] == 1 else {}
    for key, tp, custom, pipeline in configs:
        for r in report["tp"][key]["decode"]["rows"]:
            if r["batch"] in base:
                r["vs_tp1"] = r["step_s"] / base[r["batch"]]
                t = TARGETS.get((tp, r["batch"])) if dev == "cuda" and key == str(tp) else None  # CPU smoke: none
                if t is not None:
                    r["target_vs_tp1"], r["pass"] = t, r["vs_tp1"] <= t
                print(f"TP={key} B={r['batch']}: {r['vs_tp1']:.3f} × TP=1" +
                      (f" (target ≤ {t}: {'PASS' if r['pass'] else 'MISS'})" if t is not None else ""), flush=True)
    if args.identity:
        small = Path(str(path) + "_L4")
        ensure_checkpoint(small, dict(cfg, num_hidden_layers=min(4, cfg["num_hidden_layers"])), dev,
                          torch.bfloat16 if dev == "cuda" else torch.float32)
        if not (small / "tokenizer.json").exists():
            write_byte_tokenizer(small)
        ref = greedy_tokens(small, 1, dev)
        report["fp32_identical"] = {str(tp): greedy_tokens(small, tp, dev) == ref for tp in tps if tp > 1}
        print(f"fp32 greedy TP == TP=1: {report['fp32_identical']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_tp.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
