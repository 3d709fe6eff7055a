"""FP8 block-scaled kernels against their bf16 counterparts on the same shapes, one section per op.

Section "linear": `specmla.ops.fp8_block_linear` (w8a8, e4m3 weights with 128 × 128 block scales) against bf16
`torch.matmul` (x @ Wᵀ with the dequantised weights in bf16), DeepSeek-V3's linear shapes N × K = 7168×18432,
18432×7168, 2112×7168, 24576×1536, 7168×2048 at M = 1, 16, 64, 128, 4096 tokens. Each candidate is captured as one
CUDA graph of ≥ 16 back-to-back calls over copies of its weights and inputs rotated past 4 × L2 (so that every call
streams its weights from HBM, as between the layers of a step), a replay timed with CUDA events and divided per
call, median over --reps replays. The fp8 figure is what "auto" runs (DeepGEMM where it is installed and
`deepgemm.preferred`, else the Triton kernels: the row's route); both implementations are timed besides where they
run. Reported: µs, TFLOP/s (2·M·N·K), weight GB/s (the weight bytes read per call:
N·K for fp8, 2·N·K for bf16) against the copy rate measured in the same run (limits.copy_bandwidth, read + write),
bf16 / fp8 time, and PASS / MISS against the targets: ≥ 1.6× at M ≤ 64, ≥ 1.3× at M ≥ 4096 (M = 128: no
target; --smoke: the numbers only).
Numbers: relative Frobenius error of fp8 against the w8a8 emulation (≤ 1e-2) and against the exact-activation
reference (≤ 3e-2) on up to 256 rows. --sweep also times tile / split variants and records the fastest.

Section "engine" (`--sections engine`): the engine's decode step on a V3-shaped model of a few layers, bf16 weights
and the same weights block-quantised in place (`bench_engine`). The fused MoE's comparison is bench_fp8_moe.py.
A section is a function (args, ctx) → {"rows": [...], "table": markdown}; SECTIONS maps its name to it.

    PYTHONPATH=. python3 benchmarks/bench_fp8.py --out DIR                   (section linear, about a minute)
    PYTHONPATH=. python3 benchmarks/bench_fp8.py --sections engine --out DIR
    PYTHONPATH=. python3 benchmarks/bench_fp8.py --tokens 1 64 --sweep --out DIR
    PYTHONPATH=. python3 benchmarks/bench_fp8.py --smoke --out DIR             (CPU, interpreter, tiny shapes)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():  # the smoke run: Triton's interpreter (set before triton.jit runs)
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from limits import copy_bandwidth, gemm_rate  # noqa: E402

from specmla.ops import fp8_block_linear  # noqa: E402
from specmla.ops.linear import deepgemm  # noqa: E402
from specmla.ops.linear import (fp8_block_linear_torch, fp8_block_linear_triton,  # noqa: E402
                                fp8_block_linear_w8a8_torch, weight_dequant, weight_quant)
from specmla.ops.linear.triton import DECODE_MAX_M, _num_sms, plan_split  # noqa: E402

LINEAR_SHAPES = [(7168, 18432), (18432, 7168), (2112, 7168), (24576, 1536), (7168, 2048)]
TOKENS = [1, 16, 64, 128, 4096]
SMOKE_SHAPES = [(200, 300), (136, 260)]
SMOKE_TOKENS = [1, 5, 70]
GRAPH_CALLS = 16


def target(M: int) -> float | None:
    """The bf16 / fp8 time ratio the linear must reach at M rows (None: no target)."""
    if M <= 64:
        return 1.6
    if M >= 4096:
        return 1.3
    return None


# ---- timing ---------------------------------------------------------------------------------------------------
def graph_time(fn, copies: int, reps: int, calls: int = GRAPH_CALLS, barrier=None) -> float:
    """Median seconds per fn(i) call: `calls` (≥ copies) calls cycling over the copies captured in one CUDA graph,
    after two eager rounds on a side stream (compiles, allocates the split-K counters). barrier: called before
    the capture and before every replay (ranks of a collective start each replay together)."""
    calls = max(calls, copies)
    barrier = barrier or (lambda: None)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(2 * copies):
            fn(i % copies)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    barrier()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        barrier()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / calls)
    del graph
    return statistics.median(times)


def cpu_time(fn, copies: int, reps: int) -> float:
    """The smoke run's stand-in: median wall seconds of fn(i) (interpreted kernels: no meaning as a speed)."""
    fn(0)
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i % copies)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def w8a8_emulation(x, weight, scale):
    """The kernels' w8a8 arithmetic in torch, fp32 out (`fp8_block_linear_w8a8_torch`)."""
    return fp8_block_linear_w8a8_torch(x, weight, scale, out_dtype=torch.float32)


def _f(v, fmt="{:.1f}", none="-") -> str:
    return none if v is None else fmt.format(v)


