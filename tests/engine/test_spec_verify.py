"""Verification of drafts: greedy prefix acceptance and lossless rejection sampling."""

import pytest
import torch

from specmla.engine.spec import SpecStats, verify
from specmla.ops.sampling import SamplingTensors


def tensors(B, temperature, step=0, top_k=0, top_p=1.0, seed0=0):
    return SamplingTensors.from_lists([temperature] * B, [top_k] * B, [top_p] * B, range(seed0, seed0 + B),
                                      [step] * B, "cpu")


def test_greedy_accepts_the_matching_prefix_then_the_targets_token():
    V, k = 11, 3
    torch.manual_seed(0)
    logits = torch.randn(4, k + 1, V)
    am = logits.argmax(-1)
    drafts = torch.stack([
        am[0, :k],  # all match → 3 accepted + bonus
        torch.tensor([am[1, 0], (am[1, 1] + 1) % V, am[1, 2]]),  # mismatch at 1
        torch.tensor([(am[2, 0] + 1) % V, am[2, 1], am[2, 2]]),  # mismatch at 0
        am[3, :k],  # matches, but only 1 draft is real (padding is never accepted)
    ])
    num = torch.tensor([3, 3, 3, 1])
    tokens, emitted = verify(drafts, num, logits, tensors(4, 0.0), all_greedy=True)
    assert emitted.tolist() == [4, 2, 1, 2]
    assert tokens[0].tolist() == am[0].tolist()
    assert tokens[1, :2].tolist() == [am[1, 0].item(), am[1, 1].item()]
    assert tokens[2, 0].item() == am[2, 0].item()
    assert tokens[3, :2].tolist() == [am[3, 0].item(), am[3, 1].item()]
    same = verify(drafts, num, logits, tensors(4, 0.0))  # the general path agrees for greedy rows
    assert torch.equal(same[1], emitted)
    assert all(torch.equal(same[0][b, : emitted[b]], tokens[b, : emitted[b]]) for b in range(4))


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    return (((counts - expected) ** 2)[keep] / expected[keep]).sum().item()


def test_rejection_sampling_reproduces_the_target_distribution():
    """Many independent requests (one seed each) with a fixed bad draft: the emitted tokens follow
    the target, not the draft (χ² below the 0.1 % critical value)."""
    V, N = 6, 40000
    p0 = torch.tensor([0.05, 0.40, 0.10, 0.25, 0.15, 0.05])
    p1 = torch.tensor([0.30, 0.05, 0.05, 0.20, 0.10, 0.30])
    p2 = torch.tensor([0.10, 0.10, 0.50, 0.10, 0.10, 0.10])
    logits = torch.stack([p0.log(), p1.log(), p2.log()])[None].expand(N, 3, V).contiguous()
    drafts = torch.tensor([[0, 3]]).expand(N, 2).contiguous()  # the first draft is unlikely under p0
    tokens, emitted = verify(drafts, torch.full((N,), 2), logits, tensors(N, 1.0, step=5))
    first = torch.bincount(tokens[:, 0], minlength=V).float()
    assert chi2(first, p0) < 20.5  # df = 5, p = 0.001
    second_rows = emitted >= 2  # the first draft (token 0) was accepted: the next token ~ p1
    assert (tokens[second_rows, 0] == 0).all()
    second = torch.bincount(tokens[second_rows, 1], minlength=V).float()
    assert chi2(second, p1) < 20.5
    third_rows = emitted >= 3
    third = torch.bincount(tokens[third_rows, 2], minlength=V).float()
    assert third_rows.sum() > 300 and chi2(third, p2) < 20.5
    assert (emitted >= 1).all() and (emitted <= 3).all()


def test_sampled_acceptance_rate_equals_the_drafts_target_probability():
    V, N = 5, 20000
    p0 = torch.tensor([0.1, 0.6, 0.1, 0.1, 0.1])
    logits = p0.log()[None, None].expand(N, 2, V).contiguous()
    drafts = torch.ones(N, 1, dtype=torch.long)  # draft = token 1, accepted with probability 0.6
    _, emitted = verify(drafts, torch.ones(N), logits, tensors(N, 1.0))
    rate = (emitted == 2).float().mean().item()
    assert abs(rate - 0.6) < 0.02


def test_spec_stats():
    s = SpecStats()
    s.add(3, 2)
    s.add(0, 0)  # a step without drafts does not count
    s.add(2, 0)
    assert s.as_dict() == {"num_drafts": 2, "num_draft_tokens": 5, "num_accepted_tokens": 2,
                           "accepted_per_position": [1, 1, 0], "mean_acceptance_length": 2.0}


@pytest.mark.parametrize("seed", range(5))
def test_host_greedy_accept_equals_verify(seed):
    """The engine's host path for all-greedy batches gives verify()'s tokens and emitted counts."""
    from specmla.engine.spec import greedy_accept

    g = torch.Generator().manual_seed(seed)
    B, k, V = 32, 4, 6  # a small vocabulary: drafts often match the argmax
    logits = torch.randn(B, k + 1, V, generator=g)
    am = logits.argmax(-1)
    drafts = torch.where(torch.rand(B, k, generator=g) < 0.6, am[:, :k], torch.randint(0, V, (B, k), generator=g))
    num = torch.randint(0, k + 1, (B,), generator=g).to(torch.int32)
    tokens, emitted = verify(drafts, num, logits, None, all_greedy=True)
    h_tokens, h_emitted = greedy_accept(drafts.tolist(), num.tolist(), am.tolist())
    assert h_emitted == emitted.tolist()
    assert [t[:e] for t, e in zip(tokens.tolist(), h_emitted)] == h_tokens
    assert any(e > 1 for e in h_emitted) and any(e < n + 1 for e, n in zip(h_emitted, num.tolist()))
