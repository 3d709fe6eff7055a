"""Engine end to end: decode step (CUDA graphs vs eager vs its weight-reading floor) and tok/s vs transformers.

Runs a DeepSeek-V2-Lite-shaped random model (bf16) against transformers' `generate` on the same weights, and the
embedded default model.

- decode step = median TPOT of a batch generating together (engine-level: scheduling, metadata,
  forward, sampling), graphs vs eager on the same LLM object;
- floor = weight bytes a decode step must read (attention + dense + shared experts + the routed
  experts a batch of B touches on average) / device copy bandwidth measured in the same run;
- throughput = output tok/s for B prompts × 256 new tokens (greedy, EOS ignored), specmla vs
  transformers generate on the same weights, same prompts.

    PYTHONPATH=. python3 benchmarks/bench_engine.py --layers 27 --out DIR      (H100)
    PYTHONPATH=. python3 benchmarks/bench_engine.py --tiny --device cpu        (a CPU smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch
from limits import copy_bandwidth

from specmla import LLM, SamplingParams
from specmla.bench import run_throughput
from specmla.config import ModelConfig
from specmla.model.deepseek import DeepseekForCausalLM, MoE
from specmla.model.rope import rope_cos_sin_cache

V2_LITE = {  # DeepSeek-V2-Lite's config.json (27 layers, 64 routed experts top-6, 2 shared, no q_lora)
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
    "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "topk_method": "greedy",
    "norm_topk_prob": False, "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
    "rope_theta": 10000.0, "bos_token_id": 100000, "eos_token_id": 100001,
}
TINY = dict(V2_LITE, vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16,
            v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2)


def random_model(cfg_dict: dict, device, dtype, max_positions: int = 2048, seed: int = 0) -> DeepseekForCausalLM:
    cfg = ModelConfig.from_dict(cfg_dict)
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg, max_positions=max_positions).to(dtype)
    model = model.to_empty(device=device)
    model.cos_sin = rope_cos_sin_cache(cfg.rope, cfg.qk_rope_head_dim, max_positions, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model.eval()


def transformers_twin(model: DeepseekForCausalLM, cfg_dict: dict, device, dtype):
    """The same weights in transformers' DeepseekV2/V3ForCausalLM (fused expert tensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(cfg_dict["model_type"], **{k: v for k, v in cfg_dict.items() if k != "model_type"})
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    sd = {k: v for k, v in model.checkpoint_tensors().items() if ".mlp.experts." not in k}
    for name, module in model.named_modules():
        if isinstance(module, MoE) and name.startswith("model."):
            sd[f"{name}.experts.gate_up_proj"] = module.w_gate_up  # the same fused layout
            sd[f"{name}.experts.down_proj"] = module.w_down
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise RuntimeError(f"transformers twin: missing {missing[:5]}, unexpected {unexpected[:5]}")
    hf.eval()
    ids = torch.randint(3, cfg_dict["vocab_size"], (1, 12), device=device)
    with torch.no_grad():  # same weights → same logits (bf16 tolerance)
        want = hf(ids).logits[0].float()
        from specmla.model.metadata import AttentionMetadata

        got = model.compute_logits(model(ids[0], AttentionMetadata.for_contiguous([12], device=device)))
    rel = ((got - want).norm() / want.norm()).item()
    print(f"transformers twin logits rel err vs specmla: {rel:.2e}", flush=True)
    if rel > 5e-2:
        raise RuntimeError(f"transformers twin disagrees with specmla (rel {rel:.2e})")
    return hf


def hf_throughput(hf, prompts: list[list[int]], new_tokens: int) -> dict:
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    dev = next(hf.parameters()).device
    with torch.no_grad():
        ids = torch.tensor(prompts[:1], device=dev)
        hf.generate(ids, attention_mask=torch.ones_like(ids), **dict(gen, max_new_tokens=2, min_new_tokens=2))
        ids = torch.tensor(prompts, device=dev)
        _sync(dev)
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), **gen)
        _sync(dev)
        wall = time.perf_counter() - t0
    n = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"output_tokens": n, "duration_s": wall, "output_tok_per_s": n / wall}


def _sync(dev):
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def decode_step_s(llm: LLM, prompts, tokens: int = 48) -> float:
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return statistics.median(o.metrics["tpot_s"] for o in outs)


