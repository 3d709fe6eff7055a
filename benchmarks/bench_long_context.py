"""One request over a long context with MTP drafts and a quantised KV cache read inside attention (seed 004's
setting): decode tokens/s, draft acceptance, TTFT and the cache's bytes per KV format, in one run.

The embedded model (4 layers + its MTP layer, trained at 4096 positions) is stretched to the context by YaRN, as
DeepSeek-V2/V3 stretch 4k positions to 128k/160k: a copy of its directory whose config sets
rope_scaling = yarn with factor context / 4096 (the weights are linked, not copied). The prompt is Python source
from the standard library, tokenised and cut to the context. Past the trained length the model's text is no
longer good, so acceptance is what it is for every format alike; the comparison is between cache formats in the
same run. Decode tokens/s = (generated tokens - 1) / (finish - first token), i.e. after the prefill.

    PYTHONPATH=. python3 benchmarks/bench_long_context.py --context 131072 --out DIR     (one H100)
    PYTHONPATH=. python3 benchmarks/bench_long_context.py --tiny                          (CPU check of the script)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from specmla import LLM, SamplingParams
from specmla.model.default import default_model_path

TRAINED_POSITIONS = 4096


def stretched_model(src: Path, dst: Path, context: int) -> Path:
    """A copy of the model directory `src` in `dst` whose config reaches `context` positions by YaRN (factor
    context / trained positions, at least 1); every other file is a link to src's."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    trained = cfg.get("max_position_embeddings", TRAINED_POSITIONS)
    factor = max(1.0, context / trained)
    cfg["rope_scaling"] = {"type": "yarn", "factor": factor, "original_max_position_embeddings": trained,
                           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    cfg["max_position_embeddings"] = max(trained, context)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in src.iterdir():
        if f.name != "config.json" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    return dst


def source_prompt(tokenizer, n: int) -> list[int]:
    """n tokens of Python standard-library source (files in name order)."""
    ids: list[int] = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        ids += tokenizer.encode(f.read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= n:
            return ids[:n]
    raise RuntimeError(f"the standard library holds fewer than {n} tokens")


def run(path: Path, kv: str, spec: str | None, k: int, context: int, new_tokens: int, device: str,
        dtype: str, repeats: int = 1) -> dict:
    """One request of `context` prompt tokens and `new_tokens` greedy tokens on a fresh engine, `repeats` times
    (decode tok/s: the median; TTFT: the first, later ones reuse the cached prefix)."""
    llm = LLM(str(path), device=device, dtype=dtype, kv_cache_dtype=kv, speculative=spec, num_speculative_tokens=k,
              max_num_seqs=1, max_model_len=context + new_tokens + 16)
    prompt = source_prompt(llm.tokenizer, context)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompt[:256]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    rates, first = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        (out,) = llm.generate([prompt], params)
        wall = time.perf_counter() - t0
        m = out.metrics
        rates.append((len(out.token_ids) - 1) / (m["e2e_s"] - m["ttft_s"]))
        first = first or (out, m, wall)
    out, m, wall = first
    rate = statistics.median(rates)
    decode_s = (len(out.token_ids) - 1) / rate  # the median run's
    per_token = llm.kv_pool.bytes_per_page() // llm.kv_pool.page_size  # every layer's row of one token
    row = dict(kv=kv, spec=spec or "none", k=k if spec else 0, context=context, new_tokens=len(out.token_ids),
               wall_s=wall, ttft_s=m["ttft_s"], decode_s=decode_s, decode_tok_s=rate,
               decode_tok_s_runs=rates,
               kv_bytes_per_token=per_token, kv_bytes=per_token * (context + new_tokens),
               acceptance_length=m["spec"]["mean_acceptance_length"] if spec else None, tokens=out.token_ids[:16])
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--kv", nargs="+", default=["bf16", "tbq4", "fp8"])
    ap.add_argument("--spec", nargs="+", default=["mtp", "none"], help="mtp and/or none")
    ap.add_argument("--k", type=int, default=3, help="MTP drafts per step")
    ap.add_argument("--repeats", type=int, default=3, help="generations per engine; decode tok/s is their median")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true", help="CPU, fp32, a 2k context: a check of the script")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    device, dtype = ("cpu", "float32") if args.tiny else ("cuda", "bfloat16")
    context, new = (2048, 16) if args.tiny else (args.context, args.new_tokens)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = stretched_model(Path(default_model_path()), Path(tmp) / "model", context)
        for spec in args.spec:
            for kv in args.kv:
                row = run(path, kv, None if spec == "none" else spec, args.k, context, new, device, dtype,
                          args.repeats)
                rows.append(row)
                print(f"{row['spec']:>4} k={row['k']} {kv:>10}: decode {row['decode_tok_s']:8.1f} tok/s  TTFT "
                      f"{row['ttft_s'] * 1e3:8.1f} ms  acceptance length {row['acceptance_length']}  KV "
                      f"{row['kv_bytes'] / 2**20:8.1f} MiB ({row['kv_bytes_per_token']} B/token)", flush=True)
    base = {r["spec"]: r["decode_tok_s"] for r in rows if r["kv"] == "bf16"}
    for r in rows:
        if r["spec"] in base:
            r["vs_bf16"] = r["decode_tok_s"] / base[r["spec"]]
    result = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", context=context, rows=rows)
    with open(os.path.join(args.out, "bench_long_context.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
