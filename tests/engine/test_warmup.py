"""The warm-up (`engine.warmup`) and the late-compile guard (`engine.compile_guard`).

CPU: the warm-up's plan holds every padded size the scheduler can produce (a property test that drives the real
scheduler over random request streams); its request groups fit the pool it sizes for them and run through the
engine's own paths with graph holders attached (eager on CPU), leaving no trace (prefix cache, counters, later
outputs); the profile step writes only the scratch page; the n-gram kernel's block is fixed;
the guard raises, warns or stays quiet as its mode says. GPU (`-m gpu`): after `LLM()` returns, batch sizes
1…max_num_seqs in random order with contexts growing to max_model_len, speculation on and off, compile nothing and
capture nothing (the guard in "raise" mode)."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from specmla import LLM, SamplingParams
from specmla.engine import compile_guard, warmup
from specmla.engine.sequence import Sequence
from specmla.model.default import default_model_path


def _engine(model_dir, **kw):
    """An LLM on CPU with the graph holders a GPU engine gets, run eagerly (use_graphs=False)."""
    llm = LLM(model_dir, device="cpu", **kw)
    eng = llm.engine
    warmup.attach_graphs(eng, use_graphs=False)
    return llm, eng


def _step_shapes(eng, rng: random.Random, steps: int) -> tuple[set[int], set[int]]:
    """Drive the engine's scheduler over a random request stream without running the model (each scheduled chunk
    is taken as computed, each decode as one new token): the decode batch sizes and the prefill token counts its
    steps had."""
    sched, decodes, prefills = eng.scheduler, set(), set()
    for _ in range(steps):
        for _ in range(rng.choice([0, 0, 1, 3])):
            n = rng.randrange(1, max(2, eng.max_total_tokens // 2))
            sched.add(Sequence(prompt_ids=[rng.randrange(100) for _ in range(n)],
                               params=SamplingParams(max_tokens=rng.randrange(1, 40))))
        batch = sched.schedule()
        if batch.decode:
            decodes.add(len(batch.decode))
        if batch.prefill:
            prefills.add(sum(n for _, n in batch.prefill))
        for s in batch.decode:
            s.num_cached = s.total_len
            s.append_token(1)
        for s, n in batch.prefill:
            s.num_cached += n
            if s.num_cached == s.total_len:
                s.append_token(1)
        for s in list(sched.running):
            if len(s.output_ids) >= s.params.max_tokens or s.total_len >= eng.max_total_tokens:
                sched.remove(s)
    return decodes, prefills


@pytest.mark.parametrize("seed", range(6))
def test_plan_holds_every_padded_size_the_scheduler_produces(tiny_model_dir, seed):
    rng = random.Random(seed)
    spec = rng.choice([None, "ngram", "mtp"])
    kw = dict(max_num_seqs=rng.choice([1, 3, 8, 17, 40]), max_num_batched_tokens=rng.choice([16, 50, 256, 700]),
              page_size=rng.choice([16, 64]), num_pages=rng.choice([24, 200]))
    if spec:
        kw.update(speculative=spec, num_speculative_tokens=rng.randrange(1, 4))
    _, eng = _engine(tiny_model_dir, **kw)
    captures = set(warmup.plan(eng))
    decodes, prefills = _step_shapes(eng, rng, 300)
    assert decodes and prefills
    runner = eng.runner
    batch_holders = ["graphed"] if spec is None else ["graphed_verify"] + (["graphed_mtp", "graphed_spec"]
                                                                          if spec == "mtp" else [])
    for B in decodes:
        for h in batch_holders:
            b = getattr(runner, h).padded_size(B)
            assert b is not None and warmup.Capture(h, b) in captures, (h, B)
    for T in prefills:  # prefill pieces (and the MTP catch-up after them) at the step's token count
        b = runner.prefill_graphs.padded_size(T)
        assert b is not None and warmup.Capture("prefill_graphs", b) in captures, T
    assert len(captures) == len(warmup.plan(eng))  # each graph once


@pytest.mark.parametrize("kw", [{}, dict(speculative="mtp", num_speculative_tokens=2),
                                dict(speculative="ngram", num_speculative_tokens=3)], ids=["plain", "mtp", "ngram"])
def test_warm_up_requests_fit_their_pool_run_and_leave_no_trace(tiny_model_dir, kw):
    common = dict(max_num_seqs=5, max_num_batched_tokens=96, page_size=16, max_model_len=200, **kw)
    prompts = [[5, 7, 9, 11, 13] * 7, [3] * 20, [17, 2]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(tiny_model_dir, device="cpu", **common).generate(prompts, params)]

    groups = warmup.request_groups(259, 96, 5, 16, 200 - warmup.NEW_TOKENS - 3)
    pages = warmup.pages_needed(groups, 16, 2 if kw else 0)
    llm, eng = _engine(tiny_model_dir, num_pages=pages, **common)
    assert sum(n for n in (len(p) for p, _ in groups[0])) == 96  # the first group fills the token budget
    assert len(groups[0]) == 1 and len(groups[-1]) == 5  # ... in one prompt here; the last group: max_num_seqs
    assert any(len(p) == 1 for p, _ in groups[1])
    shared = groups[1][0][0]
    assert shared[:16] == groups[0][0][0][:16] and len(shared) > 16  # a cached prefix, then new tokens
    report = warmup.warm_up(eng, groups, progress=False)
    assert report.graphs == len(warmup.plan(eng))
    # no trace: an idle engine with an empty prefix cache and zeroed counters, and the same outputs as a fresh one
    assert not eng.has_unfinished() and eng.pool.num_free_pages() == pages
    assert not eng.pool._by_hash and eng.pool.prefix_hit_tokens == 0 == eng.pool.prefix_query_tokens
    assert not eng.failures and eng.num_failed_steps == 0 and eng.spec_stats.num_drafts == 0
    assert [o.token_ids for o in llm.generate(prompts, params)] == want


def test_warm_up_reports_a_prefix_hit_path(tiny_model_dir):
    """The second group's first prompt takes its leading page from the cache: the chunk after a cached prefix
    (the MHA form over the gathered context) is among the paths the warm-up runs."""
    _, eng = _engine(tiny_model_dir, max_num_seqs=4, max_num_batched_tokens=64, page_size=16, max_model_len=160,
                     num_pages=64)
    groups = warmup.engine_groups(eng)
    warmup.run_groups(eng, groups[:1])
    hits = eng.pool.prefix_hit_tokens
    warmup.run_groups(eng, groups[1:2])
    assert eng.pool.prefix_hit_tokens - hits >= 16


def test_profile_step_writes_only_the_scratch_page(tiny_model_dir):
    llm, eng = _engine(tiny_model_dir, max_num_seqs=2, max_num_batched_tokens=48, page_size=16, max_model_len=100,
                       num_pages=12)
    for c in eng.pool.caches:
        c.fill_(float("nan"))
    warmup.profile_step(eng)
    scratch = eng.pool.scratch_page
    for c in eng.pool.caches:
        assert torch.isnan(c[:scratch]).all()  # every request page untouched
    # the chunk's rows (48 tokens over the 16-slot page) went to the scratch page: layer 0's are finite (the later
    # layers' are NaN, having attended to the poisoned context the scratch page stood for)
    assert torch.isfinite(eng.pool.caches[0][scratch]).all()


def test_ngram_block_is_a_fixed_power_of_two():
    from specmla.ops.ngram import ngram_propose_triton

    tokens = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])
    lens = torch.tensor([8], dtype=torch.int32)
    with pytest.raises(ValueError, match="power of two"):
        ngram_propose_triton(tokens, lens, max_ngram=2, min_ngram=1, num_draft=2, block=48)
    for block in (16, 1024):  # the same drafts whatever the block (a compile-time constant, not the length)
        drafts, num = ngram_propose_triton(tokens, lens, max_ngram=2, min_ngram=1, num_draft=2, block=block)
        assert num.tolist() == [2] and drafts.tolist() == [[3, 1]]


# ---- the guard --------------------------------------------------------------------------------------------------
@pytest.fixture
def guard_off():
    previous = compile_guard.mode()
    compile_guard.arm("off")
    compile_guard.events.clear()
    yield
    compile_guard.arm(previous)


def test_guard_raises_in_strict_mode_but_not_while_warming(guard_off):
    with compile_guard.strict() as events:
        with compile_guard.warming():
            compile_guard.note("a capture")  # expected inside a warm-up
        assert events == []
        with pytest.raises(compile_guard.LateCompileError, match="a capture after warm-up"):
            compile_guard.note("a capture")
        assert events == ["a capture"]
    assert compile_guard.mode() == "off"
    compile_guard.note("ignored")  # off: nothing recorded
    assert compile_guard.events == ["a capture"]


def test_guard_warns_once_per_kind_and_counts_every_event(guard_off, caplog):
    compile_guard.arm("warn")
    with caplog.at_level(logging.WARNING, logger="specmla.engine"):
        compile_guard.note("x of k1", key="k1")
        compile_guard.note("y of k1", key="k1")
        compile_guard.note("z of k2", key="k2-unique-to-this-test")
    assert compile_guard.events == ["x of k1", "y of k1", "z of k2"]
    warned = [r.getMessage() for r in caplog.records if "after warm-up" in r.getMessage()]
    assert len(warned) <= 2 and any("z of k2" in m for m in warned)


def test_guard_counts_only_specmla_kernels(guard_off):
    class Fn:
        def __init__(self, module, name):
            self.module, self.__name__ = module, name

    class Src:
        def __init__(self, fn):
            self.fn = fn

    with compile_guard.strict() as events:
        compile_guard._on_triton_compile(Src(Fn("userpkg.kernels", "k")))
        assert events == []
        with pytest.raises(compile_guard.LateCompileError, match="_prefill_kernel"):
            compile_guard._on_triton_compile(Src(Fn("specmla.ops.prefill.triton", "_prefill_kernel")))


def test_guard_wraps_tritons_compile_for_bound_and_new_kernels(guard_off):
    """arm() installs the wrapper: Triton's package `compile` and every specmla kernel that bound it already."""
    import triton.compiler

    from specmla.ops import norm

    compile_guard.arm("off")
    wrapper = triton.compiler.compile
    assert wrapper.__name__ == "compile" and wrapper.__module__ == compile_guard.__name__
    if "compile" in vars(norm._rms_norm_kernel):  # bound by an earlier launch (compiled mode only)
        assert norm._rms_norm_kernel.compile is triton.compiler.compile


