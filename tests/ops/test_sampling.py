"""Tests for specmla.ops.sampling: exactness against the per-row reference, seeding, masks, statistics."""

import pytest
import torch

from specmla.ops.sampling import (
    SamplingTensors,
    apply_top_k_top_p,
    sample,
    sample_reference,
    uniform_noise,
)


def _st(batch, temperature=1.0, top_k=0, top_p=1.0, seed=None, step=0):
    def full(x):
        return list(x) if isinstance(x, (list, tuple, range)) else [x] * batch

    seed = range(batch) if seed is None else seed
    return SamplingTensors.from_lists(full(temperature), full(top_k), full(top_p), full(seed), full(step), "cpu")


def _random_params(batch, vocab, gen):
    temperature = torch.rand(batch, generator=gen) * 1.5
    temperature[::3] = 0.0  # some greedy rows
    return SamplingTensors(
        temperature=temperature,
        top_k=torch.randint(-1, vocab + 5, (batch,), generator=gen),
        top_p=torch.where(torch.rand(batch, generator=gen) < 0.3, 1.0, torch.rand(batch, generator=gen).clamp_min(0.05)),
        seed=torch.randint(0, 2**31, (batch,), generator=gen),
        step=torch.randint(0, 100_000, (batch,), generator=gen),
    )


def _subset(st, rows):
    idx = torch.tensor(rows)
    return SamplingTensors(*(getattr(st, f)[idx] for f in ("temperature", "top_k", "top_p", "seed", "step")))


def test_uniform_noise_range_and_determinism():
    seed = torch.arange(64)
    u = uniform_noise(seed, torch.zeros(64, dtype=torch.long), 4096)
    assert u.dtype == torch.float32 and u.shape == (64, 4096)
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.std().item() - 12**-0.5) < 0.005
    assert torch.equal(u[5], uniform_noise(seed[5:6], torch.zeros(1, dtype=torch.long), 4096)[0])
    # adjacent seeds / steps are uncorrelated
    other = uniform_noise(seed, torch.ones(64, dtype=torch.long), 4096)
    assert abs(torch.corrcoef(torch.stack([u.flatten(), other.flatten()]))[0, 1].item()) < 0.01
    assert abs(torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1].item()) < 0.01
    # seed and step are hashed, not added: (s, t+1) differs from (s+1, t)
    a = uniform_noise(torch.tensor([3]), torch.tensor([8]), 64)
    b = uniform_noise(torch.tensor([4]), torch.tensor([7]), 64)
    assert not torch.equal(a, b)


def test_greedy_rows_are_argmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 257, generator=gen) * 4
    out = sample(logits, _st(9, temperature=0.0))
    assert torch.equal(out.tokens, logits.argmax(-1))
    assert (out.tokens != 0).any()
    # mixed batch: greedy rows still argmax, sampled rows match the reference
    st = _st(9, temperature=[0.0, 1.0, 1e-6, 0.8, 0.0, 2.0, 0.0, 1.0, 0.5])
    mixed = sample(logits, st).tokens
    greedy = torch.tensor([0, 2, 4, 6])
    assert torch.equal(mixed[greedy], logits.argmax(-1)[greedy])
    assert torch.equal(mixed, sample_reference(logits, st).tokens)


def test_matches_reference_exactly():
    gen = torch.Generator().manual_seed(1)
    for trial in range(30):
        batch, vocab = 7, 257 if trial % 2 else 1000
        logits = torch.randn(batch, vocab, generator=gen) * (1 + trial % 4)
        st = _random_params(batch, vocab, gen)
        got, ref = sample(logits, st, num_logprobs=3), sample_reference(logits, st, num_logprobs=3)
        assert torch.equal(got.tokens, ref.tokens), trial
        assert torch.equal(got.logprobs, ref.logprobs)
        assert torch.equal(got.top_token_ids, ref.top_token_ids)


def test_seed_independent_of_batch_composition():
    gen = torch.Generator().manual_seed(2)
    batch, vocab = 12, 300
    row_logits = torch.randn(vocab, generator=gen)
    logits = row_logits.expand(batch, vocab).contiguous()
    st = _random_params(batch, vocab, gen)
    st.temperature.fill_(1.0)
    full = sample(logits, st).tokens
    perm = torch.randperm(batch, generator=gen)[:5].tolist()
    part = sample(logits[:5], _subset(st, perm)).tokens
    assert torch.equal(part, full[perm])
    for r in range(batch):  # alone in the batch
        assert sample(logits[:1], _subset(st, [r])).tokens.item() == full[r].item()


