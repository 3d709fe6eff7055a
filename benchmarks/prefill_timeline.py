"""Issue-8 probe: where the Gluon prefill kernel's time goes between tiles. One causal 8k call per case
records every program's start and end (%globaltimer), SM and key blocks (`mla_prefill_gluon(timeline=)`),
and this prints how busy the SMs were, the fixed cost per tile (a fit of duration = a + b · blocks), the
gap between programs on one SM and the tail (time with fewer than all SMs busy).

    PYTHONPATH=.:benchmarks python3 benchmarks/prefill_timeline.py [--out DIR]
"""
import argparse
import json
import os

import torch
from bench_prefill import causal_problem

from specmla.ops.prefill import hopper as P


def summarise(t: torch.Tensor, n_sm: int) -> dict:
    """Statistics of one timeline [programs, 4] = (start ns, end ns, SM, key blocks)."""
    t = t[t[:, 1] > 0].double()
    start, end, sm, blocks = t[:, 0] - t[:, 0].min(), t[:, 1] - t[:, 0].min(), t[:, 2], t[:, 3]
    span = end.max().item()
    dur = end - start
    A = torch.stack([torch.ones_like(blocks), blocks], 1)
    fit = torch.linalg.lstsq(A, dur[:, None]).solution.flatten()
    gaps = []
    for s in range(n_sm):
        on = (sm == s).nonzero().flatten()
        if len(on) > 1:
            order = start[on].argsort()
            gaps.append((start[on][order][1:] - end[on][order][:-1]).clamp(min=0))
    gaps = torch.cat(gaps) if gaps else torch.zeros(1)
    last_end = torch.stack([end[sm == s].max() for s in range(n_sm) if (sm == s).any()])
    return {"programs": len(t), "span_us": span / 1e3, "busy": (dur.sum() / (n_sm * span)).item(),
            "fixed_us_per_tile": fit[0].item() / 1e3, "us_per_block": fit[1].item() / 1e3,
            "gap_us_median": gaps.median().item() / 1e3, "gap_us_mean": gaps.mean().item() / 1e3,
            "first_sm_idle_us": last_end.min().item() / 1e3, "tail_share": 1 - last_end.min().item() / span}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--seq", type=int, default=8192)
    args = ap.parse_args()
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    S, rows, raw = args.seq, [], {}
    for H, kw in ((128, {}), (16, {}), (16, {"heads_per_group": 16})):
        q, k, v, cu, *_ = causal_problem(H, S)
        times = torch.zeros(-(-S // P.BLOCK_M) * H, 4, dtype=torch.int64, device="cuda")
        for _ in range(3):  # the last call's timeline is kept
            times.zero_()
            P.mla_prefill_gluon(q, k, v, cu, cu, S, S, 0.072, timeline=times, **kw)
        torch.cuda.synchronize()
        row = {"H": H, **kw, **summarise(times.cpu(), n_sm)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        raw[f"H{H}_{len(kw)}"] = times.cpu().tolist()
    with open(os.path.join(args.out, "prefill_timeline.json"), "w") as f:
        json.dump({"summary": rows, "raw": raw}, f)


if __name__ == "__main__":
    main()
