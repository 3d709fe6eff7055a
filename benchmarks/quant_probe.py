"""Probe for the quantised-cache decode speed (issue 7): tile / prefetch variants of the fp8 and
tbq4 paths against bf16 in the same run, each with its error against the fp32 reference.

    PYTHONPATH=. python3 benchmarks/quant_probe.py [--out DIR] [--cases 16x32x32768x1,...]

The main benchmark (bench_mla_decode.py --kv) sweeps bf16's tile list; the quantised paths load
their bytes into registers, so their best tiles differ: this sweeps prefetch on/off, key-block
size, warps, stages and the split count around the plan.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from bench_mla_decode import SCALE, kv_decode_bytes, make_problem, row_bytes, time_fn
from limits import copy_bandwidth

from specmla.ops.decode import mla_decode_torch
from specmla.ops.decode.triton import mla_decode_triton, plan

VARIANTS = [
    dict(prefetch=False),
    dict(prefetch=True),
    dict(prefetch=True, kv_align=8),
    dict(prefetch=True, block_n=64, num_warps=8, num_stages=2),
    dict(prefetch=True, block_n=32, num_warps=8, num_stages=2),
    dict(prefetch=True, block_n=32, num_warps=4, num_stages=1),
    dict(prefetch=False, block_n=64, num_warps=8, num_stages=2),
]


def timed(H, B, T, S, kv, v, problem, copies):
    caches, table, seq, qs = problem
    ref = mla_decode_torch(qs[0][:2].float(), caches[0], table[:2], seq[:2], SCALE, head_dim_v=512, kv_format=kv)
    try:
        got = mla_decode_triton(qs[0][:2], caches[0], table[:2], seq[:2], SCALE, head_dim_v=512, kv_format=kv, **v)
    except Exception as e:  # noqa: BLE001  (out of shared memory and the like)
        return {"error": str(e)[:200]}
    err = ((got.float() - ref).norm() / ref.norm()).item()
    out = torch.empty(B, S, H, 512, dtype=torch.bfloat16, device="cuda")
    ns = v.get("num_splits") or plan(B, S, H, T, torch.device("cuda"), v.get("block_n", 32))["num_splits"]
    ws = (torch.empty(B, S, H, ns, 512, device="cuda"), torch.empty(B, S, H, ns, device="cuda"))
    try:
        t = time_fn(lambda i: mla_decode_triton(qs[i], caches[i], table, seq, SCALE, out=out, workspace=ws,
                                                head_dim_v=512, kv_format=kv, **v), copies, graph=True)
    except Exception as e:  # noqa: BLE001
        return {"error": str(e)[:200], "err": err}
    return {"us": t * 1e6, "GBps": kv_decode_bytes(kv, B * T, B, S, H) / t / 1e9, "err": err, "splits": ns}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cases", default="16x32x32768x1,16x4x81920x1,16x32x32768x4")
    ap.add_argument("--kv", default="bf16,fp8_ds_mla,tbq4")
    ap.add_argument("--once", action="store_true", help="one default call per format and case (for ncu)")
    args = ap.parse_args(argv)
    if args.once:
        for case in args.cases.split(","):
            H, B, T, S = (int(x) for x in case.split("x"))
            for kv in args.kv.split(","):
                caches, table, seq, qs = make_problem(H, B, T, S, 1, kv)
                mla_decode_triton(qs[0], caches[0], table, seq, SCALE, head_dim_v=512, kv_format=kv)
                torch.cuda.synchronize()
        return
    copy_bw = copy_bandwidth()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    for case in args.cases.split(","):
        H, B, T, S = (int(x) for x in case.split("x"))
        bf16_us = None
        for kv in args.kv.split(","):
            copies = max(1, min(8, -(-4 * l2 // (B * T * row_bytes(kv)))))
            problem = make_problem(H, B, T, S, copies, kv)
            variants = [{}] if kv == "bf16" else VARIANTS
            best = None
            for v in variants:
                r = timed(H, B, T, S, kv, v, problem, copies)
                r.update(case=case, kv=kv, variant=v)
                rows.append(r)
                if "us" in r and (best is None or r["us"] < best["us"]):
                    best = r
                print(f"{case} {kv:5s} {str(v):70s} " + (f"{r['us']:8.1f} us {r['GBps']:6.0f} GB/s err {r['err']:.1e}"
                                                         if "us" in r else r.get("error", "")), flush=True)
            if best is not None and kv != "bf16":
                for f in (0.5, 2):
                    n = max(1, int(best["splits"] * f))
                    v = dict(best["variant"], num_splits=n)
                    r = timed(H, B, T, S, kv, v, problem, copies)
                    r.update(case=case, kv=kv, variant=v)
                    rows.append(r)
                    print(f"{case} {kv:5s} {str(v):70s} " + (f"{r['us']:8.1f} us {r['GBps']:6.0f} GB/s"
                                                             if "us" in r else r.get("error", "")), flush=True)
                    if "us" in r and r["us"] < best["us"]:
                        best = r
            if kv == "bf16" and best:
                bf16_us = best["us"]
            if best and bf16_us:
                print(f"== {case} {kv}: best {best['us']:.1f} us, {best['GBps']:.0f} GB/s "
                      f"({100 * best['GBps'] * 1e9 / copy_bw:.1f} % copy), {bf16_us / best['us']:.2f}x bf16 "
                      f"[{best['variant']}]", flush=True)
            del problem
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "quant_probe.json"), "w") as f:
        json.dump({"copy_GBps": copy_bw / 1e9, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
