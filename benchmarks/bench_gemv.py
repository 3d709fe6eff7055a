"""`specmla.ops.linear.gemv` (the small-M GEMVs of the decode step) against cuBLAS at decode batch (T = 1, 2, 4, 8),
bf16, on the MLA projections' shapes (V2-Lite's q‖kv_a, o_proj and head, V3's q_a‖kv_a and a large FFN weight; W_UK /
W_UV at 16 and 128 heads, as views of kv_b_proj).

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_gemv.py --out DIR [--quick]       # a GPU (< 90 s on an H200)
    PYTHONPATH=<triton of the GPU machine>:.:benchmarks python3 benchmarks/bench_gemv.py --offline  # sm_90, no GPU

Method: the device copy rate (`limits.copy_bandwidth`, bytes read + written); then per shape and T, cuBLAS (the
model's F.linear / einsum) and the kernel under each config of `sweep()`, each as a CUDA graph of back-to-back calls
over distinct weight copies (≥ 3 × L2 of weights per replay, so every call reads its weight from HBM; ≥ 20 calls),
median of 5 replays (`ops.timing.graph_call_time`, a spin kernel hiding each replay's launch) → µs per call and the weight bytes per µs as a share of the copy rate. Every config is first
checked on the GPU against the fp32 reference (rtol = atol = 2e-2 on outputs of unit scale). The Triton kernels
are compiled beforehand by a pool of processes sharing Triton's cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from specmla.ops.linear.gemv import GemvConfig, default_config, head_matmul_small_m, linear_small_m
from specmla.ops.timing import graph_call_time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from limits import copy_bandwidth  # noqa: E402

LINEAR = [(3648, 2048), (2048, 2048), (102400, 2048), (2112, 7168), (7168, 16384)]  # (N, K)
HEADS = [("uk", 16, 128, 512), ("uv", 16, 512, 128), ("uk", 128, 128, 512), ("uv", 128, 512, 128)]  # (G, K, N)
TS = (1, 2, 4, 8)
SMS = 132


def _split(G, N, K, bn, bk, waves):
    """The split giving about waves × SMS programs (at least one tile per split)."""
    kt = math.ceil(K / bk)
    s = max(1, min(kt, math.ceil(waves * SMS / (G * math.ceil(N / bn)))))
    return math.ceil(kt / math.ceil(kt / s))


def _cfg(G, N, K, bn, bk, stages, waves=None, split=1, **kw):
    """A config with its split for about waves × SMS programs (when waves is given) and its stages capped at the
    tiles a program owns + 1 (more only take shared memory)."""
    bn = min(bn, max(16, 1 << (N - 1).bit_length()))
    bk = min(bk, max(16, 1 << (K - 1).bit_length()))
    if waves is not None:
        split = _split(G, N, K, bn, bk, waves)
    stages = max(2, min(stages, math.ceil(math.ceil(K / bk) / split) + 1))
    return GemvConfig(bn, bk, 4, stages, split, **kw)


def sweep(T, G, N, K, quick=False):
    """[(label, GemvConfig)]: the default, then tile / stage / split / prefetch variants (configs equal after the
    split's normalisation are dropped)."""
    d = default_config(T, G, N, K, SMS)
    out = [("default", d)]
    cand = [
        ("n16k256 s8", _cfg(G, N, K, 16, 256, 8)),
        ("n32k256 s8", _cfg(G, N, K, 32, 256, 8)),
        ("n64k128 s8 1w", _cfg(G, N, K, 64, 128, 8, waves=1)),
        ("n64k128 s4", _cfg(G, N, K, 64, 128, 4)),
        ("n64k64 s4", _cfg(G, N, K, 64, 64, 4)),
        ("n128k64 s4", _cfg(G, N, K, 128, 64, 4)),
        ("n32k256 s4", _cfg(G, N, K, 32, 256, 4)),
        ("n64k128 s4 2w", _cfg(G, N, K, 64, 128, 4, waves=2)),
        ("default pf0", dataclasses.replace(d, prefetch=0)),
        ("default pf8", dataclasses.replace(d, prefetch=8)),
    ]
    if quick:
        cand = cand[:3]
    seen = {_key(d, K)}
    for label, c in cand:
        if _key(c, K) not in seen:
            seen.add(_key(c, K))
            out.append((label, c))
    return out


def _key(c, K):
    kt = math.ceil(K / c.block_k)
    split = math.ceil(kt / math.ceil(kt / min(c.split_k, kt)))
    return (c.block_n, c.block_k, c.num_warps, c.num_stages, split, c.prefetch)


def cases(quick=False):
    """[(kind, G, K, N, T)]: linear shapes as one head of w = weightᵀ."""
    ts = (1, 8) if quick else TS
    out = [("linear", 1, K, N, T) for N, K in LINEAR for T in ts]
    return out + [(kind, G, K, N, T) for kind, G, K, N in HEADS for T in ts]


class Case:
    """Operands of one (kind, G, K, N, T): weight copies as the model holds them, x, and the calls."""

    def __init__(self, kind, G, K, N, T, copies, device="cuda", empty=False):
        self.kind, self.G, self.K, self.N, self.T = kind, G, K, N, T
        bf = torch.bfloat16
        make = (lambda *s: torch.empty(*s, dtype=bf, device=device)) if empty else \
            (lambda *s: (torch.randn(*s, device=device) * K ** -0.5).to(bf))
        if kind == "linear":
            self.ws = [make(N, K) for _ in range(copies)]  # F.linear's weight [N, K]
            self.x = make(T, K) * (1 if empty else K ** 0.5)
        elif kind == "uk":  # w_uk: [G, K=Dn, N=Dc] view of kv_b_proj [G, Dn + Dv, Dc]
            self.ws = [make(G, 2 * K, N)[:, :K] for _ in range(copies)]
            self.q = make(T, G, K + 64) * (1 if empty else K ** 0.5)
            self.x = self.q[..., :K]
            self.q_abs = torch.empty(T, G, N + 64, dtype=bf, device=device)
        else:  # w_uv: [G, Dv=N, Dc=K] view of kv_b_proj; the kernel takes w_uv.transpose(1, 2)
            self.ws = [make(G, 2 * N, K)[:, N:] for _ in range(copies)]
            self.x = make(T, G, K) * (1 if empty else K ** 0.5)

    def weight_bytes(self):
        return self.G * self.K * self.N * 2

    def cublas(self, i):
        w = self.ws[i]
        if self.kind == "linear":
            return F.linear(self.x, w)
        if self.kind == "uk":
            return torch.einsum("thn,hnc->thc", self.x, w)
        return torch.einsum("thc,hvc->thv", self.x, w)

    def ours(self, i, cfg):
        w = self.ws[i]
        if self.kind == "linear":
            return linear_small_m(self.x, w, config=cfg)
        if self.kind == "uk":
            return head_matmul_small_m(self.x, w, out=self.q_abs[..., :self.N], config=cfg)
        return head_matmul_small_m(self.x, w.transpose(1, 2), config=cfg)

    def reference(self):
        w = self.ws[0].float()
        if self.kind == "linear":
            return self.x.float() @ w.t()
        if self.kind == "uk":
            return torch.einsum("thn,hnc->thc", self.x.float(), w)
        return torch.einsum("thc,hvc->thv", self.x.float(), w)


def time_graph(fn, calls, replays=5):
    """µs per call: `ops.timing.graph_call_time` of `calls` back-to-back fn(i) in one CUDA graph."""
    t = graph_call_time(fn, calls, replays)
    if t is None:
        raise RuntimeError("a GEMV call did not compile or launch (run with logging at DEBUG for the reason)")
    return t * 1e6


def _compile_worker(items):
    """Compile (by running once on empty operands) the kernel of each (case, config) in a fresh process."""
    torch.cuda.init()
    for (kind, G, K, N, T), cfg in items:
        Case(kind, G, K, N, T, 1, empty=True).ours(0, GemvConfig(**cfg))
    torch.cuda.synchronize()
    return len(items)


def precompile(quick, workers):
    import concurrent.futures as cf
    import multiprocessing as mp

    items = [(c, dict(vars(cfg))) for c in cases(quick) for _, cfg in sweep(c[4], c[1], c[3], c[2], quick)]
    chunks = [items[i::workers] for i in range(workers)]
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        return sum(pool.map(_compile_worker, chunks))


def run(args):
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    global SMS
    SMS = props.multi_processor_count
    l2 = getattr(props, "L2_cache_size", 50 << 20) or (50 << 20)
    n_compiled = precompile(args.quick, args.workers)
    t_compile = time.time() - t0
    copy = copy_bandwidth("cuda") / 1e9  # GB/s
    print(f"{props.name}: {SMS} SMs, L2 {l2 >> 20} MB, copy {copy:.0f} GB/s; {n_compiled} launches precompiled in "
          f"{t_compile:.1f} s", flush=True)
    rows = []
    header = (f"{'kind':6} {'G':>3} {'K':>6} {'N':>6} {'T':>2} | {'cuBLAS µs':>9} {'%':>4} | {'default µs':>10} "
              f"{'%':>4} | {'best µs':>8} {'%':>4} {'× cuBLAS':>8} | best config")
    print(header)
    for kind, G, K, N, T in cases(args.quick):
        wbytes = G * K * N * 2
        copies = max(2, min(256, math.ceil(3 * l2 / wbytes)))
        calls = max(20, copies)
        case = Case(kind, G, K, N, T, copies)
        ref = case.reference()
        pct = lambda us: 100.0 * wbytes / (us * 1e-6) / (copy * 1e9)  # noqa: E731
        row = dict(kind=kind, G=G, K=K, N=N, T=T, weight_bytes=wbytes, copies=copies, calls=calls)
        us = time_graph(lambda i: case.cublas(i % copies), calls)
        row["cublas"] = dict(us=us, pct=pct(us))
        results = []
        for label, cfg in sweep(T, G, N, K, args.quick):
            y = case.ours(0, cfg).float()
            err = ((y - ref).abs() / (ref.abs() + 1)).max().item()
            ok = bool(torch.isfinite(y).all()) and torch.allclose(y, ref, rtol=2e-2, atol=2e-2)
            us = time_graph(lambda i: case.ours(i % copies, cfg), calls) if ok else float("nan")
            results.append(dict(label=label, config=vars(cfg), ok=ok, err=err, us=us, pct=pct(us)))
        row["configs"] = results
        good = [r for r in results if r["ok"]]
        best = min(good, key=lambda r: r["us"]) if good else None
        row["best"], row["default"] = best, results[0]
        rows.append(row)
        bad = [r["label"] for r in results if not r["ok"]]
        c, dflt = row["cublas"], results[0]
        line = (f"{kind:6} {G:3} {K:6} {N:6} {T:2} | {c['us']:9.2f} {c['pct']:4.0f} | {dflt['us']:10.2f} "
                f"{dflt['pct']:4.0f} | ")
        if best:
            line += (f"{best['us']:8.2f} {best['pct']:4.0f} {c['us'] / best['us']:8.2f} | {best['label']} "
                     f"{_key(GemvConfig(**best['config']), K)}")
        print(line + (f"  WRONG: {bad}" if bad else ""), flush=True)
        case = ref = None  # free the weight copies before the next case
        torch.cuda.empty_cache()
    out = dict(device=props.name, sms=SMS, l2_bytes=l2, copy_GBps=copy, torch=torch.__version__,
               triton=__import__("triton").__version__, quick=args.quick, seconds=time.time() - t0, rows=rows)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_gemv.json"), "w") as f:
            json.dump(out, f, indent=1)
    print(f"{time.time() - t0:.1f} s")


def offline(args):
    """Compile every swept config at the real shapes for sm_90 (PDL on: `pdl_args` follows the sm_90 target) and
    report registers and spills."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    from offline_sm90 import offline_sm90, resource_usage

    report = []
    for kind, G, K, N, T in cases(args.quick):
        case = Case(kind, G, K, N, T, 1, device="cpu", empty=True)
        for label, cfg in sweep(T, G, N, K, args.quick):
            with offline_sm90() as ks:
                case.ours(0, cfg)
            u = resource_usage(ks[0])
            u = dict(kind=kind, G=G, K=K, N=N, T=T, label=label, key=_key(cfg, K), regs=u["regs"],
                     local=u["local"], stack=u["stack"], shared=u["shared"], warps=u["warps"])
            report.append(u)
    spills = [r for r in report if r["local"] or r["stack"]]
    for r in sorted({(r["key"], r["regs"], r["shared"], r["local"]) for r in report}):
        print(r)
    print(f"{len(report)} compiles, {len(spills)} spill: {spills}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gemv_offline.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--quick", action="store_true", help="T = 1, 8 and four configs per shape")
    p.add_argument("--offline", action="store_true", help="compile for sm_90 on CPU and report registers / spills")
    p.add_argument("--workers", type=int, default=12, help="processes compiling the kernels beforehand")
    a = p.parse_args()
    offline(a) if a.offline else run(a)
