"""Issue-7 probe: when each program of the fp8 decode kernel (`ops.mla_decode_gluon_fp8reg`) reaches each phase, from
the %globaltimer stamps of its PROBE 7 (the default kernel plus the stamps), and on which SM it ran.

Why: at B=32 T=32k the kernel's steady state runs at the copy rate (its time grows with T at 99 % of it), yet the
whole call reaches 90 %. The stamps show where the rest goes: the q prologue, the first block's arrival, the spread
of the programs' last blocks (some SMs read HBM more slowly than others, every run), the drain and the stores.
Repeated runs give each SM's finish time; their correlation says whether the spread follows the SMs.

    PYTHONPATH=.:benchmarks python3 benchmarks/fp8reg_timeline.py [--out DIR] [--reps 3] [--case 16x32x32768x1]
"""
import argparse
import json
import os

import torch
from bench_mla_decode import SCALE, make_problem
from fp8_probe import settings

from specmla.ops.decode.hopper import fp8 as R
from specmla.ops.decode.triton import mla_decode_triton, plan

PHASES = {0: "consumer 0 starts", 2: "q ready", 4: "first block handed over", 6: "last block handed over",
          8: "consumer 0 done", 9: "consumer 1 done", 10: "consumer 1's state in shared memory",
          11: "partial stored"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--case", default="16x32x32768x1")
    args = ap.parse_args()
    H, B, T, S = (int(x) for x in args.case.split("x"))
    caches, table, seq, qs = make_problem(H, B, T, S, 1, "fp8_ds_mla")
    ns = plan(B, S, H, T, qs[0].device, R.BLOCK_N, waves=1)["num_splits"]
    assert ns > 1, "the stamps go to the split workspace: pick a case with splits"
    programs = B * S * ns  # 16 rows: one head block, no folding
    # the partials, then the stamps STAMPS_AT int64 words in
    buf = torch.zeros(2 * R.STAMPS_AT + 32 * programs, dtype=torch.float32, device="cuda")
    assert B * S * H * ns * 512 <= 2 * R.STAMPS_AT
    mid_o = buf[: B * S * H * ns * 512].view(B, S, H, ns, 512)
    mid_lse = torch.empty(B, S, H, ns, dtype=torch.float32, device="cuda")
    want = mla_decode_triton(qs[0], caches[0], table, seq, SCALE, head_dim_v=512, kv_format="fp8_ds_mla")
    reps, finish_by_sm = [], []
    with settings(dict(PROBE=7), R):
        for _ in range(args.reps):
            buf.zero_()
            for _ in range(2):
                got = mla_decode_triton(qs[0], caches[0], table, seq, SCALE, head_dim_v=512, kv_format="fp8_ds_mla",
                                        workspace=(mid_o, mid_lse))
            torch.cuda.synchronize()
            assert torch.equal(got, want), "PROBE 7 must not change the result"
            t = buf[2 * R.STAMPS_AT:].view(torch.int64)[: programs * 16].view(programs, 16).cpu()
            us = (t[:, :12] - t[:, 0].min()).double() / 1e3
            sm = t[:, 12]
            rep = {name: dict(min=round(us[:, i].min().item(), 2), median=round(us[:, i].median().item(), 2),
                              max=round(us[:, i].max().item(), 2)) for i, name in PHASES.items()}
            order = torch.argsort(us[:, 6])
            rep["slowest_sms"] = [[int(sm[i]), round(us[i, 6].item(), 1)] for i in order[-8:].tolist()]
            rep["fastest_sms"] = [[int(sm[i]), round(us[i, 6].item(), 1)] for i in order[:8].tolist()]
            reps.append(rep)
            by_sm = torch.full((int(sm.max()) + 1,), float("nan"), dtype=torch.float64)
            by_sm[sm] = us[:, 6]
            finish_by_sm.append(by_sm)
            print(json.dumps({k: v for k, v in rep.items() if k in PHASES.values()}), flush=True)
    a, b = finish_by_sm[0], finish_by_sm[-1]
    n = min(len(a), len(b))
    ok = ~(a[:n].isnan() | b[:n].isnan())
    corr = torch.corrcoef(torch.stack([a[:n][ok], b[:n][ok]]))[0, 1].item()
    print(f"programs {programs}; last block handed over: spread {reps[-1]['last block handed over']}; "
          f"correlation of each SM's finish between the first and last run {corr:.3f}", flush=True)
    with open(os.path.join(args.out, "fp8reg_timeline.json"), "w") as f:
        json.dump({"case": [H, B, T, S], "splits": ns, "programs": programs, "runs": reps,
                   "finish_correlation_by_sm": corr}, f, indent=1)


if __name__ == "__main__":
    main()
