"""Pipelined decode steps (`LLMEngine.pipeline_decode`): the next decode step is launched before this one's
tokens reach the host. On CPU the graphed decoder's static-buffer path runs eagerly, so the same code runs here;
every test compares with the engine stepping one step after the other, operation for operation."""

from __future__ import annotations

import random

import pytest
import torch

from specmla import LLM, SamplingParams
from specmla.engine import engine as engine_module
from specmla.engine.cuda_graphs import GraphedDecoder


@pytest.fixture(autouse=True)
def _restore_index(monkeypatch):
    monkeypatch.setattr(engine_module, "_index", engine_module._index)


def _prompts(lengths, seed=0, vocab=250):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


class _OneBufferDecoder(GraphedDecoder):
    """The static-buffer decoder with CUDA graphs' output semantics on CPU: one output buffer per padded size,
    overwritten by every replay of that size."""

    def _replay(self, b):
        hidden, logits = super()._replay(b)
        bufs = self.__dict__.setdefault("_bufs", {})
        if b not in bufs:
            bufs[b] = (torch.empty_like(hidden), torch.empty_like(logits))
        bufs[b][0].copy_(hidden)
        bufs[b][1].copy_(logits)
        return bufs[b]


def _llm(tiny_model_dir, pipeline: bool, max_num_seqs: int = 8, num_pages: int = 256, **kw):
    llm = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=num_pages, max_num_seqs=max_num_seqs,
              pipeline_decode=pipeline, **kw)
    llm.engine.runner.graphed = _OneBufferDecoder(llm.model, llm.kv_pool, max_num_seqs, 64, use_graphs=False)
    return llm


class _Count:
    """Counts the runner's ahead launches, the ones the engine took, and the plain graphed decode steps."""

    def __init__(self, llm):
        runner = llm.engine.runner
        self.launched = self.taken = self.plain = self.subsets = 0
        index = engine_module._index

        def subset(*a):
            self.subsets += 1
            return index(*a)

        engine_module._index = subset  # restored by the autouse fixture below
        ahead, commit, plain = runner.decode_ahead, runner.commit_ahead, runner._graphed_decode

        def launched(*a):
            self.launched += 1
            return ahead(*a)

        def taken(*a):
            self.taken += 1
            return commit(*a)

        def run_plain(*a):
            self.plain += 1
            return plain(*a)

        runner.decode_ahead, runner.commit_ahead, runner._graphed_decode = launched, taken, run_plain


def _run_ops(llm, ops):
    """Apply ("add", prompt, params) / ("abort", index) / ("step", n) in order; the outputs of every request."""
    eng, seqs = llm.engine, []
    for op in ops:
        if op[0] == "add":
            seqs.append(eng.add_request(op[1], op[2]))
        elif op[0] == "abort":
            eng.abort(seqs[op[1]])
        else:
            for _ in range(op[1]):
                if eng.has_unfinished():
                    eng.step()
    while eng.has_unfinished():
        eng.step()
    return [(s.output_ids, s.finish_reason) for s in seqs]


def test_pipelined_greedy_equals_stepwise_and_takes_the_steps_launched_ahead(tiny_model_dir):
    prompts = _prompts([5, 13, 2, 9, 21])
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 3, 17, 1, 8)]
    want = _llm(tiny_model_dir, False).generate(prompts, params)
    llm = _llm(tiny_model_dir, True)
    count = _Count(llm)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == ["length"] * 5
    # requests ending by length are never launched ahead, so every launch is taken here, and every decode step
    # was launched ahead (the first one by the prefill step)
    assert count.launched > 10 and count.taken == count.launched and count.plain == 0
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages


