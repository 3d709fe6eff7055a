"""DeepSeek-V3 at full shape under tensor + expert parallelism: the decode step of a V3-shaped model (hidden 7168,
MLA with 128 heads, 256 routed experts top-8 + 1 shared, one MTP layer), FP8 block-scaled weights built on every rank
from random bf16 (`LLM(dir, load_format="dummy")`: a config.json, no weights on disk), TP = EP = --tp, CUDA graphs on
every rank.

- memory plan (no GPU needed): each rank's weight bytes at TP = 1, 4, 8 for the full 61 layers + MTP, exact (the
  model built on the meta device, sharded and quantised there), against the GPUs' memory, and the weight bytes a
  decode step reads on a rank per batch size (the floor's numerator);
- step per batch size: `bench_engine.decode_steps` ((t(1 + n) − t(1)) / n on fresh random prompts, median of
  --rounds rounds) per KV format (--kv) and speculative setting (--spec: none, mtp1, mtp2, mtp3). With MTP the
  random model's drafts are rarely accepted, so the time per emitted token is × the run's acceptance length = the
  time of one verify + draft step (the acceptance pooled over the configuration's batch sizes); tokens/s is then
  projected for an acceptance of p per draft position, each position independent (1 + p + … + p^k tokens a step;
  DeepSeek reports 85–90 % for the second token only, so k > 1 projections are upper estimates);
- floor per step: rank 0's weight bytes read by the step (`bench_engine.step_read_bytes`: the routed experts the
  batch touches; with MTP the verify pass's B·(1 + k) tokens, plus k drafts through the MTP layer and the head) +
  the latent-cache bytes its heads read, over the copy rate measured in the same run;
- all-reduce per step on rank 0 (torch.profiler, `bench_tp.profile_steps`) at B = 1 and 32.

    PYTHONPATH=. python3 benchmarks/bench_v3.py --tp 4 --layers 16 --out DIR           (4 GPUs: a 16-layer subset)
    PYTHONPATH=. python3 benchmarks/bench_v3.py --plan-only                              (the memory plan, CPU)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import ROUTED, decode_steps, routed_read_bytes, step_read_bytes  # noqa: E402
from bench_fp8 import V3  # noqa: E402
from limits import copy_bandwidth  # noqa: E402

from specmla import LLM  # noqa: E402
from specmla.config import FP8_QUANTIZATION, ModelConfig  # noqa: E402
from specmla.model.default import write_byte_tokenizer  # noqa: E402
from specmla.model.deepseek import DeepseekForCausalLM, MoE  # noqa: E402
from specmla.model.fp8 import quantize_fp8_  # noqa: E402
from specmla.model.sharding import shard_model_  # noqa: E402

V3_FP8 = dict(V3, num_nextn_predict_layers=1, quantization_config=FP8_QUANTIZATION, torch_dtype="bfloat16")
ACCEPTANCE = (0.85, 0.90)  # DeepSeek-V3's reported second-token acceptance (the projection's p)
SPECS = {"none": (None, 0), "mtp1": ("mtp", 1), "mtp2": ("mtp", 2), "mtp3": ("mtp", 3)}


def memory_plan(cfg_dict: dict, worlds=(1, 4, 8), batches=(1, 8, 32, 128)) -> list[dict]:
    """Rank 0's weight bytes per TP size (FP8 as DeepSeek ships it), built on the meta device, and the weight bytes
    one decode step of each batch size reads there (`step_read_bytes`)."""
    cfg = ModelConfig.from_dict(cfg_dict)
    rows = []
    for world in worlds:
        with torch.device("meta"):
            model = DeepseekForCausalLM(cfg, max_positions=4096).to(torch.bfloat16)
        if world > 1:
            shard_model_(model, 0, world)
        quantize_fp8_(model)
        by = {}
        for name, p in model.named_parameters():
            part = ("MTP layer" if name.startswith("mtp.")
                    else "routed experts" if name.rsplit(".", 1)[-1] in ROUTED
                    else "embedding + head" if name.startswith(("model.embed_tokens", "lm_head"))
                    else "attention, dense and shared")
            by[part] = by.get(part, 0) + p.numel() * p.element_size()
        rows.append({"tp": world, "rank_bytes": sum(by.values()), "parts": by,
                     "step_weight_bytes": {B: step_read_bytes(model, B) for B in batches}})
    return rows


def draft_read_bytes(model: DeepseekForCausalLM, batch: int) -> float:
    """Weight bytes one MTP draft of `batch` tokens reads on this rank: the MTP layer (its routed experts as
    `step_read_bytes` counts them) and the head it shares with the trunk."""
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    total = nbytes(model.lm_head.weight) + sum(nbytes(p) for n, p in model.named_parameters()
                                               if n.startswith("mtp.0.") and n.rsplit(".", 1)[-1] not in ROUTED)
    moe = model.mtp[0].mlp
    if isinstance(moe, MoE):
        total += routed_read_bytes(moe, model.config, batch)
    return total


def kv_bytes_per_token(llm: LLM) -> int:
    """Every trunk and MTP layer's cache row of one token, in the pool's format."""
    return llm.kv_pool.bytes_per_page() // llm.kv_pool.page_size


def run_config(path: Path, tp: int, kv: str, spec: str, batches, prompt_len: int, new_tokens: int, rounds: int,
               copy_bw: float, profile: bool) -> dict:
    method, k = SPECS[spec]
    max_len = prompt_len + new_tokens + 16
    llm = LLM(str(path), load_format="dummy", tensor_parallel_size=tp, kv_cache_dtype=kv, speculative=method,
              num_speculative_tokens=max(k, 1), max_num_seqs=max(batches), max_model_len=max_len,
              num_pages=max(batches) * -(-max_len // 64) + 64)
    try:
        stats = llm.engine.spec_stats if method else None
        drafts0 = (stats.num_drafts, stats.num_accepted_tokens) if stats else None
        res = decode_steps(llm, batches, prompt_len, rounds, copy_bw, new_tokens=new_tokens + 1)
        accept = 1.0
        if stats is not None and stats.num_drafts > drafts0[0]:
            accept = 1 + (stats.num_accepted_tokens - drafts0[1]) / (stats.num_drafts - drafts0[0])
        per_token_kv = kv_bytes_per_token(llm)
        rows = []
        for r in res["rows"]:
            step = r["step_s"] * accept  # one verify + draft step (spec), or one decode step
            B = r["batch"]
            kv_read = B * (prompt_len + new_tokens // 2) * per_token_kv * cfg_trunk_share(llm)
            weights = r["weight_bytes"] if not method else (step_read_bytes(llm.model, B * (1 + k))
                                                            + k * draft_read_bytes(llm.model, B))
            row = {"batch": B, "per_token_s": r["step_s"], "samples_s": r["step_samples_s"],
                   "acceptance_length": accept, "step_s": step, "weight_bytes": weights,
                   "kv_bytes": kv_read, "floor_s": (weights + kv_read) / copy_bw}
            row["floor_frac"] = row["floor_s"] / step
            row["tok_s_per_request"] = 1 / r["step_s"]
            if method:
                row["projected_tok_s"] = {str(p): sum(p ** i for i in range(k + 1)) / step for p in ACCEPTANCE}
            rows.append(row)
        out = {"tp": tp, "kv": kv, "spec": spec, "k": k, "kv_bytes_per_token": per_token_kv, "rows": rows}
        if profile and not method:
            from bench_tp import profile_steps

            out["profile"] = [profile_steps(llm, B, prompt_len) for B in (1, 32) if B in batches]
        return out
    finally:
        llm.shutdown()


def cfg_trunk_share(llm: LLM) -> float:
    """The share of a token's cache row that a trunk decode step reads (the MTP layers' rows are read by drafts)."""
    cfg = llm.model.config
    return cfg.num_hidden_layers / (cfg.num_hidden_layers + cfg.num_nextn_predict_layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=None, help="ranks (default: every GPU)")
    ap.add_argument("--layers", type=int, default=61, help="decoder layers (V3: 61; fewer where the GPUs are short)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--kv", nargs="+", default=["fp8", "auto"], help="KV formats (auto: bf16)")
    ap.add_argument("--spec", nargs="+", default=["none", "mtp1", "mtp3"], choices=list(SPECS))
    ap.add_argument("--spec-batches", type=int, nargs="+", default=None,
                    help="batch sizes of the MTP configurations (default: --batches)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--plan-only", action="store_true", help="the memory plan only (no GPU)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    report = {"config": dict(V3_FP8, num_hidden_layers=args.layers), "memory_plan": memory_plan(V3_FP8)}
    gib = 1 << 30
    for r in report["memory_plan"]:
        print(f"memory plan, 61 layers + MTP, FP8: TP={r['tp']}: {r['rank_bytes'] / 1e9:.1f} GB a rank ("
              + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in r["parts"].items()) + "); a step reads "
              + ", ".join(f"B={B} {v / 1e9:.2f}" for B, v in r["step_weight_bytes"].items()) + " GB", flush=True)
    if not args.plan_only:
        tp = args.tp or torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        copy_bw = copy_bandwidth("cuda")
        report.update(device=props.name, gpus=torch.cuda.device_count(), gpu_memory_bytes=props.total_memory,
                      tp=tp, copy_GBps=copy_bw / 1e9, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                      runs=[])
        print(f"{props.name} × {tp} ({props.total_memory / gib:.0f} GiB each), copy {copy_bw / 1e9:.0f} GB/s, "
              f"{args.layers} layers", flush=True)
        with tempfile.TemporaryDirectory() as d:
            path = Path(d)
            (path / "config.json").write_text(json.dumps(report["config"]))
            write_byte_tokenizer(path)
            for kv in args.kv:
                for spec in args.spec:
                    batches = args.batches if spec == "none" else (args.spec_batches or args.batches)
                    gc.collect()
                    torch.cuda.empty_cache()
                    run = run_config(path, tp, kv, spec, batches, args.prompt_len, args.new_tokens, args.rounds,
                                     copy_bw, not args.no_profile)
                    report["runs"].append(run)
                    for r in run["rows"]:
                        proj = "".join(f", {float(p):.0%} → {t:.0f} tok/s" for p, t in r.get("projected_tok_s",
                                                                                            {}).items())
                        print(f"kv={kv} {spec} B={r['batch']}: step {r['step_s'] * 1e3:.2f} ms (floor "
                              f"{r['floor_s'] * 1e3:.2f}, {r['floor_frac']:.0%}), acceptance "
                              f"{r['acceptance_length']:.2f}, {r['tok_s_per_request']:.1f} tok/s a request{proj}",
                              flush=True)
                    with open(os.path.join(args.out, "bench_v3.json"), "w") as f:  # each run as it ends
                        json.dump(report, f, indent=1)
                    for p in run.get("profile", []):
                        print(f"kv={kv} {spec} B={p['batch']} rank 0: kernels {p['kernel_per_step_s'] * 1e3:.2f} "
                              f"ms/step, all-reduce {p['allreduce_per_step_s'] * 1e3:.3f} ms "
                              f"({p['allreduce_calls_per_step']:.0f} calls)", flush=True)
    with open(os.path.join(args.out, "bench_v3.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
