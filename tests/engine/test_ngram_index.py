"""The host n-gram index drafts exactly what `ops.ngram_propose`'s reference drafts, token by token as a request
grows, and rebuilds when its tokens change."""

import random

import pytest
import torch

from specmla.engine.ngram_index import NgramIndex
from specmla.ops.ngram import ngram_propose_torch


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("nmin,nmax", [(1, 3), (2, 2), (1, 5)])
def test_index_drafts_equal_the_reference_as_tokens_arrive(seed, nmin, nmax):
    rng = random.Random(seed)
    vocab = rng.choice([3, 7, 50])  # small vocabularies repeat n-grams often
    row = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
    idx = NgramIndex(nmin, nmax)
    checked = found = 0
    while len(row) < 90:
        row += [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]  # a step appends 1..4 tokens
        idx.sync(list(row))
        cap = rng.randint(0, 6)
        want, num = ngram_propose_torch(torch.tensor([row]), torch.tensor([len(row)]), max_ngram=nmax,
                                        min_ngram=nmin, num_draft=cap, max_num_draft=max(cap, 1))
        assert idx.draft(cap) == want[0, : int(num[0])].tolist()
        checked += 1
        found += int(num[0]) > 0
    assert checked > 20 and found > 5


def test_changed_tokens_rebuild_the_index():
    idx = NgramIndex(1, 2)
    idx.sync([5, 6, 7, 5, 6])
    assert idx.draft(3) == [7, 5, 6]
    idx.sync([5, 6, 9])  # a step undone, other tokens since
    assert idx.tokens == [5, 6, 9] and idx.draft(3) == []
    idx.sync([5, 6, 9, 5])
    assert idx.draft(2) == [6, 9]
    assert NgramIndex(1, 1).draft(0) == []
    with pytest.raises(ValueError, match="min_ngram"):
        NgramIndex(3, 2)