def test_steps_give_different_draws():
    vocab, steps = 16, 4000
    logits = torch.zeros(steps, vocab)  # uniform distribution
    st = _st(steps, seed=[1234] * steps, step=range(steps))
    tokens = sample(logits, st).tokens
    freq = torch.bincount(tokens, minlength=vocab).float() / steps
    assert (freq - 1 / vocab).abs().max() < 0.02
    assert (tokens[1:] != tokens[:-1]).float().mean() > 0.85
    # the same (seed, step) always repeats
    assert torch.equal(tokens, sample(logits, st).tokens)


def test_top_k_one_and_tiny_top_p_are_argmax():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(32, 257, generator=gen) * 3
    assert torch.equal(sample(logits, _st(32, temperature=1.5, top_k=1)).tokens, logits.argmax(-1))
    assert torch.equal(sample(logits, _st(32, temperature=1.5, top_p=1e-6)).tokens, logits.argmax(-1))


def test_a_top_p_of_zero_keeps_the_top_token():
    """A top_p that became 0 (float32 underflow; the API refuses such values) still keeps each row's most likely
    token, so it samples argmax, never a masked-out token."""
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(16, 97, generator=gen) * 2
    masked = apply_top_k_top_p(logits, torch.zeros(16, dtype=torch.long), torch.zeros(16))
    assert torch.isfinite(masked).sum(-1).tolist() == [1] * 16
    assert torch.equal(masked.argmax(-1), logits.argmax(-1))
    assert torch.equal(sample(logits, _st(16, temperature=0.8, top_p=0.0)).tokens, logits.argmax(-1))


def test_top_k_mask_keeps_exactly_k():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 101, generator=gen)
    k = torch.tensor([1, 5, 50, 101, 0, -3])
    masked = apply_top_k_top_p(logits, k, torch.ones(6))
    kept = torch.isfinite(masked)
    assert kept.sum(-1).tolist() == [1, 5, 50, 101, 101, 101]
    for r, kr in enumerate([1, 5, 50]):
        assert set(kept[r].nonzero().flatten().tolist()) == set(logits[r].topk(kr).indices.tolist())
    assert torch.equal(masked[kept], logits[kept])


def test_top_p_keeps_minimal_nucleus():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().expand(4, 4)
    masked = apply_top_k_top_p(logits, torch.zeros(4, dtype=torch.long), torch.tensor([0.45, 0.75, 0.85, 1.0]))
    assert torch.isfinite(masked).tolist() == [
        [False, True, False, False],
        [False, True, False, True],
        [False, True, True, True],
        [True, True, True, True],
    ]
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(50, 64, generator=gen) * 2
    top_p = torch.rand(50, generator=gen).clamp_min(0.01)
    kept = torch.isfinite(apply_top_k_top_p(logits, torch.zeros(50, dtype=torch.long), top_p))
    for r in range(50):
        p_sorted = logits[r].double().softmax(-1).sort(descending=True).values
        cum = p_sorted.cumsum(0)
        n_min = int((cum < top_p[r].double()).sum()) + 1  # smallest prefix reaching top_p
        if (cum - top_p[r]).abs().min() > 1e-5:  # skip float-boundary cases
            assert int(kept[r].sum()) == n_min, r


def _empirical(logits_row, n, **kw):
    tokens = sample(logits_row.expand(n, -1).contiguous(), _st(n, **kw)).tokens
    return torch.bincount(tokens, minlength=logits_row.numel()).double() / n


def test_statistics_match_target_distributions():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(16, generator=gen) * 1.5
    n, tol = 20000, 0.02
    target = (logits.double() / 0.7).softmax(-1)
    assert (_empirical(logits, n, temperature=0.7) - target).abs().max() < tol

    top4 = torch.full_like(target, 0.0)
    idx = target.topk(4).indices
    top4[idx] = target[idx] / target[idx].sum()
    assert (_empirical(logits, n, temperature=0.7, top_k=4) - top4).abs().max() < tol

    order = target.argsort(descending=True)
    n_keep = int((target[order].cumsum(0) < 0.8).sum()) + 1
    nucleus = torch.zeros_like(target)
    nucleus[order[:n_keep]] = target[order[:n_keep]] / target[order[:n_keep]].sum()
    emp = _empirical(logits, n, temperature=0.7, top_p=0.8)
    assert (emp - nucleus).abs().max() < tol and emp[nucleus == 0].sum() == 0