# ---- section "linear" -----------------------------------------------------------------------------------------
def linear_variants(M: int, N: int, K: int, dev) -> dict[str, dict]:
    """--sweep: keyword sets of fp8_block_linear_triton to time besides the default."""
    if M <= DECODE_MAX_M:
        out = {}
        for bn in (64, 128):
            base = plan_split(N, K, bn, _num_sms(dev))
            for sp in sorted({max(1, base // 2), base, base * 2}):
                out[f"bn{bn}_split{sp}"] = dict(config=dict(BLOCK_N=bn), split=sp)
        out["stages3"] = dict(config=dict(num_stages=3))
        out["stages6"] = dict(config=dict(num_stages=6))
        out["warps4" if M > 32 else "warps8"] = dict(config=dict(num_warps=4 if M > 32 else 8))
        out["no_prefetch"] = dict(config=dict(PREFETCH=0))
        return out
    return {"128x128_w8_s3": dict(config=dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3)),
            "128x128_w8_s4": dict(config=dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=4)),
            "64x128_w4_s4": dict(config=dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=16, num_warps=4, num_stages=4)),
            "128x256_w8_s3": dict(config=dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, num_warps=8, num_stages=3))}


def bench_linear(args, ctx) -> dict:
    smoke, dev = ctx["smoke"], ctx["device"]
    shapes = SMOKE_SHAPES if smoke else LINEAR_SHAPES
    tokens = SMOKE_TOKENS if smoke else sorted(set(args.tokens))
    timer = cpu_time if smoke else graph_time
    reps = 1 if smoke else args.reps
    rows = []
    for N, K in shapes:
        g = torch.Generator().manual_seed(N * 31 + K)
        w8, ws = weight_quant((torch.randn(N, K, generator=g) * 0.02).to(dev))
        wbf = weight_dequant(w8, ws).to(torch.bfloat16)
        for M in tokens:
            x_bytes = M * K * 2
            copies = 1 if smoke else max(1, -(-4 * ctx["l2"] // (N * K + x_bytes)))
            copies_bf = 1 if smoke else max(1, -(-4 * ctx["l2"] // (2 * N * K + x_bytes)))
            xs = [torch.randn(M, K, generator=g).to(torch.bfloat16 if not smoke else torch.float32).to(dev)
                  for _ in range(max(copies, copies_bf))]
            w8s = [w8] + [w8.clone() for _ in range(copies - 1)]
            wss = [ws] + [ws.clone() for _ in range(copies - 1)]
            wbfs = [wbf] + [wbf.clone() for _ in range(copies_bf - 1)]
            outs = [torch.empty(M, N, dtype=xs[0].dtype, device=dev) for _ in range(2)]
            kw = {} if not smoke else {"backend": "triton"}
            row = {"N": N, "K": K, "M": M, "copies_fp8": copies, "copies_bf16": copies_bf}
            # numbers on up to 256 rows
            r = slice(0, min(M, 256))
            y = fp8_block_linear(xs[0], w8, ws, **kw)
            row["rel_err_w8a8"] = rel_err(y[r], w8a8_emulation(xs[0][r], w8, ws))
            row["rel_err_ref"] = rel_err(y[r], fp8_block_linear_torch(xs[0][r], w8, ws, out_dtype=torch.float32))
            row["check"] = "ok" if row["rel_err_w8a8"] <= 1e-2 and row["rel_err_ref"] <= 3e-2 else "FAIL"
            row["fp8_s"] = timer(lambda i: fp8_block_linear(xs[i], w8s[i], wss[i], **kw), copies, reps)
            row["bf16_s"] = timer(lambda i: torch.matmul(xs[i], wbfs[i].T, out=outs[i % 2]) if not smoke
                                  else xs[i] @ wbfs[i].T.to(xs[i].dtype), copies_bf, reps)
            row["route"] = "deepgemm" if deepgemm.routes_to(xs[0], w8) else "triton"
            if not smoke:  # both implementations, whichever "auto" takes
                row["triton_s"] = timer(lambda i: fp8_block_linear_triton(xs[i], w8s[i], wss[i]), copies, reps)
                if deepgemm.available(dev) and deepgemm.supported(xs[0], w8):
                    row["deepgemm_rel_err_w8a8"] = rel_err(deepgemm.fp8_block_linear_deepgemm(xs[0], w8, ws)[r],
                                                           w8a8_emulation(xs[0][r], w8, ws))
                    row["deepgemm_s"] = timer(lambda i: deepgemm.fp8_block_linear_deepgemm(xs[i], w8s[i], wss[i]),
                                              copies, reps)
            if args.sweep and not smoke:
                sweep = {}
                for name, v in linear_variants(M, N, K, dev).items():
                    try:
                        sweep[name] = timer(lambda i, v=v: fp8_block_linear_triton(xs[i], w8s[i], wss[i], **v),
                                            copies, reps)
                    except Exception as e:  # a variant that does not compile or fit: reported, the rest timed
                        sweep[name] = f"{type(e).__name__}: {str(e)[:200]}"
                row["sweep_us"] = {k: (v * 1e6 if isinstance(v, float) else v) for k, v in sweep.items()}
                timed = {k: v for k, v in sweep.items() if isinstance(v, float)}
                if timed:
                    best = min(timed, key=timed.get)
                    row["sweep_best"], row["sweep_best_us"] = best, timed[best] * 1e6
            flops = 2.0 * M * N * K
            row["fp8_us"], row["bf16_us"] = row["fp8_s"] * 1e6, row["bf16_s"] * 1e6
            row["fp8_TFLOPs"], row["bf16_TFLOPs"] = flops / row["fp8_s"] / 1e12, flops / row["bf16_s"] / 1e12
            row["fp8_weight_GBps"] = N * K / row["fp8_s"] / 1e9
            row["bf16_weight_GBps"] = 2 * N * K / row["bf16_s"] / 1e9
            if ctx["copy_bw"] == ctx["copy_bw"]:  # not NaN
                row["fp8_pct_copy"] = 100 * N * K / row["fp8_s"] / ctx["copy_bw"]
                row["bf16_pct_copy"] = 100 * 2 * N * K / row["bf16_s"] / ctx["copy_bw"]
            row["speedup"] = row["bf16_s"] / row["fp8_s"]
            row["target"] = target(M)
            ok = row["check"] == "ok" and (smoke or row["target"] is None or row["speedup"] >= row["target"])
            row["result"] = "PASS" if ok else "MISS"
            rows.append(row)
            print(f"  N={N} K={K} M={M}: fp8 {row['fp8_us']:.1f} µs, bf16 {row['bf16_us']:.1f} µs, "
                  f"{row['speedup']:.2f}x, err {row['rel_err_w8a8']:.1e} / {row['rel_err_ref']:.1e} "
                  f"{row['result']}" + (f", sweep best {row['sweep_best']} {row['sweep_best_us']:.1f} µs"
                                        if "sweep_best" in row else ""), flush=True)
            del xs, w8s, wss, wbfs, outs
            if not smoke:
                torch.cuda.empty_cache()
    head = ("| N × K | M | fp8 µs (route) | Triton µs | DeepGEMM µs | bf16 µs | bf16/fp8 | target | fp8 TFLOP/s | "
            "bf16 TFLOP/s | fp8 weight GB/s (% copy) | bf16 weight GB/s (% copy) | err w8a8 / ref | result |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        us = {k: (r[f"{k}_s"] * 1e6 if f"{k}_s" in r else None) for k in ("triton", "deepgemm")}
        lines.append(f"| {r['N']}×{r['K']} | {r['M']} | {r['fp8_us']:.1f} ({r['route']}) | {_f(us['triton'])} | "
                     f"{_f(us['deepgemm'])} | {r['bf16_us']:.1f} | "
                     f"{r['speedup']:.2f}x | {_f(r['target'], '≥ {:.2f}x')} | {r['fp8_TFLOPs']:.1f} | "
                     f"{r['bf16_TFLOPs']:.1f} | {r['fp8_weight_GBps']:.0f} ({_f(r.get('fp8_pct_copy'), '{:.0f}%')}) | "
                     f"{r['bf16_weight_GBps']:.0f} ({_f(r.get('bf16_pct_copy'), '{:.0f}%')}) | "
                     f"{r['rel_err_w8a8']:.1e} / {r['rel_err_ref']:.1e} | {r['result']} |")
    return {"rows": rows, "table": "\n".join(lines)}


V3 = {  # DeepSeek-V3's config.json shapes; the engine section keeps as many layers as fit one H100 in bf16
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "num_nextn_predict_layers": 0, "bos_token_id": 0, "eos_token_id": 1,
}
ENGINE_LAYERS = 5  # 3 dense + 2 MoE layers: about 53 GB of bf16 weights
ENGINE_BATCHES = (1, 32)


def bench_engine(args, ctx) -> dict:
    """The engine's decode step on a V3-shaped random model of ENGINE_LAYERS layers: bf16 weights, then the same
    weights block-quantised in place (`quantize_fp8_`), each through `LLM(model)` with CUDA graphs; step per batch
    size by `bench_engine.decode_steps`; floor = the weight bytes the step reads in that storage + KV bytes, over
    the copy rate of the run."""
    from bench_engine import decode_steps, kv_read_bytes, random_model, step_read_bytes

    from specmla import LLM
    from specmla.model.fp8 import quantize_fp8_

    if ctx["smoke"]:
        return {"rows": [], "table": "(engine: GPU only)"}
    prompt, new = 512, 129
    batches = list(ENGINE_BATCHES)
    model = random_model(dict(V3, num_hidden_layers=ENGINE_LAYERS), ctx["device"], torch.bfloat16,
                         max_positions=prompt + new + 64)
    rows = []
    for kind in ("bf16", "fp8"):
        if kind == "fp8":
            quantize_fp8_(model)
            torch.cuda.empty_cache()
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        llm = LLM(model, max_num_seqs=max(batches), page_size=64,
                  num_pages=max(batches) * -(-(prompt + new) // 64) + 64)
        res = decode_steps(llm, batches, prompt, 3, ctx["copy_bw"], new_tokens=new)
        for r in res["rows"]:
            w, kv = step_read_bytes(model, r["batch"]), kv_read_bytes(model.config, r["batch"], prompt + new // 2)
            rows.append({"weights": kind, "batch": r["batch"], "step_s": r["step_s"], "samples_s": r["step_samples_s"],
                         "weight_bytes_on_gpu": weights, "read_bytes": w + kv,
                         "floor_s": (w + kv) / ctx["copy_bw"]})
            print(f"  {kind} B={r['batch']}: step {r['step_s'] * 1e3:.2f} ms, "
                  f"floor {rows[-1]['floor_s'] * 1e3:.2f} ms, weights on the GPU {weights / 1e9:.1f} GB", flush=True)
        del llm
        torch.cuda.empty_cache()
    by = {(r["weights"], r["batch"]): r for r in rows}
    lines = ["| B | bf16 step ms (floor) | fp8 step ms (floor) | bf16 / fp8 | weights on the GPU bf16 / fp8 GB |",
             "|---|---|---|---|---|"]
    for B in batches:
        a, b = by[("bf16", B)], by[("fp8", B)]
        lines.append(f"| {B} | {a['step_s'] * 1e3:.2f} ({a['floor_s'] * 1e3:.2f}) | {b['step_s'] * 1e3:.2f} "
                     f"({b['floor_s'] * 1e3:.2f}) | {a['step_s'] / b['step_s']:.2f}x | "
                     f"{a['weight_bytes_on_gpu'] / 1e9:.1f} / {b['weight_bytes_on_gpu'] / 1e9:.1f} |")
    return {"rows": rows, "table": "\n".join(lines)}


SECTIONS = {"linear": bench_linear, "engine": bench_engine}  # name → fn(args, ctx) → {"rows", "table"}; the fused
# MoE's fp8 comparison is benchmarks/bench_fp8_moe.py


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=["linear"],
                    help="linear (default); engine: the decode step of a V3-shaped model, bf16 against fp8 weights")
    ap.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    ap.add_argument("--reps", type=int, default=20, help="timed replays (median)")
    ap.add_argument("--sweep", action="store_true", help="also time tile / split variants of the fp8 kernels")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes through the interpreted kernels")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    smoke = args.smoke or not torch.cuda.is_available()
    dev = torch.device("cpu" if smoke else "cuda")
    import triton

    ctx = {"smoke": smoke, "device": dev, "copy_bw": float("nan"), "gemm": float("nan"), "l2": 50 << 20}
    result = {"device": "cpu (smoke)" if smoke else torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "triton": triton.__version__,
              "timing": "smoke: wall time of interpreted kernels (no meaning)" if smoke else
                        f"CUDA graph of ≥ {GRAPH_CALLS} calls over inputs rotated past 4 × L2, median of {args.reps} "
                        "replays, per call"}
    if not smoke:
        props = torch.cuda.get_device_properties(dev)
        ctx["l2"] = getattr(props, "L2_cache_size", 50 << 20)
        ctx["copy_bw"], ctx["gemm"] = copy_bandwidth(dev), gemm_rate(dev)
        result.update(copy_GBps=ctx["copy_bw"] / 1e9, gemm_TFLOPs=ctx["gemm"] / 1e12, sms=props.multi_processor_count,
                      l2_bytes=ctx["l2"])
        print(f"{result['device']}: copy {ctx['copy_bw'] / 1e9:.0f} GB/s (read + write), bf16 GEMM "
              f"{ctx['gemm'] / 1e12:.0f} TFLOP/s, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    tables = []
    for name in args.sections:
        print(f"\n## {name}", flush=True)
        res = SECTIONS[name](args, ctx)
        result[name] = res["rows"]
        tables.append(f"## {name}\n\n{res['table']}")
    print("\n" + "\n\n".join(tables))
    os.makedirs(args.out, exist_ok=True)
    for name in args.sections:
        with open(os.path.join(args.out, f"bench_fp8_{name}.json"), "w") as f:
            json.dump({k: v for k, v in result.items() if k not in SECTIONS or k == name}, f, indent=1, default=str)
    return result


if __name__ == "__main__":
    main()
