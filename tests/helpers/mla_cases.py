"""Random paged-cache decode problems: permuted block tables, NaN-poisoned unused memory."""

from __future__ import annotations

import torch

from specmla.ops.decode import mla_decode_torch


def make_decode_case(B, S, H, page_size, dc, dr, lens, dtype, device="cpu", seed=0, causal=True):
    g = torch.Generator().manual_seed(seed)
    D = dc + dr
    lens = [max(n, 1) for n in lens]
    pages_per = [-(-n // page_size) for n in lens]
    width = max(pages_per) + 2  # spare table columns, filled with garbage page ids
    num_pages = sum(pages_per) + 5  # some pages belong to nobody
    perm = torch.randperm(num_pages, generator=g)
    kv = torch.full((num_pages, page_size, D), float("nan"), dtype=torch.float32)
    table = torch.randint(0, num_pages, (B, width), generator=g, dtype=torch.int32)
    k = 0
    for b, (n, np_) in enumerate(zip(lens, pages_per)):
        pages = perm[k : k + np_]
        k += np_
        table[b, :np_] = pages.to(torch.int32)
        rows = torch.randn(n, D, generator=g)
        flat = kv[pages].reshape(-1, D)
        flat[:n] = rows  # tail of the last page stays NaN
        kv[pages] = flat.view(np_, page_size, D)
    q = torch.randn(B, S, H, D, generator=g)
    seq = torch.tensor(lens, dtype=torch.int32)
    return (q.to(dtype).to(device), kv.to(dtype).to(device), table.to(device), seq.to(device))


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def reference(q, kv, table, seq, causal, dc, scale=0.0721):
    """fp64 torch decode (out, lse) of a case."""
    return mla_decode_torch(q.double(), kv.double(), table, seq, scale, causal=causal, return_lse=True,
                            head_dim_v=dc)


def assert_matches_reference(case, causal, dc, got, got_lse, out_tol, lse_tol=1e-3):
    """A kernel's (out, lse) on `case` against the fp64 reference (computed on the CPU): dtype and
    shape, no NaN, output within out_tol, the same empty rows (lse -inf, output 0), lse within lse_tol."""
    q, kv, table, seq = (t.cpu() for t in case)
    want, want_lse = reference(q, kv, table, seq, causal, dc)
    got, got_lse = got.cpu(), got_lse.cpu()
    assert got.shape == want.shape and got.dtype == q.dtype
    assert not torch.isnan(got).any()
    assert rel_err(got, want) <= out_tol
    inf = torch.isinf(want_lse)
    assert torch.equal(inf, torch.isinf(got_lse))
    assert (got[inf] == 0).all()
    if (~inf).any():
        assert (got_lse[~inf].double() - want_lse[~inf]).abs().max().item() <= lse_tol
