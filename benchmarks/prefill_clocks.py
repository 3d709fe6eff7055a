"""Issue-8 probe: the SM clock and power each prefill kernel runs at when it runs for a while.

Why: under Nsight Compute (clocks locked at 1.45 GHz) the Gluon kernel and torch SDPA's cuDNN kernel take
the same time on one causal 8k call at H=128 (5.04 against 5.02 ms), yet unlocked SDPA is 5–9 % faster.
Either the two run at different clocks (power) or part of ours does not scale with the clock (latency).
Each phase runs one kernel back to back for `--seconds` while a thread samples the clock and power
(nvidia-smi), and times every call with CUDA events.

    PYTHONPATH=.:benchmarks python3 benchmarks/prefill_clocks.py [--out DIR]
"""
import argparse
import json
import os
import subprocess
import threading
import time

import torch
import torch.nn.functional as F
from bench_prefill import causal_problem

from specmla.ops import prefill as prefill_ops
from specmla.ops.prefill.hopper import mla_prefill_gluon


class Sampler(threading.Thread):
    """nvidia-smi in loop mode: (host time, SM MHz, watts) every `ms` milliseconds."""

    def __init__(self, ms=20):
        super().__init__(daemon=True)
        self.rows, self.ms = [], ms
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                      f"-lms={ms}"], stdout=subprocess.PIPE, text=True)

    def run(self):
        for line in self.proc.stdout:
            try:
                mhz, watts = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.rows.append((time.time(), mhz, watts))

    def stop(self):
        self.proc.terminate()

    def between(self, t0, t1):
        sel = [(m, w) for t, m, w in self.rows if t0 <= t <= t1]
        if not sel:
            return float("nan"), float("nan"), 0
        return sum(m for m, _ in sel) / len(sel), sum(w for _, w in sel) / len(sel), len(sel)


def phase(fn, seconds, sampler, flops):
    fn()
    torch.cuda.synchronize()
    t0 = time.time()
    events = []
    while time.time() - t0 < seconds:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        events.append((s, e))
        if len(events) % 8 == 0:
            events[-1][1].synchronize()  # keep the host close to the device so the samples line up
    torch.cuda.synchronize()
    t1 = time.time()
    ms = sorted(s.elapsed_time(e) for s, e in events)
    mhz, watts, n = sampler.between(t0 + 0.2 * (t1 - t0), t1)
    return {"calls": len(ms), "median_ms": ms[len(ms) // 2], "TFLOPs": flops / (ms[len(ms) // 2] / 1e3) / 1e12,
            "first_ms": events[0][0].elapsed_time(events[0][1]), "sm_mhz": mhz, "watts": watts, "samples": n}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    sampler = Sampler()
    sampler.start()
    rows = []
    for H in (128, 16):
        S = 8192
        q, k, v, cu, flops, (qs, ks, vs) = causal_problem(H, S)
        fns = {"ours": lambda: prefill_ops.mla_prefill(q, k, v, cu, cu, S, S, 0.072),
               "ours_grid": lambda: mla_prefill_gluon(q, k, v, cu, cu, S, S, 0.072, persistent=False),
               "sdpa": lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.072)}
        for rnd in range(2):
            for name, fn in fns.items():
                time.sleep(1.0)  # let the clock recover between phases, alike for each
                row = {"H": H, "kernel": name, "round": rnd, **phase(fn, args.seconds, sampler, flops)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    sampler.stop()
    with open(os.path.join(args.out, "prefill_clocks.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
