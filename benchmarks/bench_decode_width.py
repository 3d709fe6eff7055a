"""Decode of short requests in a wide block table: `mla_decode`'s default plan, made for the table's width (as an
engine's decode graphs make it, for max_model_len), against the same call with the split count and kernel forced.

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_decode_width.py --out DIR      (a Hopper GPU, ~60 s)

Per (H, B, table width in keys, request length L): requests of L random bf16 latents on shuffled pages of a table
`width` keys wide; each call timed as `ops.timing.graph_call_time` times it (32 calls in one CUDA graph over 4 cache
copies, median of 7 replays), the default plan and every (kernel, split count) in KERNELS × SPLITS. The ratio
default ÷ best says what a request loses to a plan made for longer ones.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from specmla.ops.decode import kernel_module, mla_decode, route
from specmla.ops.timing import graph_call_time

PAGE, COPIES, CALLS, REPS = 64, 4, 32, 7
KERNELS = ("triton", "bf16", "bf16_seesaw")
SPLITS = (1, 2, 4, 8, 16, 32)


def measure(H: int, B: int, width: int, L: int) -> dict:
    need = B * -(-L // PAGE)  # pages holding the requests; the rest of each table row points at page 0
    caches = [torch.randn(need + 1, PAGE, 576, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
    table = torch.zeros(B, width // PAGE, dtype=torch.int32, device="cuda")
    table[:, : -(-L // PAGE)] = 1 + torch.randperm(need, device="cuda", dtype=torch.int32).view(B, -1)
    seq = torch.full((B,), L, dtype=torch.int32, device="cuda")
    qs = [torch.randn(B, 1, H, 576, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
    chosen = route(qs[0], caches[0], table)
    row = {"H": H, "B": B, "width": width, "L": L, "default": [chosen.kernel, chosen.plan["num_splits"]]}
    t = graph_call_time(lambda i: mla_decode(qs[i % COPIES], caches[i % COPIES], table, seq, 0.1), CALLS, REPS)
    row["default_us"] = None if t is None else t * 1e6
    forced = {}
    for kernel in KERNELS:
        opts = kernel_module(kernel).Options()
        for ns in SPLITS:
            t = graph_call_time(lambda i: mla_decode(qs[i % COPIES], caches[i % COPIES], table, seq, 0.1,
                                                     num_splits=ns, opts=opts), CALLS, REPS, f"{kernel}/{ns}")
            if t is not None:
                forced[f"{kernel}/{ns}"] = t * 1e6
    row["forced_us"] = forced
    if forced:
        best = min(forced, key=forced.get)
        row["best"], row["best_us"] = best, forced[best]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--widths", type=int, nargs="+", default=[1024, 8192, 163840], help="table widths in keys")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    rows = []
    for H in args.heads:
        for B in args.batches:
            for width in args.widths:
                for L in args.lengths:
                    if L > width:
                        continue
                    r = measure(H, B, width, L)
                    rows.append(r)
                    print(f"H={H} B={B} width {width} L={L}: default {r['default'][0]}/{r['default'][1]} "
                          f"{r['default_us']:.2f} µs; best {r.get('best')} {r.get('best_us', float('nan')):.2f} µs",
                          flush=True)
                    torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_decode_width.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
