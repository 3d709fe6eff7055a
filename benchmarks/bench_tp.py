"""Tensor parallelism: decode tok/s of TP=2 vs TP=1, and fp32 greedy identity of TP=2 with TP=1.

A DeepSeek-V2-Lite-shaped random model (full width, fewer layers to keep the checkpoint small) on one multi-GPU
host:
- speed, bf16: decode tok/s at B=1 and B=32 for TP=1 with CUDA graphs, TP=1 eager and TP=2 (eager:
  the tensor-parallel path does not capture graphs yet), and how many greedy tokens agree;
- identity, fp32: TP=2 greedy tokens == TP=1 (in bf16 the split all-reduce rounds differently, so
  near-tied logits of a random model can flip a token; fp32 shows the sharding itself is exact).

    PYTHONPATH=. python3 benchmarks/bench_tp.py --layers 8 --out DIR        (2 GPUs)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch
from bench_engine import TINY, V2_LITE, random_model

from specmla import LLM, SamplingParams
from specmla.model.default import write_byte_tokenizer
from specmla.model.loader import save_checkpoint


def write_model(path: Path, layers: int, device: str, tiny: bool = False) -> Path:
    cfg = dict(TINY if tiny else V2_LITE, num_hidden_layers=layers, torch_dtype="bfloat16")
    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    model = random_model(cfg, device, torch.bfloat16 if device == "cuda" else torch.float32)
    save_checkpoint(model, path)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    write_byte_tokenizer(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return path


def run(path: Path, tp: int, batches: list[int], new_tokens: int, prompt_len: int, dtype: str = "bfloat16",
        eager: bool = False, device: str = "cuda") -> dict:
    llm = LLM(path, device=device, dtype=dtype if device == "cuda" else "float32", tensor_parallel_size=tp,
              max_num_seqs=max(batches), max_model_len=prompt_len + new_tokens + 16, gpu_memory_utilization=0.5,
              enforce_eager=eager)
    rng = random.Random(0)
    out = {"tp": tp, "dtype": dtype, "eager": eager or tp > 1}
    try:
        for B in batches:
            prompts = [[rng.randrange(3, llm.model.config.vocab_size) for _ in range(prompt_len)] for _ in range(B)]
            params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
            llm.generate(prompts, params)  # warm up: graphs captured, kernels compiled
            t0 = time.perf_counter()
            res = llm.generate(prompts, params)
            wall = time.perf_counter() - t0
            tpot = sorted(o.metrics["tpot_s"] for o in res)[len(res) // 2]
            out[f"b{B}"] = {"output_tok_per_s": B * new_tokens / wall, "decode_tok_per_s": B / tpot,
                            "median_tpot_ms": 1e3 * tpot, "tokens": [o.token_ids for o in res]}
    finally:
        llm.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--model-dir", default="/tmp/specmla_tp")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true", help="tiny dims on CPU (a smoke run of this script)")
    args = ap.parse_args()
    dev = "cpu" if args.tiny else "cuda"
    path = write_model(Path(f"{args.model_dir}_{'tiny' if args.tiny else 'v2lite'}_L{args.layers}"), args.layers, dev,
                       args.tiny)
    report = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
              "gpus": torch.cuda.device_count(), "layers": args.layers}
    fp32 = [run(path, tp, [32], 32, args.prompt_len, dtype="float32", eager=True, device=dev) for tp in (1, 2)]
    report["fp32_b32_identical"] = fp32[0]["b32"]["tokens"] == fp32[1]["b32"]["tokens"]
    print(f"fp32, B=32, 32 tokens: TP2 greedy == TP1: {report['fp32_b32_identical']}", flush=True)
    rows = [run(path, 1, args.batches, args.new_tokens, args.prompt_len, device=dev),
            run(path, 1, args.batches, args.new_tokens, args.prompt_len, eager=True, device=dev),
            run(path, 2, args.batches, args.new_tokens, args.prompt_len, device=dev)]
    names = ["tp1_graphs", "tp1_eager", "tp2_eager"]
    for B in args.batches:
        base = rows[0][f"b{B}"]["tokens"]
        entry = {}
        for name, r in zip(names, rows):
            x = r[f"b{B}"]
            agree = sum(a == b for u, v in zip(base, x["tokens"]) for a, b in zip(u, v)) / (B * args.new_tokens)
            entry[name] = {k: x[k] for k in ("output_tok_per_s", "decode_tok_per_s", "median_tpot_ms")}
            entry[name]["token_agreement_with_tp1_graphs"] = agree
            print(f"B={B} {name}: {x['decode_tok_per_s']:.0f} decode tok/s (TPOT {x['median_tpot_ms']:.2f} ms), "
                  f"greedy agreement with TP1 {agree:.3f}", flush=True)
        report[f"bf16_b{B}"] = entry
    with open(os.path.join(args.out, "bench_tp.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
