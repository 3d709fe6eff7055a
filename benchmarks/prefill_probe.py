"""Issue-8 probe: Gluon prefill variants (`ops.mla_prefill_gluon` knobs) against the Triton kernel and
torch SDPA, causal, d_qk 192 / d_v 128, bf16, in one run, timed in interleaved rounds
(`bench_prefill.interleaved`).

    PYTHONPATH=.:benchmarks python3 benchmarks/prefill_probe.py [--out DIR] [--rounds N]
"""
import argparse
import json
import os

import torch.nn.functional as F
from bench_prefill import causal_problem, interleaved
from limits import gemm_rate

from specmla.ops.prefill import hopper as P
from specmla.ops.prefill import mla_prefill_triton

VARIANTS = {  # name → keyword arguments of mla_prefill_gluon
    "gluon": {},  # one request: the persistent grid, key blocks from the diagonal down, heads by `head_group`
    "gluon_forward_heads_7": {"reverse": False, "heads_per_group": 7},  # the seventh session's order
    "gluon_grid": {"persistent": False},  # one program per tile
    "gluon_q_whole": {"split_q": False},  # Q loaded once both warpgroups are done with the last tile's
    "gluon_heads_1": {"heads_per_group": 1},
    "gluon_heads_2": {"heads_per_group": 2},
    "gluon_heads_4": {"heads_per_group": 4},
}


def triton_launch(q, k, v, cu, S):
    """The default kernel launched through Triton's own path every call (`FAST_LAUNCH` off)."""
    P.FAST_LAUNCH = False
    try:
        return P.mla_prefill_gluon(q, k, v, cu, cu, S, S, 0.072)
    finally:
        P.FAST_LAUNCH = True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seq", type=int, default=8192)
    args = ap.parse_args()
    gemm = gemm_rate() / 1e12
    print(f"gemm {gemm:.0f} TFLOP/s", flush=True)
    rows = []
    S = args.seq
    for H in (128, 16):
        q, k, v, cu, flops, (qs, ks, vs) = causal_problem(H, S)
        want = mla_prefill_triton(q, k, v, cu, cu, S, S, 0.072, gluon=False).float()
        fns = {name: (lambda kw=kw: P.mla_prefill_gluon(q, k, v, cu, cu, S, S, 0.072, **kw))
               for name, kw in VARIANTS.items()}
        fns["gluon_triton_launch"] = lambda: triton_launch(q, k, v, cu, S)
        fns["triton"] = lambda: mla_prefill_triton(q, k, v, cu, cu, S, S, 0.072, gluon=False)
        fns["sdpa"] = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.072)
        times = interleaved(list(fns.values()), rounds=args.rounds)
        row = {"H": H, "S": S, "gemm_TFLOPs": gemm}
        for (name, fn), t in zip(fns.items(), times):
            row[name] = round(flops / t / 1e12, 1)
            if name.startswith("gluon"):
                err = ((fn().float() - want).norm() / want.norm()).item()
                row[name + "_err"] = err
        row["sdpa_over_gluon"] = row["sdpa"] / row["gluon"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(os.path.join(args.out, "prefill_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
