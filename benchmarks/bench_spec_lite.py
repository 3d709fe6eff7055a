"""Speculative decoding's cost on a DeepSeek-V2-Lite-shaped random model: mtp / ngram / hybrid tok/s vs none.

`specmla bench spec` at B=1 and B=32.

No V2-Lite checkpoint can be downloaded here, so the weights are random (N(0, 0.02), bf16) with V2-Lite's
shapes plus one MTP layer. What this measures is the cost side of speculation on a real-sized model: a
verify step over 1 + k rows against a 1-row step, and an MTP pass against a 27-layer trunk. The
acceptance of random drafts says nothing about a trained model's; multiply the measured cost per step
by a trained model's acceptance length to project its speedup.

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_spec_lite.py --json OUT.json        (one H100)
"""

from __future__ import annotations

import argparse
import json

import torch

from bench_engine import TINY, V2_LITE, random_model
from specmla import LLM
from specmla.bench import format_spec_rows, load_prompts, run_spec_sweep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=27, help="trunk layers (V2-Lite has 27)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--modes", nargs="+", default=["none", "mtp", "ngram", "hybrid"])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: a check of the script")
    args = ap.parse_args()
    cfg = dict(TINY if args.tiny else V2_LITE, num_hidden_layers=args.layers, num_nextn_predict_layers=1)
    dev, dtype = (torch.device("cpu"), torch.float32) if args.tiny else (torch.device("cuda"), torch.bfloat16)
    model = random_model(cfg, dev, dtype, max_positions=args.max_model_len)
    print(f"{'tiny' if args.tiny else 'V2-Lite'}-shaped, {args.layers} layers + 1 MTP layer, random {dtype}: "
          f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters", flush=True)
    results = []
    for B in args.batch:
        prompts = load_prompts(None, B, args.input_len, cfg["vocab_size"], seed=0)
        rows = run_spec_sweep(lambda mode, k, B=B: LLM(model, speculative=mode, num_speculative_tokens=k,
                                                      max_num_seqs=B, gpu_memory_utilization=0.8),
                              prompts, args.output_len, args.modes, args.k, batch=B)
        print(f"batch {B}:\n{format_spec_rows(rows)}", flush=True)
        results += [dict(r, layers=args.layers) for r in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
