"""Probe for the few-program decode calls (issue 3's B=1, T=8k goal): the default call, other split counts
at B=1, each of its two launches alone, and the floors of a one-launch call.

    PYTHONPATH=.:benchmarks python3 benchmarks/decode_floor_probe.py [--out DIR] [--rounds 3]

Floors, timed like the kernel (a CUDA graph of 16 back-to-back calls, caches rotated past 4× L2):
- an empty Triton launch: what one more kernel costs a call in a graph;
- one program per 64-row page reading it whole (9.4 MB at B=1, T=8k) and writing one word: the time of
  one launch that only reads the cache, the best a one-launch decode could do.
- torch's device copy of the cache (its bytes read and written), for reference.
Floors are the best of --rounds timings (the most generous floor); the decode call's figure is the median.
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
from decode_probe import NoLaunch
from limits import copy_bandwidth

import specmla.ops.decode.triton as mdt
from specmla.ops.decode.hopper import common as mla_decode_gluon
from specmla.ops.decode import mla_decode_torch
from specmla.ops.decode.triton import decode_bytes, mla_decode_triton, plan


STAGES = {  # the call with one of its two launches left out: (module, attribute) to replace
    "split kernel only": (mdt, "_mla_decode_combine_kernel"),
    "combine kernel only": (mla_decode_gluon, "launch_gluon_split"),
}


@triton.jit
def _empty(X):
    pass


@triton.jit
def _read_pages(KV, BT, OUT, stride_p, N: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr):
    """Program i reads part i % PARTS of page BT[i // PARTS] (N / PARTS elements, all loads issued before
    the first is used) and writes their sum: nothing but the cache's bytes."""
    pid = tl.program_id(0)
    base = KV + tl.load(BT + pid // PARTS).to(tl.int64) * stride_p + (pid % PARTS) * (N // PARTS)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.static_range(0, N // PARTS, BLOCK):
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
        variants = {"default": {}}
        if B == 1:
            for ns in (32, 64):
                variants[f"{ns} splits"] = dict(num_splits=ns)
            variants.update({stage: dict(stage=stage) for stage in STAGES})
        times = {k: [] for k in variants}
        errs = {}
        for name, v in variants.items():
            if "stage" in v:  # a wrong result by design
                continue
            got = mla_decode_triton(qs[0][:2], caches[0], table[:2], seq[:2], SCALE, head_dim_v=512,
                                    num_splits=v.get("num_splits"))
            errs[name] = ((got.double() - ref).norm() / ref.norm()).item()
        for r in range(args.rounds):
            names = list(variants)
            names = names[r % len(names):] + names[:r % len(names)]
            for name in names:
                v = variants[name]
                ns = v.get("num_splits") or ns_plan
                out = torch.empty(B, S, H, 512, dtype=torch.bfloat16, device="cuda")
                ws = (torch.empty(B, S, H, ns, 512, device="cuda"), torch.empty(B, S, H, ns, device="cuda"))
                module, attr = STAGES.get(v.get("stage"), (None, None))
                saved = module and getattr(module, attr)
                if module:
                    setattr(module, attr, NoLaunch())
                try:
                    times[name].append(time_fn(lambda i: mla_decode_triton(
                        qs[i], caches[i], table, seq, SCALE, out=out, workspace=ws, head_dim_v=512,
                        num_splits=v.get("num_splits")), copies, graph=True))
                finally:
                    if module:
                        setattr(module, attr, saved)
        for name in variants:
            t = statistics.median(times[name])
            row = dict(case=[H, B, T, S], variant=name, us=t * 1e6, runs_us=[x * 1e6 for x in times[name]],
                       GBps=nbytes / t / 1e9, pct_copy=100 * nbytes / t / bw, rel_err=errs.get(name))
            rows.append(row)
            print(f"{case:16s} {name:34s} {row['us']:8.2f} us {row['GBps']:6.0f} GB/s {row['pct_copy']:5.1f} %  "
                  f"err {row['rel_err'] or float('nan'):.1e}  runs {[round(x, 2) for x in row['runs_us']]}", flush=True)
        if B == 1:  # the floors of a one-launch call at this size
            dummy = torch.empty(1, device="cuda")
            t_empty = time_fn(lambda i: _empty[(1,)](dummy), copies, graph=True)
            n = PAGE * 576
            reads = {}
            for parts in (1, 2, 4, 8):  # 128 .. 1024 programs at B=1, T=8k
                for warps in (4, 8):
                    sums = torch.empty(table.numel() * parts, device="cuda")
                    reads[(parts, warps)] = min(time_fn(
                        lambda i: _read_pages[(table.numel() * parts,)](caches[i], table, sums, caches[i].stride(0),
                                                                        N=n, PARTS=parts, BLOCK=4096 // parts,
                                                                        num_warps=warps), copies, graph=True)
                        for _ in range(args.rounds))
            (parts, warps), t_read = min(reads.items(), key=lambda kv: kv[1])
            dst = torch.empty_like(caches[0])  # torch's device copy of the cache: reads and writes its bytes
            t_copy = min(time_fn(lambda i: dst.copy_(caches[i]), copies, graph=True) for _ in range(args.rounds))
            rows.append(dict(case=[H, B, T, S], variant="reference: torch copy of the cache", us=t_copy * 1e6,
                             GBps_read_plus_written=2 * caches[0].numel() * 2 / t_copy / 1e9))
            print(f"{case:16s} torch copy of the cache {t_copy * 1e6:.2f} us", flush=True)
            rows.append(dict(case=[H, B, T, S], variant="floor: empty launch", us=t_empty * 1e6))
            rows.append(dict(case=[H, B, T, S], variant="floor: read the cache in one launch", us=t_read * 1e6,
                             GBps=nbytes / t_read / 1e9, pct_copy=100 * nbytes / t_read / bw,
                             programs=table.numel() * parts, warps=warps,
                             all_us={f"{p * table.numel()} programs, {w} warps": t * 1e6 for (p, w), t in reads.items()}))
            print(f"{case:16s} floor: empty launch {t_empty * 1e6:.2f} us; read-only launch {t_read * 1e6:.2f} us = "
                  f"{nbytes / t_read / 1e9:.0f} GB/s ({100 * nbytes / t_read / bw:.1f} % of copy) with "
                  f"{table.numel() * parts} programs of {warps} warps; all: "
                  f"{ {k: round(v * 1e6, 2) for k, v in reads.items()} }", flush=True)
    with open(os.path.join(args.out, "decode_floor_probe.json"), "w") as f:
        json.dump(dict(copy_GBps=bw / 1e9, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
