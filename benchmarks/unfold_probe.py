"""Several query tokens (S > 1, the MTP verify step) on quantised caches: the 64-row e4m3 kernel (fp8 formats, through
`mla_decode_triton.FOLDED_E4M3_FORMATS`), the 16-row e4m3 Gluon kernels with one query token per program
(`UNFOLDED_FORMATS`) and the folded route (the Triton kernel or the unpacking Gluon kernel), each format in the same
run as bf16. GPU only.

    PYTHONPATH=.:benchmarks python3 benchmarks/unfold_probe.py --cases 16x32x32768x2,16x32x32768x4 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from bench_mla_decode import SCALE, make_problem, parse_case, row_bytes, time_fn

from specmla.ops.decode import triton as T
from specmla.ops.decode import mla_decode_torch

FORMATS = ("bf16", "fp8", "fp8_ds_mla", "tbq4")
FOLD64 = ("fp8", "fp8_ds_mla")  # the formats the 64-row kernel reads (its route is off by default)


def time_route(kv: str, H: int, B: int, T_: int, S: int, unfolded: tuple, folded64: tuple = ()) -> dict:
    """Seconds per default call with UNFOLDED_FORMATS = unfolded and FOLDED_E4M3_FORMATS = folded64, and its error on
    two requests."""
    T.UNFOLDED_FORMATS = unfolded
    T.FOLDED_E4M3_FORMATS = folded64
    caches, table, seq, qs = make_problem(H, B, T_, S, 2, kv)
    ref = mla_decode_torch(qs[0][:2].float(), caches[0], table[:2], seq[:2], SCALE, head_dim_v=512, kv_format=kv)
    got = T.mla_decode_triton(qs[0][:2], caches[0], table[:2], seq[:2], SCALE, head_dim_v=512, kv_format=kv)
    err = ((got.float() - ref).norm() / ref.norm()).item()
    out = torch.empty(B, S, H, 512, dtype=torch.bfloat16, device="cuda")
    t = time_fn(lambda i: T.mla_decode_triton(qs[i], caches[i], table, seq, SCALE, out=out, head_dim_v=512,
                                              kv_format=kv), 2, graph=True)
    return {"s": t, "rel_err": err}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="16x32x32768x2,16x32x32768x4,16x4x81920x4")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--kv", default=",".join(FORMATS[1:]), help="quantised formats to time (bf16 always runs)")
    args = ap.parse_args()
    default, default64 = T.UNFOLDED_FORMATS, T.FOLDED_E4M3_FORMATS
    rows = []
    for case in args.cases.split(","):
        H, B, T_, S = parse_case(case)
        base = time_route("bf16", H, B, T_, S, default)
        rows.append({"case": case, "kv": "bf16", "route": "default", **base})
        print(f"{case} bf16 {base['s'] * 1e6:.1f} us", flush=True)
        for kv in args.kv.split(","):
            routes = [("unfolded", default, ()), ("folded", (), ())]
            if kv in FOLD64:
                routes.insert(0, ("fold64", default, FOLD64))
            for route, unfolded, folded64 in routes:
                r = time_route(kv, H, B, T_, S, unfolded, folded64)
                rows.append({"case": case, "kv": kv, "route": route, "row_bytes": row_bytes(kv),
                             "x_bf16": base["s"] / r["s"], **r})
                print(f"{case} {kv} {route} {r['s'] * 1e6:.1f} us {base['s'] / r['s']:.2f}x err {r['rel_err']:.4f}",
                      flush=True)
    T.UNFOLDED_FORMATS, T.FOLDED_E4M3_FORMATS = default, default64
    with open(os.path.join(args.out, "unfold_probe.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
