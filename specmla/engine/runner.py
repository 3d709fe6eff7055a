"""Runs the model on a batch of sequences: builds the step's tensors, forwards, samples.

Each scheduled sequence computes q_len tokens from num_cached on (a prefill chunk, or one new token
in decode). The batch tensors (positions, slot mapping, block table, lengths) are
built on the host once per step and shared by every layer.
"""

from __future__ import annotations

import itertools

import torch

from specmla.engine.cuda_graphs import GraphedDecoder
from specmla.engine.kv_pool import KVPool
from specmla.engine.mtp_graph import GraphedMtpDrafter
from specmla.engine.prefill_graphs import PiecewisePrefill
from specmla.engine.sequence import Sequence
from specmla.engine.spec_graph import GraphedSpecStep
from specmla.model.deepseek import DeepseekForCausalLM
from specmla.model.metadata import AttentionMetadata
from specmla.ops.argmax import argmax_rows
from specmla.ops.sampling import SampleOutput, SamplingTensors, sample


def to_device_ints(device: torch.device, *lists: list[int]) -> list[torch.Tensor]:
    """The int lists as int64 tensors on `device`: one copy, from pinned memory on a GPU, queued without waiting for
    the device's earlier work (a pageable copy would wait for it)."""
    flat = torch.tensor([x for xs in lists for x in xs], dtype=torch.long)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    return list(flat.split([len(xs) for xs in lists]))


