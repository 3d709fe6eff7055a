"""A whole greedy MTP speculative step as one CUDA-graph replay, with one host wait.

The two-graph step (verify graph → host reads the argmax and accepts → MTP graph → host reads the
drafts) pays two waits and two rounds of input building per step; for a small model at B=1 that
host work, not the GPU, sets the speed. For all-greedy batches everything between the inputs and
the next step's drafts can stay on the device:

1. verify: the trunk over S = 1 + k rows per request (the last token and k drafts, padded);
2. `accept_and_place` (one kernel) on the argmax: accepted drafts + one target token per request,
   and the positions / slots of the draft steps below;
3. MTP catch-up over the same S rows (row j takes the emitted token after it; rows past the emitted
   ones compute garbage that the next step overwrites), the state of the last emitted row drafts;
4. k - 1 recursive draft steps at those positions (start + accepted + j), their slots looked up
   in the request's page table on the device.

The host uploads one set of inputs, replays, and reads one [B, S + 2 + k] int64 tensor back: the
tokens, the emitted count, the drafts the step used and the next drafts. The request's pages must
already hold every position step 4 can write (start + k + k - 1), which the runner allocates before
the replay.

Pipelined: the next step can be launched before the host reads this one (`launch_chained`): a second
graph per padded size first derives its inputs on the device from the last result
(`ops.advance_spec_inputs`: the last emitted token and the next drafts, positions, slots, lengths,
each request's budget of tokens left), then runs the same step; the host uploads only the page tables,
allocated for the furthest the step can reach. Both graphs write their result to one static buffer,
which the chained graph reads first.
Sampled or logprob requests keep the two-graph path (`ModelRunner.forward_verify` + the MTP drafter).
"""

from __future__ import annotations

import torch

from specmla.engine import compile_guard
from specmla.engine.cuda_graphs import BatchGraphs
from specmla.engine.kv_pool import KVPool
from specmla.engine.mtp_graph import mtp_draft_chain
from specmla.model.deepseek import DeepseekForCausalLM
from specmla.model.metadata import AttentionMetadata
from specmla.ops.spec_accept import accept_and_place, advance_spec_inputs


