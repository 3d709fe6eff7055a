"""Greedy acceptance and the next draft steps' placement, in one Triton kernel (+ torch reference).

Inside the one-replay speculative step (engine/spec_graph.py) the verify argmax must become the
emitted tokens, and every MTP draft step needs its position, cache slot and length, which depend on
how many drafts were accepted. In torch that is ~10 small kernels for the acceptance and ~10 per
draft step; at B=1 each costs a few µs of an otherwise tiny step. One program per request does it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def greedy_verify(drafts: torch.Tensor, num_drafts: torch.Tensor, argmax: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance on the device, without host syncs (so it can sit inside a CUDA graph):
    drafts [B, k], num_drafts [B], the target's argmax [B, k+1] → (tokens [B, k+1], accepted [B]):
    a request accepts its longest draft prefix equal to the argmax and emits tokens[:accepted + 1],
    the accepted drafts followed by the argmax at the first mismatch (or the bonus token)."""
    k = drafts.shape[1]
    valid = torch.arange(k, device=drafts.device)[None, :] < num_drafts.long()[:, None]
    accepted = ((drafts == argmax[:, :k]) & valid).long().cumprod(1).sum(1)
    tokens = torch.where(torch.arange(k + 1, device=drafts.device)[None, :] < accepted[:, None],
                         torch.cat([drafts, argmax[:, -1:]], 1), argmax)
    return tokens, accepted


def accept_and_place_torch(ids: torch.Tensor, num_drafts: torch.Tensor, argmax: torch.Tensor, start: torch.Tensor,
                           table: torch.Tensor, page_size: int, num_steps: int):
    """ids [b, S] (each request's last token, then its k = S - 1 drafts), num_drafts [b], the
    target's argmax [b, S], start [b] (the position of ids[:, 0]), page table [b, P] →
    (tokens int64 [b, S]: accepted drafts then the argmax after them; accepted int64 [b];
    pos int64 [num_steps, b] = start + accepted + 1 + j; slots int64 [num_steps, b]; lens int32
    [num_steps, b] = pos + 1). Request b emits tokens[b, :accepted + 1]."""
    tokens, accepted = greedy_verify(ids[:, 1:], num_drafts, argmax)
    j = torch.arange(num_steps, device=ids.device)[:, None]
    pos = start.long()[None, :] + accepted[None, :] + 1 + j  # [num_steps, b]
    page = table.long().gather(1, (pos // page_size).clamp_max(table.shape[1] - 1).T).T
    return tokens, accepted, pos, page * page_size + pos % page_size, (pos + 1).to(torch.int32)


@triton.jit
def _accept_and_place_kernel(
    IDS, ND, ARGMAX, START, TABLE, TOK, ACC, POS, SLOT, LEN,
    B, S, P, stride_t, stride_start, PAGE: tl.constexpr, NUM_STEPS, BLOCK_S: tl.constexpr, BLOCK_J: tl.constexpr,
):
    i = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)
    is_draft = offs < S - 1
    draft = tl.load(IDS + i * S + 1 + offs, mask=is_draft, other=-1)
    am = tl.load(ARGMAX + i * S + offs, mask=offs < S, other=0)
    nd = tl.load(ND + i)
    match = (draft == am) & is_draft & (offs < nd)
    accepted = tl.min(tl.where(match, BLOCK_S, offs), 0)  # the first position that is not a match
    tl.store(TOK + i * S + offs, tl.where(offs < accepted, draft, am), mask=offs < S)
    tl.store(ACC + i, accepted.to(tl.int64))
    jj = tl.arange(0, BLOCK_J)
    j_ok = jj < NUM_STEPS
    pos = tl.load(START + i * stride_start).to(tl.int64) + accepted + 1 + jj
    page = tl.load(TABLE + i * stride_t + tl.minimum(pos // PAGE, P - 1), mask=j_ok, other=0).to(tl.int64)
    tl.store(POS + jj * B + i, pos, mask=j_ok)
    tl.store(SLOT + jj * B + i, page * PAGE + pos % PAGE, mask=j_ok)
    tl.store(LEN + jj * B + i, (pos + 1).to(tl.int32), mask=j_ok)


def accept_and_place_triton(ids, num_drafts, argmax, start, table, page_size: int, num_steps: int):
    """Same contract as `accept_and_place_torch`."""
    b, S = ids.shape
    if argmax.shape != (b, S) or num_drafts.shape != (b,) or start.shape != (b,) or table.shape[0] != b:
        raise ValueError("accept_and_place: ids / argmax [b, S], num_drafts / start [b], table [b, P]")
    dev = ids.device
    tokens = torch.empty(b, S, dtype=torch.int64, device=dev)
    accepted = torch.empty(b, dtype=torch.int64, device=dev)
    pos = torch.empty(num_steps, b, dtype=torch.int64, device=dev)
    slots = torch.empty(num_steps, b, dtype=torch.int64, device=dev)
    lens = torch.empty(num_steps, b, dtype=torch.int32, device=dev)
    if b:
        _accept_and_place_kernel[(b,)](
            ids.contiguous(), num_drafts.contiguous(), argmax.contiguous(), start, table, tokens,
            accepted, pos, slots, lens, b, S, table.shape[1], table.stride(0), start.stride(0), PAGE=page_size, NUM_STEPS=num_steps,
            BLOCK_S=max(2, triton.next_power_of_2(S)), BLOCK_J=max(2, triton.next_power_of_2(num_steps)),
            num_warps=1,
        )
    return tokens, accepted, pos, slots, lens


def accept_and_place(ids, num_drafts, argmax, start, table, page_size: int, num_steps: int):
    """Triton on CUDA, the torch reference elsewhere."""
    fn = accept_and_place_triton if ids.is_cuda else accept_and_place_torch
    return fn(ids, num_drafts, argmax, start, table, page_size, num_steps)
