"""Where the wall time of a B=1 engine step goes, no-spec against greedy MTP (issue 6): each part of
the step timed on the host (schedule, input building, replay + wait, acceptance and bookkeeping).

The graph's own GPU time is known (profile_spec_step.py); what a B=1 step adds to it is host work,
and only host work that speculation adds per step, or per token, lowers its speedup.

    PYTHONPATH=.:benchmarks python3 benchmarks/spec_host_probe.py --k 4 [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import time

import torch

from specmla import LLM, SamplingParams
from specmla.bench import load_prompts
from specmla.engine import cuda_graphs, engine, runner, scheduler, spec_graph

TIMED = [  # (owner, method, label): nested labels count inside their parents too
    (engine.LLMEngine, "step", "step"),
    (scheduler.Scheduler, "schedule", "schedule"),
    (runner.ModelRunner, "forward_logits", "forward (none)"),
    (runner.ModelRunner, "greedy_mtp_step", "spec step (inputs + replay)"),
    (spec_graph.GraphedSpecStep, "load", "spec: load inputs"),
    (cuda_graphs.GraphedDecoder, "load", "none: load inputs"),
    (cuda_graphs.BatchGraphs, "_replay", "replay launch"),
    (engine.LLMEngine, "_sample_and_append", "sample + append (none)"),
    (engine.LLMEngine, "_accept", "accept + append (spec)"),
]


def instrument(totals: dict, counts: dict) -> None:
    """Wrap each TIMED method with a timer. Engine steps that prefill (once per request, eager) are
    counted apart (labels marked [prefill steps]): the rest is decode steps alone."""
    last = {}
    sched = scheduler.Scheduler.schedule

    def schedule(self, *a, **kw):
        batch = sched(self, *a, **kw)
        last["prefill"] = bool(batch.prefill)
        return batch

    scheduler.Scheduler.schedule = schedule
    for owner, name, label in TIMED:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*a, _fn=fn, _label=label, **kw):
            t = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                if last.get("prefill") and _label != "schedule":  # set by this step's schedule()
                    _label += " [prefill steps]"
                totals[_label] += time.perf_counter() - t
                counts[_label] += 1

        setattr(owner, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="data/bench/code_complete.jsonl")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    totals, counts = collections.defaultdict(float), collections.defaultdict(int)
    instrument(totals, counts)
    gc_started = {}

    def gc_timer(phase, info):  # Python's cyclic collector pauses the host too: count it as a part
        if phase == "start":
            gc_started["t"] = time.perf_counter()
        elif "t" in gc_started:
            label = f"gc, generation {info['generation']}"
            totals[label] += time.perf_counter() - gc_started.pop("t")
            counts[label] += 1

    gc.callbacks.append(gc_timer)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    report = {}
    for mode in (None, "mtp"):
        llm = LLM(max_num_seqs=1, speculative=mode, num_speculative_tokens=args.k)
        prompts = load_prompts(args.dataset, args.num_prompts, 0, llm.model.config.vocab_size, 0)
        llm.generate(prompts[:4], params)  # warm-up: kernels, graphs
        totals.clear(), counts.clear()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t
        tokens = sum(len(o.token_ids) for o in outs)
        steps = counts["step"]  # decode steps; the parts below are averaged over them
        name = f"mtp k={args.k}" if mode else "none"
        report[name] = {"wall_s": wall, "tokens": tokens, "steps": steps,
                        "us_per_step": {k: 1e6 * v / steps for k, v in totals.items()},
                        "calls": dict(counts)}
        decode_tokens = tokens - len(outs)  # each request's first token comes from its prefill step
        print(f"{name}: {tokens / wall:.0f} tok/s, {steps} decode steps, {decode_tokens / steps:.2f} tokens/step, "
              f"{1e6 * totals['step'] / steps:.0f} µs/decode step, "
              f"{1e6 * totals['step [prefill steps]'] / max(1, counts['step [prefill steps]']):.0f} µs/prefill step")
        for label, v in sorted(totals.items(), key=lambda kv: -kv[1]):
            print(f"  {label:<30} {1e6 * v / steps:8.1f} µs/step  ({counts[label]} calls)")
        del llm
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
