"""Prefill benchmarks, all against peers measured in the same run:

1. causal prefill, one 8k sequence, H ∈ {128, 16}, d_qk 192 / d_v 128: `mla_prefill` (Triton) vs
   torch `scaled_dot_product_attention` (TFLOP/s = H·S²·(192+128) / time, causal half counted as
   the anchors do);
2. a ragged batch (16 requests, 128 … 8192 tokens): ours on the packed batch vs SDPA on the padded
   batch (with its mask);
3. ragged batch vs a per-request SDPA loop (H ∈ {128, 16}): 16 requests of U(128, 4096) tokens, odd mixes with
   length-1 requests, and one dense 8192 sequence: ours on the packed [ΣL, H, D] batch vs a Python loop calling
   torch SDPA once per request on [1, H, L_i, D] views of the packed rows; acceptance ratio (loop / ours) ≥ 1.0
   on the ragged cases, ≥ 1.05 on the dense one;
4. the ShallowMLA-style module benchmark: the MLA attention module forward (B ∈ {4, 8},
   L ∈ {512 … 4096}, d=2048, 16 heads, Dc=512, Dr=64) — specmla's module vs a plain PyTorch module of
   the DeepSeek-V3 reference style (absorbed einsums, explicit masked softmax), tokens/s, plus an
   ablation with each fused kernel (norm, rope, prefill attention) switched back to torch.

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_prefill.py --out DIR
    PYTHONPATH=.:benchmarks python3 benchmarks/bench_prefill.py --only ragged_loop --out DIR   (section 3 alone)
    TRITON_INTERPRET=1 PYTHONPATH=.:benchmarks python3 benchmarks/bench_prefill.py --smoke     (CPU code-path check)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from typing import NamedTuple

import torch
import torch.nn.functional as F

import specmla.model.deepseek as ds
from specmla.config import ModelConfig
from specmla.model.metadata import AttentionMetadata
from specmla.ops import prefill as prefill_ops
from specmla.ops.prefill import hopper
from specmla.ops import norm as norm_ops
from specmla.ops import rope as rope_ops


def timeit(fn, reps=10, warmup=3):
    for _ in range(warmup):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        else:
            import time

            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


ROUNDS = 5


def interleaved(fns, rounds=ROUNDS):
    """Median time of each fn over `rounds` rounds that take turns, so that a GPU clock drift (H100 runs
    from about 1.5 to 1.98 GHz under this load) reaches every fn alike. Each round starts one fn later
    (round r: fns r, r+1, …): in a fixed order the first fn always ran right after the last one of the
    previous round, and one configuration timed twice in a run measured 502 first and 535 sixth (H=128,
    4k), 300 and 359 (H=16, 4k)."""
    times = [[] for _ in fns]
    for r in range(rounds):
        for i in range(len(fns)):
            i = (i + r) % len(fns)
            times[i].append(timeit(fns[i], reps=5, warmup=1))
    return [statistics.median(t) for t in times]


class CausalProblem(NamedTuple):
    """One causal request of S tokens in the MHA form (d_qk 192, d_v 128), as the prefill benchmarks build it."""
    q: torch.Tensor  # [S, H, 192]
    k: torch.Tensor  # [S, H, 192]
    v: torch.Tensor  # [S, H, 128]
    cu: torch.Tensor  # [0, S], int32: the cu_seqlens of one request
    flops: int  # H·S²·(192 + 128): half of 2·S²·H·(d_qk + d_v), as the benchmarks count causal attention
    sdpa_qkv: tuple  # q, k, v viewed [1, H, S, d], as torch SDPA takes them


def causal_problem(H: int, S: int, dev="cuda", dtype=torch.bfloat16) -> CausalProblem:
    q = torch.randn(S, H, 192, device=dev, dtype=dtype)
    k = torch.randn(S, H, 192, device=dev, dtype=dtype)
    v = torch.randn(S, H, 128, device=dev, dtype=dtype)
    cu = torch.tensor([0, S], dtype=torch.int32, device=dev)
    return CausalProblem(q, k, v, cu, H * S * S * (192 + 128), tuple(t.transpose(0, 1)[None] for t in (q, k, v)))


def single_sequence(H, S, dev, dtype):
    q, k, v, cu, flops, (qs, ks, vs) = causal_problem(H, S, dev, dtype)
    ours, triton_only, sdpa = interleaved([
        lambda: prefill_ops.mla_prefill(q, k, v, cu, cu, S, S, 0.072),
        lambda: prefill_ops.mla_prefill_triton(q, k, v, cu, cu, S, S, 0.072),
        lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.072)])
    row = {"H": H, "S": S, "ours_TFLOPs": flops / ours / 1e12, "sdpa_TFLOPs": flops / sdpa / 1e12,
           "ratio": sdpa / ours, "triton_TFLOPs": flops / triton_only / 1e12}
    if dev == "cuda":  # tile variants around the default (the default is the first)
        for bm, bn, w, st, *ws in VARIANTS:
            name = f"variant_{bm}_{bn}_{w}_{st}{'_ws' if ws else ''}_TFLOPs"
            try:
                t = timeit(lambda: prefill_ops.mla_prefill_triton(q, k, v, cu, cu, S, S, 0.072, block_m=bm,
                                                                  block_n=bn, num_warps=w, num_stages=st,
                                                                  warp_specialize=bool(ws)))
                row[name] = flops / t / 1e12
            except Exception as e:  # out of shared memory / registers, or no warp specialisation here
                row[name] = str(e)[:80]
    return row


VARIANTS = [(128, 128, 8, 2), (128, 64, 8, 3, "ws")]  # Triton kernel tiles (block_m, block_n, warps, stages[,
# warp-specialised]) beside its default; docs/benchmarks.md has the sweep


def ragged_batch(H, lens, dev, dtype):
    T, L = sum(lens), max(lens)
    q = torch.randn(T, H, 192, device=dev, dtype=dtype)
    k = torch.randn(T, H, 192, device=dev, dtype=dtype)
    v = torch.randn(T, H, 128, device=dev, dtype=dtype)
    cu = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
    B = len(lens)
    qp = torch.zeros(B, H, L, 192, device=dev, dtype=dtype)
    kp, vp = torch.zeros_like(qp), torch.zeros(B, H, L, 128, device=dev, dtype=dtype)
    for i, n in enumerate(lens):
        s = int(cu[i])
        qp[i, :, :n], kp[i, :, :n], vp[i, :, :n] = (t[s : s + n].transpose(0, 1) for t in (q, k, v))
    causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    valid = torch.arange(L, device=dev)[None, :] < torch.tensor(lens, device=dev)[:, None]
    mask = causal[None, None] & valid[:, None, None, :]
    ours, triton_only, sdpa = interleaved([
        lambda: prefill_ops.mla_prefill(q, k, v, cu, cu, L, L, 0.072),
        lambda: prefill_ops.mla_prefill_triton(q, k, v, cu, cu, L, L, 0.072),
        lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=0.072)], rounds=3)
    return {"H": H, "lens": lens, "ours_s": ours, "triton_s": triton_only, "sdpa_padded_s": sdpa, "ratio": sdpa / ours}


def ragged_loop_cases(smoke: bool) -> list[tuple[str, list[int], float]]:
    """(name, request lengths, acceptance ratio) of the ragged-vs-SDPA-loop section; the 16 lengths of the
    first case come from random.Random(0)."""
    rng = random.Random(0)
    if smoke:
        return [("4 × U(8, 64)", [rng.randint(8, 64) for _ in range(4)], 1.0), ("odd [37, 1, 20]", [37, 1, 20], 1.0),
                ("odd [1, 1, 64]", [1, 1, 64], 1.0), ("dense 128", [128], 1.05)]
    return [("16 × U(128, 4096)", [rng.randint(128, 4096) for _ in range(16)], 1.0),
            ("odd [1000, 37, 3000, 1]", [1000, 37, 3000, 1], 1.0),
            ("odd [1, 1, 8192]", [1, 1, 8192], 1.0),
            ("odd [4096, 4096, 1 × 8]", [4096, 4096] + [1] * 8, 1.0),
            ("odd [129, 255, 513, 1025, 2047]", [129, 255, 513, 1025, 2047], 1.0),
            ("dense 8192", [8192], 1.05)]


LOOP_ROUNDS = 10


def ragged_vs_loop(name: str, H: int, lens: list[int], accept: float, dev, dtype, rounds: int = LOOP_ROUNDS) -> dict:
    """Ours (`mla_prefill` on the packed batch, max_seqlen = the longest request) against a Python loop of torch
    SDPA calls, one per request, on [1, H, L_i, D] views of the packed rows (the views are taken inside the loop;
    nothing else is allocated per call). Interleaved rounds, median; TFLOP/s = Σ H·L_i²·(192+128) / time."""
    T, L = sum(lens), max(lens)
    if len(lens) == 1:  # the single-sequence case's problem
        q, k, v, cu, _, _ = causal_problem(H, T, dev, dtype)
    else:
        q = torch.randn(T, H, 192, device=dev, dtype=dtype)
        k = torch.randn(T, H, 192, device=dev, dtype=dtype)
        v = torch.randn(T, H, 128, device=dev, dtype=dtype)
        cu = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
    bounds = [(int(a), int(b)) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]  # host ints, taken once
    flops = sum(H * n * n * (192 + 128) for n in lens)

    schedule = prefill_ops.prefill_schedule(cu, cu, T) if len(lens) > 1 else None

    def ours():  # as the model calls it: the step's schedule built once (AttentionMetadata), shared by the layers
        return prefill_ops.mla_prefill(q, k, v, cu, cu, L, L, 0.072, schedule=schedule)

    def ours_scheduling():  # the schedule built inside the call (~25 small launches)
        return prefill_ops.mla_prefill(q, k, v, cu, cu, L, L, 0.072)

    def per_tile():  # the Hopper kernel with one program per tile (no persistent grid, no schedule)
        return hopper.mla_prefill_hopper(q, k, v, cu, cu, L, L, 0.072, opts=hopper.Options(persistent=False))

    def loop():
        return [F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
                                               v[a:b].transpose(0, 1)[None], is_causal=True, scale=0.072)
                for a, b in bounds]

    # the two agree (bf16 rounding): a timing of a wrong result would mean nothing
    got, want = ours(), torch.cat([o[0].transpose(0, 1) for o in loop()])
    err = (got.float() - want.float()).abs().max().item()
    del got, want
    fns = [ours, loop] + ([ours_scheduling, per_tile] if len(lens) > 1 and hopper.supported(q, k, v, 0.072) else [])
    t_ours, t_loop, *extra = interleaved(fns, rounds=rounds)
    ratio = t_loop / t_ours
    more = {"ours_scheduling_ms": extra[0] * 1e3, "per_tile_ms": extra[1] * 1e3} if extra else {}
    return {"case": name, "H": H, "lens": lens, "tokens": T, "flops": flops, "ours_ms": t_ours * 1e3, **more,
            "loop_ms": t_loop * 1e3, "ours_TFLOPs": flops / t_ours / 1e12, "loop_TFLOPs": flops / t_loop / 1e12,
            "ratio": ratio, "target_ratio": accept, "pass": ratio >= accept, "max_abs_diff": err,
            "rounds": rounds}


def format_loop_table(rows: list[dict]) -> str:
    lines = ["ragged batch vs a per-request SDPA loop (d_qk 192, d_v 128, causal, scale 0.072; "
             "ratio = loop time / ours; median of interleaved rounds)",
             "| case | H | tokens | ours ms | ours, schedule built in the call ms | per-tile grid ms | loop ms "
             "| ours TFLOP/s | loop TFLOP/s | ratio | target | result | max abs diff |", "|---" * 13 + "|"]
    for r in rows:
        extra = " | ".join(f"{r[k]:.3f}" if k in r else "—" for k in ("ours_scheduling_ms", "per_tile_ms"))
        lines.append(f"| {r['case']} | {r['H']} | {r['tokens']} | {r['ours_ms']:.3f} | {extra} | {r['loop_ms']:.3f} "
                     f"| {r['ours_TFLOPs']:.1f} | {r['loop_TFLOPs']:.1f} | {r['ratio']:.3f} "
                     f"| ≥ {r['target_ratio']:g} | {'PASS' if r['pass'] else 'MISS'} | {r['max_abs_diff']:.2g} |")
    lines.append("every case at its target: " + ("PASS" if all(r["pass"] for r in rows) else "MISS"))
    cases = dict.fromkeys((r["case"], tuple(r["lens"])) for r in rows)  # each case once, in table order
    lines.append("lengths: " + "; ".join(f"{name}: {list(lens)}" for name, lens in cases))
    return "\n".join(lines)


class ReferenceMLA(torch.nn.Module):
    """DeepSeek-V3 reference-style MLA forward (absorbed, plain torch einsums and masked softmax)
    sharing the weights of a specmla MLAttention."""

    def __init__(self, attn: ds.MLAttention):
        super().__init__()
        self.a = attn

    def forward(self, x, positions):
        a, cfg = self.a, self.a.cfg
        B, L, _ = x.shape
        q = a.q_proj(x).view(B, L, a.num_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], -1)
        kv = a.kv_a_proj_with_mqa(x)
        c, k_pe = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], -1)
        xf = c.float()
        c = (a.kv_a_layernorm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(c.dtype))
        cs = ds_cos_sin(cfg, L, x.device)
        q_pe = rope_ops.apply_rope(q_pe.reshape(B * L, a.num_heads, -1), positions, cs).view_as(q_pe)
        k_pe = rope_ops.apply_rope(k_pe.reshape(B * L, -1), positions, cs).view_as(k_pe)
        w_uk, w_uv = a.absorbed_weights()
        q_nope = torch.einsum("bshd,hdc->bshc", q_nope, w_uk)
        scores = (torch.einsum("bshc,btc->bsht", q_nope, c) + torch.einsum("bshr,btr->bsht", q_pe, k_pe))
        scores = scores * cfg.softmax_scale
        mask = torch.full((L, L), float("-inf"), device=x.device).triu_(1)
        scores = (scores + mask[None, :, None, :]).softmax(dim=-1, dtype=torch.float32).type_as(x)
        o = torch.einsum("bsht,btc->bshc", scores, c)
        o = torch.einsum("bshc,hdc->bshd", o, w_uv)
        return a.o_proj(o.flatten(2))


def ds_cos_sin(cfg, L, dev):
    from specmla.model.rope import rope_cos_sin_cache

    return rope_cos_sin_cache(cfg.rope, cfg.qk_rope_head_dim, L, device=dev)


def module_bench(B, L, dev, dtype, ablate: str | None = None):
    cfg = ModelConfig.from_dict({
        "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 100, "hidden_size": 2048, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": L,
    })
    attn = ds.MLAttention(cfg).to(dev, dtype)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.02)
    norm = ds.RMSNorm(2048).to(dev, dtype)
    x = torch.randn(B, L, 2048, device=dev, dtype=dtype)
    positions = torch.arange(L, device=dev).repeat(B)
    meta = AttentionMetadata.for_contiguous([L] * B, device=dev)
    cs = ds_cos_sin(cfg, L, dev)
    ref = ReferenceMLA(attn)
    saved = (ds.rms_norm, ds.apply_rope_qk_, ds.mla_prefill)
    if ablate == "norm":
        ds.rms_norm = lambda *a, **k: norm_ops.rms_norm(*a, **k, backend="torch")
    if ablate == "rope":
        ds.apply_rope_qk_ = lambda *a, **k: rope_ops.apply_rope_qk_(*a, **k, backend="torch")
    if ablate == "attention":
        ds.mla_prefill = lambda *a, **k: prefill_ops.mla_prefill(*a, **k, backend="torch")
    try:
        with torch.inference_mode():
            ours = timeit(lambda: attn(norm(x).view(B * L, -1), meta, cs, None))
            base = timeit(lambda: ref(norm(x), positions))
    finally:
        ds.rms_norm, ds.apply_rope_qk_, ds.mla_prefill = saved
    return {"B": B, "L": L, "ablate": ablate, "ours_tok_s": B * L / ours, "reference_tok_s": B * L / base,
            "gain": base / ours - 1}


SECTIONS = ("single", "ragged", "ragged_loop", "module", "ablation")


def main():
    ap = argparse.ArgumentParser(description="Prefill attention against torch SDPA (single sequence, ragged batch "
                                             "padded and as a per-request loop) and the MLA module against a plain "
                                             "PyTorch one (docs/benchmarks.md)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes (CPU check of the code paths; on CPU under TRITON_INTERPRET=1)")
    ap.add_argument("--single-only", action="store_true", help="only the single-sequence cases (prints, no JSON)")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=None, metavar="SECTION",
                    help=f"run only these sections ({', '.join(SECTIONS)}); the JSON goes to "
                         "bench_prefill_only_<sections>.json instead of bench_prefill.json")
    ap.add_argument("--loop-rounds", type=int, default=LOOP_ROUNDS,
                    help="interleaved rounds of the ragged_loop section (median)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not args.smoke:
        raise SystemExit("bench_prefill.py times CUDA kernels and needs a GPU; on CPU only --smoke (tiny sizes, "
                         "a check of the code paths, under TRITON_INTERPRET=1) runs")
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    sections = ["single"] if args.single_only else (args.only or list(SECTIONS))
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}
    S = 256 if args.smoke else 8192
    if dev == "cuda":  # the limit the TFLOP/s figures are read against, measured in the same run
        import limits

        res["gemm_TFLOPs"] = limits.gemm_rate() / 1e12
    if "single" in sections:
        res["single"] = [single_sequence(H, S, dev, dtype) for H in ((2,) if args.smoke else (128, 16))]
        for row in res["single"]:
            if "gemm_TFLOPs" in res:
                row["ours_of_gemm"] = row["ours_TFLOPs"] / res["gemm_TFLOPs"]
                row["sdpa_of_gemm"] = row["sdpa_TFLOPs"] / res["gemm_TFLOPs"]
    if args.single_only:
        print("gemm_TFLOPs", res.get("gemm_TFLOPs"))
        print("single", json.dumps(res["single"]))
        return
    if "ragged" in sections:
        lens = [64, 17, 128] if args.smoke else [128 * 2 ** (i % 7) for i in range(16)]
        res["ragged"] = [ragged_batch(2 if args.smoke else 16, lens, dev, dtype)]
    if "ragged_loop" in sections:
        res["ragged_loop"] = []
        for H in ((2,) if args.smoke else (128, 16)):
            for name, lens, accept in ragged_loop_cases(args.smoke):
                row = ragged_vs_loop(name, H, lens, accept, dev, dtype, rounds=args.loop_rounds)
                res["ragged_loop"].append(row)
                print(f"  ragged_loop {name} H={H}: ours {row['ours_ms']:.3f} ms, loop {row['loop_ms']:.3f} ms, "
                      f"ratio {row['ratio']:.3f}", flush=True)
                if dev == "cuda":
                    torch.cuda.empty_cache()
    shapes = [(2, 64)] if args.smoke else [(b, l) for b in (4, 8) for l in (512, 1024, 2048, 4096)]
    if "module" in sections:
        res["module"] = [module_bench(b, l, dev, dtype) for b, l in shapes]
    if "ablation" in sections:
        b, l = shapes[0] if args.smoke else (4, 4096)
        res["ablation"] = [module_bench(b, l, dev, dtype, ablate=a) for a in ("norm", "rope", "attention")]
    print("gemm_TFLOPs", res.get("gemm_TFLOPs"))
    for key in SECTIONS:
        for row in res.get(key, []):
            print(key, json.dumps(row))
    if "ragged_loop" in res:
        print("\n" + format_loop_table(res["ragged_loop"]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    name = "bench_prefill.json" if args.only is None else f"bench_prefill_only_{'_'.join(sections)}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
