"""MLA decode benchmark (H100): `mla_decode` as the engine calls it, and the Triton kernel's tile variants, vs naive
torch and the copy-bandwidth roofline.

GB/s are counted as FlashMLA does: (Σ seq_len·576 + B·S·H·(576+512))·2 bytes / time, and compared
with the device-to-device copy bandwidth measured in the same run (bytes read + written). TFLOP/s =
2·S·Σ seq_len·H·(576+512) / time. Caches smaller than 4× L2 are rotated among copies so that the
timing reads HBM, not L2. Our kernel is timed inside a CUDA graph of ≥ 16 back-to-back calls (as
the engine's decode graph runs it), divided per call. Prints a table, writes JSON and a PNG plot.

--ragged draws each case's request lengths uniformly from S … T (a server's mixed batch; bytes and FLOPs count the
drawn lengths): the split rule plans for the longest request, so this shows what mixed lengths cost.

--kv bf16,fp8,tbq4 (repeatable or a comma list; default bf16) runs every case on each cache format:
fp8 / fp8_ds_mla / tbq4 caches are uint8 rows (608 / 656 / 400 bytes, ops.kv_cache) quantised from the same
random bf16 latents, and their bytes count the rows at their real size (Σ seq_len·row_bytes +
B·S·H·(576+512)·2). rel_err is against the torch reference on the dequantised cache; with bf16 in
the run, quantised rows get speedup_vs_bf16 (bf16 time / format time). The naive torch timing is
bf16 only. --cases HxBxTxS[,...] runs a subset of CASES; --variants N tries only the first N tile
variants (to fit limited device time). --routes also times every kernel that takes each call and writes the fastest
per case as a measured-routes table (OUT/decode_routes.json; `ops.decode.dispatch` reads such tables from
specmla/ops/decode/routes/<device>.json).

    PYTHONPATH=. python3 benchmarks/bench_mla_decode.py --out DIR [--quick] [--kv bf16,fp8,tbq4]
        [--cases 16x32x32768x1,16x4x81920x4] [--variants N]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from limits import copy_bandwidth, gemm_rate

from specmla.ops import mla_decode
from specmla.ops.decode import dispatch, kernel_module, mla_decode_torch, route
from specmla.ops.decode import triton as triton_kernel
from specmla.ops.decode.dispatch import decode_bytes, decode_flops
from specmla.ops.decode.tune import PAGE, ROUTE_CANDIDATES, SCALE, copies_for, make_problem, row_bytes, time_fn
from specmla.ops.kv_cache import QUANTIZED

CASES = [  # (H, B, T, S)
    (16, 128, 4096, 1), (16, 32, 32768, 1), (16, 1, 8192, 1), (16, 4, 81920, 1),
    (16, 64, 8192, 1), (16, 64, 8192, 2), (16, 64, 8192, 4),
    (128, 64, 8192, 1), (128, 64, 8192, 2), (64, 128, 4096, 1),
    (16, 4, 81920, 4), (16, 32, 32768, 4),
]
FORMATS = ("bf16",) + QUANTIZED
SMS = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132


def kv_decode_bytes(kv: str, seq_lens_sum: int, B: int, S: int, H: int) -> int:
    """decode_bytes with the cache counted at its real row size (equal to it for bf16)."""
    return seq_lens_sum * row_bytes(kv) + B * S * H * (576 + 512) * 2


def flashmla_time(qs, caches, table, seq, copies: int) -> float:
    """FlashMLA's dense decode (`flash_mla.flash_mla_with_kvcache`, bf16, causal) on the same problem, timed as ours
    (a graph of ≥ 16 calls); its scheduling metadata is made by the warm-up calls, outside the graph."""
    import flash_mla

    meta, _ = flash_mla.get_mla_metadata()
    paged = [c.view(c.shape[0], c.shape[1], 1, c.shape[2]) for c in caches]
    return time_fn(lambda i: flash_mla.flash_mla_with_kvcache(qs[i], paged[i], table, seq, 512, meta,
                                                              softmax_scale=SCALE, causal=True), copies, graph=True)


def ragged_lengths(B: int, T: int, S: int, seed: int = 0) -> list[int]:
    """B request lengths drawn uniformly from S … T (a batch of mixed contexts, as a server's decode step holds)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(S, T + 1, (B,), generator=g).tolist()


def run_case(H, B, T, S, copy_bw, l2_bytes, naive: bool, variants: list[dict], kv: str = "bf16",
             max_variants: int | None = None, routes: bool = False, flashmla: bool = False, ragged: bool = False):
    lens = ragged_lengths(B, T, S) if ragged else None
    total = sum(lens) if ragged else B * T
    copies = copies_for(kv, 1, total, l2_bytes)  # rotated past 4× L2 by the bytes the calls read
    caches, table, seq, qs = make_problem(H, B, T, S, copies, kv, lens=lens)
    nbytes, flops = kv_decode_bytes(kv, total, B, S, H), decode_flops(total, S, H)
    assert kv != "bf16" or nbytes == decode_bytes(total, B, S, H)
    # correctness on this very problem (a slice of the batch against the fp32 reference on the
    # same, dequantised, cache)
    ref = mla_decode_torch(qs[0][:2].float(), caches[0], table[:2], seq[:2], SCALE, head_dim_v=512, kv_format=kv)
    got = mla_decode(qs[0][:2], caches[0], table[:2], seq[:2], SCALE, head_dim_v=512, kv_format=kv)
    err = ((got.float() - ref).norm() / ref.norm()).item()
    del ref, got
    row = {"H": H, "B": B, "T": T, "S": S, "kv": kv, "ragged": ragged, "seq_lens_sum": total, "bytes": nbytes,
           "flops": flops, "rel_err": err,
           "plan": dispatch.plan(B, S, H, T, SMS)}
    chosen = route(qs[0], caches[0], table, kv_format=kv, head_dim_v=512)
    row["kernel"], row["route_plan"] = chosen.kernel, chosen.plan

    def timed(v):
        """The Triton kernel with tiles v (Options fields) and optionally num_splits."""
        v = dict(v)
        ns = v.pop("num_splits", None) or dispatch.plan(B, S, H, T, SMS, v["block_n"],
                                                        v.get("max_rows", 64))["num_splits"]
        out = torch.empty(B, S, H, 512, dtype=torch.bfloat16, device="cuda")
        ws = (torch.empty(B, S, H, ns, 512, device="cuda"), torch.empty(B, S, H, ns, device="cuda"))
        opts = triton_kernel.Options(**v)
        try:
            t = time_fn(lambda i: mla_decode(qs[i], caches[i], table, seq, SCALE, out=out, workspace=ws,
                                             head_dim_v=512, kv_format=kv, opts=opts), copies, graph=True)
        except Exception as e:  # a variant that does not compile (e.g. out of shared memory)
            row[f"ours{v}"] = str(e)[:200]
            return None
        row[f"ours{v}"] = t
        return t

    # the default call, as the engine makes it: no tile, split or workspace arguments
    out_default = torch.empty(B, S, H, 512, dtype=torch.bfloat16, device="cuda")
    row["default_s"] = time_fn(lambda i: mla_decode(qs[i], caches[i], table, seq, SCALE, out=out_default,
                                                    head_dim_v=512, kv_format=kv), copies, graph=True)
    best = None
    if S > 1:  # also try folding fewer tokens per pass (more passes, each lighter on the tensor cores)
        variants = variants + [dict(num_warps=4, num_stages=5, block_n=32, max_rows=32),
                               dict(num_warps=4, num_stages=3, block_n=32, max_rows=32),
                               dict(num_warps=4, num_stages=5, block_n=32, max_rows=16)]
    for v in variants[:max_variants]:  # tile/pipeline variants with the planned split count
        t = timed(v)
        if t is not None and (best is None or t < best[0]):
            best = (t, v)
    if best is None:  # every listed variant failed (e.g. out of shared memory): smaller key blocks
        fallback = dict(num_warps=8, num_stages=2, block_n=32)
        t = timed(fallback)
        if t is None:
            raise RuntimeError(f"no variant ran for {row['kv']} H={H} B={B} T={T} S={S}: {row}")
        best = (t, fallback)
    row["planned_s"] = best[0]
    ns = dispatch.plan(B, S, H, T, SMS, best[1]["block_n"], best[1].get("max_rows", 64))["num_splits"]
    for f in (0.25, 0.5, 2, 4):  # then the split count around the plan, best tiles
        n = max(1, min(256, int(ns * f)))
        if n == ns:
            continue
        v = dict(best[1], num_splits=n)
        t = timed(v)
        if t is not None and t < best[0]:
            best = (t, v)
    row["ours_s"], row["ours_variant"] = best
    if routes:  # every kernel that takes the call, with its own defaults: the measured-routes table's evidence
        row["kernels_s"] = {}
        for name in ROUTE_CANDIDATES[kv]:
            opts = kernel_module(name).Options()
            try:
                chosen_plan = route(qs[0], caches[0], table, kv_format=kv, head_dim_v=512, opts=opts).plan
            except ValueError:  # this kernel does not take the call
                continue
            row["kernels_s"][name] = time_fn(lambda i: mla_decode(qs[i], caches[i], table, seq, SCALE, out=out_default,
                                                                  head_dim_v=512, kv_format=kv, opts=opts),
                                             copies, graph=True)
            splits = chosen_plan["num_splits"]
            if name != "triton" and kv != "bf16" and chosen_plan["keys_per_split"] < dispatch.MIN_HOPPER_KEYS:
                # short splits: the same kernel on half as many, longer ones
                half = max(1, splits // 2)
                row["kernels_s"][f"{name}@{half}"] = time_fn(
                    lambda i: mla_decode(qs[i], caches[i], table, seq, SCALE, out=out_default, head_dim_v=512,
                                         kv_format=kv, opts=opts, num_splits=half), copies, graph=True)
    if row["kernel"] != "triton":  # a Hopper kernel runs the call: time the Triton kernel's default tiles too
        row["triton_only_s"] = time_fn(lambda i: mla_decode(qs[i], caches[i], table, seq, SCALE, out=out_default,
                                                            head_dim_v=512, kv_format=kv, backend="triton"),
                                       copies, graph=True)
    if flashmla and kv == "bf16":  # the peer, same caches, queries and graph timing
        row["flashmla_s"] = flashmla_time(qs, caches, table, seq, copies)
    # the headline is the default call (the engine's route); ours_s is the Triton kernel's best tiles and splits
    row["ours_GBps"] = nbytes / row["default_s"] / 1e9
    row["ours_pct_copy"] = 100 * nbytes / row["default_s"] / copy_bw
    row["ours_TFLOPs"] = flops / row["default_s"] / 1e12
    row["naive_s"] = None
    if naive and kv == "bf16":  # quantised: dequantise-then-torch would time the dequantisation, skipped
        try:
            t = time_fn(lambda i: mla_decode_torch(qs[i], caches[i], table, seq, SCALE, head_dim_v=512), copies,
                        iters=5, warmup=1)
            row["naive_s"] = t
            row["naive_pct_copy"] = 100 * nbytes / t / copy_bw
        except torch.OutOfMemoryError:
            pass
    return row


def routes_table(rows: list[dict], device: str) -> dict:
    """The measured routes of `rows` (run with routes): per (format, S, H), [B, T, fastest kernel at its planned
    splits] of each case, with the evidence (every kernel's µs, "name@n" at n splits) beside it."""
    import datetime
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    table, evidence = {}, {}
    for r in rows:
        if not r.get("kernels_s"):
            continue
        key = dispatch.route_key(r["kv"], r["S"], r["H"])
        plain = {k: t for k, t in r["kernels_s"].items() if "@" not in k}  # the table names kernels at their plan
        best = min(plain, key=plain.get)
        table.setdefault(key, []).append([r["B"], r["T"], best])
        evidence.setdefault(key, []).append([r["B"], r["T"], {k: round(t * 1e6, 1) for k, t in r["kernels_s"].items()}])
    return {"device": device, "date": datetime.date.today().isoformat(), "commit": commit,
            "command": "benchmarks/bench_mla_decode.py --routes", "routes": table, "us": evidence}


def parse_case(text: str) -> tuple[int, int, int, int]:
    H, B, T, S = (int(x) for x in text.lower().split("x"))
    if T % PAGE:
        raise argparse.ArgumentTypeError(f"T={T} must be a multiple of the page size {PAGE}")
    return H, B, T, S


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="MLA decode: µs per call, GB/s against the copy rate, per cache format "
                                             "(docs/benchmarks.md, MLA decode sections)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="first variant only, no naive torch")
    ap.add_argument("--kv", action="append", default=None,
                    help="cache format(s): bf16, fp8, fp8_ds_mla, tbq4; repeatable or comma-separated (default bf16)")
    ap.add_argument("--cases", action="append", default=None,
                    help="HxBxTxS[,HxBxTxS...] to run instead of the default CASES (repeatable)")
    ap.add_argument("--routes", action="store_true",
                    help="also time every kernel that takes each call and write the fastest per (format, S, H, B, T) "
                         "to OUT/decode_routes.json, the format of specmla/ops/decode/routes/<device>.json")
    ap.add_argument("--flashmla", action="store_true",
                    help="also time FlashMLA's dense decode on the bf16 cases (needs the flash_mla package)")
    ap.add_argument("--ragged", action="store_true",
                    help="request lengths drawn uniformly from S … T per case (fixed seed) instead of all T; bytes "
                         "and FLOPs count the lengths drawn")
    ap.add_argument("--variants", type=int, default=None,
                    help="try only the first N tile variants (default all; for S > 1 the fold variants come last)")
    args = ap.parse_args(argv)
    kvs = [k for a in args.kv or ["bf16"] for k in a.split(",") if k]
    bad = [k for k in kvs if k not in FORMATS]
    if bad:
        ap.error(f"unknown --kv {bad}; choose from {FORMATS}")
    args.kv = sorted(dict.fromkeys(kvs), key=FORMATS.index)  # bf16 first: the speedup baseline
    try:
        args.cases = [parse_case(c) for a in args.cases for c in a.split(",") if c] if args.cases else list(CASES)
    except (ValueError, argparse.ArgumentTypeError) as e:
        ap.error(f"--cases: {e} (want HxBxTxS, e.g. 16x32x32768x1)")
    if args.ragged and args.routes:
        ap.error("--ragged with --routes: the routes table is keyed by (B, T) of uniform batches")
    if args.flashmla:
        try:
            import flash_mla  # noqa: F401
        except ImportError:
            ap.error("--flashmla: the flash_mla package is not importable (build FlashMLA and put it on PYTHONPATH)")
    if args.quick:
        args.variants = 1
    if args.variants is not None and args.variants < 1:
        ap.error("--variants must be ≥ 1")
    return args


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    copy_bw, gemm = copy_bandwidth(), gemm_rate()
    print(f"device {props.name}, {props.multi_processor_count} SMs, copy bandwidth {copy_bw / 1e9:.0f} GB/s, "
          f"bf16 GEMM {gemm / 1e12:.0f} TFLOP/s")
    variants = [dict(num_warps=8, num_stages=2, block_n=64), dict(num_warps=4, num_stages=2, block_n=32),
                dict(num_warps=4, num_stages=3, block_n=32), dict(num_warps=4, num_stages=4, block_n=32),
                dict(num_warps=8, num_stages=3, block_n=32), dict(num_warps=4, num_stages=2, block_n=64),
                dict(num_warps=4, num_stages=5, block_n=32), dict(num_warps=4, num_stages=6, block_n=16)]
    rows = []
    for H, B, T, S in args.cases:
        base = None
        for kv in args.kv:
            row = run_case(H, B, T, S, copy_bw, l2, naive=not args.quick, variants=variants, kv=kv,
                           max_variants=args.variants, routes=args.routes, flashmla=args.flashmla,
                           ragged=args.ragged)
            if kv == "bf16":
                base = row["default_s"]
            elif base is not None:
                row["speedup_vs_bf16"] = base / row["default_s"]
            rows.append(row)
            torch.cuda.empty_cache()  # run_case's caches are gone now
            naive = f"{row['naive_pct_copy']:.1f}%" if row.get("naive_s") else "-"
            speedup = f"{row['speedup_vs_bf16']:5.2f}x bf16  " if "speedup_vs_bf16" in row else ""
            print(f"H={H:3d} B={B:3d} T={'≤' if args.ragged else ''}{T:6d} S={S} {kv:>4}  "
                  f"{row['default_s'] * 1e3:8.4f} ms  {speedup}"
                  f"{row['ours_GBps']:7.0f} GB/s {row['ours_pct_copy']:5.1f}% copy  {row['ours_TFLOPs']:6.1f} TFLOP/s "
                  f"({100 * row['ours_TFLOPs'] * 1e12 / gemm:.0f}% GEMM)  "
                  f"naive {naive}  err {row['rel_err']:.1e}  triton tiles: planned {row['planned_s'] * 1e3:.4f} ms  "
                  f"best {row['ours_s'] * 1e3:.4f} ms at {row['ours_variant']}  plan splits {row['plan']['num_splits']}  kernel {row['kernel']}"
                  + (f"  triton-only {row['triton_only_s'] * 1e3:.4f} ms" if row.get("triton_only_s") else "")
                  + "".join(f"  {k} {t * 1e6:.1f} us" for k, t in row.get("kernels_s", {}).items())
                  + (f"  FlashMLA {row['flashmla_s'] * 1e6:.1f} us" if row.get("flashmla_s") else ""),
                  flush=True)
    result = {"device": props.name, "copy_GBps": copy_bw / 1e9, "gemm_TFLOPs": gemm / 1e12, "torch": torch.__version__,
              "rows": rows}
    with open(os.path.join(args.out, "bench_mla_decode.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    if args.routes:
        with open(os.path.join(args.out, "decode_routes.json"), "w") as f:
            json.dump(routes_table(rows, props.name), f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = [f"H{r['H']} B{r['B']}\nT{r['T'] // 1024}k S{r['S']}\n{r['kv']}" for r in rows]
        x = range(len(rows))
        fig, ax = plt.subplots(figsize=(max(12, 0.6 * len(rows)), 4.5))
        ax.bar([i - 0.2 for i in x], [r["ours_GBps"] for r in rows], width=0.4, label="specmla (Triton / Gluon)")
        ax.bar([i + 0.2 for i in x], [r["naive_pct_copy"] * copy_bw / 1e11 if r.get("naive_s") else 0 for r in rows],
               width=0.4, label="naive torch")
        ax.axhline(copy_bw / 1e9, color="k", linestyle="--", label="copy bandwidth")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_ylabel("GB/s (FlashMLA count, cache at its row size)")
        ax.set_title(f"MLA decode, {'/'.join(args.kv)} latent cache, page {PAGE} — {props.name}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "bench_mla_decode.png"), dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
