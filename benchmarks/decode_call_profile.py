"""Where one decode call's GPU time goes: each kernel of `mla_decode_triton` (split kernel, combine, tbq4's
rotations) with its mean duration, from torch's profiler over graph-free calls.

The graph-timed benchmark gives one figure per call; this splits it, so fixed costs (the combine, the rotations,
a split kernel with no key blocks) can be told from streaming time.

    PYTHONPATH=.:benchmarks python3 benchmarks/decode_call_profile.py --cases 16x32x32768x1 --kv fp8,tbq4 \
        [--set mla_decode_gluon_fp8reg.P_SPLIT=False ...] [--out DIR]
"""
import argparse
import collections
import importlib
import json
import os

import torch
from bench_mla_decode import SCALE, make_problem

from specmla.ops.decode.triton import mla_decode_triton


def kernel_times(fn, calls: int = 20) -> dict:
    """{kernel name: mean µs per call} over `calls` calls of fn (after a warm-up)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name[:80]] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    return {k: v / calls for k, v in total.most_common()}


def apply(settings: list[str]) -> None:
    """module.NAME=value pairs (module under specmla.ops) set before the calls."""
    for item in settings:
        target, value = item.split("=", 1)
        mod, name = target.rsplit(".", 1)
        setattr(importlib.import_module(f"specmla.ops.{mod}"), name, eval(value))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="16x32x32768x1")
    ap.add_argument("--kv", default="bf16,fp8,tbq4")
    ap.add_argument("--set", nargs="*", default=[])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    apply(args.set)
    report = {"settings": args.set, "rows": []}
    for case in args.cases.split(","):
        H, B, T, S = (int(x) for x in case.split("x"))
        for kv in args.kv.split(","):
            caches, table, seq, qs = make_problem(H, B, T, S, 1, kv)
            o = torch.empty(B, S, H, 512, dtype=torch.bfloat16, device="cuda")
            times = kernel_times(lambda q=qs[0], c=caches[0]: mla_decode_triton(q, c, table, seq, SCALE, out=o,
                                                                                head_dim_v=512, kv_format=kv))
            row = {"case": [H, B, T, S], "kv": kv, "kernels_us": times, "sum_us": sum(times.values())}
            print(json.dumps(row), flush=True)
            report["rows"].append(row)
            del caches, qs
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "decode_call_profile.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
