"""Warm-up: every kernel compiled and every CUDA graph captured before the engine takes its first request.

What a step can reach is fixed when the engine is built: the decode, verify, MTP-draft and whole-step graphs at each
padded batch size (`graph_batch_sizes(max_num_seqs)`), the prefill pieces at each token bucket
(`prefill_buckets(max_num_batched_tokens)`), and, between the prefill pieces, eager work whose kernels specialise
on nothing a step changes: the MHA-form attention (ragged or not), the up-projection of a cached context (kv_b_proj,
always in the model dtype: cuBLAS), the MTP head's norm, the n-gram proposer, sampling (torch). So the warm-up

1. captures every graph of `plan`, largest size first (the smaller ones' intermediates reuse its blocks);
2. runs `request_groups` through the engine: one step filling the token budget, ragged prompts (one of a single
   token) with a cached prefix, and max_num_seqs requests at once, greedy and then sampled with logprobs, which
   drive the eager kernels through the engine's own code paths;
3. runs `profile_step`: one prompt chunk of the token budget attending to a context of max_model_len keys, the
   largest eager activation a single request can cause.

`LLM` measures the memory the graphs and the activations take on a small KV pool first (`measure`), sizes the pool
from what is left, builds the engine again on it and captures the graphs again; then it arms `compile_guard`.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import random
import time

import torch
from tqdm import tqdm

from specmla.engine import compile_guard
from specmla.engine.cuda_graphs import GraphedDecoder
from specmla.engine.engine import LLMEngine
from specmla.engine.mtp_graph import GraphedMtpDrafter
from specmla.engine.prefill_graphs import PiecewisePrefill
from specmla.engine.spec_graph import GraphedSpecStep
from specmla.model.metadata import AttentionMetadata
from specmla.ops.timing import synchronize
from specmla.sampling_params import SamplingParams

log = logging.getLogger("specmla.engine")

BATCH_HOLDERS = ("graphed", "graphed_verify", "graphed_mtp", "graphed_spec")  # the runner's per-batch graph holders
GIB = float(1 << 30)


@dataclasses.dataclass(frozen=True)
class Capture:
    """One graph (or set of prefill pieces) to capture: the runner attribute that holds it and its padded size."""

    holder: str
    size: int


def attach_graphs(engine: LLMEngine, use_graphs: bool = True) -> None:
    """Give the engine's runner its graph holders: decode (or, with speculation, verify at S = 1 + k, the MTP
    catch-up + drafts and the whole greedy MTP step) at each padded batch size up to max_num_seqs, and the prefill
    pieces at each bucket up to the token budget. Their page tables hold max_model_len tokens plus twice the
    speculative lookahead (a step near the end of the context writes its drafts' rows past it), so every step of
    a request stays on the graphs. use_graphs=False: the same static-buffer code, eager (CPU)."""
    runner, pool, model, proposer = engine.runner, engine.pool, engine.model, engine.proposer
    seqs = engine.scheduler.max_num_seqs
    P = -(-(engine.max_model_len + 2 * engine.scheduler.lookahead) // pool.page_size)
    runner.prefill_graphs = PiecewisePrefill(model, pool, engine.scheduler.max_num_batched_tokens, use_graphs)
    if proposer is None or engine.policy is not None:  # the `auto` draft length decodes plainly too
        runner.graphed = GraphedDecoder(model, pool, seqs, P, use_graphs)
    if proposer is None:
        return
    # every decode step is a verify step with S = 1 + k query tokens
    runner.graphed_verify = GraphedDecoder(model, pool, seqs, P, use_graphs, query_len=1 + proposer.k)
    if proposer.uses_mtp:  # the MTP catch-up + k drafts after each verify step: one more replay
        runner.graphed_mtp = GraphedMtpDrafter(model, pool, seqs, P, proposer.k, use_graphs,
                                               num_draft=proposer.num_mtp_drafts)
    if proposer.whole_step_graph:  # greedy batches: the whole step in one replay
        runner.graphed_spec = GraphedSpecStep(model, pool, seqs, P, proposer.k, use_graphs)


def plan(engine: LLMEngine) -> list[Capture]:
    """Every graph the engine's steps can replay: each holder's every padded size, largest first."""
    runner = engine.runner
    out = []
    for name in BATCH_HOLDERS + ("prefill_graphs",):
        graphs = getattr(runner, name)
        if graphs is not None:
            out += [Capture(name, b) for b in sorted(graphs.sizes, reverse=True)]
    return out


NEW_TOKENS = 3  # tokens each warm-up request generates


def request_groups(vocab: int, budget: int, max_num_seqs: int, page_size: int, longest: int, seed: int = 0
                   ) -> list[list[tuple[list[int], SamplingParams]]]:
    """Synthetic requests (token ids, params) run one group after the other: (a) prompts filling the token budget
    `budget` in one step (each at most `longest` tokens), greedy; (b) a prompt sharing the first's leading pages (a
    cached prefix) beside ragged prompts of odd lengths and one of a single token, greedy, sampled and with
    logprobs; (c) max_num_seqs short prompts at once, greedy; (d) the same, sampled (top-k, top-p), half with
    logprobs. Random tokens, so no prefix is shared with a user's prompt; ignore_eos, so every request runs its
    NEW_TOKENS; `longest` must leave room for them within the context."""
    rng = random.Random(seed)
    longest = max(1, longest)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    new = NEW_TOKENS
    greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=new, temperature=0.8, top_k=40, top_p=0.9, seed=seed, ignore_eos=True)
    with_lp = SamplingParams(max_tokens=new, temperature=0.0, logprobs=2, ignore_eos=True)
    sampled_lp = SamplingParams(max_tokens=new, temperature=0.7, top_p=0.95, seed=seed + 1, logprobs=3,
                                ignore_eos=True)
    lens, left = [], budget
    while left > 0 and len(lens) < max_num_seqs:
        lens.append(min(longest, left))
        left -= lens[-1]
    fill = [tokens(n) for n in lens]
    groups = [[(p, greedy) for p in fill]]
    shared = fill[0][: (len(fill[0]) - 1) // page_size * page_size]  # the first prompt's full leading pages
    ragged = [shared + tokens(min(5, longest - len(shared)))] if shared and len(shared) < longest else []
    ragged += [tokens(n) for n in (min(37, longest), 1, min(page_size + 3, longest))]
    groups.append(list(zip(ragged, [greedy, sampled, with_lp, greedy])))
    short = [tokens(min(longest, 2 + i % 7)) for i in range(max_num_seqs)]
    groups.append([(p, greedy) for p in short])
    groups.append([(p, sampled if i % 2 else sampled_lp) for i, p in enumerate(short)])
    return groups


def engine_groups(engine: LLMEngine) -> list:
    """`request_groups` for this engine's model and limits (prompts as long as its pool and context hold)."""
    sched = engine.scheduler
    return request_groups(engine.model.config.vocab_size, sched.max_num_batched_tokens, sched.max_num_seqs,
                          engine.pool.page_size, engine.max_total_tokens - NEW_TOKENS - sched.lookahead - 1)


