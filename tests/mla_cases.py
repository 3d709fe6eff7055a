"""Random paged-cache decode problems: permuted block tables, NaN-poisoned unused memory."""

from __future__ import annotations

import torch


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
