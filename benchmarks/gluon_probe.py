"""Probe for the Gluon 64-row decode kernel (issue 3's H=128 and folded S=4 goals): correctness on
the test grid's odd cases against the fp32 reference, then times against the Triton kernel's
default in the same run (same CUDA-graph timing as bench_mla_decode).

    PYTHONPATH=. python3 benchmarks/gluon_probe.py [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from bench_mla_decode import SCALE, make_problem, time_fn
from limits import copy_bandwidth

from specmla.ops.decode.hopper import common as G
from specmla.ops.decode import mla_decode_torch
from specmla.ops.decode.triton import decode_bytes, decode_flops, mla_decode_triton, plan

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from helpers.mla_cases import make_decode_case, rel_err  # noqa: E402


def check(rows, quick=False):
    """Gluon vs the fp32 reference on NaN-poisoned caches with permuted tables."""
    cases = [  # H, S, B, page, lens, causal, splits
        (128, 1, 2, 64, [1000, 4096], True, None), (128, 1, 3, 16, [1, 63, 700], True, 3),
        (16, 4, 6, 64, [5, 64, 65, 129, 1000, 4096], True, None), (16, 4, 2, 128, [3, 2000], False, 7),
        (64, 1, 64, 64, [int(x) for x in torch.randint(1, 4096, (64,))], True, None),
        (16, 4, 2, 1, [9, 130], True, 2), (32, 2, 2, 64, [300, 77], True, 4), (128, 2, 1, 32, [4096], True, 16),
        (33, 2, 2, 64, [500, 40], True, 2), (64, 1, 2, 64, [513, 1], False, 1),
    ]
    for H, S, B, ps, lens, causal, ns in cases[: 3 if quick else None]:
        q, kv, table, seq = make_decode_case(B, S, H, ps, 512, 64, lens, torch.bfloat16, "cuda", seed=H + S, causal=causal)
        ref, ref_lse = mla_decode_torch(q.double(), kv.double(), table, seq, SCALE, causal=causal, return_lse=True,
                                        head_dim_v=512)
        r = {"case": [H, S, B, ps, causal, ns]}
        for name, g, seesaw in (("seesaw", True, True), ("gluon", True, False), ("triton", False, False)):
            G.SEESAW = seesaw
            try:
                out, lse = mla_decode_triton(q, kv, table, seq, SCALE, causal=causal, return_lse=True, head_dim_v=512,
                                             num_splits=ns, gluon=g)
                finite = lse.isfinite()
                r[name] = dict(rel=rel_err(out, ref), lse=(lse[finite].double() - ref_lse[finite]).abs().max().item(),
                               nan=bool(out.isnan().any()))
            except Exception as e:  # noqa: BLE001
                r[name] = {"error": repr(e)[:300]}
        rows.append(r)
        print("check", r, flush=True)


def _time_call(problem, B, S, H, ns, variant):
    """Seconds per mla_decode_triton call with `ns` splits and the variant's arguments (None: it failed)."""
    caches, table, seq, qs = problem
    out = torch.empty(B, S, H, 512, dtype=torch.bfloat16, device="cuda")
    ws = (torch.empty(B, S, H, ns, 512, device="cuda"), torch.empty(B, S, H, ns, device="cuda"))
    try:
        return time_fn(lambda i: mla_decode_triton(qs[i], caches[i], table, seq, SCALE, out=out, workspace=ws,
                                                   head_dim_v=512, num_splits=ns, **variant), 4, graph=True)
    except Exception as e:  # noqa: BLE001
        print("ERROR", (H, B, S), variant, ns, repr(e)[:300], flush=True)
        return None


def timing(rows, bw, quick):
    cases = [(128, 64, 8192, 1), (16, 64, 8192, 4), (64, 128, 4096, 1), (16, 32, 32768, 4),
             (128, 64, 8192, 2), (16, 4, 81920, 4)]
    variants = [("triton", dict(gluon=False), False), ("seesaw", dict(gluon=True, block_n=64), True),
                ("one_stream", dict(gluon=True, block_n=64, num_stages=2), False)]
    for H, B, T, S in cases[: 3 if quick else None]:
        problem = make_problem(H, B, T, S, 4)
        nb, fl = decode_bytes(B * T, B, S, H), decode_flops(B * T, S, H)
        for name, v, seesaw in variants:
            G.SEESAW = seesaw
            for mult in ((1,) if quick or H != 128 else (1, 2)):
                ns = plan(B, S, H, T, torch.device("cuda"), v.get("block_n", 64))["num_splits"] * mult
                t = _time_call(problem, B, S, H, ns, v)
                if t is None:
                    continue
                r = dict(case=[H, B, T, S], variant=name, splits=ns, us=t * 1e6, GBps=nb / t / 1e9,
                         pct_copy=100 * nb / t / bw, TFLOPs=fl / t / 1e12)
                rows.append(r)
                print("time", r, flush=True)
    G.SEESAW = True


def sweep_small_tiles(rows, bw):
    """16-row tiles (H=16 S=1, the Triton kernel's case) padded through the seesaw kernel vs Triton."""
    for H, B, T, S, splits in ((16, 128, 4096, 1, (1, 2)), (16, 32, 32768, 1, (1, 2, 4, 8)), (16, 64, 8192, 1, (1, 2, 4)),
                               (16, 4, 81920, 1, (16, 33, 66)), (16, 64, 8192, 2, (1, 2, 4))):
        problem = make_problem(H, B, T, S, 4)
        nb = decode_bytes(B * T, B, S, H)
        for v in (dict(gluon=False), dict(gluon=True, block_n=64)):
            for ns in splits:
                t = _time_call(problem, B, S, H, ns, v)
                if t is None:
                    continue
                r = dict(case=[H, B, T, S], variant=v, splits=ns, us=t * 1e6, pct_copy=100 * nb / t / bw)
                rows.append(r)
                print("sweep", r, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy {bw / 1e9:.0f} GB/s", flush=True)
    checks, times = [], []
    check(checks, args.quick)
    timing(times, bw, args.quick)
    if not args.quick:
        sweep_small_tiles(times, bw)
    with open(os.path.join(args.out, "gluon_probe.json"), "w") as f:
        json.dump({"copy_GBps": bw / 1e9, "checks": checks, "times": times}, f, indent=1)


if __name__ == "__main__":
    main()
