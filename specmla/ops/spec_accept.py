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


# ---- the next speculative step's inputs, from the last step's result, on the device ------------------------------
# A pipelined engine launches step n + 1 before the host has read step n: its inputs (each request's last emitted
# token and next drafts, positions, cache slots, lengths) follow from step n's result [b, S + 2 + k] = tokens (S) |
# emitted | drafts used | next drafts (k), and from each request's budget of tokens left (`remaining`, which the
# step spends). A row with no budget left (a padded row, a request at its max_tokens or context) is dead: token 0 at
# positions 0..S-1 of the scratch page, no drafts, so it writes nothing another request could read.


def advance_spec_inputs_torch(out: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                              num_drafts: torch.Tensor, remaining: torch.Tensor, seq_lens: torch.Tensor,
                              table: torch.Tensor, page_size: int, scratch_page: int, last_pos: int) -> None:
    """In place: out int64 [b, S + 2 + k] (the last step's result); ids / pos / slots int64 [b, S] (that step's
    inputs, overwritten with the next's); num_drafts int64 [b]; remaining int64 [b] (tokens the request may still
    emit); seq_lens int32 [b]; table int32 [b, P] (pages for the next step, allocated by the host). A live row
    (remaining > 0 before the step) moves its start by its emitted count e, spends e of its budget, and, if budget
    is left, takes its last emitted token and next drafts (at most remaining - 1 of them); positions past last_pos
    (drafts beyond the context) are clamped there (their slots are not)."""
    b, S = ids.shape
    k = out.shape[1] - S - 2
    e = out[:, S].clamp(1, S)
    live_before = remaining > 0
    left = torch.where(live_before, remaining - e, 0).clamp_min(0)
    live = left > 0
    start = torch.where(live, pos[:, 0] + e, 0)
    last = out[:, :S].gather(1, (e - 1)[:, None])
    j = torch.arange(S, device=ids.device)[None, :]
    p = start[:, None] + j
    drafts = out[:, S + 2 : S + 2 + k]
    new_ids = torch.where(live[:, None], torch.cat([last, drafts], 1), 0)
    page = table.long().gather(1, (p // page_size).clamp_max(table.shape[1] - 1))
    new_slots = torch.where(live[:, None], page * page_size + p % page_size, scratch_page * page_size + j % page_size)
    ids.copy_(new_ids)
    pos.copy_(torch.where(live[:, None], p.clamp_max(last_pos), j))
    slots.copy_(new_slots)
    num_drafts.copy_(torch.where(live, (left - 1).clamp(0, k), 0))
    remaining.copy_(left)
    seq_lens.copy_(torch.where(live, start + S, S).to(seq_lens.dtype))


@triton.jit
def _advance_kernel(OUT, IDS, POS, SLOTS, ND, REM, LENS, TABLE, S, K, P, stride_out, stride_t, PAGE: tl.constexpr,
                    SCRATCH, LAST_POS, BLOCK_S: tl.constexpr):
    i = tl.program_id(0)
    js = tl.arange(0, BLOCK_S)
    in_s = js < S
    e = tl.minimum(tl.maximum(tl.load(OUT + i * stride_out + S), 1), S)
    rem = tl.load(REM + i)
    left = tl.where(rem > 0, rem - e, 0)
    left = tl.maximum(left, 0)
    live = left > 0
    start = tl.where(live, tl.load(POS + i * S) + e, 0)
    last = tl.load(OUT + i * stride_out + e - 1)
    draft = tl.load(OUT + i * stride_out + S + 2 + js - 1, mask=(js >= 1) & in_s, other=0)
    new_id = tl.where(js == 0, last, draft)
    new_id = tl.where(live, new_id, 0)
    p = start + js
    page = tl.load(TABLE + i * stride_t + tl.minimum(p // PAGE, P - 1), mask=in_s, other=0).to(tl.int64)
    slot = tl.where(live, page * PAGE + p % PAGE, SCRATCH * PAGE + js % PAGE)
    tl.store(IDS + i * S + js, new_id, mask=in_s)
    tl.store(POS + i * S + js, tl.where(live, tl.minimum(p, LAST_POS), js.to(tl.int64)), mask=in_s)
    tl.store(SLOTS + i * S + js, slot, mask=in_s)
    tl.store(ND + i, tl.where(live, tl.minimum(tl.maximum(left - 1, 0), K), 0))
    tl.store(REM + i, left)
    tl.store(LENS + i, tl.where(live, start + S, S).to(tl.int32))


def advance_spec_inputs_triton(out, ids, pos, slots, num_drafts, remaining, seq_lens, table, page_size: int,
                               scratch_page: int, last_pos: int) -> None:
    """Same contract as `advance_spec_inputs_torch` (every tensor contiguous)."""
    b, S = ids.shape
    k = out.shape[1] - S - 2
    for name, t in (("ids", ids), ("pos", pos), ("slots", slots), ("table", table)):
        if t.shape[0] != b or not t.is_contiguous():
            raise ValueError(f"advance_spec_inputs: {name} must be contiguous with b = {b} rows")
    if out.shape[0] != b or k < 0 or num_drafts.shape != (b,) or remaining.shape != (b,) or seq_lens.shape != (b,):
        raise ValueError("advance_spec_inputs: out [b, S + 2 + k], num_drafts / remaining / seq_lens [b]")
    if b:
        _advance_kernel[(b,)](out, ids, pos, slots, num_drafts, remaining, seq_lens, table, S, k, table.shape[1],
                              out.stride(0), table.stride(0), PAGE=page_size, SCRATCH=scratch_page, LAST_POS=last_pos,
                              BLOCK_S=max(2, triton.next_power_of_2(S)), num_warps=1)


def advance_spec_inputs(out, ids, pos, slots, num_drafts, remaining, seq_lens, table, page_size: int,
                        scratch_page: int, last_pos: int) -> None:
    """Triton on CUDA, the torch reference elsewhere."""
    fn = advance_spec_inputs_triton if ids.is_cuda else advance_spec_inputs_torch
    fn(out, ids, pos, slots, num_drafts, remaining, seq_lens, table, page_size, scratch_page, last_pos)