def pages_needed(groups, page_size: int, lookahead: int) -> int:
    """KV pages for the largest group to run at once (prompt, new tokens and the speculative lookahead twice, and one
    page of slack, each)."""
    return max(sum(-(-(len(p) + sp.max_tokens + 2 * lookahead + 1) // page_size) + 1 for p, sp in g) for g in groups)


def run_groups(engine: LLMEngine, groups, bar=None) -> None:
    for group in groups:
        seqs = [engine.add_request(p, sp) for p, sp in group]
        while engine.has_unfinished():
            engine.step()
        bad = [s.error for s in seqs if s.finish_reason == "error"]
        if bad:
            raise RuntimeError(f"a warm-up request failed: {bad[0]}")
        if bar is not None:
            bar.update()


@torch.inference_mode()
def profile_step(engine: LLMEngine) -> None:
    """One synthetic prompt chunk of min(budget, max_model_len) tokens at the end of a max_model_len context (the
    context rows read from the scratch page, the chunk's rows written there): the largest eager activation one
    request's chunk can cause (its context gathered and up-projected for the MHA form). Needs prefill graphs."""
    runner, pool = engine.runner, engine.pool
    pieces = runner.prefill_graphs
    L = engine.max_model_len
    T = min(engine.scheduler.max_num_batched_tokens, L, pieces.sizes[-1])
    dev, ps = pool.device, pool.page_size
    scratch = torch.arange(pool.scratch_page * ps, (pool.scratch_page + 1) * ps, device=dev)
    ids = [random.Random(1).randrange(engine.model.config.vocab_size) for _ in range(T)]
    positions = list(range(L - T, L))
    slots = scratch.repeat(-(-T // ps))[:T]
    ctx = scratch.repeat(-(-L // ps))[:L]
    i32 = dict(dtype=torch.int32, device=dev)
    meta = AttentionMetadata(
        positions=torch.tensor(positions, device=dev), cu_seqlens_q=torch.tensor([0, T], **i32),
        seq_lens=torch.tensor([L], **i32), max_seqlen_q=T, max_seqlen_kv=L, slot_mapping=slots,
        context_slots=ctx, cu_seqlens_kv=torch.tensor([0, L], **i32), kv_format=pool.kv_format)
    hidden = pieces.forward(ids, positions, slots.tolist(), meta)
    engine.model.compute_logits(hidden[-1:])


@dataclasses.dataclass
class WarmupReport:
    seconds: float = 0.0
    graphs: int = 0
    graph_bytes: int = 0  # device memory the captures took (graph pools, static outputs, loaded kernels)
    activation_bytes: int = 0  # what the eager work added on top (the allocator keeps its peak)

    def line(self) -> str:
        return (f"warm-up: graphs captured at {self.graphs} sizes and kernels compiled in {self.seconds:.1f} s; "
                f"graphs {self.graph_bytes / GIB:.2f} GiB, activations {self.activation_bytes / GIB:.2f} GiB")


def _free(device) -> int:
    """Free device memory once queued work is done (0 off CUDA: nothing to measure)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]


@torch.inference_mode()
def warm_up(engine: LLMEngine, groups: list | None = None, progress: bool | None = None) -> WarmupReport:
    """Compile and capture everything `plan` reaches, and with `groups` (`request_groups`; they must fit the pool)
    what those requests and `profile_step` reach, on the engine's own pool (its prefix cache and counters are reset
    afterwards). progress None: a bar on a terminal only."""
    start = time.perf_counter()
    dev = engine.pool.device
    items = plan(engine)
    groups = groups or []
    report = WarmupReport(graphs=len(items))
    bar = tqdm(total=len(items) + len(groups) + (1 if groups else 0), desc="warming up (compile, capture graphs)",
               unit="step", disable=None if progress is None else not progress, leave=False)
    free0 = _free(dev)
    with compile_guard.warming():
        runner = engine.runner
        for item in items:
            graphs = getattr(runner, item.holder)
            if item.holder == "prefill_graphs":
                graphs.capture(item.size, mtp=engine.proposer is not None and engine.proposer.uses_mtp)
            else:
                graphs.capture(item.size)
            bar.update()
        free1 = _free(dev)
        if groups:
            run_groups(engine, groups, bar)
            profile_step(engine)
            bar.update()
            engine.forget_history()
        free2 = _free(dev)
        if engine.policy is not None and runner.graphed is not None and runner.graphed.use_graphs:
            measure_step_costs(engine)
    bar.close()
    report.seconds = time.perf_counter() - start
    report.graph_bytes, report.activation_bytes = max(0, free0 - free1), max(0, free1 - free2)
    return report


COST_STEPS = 6  # timed decode steps per side and padded size


@torch.inference_mode()
def measure_step_costs(engine: LLMEngine, steps: int = COST_STEPS, seed: int = 0) -> bool:
    """Give the `auto` draft length's policy the seconds a decode step takes, plain and speculative, at every padded
    batch size: that many greedy requests decode through the engine's own steps (host work, pipelining and the
    graphs as a user's requests meet them), each side forced in turn, and `steps` steady steps are timed after the
    first two. False (nothing measured) where the pool cannot hold the largest batch."""
    policy, pool, runner = engine.policy, engine.pool, engine.runner
    sizes = runner.graphed.sizes
    look = engine.scheduler.lookahead
    prompt_len, new = 8, steps + 4
    per_seq = -(-(prompt_len + new * (look + 1) + 2 * look + 1) // pool.page_size) + 1
    if per_seq * sizes[-1] > pool.num_free_pages():
        return False
    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    try:
        for b in sizes:
            for speculative in (False, True):
                policy.force = speculative
                seqs = [engine.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params)
                        for _ in range(b)]
                while any(s.num_cached < s.total_len - 1 for s in seqs):  # the prompts' prefill
                    engine.step()
                for _ in range(2):
                    engine.step()
                synchronize(pool.device)
                t0 = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                synchronize(pool.device)
                policy.seed(speculative, b, (time.perf_counter() - t0) / steps)
                while engine.has_unfinished():
                    engine.step()
    finally:
        policy.force = None
    engine.forget_history()
    return True


def measure(make_engine, device: torch.device, groups: list, page_size: int, lookahead: int,
            progress: bool | None = None) -> tuple[int, WarmupReport]:
    """Build an engine on a pool just large enough for `groups`, warm it up with them and return (the device bytes
    that took beyond the pool: graphs, activations, loaded kernels; the warm-up's report). The engine, its graphs
    and pool are released before returning; what stays loaded (kernels, the ops' scratch) is part of the bytes."""
    gc.collect()
    before = _free(device)
    engine = make_engine(pages_needed(groups, page_size, lookahead))
    pool_bytes = sum(c.numel() * c.element_size() for c in engine.pool.caches)
    report = warm_up(engine, groups, progress)
    used = before - _free(device) - pool_bytes  # the graph holders' static buffers count
    release(engine)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return max(0, used), report


def release(engine: LLMEngine) -> None:
    """Drop an engine's graphs (their memory pools go back to the allocator once nothing else holds them)."""
    runner = engine.runner
    for name in BATCH_HOLDERS + ("prefill_graphs",):
        setattr(runner, name, None)
