"""The one-kernel greedy acceptance + draft placement (ops/spec_accept.py) against its torch
reference (interpreter on CPU), and the reference against a plain host loop."""

import pytest
import torch

from specmla.engine.spec import greedy_accept
from specmla.ops.spec_accept import accept_and_place_torch, accept_and_place_triton


def make_case(b, k, P, page, seed):
    """Drafts that match the argmax for a random prefix (sometimes all of it), random draft counts
    (0..k), starts anywhere in the table, a random page table."""
    g = torch.Generator().manual_seed(seed)
    S = k + 1
    argmax = torch.randint(0, 50, (b, S), generator=g)
    drafts = torch.randint(0, 50, (b, k), generator=g)
    keep = torch.randint(0, S, (b,), generator=g)
    for i in range(b):
        drafts[i, : keep[i]] = argmax[i, : keep[i]]
    ids = torch.cat([torch.randint(0, 50, (b, 1), generator=g), drafts], 1)
    num = torch.randint(0, k + 1, (b,), generator=g)
    start = torch.randint(0, P * page - 2 * k - 1, (b,), generator=g)
    table = torch.randperm(4 * P * b, generator=g)[: b * P].view(b, P).to(torch.int32)
    return ids, num, argmax, start, table


@pytest.mark.parametrize("b,k,P,page", [(1, 1, 3, 4), (5, 3, 6, 4), (7, 4, 2, 64), (3, 7, 20, 1)])
def test_kernel_matches_reference_and_host_loop(b, k, P, page):
    ids, num, argmax, start, table = make_case(b, k, P, page, seed=b * 10 + k)
    want = accept_and_place_torch(ids, num, argmax, start, table, page, k - 1)
    got = accept_and_place_triton(ids, num, argmax, start, table, page, k - 1)
    for w, o in zip(want, got):
        assert w.dtype == o.dtype and torch.equal(w, o)
    tokens, emitted = greedy_accept(ids[:, 1:].tolist(), num.tolist(), argmax.tolist())
    assert [t[:e] for t, e in zip(want[0].tolist(), (want[1] + 1).tolist())] == tokens
    assert (want[1] + 1).tolist() == emitted
    pos, slots = want[2], want[3]
    for i in range(b):
        for j in range(k - 1):
            p = int(start[i]) + int(want[1][i]) + 1 + j
            assert pos[j, i] == p and slots[j, i] == int(table[i, p // page]) * page + p % page


def test_strided_start_and_bad_shapes():
    ids, num, argmax, start, table = make_case(4, 3, 5, 4, seed=1)
    wide = torch.stack([start, start], 1)  # start as a strided column, as the graph passes it
    got = accept_and_place_triton(ids, num, argmax, wide[:, 0], table, 4, 2)
    assert torch.equal(got[2], accept_and_place_torch(ids, num, argmax, start, table, 4, 2)[2])
    with pytest.raises(ValueError, match="accept_and_place"):
        accept_and_place_triton(ids, num, argmax[:, :2], start, table, 4, 2)
