"""Engine end to end: decode step (CUDA graphs vs eager vs its weight-reading floor) and tok/s vs transformers.

Runs a DeepSeek-V2-Lite-shaped random model (bf16) against transformers' `generate` on the same weights, and the
embedded default model.

- decode step = median TPOT of a batch generating together (engine-level: scheduling, metadata,
  forward, sampling), graphs vs eager on the same LLM object;
- floor = weight bytes a decode step must read (attention + dense + shared experts + the routed
  experts a batch of B touches on average) / device copy bandwidth measured in the same run;
- throughput = output tok/s for B prompts × 256 new tokens (greedy, EOS ignored), specmla vs
  transformers generate on the same weights, same prompts.

With --checkpoint-dir DIR the model is used as a new user would: the random V2-Lite-shaped model is written
once as an HF checkpoint directory (config.json, ~4 GB safetensors shards with the hub's per-expert
names, model.safetensors.index.json; no tokenizer: prompts are token ids), reused when DIR already
holds it, and loaded with `LLM(DIR)` (CUDA graphs, the engine's default). Then, for B fresh random
prompts of --prompt-len tokens (512 by default here), greedy, EOS ignored:
- decode step = (time to generate 129 tokens − time to generate 1 token) / 128, B = 1, 8, 32, 64, 128,
  median over --rounds rounds, each round going through every B (after one untimed warm-up per B);
- floor = (step_read_bytes + the KV cache the batch reads at its mid-generation length) / the copy
  bandwidth of the same run; PASS/MISS against B=1 ≤ 3.5 ms, B=8 ≤ 9, B=32 ≤ 14, B=128 ≤ 20 and "no
  batch slower than a larger one";
- an MTP-shaped verify step at B=1: the model's decode forward + logits with S = 1 + 3 query tokens
  against S = 1, replayed from the engine's static-buffer CUDA graph (GraphedDecoder, as speculative
  decoding runs it) over a --prompt-len-token context (the speculative engine itself would mix in
  draft acceptance; this is the step's cost alone).
With --mixed, a long prompt arriving while requests decode (32 decoding requests of 512-token prompts, one
8192-token prompt; 4, 32 and 256 with --tiny): the decode-only step, every step's time and prefill chunk while the
long prompt prefills (chunked beside the decodes under max_num_batched_tokens), the decodes' TPOT during it, the
long prompt's TTFT, and each chunk's compute time alone (a step prefilling that chunk at its offset and nothing
else), checked as "no step exceeds 2 × the decode-only step + its chunk's compute time".
With --chunk-sweep N ..., prompt tok/s of 1 × 512, 1 × 8192 and 64 × 512 with LLM(DIR) built at each
max_num_batched_tokens N (the knee of tok/s against the chunk size).
The DeepSeek-V2-Lite-shaped checkpoint takes 31 GB of disk.

    PYTHONPATH=. python3 benchmarks/bench_engine.py --layers 27 --out DIR      (H100)
    PYTHONPATH=. python3 benchmarks/bench_engine.py --checkpoint-dir /tmp/v2lite --out DIR      (H100, ~6 min)
    PYTHONPATH=. python3 benchmarks/bench_engine.py --tiny --device cpu        (a CPU smoke run)
    PYTHONPATH=. python3 benchmarks/bench_engine.py --checkpoint-dir /tmp/v2lite --no-decode --mixed --out DIR
    PYTHONPATH=. python3 benchmarks/bench_engine.py --checkpoint-dir /tmp/v2lite --no-decode --chunk-sweep 1024 4096
    PYTHONPATH=. python3 benchmarks/bench_engine.py --tiny --device cpu --checkpoint-dir /tmp/tiny --out /tmp
    PYTHONPATH=. python3 benchmarks/bench_engine.py --tiny --device cpu --checkpoint-dir /tmp/tiny --no-decode --mixed
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import time
from pathlib import Path

import torch
from limits import copy_bandwidth, gemm_rate

from specmla import LLM, SamplingParams
from specmla.bench import run_throughput
from specmla.config import ModelConfig
from specmla.engine.cuda_graphs import GraphedDecoder
from specmla.model.deepseek import DeepseekForCausalLM, MoE
from specmla.model.default import init_random_
from specmla.model.loader import empty_model, save_checkpoint
from specmla.ops.timing import synchronize

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
    g = torch.Generator(device=device).manual_seed(seed)
    model = empty_model(ModelConfig.from_dict(cfg_dict), device, dtype, max_positions)
    return init_random_(model, std=0.02, generator=g).eval()


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
        synchronize(dev)
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), **gen)
        synchronize(dev)
        wall = time.perf_counter() - t0
    n = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"output_tokens": n, "duration_s": wall, "output_tok_per_s": n / wall}


def decode_step_s(llm: LLM, prompts, tokens: int = 48) -> float:
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return statistics.median(o.metrics["tpot_s"] for o in outs)


ROUTED = {"w_gate_up", "w_down", "w_gate_up_scale", "w_down_scale"}  # an MoE's routed-expert stacks and scales


def routed_read_bytes(moe: MoE, cfg: ModelConfig, batch: int) -> float:
    """Bytes of `moe`'s routed experts that `batch` tokens touch on average: this rank's experts (all of them
    without expert parallelism), each picked with probability k / E by each token."""
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    per_expert = sum(nbytes(t[0]) for t in (moe.w_gate_up, moe.w_down, moe.w_gate_up_scale, moe.w_down_scale)
                     if t is not None)
    k, E = cfg.num_experts_per_tok, cfg.n_routed_experts
    return moe.w_down.shape[0] * (1 - (1 - k / E) ** batch) * per_expert


def step_read_bytes(model: DeepseekForCausalLM, batch: int) -> float:
    """Weight bytes a decode step of `batch` tokens reads, in the model's own storage (bf16, or e4m3 + scales): every
    parameter but the embedding (gathered) and the routed experts, plus the routed experts the batch touches on
    average (E_here·(1 − (1 − k/E)^batch) per MoE layer, E_here the experts this rank holds); the MTP layers are not
    part of the step. Under tensor parallelism: rank 0's shard."""
    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if not n.startswith(("mtp.", "model.embed_tokens")) and n.rsplit(".", 1)[-1] not in ROUTED)
    for name, m in model.named_modules():
        if isinstance(m, MoE) and not name.startswith("mtp."):
            total += routed_read_bytes(m, model.config, batch)
    return total


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
        row["floor_step_s"] = step_read_bytes(llm.model, B) / copy_bw
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


