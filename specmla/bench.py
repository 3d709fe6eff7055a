"""`specmla bench throughput`: offline throughput of a batch of prompts (vllm bench definitions).

- output throughput = generated tokens / wall time of the whole batch;
- TTFT = first token time − arrival, per request; TPOT = (e2e − TTFT) / (output tokens − 1);
  reported as mean / median / p99 over requests.
Optionally runs transformers' `generate` on the same weights and prompts for comparison.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

import torch

from specmla.sampling_params import SamplingParams


def load_prompts(path: str | None, num_prompts: int, input_len: int, vocab: int, seed: int) -> list:
    """Prompts from a file (one per line, or JSON lines with a "prompt" field), else random token ids."""
    if path:
        lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
        prompts = [json.loads(ln)["prompt"] if ln.lstrip().startswith("{") else ln for ln in lines]
        if not prompts:
            raise ValueError(f"{path} holds no prompts")
        return [prompts[i % len(prompts)] for i in range(num_prompts)]
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(num_prompts)]


def _stats(xs: list[float]) -> dict:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return {"mean": None, "median": None, "p99": None}
    p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
    return {"mean": statistics.fmean(xs), "median": statistics.median(xs), "p99": p99}


def run_throughput(llm, prompts: list, output_len: int, warmup: bool = True) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    if warmup:  # compile kernels / allocate before timing
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    if llm.kv_pool.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    n_out = sum(len(o.token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    return {
        "requests": len(outs),
        "input_tokens": n_in,
        "output_tokens": n_out,
        "duration_s": wall,
        "output_tok_per_s": n_out / wall,
        "total_tok_per_s": (n_in + n_out) / wall,
        "request_per_s": len(outs) / wall,
        "ttft_s": _stats([o.metrics["ttft_s"] for o in outs]),
        "tpot_s": _stats([o.metrics["tpot_s"] for o in outs]),
        "preemptions": llm.engine.scheduler.num_preemptions,
        "prefix_hit_tokens": llm.kv_pool.prefix_hit_tokens,
        "spec": llm.engine.spec_stats.as_dict(),
    }


def run_transformers(model_dir, prompts: list[list[int]], output_len: int, batch: int, device: str, dtype) -> dict:
    """transformers' generate on the same weights: greedy, `output_len` new tokens, batches of `batch`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    gen = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        first = torch.tensor([prompts[0]], device=device)
        model.generate(first, attention_mask=torch.ones_like(first), **dict(gen, max_new_tokens=2, min_new_tokens=2))
        t0 = time.perf_counter()
        n_out = 0
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i : i + batch], device=device)  # equal lengths: no padding needed
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
            n_out += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return {"output_tokens": n_out, "duration_s": wall, "output_tok_per_s": n_out / wall}


def format_report(r: dict, label: str = "specmla") -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1000:.1f}"

    spec = r["spec"]
    spec_line = (f"\n  speculative: {spec['num_accepted_tokens']}/{spec['num_draft_tokens']} draft tokens accepted, "
                 f"mean acceptance length {spec['mean_acceptance_length']:.2f}" if spec["num_drafts"] else "")
    return (
        f"{label}: {r['requests']} requests, {r['input_tokens']} prompt + {r['output_tokens']} output tokens "
        f"in {r['duration_s']:.2f} s\n"
        f"  output throughput {r['output_tok_per_s']:.1f} tok/s | total {r['total_tok_per_s']:.1f} tok/s | "
        f"{r['request_per_s']:.2f} req/s\n"
        f"  TTFT ms mean/median/p99 {ms(r['ttft_s']['mean'])}/{ms(r['ttft_s']['median'])}/{ms(r['ttft_s']['p99'])} | "
        f"TPOT ms mean/median/p99 {ms(r['tpot_s']['mean'])}/{ms(r['tpot_s']['median'])}/{ms(r['tpot_s']['p99'])}\n"
        f"  preemptions {r['preemptions']} | prefix-cache hit tokens {r['prefix_hit_tokens']}"
        + spec_line
    )


