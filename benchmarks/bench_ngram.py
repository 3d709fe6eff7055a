"""N-gram proposer: time of the GPU kernels vs a numpy proposer with its device↔host copies, and host syncs.

FastDeploy's comparison, at B=256, L=131072 by default; the GPU path must run without a host sync.

    PYTHONPATH=. python3 benchmarks/bench_ngram.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from specmla.ops.ngram import ngram_propose


def cpu_ngram(tokens: np.ndarray, lens: np.ndarray, max_ngram: int, min_ngram: int, k: int, budget: int | None):
    """Vectorised numpy per request (a fair CPU baseline; the reference loop is far slower)."""
    B = tokens.shape[0]
    drafts = np.zeros((B, k), dtype=np.int64)
    num = np.zeros(B, dtype=np.int32)
    for b in range(B):
        row, n_len = tokens[b], int(lens[b])
        for n in range(max_ngram, min_ngram - 1, -1):
            if n >= n_len:
                continue
            limit = n_len - n
            ok = np.ones(limit, dtype=bool)
            for t in range(n):
                ok &= row[t : t + limit] == row[n_len - n + t]
            hits = np.flatnonzero(ok)
            if hits.size:
                s = hits[0] + n
                got = row[s : min(s + k, n_len)]
                drafts[b, : got.size] = got
                num[b] = got.size
                break
    if budget is not None:
        assigned, remaining = 0, B
        for b in range(B):
            remaining -= 1
            num[b] = min(num[b], max(0, budget - assigned - 1 - remaining))
            drafts[b, num[b]:] = 0
            assigned += 1 + num[b]
    return drafts, num


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rng = np.random.default_rng(0)
    B, L = args.batch, args.length
    tokens = rng.integers(0, args.vocab, size=(B, L))
    lens = rng.integers(L // 2, L + 1, size=B).astype(np.int32)
    for b in range(B):  # plant a repeat of each row's 3-token suffix somewhere earlier (or not)
        if b % 4:
            at = int(rng.integers(0, lens[b] - 16))
            tokens[b, at : at + 3] = tokens[b, lens[b] - 3 : lens[b]]
    kw = dict(max_ngram=3, min_ngram=1, num_draft=args.k, max_batch_tokens=B * 3)
    t_dev = torch.from_numpy(tokens).to(dev)
    l_dev = torch.from_numpy(lens).to(dev)
    d, n = ngram_propose(t_dev, l_dev, **kw)
    ref_d, ref_n = cpu_ngram(tokens, lens, 3, 1, args.k, B * 3)
    assert np.array_equal(n.cpu().numpy(), ref_n) and np.array_equal(d.cpu().numpy(), ref_d), "mismatch"

    def gpu_call():
        return ngram_propose(t_dev, l_dev, **kw)

    def cpu_call():  # what a CPU proposer pays: copy the history down, search, copy the drafts up
        toks, ls = t_dev.cpu().numpy(), l_dev.cpu().numpy()
        dd, nn = cpu_ngram(toks, ls, 3, 1, args.k, B * 3)
        return torch.from_numpy(dd).to(dev), torch.from_numpy(nn).to(dev)

    def timed(fn, reps):
        times = []
        for _ in range(reps):
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if dev == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    gpu_call()
    syncs_ok = None
    if dev == "cuda":
        torch.cuda.set_sync_debug_mode("error")  # any host sync inside raises
        try:
            gpu_call()
            syncs_ok = True
        except RuntimeError:
            syncs_ok = False
        finally:
            torch.cuda.set_sync_debug_mode("default")
    t_gpu = timed(gpu_call, 20)
    t_cpu = timed(cpu_call, 3)
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "B": B, "L": L, "k": args.k,
           "kernel_s": t_gpu, "cpu_with_copies_s": t_cpu, "speedup": t_cpu / t_gpu, "zero_host_syncs": syncs_ok}
    print(json.dumps(res))
    with open(os.path.join(args.out, "bench_ngram.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
