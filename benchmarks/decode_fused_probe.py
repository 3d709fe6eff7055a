"""Probe for the few-program decode calls (issue 3's B=1, T=8k goal): the splits merged inside the split
launch against the separate combine kernel, split counts, and the floors of a one-launch call.

    PYTHONPATH=.:benchmarks python3 benchmarks/decode_fused_probe.py [--out DIR] [--rounds 3]

Floors, timed like the kernel (a CUDA graph of 16 back-to-back calls, caches rotated past 4× L2):
- an empty Triton launch: what one more kernel costs a call in a graph;
- one program per 64-row page reading it whole (9.4 MB at B=1, T=8k) and writing one word: the time of
  one launch that only reads the cache, the best a one-launch decode could do.
Variants run in turns within each round, so clock drift spreads over all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import triton
import triton.language as tl
from bench_mla_decode import PAGE, SCALE, make_problem, time_fn
from limits import copy_bandwidth

from specmla.ops import mla_decode_gluon as G
from specmla.ops.mla_decode import mla_decode_torch
from specmla.ops.mla_decode_triton import decode_bytes, mla_decode_triton, plan


@triton.jit
def _empty(X):
    pass


@triton.jit
def _read_pages(KV, BT, OUT, stride_p, N: tl.constexpr, BLOCK: tl.constexpr):
    """Program i reads page BT[i] (N elements) and writes their sum: nothing but the cache's bytes."""
    pid = tl.program_id(0)
    base = KV + tl.load(BT + pid).to(tl.int64) * stride_p
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.static_range(0, N, BLOCK):
        acc += tl.load(base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(OUT + pid, tl.sum(acc, 0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default="16x1x8192x1,16x2x8192x1,16x4x8192x1,16x4x81920x1,16x8x32768x1,16x16x8192x1,"
                                       "16x16x32768x1,16x8x8192x2")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy {bw / 1e9:.0f} GB/s", flush=True)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for case in args.cases.split(","):
        H, B, T, S = (int(x) for x in case.split("x"))
        copies = max(1, min(8, -(-4 * l2 // (B * T * 1152))))
        caches, table, seq, qs = make_problem(H, B, T, S, copies)
        nbytes = decode_bytes(B * T, B, S, H)
        ns_plan = plan(B, S, H, T, torch.device("cuda"), 64, waves=1)["num_splits"]
        ref = mla_decode_torch(qs[0][:2].double(), caches[0].double(), table[:2], seq[:2], SCALE, head_dim_v=512)
        variants = {"two launches": dict(fused=False), "one launch": dict(fused=True)}
        if B == 1:
            for ns in (32, 64):
                variants[f"one launch, {ns} splits"] = dict(fused=True, num_splits=ns)
        times = {k: [] for k in variants}
        errs = {}
        for name, v in variants.items():
            G.FUSED_COMBINE = v["fused"]
            got = mla_decode_triton(qs[0][:2], caches[0], table[:2], seq[:2], SCALE, head_dim_v=512,
                                    num_splits=v.get("num_splits"))
            errs[name] = ((got.double() - ref).norm() / ref.norm()).item()
        for r in range(args.rounds):
            names = list(variants)
            names = names[r % len(names):] + names[:r % len(names)]
            for name in names:
                v = variants[name]
                G.FUSED_COMBINE = v["fused"]
                ns = v.get("num_splits") or ns_plan
                out = torch.empty(B, S, H, 512, dtype=torch.bfloat16, device="cuda")
                ws = (torch.empty(B, S, H, ns, 512, device="cuda"), torch.empty(B, S, H, ns, device="cuda"))
                times[name].append(time_fn(lambda i: mla_decode_triton(
                    qs[i], caches[i], table, seq, SCALE, out=out, workspace=ws, head_dim_v=512), copies, graph=True))
        G.FUSED_COMBINE = False
        for name in variants:
            t = statistics.median(times[name])
            row = dict(case=[H, B, T, S], variant=name, us=t * 1e6, runs_us=[x * 1e6 for x in times[name]],
                       GBps=nbytes / t / 1e9, pct_copy=100 * nbytes / t / bw, rel_err=errs[name])
            rows.append(row)
            print(f"{case:16s} {name:34s} {row['us']:8.2f} us {row['GBps']:6.0f} GB/s {row['pct_copy']:5.1f} %  "
                  f"err {row['rel_err']:.1e}  runs {[round(x, 2) for x in row['runs_us']]}", flush=True)
        if B == 1:  # the floors of a one-launch call at this size
            dummy = torch.empty(1, device="cuda")
            t_empty = time_fn(lambda i: _empty[(1,)](dummy), copies, graph=True)
            sums = torch.empty(table.numel(), device="cuda")
            n = PAGE * 576
            t_read = time_fn(lambda i: _read_pages[(table.numel(),)](caches[i], table, sums, caches[i].stride(0), N=n,
                                                                      BLOCK=4096, num_warps=8), copies, graph=True)
            rows.append(dict(case=[H, B, T, S], variant="floor: empty launch", us=t_empty * 1e6))
            rows.append(dict(case=[H, B, T, S], variant="floor: read the cache in one launch", us=t_read * 1e6,
                             GBps=nbytes / t_read / 1e9, pct_copy=100 * nbytes / t_read / bw))
            print(f"{case:16s} floor: empty launch {t_empty * 1e6:.2f} us; read-only launch {t_read * 1e6:.2f} us = "
                  f"{nbytes / t_read / 1e9:.0f} GB/s ({100 * nbytes / t_read / bw:.1f} % of copy)", flush=True)
    with open(os.path.join(args.out, "decode_fused_probe.json"), "w") as f:
        json.dump(dict(copy_GBps=bw / 1e9, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
