"""N-gram proposer (contract C3): the Triton kernels (interpreter on CPU) against the plain loop."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specmla.ops.ngram import ngram_propose


def both(tokens, lens, **kw):
    a = ngram_propose(tokens, lens, backend="torch", **kw)
    b = ngram_propose(tokens, lens, backend="triton", **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (a, b)
    return a


def test_semantics_on_hand_made_rows():
    t = torch.tensor([
        [1, 2, 3, 4, 1, 2, 3, 9, 9, 1, 2, 3, 0, 0],  # "1 2 3" first at 0 → drafts 4 1 2 3
        [5, 6, 7, 5, 6, 8, 5, 6, 0, 0, 0, 0, 0, 0],  # "5 6" leftmost at 0 → 7 5 6 8
        [7, 8, 9, 1, 2, 4, 4, 4, 4, 4, 4, 4, 4, 4],  # no 3-gram earlier; "4 4" at 5 → 4 4 ...
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 13],  # only "13" at 12: one token follows → [13]
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14],  # no repeat: 0 drafts
    ])
    lens = torch.tensor([12, 8, 14, 14, 14], dtype=torch.int32)
    drafts, num = both(t, lens, max_ngram=3, min_ngram=1, num_draft=4)
    assert num.tolist() == [4, 4, 4, 1, 0]
    assert drafts[0].tolist() == [4, 1, 2, 3]
    assert drafts[1].tolist() == [7, 5, 6, 8]
    assert drafts[2].tolist() == [4, 4, 4, 4]
    assert drafts[3].tolist() == [13, 0, 0, 0]
    assert drafts[4].tolist() == [0, 0, 0, 0]


def test_budget_cuts_in_batch_order_and_inactive_requests_get_nothing():
    t = torch.tensor([[1, 2, 1, 2, 1, 2, 1, 2]] * 4)
    lens = torch.full((4,), 8, dtype=torch.int32)
    _, num = both(t, lens, max_ngram=2, min_ngram=1, num_draft=3, max_batch_tokens=9)
    # request 0: 9 - 0 - 1 - 3 others = 5 → 3; request 1: 9 - 4 - 1 - 2 = 2; then 9 - 7 - 1 - 1 = 0
    assert num.tolist() == [3, 2, 0, 0]
    active = torch.tensor([False, True, True, False])
    _, num = both(t, lens, max_ngram=2, min_ngram=1, num_draft=3, max_batch_tokens=6, active=active)
    assert num.tolist() == [0, 3, 1, 0]  # only two active requests count
    _, num = both(t, lens, max_ngram=2, min_ngram=1, num_draft=3, max_batch_tokens=2)
    assert num.tolist() == [0, 0, 0, 0]


def test_per_request_caps():
    t = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]] * 3)
    lens = torch.full((3,), 8, dtype=torch.int32)
    caps = torch.tensor([0, 1, 5], dtype=torch.int32)
    drafts, num = both(t, lens, max_ngram=2, min_ngram=1, num_draft=caps, max_num_draft=5)
    assert num.tolist() == [0, 1, 5] and drafts.shape == (3, 5)
    assert drafts[2].tolist() == [3, 1, 2, 3, 1]


def test_bad_arguments():
    t = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError):
        ngram_propose(t, torch.ones(3, dtype=torch.int32), max_ngram=2, min_ngram=1, num_draft=2)
    with pytest.raises(ValueError):
        ngram_propose(t, torch.ones(2, dtype=torch.int32), max_ngram=1, min_ngram=2, num_draft=2)
    with pytest.raises(ValueError):
        ngram_propose(t, torch.ones(2, dtype=torch.int32), max_ngram=2, min_ngram=1, num_draft=-1)


@st.composite
def batches(draw):
    B = draw(st.integers(1, 5))
    L = draw(st.integers(2, 40))
    vocab = draw(st.integers(2, 6))
    rows, lens = [], []
    for _ in range(B):
        n = draw(st.integers(1, L))
        row = draw(st.lists(st.integers(0, vocab - 1), min_size=L, max_size=L))
        if n > 4 and draw(st.booleans()):  # plant a repeat of the suffix earlier in the row
            k = draw(st.integers(1, min(4, n // 2)))
            at = draw(st.integers(0, n - 2 * k))
            row[at : at + k] = row[n - k : n]
        rows.append(row)
        lens.append(n)
    kw = dict(max_ngram=draw(st.integers(1, 4)), num_draft=draw(st.integers(0, 6)))
    kw["min_ngram"] = draw(st.integers(1, kw["max_ngram"]))
    if draw(st.booleans()):
        kw["max_batch_tokens"] = draw(st.integers(0, B * 5))
    if draw(st.booleans()):
        kw["active"] = torch.tensor(draw(st.lists(st.booleans(), min_size=B, max_size=B)))
    return torch.tensor(rows), torch.tensor(lens, dtype=torch.int32), kw


@settings(max_examples=60, deadline=None)
@given(batches())
def test_kernels_equal_the_loop_on_random_rows_with_planted_repeats(case):
    tokens, lens, kw = case
    drafts, num = both(tokens, lens, **kw)
    assert ((num >= 0) & (num <= kw["num_draft"])).all()