def test_pipelined_eos_the_host_has_not_seen_drops_the_extra_token(tiny_model_dir):
    prompts = _prompts([6, 11, 4], seed=3)
    free = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ref = _llm(tiny_model_dir, False).generate(prompts, free)
    # request 1 ends on a token it first makes in a decode step; the others end where that token comes up
    eos = next(t for i, t in enumerate(ref[1].token_ids) if i >= 3 and ref[1].token_ids.index(t) == i)
    params = SamplingParams(max_tokens=20, temperature=0)
    outs = {}
    for pipeline in (False, True):
        llm = _llm(tiny_model_dir, pipeline)
        llm.engine.eos_ids = {eos}
        count = _Count(llm)
        outs[pipeline] = llm.generate(prompts, params)
        assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages
    # the step launched with request 1 still in it (its EOS unseen) was taken for the two others, rows gathered
    assert count.taken > 0 and count.subsets > 0
    for a, b, r in zip(outs[True], outs[False], ref):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        cut = r.token_ids.index(eos) + 1 if eos in r.token_ids else len(r.token_ids)
        assert a.token_ids == r.token_ids[:cut]
    assert outs[True][1].finish_reason == "stop" and outs[True][1].token_ids[-1] == eos


def test_pipelined_with_arrivals_aborts_and_stop_strings_equals_stepwise(tiny_model_dir):
    p = _prompts([7, 3, 15, 5, 9], seed=5)
    g = lambda n, **k: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **k)  # noqa: E731
    ref = _llm(tiny_model_dir, False).generate([p[2]], g(12))[0].text
    ops = [("add", p[0], g(14)), ("add", p[1], g(9)), ("step", 4),
           ("add", p[2], g(12, stop=[ref[5:7]] if len(ref) >= 7 else None)), ("step", 3),
           ("abort", 1), ("step", 2), ("add", p[3], g(6)), ("step", 1), ("add", p[4], g(10)), ("abort", 3),
           ("step", 5)]
    want = _run_ops(_llm(tiny_model_dir, False), ops)
    llm = _llm(tiny_model_dir, True)
    count = _Count(llm)
    assert _run_ops(llm, ops) == want
    # arrivals' prefill steps take the decodes launched ahead too, and launch their new requests' first decode
    assert count.taken > 10 and count.plain == 0, (count.taken, count.launched, count.plain)
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages


def test_pipelined_under_page_pressure_equals_stepwise(tiny_model_dir):
    """A small pool: preemptions, launches skipped for want of pages; the same tokens."""
    prompts = _prompts([10, 14, 9, 12], seed=7)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = _llm(tiny_model_dir, False, num_pages=24).generate(prompts, params)
    llm = _llm(tiny_model_dir, True, num_pages=24)
    count = _Count(llm)
    got = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0 and count.taken > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages


def test_pipelined_seeded_sampling_equals_stepwise(tiny_model_dir):
    """The step launched ahead samples with the step counter its request will have: the same random stream."""
    prompts = _prompts([5, 8, 3], seed=9)
    params = [SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=1.2, top_k=20, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)]
    want = _llm(tiny_model_dir, False).generate(prompts, params)
    llm = _llm(tiny_model_dir, True)
    count = _Count(llm)
    got = llm.generate(prompts, params)
    assert count.taken > 5
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_logprob_requests_step_one_after_the_other(tiny_model_dir):
    prompts = _prompts([5, 8], seed=9)
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)]
    want = _llm(tiny_model_dir, False).generate(prompts, params)
    llm = _llm(tiny_model_dir, True)
    count = _Count(llm)
    got = llm.generate(prompts, params)
    assert count.launched == 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want] and got[0].logprobs


def test_pipelined_step_failure_is_retried_alone_like_stepwise(tiny_model_dir):
    """A request that fails inside a pipelined step ends with an error; the others go on as without it."""
    prompts = _prompts([6, 9, 4], seed=11)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = {}
    for pipeline in (False, True):
        llm = _llm(tiny_model_dir, pipeline)
        bad = {}

        count = _Count(llm)

        def hook(seqs):
            victim = bad.get("seq")
            if victim is not None and victim in seqs and len(victim.output_ids) == 4:
                bad["taken_before"] = count.taken
                raise RuntimeError("injected")

        llm.engine.fault_hook = hook
        seqs = [llm.engine.add_request(p, params) for p in prompts]
        bad["seq"] = seqs[1]
        while llm.engine.has_unfinished():
            llm.engine.step()
        outs[pipeline] = [(s.output_ids, s.finish_reason) for s in seqs]
        assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages
    assert bad["taken_before"] > 0  # pipelined: the failing step had taken a step launched ahead
    assert outs[True] == outs[False]
    assert outs[True][1][1] == "error" and outs[True][0][1] == outs[True][2][1] == "length"