# ---- checkpoint directory mode: decode step at B = 1 .. 128, MTP-shaped verify step ----------------------
STEP_TARGETS_MS = {1: 3.5, 8: 9.0, 32: 14.0, 128: 20.0}


def write_checkpoint(model: DeepseekForCausalLM, cfg_dict: dict, path: Path, shard_bytes: int = 4 << 30) -> None:
    """The model as an HF checkpoint directory: shards model-0000i-of-0000n.safetensors of about shard_bytes with
    the hub's tensor names, model.safetensors.index.json, and config.json last (its presence marks the directory
    complete). One shard at a time goes through host memory."""
    path.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, path, max_shard_bytes=shard_bytes)
    (path / "config.json").write_text(json.dumps(cfg_dict, indent=1))


def same_config(path: Path, cfg_dict: dict) -> bool:
    """Whether `path` holds cfg_dict's config.json (False: none there); a directory holding another config is
    refused rather than overwritten."""
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        return False
    if json.loads(cfg_file.read_text()) != json.loads(json.dumps(cfg_dict)):
        raise SystemExit(f"{path} holds another checkpoint (its config.json differs from this run's); "
                         "give an empty or new --checkpoint-dir")
    return True


def ensure_checkpoint(path: Path, cfg_dict: dict, device, dtype, shard_bytes: int = 4 << 30) -> float:
    """Write the random model of cfg_dict to `path` unless it already holds it; seconds spent writing (0: reused).
    A directory holding another config is refused rather than overwritten."""
    if same_config(path, cfg_dict) and any(path.glob("*.safetensors")):
        print(f"reusing the checkpoint in {path}", flush=True)
        return 0.0
    t0 = time.perf_counter()
    print(f"writing a random {cfg_dict['num_hidden_layers']}-layer checkpoint to {path}", flush=True)
    model = random_model(cfg_dict, device, dtype)
    write_checkpoint(model, cfg_dict, path, shard_bytes)
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return time.perf_counter() - t0


def kv_read_bytes(cfg: ModelConfig, batch: int, context: int, elem: int = 2) -> float:
    """Latent-cache bytes one decode step reads: batch × context rows of (kv_lora_rank + rope) per layer."""
    return batch * context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * elem * cfg.num_hidden_layers


def timed_generate(llm: LLM, prompts, tokens: int) -> float:
    dev = llm.kv_pool.device
    synchronize(dev)
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    synchronize(dev)
    return time.perf_counter() - t0


def monotone_misses(rows: list[dict]) -> list[str]:
    """"B=a > B=b" for every batch a whose step is slower than that of a larger batch b."""
    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if b["batch"] > a["batch"] and a["step_s"] > b["step_s"]:
                out.append(f"B={a['batch']} ({a['step_s'] * 1e3:.2f} ms) > B={b['batch']} ({b['step_s'] * 1e3:.2f} ms)")
    return out