def test_logprobs_and_top_logprobs():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 257, generator=gen) * 2
    out = sample(logits, _st(5, temperature=0.9, top_k=20, top_p=0.9), num_logprobs=4)
    ref = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.tokens[:, None]).squeeze(1))
    assert out.top_logprobs.shape == (5, 4) and out.top_token_ids.dtype == torch.int64
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    torch.testing.assert_close(out.top_logprobs, ref.gather(1, out.top_token_ids))
    assert torch.equal(out.top_token_ids, ref.topk(4).indices)
    plain = sample(logits, _st(5), num_logprobs=0)
    assert plain.top_logprobs is None and plain.top_token_ids is None
    assert plain.logprobs.dtype == torch.float32


def test_bf16_logits():
    gen = torch.Generator().manual_seed(8)
    logits = (torch.randn(7, 257, generator=gen) * 3).bfloat16()
    st = _st(7, temperature=[0.0, 1.0, 0.7, 0.0, 1.2, 0.5, 1.0], top_k=[0, 10, 0, 5, 50, 0, 3])
    out = sample(logits, st, num_logprobs=2)
    assert out.logprobs.dtype == torch.float32 and out.tokens.dtype == torch.int64
    assert torch.equal(out.tokens, sample(logits.float(), st).tokens)


def test_no_host_sync(monkeypatch):
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(7, 257, generator=gen)
    st = _random_params(7, 257, gen)
    expected = sample_reference(logits, st, num_logprobs=2).tokens

    def forbidden(*args, **kwargs):
        raise AssertionError("host sync inside sample()")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    out = sample(logits, st, num_logprobs=2)
    monkeypatch.undo()
    assert torch.equal(out.tokens, expected)


def test_bad_input_raises():
    st = _st(3)
    with pytest.raises(ValueError, match="2-D"):
        sample(torch.randn(10), st)
    with pytest.raises(ValueError, match="2-D"):
        sample(torch.randint(0, 5, (3, 10)), st)
    with pytest.raises(ValueError, match="temperature"):
        sample(torch.randn(4, 10), st)
    with pytest.raises(ValueError, match="num_logprobs"):
        sample(torch.randn(3, 10), st, num_logprobs=11)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_matches_eager():
    gen = torch.Generator().manual_seed(10)
    batch, vocab = 8, 32000
    logits = (torch.randn(batch, vocab, generator=gen) * 3).cuda()
    st = _random_params(batch, vocab, gen)
    st = SamplingTensors(*(getattr(st, f).cuda() for f in ("temperature", "top_k", "top_p", "seed", "step")))
    eager = sample(logits, st, num_logprobs=2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sample(logits, st, num_logprobs=2)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sample(logits, st, num_logprobs=2)
    graph.replay()
    assert torch.equal(captured.tokens, eager.tokens)
    st.step += 1  # new step in place: replay draws the step+1 tokens
    graph.replay()
    assert torch.equal(captured.tokens, sample(logits, st).tokens)
    assert torch.equal(captured.tokens.cpu(), sample_reference(logits.cpu(), _cpu(st)).tokens)


def _cpu(st):
    return SamplingTensors(*(getattr(st, f).cpu() for f in ("temperature", "top_k", "top_p", "seed", "step")))


def test_host_known_shortcuts_give_the_full_paths_answer():
    """all_greedy / filtering=False / with_logprobs=False skip work but never change a token."""
    torch.manual_seed(0)
    logits = torch.randn(6, 301) * 3
    greedy = SamplingTensors.from_lists([0.0] * 6, [0] * 6, [1.0] * 6, range(6), [3] * 6, "cpu")
    full = sample(logits, greedy)
    fast = sample(logits, greedy, all_greedy=True, filtering=False, with_logprobs=False)
    assert torch.equal(full.tokens, fast.tokens) and fast.logprobs is None
    plain = SamplingTensors.from_lists([0.8, 1.0, 0.0, 1.3, 0.5, 1.0], [0] * 6, [1.0] * 6, range(10, 16), [1] * 6,
                                       "cpu")
    full = sample(logits, plain)
    fast = sample(logits, plain, filtering=False)
    assert torch.equal(full.tokens, fast.tokens)
    assert torch.allclose(full.logprobs, fast.logprobs)