def test_pipelined_at_the_context_limit_and_under_a_small_token_budget_equals_stepwise(tiny_model_dir):
    """Requests that reach max_model_len are never launched past it; a token budget below the number of decodes
    leaves some requests out of a step."""
    prompts = _prompts([20, 26, 9, 14, 23], seed=13)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for kw in (dict(max_model_len=32), dict(max_num_batched_tokens=3)):
        want = _llm(tiny_model_dir, False, **kw).generate(prompts, params)
        llm = _llm(tiny_model_dir, True, **kw)
        count = _Count(llm)
        got = llm.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        assert count.taken > 0
        if "max_model_len" in kw:
            assert all(len(p) + len(o.token_ids) == 32 for p, o in zip(prompts, got))
            assert count.launched == count.taken  # none launched for a request its token ends by length
        assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages


@pytest.mark.gpu
def test_gpu_pipelined_graph_steps_equal_stepwise():
    """With CUDA graphs: greedy and seeded requests, some ending on an EOS the host has not seen, the same tokens
    pipelined and stepwise (fp32: the ahead batches can pad to other sizes than the stepwise ones)."""
    prompts = _prompts([5, 13, 2, 9, 21, 30, 7], seed=1)
    params = [SamplingParams(max_tokens=n, temperature=t, seed=3, ignore_eos=True)
              for n, t in zip((40, 3, 25, 1, 33, 12, 40), (0, 0, 0.7, 0, 1.0, 0, 0))]
    outs, eos = {}, None
    for pipeline in (False, True):
        llm = LLM(None, device="cuda", dtype="float32", max_num_seqs=8, pipeline_decode=pipeline,
                  gpu_memory_utilization=0.3)
        assert llm.engine.runner.graphed is not None and llm.engine.runner.graphed.use_graphs
        count = _Count(llm)
        outs[pipeline] = [o.token_ids for o in llm.generate(prompts, params)]
        if eos is None:
            eos = outs[pipeline][0][7]
        llm.engine.eos_ids = {eos}
        stop = [SamplingParams(max_tokens=40, temperature=0) for _ in prompts]
        outs[pipeline].append([o.token_ids for o in llm.generate(prompts, stop)])
        if pipeline:
            assert count.taken > 20
        assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages
    assert outs[True] == outs[False]


@pytest.mark.gpu
def test_gpu_launch_ahead_does_not_wait_for_the_gpu():
    """With ~10 ms of GPU work queued before it, launching the next step returns in far less: nothing on its path
    (uploads, the device-fed ids, sampling tensors, the graph launch) waits for the device's queued work."""
    import statistics
    import time

    llm = LLM(None, device="cuda", dtype="float32", max_num_seqs=8, gpu_memory_utilization=0.3)
    eng, times = llm.engine, []
    launch = eng._launch_ahead

    def timed(seqs, tokens):
        torch.cuda._sleep(20_000_000)  # clock cycles: about 10 ms
        t0 = time.perf_counter()
        out = launch(seqs, tokens)
        times.append(time.perf_counter() - t0)
        return out

    eng._launch_ahead = timed
    params = [SamplingParams(max_tokens=30, temperature=t, seed=1, ignore_eos=True) for t in (0, 0.8, 0, 1.0)]
    llm.generate(_prompts([5, 9, 3, 7], seed=2), params)
    assert len(times) > 20
    assert statistics.median(times[8:]) < 4e-3, times  # the first launches capture graphs (they synchronise)
    # an arrival's prefill metadata (built beside the decodes launched ahead) does not wait either
    seq = eng.add_request(_prompts([40], seed=3)[0], SamplingParams(max_tokens=2))
    eng.pool.allocate(seq.seq_id, 40)
    eng.runner.build_metadata([seq], [40])  # warm (pinned memory pool)
    torch.cuda._sleep(20_000_000)
    t0 = time.perf_counter()
    eng.runner.build_metadata([seq], [40])
    assert time.perf_counter() - t0 < 4e-3
    torch.cuda.synchronize()
    eng.abort(seq)