def decode_steps(llm: LLM, batches, prompt_len: int, rounds: int, copy_bw: float, new_tokens: int = 129,
                 seed: int = 1) -> dict:
    """Decode step per batch size: (t(new_tokens) − t(1)) / (new_tokens − 1) on fresh random prompts, median over
    rounds that each go through every batch size; one untimed warm-up per batch size first (compiles kernels,
    captures the graphs its batch sizes need)."""
    cfg = llm.model.config
    rng = random.Random(seed)

    def fresh(B):  # new random prompts every call: no prefix-cache hits
        return [[rng.randrange(3, cfg.vocab_size) for _ in range(prompt_len)] for _ in range(B)]

    for B in batches:
        timed_generate(llm, fresh(B), new_tokens)
    samples = {B: [] for B in batches}
    for r in range(rounds):
        for B in batches:
            t1 = timed_generate(llm, fresh(B), 1)
            tn = timed_generate(llm, fresh(B), new_tokens)
            samples[B].append((tn - t1) / (new_tokens - 1))
            print(f"  round {r + 1}/{rounds} B={B}: t(1) {t1 * 1e3:.1f} ms, t({new_tokens}) {tn * 1e3:.1f} ms, "
                  f"step {samples[B][-1] * 1e3:.2f} ms", flush=True)
    rows = []
    for B in batches:
        step = statistics.median(samples[B])
        w, kv = step_read_bytes(llm.model, B), kv_read_bytes(cfg, B, prompt_len + new_tokens // 2)
        row = {"batch": B, "step_s": step, "step_samples_s": samples[B], "weight_bytes": w, "kv_bytes": kv,
               "floor_step_s": (w + kv) / copy_bw, "weight_floor_step_s": w / copy_bw}
        row["floor_frac"] = row["floor_step_s"] / step
        if B in STEP_TARGETS_MS:
            row["target_ms"] = STEP_TARGETS_MS[B]
            row["pass"] = step * 1e3 <= STEP_TARGETS_MS[B]
        rows.append(row)
    misses = monotone_misses(rows)
    return {"prompt_len": prompt_len, "new_tokens": new_tokens, "rounds": rounds, "rows": rows,
            "monotone": not misses, "monotone_misses": misses}


def verify_steps(llm: LLM, context: int, k: int = 3, reps: int = 30, seed: int = 2) -> dict:
    """B=1 decode forward + logits with S = 1 + k query tokens against S = 1, over a `context`-token cache,
    through GraphedDecoder (a CUDA graph on CUDA, as the speculative engine's verify step runs; eager on CPU).
    The cache rows are zeroed pages of the engine's pool, released afterwards."""
    model, pool = llm.model, llm.kv_pool
    on_cuda = pool.device.type == "cuda"
    rng = random.Random(seed)
    sid = -1  # a sequence id no request has
    pool.allocate(sid, context + 1 + k)
    try:
        pages = pool.pages_of(sid)
        idx = torch.tensor(pages, device=pool.device)
        for c in pool.caches:  # defined rows (unwritten memory could hold NaN)
            c[idx] = 0
        max_pages = -(-model.max_positions // pool.page_size)
        out = {"context": context, "k": k, "what": "model forward + logits, B=1, GraphedDecoder "
                                                   + ("(CUDA graph replay)" if on_cuda else "(eager, CPU)")}
        for S in (1, 1 + k):
            dec = GraphedDecoder(model, pool, 1, max_pages, use_graphs=on_cuda, query_len=S)
            args = ([rng.randrange(3, model.config.vocab_size) for _ in range(S)], list(range(context, context + S)),
                    pool.slots(sid, context, context + S), [context + S], [pages])
            dec.run(*args)  # captures
            dec.run(*args)
            times = []
            for _ in range(reps):
                if on_cuda:
                    torch.cuda.synchronize()
                    torch.cuda._sleep(200_000)  # the host enqueues the step while the GPU spins
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    dec.run(*args)
                    e.record()
                    e.synchronize()
                    times.append(s.elapsed_time(e) / 1e3)
                else:
                    t0 = time.perf_counter()
                    dec.run(*args)
                    times.append(time.perf_counter() - t0)
            out[f"step_S{S}_s"] = statistics.median(times)
            del dec
        out["ratio"] = out[f"step_S{1 + k}_s"] / out["step_S1_s"]
        return out
    finally:
        pool.free(sid)


# ---- checkpoint directory mode: prompt throughput and time to first token ------------------------------
PREFILL_CASES = [(1, 128), (1, 512), (1, 2048), (1, 8192), (64, 512), (16, 4096)]  # (prompts, tokens each)
PREFILL_TARGETS = {(1, 512): ("ttft_ms", 30.0), (1, 8192): ("tok_s", 40e3), (64, 512): ("tok_s", 50e3)}


def prompt_flops(cfg: ModelConfig, L: int) -> float:
    """FLOPs of one L-token prompt's forward: every token through the linear layers it touches (attention
    projections, the dense MLP or router + shared + top-k routed experts), causal attention in the MHA form
    (L²/2 query-key pairs per head of q·k over d_qk and p·v over d_v), the last token's logits."""
    with torch.device("meta"):
        m = DeepseekForCausalLM(cfg, max_positions=16)
    per_token = 0
    for i, layer in enumerate(m.model.layers):
        per_token += sum(p.numel() for p in layer.self_attn.parameters() if p.dim() == 2)
        if cfg.is_moe_layer(i):
            H, I, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
            mlp = layer.mlp
            per_token += mlp.gate.weight.numel() + k * 3 * H * I
            per_token += sum(p.numel() for n, p in mlp.named_parameters() if n.startswith("shared"))
        else:
            per_token += sum(p.numel() for p in layer.mlp.parameters() if p.dim() == 2)
    heads = cfg.num_attention_heads
    attn = cfg.num_hidden_layers * heads * (L * (L + 1) / 2) * (cfg.qk_head_dim + cfg.v_head_dim) * 2
    return 2 * per_token * L + attn + 2 * cfg.hidden_size * cfg.vocab_size


def gpu_busy_s(llm: LLM, prompts) -> tuple[float, int]:
    """(seconds of GPU kernels, kernel launches) while the engine prefills `prompts` (one token out), from the
    torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed_generate(llm, prompts, 1)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / 1e6, len(kernels)


def prefill_runs(llm: LLM, rounds: int, gemm: float, cases=PREFILL_CASES, seed: int = 3, profile: bool = True
                 ) -> dict:
    """Per case (B prompts of L fresh random tokens, one token generated): wall time of `generate` (the prompt's
    time to first token at B=1), prompt tok/s, and the compute ceiling B·L / (FLOPs / the run's GEMM rate);
    median over `rounds` interleaved rounds after one untimed warm-up per case. One profiled run per case
    gives the GPU's busy time and the kernels launched (host-bound when busy ≪ wall); `profile=False` skips it."""
    cfg = llm.model.config
    rng = random.Random(seed)

    def fresh(B, L):
        return [[rng.randrange(3, cfg.vocab_size) for _ in range(L)] for _ in range(B)]

    for B, L in cases:
        timed_generate(llm, fresh(B, L), 1)
    samples = {c: [] for c in cases}
    for r in range(rounds):
        for B, L in cases:
            samples[(B, L)].append(timed_generate(llm, fresh(B, L), 1))
    rows = []
    for B, L in cases:
        t = statistics.median(samples[(B, L)])
        flops = B * prompt_flops(cfg, L)
        row = {"prompts": B, "prompt_len": L, "wall_s": t, "samples_s": samples[(B, L)], "tok_s": B * L / t,
               "flops": flops, "ceiling_tok_s": B * L / (flops / gemm), "ceiling_frac": flops / gemm / t}
        if profile and llm.kv_pool.device.type == "cuda":
            row["gpu_busy_s"], row["kernels"] = gpu_busy_s(llm, fresh(B, L))
        if (B, L) in PREFILL_TARGETS:
            what, target = PREFILL_TARGETS[(B, L)]
            row["target"] = {what: target}
            row["pass"] = t * 1e3 <= target if what == "ttft_ms" else B * L / t >= target
        rows.append(row)
        busy = (f", GPU busy {row['gpu_busy_s'] * 1e3:.1f} ms in {row['kernels']} kernels" if "gpu_busy_s" in row
                else "")
        print(f"  prefill {B} × {L}: {t * 1e3:.1f} ms, {B * L / t:.0f} tok/s (ceiling {row['ceiling_tok_s']:.0f})"
              + busy, flush=True)
    return {"rounds": rounds, "max_num_batched_tokens": llm.engine.scheduler.max_num_batched_tokens, "rows": rows}


def transformers_prefill(path: Path, dev, dtype, cases=PREFILL_CASES, rounds: int = 2, seed: int = 3) -> dict:
    """transformers on the same checkpoint directory: one forward over the B × L prompt batch and the argmax of
    each last token's logits, wall time (synchronised), median of `rounds` after one warm-up per case."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(dev).eval()  # (no accelerate needed)
    rng = random.Random(seed)
    rows = []
    for B, L in cases:
        ids = torch.tensor([[rng.randrange(3, hf.config.vocab_size) for _ in range(L)] for _ in range(B)],
                           device=dev)
        times = []
        for i in range(rounds + 1):
            synchronize(dev)
            t0 = time.perf_counter()
            with torch.inference_mode():
                hf(ids, logits_to_keep=1).logits[:, -1].argmax(-1).tolist()
            synchronize(dev)
            if i:
                times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        rows.append({"prompts": B, "prompt_len": L, "wall_s": t, "tok_s": B * L / t})
        print(f"  transformers prefill {B} × {L}: {t * 1e3:.1f} ms, {B * L / t:.0f} tok/s", flush=True)
    del hf
    return {"rounds": rounds, "rows": rows}


# ---- checkpoint directory mode: a long prompt arriving while requests decode -------------------------------
MIXED = {"decodes": 32, "decode_prompt": 512, "long_prompt": 8192, "before": 20, "after": 20, "warm": 5}
MIXED_TINY = dict(MIXED, decodes=4, decode_prompt=32, long_prompt=256)
SWEEP_CASES = [(1, 512), (1, 8192), (64, 512)]  # --chunk-sweep: prefill cases per max_num_batched_tokens
SWEEP_CASES_TINY = [(1, 64), (1, 256), (8, 64)]


def engine_budget(args) -> int:
    """The tokens per step the LLM gets: --max-batched-tokens, else LLM's own default."""
    import inspect

    if args.max_batched_tokens is not None:
        return args.max_batched_tokens
    return inspect.signature(LLM.__init__).parameters["max_num_batched_tokens"].default


def mixed_decode_tokens(sizes: dict, budget: int) -> int:
    """max_tokens of the decoding requests: more than the steps one scenario takes (warm-up, before, the long
    prompt's chunks at budget − decodes tokens each, after), so none finishes while it is measured."""
    chunks = -(-sizes["long_prompt"] // max(1, budget - sizes["decodes"]))
    return sizes["warm"] + sizes["before"] + chunks + sizes["after"] + 16


def _timed_step(llm: LLM) -> float:
    dev = llm.kv_pool.device
    synchronize(dev)
    t0 = time.perf_counter()
    llm.engine.step()
    synchronize(dev)
    return time.perf_counter() - t0


class _BatchLog:
    """Records what each `scheduler.schedule()` hands the engine (decode count, prefill chunks with their
    offsets) by wrapping the scheduler instance's method; `close()` restores it."""

    def __init__(self, scheduler):
        self.scheduler, self.batches = scheduler, []
        inner = scheduler.schedule

        def schedule():
            b = inner()
            self.batches.append({"decodes": len(b.decode),
                                 "prefill": [(s.seq_id, n, s.num_cached) for s, n in b.prefill]})
            return b

        scheduler.schedule = schedule

    def close(self):
        del self.scheduler.schedule  # the class's method again


def mixed_scenario(llm: LLM, sizes: dict, budget: int, rng: random.Random, max_steps: int = 100_000) -> dict:
    """One run of "a long prompt arriving while `decodes` requests decode", every step timed (synchronised wall
    time of `engine.step()`):
    1. `decodes` requests of fresh random `decode_prompt`-token prompts are added and stepped until every one has
       its first token (prefill done); `warm` decode-only steps untimed, then `before` decode-only steps timed;
    2. one request of a fresh random `long_prompt`-token prompt (max_tokens 1) is added; steps are timed until it
       has its token (its prefill goes in chunks of up to budget − decodes tokens beside the decodes), then
       `after` more decode steps.
    The decoding requests are aborted at the end."""
    eng, cfg = llm.engine, llm.model.config
    if eng.has_unfinished():
        raise RuntimeError("the mixed scenario needs an idle engine")

    def fresh(L):
        return [rng.randrange(3, cfg.vocab_size) for _ in range(L)]

    n = sizes["decodes"]
    dec_params = SamplingParams(max_tokens=mixed_decode_tokens(sizes, budget), temperature=0, ignore_eos=True)
    decs = [eng.add_request(fresh(sizes["decode_prompt"]), dec_params) for _ in range(n)]
    log = _BatchLog(eng.scheduler)
    try:
        steps = 0
        while not all(s.output_ids for s in decs):
            eng.step()
            steps += 1
            if steps > max_steps:
                raise RuntimeError("the decoding requests did not all finish their prefill")
        for _ in range(sizes["warm"]):
            eng.step()
        del log.batches[:]
        before = [_timed_step(llm) for _ in range(sizes["before"])]
        bad = [b for b in log.batches if b["prefill"] or b["decodes"] != n]
        if bad:
            raise RuntimeError(f"a decode-only step was not {n} decodes alone: {bad[0]}")
        del log.batches[:]
        long_seq = eng.add_request(fresh(sizes["long_prompt"]),
                                   SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        rows = []
        while not long_seq.output_ids:
            t = _timed_step(llm)
            rows.append({"phase": "prefill", "step_s": t, **_step_parts(log.batches[-1], long_seq.seq_id)})
            if len(rows) > max_steps:
                raise RuntimeError("the long prompt got no first token")
        ttft_engine = eng.output_of(long_seq).metrics["ttft_s"]
        for _ in range(sizes["after"]):
            t = _timed_step(llm)
            rows.append({"phase": "after", "step_s": t, **_step_parts(log.batches[-1], long_seq.seq_id)})
        finished_early = [s.seq_id for s in decs if s.is_finished]
        if finished_early:
            raise RuntimeError(f"decoding requests {finished_early} finished during the measurement")
    finally:
        log.close()
        for s in decs:
            eng.abort(s)
    return {"before_s": before, "steps": rows, "long_ttft_engine_s": ttft_engine,
            "long_ttft_steps_s": sum(r["step_s"] for r in rows if r["phase"] == "prefill")}


def _step_parts(batch: dict, long_id: int) -> dict:
    """The long request's chunk (size, offset) and the rest of one recorded batch."""
    chunk = [(c, off) for sid, c, off in batch["prefill"] if sid == long_id]
    other = sum(c for sid, c, _ in batch["prefill"] if sid != long_id)
    size, off = chunk[0] if chunk else (0, None)
    return {"decodes": batch["decodes"], "chunk": size, "chunk_offset": off, "other_prefill_tokens": other}


def chunk_alone_s(llm: LLM, prompt_len: int, offset: int, size: int, rng: random.Random, reps: int = 3) -> float:
    """Wall time of a step that prefills tokens [offset, offset + size) of a fresh `prompt_len`-token prompt and
    nothing else (the chunk of the mixed run at its place: its attention reads the `offset` cached tokens before
    it), median of `reps`. The first `offset` tokens go in untimed steps of at most the engine's budget; the
    scheduler's budget is set to `size` for the timed step; the request is aborted after it."""
    eng, sched, cfg = llm.engine, llm.engine.scheduler, llm.model.config
    budget = sched.max_num_batched_tokens
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    try:
        for _ in range(reps):
            seq = eng.add_request([rng.randrange(3, cfg.vocab_size) for _ in range(prompt_len)], params)
            while seq.num_cached < offset:
                sched.max_num_batched_tokens = min(budget, offset - seq.num_cached)
                eng.step()
            if seq.num_cached != offset:
                raise RuntimeError(f"chunk_alone_s: {seq.num_cached} tokens cached, wanted {offset}")
            sched.max_num_batched_tokens = size
            times.append(_timed_step(llm))
            if seq.num_cached != offset + size:
                raise RuntimeError(f"chunk_alone_s: the timed step computed {seq.num_cached - offset} tokens, "
                                   f"wanted {size}")
            eng.abort(seq)
    finally:
        sched.max_num_batched_tokens = budget
        while eng.has_unfinished():
            eng.abort(eng.running[0] if eng.running else eng.waiting[0])
    return statistics.median(times)


def mixed_run(llm: LLM, sizes: dict, seed: int = 4) -> dict:
    """The mixed scenario once untimed (kernels and graphs of every shape it meets), once measured; then the
    compute time of each of its long-prompt chunks alone, and the check "no step exceeds 2 × the decode-only
    step + its chunk's compute time alone" (a step without a chunk: 2 × the decode-only step)."""
    rng = random.Random(seed)
    budget = llm.engine.scheduler.max_num_batched_tokens
    if budget <= sizes["decodes"]:
        raise SystemExit(f"--mixed: max_num_batched_tokens {budget} leaves no room for a prefill chunk beside "
                         f"{sizes['decodes']} decodes")
    mixed_scenario(llm, sizes, budget, rng)  # warm-up
    run = mixed_scenario(llm, sizes, budget, rng)
    decode_s = statistics.median(run["before_s"])
    chunks = sorted({(r["chunk_offset"], r["chunk"]) for r in run["steps"] if r["chunk"]})
    alone = {c: chunk_alone_s(llm, sizes["long_prompt"], *c, rng) for c in chunks}
    fresh = {}  # the brief's simpler measure: a fresh prompt of the chunk's length, generate(max_tokens=1)
    for size in sorted({c for _, c in chunks}):
        timed_generate(llm, [[rng.randrange(3, llm.model.config.vocab_size) for _ in range(size)]], 1)
        fresh[size] = statistics.median(
            timed_generate(llm, [[rng.randrange(3, llm.model.config.vocab_size) for _ in range(size)]], 1)
            for _ in range(3))
    for r in run["steps"]:
        c = (r["chunk_offset"], r["chunk"])
        r["chunk_alone_s"] = alone.get(c, 0.0)
        r["chunk_fresh_prompt_s"] = fresh.get(r["chunk"], 0.0)
        r["limit_s"] = 2 * decode_s + r["chunk_alone_s"]
        r["pass"] = r["step_s"] <= r["limit_s"]
        r["pass_vs_fresh_prompt"] = r["step_s"] <= 2 * decode_s + r["chunk_fresh_prompt_s"]
    carried = [r["step_s"] for r in run["steps"] if r["chunk"]]
    after = [r["step_s"] for r in run["steps"] if r["phase"] == "after"]
    return {**sizes, "max_num_batched_tokens": budget, "decode_step_s": decode_s,
            "decode_step_samples_s": run["before_s"], "steps": run["steps"],
            "tpot_during_prefill_s": {"mean": statistics.mean(carried), "median": statistics.median(carried),
                                      "max": max(carried), "steps": len(carried)},
            "decode_step_after_s": statistics.median(after) if after else None,
            "long_ttft_s": run["long_ttft_engine_s"], "long_ttft_steps_s": run["long_ttft_steps_s"],
            "chunk_alone_s": [{"offset": o, "size": c, "s": t} for (o, c), t in alone.items()],
            "chunk_fresh_prompt_s": [{"size": c, "s": t} for c, t in fresh.items()],
            "pass": all(r["pass"] for r in run["steps"]),
            "pass_vs_fresh_prompt": all(r["pass_vs_fresh_prompt"] for r in run["steps"])}


def format_mixed_table(res: dict) -> str:
    t = res["tpot_during_prefill_s"]
    lines = [f"mixed: a {res['long_prompt']}-token prompt arriving while {res['decodes']} requests decode "
             f"({res['decode_prompt']}-token prompts), max_num_batched_tokens {res['max_num_batched_tokens']}; "
             f"{res['label']}",
             f"decode-only step (median of {len(res['decode_step_samples_s'])}): {res['decode_step_s'] * 1e3:.2f} ms; "
             f"decodes' TPOT during the prefill ({t['steps']} steps with a chunk): mean {t['mean'] * 1e3:.2f}, "
             f"median {t['median'] * 1e3:.2f}, max {t['max'] * 1e3:.2f} ms; after it: "
             + ("n/a" if res["decode_step_after_s"] is None else f"{res['decode_step_after_s'] * 1e3:.2f} ms"),
             f"TTFT of the long prompt: {res['long_ttft_s'] * 1e3:.1f} ms (its steps: "
             f"{res['long_ttft_steps_s'] * 1e3:.1f} ms)",
             "| step | phase | decodes | chunk (offset + size) | step ms | chunk alone ms | fresh prompt ms "
             "| limit ms (2 × decode + chunk alone) | result |", "|---" * 9 + "|"]
    for i, r in enumerate(res["steps"]):
        chunk = "—" if not r["chunk"] else f"{r['chunk_offset']} + {r['chunk']}"
        alone = "—" if not r["chunk"] else f"{r['chunk_alone_s'] * 1e3:.2f}"
        fresh = "—" if not r["chunk"] else f"{r['chunk_fresh_prompt_s'] * 1e3:.2f}"
        lines.append(f"| {i + 1} | {r['phase']} | {r['decodes']} | {chunk} | {r['step_s'] * 1e3:.2f} "
                     f"| {alone} | {fresh} "
                     f"| {r['limit_s'] * 1e3:.2f} | {'PASS' if r['pass'] else 'MISS'} |")
    lines.append("no step exceeds 2 × the decode-only step + its chunk's compute time: "
                 + ("PASS" if res["pass"] else "MISS") + " (against a fresh prompt of the chunk's length: "
                 + ("PASS" if res["pass_vs_fresh_prompt"] else "MISS") + ")")
    return "\n".join(lines)


def free_llm(dev) -> None:
    """Release the GPU memory of objects already dropped by the caller (an LLM's graph pools, KV cache and
    weights): collect reference cycles, then empty the allocator's cache."""
    import gc

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def chunk_sweep(path: Path, args, dev, dtype, max_len: int, max_seqs: int, gemm: float) -> dict:
    """Per max_num_batched_tokens value: LLM(path) built with it (the previous one freed first), prompt tok/s
    and wall time of the sweep cases (prefill_runs, no profiler), median of --rounds rounds."""
    cases = SWEEP_CASES_TINY if args.tiny else SWEEP_CASES
    rows = []
    for budget in args.chunk_sweep:
        llm = LLM(str(path), device=str(dev), dtype=dtype, max_num_seqs=max_seqs, max_model_len=max_len,
                  max_num_batched_tokens=budget, load_format=args.load_format)
        print(f"chunk sweep: max_num_batched_tokens {budget}", flush=True)
        res = prefill_runs(llm, args.rounds, gemm, cases=cases, profile=False)
        del llm
        free_llm(dev)
        for r in res["rows"]:
            rows.append({"max_num_batched_tokens": budget, "case": f"{r['prompts']} × {r['prompt_len']}",
                         "prompts": r["prompts"], "prompt_len": r["prompt_len"], "tok_s": r["tok_s"],
                         "wall_s": r["wall_s"], "samples_s": r["samples_s"]})
    return {"rounds": args.rounds, "cases": [list(c) for c in cases], "rows": rows}


def format_sweep_table(res: dict) -> str:
    cases = [f"{b} × {l}" for b, l in res["cases"]]
    by = {(r["max_num_batched_tokens"], r["case"]): r for r in res["rows"]}
    budgets = list(dict.fromkeys(r["max_num_batched_tokens"] for r in res["rows"]))
    lines = [f"chunk sweep: prompt tok/s (wall ms) per max_num_batched_tokens, median of {res['rounds']} rounds",
             "| max_num_batched_tokens | " + " | ".join(cases) + " |", "|---" * (1 + len(cases)) + "|"]
    for b in budgets:
        cells = [f"{by[(b, c)]['tok_s']:.0f} ({by[(b, c)]['wall_s'] * 1e3:.1f})" for c in cases]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_prefill_table(res: dict) -> str:
    hf = {(r["prompts"], r["prompt_len"]): r for r in (res.get("transformers") or {}).get("rows", [])}
    lines = [f"prefill, {res['label']}: one token generated per prompt, median of {res['rounds']} rounds, "
             f"max_num_batched_tokens {res['max_num_batched_tokens']}",
             "| prompts × tokens | wall ms | prompt tok/s | ceiling tok/s | of ceiling | GPU busy ms | kernels "
             "| transformers tok/s | vs transformers | target | result |", "|---" * 11 + "|"]
    for r in res["rows"]:
        h = hf.get((r["prompts"], r["prompt_len"]))
        tgt = r.get("target")
        tgt_s = "—" if not tgt else (f"TTFT ≤ {tgt['ttft_ms']:g} ms" if "ttft_ms" in tgt else f"≥ {tgt['tok_s']:.0f} tok/s")
        verdict = "—" if not tgt else ("PASS" if r["pass"] else "MISS")
        busy = r.get("gpu_busy_s")
        busy_s = "n/a" if busy is None else f"{busy * 1e3:.1f}"
        hf_s = "n/a" if h is None else f"{h['tok_s']:.0f}"
        ratio = "n/a" if h is None else f"{r['tok_s'] / h['tok_s']:.1f}×"
        lines.append(f"| {r['prompts']} × {r['prompt_len']} | {r['wall_s'] * 1e3:.1f} | {r['tok_s']:.0f} "
                     f"| {r['ceiling_tok_s']:.0f} | {r['ceiling_frac']:.0%} | {busy_s} | {r.get('kernels', 'n/a')} "
                     f"| {hf_s} | {ratio} | {tgt_s} | {verdict} |")
    return "\n".join(lines)


def format_decode_table(res: dict) -> str:
    lines = [f"decode step, {res['label']}: {res['prompt_len']}-token prompts, (t({res['new_tokens']}) − t(1)) / "
             f"{res['new_tokens'] - 1}, median of {res['rounds']} rounds",
             "| B | step ms | floor ms (weights + KV) | floor / step | target ms | result |",
             "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        target = r.get("target_ms")
        verdict = "—" if target is None else ("PASS" if r["pass"] else "MISS")
        floor = "n/a" if r["floor_step_s"] != r["floor_step_s"] else f"{r['floor_step_s'] * 1e3:.2f}"  # nan on CPU
        frac = "n/a" if r["floor_frac"] != r["floor_frac"] else f"{r['floor_frac']:.0%}"
        lines.append(f"| {r['batch']} | {r['step_s'] * 1e3:.2f} | {floor} | {frac} | "
                     f"{'—' if target is None else f'{target:g}'} | {verdict} |")
    lines.append("no batch slower than a larger one: " + ("PASS" if res["monotone"] else
                                                         "MISS (" + "; ".join(res["monotone_misses"]) + ")"))
    v = res.get("verify")
    if v:
        sk = v[f"step_S{1 + v['k']}_s"]
        lines.append(f"B=1 verify step (S = 1 + {v['k']}) {sk * 1e3:.2f} ms against S = 1 "
                     f"{v['step_S1_s'] * 1e3:.2f} ms (× {v['ratio']:.2f}; {v['what']}, {v['context']}-token context)")
    return "\n".join(lines)


def checkpoint_mode(args, dev, dtype, copy_bw, results: dict) -> None:
    cfg_dict = dict(TINY if args.tiny else V2_LITE, num_hidden_layers=args.layers,
                    torch_dtype=str(dtype).removeprefix("torch."))
    path = Path(args.checkpoint_dir)
    results["checkpoint_dir"] = str(path)
    results["args"] = vars(args)
    try:
        results["git_commit"] = args.commit or subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True,
            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        results["git_commit"] = None
    if args.load_format == "safetensors":
        results["checkpoint_write_s"] = ensure_checkpoint(path, cfg_dict, dev, dtype, int(args.shard_gb * (1 << 30)))
    elif not same_config(path, cfg_dict):  # the same shapes built on the device (N(0, 0.02)): config.json alone
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(cfg_dict, indent=1))
    mixed = (MIXED_TINY if args.tiny else MIXED) if args.mixed else None
    sweep_cases = (SWEEP_CASES_TINY if args.tiny else SWEEP_CASES) if args.chunk_sweep else []
    longest = max([args.prompt_len] + ([L for _, L in PREFILL_CASES] if args.prefill else [])
                  + [L for _, L in sweep_cases])
    if mixed:  # the long prompt and its token; the decoding requests' prompts and every token they may generate
        longest = max(longest, mixed["long_prompt"] + 1,
                      mixed["decode_prompt"] + mixed_decode_tokens(mixed, engine_budget(args)))
    max_len = -(-(longest + 256) // 64) * 64
    max_seqs = max(args.batches + ([mixed["decodes"] + 1] if mixed else []) + (args.profile or [])
                   + [B for B, _ in sweep_cases])
    extra = {} if args.max_batched_tokens is None else {"max_num_batched_tokens": args.max_batched_tokens}
    label = f"V2-Lite-shaped checkpoint ({args.layers} layers, random, {str(dtype).split('.')[-1]}), LLM(path)"
    gemm = float("nan")
    if args.prefill or args.chunk_sweep:
        gemm = gemm_rate(dev) if dev.type == "cuda" else float("nan")
        results["gemm_TFLOPs"] = gemm / 1e12
        free_llm(dev)  # the GEMM's operands leave the allocator's cache before the KV pool is sized
    if not args.no_decode or args.prefill or mixed or args.profile:
        t0 = time.perf_counter()
        llm = LLM(str(path), device=str(dev), dtype=dtype, max_num_seqs=max_seqs, max_model_len=max_len,
                  load_format=args.load_format, **extra)
        results["load_s"] = time.perf_counter() - t0
        print(f"loaded {path} in {results['load_s']:.1f}s; CUDA graphs: {llm.engine.runner.graphed is not None}",
              flush=True)
        if not args.no_decode:
            res = {"label": label, "graphs": llm.engine.runner.graphed is not None,
                   **decode_steps(llm, args.batches, args.prompt_len, args.rounds, copy_bw)}
            res["verify"] = verify_steps(llm, args.prompt_len)
            results["decode"] = res
            print("\n" + format_decode_table(res), flush=True)
        if args.profile:
            from step_profile import format_profile, profile_decode

            rows = []
            for B in args.profile:
                floor = (step_read_bytes(llm.model, B) + kv_read_bytes(llm.model.config, B, args.prompt_len)) / copy_bw
                rows.append(profile_decode(llm, B, args.prompt_len, floor))
                print("\n" + format_profile(rows[-1]), flush=True)
            results["profile"] = {"label": label, "rows": rows}
        if args.prefill:
            results["prefill"] = {"label": label, **prefill_runs(llm, args.rounds, gemm)}
        if mixed:
            results["mixed"] = {"label": label, **mixed_run(llm, mixed)}
            print("\n" + format_mixed_table(results["mixed"]), flush=True)
        del llm
        free_llm(dev)
    if args.chunk_sweep:
        results["chunk_sweep"] = {"label": label, **chunk_sweep(path, args, dev, dtype, max_len, max_seqs, gemm)}
        print("\n" + format_sweep_table(results["chunk_sweep"]), flush=True)
    if args.prefill:
        res = results["prefill"]
        if not args.no_transformers:
            res["transformers"] = transformers_prefill(path, dev, dtype)
        print("\n" + format_prefill_table(res), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=None, help="trunk layers (default 27; 2 with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="tiny dims (CPU smoke run)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=None,
                    help="batch sizes (default 1 32; 1 8 32 64 128 with --checkpoint-dir)")
    ap.add_argument("--prompt-len", type=int, default=None,
                    help="prompt tokens (default 128; 512 with --checkpoint-dir)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--skip-embedded", action="store_true")
    ap.add_argument("--checkpoint-dir", default=None,
                    help="write (or reuse) the random model as an HF checkpoint here, load it with LLM(dir), and "
                         "measure the decode step per batch size and the B=1 verify step (bench_engine_decode.json)")
    ap.add_argument("--prefill", action="store_true",
                    help="--checkpoint-dir: also prompt throughput and time to first token (B=1 with 128 … 8192 "
                         "tokens, 64 × 512, 16 × 4096) against transformers on the same directory")
    ap.add_argument("--mixed", action="store_true",
                    help="--checkpoint-dir: a long prompt (8192 tokens) arriving while 32 requests decode: every "
                         "step's time and chunk, the decodes' TPOT during the prefill, the long prompt's TTFT, and "
                         "'no step exceeds 2 × the decode-only step + its chunk's compute time' (key 'mixed' of "
                         "bench_engine_prefill.json with --prefill, else bench_engine_mixed.json)")
    ap.add_argument("--chunk-sweep", type=int, nargs="+", default=None, metavar="N",
                    help="--checkpoint-dir: for each max_num_batched_tokens N, LLM(dir) built with it and prompt "
                         "tok/s of 1 × 512, 1 × 8192, 64 × 512 (key 'chunk_sweep' of bench_engine_prefill.json "
                         "with --prefill, else bench_engine_chunk_sweep.json)")
    ap.add_argument("--no-decode", action="store_true", help="--checkpoint-dir: skip the decode-step measurement")
    ap.add_argument("--profile", type=int, nargs="+", default=None, metavar="B",
                    help="--checkpoint-dir: where each batch size's decode step goes, per kernel and kernel group "
                         "(torch.profiler; benchmarks/step_profile.py), in bench_engine_profile.json")
    ap.add_argument("--rounds", type=int, default=3, help="--checkpoint-dir: rounds of the decode-step, prefill and chunk-sweep measurements")
    ap.add_argument("--max-batched-tokens", type=int, default=None,
                    help="--checkpoint-dir: the engine's tokens per step (default: the engine's own)")
    ap.add_argument("--shard-gb", type=float, default=4.0, help="--checkpoint-dir: safetensors shard size")
    ap.add_argument("--load-format", choices=["safetensors", "dummy"], default="safetensors",
                    help="--checkpoint-dir: dummy builds the same shapes on the device (N(0, 0.02)) from config.json "
                         "alone, without writing or reading the weights (decode steps only: the transformers "
                         "comparisons read the checkpoint)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--commit", default=None, help="commit to record (default: the checkout's HEAD)")
    args = ap.parse_args()
    ckpt = args.checkpoint_dir is not None
    if args.load_format == "dummy" and args.prefill and not args.no_transformers:
        ap.error("--load-format dummy writes no weights for transformers to read: add --no-transformers")
    args.layers = args.layers or (2 if args.tiny else 27)
    args.batches = args.batches or ([1, 8, 32, 64, 128] if ckpt else [1, 32])
    args.prompt_len = args.prompt_len or (512 if ckpt else 128)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    copy_bw = copy_bandwidth(dev)
    results = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "copy_GBps": copy_bw / 1e9,
               "torch": torch.__version__, "models": []}
    os.makedirs(args.out, exist_ok=True)
    if ckpt:
        del results["models"]
        checkpoint_mode(args, dev, dtype, copy_bw, results)
        parts = ("decode", "prefill", "mixed", "chunk_sweep", "profile")
        common = {k: v for k, v in results.items() if k not in parts}
        files = {"decode": ["decode"], "prefill": ["prefill"], "profile": ["profile"]}  # bench_engine_<file>.json
        for part in ("mixed", "chunk_sweep"):  # beside the prefill figures when they run, else a file each
            files.setdefault("prefill" if "prefill" in results else part, []).append(part)
        for name, keys in files.items():
            if any(k in results for k in keys):
                with open(os.path.join(args.out, f"bench_engine_{name}.json"), "w") as f:
                    json.dump({**common, **{k: results[k] for k in keys if k in results}}, f, indent=1, default=str)
        return
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
