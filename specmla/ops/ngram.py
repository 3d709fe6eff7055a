"""N-gram draft proposer (contract C3), FastDeploy `ngram_match` semantics, on the device.

For each request: for n from max_ngram down to min_ngram, the pattern is the last n tokens; find the
leftmost start i with i + n < seq_len and tokens[i:i+n] == pattern; the drafts are the tokens that
follow it, tokens[i+n : min(i+n+cap, seq_len)]; the largest n with a match wins; no match → 0 drafts.
Then a batch-wide budget (verify tokens per step) is applied in batch order: a request's drafts are
cut so that (tokens assigned so far, 1 + drafts per processed request) + (1 per active request not
yet processed) never exceeds max_batch_tokens.

GPU path: a search kernel with one program per request scanning many start positions at once (the
leftmost match by a min-reduction per block, stopping at the first block that has one), then a
one-program serial budget pass. No host synchronisation. The torch reference is a plain loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _caps(num_draft, B: int, device, max_num_draft: int | None) -> tuple[torch.Tensor, int]:
    if isinstance(num_draft, torch.Tensor):
        if num_draft.shape != (B,):
            raise ValueError(f"num_draft tensor must be [B={B}], got {tuple(num_draft.shape)}")
        if max_num_draft is None:
            if num_draft.is_cuda:
                raise ValueError("pass max_num_draft with a per-request num_draft on the GPU (no host sync)")
            max_num_draft = int(num_draft.max().item()) if B else 0
        return num_draft.to(device=device, dtype=torch.int32).clamp(0, max_num_draft), max_num_draft
    if num_draft < 0:
        raise ValueError("num_draft must be >= 0")
    return torch.full((B,), num_draft, dtype=torch.int32, device=device), num_draft


def _check(tokens, seq_lens, max_ngram, min_ngram):
    if tokens.dim() != 2 or seq_lens.shape != (tokens.shape[0],):
        raise ValueError(f"tokens must be [B, L] and seq_lens [B], got {tuple(tokens.shape)}, {tuple(seq_lens.shape)}")
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")


def ngram_propose_torch(tokens, seq_lens, *, max_ngram, min_ngram, num_draft, max_batch_tokens=None, active=None,
                        max_num_draft=None):
    """Reference: plain loops on host copies (the 'CPU implementation')."""
    _check(tokens, seq_lens, max_ngram, min_ngram)
    B = tokens.shape[0]
    caps, width = _caps(num_draft, B, "cpu", max_num_draft)
    toks = tokens.cpu().tolist()
    lens = seq_lens.cpu().tolist()
    act = [True] * B if active is None else [bool(a) for a in active.cpu().tolist()]
    drafts = torch.zeros(B, width, dtype=torch.int64)
    found = [0] * B
    for b in range(B):
        n_len, cap = lens[b], int(caps[b])
        if not act[b] or cap == 0:
            continue
        row = toks[b][:n_len]
        for n in range(max_ngram, min_ngram - 1, -1):
            if n >= n_len:
                continue
            pattern = row[n_len - n :]
            start = next((i for i in range(n_len - n) if row[i : i + n] == pattern), None)
            if start is not None:
                got = row[start + n : min(start + n + cap, n_len)]
                drafts[b, : len(got)] = torch.tensor(got, dtype=torch.int64)
                found[b] = len(got)
                break
    num = torch.tensor(found, dtype=torch.int32)
    if max_batch_tokens is not None:
        assigned, remaining = 0, sum(act)
        for b in range(B):
            if not act[b]:
                continue
            remaining -= 1
            room = max(0, max_batch_tokens - assigned - 1 - remaining)
            num[b] = min(int(num[b]), room)
            assigned += 1 + int(num[b])
    keep = torch.arange(width)[None, :] < num[:, None]
    drafts = torch.where(keep, drafts, torch.zeros_like(drafts))
    return drafts.to(tokens.device), num.to(tokens.device)


@triton.jit(do_not_specialize=["stride_tb"])  # the token rows' length changes every step
def _ngram_search_kernel(
    TOK, LENS, CAPS, ACTIVE, DRAFTS, NUM,
    stride_tb, stride_db,
    MAX_NGRAM: tl.constexpr, MIN_NGRAM: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    seq_len = tl.load(LENS + b)
    cap = tl.load(CAPS + b)
    act = tl.load(ACTIVE + b)
    row = TOK + b * stride_tb
    offs = tl.arange(0, BLOCK)
    NONE = 2147483647
    best_start = tl.full([], -1, tl.int32)  # scalar tensors: the same type on every path (compiled mode)
    best_n = tl.full([], 0, tl.int32)
    for n in tl.static_range(MAX_NGRAM, MIN_NGRAM - 1, -1):  # longest n-gram first
        if (best_n == 0) & (n < seq_len) & (act != 0) & (cap > 0):
            limit = seq_len - n  # starts i < limit, i.e. i + n < seq_len
            found = tl.full([], NONE, tl.int32)
            i0 = tl.full([], 0, tl.int32)
            while (i0 < limit) & (found == NONE):
                i = i0 + offs
                ok = i < limit
                for t in tl.static_range(0, n):
                    pat = tl.load(row + seq_len - n + t)
                    ok = ok & (tl.load(row + i + t, mask=i < limit, other=-1) == pat)
                found = tl.min(tl.where(ok, i, NONE), 0)
                i0 += BLOCK
            if found != NONE:
                best_start = found
                best_n = tl.full([], n, tl.int32)
    count = tl.where(best_n > 0, tl.minimum(cap, seq_len - (best_start + best_n)), 0)
    d = tl.arange(0, WIDTH)
    vals = tl.load(row + best_start + best_n + d, mask=d < count, other=0)
    tl.store(DRAFTS + b * stride_db + d, vals)
    tl.store(NUM + b, count.to(tl.int32))


@triton.jit(do_not_specialize=["B", "max_batch_tokens"])
def _ngram_budget_kernel(NUM, ACTIVE, DRAFTS, B, stride_db, max_batch_tokens, WIDTH: tl.constexpr):
    """Serial pass in batch order (B is small: one program)."""
    remaining = tl.full([], 0, tl.int32)
    for b in range(0, B):
        remaining += (tl.load(ACTIVE + b) != 0).to(tl.int32)
    assigned = tl.full([], 0, tl.int32)
    d = tl.arange(0, WIDTH)
    for b in range(0, B):
        if tl.load(ACTIVE + b) != 0:
            remaining -= 1
            room = tl.maximum(max_batch_tokens - assigned - 1 - remaining, 0)
            n = tl.minimum(tl.load(NUM + b), room)
            tl.store(NUM + b, n)
            row = tl.load(DRAFTS + b * stride_db + d)
            tl.store(DRAFTS + b * stride_db + d, tl.where(d < n, row, 0))
            assigned += 1 + n


def ngram_propose_triton(tokens, seq_lens, *, max_ngram, min_ngram, num_draft, max_batch_tokens=None, active=None,
                         max_num_draft=None, block: int = 1024):
    """`block`: start positions compared per iteration, a power of two fixed by the caller (never derived from the
    step's lengths, so a new context length compiles nothing)."""
    _check(tokens, seq_lens, max_ngram, min_ngram)
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    B = tokens.shape[0]
    dev = tokens.device
    caps, width = _caps(num_draft, B, dev, max_num_draft)
    w = max(1, triton.next_power_of_2(width))
    drafts = torch.zeros(B, w, dtype=torch.int64, device=dev)
    num = torch.zeros(B, dtype=torch.int32, device=dev)
    act = (torch.ones(B, dtype=torch.int32, device=dev) if active is None else active.to(device=dev, dtype=torch.int32))
    tokens = tokens.contiguous()
    if B:
        _ngram_search_kernel[(B,)](
            tokens, seq_lens.to(dev, torch.int32), caps, act, drafts, num, tokens.stride(0), drafts.stride(0),
            MAX_NGRAM=max_ngram, MIN_NGRAM=min_ngram, WIDTH=w, BLOCK=block,
        )
        if max_batch_tokens is not None:
            _ngram_budget_kernel[(1,)](num, act, drafts, B, drafts.stride(0), max_batch_tokens, WIDTH=w)
    return drafts[:, :width], num


def ngram_propose(tokens, seq_lens, *, max_ngram, min_ngram, num_draft, max_batch_tokens=None, active=None,
                  max_num_draft=None, backend: str = "auto"):
    """Contract C3 → (drafts int64 [B, num_draft], num_drafts int32 [B]). A per-request `num_draft`
    tensor on the GPU needs `max_num_draft` (the drafts' width) so that no host sync is needed."""
    if backend == "auto":
        backend = "triton" if tokens.is_cuda else "torch"
    fn = {"torch": ngram_propose_torch, "triton": ngram_propose_triton}.get(backend)
    if fn is None:
        raise ValueError(f"unknown backend {backend!r} (auto | triton | torch)")
    return fn(tokens, seq_lens, max_ngram=max_ngram, min_ngram=min_ngram, num_draft=num_draft,
              max_batch_tokens=max_batch_tokens, active=active, max_num_draft=max_num_draft)
