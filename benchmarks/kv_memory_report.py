"""Paged KV cache: memory saved against a static max_batch × max_len preallocation (ShallowMLA's Table 4).


Runs the engine for real (default model, CPU is fine) on B prompts of L tokens, records the pool's
peak page use, and reports 1 - (peak pages · page_size) / (max_batch · max_len) with the report's
max_batch=32, max_len=16384, for our default page size (64) and the report's (1024).

    python benchmarks/kv_memory_report.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

from specmla import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=16384)
    args = ap.parse_args()
    rows = []
    for page_size in (64, 1024):
        # one step admits every prompt (token budget 8 × 4096), so the peak holds all B sequences at once
        llm = LLM(args.model, device="cpu", page_size=page_size, max_model_len=4096,
                  num_pages=max(8, 8 * 4096 // page_size + 8), max_num_batched_tokens=8 * 4096, max_num_seqs=8)
        for B in (4, 8):
            for L in (512, 1024, 2048, 4096):
                pool = llm.kv_pool
                pool.peak_pages_used = 0
                prompts = [[(7 * i + j) % 200 + 3 for j in range(L - 1)] for i in range(B)]
                llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
                assert pool.num_free_pages() == pool.num_pages
                used = pool.peak_pages_used * page_size
                ratio = 1 - used / (args.max_batch * args.max_len)
                rows.append({"page_size": page_size, "B": B, "L": L, "peak_pages": pool.peak_pages_used,
                             "saving": ratio})
                print(f"page {page_size:5d}  B={B} L={L:5d}  peak pages {pool.peak_pages_used:4d}  saving {ratio:.2%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
