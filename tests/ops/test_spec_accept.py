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


def advance_case(b, k, P, page, seed):
    """A step's result (emitted 1..S, drafts used, next drafts), its inputs (start anywhere the table reaches
    with room for the step after), budgets that leave some rows live, some ending on this step, some dead
    (padded), and a fresh page table."""
    g = torch.Generator().manual_seed(seed)
    S = k + 1
    out = torch.randint(0, 90, (b, S + 2 + k), generator=g)
    out[:, S] = torch.randint(1, S + 1, (b,), generator=g)  # emitted
    start = torch.randint(0, P * page - 2 * S - 2 * k, (b,), generator=g)
    pos = start[:, None] + torch.arange(S)[None, :]
    ids = torch.randint(0, 90, (b, S), generator=g)
    slots = torch.randint(0, 999, (b, S), generator=g)
    remaining = torch.randint(-1, 3 * S, (b,), generator=g)  # ≤ 0: dead rows (padding)
    num = torch.randint(0, k + 1, (b,), generator=g)
    lens = torch.randint(0, 99, (b,), generator=g).to(torch.int32)
    table = torch.randperm(4 * P * b, generator=g)[: b * P].view(b, P).to(torch.int32)
    return out, ids, pos, slots, num, remaining, lens, table


@pytest.mark.parametrize("b,k,P,page", [(1, 1, 4, 4), (6, 3, 8, 4), (9, 4, 3, 64), (4, 2, 40, 1)])
def test_advance_kernel_matches_reference_and_the_host_rule(b, k, P, page):
    from specmla.ops.spec_accept import advance_spec_inputs_torch, advance_spec_inputs_triton

    case = advance_case(b, k, P, page, seed=3 * b + k)
    out, ids0, pos0, _, _, rem0, _, table = case
    scratch, last_pos = 4 * P * b + 1, int(pos0.max()) + 2  # a last rope position some rows pass
    want, got = [t.clone() for t in case], [t.clone() for t in case]
    advance_spec_inputs_torch(*want[:7], want[7], page, scratch, last_pos)
    advance_spec_inputs_triton(*got[:7], got[7], page, scratch, last_pos)
    for w, o in zip(want, got):
        assert w.dtype == o.dtype and torch.equal(w, o)
    _, ids, pos, slots, num, rem, lens, _ = want
    S = k + 1
    for i in range(b):  # the rule, row by row
        e = int(out[i, S])
        left = max(int(rem0[i]) - e, 0) if rem0[i] > 0 else 0
        assert rem[i] == left
        if left > 0:
            start = int(pos0[i, 0]) + e
            assert ids[i].tolist() == [int(out[i, e - 1])] + out[i, S + 2 :].tolist()
            assert pos[i].tolist() == [min(start + j, last_pos) for j in range(S)]
            assert slots[i].tolist() == [int(table[i, (start + j) // page]) * page + (start + j) % page
                                         for j in range(S)]
            assert num[i] == min(k, left - 1) and lens[i] == start + S
        else:  # dead: the scratch page, no drafts
            assert ids[i].tolist() == [0] * S and pos[i].tolist() == list(range(S)) and num[i] == 0
            assert slots[i].tolist() == [scratch * page + j % page for j in range(S)] and lens[i] == S
    assert b < 4 or ((rem == 0).any() and (rem > 0).any())  # the larger cases hold both kinds
