"""Probe for the missed decode goals (issue 3): where the time of a case goes, and tile variants the
main benchmark does not sweep (128-row head tiles for H=128, warp counts for folded S=4).

    PYTHONPATH=. python3 benchmarks/decode_probe.py [--out DIR]

- Stage breakdown: the split kernel alone and the combine kernel alone (the other replaced by a
  no-op launch) inside the same back-to-back CUDA graph as bench_mla_decode times.
- Variants: each variant's time, GB/s, TFLOP/s and error against the fp32 reference.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from bench_mla_decode import SCALE, make_problem, time_fn
from limits import copy_bandwidth

import specmla.ops.decode.triton as mdt
from specmla.ops.decode import mla_decode_torch
from specmla.ops.decode.triton import decode_bytes, decode_flops, mla_decode_triton, plan


class NoLaunch:
    """Stands in for a Triton kernel or a launching function: `k[grid](...)` and `k(...)` launch nothing."""

    def __getitem__(self, grid):
        return self

    def __call__(self, *args, **kwargs):
        return None


def timed(H, B, T, S, v, copies, stage="both"):
    caches, table, seq, qs = make_problem(H, B, T, S, copies)
    ref = mla_decode_torch(qs[0][:2].float(), caches[0], table[:2], seq[:2], SCALE, head_dim_v=512)
    try:
        got = mla_decode_triton(qs[0][:2], caches[0], table[:2], seq[:2], SCALE, head_dim_v=512, **v)
    except Exception as e:  # noqa: BLE001  (out of shared memory and the like)
        return {"error": str(e)[:160]}
    err = ((got.float() - ref).norm() / ref.norm()).item()
    out = torch.empty(B, S, H, 512, dtype=torch.bfloat16, device="cuda")
    ns = v.get("num_splits") or plan(B, S, H, T, torch.device("cuda"), v.get("block_n", 32),
                                     v.get("max_rows", 64))["num_splits"]
    ws = (torch.empty(B, S, H, ns, 512, device="cuda"), torch.empty(B, S, H, ns, device="cuda"))
    saved = mdt._mla_decode_split_kernel, mdt._mla_decode_combine_kernel
    if stage == "split":
        mdt._mla_decode_combine_kernel = NoLaunch()
    elif stage == "combine":
        mdt._mla_decode_split_kernel = NoLaunch()
    try:
        t = time_fn(lambda i: mla_decode_triton(qs[i], caches[i], table, seq, SCALE, out=out, workspace=ws,
                                                head_dim_v=512, **v), copies, graph=True)
    except Exception as e:  # noqa: BLE001
        return {"error": str(e)[:160]}
    finally:
        mdt._mla_decode_split_kernel, mdt._mla_decode_combine_kernel = saved
    nb, fl = decode_bytes(B * T, B, S, H), decode_flops(B * T, S, H)
    return {"us": t * 1e6, "GBps": nb / t / 1e9, "TFLOPs": fl / t / 1e12, "err": err, "splits": ns}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy {bw / 1e9:.0f} GB/s", flush=True)
    rows = []

    def show(case, v, stage="both", copies=4):
        r = timed(*case, v, copies, stage)
        r.update(case=case, variant=v, stage=stage)
        rows.append(r)
        if "error" in r:
            print(case, v, stage, "ERROR", r["error"], flush=True)
        else:
            print(f"{case} {stage:7s} {str(v):70s} {r['us']:8.1f} us {r['GBps']:6.0f} GB/s "
                  f"{100 * r['GBps'] * 1e9 / bw:5.1f}% {r['TFLOPs']:6.1f} TF  err {r['err']:.1e}  splits {r['splits']}",
                  flush=True)

    b1 = (16, 1, 8192, 1)
    for ns in (16, 32, 64, 128):
        for stage in ("both", "split", "combine"):
            show(b1, dict(num_splits=ns), stage, copies=8)
    for v in (dict(block_n=16, num_warps=4, num_stages=4), dict(block_n=64, num_warps=4, num_stages=3),
              dict(block_n=32, num_warps=2, num_stages=4)):
        show(b1, v, copies=8)
    h128 = (128, 64, 8192, 1)
    for v in (dict(), dict(max_rows=128, num_warps=8, block_n=32, num_stages=2),
              dict(max_rows=128, num_warps=16, block_n=32, num_stages=2),
              dict(max_rows=128, num_warps=16, block_n=16, num_stages=3),
              dict(max_rows=128, num_warps=16, block_n=64, num_stages=1),
              dict(max_rows=128, num_warps=8, block_n=16, num_stages=3),
              dict(num_warps=4, block_n=32, num_stages=3), dict(num_warps=8, block_n=32, num_stages=3)):
        show(h128, v)
    s4 = (16, 64, 8192, 4)
    show((16, 64, 8192, 1), dict())
    for v in (dict(), dict(num_warps=4, block_n=32, num_stages=3), dict(num_warps=4, block_n=64, num_stages=2),
              dict(num_warps=8, block_n=32, num_stages=3), dict(num_warps=16, block_n=64, num_stages=2),
              dict(num_warps=8, block_n=64, num_stages=1)):
        show(s4, v)
    with open(os.path.join(args.out, "decode_probe.json"), "w") as f:
        json.dump({"copy_GBps": bw / 1e9, "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