def _random_ops(seed: int) -> list:
    """A random schedule: requests (shared or fresh prompts, greedy or sampled, some with logprobs or a stop
    string, some ending on EOS) added, aborted and stepped in between."""
    r = random.Random(seed)
    base = [r.randrange(250) for _ in range(12)]
    ops, n = [], 0
    for _ in range(r.randrange(6, 14)):
        k = r.random()
        if k < 0.45:
            length = r.randrange(1, 14)
            prompt = base[:length] if r.random() < 0.5 else [r.randrange(250) for _ in range(length)]
            p = dict(max_tokens=r.randrange(1, 30), temperature=r.choice([0, 0, 0.9]), seed=r.randrange(100),
                     ignore_eos=r.random() < 0.5)
            if r.random() < 0.2:
                p["logprobs"] = 0
            if r.random() < 0.3:
                p["stop"] = [chr(r.randrange(33, 127))]
            ops.append(("add", prompt, SamplingParams(**p)))
            n += 1
        elif k < 0.6 and n:
            ops.append(("abort", r.randrange(n)))
        else:
            ops.append(("step", r.randrange(1, 5)))
    return ops


def test_pipelined_random_schedules_equal_stepwise(tiny_model_dir):
    """40 random schedules on a 14-page pool with a 40-token context and an 8-token budget (chunked prompts,
    preemptions, prefix hits, failures injected in odd seeds): the same tokens and finish reasons pipelined and
    stepwise."""
    engines = {p: _llm(tiny_model_dir, p, max_num_seqs=6, num_pages=14, max_model_len=40, max_num_batched_tokens=8)
               for p in (False, True)}
    count = _Count(engines[True])
    for seed in range(40):
        ops = _random_ops(seed)
        outs = {}
        for pipeline, llm in engines.items():
            faults = random.Random(seed)

            def hook(seqs, faults=faults, on=seed % 2 == 1):
                if on and seqs and faults.random() < 0.05 and len(seqs[0].output_ids) % 3 == 1:
                    raise RuntimeError("injected")

            llm.engine.fault_hook = hook
            llm.engine.eos_ids = {random.Random(seed).randrange(250) for _ in range(8)}
            outs[pipeline] = _run_ops(llm, ops)
            assert llm.kv_pool.num_free_pages() == llm.kv_pool.num_pages
        assert outs[True] == outs[False], seed
    assert count.taken > 300 and engines[True].engine.scheduler.num_preemptions > 0
    assert engines[True].engine.num_failed_steps > 0


@pytest.mark.parametrize("pipeline", [False, True])
def test_one_token_prompt_chunk_beside_decodes_keeps_their_logits(tiny_model_dir, pipeline):
    """A prompt whose last chunk is one token (a budget of 8: the running decode and 7 prompt tokens, then the
    decode and the 8th) goes through the decode graph of the decodes' padded size in the same step: with graph
    outputs reused per size, the decodes still get their own tokens (the same as without graphs)."""
    prompts = _prompts([5, 8], seed=21)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=256, max_num_seqs=8,
               max_num_batched_tokens=8).generate(prompts, params)
    llm = LLM(tiny_model_dir, device="cpu", page_size=4, num_pages=256, max_num_seqs=8, max_num_batched_tokens=8,
              pipeline_decode=pipeline)
    llm.engine.runner.graphed = _OneBufferDecoder(llm.model, llm.kv_pool, 8, 64, use_graphs=False)
    eng, seqs = llm.engine, []
    seqs.append(eng.add_request(prompts[0], params))
    for _ in range(3):
        eng.step()
    seqs += [eng.add_request(p, params) for p in prompts[1:]]
    while eng.has_unfinished():
        eng.step()
    assert [s.output_ids for s in seqs] == [o.token_ids for o in want]