class GraphedSpecStep(BatchGraphs):
    """Static-buffer greedy MTP step for k drafts per request, captured per padded batch size, in two variants:
    inputs uploaded by the host (`launch`), or derived on the device from the last result (`launch_chained`)."""

    def __init__(self, model: DeepseekForCausalLM, pool: KVPool, max_num_seqs: int, max_pages_per_seq: int,
                 k: int, use_graphs: bool = True):
        if not len(model.mtp):
            raise ValueError("a graphed MTP step needs a model with MTP layers")
        if k < 1:
            raise ValueError("k must be >= 1")
        S, P = k + 1, max_pages_per_seq
        # int64: ids | positions | slots (S each) | num_drafts | remaining; int32: seq_lens | page table
        super().__init__(pool, max_num_seqs, use_graphs, n_long=3 * S + 2, n_int=1 + P)
        self.model, self.k, self.S, self.max_pages_per_seq = model, k, S, P
        n, dev = self.sizes[-1], pool.device
        self.cu_a = torch.arange(n + 1, dtype=torch.int32, device=dev) * S
        self.cu_b = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.row_start = torch.arange(n, device=dev) * S
        self.last_pos = model.max_positions - 1
        # the last step's result (either variant): tokens (S) | emitted | drafts used | next drafts (k)
        self.result = torch.zeros(n, S + 2 + k, dtype=torch.long, device=dev)
        self.chained: dict[int, torch.cuda.CUDAGraph] = {}
        self.last_size: int | None = None  # the padded size of the last launch (a chained launch continues it)

    def pad(self, b: int) -> None:
        self.load([], [], [], [], [], [], pad_to=b)

    def _views(self, b: int) -> dict[str, torch.Tensor]:
        """Inputs of padded size b: views of the flat buffers, laid out per padded size (see `load`)."""
        S, P = self.S, self.max_pages_per_seq
        longs, ints = self._long, self._int
        return dict(ids=longs[: b * S], pos=longs[b * S : 2 * b * S], slots=longs[2 * b * S : 3 * b * S],
                    num_drafts=longs[3 * b * S : 3 * b * S + b], remaining=longs[3 * b * S + b : 3 * b * S + 2 * b],
                    seq_lens=ints[:b], table=ints[b : b + b * P].view(b, P))

    def _forward(self, b: int) -> torch.Tensor:
        model, pool, S, k, P = self.model, self.pool, self.S, self.k, self.max_pages_per_seq
        d = self._views(b)
        table, ps = d["table"], pool.page_size
        meta = AttentionMetadata(
            positions=d["pos"], cu_seqlens_q=self.cu_a[: b + 1], seq_lens=d["seq_lens"], max_seqlen_q=S,
            max_seqlen_kv=P * ps, slot_mapping=d["slots"], block_table=table, decode_query_len=S,
            kv_format=pool.kv_format,
        )
        hidden = model(d["ids"], meta, pool.caches)
        argmax = model.greedy_tokens(hidden).view(b, S)
        # accepted drafts, and where draft step j sits (start + accepted + j) with its cache slot
        tokens, accepted, pos, slots, lens = accept_and_place(
            d["ids"].view(b, S), d["num_drafts"], argmax, d["pos"].view(b, S)[:, 0], table, ps, k - 1)
        draft_metas = [AttentionMetadata(  # drafts past the context: the last rope position (never proposed)
            positions=pos[j].clamp_max(self.last_pos), cu_seqlens_q=self.cu_b[: b + 1], seq_lens=lens[j],
            max_seqlen_q=1, max_seqlen_kv=P * ps, slot_mapping=slots[j], block_table=table, decode_query_len=1,
            kv_format=pool.kv_format,
        ) for j in range(k - 1)]
        drafts = mtp_draft_chain(model, pool.caches, tokens.reshape(-1), hidden, meta,
                                 self.row_start[:b] + accepted, draft_metas)
        out = self.result[:b]
        out.copy_(torch.cat([tokens, (accepted + 1)[:, None], d["num_drafts"][:, None], drafts], 1))
        return out

    def _forward_chained(self, b: int) -> torch.Tensor:
        """The next step, its inputs derived from the last result (which this step then overwrites)."""
        d = self._views(b)
        S = self.S
        advance_spec_inputs(self.result[:b], d["ids"].view(b, S), d["pos"].view(b, S), d["slots"].view(b, S),
                            d["num_drafts"], d["remaining"], d["seq_lens"], d["table"], self.pool.page_size,
                            self.pool.scratch_page, self.last_pos)
        return self._forward(b)

    @torch.inference_mode()
    def capture(self, b: int) -> None:
        """Both variants of padded size b (the chained one right after the plain one: the same inputs do)."""
        super().capture(b)
        if self.use_graphs and b not in self.chained:
            compile_guard.note(f"CUDA graph capture of GraphedSpecStep (chained) at batch {b}")
            torch.cuda.synchronize()
            self._forward_chained(b)  # its advance kernel compiles here, outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.mempool):
                self._forward_chained(b)
            self.chained[b] = graph

    def load(self, input_ids: list[int], num_drafts: list[int], positions: list[int], slots: list[int],
             seq_lens: list[int], tables: list[list[int]], remaining: list[int] | None = None,
             pad_to: int | None = None) -> int:
        """Copy one batch into the static buffers; returns the padded size (pad_to: that one instead of B's).
        input_ids / positions / slots: S per request, flattened (the last token, then k drafts padded with any
        token); seq_lens: start + S; tables: each request's pages, covering start + 2k positions; remaining: the
        tokens each request may still emit (for chained steps; default: no limit)."""
        B, S, P = len(seq_lens), self.S, self.max_pages_per_seq
        b = self.padded_size(B) if pad_to is None else pad_to
        if b is None or len(input_ids) != B * S or any(len(t) > P for t in tables):
            raise ValueError("batch does not fit the graphed MTP step")
        long_host, int_host = self._staging()
        longs = long_host.numpy()[: 3 * b * S + 2 * b]  # laid out as `_views` reads them
        self._fill_queries(longs[: b * S], longs[b * S : 2 * b * S], longs[2 * b * S : 3 * b * S], input_ids,
                           positions, slots, S)
        nd, rem = longs[3 * b * S : 3 * b * S + b], longs[3 * b * S + b :]
        nd[:B], nd[B:] = num_drafts, 0
        rem[:B], rem[B:] = remaining if remaining is not None else [2**62] * B, 0  # padded rows: dead
        ints = int_host.numpy()[: b + b * P]
        ints[:B], ints[B:b] = seq_lens, S
        self._fill_tables(ints[b:].reshape(b, P), tables)
        self._upload(3 * b * S + 2 * b, b + b * P)
        return b

    @torch.inference_mode()
    def launch(self, input_ids, num_drafts, positions, slots, seq_lens, tables, remaining=None) -> torch.Tensor:
        """One step from the host's inputs; its result [B, S + 2 + k] on the device (not waited for)."""
        B = len(seq_lens)
        b = self.load(input_ids, num_drafts, positions, slots, seq_lens, tables, remaining)
        self.last_size = b
        return self._replay(b)[:B]

    @torch.inference_mode()
    def launch_chained(self, tables: list[list[int]]) -> torch.Tensor:
        """The step after the last launch, for the same requests (in the same order), its inputs derived on the
        device from that step's result; tables: their pages, covering every position the step can write. Returns
        its result [B, S + 2 + k] on the device."""
        b, B, P = self.last_size, len(tables), self.max_pages_per_seq
        if b is None or self.padded_size(B) != b or any(len(t) > P for t in tables):
            raise ValueError("a chained step continues the last launch's batch")
        _, int_host = self._staging()
        table = int_host.numpy()[b : b + b * P].reshape(b, P)
        self._fill_tables(table, tables)
        self._upload(0, b + b * P)  # (seq_lens uploaded too, then rewritten on the device)
        if not self.use_graphs:
            return self._forward_chained(b)[:B]
        if b not in self.chained:
            self.capture(b)
        self.chained[b].replay()
        return self.result[:B]

    @torch.inference_mode()
    def run(self, input_ids, num_drafts, positions, slots, seq_lens, tables, remaining=None) -> list[list[int]]:
        """One step, waited for: per request [tokens (S) | emitted | drafts used | next drafts (k)]."""
        return self.launch(input_ids, num_drafts, positions, slots, seq_lens, tables, remaining).tolist()