def test_guard_mode_is_checked(guard_off, monkeypatch):
    with pytest.raises(ValueError, match="guard mode"):
        compile_guard.arm("loud")
    monkeypatch.setenv(compile_guard.ENV, "sometimes")
    with pytest.raises(ValueError, match="SPECMLA_COMPILE_GUARD"):
        compile_guard.arm()
    monkeypatch.setenv(compile_guard.ENV, "RAISE")
    compile_guard.arm()
    assert compile_guard.mode() == "raise"


# ---- GPU --------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, dict(speculative="mtp", num_speculative_tokens=3),
                                dict(speculative="ngram", num_speculative_tokens=2), dict(kv_cache_dtype="fp8"),
                                dict(speculative="auto", num_speculative_tokens=3)],
                         ids=["plain", "mtp", "ngram", "fp8-kv", "auto"])
def test_gpu_nothing_compiles_or_captures_after_warm_up(kw):
    """Batch sizes 1..max_num_seqs in random order, prompts sharing cached prefixes, greedy / sampled / logprobs
    mixed, contexts growing to max_model_len: under the guard in "raise" mode nothing compiles or captures."""
    max_seqs, max_len = 20, 640
    llm = LLM(default_model_path(), device="cuda", max_num_seqs=max_seqs, max_model_len=max_len,
              max_num_batched_tokens=512, gpu_memory_utilization=0.3, **kw)
    st = llm.startup
    assert st["graphs"] == len(warmup.plan(llm.engine)) > 0 and st["kv_pages"] == llm.kv_pool.num_pages
    assert st["graph_bytes"] > 0 and st["reserved_bytes"] > 0
    policy = llm.engine.policy
    if kw.get("speculative") == "auto":  # both sides' step costs measured at every padded size, none guessed
        sizes = llm.engine.runner.graphed.sizes
        assert set(policy.costs) == {(spec, b) for spec in (True, False) for b in sizes}
        assert all(0 < t < 1 for t in policy.costs.values())
    rng = random.Random(0)
    vocab = llm.model.config.vocab_size
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randrange(64, 300))] for _ in range(4)]
    kinds = [SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=1, temperature=0.9, top_p=0.8, top_k=50, seed=3, ignore_eos=True),
             SamplingParams(max_tokens=1, temperature=0.0, logprobs=3, ignore_eos=True)]
    sizes = list(range(1, max_seqs + 1))
    rng.shuffle(sizes)
    with compile_guard.strict() as events:
        for i, B in enumerate(sizes):
            reach = 40 + (max_len - 60) * (i + 1) // len(sizes)  # the contexts grow towards max_model_len
            prompts, params = [], []
            for _ in range(B):
                n = rng.randrange(1, reach - 8)
                head = rng.choice(prefixes) if rng.random() < 0.4 else []
                prompts.append((head + [rng.randrange(vocab) for _ in range(n)])[:n])
                p = rng.choice(kinds)
                params.append(SamplingParams(**{**p.__dict__, "stop": None,
                                                "max_tokens": rng.randrange(1, max(2, reach - n))}))
            outs = llm.generate(prompts, params)
            assert all(o.finish_reason in ("length", "stop") for o in outs), [o.error for o in outs]
        outs = llm.generate([prefixes[0] + [1, 2, 3]], SamplingParams(max_tokens=max_len, ignore_eos=True))
        assert outs[0].finish_reason == "length"
        assert len(outs[0].prompt_token_ids) + len(outs[0].token_ids) == max_len
    assert events == []
    if policy is not None:
        print("auto: steps", dict(policy.steps))
    # the guard sees a compile on this Triton: a norm of a new width after warm-up
    from specmla.ops.norm import rms_norm

    with compile_guard.strict() as events, pytest.raises(compile_guard.LateCompileError, match="_rms_norm_kernel"):
        rms_norm(torch.randn(3, 72, device="cuda"), torch.ones(72, device="cuda"), 1e-6)
    assert len(events) == 1
