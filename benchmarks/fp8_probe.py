"""Issue-7 probe: fp8 and tbq4 caches through the Hopper Gluon kernel (`ops.mla_decode_gluon_quant`) and
through the Triton kernel, against bf16, in one run (CUDA-graph timing as bench_mla_decode), plus the
Gluon kernel's timing probes (`PROBE`: one half of its work left out, so the results are wrong).

    PYTHONPATH=.:benchmarks python3 benchmarks/fp8_probe.py [--out DIR]
    FP8_PROBE_CASES=16x32x32768x1 FP8_PROBE_SHAPES=16:8:120:136,32:8:144:112 ...  # cases; register splits
"""
import argparse
import contextlib
import json
import os

import torch
from bench_mla_decode import SCALE, kv_decode_bytes, make_problem, time_fn
from limits import copy_bandwidth

from specmla.ops.decode.hopper import dequant as F
from specmla.ops.decode import mla_decode_torch
from specmla.ops.decode.triton import mla_decode_triton

DS = "fp8_ds_mla"  # FlashMLA's 656-byte rows, the layout these probes measured

CASES = [(16, 32, 32768, 1), (16, 4, 81920, 1), (16, 32, 32768, 2), (16, 1, 8192, 1), (16, 128, 4096, 1)]
if os.environ.get("FP8_PROBE_CASES"):  # e.g. "16x32x32768x1,16x4x81920x1"
    CASES = [tuple(int(v) for v in c.split("x")) for c in os.environ["FP8_PROBE_CASES"].split(",")]
# name, cache format, mla_decode_triton(gluon=), settings of ops.mla_decode_gluon_quant for the call
VARIANTS = (("bf16", "bf16", None, {}), ("fp8_default", DS, None, {}), ("fp8_gluon", DS, True, {}),
            ("fp8_triton", DS, False, {}),
            # timing probes (wrong results): no unpacking; no consumer matmuls; raw stores; no code loads; neither
            # loads nor unpacking
            ("probe_no_unpack", DS, True, dict(PROBE=1)), ("probe_no_mma", DS, True, dict(PROBE=2)),
            ("probe_raw_stores", DS, True, dict(PROBE=3)), ("probe_no_loads", DS, True, dict(PROBE=4)),
            ("probe_consumers_only", DS, True, dict(PROBE=5)),
            ("tbq4_default", "tbq4", None, {}), ("tbq4_gluon", "tbq4", True, {}), ("tbq4_triton", "tbq4", False, {}))
if os.environ.get("FP8_PROBE_SHAPES"):  # register splits to try: "16:8:104:152,32:4:152:208" (rows:warps:cons:prod)
    VARIANTS = VARIANTS[:2] + tuple(
        (f"shape_{v}", DS, True,
         dict(SHAPES={**F.SHAPES, int(v.split(":")[0]): tuple(int(x) for x in v.split(":")[1:])}))
        for v in os.environ["FP8_PROBE_SHAPES"].split(","))


@contextlib.contextmanager
def settings(values: dict, module=F):
    """Module settings of a Gluon kernel (default: `ops.mla_decode_gluon_quant`) for one variant, restored after."""
    old = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    out_dir = ap.parse_args().out
    bw = copy_bandwidth()
    print(f"copy {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for H, B, T, S in CASES:
        res = {"case": [H, B, T, S]}
        for kv in ("bf16", DS, "tbq4"):
            caches, table, seq, qs = make_problem(H, B, T, S, 4, kv)
            nb = kv_decode_bytes(kv, B * T, B, S, H)
            out = torch.empty(B, S, H, 512, dtype=torch.bfloat16, device="cuda")
            ref = mla_decode_torch(qs[0][:2].float(), caches[0], table[:2], seq[:2], SCALE, head_dim_v=512,
                                   kv_format=kv)
            for name, fmt, gluon, values in VARIANTS:
                if fmt != kv:
                    continue
                with settings(values):
                    got = mla_decode_triton(qs[0][:2], caches[0], table[:2], seq[:2], SCALE, head_dim_v=512,
                                            kv_format=kv, gluon=gluon)
                    t = time_fn(lambda i, qs=qs, caches=caches: mla_decode_triton(
                        qs[i], caches[i], table, seq, SCALE, out=out, head_dim_v=512, kv_format=kv, gluon=gluon),
                        4, graph=True)
                res[name] = dict(us=t * 1e6, pct_copy=100 * nb / t / bw,
                                 rel_err=((got.float() - ref).norm() / ref.norm()).item())
            del caches, qs
            torch.cuda.empty_cache()
        for name, *_ in VARIANTS[1:]:
            res[name]["x_bf16"] = res["bf16"]["us"] / res[name]["us"]
        print(json.dumps(res), flush=True)
        rows.append(res)
    with open(os.path.join(out_dir, "fp8_probe.json"), "w") as f:
        json.dump({"copy_GBps": bw / 1e9, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