def run_spec_sweep(make_llm, prompts: list, output_len: int, modes: list[str], ks: list[int],
                   batch: int | None = None, rounds: int = 1) -> list[dict]:
    """Decode tok/s and acceptance for each speculative mode and draft length, same prompts (greedy);
    `batch` requests run at a time (the LLM's max_num_seqs), default all prompts at once.

    rounds > 1: every configuration is built and warmed up first, then timed once per round, each round
    starting one configuration later, and the rates are the medians over rounds (rates alone: `runs`).
    A B=1 run of the embedded model is host-bound and the host's speed drifts, so one timing per
    configuration in a fixed order does not reproduce."""
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    configs = [(mode, k) for mode in modes for k in ([0] if mode == "none" else ks)]
    shape = (batch or len(prompts), len(prompts))
    done, live = {}, {}
    for mode, k in configs:
        llm = make_llm(None if mode == "none" else mode, max(k, 1))
        # warm up on the same workload: every kernel variant the growing lengths and the varying
        # accepted counts reach is compiled (and the graphs captured) before the timed runs
        llm.generate(prompts, params)
        if rounds == 1:  # timed at once and dropped: nothing else is alive while it runs
            done[(mode, k)] = _spec_row(mode, k, *shape, [_timed_generate(llm, prompts, params)])
            del llm
        else:
            live[(mode, k)] = llm
    if rounds > 1:
        runs = {c: [] for c in configs}
        for r in range(rounds):
            for c in configs[r % len(configs):] + configs[: r % len(configs)]:
                runs[c].append(_timed_generate(live[c], prompts, params))
        done = {c: _spec_row(*c, *shape, runs[c]) for c in configs}
    rows = [done[c] for c in configs]
    base = next((r for r in rows if r["mode"] == "none"), None)
    for row in rows:
        if base is not None:
            row["speedup"] = row["output_tok_per_s"] / base["output_tok_per_s"]
            # decode alone (each request's first token excluded): the prefill step, which speculation
            # cannot shorten and the MTP catch-up lengthens, is left out
            if row["decode_tok_per_s_per_request"] and base["decode_tok_per_s_per_request"]:
                row["decode_speedup"] = row["decode_tok_per_s_per_request"] / base["decode_tok_per_s_per_request"]
            row["same_output"] = row["token_ids"] == base["token_ids"]
    for r in rows:
        r.pop("token_ids")
    return rows


def _timed_generate(llm, prompts, params) -> dict:
    """One timed pass over the prompts: output tok/s, per-request decode tok/s, acceptance, tokens."""
    llm.engine.spec_stats.__init__()
    policy = llm.engine.policy
    if policy is not None:
        policy.steps.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    decode_s = sum((o.metrics["e2e_s"] - (o.metrics["ttft_s"] or 0)) for o in outs) / len(outs)
    n = sum(len(o.token_ids) for o in outs)
    return {"output_tok_per_s": n / wall,
            "decode_tok_per_s_per_request": (params.max_tokens - 1) / decode_s if decode_s > 0 else None,
            "spec": llm.engine.spec_stats.as_dict(), "token_ids": [o.token_ids for o in outs],
            "policy": policy.as_dict() if policy is not None else None}


def _spec_row(mode, k, batch, n_prompts, runs: list[dict]) -> dict:
    """A configuration's row: median rates over its runs (each run's rates kept in `runs`)."""
    dec = [r["decode_tok_per_s_per_request"] for r in runs if r["decode_tok_per_s_per_request"]]
    row = {"mode": mode, "k": k, "batch": batch, "prompts": n_prompts,
           "output_tok_per_s": statistics.median(r["output_tok_per_s"] for r in runs),
           "decode_tok_per_s_per_request": statistics.median(dec) if dec else None,
           "spec": runs[-1]["spec"], "token_ids": runs[0]["token_ids"], "policy": runs[-1]["policy"]}
    if len(runs) > 1:
        row["runs"] = [{key: r[key] for key in ("output_tok_per_s", "decode_tok_per_s_per_request")} for r in runs]
        row["same_across_runs"] = all(r["token_ids"] == runs[0]["token_ids"] for r in runs)
    return row


def _chosen_k(policy: dict | None) -> str:
    if not policy or policy["speculative_fraction"] is None:
        return ""
    return (f"  [auto: k={policy['k_max']} on {policy['speculative_fraction']:.0%} of decode steps, "
            f"k=0 on the rest]")


def format_spec_rows(rows: list[dict]) -> str:
    """One line per mode and k: output tok/s and its speedup over no-spec (whole requests), the decode-only
    speedup (first tokens excluded), acceptance, and (auto) the share of decode steps that speculated with k_max."""
    lines = [f"{'mode':7s} {'k':>2s} {'B':>4s} {'tok/s':>9s} {'speedup':>8s} {'decode':>7s} {'mean acc len':>12s}"
             "  accepted per position"]
    for r in rows:
        sp = r["spec"]
        per = sp["accepted_per_position"]
        rate = [f"{a / sp['num_drafts']:.2f}" for a in per] if sp["num_drafts"] else []
        lines.append(f"{r['mode']:7s} {r['k']:>2d} {r['batch']:>4d} {r['output_tok_per_s']:>9.1f} "
                     f"{r.get('speedup', 1.0):>7.2f}x {r.get('decode_speedup', 1.0):>6.2f}x "
                     f"{sp['mean_acceptance_length']:>12.2f}  {' '.join(rate)}"
                     + _chosen_k(r.get("policy"))
                     + ("" if r.get("same_output", True) else "  (OUTPUT DIFFERS)"))
    return "\n".join(lines)
