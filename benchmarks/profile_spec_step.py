"""Where a B=1 decode step of the embedded model spends its time (issue 6): GPU time of each
captured graph (plain decode, the one-replay MTP step for k = 1..4), the whole engine step's wall
time, and the kernel count per module of one eager forward.

    PYTHONPATH=. python3 benchmarks/profile_spec_step.py [--out DIR]

A step of this 18 M-parameter model is a few hundred tiny kernels; in a graph each costs a few µs
whatever it computes, so the kernel count, not the bytes or FLOPs, sets the GPU time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time

import torch

from specmla import LLM, SamplingParams
from specmla.model.default import ASSETS
from specmla.model.deepseek import MoE
from specmla.model.metadata import AttentionMetadata

PROMPT = "import os\n\n\ndef walk(top, topdown=True, onerror=None, followlinks=False):\n    \"\"\"Directory tree generator."


def replay_us(graph: torch.cuda.CUDAGraph, n: int = 50) -> tuple[float, float]:
    """(one replay then a wait, as the engine does; n back-to-back replays / n: GPU time), µs."""
    one = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        one.append(time.perf_counter() - t)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        graph.replay()
    e.record()
    torch.cuda.synchronize()
    return statistics.median(one) * 1e6, s.elapsed_time(e) * 1e3 / n


def step_wall_us(llm: LLM, tokens: int = 96) -> float:
    """Wall time per engine step while one request decodes (prefill step excluded), after a
    warm-up generation that captures the graphs."""
    eng = llm.engine
    llm.generate([PROMPT], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    eng.add_request(PROMPT, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    eng.step()  # prefill
    torch.cuda.synchronize()
    n, t = 0, time.perf_counter()
    while eng.has_unfinished():
        eng.step()
        n += 1
    return (time.perf_counter() - t) / n * 1e6


def launch_us(graph: torch.cuda.CUDAGraph) -> float:
    """Host time of the cudaGraphLaunch call itself (profiler's CPU event)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return sum(e.cpu_time_total for e in prof.events() if "GraphLaunch" in e.name)


def timeline(graph: torch.cuda.CUDAGraph) -> dict:
    """Kernels of one replay as the profiler sees them: count, summed busy time, span from the
    first start to the last end, and the kernels that take longest in total."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
    if not ev:
        return {}
    busy = collections.Counter()
    for e in ev:
        busy[e.name[:60]] += e.time_range.end - e.time_range.start
    start, end = min(e.time_range.start for e in ev), max(e.time_range.end for e in ev)
    launch = [e for e in prof.events() if "GraphLaunch" in e.name]
    first_delay = start - launch[0].time_range.start if launch else None
    return {"kernels": len(ev), "busy_us": sum(busy.values()), "span_us": end - start,
            "launch_to_first_kernel_us": first_delay, "top": busy.most_common(8)}


def graphs_of(llm: LLM) -> dict:
    r = llm.engine.runner
    out = {}
    for name in ("graphed", "graphed_verify", "graphed_mtp", "graphed_spec"):
        g = getattr(r, name)
        if g is not None and 1 in g.graphs:
            one, b2b = replay_us(g.graphs[1])
            out[name] = {"one_replay_us": one, "back_to_back_us": b2b, "launch_call_us": launch_us(g.graphs[1]),
                         "timeline": timeline(g.graphs[1]),
                         "nodes": g.graphs[1].num_nodes() if hasattr(g.graphs[1], "num_nodes") else None}
    return out


def kernel_counts(llm: LLM) -> dict:
    """Kernels per module for one eager B=1 decode forward and one MTP forward (sync-free MoE, as
    in a graph)."""
    model = llm.model
    for m in model.modules():
        if isinstance(m, MoE):
            m.sync_free = True
    pool = llm.kv_pool
    ids = torch.tensor([5], device="cuda")
    meta = AttentionMetadata(positions=torch.tensor([3], device="cuda"),
                             cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
                             seq_lens=torch.tensor([4], dtype=torch.int32, device="cuda"), max_seqlen_q=1,
                             max_seqlen_kv=pool.page_size, slot_mapping=torch.tensor([3], device="cuda"),
                             block_table=torch.tensor([[pool.scratch_page]], dtype=torch.int32, device="cuda"),
                             decode_query_len=1, kv_format=pool.kv_format)
    out = {}
    with torch.inference_mode():
        for name, fn in (("trunk", lambda: model.compute_logits(model(ids, meta, pool.caches))),
                         ("mtp", lambda: model.mtp_logits(0, model.mtp_forward(
                             0, ids, torch.zeros(1, model.config.hidden_size, device="cuda",
                                                 dtype=torch.bfloat16), meta, pool.caches)).argmax(-1))):
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            names = collections.Counter(e.name for e in prof.events() if e.device_type.name == "CUDA")
            out[name] = {"kernels": sum(names.values()), "top": names.most_common(12)}
    for m in model.modules():
        if isinstance(m, MoE):
            m.sync_free = False
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    res = {}
    llm = LLM(ASSETS, device="cuda", max_num_seqs=1)
    res["none"] = {"step_us": step_wall_us(llm), "graphs": graphs_of(llm)}
    res["kernels"] = kernel_counts(llm)
    print("none", res["none"], {k: v["kernels"] for k, v in res["kernels"].items()}, flush=True)
    del llm
    for k in (1, 2, 3, 4):
        for one_graph in (True, False):
            llm = LLM(ASSETS, device="cuda", max_num_seqs=1, speculative="mtp", num_speculative_tokens=k)
            if not one_graph:
                llm.engine.runner.graphed_spec = None
            r = {"step_us": step_wall_us(llm), "graphs": graphs_of(llm),
                 "acc": llm.engine.spec_stats.mean_acceptance_length}
            res[f"mtp{k}" + ("" if one_graph else "_two_graphs")] = r
            print(f"mtp k={k} one_graph={one_graph}", json.dumps(r), flush=True)
            del llm
    with open(os.path.join(args.out, "profile_spec_step.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