def step_floor_bytes(cfg: ModelConfig, batch: int, elem: int = 2) -> float:
    """Weight bytes one decode step must read: everything but the routed experts, plus the routed
    experts a batch of `batch` tokens touches on average (E·(1 − (1 − k/E)^batch) per MoE layer)."""
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    with torch.device("meta"):
        m = DeepseekForCausalLM(cfg, max_positions=16)
    total = sum(p.numel() for n, p in m.named_parameters() if not n.startswith("mtp."))
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    E, k = cfg.n_routed_experts or 0, cfg.num_experts_per_tok or 0
    expert = 3 * H * I
    touched = E * (1 - (1 - k / E) ** batch) if E else 0
    dense = total - moe_layers * E * expert - cfg.vocab_size * H  # the embedding is gathered, not read whole
    return (dense + moe_layers * touched * expert) * elem


def bench_model(label, llm: LLM, hf, batches, prompt_len, new_tokens, copy_bw, seed=0) -> dict:
    cfg = llm.model.config
    rng = random.Random(seed)
    res = {"model": label, "layers": cfg.num_hidden_layers, "rows": []}
    graphed = llm.engine.runner.graphed
    for B in batches:
        prompts = [[rng.randrange(3, cfg.vocab_size) for _ in range(prompt_len)] for _ in range(B)]
        row = {"batch": B}
        llm.engine.runner.graphed = None
        row["eager_step_s"] = decode_step_s(llm, prompts)
        if graphed is not None:
            llm.engine.runner.graphed = graphed
            try:
                decode_step_s(llm, prompts, tokens=4)  # capture this size
                row["graph_step_s"] = decode_step_s(llm, prompts)
                row["graph_speedup"] = row["eager_step_s"] / row["graph_step_s"]
            except Exception as e:  # report and go on with eager numbers
                row["graph_error"] = repr(e)[:300]
                llm.engine.runner.graphed = graphed = None
                while llm.engine.has_unfinished():
                    llm.engine.abort(llm.engine.running[0] if llm.engine.running else llm.engine.waiting[0])
        row["floor_step_s"] = step_floor_bytes(cfg, B) / copy_bw
        best = row.get("graph_step_s", row["eager_step_s"])
        row["step_vs_floor"] = row["floor_step_s"] / best
        row["specmla"] = run_throughput(llm, prompts, new_tokens)
        if hf is not None:
            row["transformers"] = hf_throughput(hf, prompts, new_tokens)
            row["speedup_vs_transformers"] = (row["specmla"]["output_tok_per_s"]
                                              / row["transformers"]["output_tok_per_s"])
        res["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("specmla", "transformers")}), flush=True)
        print(f"  {label} B={B}: specmla {row['specmla']['output_tok_per_s']:.1f} tok/s"
              + (f", transformers {row['transformers']['output_tok_per_s']:.1f} tok/s "
                 f"({row['speedup_vs_transformers']:.2f}x)" if hf is not None else ""), flush=True)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--tiny", action="store_true", help="tiny dims (CPU smoke run)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--skip-embedded", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    copy_bw = copy_bandwidth(dev)
    results = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "copy_GBps": copy_bw / 1e9,
               "torch": torch.__version__, "models": []}
    cfg_dict = dict(TINY if args.tiny else V2_LITE, num_hidden_layers=args.layers)
    model = random_model(cfg_dict, dev, dtype)
    hf = None if args.no_transformers else transformers_twin(model, cfg_dict, dev, dtype)
    llm = LLM(model, max_num_seqs=max(args.batches), page_size=64, num_pages=2048 if dev.type == "cuda" else 256,
              max_num_batched_tokens=4096)
    label = f"V2-Lite-shaped ({args.layers} layers, random, {str(dtype).split('.')[-1]})"
    results["models"].append(bench_model(label, llm, hf, args.batches, args.prompt_len, args.new_tokens, copy_bw))
    del llm, model, hf
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_embedded:
        emb = LLM(None, device=str(dev), max_num_seqs=max(args.batches), num_pages=512)
        results["models"].append(bench_model("embedded default model", emb, None, args.batches, args.prompt_len,
                                             args.new_tokens, copy_bw))
    with open(os.path.join(args.out, "bench_engine.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