class ModelRunner:
    def __init__(self, model: DeepseekForCausalLM, pool: KVPool, graphed: GraphedDecoder | None = None):
        self.model, self.pool = model, pool
        self.device = pool.device
        self.graphed = graphed  # decode steps through static buffers / CUDA graphs when set
        self.graphed_verify: GraphedDecoder | None = None  # the same for speculative verify steps (S = 1 + k)
        self.graphed_mtp: GraphedMtpDrafter | None = None  # MTP catch-up + drafts after a verify step, one replay
        self.graphed_spec: GraphedSpecStep | None = None  # greedy MTP steps: verify + accept + drafts, one replay
        self.prefill_graphs: PiecewisePrefill | None = None  # other steps: graphed pieces around eager attention

    def build_metadata(
        self, seqs: list[Sequence], q_lens: list[int], naive_context: bool = False, starts: list[int] | None = None,
        rows: tuple[list[int], list[int], list[int], list[int]] | None = None,
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Input ids and metadata for computing positions [start, start + q_len) of each sequence
        (start defaults to num_cached; the cache holds the positions before it); `rows`: `_rows` of the same
        arguments when the caller has them already."""
        pool, dev = self.pool, self.device
        starts = [s.num_cached for s in seqs] if starts is None else starts
        ids, positions, slots, kv_lens = rows if rows is not None else self._rows(seqs, q_lens, starts)
        # equal short chunks after a cached prefix take the absorbed decode path, except in an engine with graphs:
        # there every eager attention is the MHA form, whose kernels specialise on nothing a step's lengths change
        # (the absorbed kernels plan by batch and table width, which would compile mid-run)
        is_decode = (self.prefill_graphs is None and all(q == q_lens[0] for q in q_lens)
                     and all(st > 0 for st in starts) and q_lens[0] <= 8)
        has_prefix = any(st > 0 for st in starts)
        ctx, cu_kv = [], []
        if has_prefix and (not is_decode or naive_context):
            ctx = [slot for s, n in zip(seqs, kv_lens) for slot in pool.slots(s.seq_id, 0, n)]
            cu_kv = list(itertools.accumulate(kv_lens, initial=0))
        table, width = pool.block_table_rows([s.seq_id for s in seqs])
        (ids_t, pos_t, slots_t, lens_t, cu_q_t, table_t, ctx_t, cu_kv_t) = to_device_ints(
            dev, ids, positions, slots, kv_lens, list(itertools.accumulate(q_lens, initial=0)), table, ctx, cu_kv)
        meta = AttentionMetadata(
            positions=pos_t,
            cu_seqlens_q=cu_q_t.to(torch.int32),
            seq_lens=lens_t.to(torch.int32),
            max_seqlen_q=max(q_lens),
            max_seqlen_kv=max(kv_lens),
            slot_mapping=slots_t,
            block_table=table_t.to(torch.int32).view(len(seqs), width),
            decode_query_len=q_lens[0] if is_decode else 0,
            context_slots=ctx_t if ctx else None,
            cu_seqlens_kv=cu_kv_t.to(torch.int32) if ctx else None,
            kv_format=pool.kv_format,
        )
        return ids_t, meta

    def _rows(self, seqs: list[Sequence], q_lens: list[int], starts: list[int]
              ) -> tuple[list[int], list[int], list[int], list[int]]:
        """The step's token ids, positions and cache slots (request after request) and each request's
        length once they are computed."""
        ids, positions, slots, kv_lens = [], [], [], []
        for s, q, start in zip(seqs, q_lens, starts):
            end = start + q
            ids += s.all_ids[start:end]
            positions += range(start, end)
            slots += self.pool.slots(s.seq_id, start, end)
            kv_lens.append(end)
        return ids, positions, slots, kv_lens

    @torch.inference_mode()
    def forward_logits(
        self, seqs: list[Sequence], q_lens: list[int] | None = None, naive_context: bool = False
    ) -> torch.Tensor:
        """Compute q_lens[i] new tokens of each sequence (default: all uncomputed ones; pages must be
        allocated) and return the fp32 logits [B, V] of each sequence's last computed token."""
        if q_lens is None:
            q_lens = [s.total_len - s.num_cached for s in seqs]
        if self._graphable(seqs, q_lens, naive_context):
            hidden, logits = self._graphed_decode(seqs)
            # one-token chunks (a prompt's last token after a cached prefix, or a chunk the budget cut to one)
            # replay the decode graph: their trunk states (the graph's output buffer, valid until its next
            # replay) are what the MTP proposer catches up on, as after any other prefill
            self.last_hidden = (hidden, [s.num_cached for s in seqs], q_lens)
        else:
            if (self.prefill_graphs is not None and not naive_context
                    and self.prefill_graphs.padded_size(sum(q_lens)) is not None):
                rows = self._rows(seqs, q_lens, [s.num_cached for s in seqs])
                _, meta = self.build_metadata(seqs, q_lens, rows=rows)
                ids, positions, slots, _ = rows
                hidden = self.prefill_graphs.forward(ids, positions, slots, meta)
            else:
                input_ids, meta = self.build_metadata(seqs, q_lens, naive_context)
                hidden = self.model(input_ids, meta, self.pool.caches, force_naive=naive_context)
            logits = self.model.compute_logits(hidden[meta.cu_seqlens_q[1:].long() - 1])
            self.last_hidden = (hidden, [s.num_cached for s in seqs], q_lens)  # for the MTP proposer
        for s, q in zip(seqs, q_lens):
            s.num_cached += q
            self.pool.register_computed(s.seq_id, s.all_ids, s.num_cached)
        return logits

    def decode_ahead(self, seqs: list[Sequence], next_ids: torch.Tensor) -> torch.Tensor:
        """Launch the decode step that follows the current one for `seqs` (their next page allocated, graphable),
        each fed its token in next_ids (on the device, not appended on the host yet: its position is
        total_len) and sampled as the step after the current one; returns its tokens, on the device. Host state
        is untouched until `commit_ahead`."""
        _, logits = self._replay_decode(seqs, next_ids, [s.total_len for s in seqs])
        return self.sample(seqs, logits, step_offset=1).tokens

    def commit_ahead(self, seqs: list[Sequence]) -> None:
        """Account for a `decode_ahead` step whose tokens the engine takes: one more cached token each."""
        for s in seqs:
            s.num_cached += 1
            self.pool.register_computed(s.seq_id, s.all_ids, s.num_cached)

    def _graphable(self, seqs, q_lens, naive_context) -> bool:
        g = self.graphed
        return (
            g is not None and not naive_context and all(q == 1 for q in q_lens) and all(s.num_cached > 0 for s in seqs)
            and g.padded_size(len(seqs)) is not None
            and all(len(self.pool.pages_of(s.seq_id)) <= g.max_pages_per_seq for s in seqs)
        )

    def _graphed_decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        return self._replay_decode(seqs, [s.all_ids[s.num_cached] for s in seqs], [s.num_cached for s in seqs])

    def _replay_decode(self, seqs: list[Sequence], input_ids: list[int] | torch.Tensor, positions: list[int]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(trunk hidden states, logits) of one graphed decode step: each request's token input_ids[i] at
        positions[i]."""
        pool = self.pool
        return self.graphed.run(
            input_ids=input_ids,
            positions=positions,
            slots=[pool.slots(s.seq_id, p, p + 1)[0] for s, p in zip(seqs, positions)],
            seq_lens=[p + 1 for p in positions],
            tables=[pool.pages_of(s.seq_id) for s in seqs],
        )

    @torch.inference_mode()
    def forward_verify(self, seqs: list[Sequence], drafts: torch.Tensor) -> torch.Tensor:
        """Score each request's last token followed by its k (padded) drafts in one decode pass with
        S = 1 + k; returns logits [B, S, V]. Cache slots for all S tokens are written; the engine
        moves num_cached past the accepted ones only."""
        B, S = drafts.shape[0], drafts.shape[1] + 1
        g = self.graphed_verify
        if g is not None and g.padded_size(B) is not None and all(
                len(self.pool.pages_of(s.seq_id)) <= g.max_pages_per_seq for s in seqs):
            pool, d = self.pool, drafts.tolist()
            last_pos = self.model.max_positions - 1  # padded drafts past the context: the last rope position
            hidden, logits = g.run(
                input_ids=[t for s, row in zip(seqs, d) for t in [s.all_ids[-1]] + row],
                positions=[min(p, last_pos) for s in seqs for p in range(s.num_cached, s.num_cached + S)],
                slots=[x for s in seqs for x in pool.slots(s.seq_id, s.num_cached, s.num_cached + S)],
                seq_lens=[s.num_cached + S for s in seqs],
                tables=[pool.pages_of(s.seq_id) for s in seqs],
            )
        else:
            _, meta = self.build_metadata(seqs, [S] * B)
            last = torch.tensor([s.all_ids[-1] for s in seqs], dtype=torch.long, device=self.device)
            ids = torch.cat([last[:, None], drafts.to(self.device)], 1).reshape(-1)
            hidden = self.model(ids, meta, self.pool.caches)
            logits = self.model.compute_logits(hidden)
        self.last_hidden = (hidden, [s.num_cached for s in seqs], [S] * B)
        return logits.view(B, S, -1)

    @torch.inference_mode()
    def launch_greedy_mtp_step(self, seqs: list[Sequence], drafts: list[list[int]], remaining: list[int]
                               ) -> torch.Tensor | None:
        """Launch a whole greedy MTP step through `graphed_spec` (one replay): seqs[i] is decoding
        (num_cached = total_len - 1) with drafts[i] (≤ k tokens) and may emit remaining[i] more tokens. Returns
        its result [B, S + 2 + k] on the device, not waited for (request i emits tokens[:emitted]; see
        `GraphedSpecStep`), or None, with nothing done, when the graph does not take the batch (then the
        two-graph path runs)."""
        g, pool = self.graphed_spec, self.pool
        if g is None or g.padded_size(len(seqs)) is None:
            return None
        k, S = g.k, g.S
        need = 0
        for s in seqs:
            reach = s.total_len - 1 + 2 * k  # positions the step may write: verify S rows, then k - 1 drafts
            if s.num_cached != s.total_len - 1 or -(-reach // pool.page_size) > g.max_pages_per_seq:
                return None
            need += pool.pages_needed(s.seq_id, reach)
        if need > pool.num_free_pages():
            return None
        ids, num, positions, slots, seq_lens, tables = [], [], [], [], [], []
        last_pos = self.model.max_positions - 1  # padded drafts past the context: the last rope position
        for s, d in zip(seqs, drafts):
            st = s.num_cached
            pool.allocate(s.seq_id, st + 2 * k)
            ids += [s.all_ids[-1], *d] + [0] * (k - len(d))
            num.append(len(d))
            positions += [min(p, last_pos) for p in range(st, st + S)]
            slots += pool.slots(s.seq_id, st, st + S)
            seq_lens.append(st + S)
            tables.append(pool.pages_of(s.seq_id))
        return g.launch(input_ids=ids, num_drafts=num, positions=positions, slots=slots, seq_lens=seq_lens,
                        tables=tables, remaining=remaining)

    @torch.inference_mode()
    def launch_chained_mtp_step(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """Launch the greedy MTP step after the one just launched for the same `seqs` (same order), before its
        tokens reach the host: its inputs come from that step's result on the device (`GraphedSpecStep.
        launch_chained`). The host state is that before the launched step: each request starts it at most S
        positions further and writes 2k past that, for which pages are allocated here. Returns its result on the
        device, or None (nothing launched) where the pool or the static table cannot hold that."""
        g, pool = self.graphed_spec, self.pool
        k, S = g.k, g.S
        reach = [s.total_len - 1 + S + 2 * k for s in seqs]
        if any(-(-r // pool.page_size) > g.max_pages_per_seq for r in reach):
            return None
        if sum(pool.pages_needed(s.seq_id, r) for s, r in zip(seqs, reach)) > pool.num_free_pages():
            return None
        for s, r in zip(seqs, reach):
            pool.allocate(s.seq_id, r)
        return g.launch_chained([pool.pages_of(s.seq_id) for s in seqs])

    @torch.inference_mode()
    def mtp_launch_after_verify(self, seqs: list[Sequence], tokens: list[list[int]], emitted: list[int],
                                verify_hidden: torch.Tensor, k: int, num_draft: int | None = None
                                ) -> torch.Tensor | None:
        """Start the graphed MTP catch-up + k drafts right after a verify step, before the engine
        appends the emitted tokens (its host work then overlaps the replay). seqs[i] is decoding
        (num_cached = total_len - 1 = the step's first position), verified S = 1 + k rows (trunk
        states verify_hidden[i·S : (i+1)·S]) and emits tokens[i][:emitted[i]]. Returns the drafts
        [B, k] on the device, for `mtp_draft_after_verify`, or None (nothing done) when the graphed
        drafter does not take the batch: every request must be able to hold total_len + k tokens
        (after the emitted ones) within the static table. Requests that finish while their tokens
        are appended simply drop their drafts."""
        g, pool = self.graphed_mtp, self.pool
        S, B, nd = k + 1, len(seqs), k if num_draft is None else num_draft
        if (g is None or g.k != k or g.num_draft != nd or g.padded_size(B) is None
                or verify_hidden.shape[0] != B * S):
            return None
        need = 0
        for s, e in zip(seqs, emitted):
            total = s.total_len + e  # the length once the emitted tokens are appended
            if not (s.num_cached == s.total_len - 1 and not s.is_finished and 1 <= e <= S
                    and -(-(total + k) // pool.page_size) <= g.max_pages_per_seq):
                return None
            need += pool.pages_needed(s.seq_id, total + k)
        if need > pool.num_free_pages():
            return None
        ids, positions, slots, seq_lens, dpos, dslots, tables = [], [], [], [], [], [], []
        last_pos = self.model.max_positions - 1
        for s, toks, e in zip(seqs, tokens, emitted):
            st, total = s.num_cached, s.total_len + e
            pool.allocate(s.seq_id, total + k)
            ids += toks[:e] + [0] * (S - e)  # row j takes token st + j + 1; rows past the emitted ones are garbage
            positions += [min(x, last_pos) for x in range(st, st + S)]  # rows past the emitted ones: garbage
            slots += pool.slots(s.seq_id, st, st + S)  # allocated: total + k > st + k
            seq_lens.append(st + S)
            p = list(range(total - 1, total + nd - 2))  # draft step j at total - 2 + j
            # drafts past the context (never proposed: the engine caps them there) take the last rope position
            dpos.append([min(x, last_pos) for x in p])
            dslots.append(pool.slots(s.seq_id, p[0], p[-1] + 1) if p else [])
            tables.append(pool.pages_of(s.seq_id))
        return g.run(hidden=verify_hidden, input_ids=ids, positions=positions, slots=slots, seq_lens=seq_lens,
                     last=[e - 1 for e in emitted], draft_positions=dpos, draft_slots=dslots, tables=tables)

    @torch.inference_mode()
    def mtp_draft_after_verify(self, seqs: list[Sequence], starts: list[int], emitted: list[int],
                               verify_hidden: torch.Tensor, k: int, launched: torch.Tensor | None = None,
                               num_draft: int | None = None) -> None:
        """The MTP proposer after a verify step whose emitted tokens are appended: seqs[i] verified
        S = 1 + k rows from position starts[i] (trunk states verify_hidden[i·S : (i+1)·S]) and
        emitted emitted[i] tokens. `launched`: the device drafts of `mtp_launch_after_verify`, read
        here; without them the unfinished requests catch up and draft eagerly (one draft where the drafter is a
        CUDA graph, as after a prefill: the recursive drafts would run the MTP layer's experts eagerly, at sizes the
        warm-up never compiled)."""
        if launched is not None:
            for s, d in zip(seqs, launched.tolist()):
                if not s.is_finished:
                    s.drafts = d
            return
        S = k + 1
        items = [(s, starts[i], verify_hidden[i * S : i * S + emitted[i]]) for i, s in enumerate(seqs)
                 if not s.is_finished]
        if items:
            n = k if num_draft is None else num_draft
            graphed = self.graphed_mtp is not None and self.graphed_mtp.use_graphs
            self.mtp_catch_up_and_draft(items, min(n, 1) if graphed else n)

    @torch.inference_mode()
    def mtp_catch_up_and_draft(self, items: list[tuple[Sequence, int, torch.Tensor]], k: int) -> None:
        """MTP proposer. items: (request, first position, trunk hidden rows for positions first..).
        Runs the MTP module at those positions (its input at position p is the trunk's hidden state
        at p and token p+1, so every row needs its next token known), filling the MTP layer's paged
        cache; then, for each request that is decoding, drafts k tokens by applying the module
        recursively from its last position. Drafts land in `seq.drafts`."""
        model, pool = self.model, self.pool
        seqs = [s for s, _, _ in items]
        starts = [p for _, p, _ in items]
        q_lens = [h.shape[0] for _, _, h in items]
        next_list = [t for s, p, h in items for t in s.all_ids[p + 1 : p + 1 + h.shape[0]]]
        rows = self._rows(seqs, q_lens, starts)
        _, meta = self.build_metadata(seqs, q_lens, starts=starts, rows=rows)
        prev = torch.cat([h for _, _, h in items])
        pieces = self.prefill_graphs
        if pieces is not None and pieces.padded_size(len(next_list)) is not None:
            _, positions, slots, _ = rows
            h_mtp = pieces.mtp_forward(0, next_list, prev, positions, slots, meta)
        else:
            next_ids = torch.tensor(next_list, dtype=torch.long, device=self.device)
            h_mtp = model.mtp_forward(0, next_ids, prev, meta, pool.caches)
        last = torch.tensor(q_lens, device=self.device).cumsum(0) - 1
        drafting = []  # the decoding requests whose draft rows the pool holds, pages taken in order
        for i, s in enumerate(seqs):
            s.drafts = []
            if (s.num_cached == s.total_len - 1 and not s.is_finished and starts[i] + q_lens[i] == s.total_len - 1
                    and pool.can_allocate(s.seq_id, s.total_len + k)):
                pool.allocate(s.seq_id, s.total_len + k)
                drafting.append(i)
        if not drafting:
            return
        dseqs = [seqs[i] for i in drafting]
        h = h_mtp[last[drafting]]
        tok = model.mtp_logits(0, h).argmax(-1)
        out = [tok]
        for j in range(1, k):  # position total_len - 2 + j takes (previous MTP state, previous draft)
            _, m = self.build_metadata(dseqs, [1] * len(dseqs), starts=[s.total_len - 2 + j for s in dseqs])
            h = model.mtp_forward(j % len(model.mtp), tok, h, m, pool.caches)
            tok = model.mtp_logits(j % len(model.mtp), h).argmax(-1)
            out.append(tok)
        drafts = torch.stack(out, 1).tolist()
        for s, d in zip(dseqs, drafts):
            s.drafts = d

    @staticmethod
    def sampling_tensors(seqs: list[Sequence], device, step_offset: int = 0) -> SamplingTensors:
        """step_offset: how many tokens each request will have appended by the time this sample is its next."""
        p = [s.params for s in seqs]
        return SamplingTensors.from_lists(
            temperature=[x.temperature for x in p], top_k=[x.top_k for x in p], top_p=[x.top_p for x in p],
            seed=[s.seed for s in seqs], step=[len(s.output_ids) + step_offset for s in seqs], device=device,
        )

    def sample(self, seqs: list[Sequence], logits: torch.Tensor, step_offset: int = 0):
        p = [s.params for s in seqs]
        all_greedy = all(x.temperature < 1e-5 for x in p)
        if all_greedy and all(x.logprobs is None for x in p):  # argmax only: no per-request tensors to upload
            return SampleOutput(argmax_rows(logits), None, None, None)
        st = self.sampling_tensors(seqs, logits.device, step_offset)
        n_logprobs = max((x.logprobs or 0) for x in p)
        return sample(
            logits, st, num_logprobs=n_logprobs,
            all_greedy=all_greedy,
            filtering=any(0 < x.top_k < logits.shape[-1] or x.top_p < 1.0 for x in p),
            with_logprobs=any(x.logprobs is not None for x in p),
        )
