"""The MTP catch-up and k-draft loop of a speculative step, replayed from one CUDA graph.

After a verify step (S = 1 + k query rows per request) the MTP module must (A) catch up on the
positions the step verified — emitted_i = accepted + 1 rows, which varies per request and per step —
and (B) draft k tokens by applying itself recursively k - 1 more times. Run eagerly this is k
module forwards of a few dozen small kernels each plus host syncs; here it is one graph replay:

- Stage A always runs S rows per request, as a decode-shaped step (decode_query_len = S, positions
  start_i .. start_i + S - 1, seq_len start_i + S). The decode kernel's bottom-right causal mask lets
  row j see positions < start_i + j + 1, exactly what the eager catch-up over emitted_i rows gives
  its rows. Rows j >= emitted_i are garbage (token 0) but are written to their real cache slots:
  those positions are >= the request's last token, so the next catch-up rewrites them before any
  valid row reads them; leaving them unwritten would let stale (possibly non-finite) cache rows
  inside seq_len reach the valid rows of the same kernel tile through 0 · NaN.
- The MTP state at row emitted_i - 1 is gathered on the device (a static index buffer) and gives
  draft 1; stage B's k - 1 single-token steps each have their own static positions / slots / lengths.

The runner launches it as soon as a verify step's tokens are on the host, before the engine appends
them, and reads the drafts after that bookkeeping, which so overlaps the replay
(`ModelRunner.mtp_launch_after_verify` / `mtp_draft_after_verify`).

Graphs are captured lazily per padded batch size (`graph_batch_sizes`); padded requests use only
the scratch page. With `use_graphs=False` (CPU) the same static-buffer code runs eagerly, so tests
can check it against the eager proposer.
"""

from __future__ import annotations

import torch

from specmla.engine.cuda_graphs import BatchGraphs
from specmla.engine.kv_pool import KVPool
from specmla.model.deepseek import DeepseekForCausalLM
from specmla.model.metadata import AttentionMetadata


def mtp_draft_chain(model: DeepseekForCausalLM, caches, ids: torch.Tensor, hidden: torch.Tensor,
                    meta: AttentionMetadata, last: torch.Tensor, draft_metas: list[AttentionMetadata]) -> torch.Tensor:
    """Stage A then B on device tensors only (graph-capturable): the MTP module over the verified
    rows (ids = the token after each row's position, hidden = the trunk's states there), the state
    of row `last[i]` drafts request i's first token; draft_metas[j - 1] places draft step j. Returns
    the drafts [b, 1 + len(draft_metas)]."""
    h = model.mtp_forward(0, ids, hidden, meta, caches).index_select(0, last)
    tok = model.mtp_greedy_tokens(0, h)
    out = [tok]
    for j, m in enumerate(draft_metas, 1):  # position total_len - 2 + j takes (previous MTP state, previous draft)
        layer = j % len(model.mtp)
        h = model.mtp_forward(layer, tok, h, m, caches)
        tok = model.mtp_greedy_tokens(layer, h)
        out.append(tok)
    return torch.stack(out, 1)


class GraphedMtpDrafter(BatchGraphs):
    """Static-buffer MTP catch-up (S = 1 + k rows per request) + num_draft - 1 recursive draft steps
    (num_draft = k for MTP; hybrid drafts only its MTP share and lets the n-gram proposer extend)."""

    def __init__(self, model: DeepseekForCausalLM, pool: KVPool, max_num_seqs: int, max_pages_per_seq: int,
                 k: int, use_graphs: bool = True, num_draft: int | None = None):
        if not len(model.mtp):
            raise ValueError("graphed MTP drafting needs a model with MTP layers")
        if k < 1:
            raise ValueError("k must be >= 1")
        nd = k if num_draft is None else num_draft
        if not 1 <= nd <= k:
            raise ValueError(f"num_draft must be in 1..k={k}, got {nd}")
        S, P = k + 1, max_pages_per_seq
        # laid out per padded size b (see `_views`), so a step writes and uploads one prefix of each
        super().__init__(pool, max_num_seqs, use_graphs, n_long=3 * S + 1 + 2 * (nd - 1), n_int=nd + P)
        self.model, self.k, self.S, self.num_draft, self.max_pages_per_seq = model, k, S, nd, P
        n, dev = self.sizes[-1], pool.device
        self.hidden = torch.zeros(n * S, model.config.hidden_size, dtype=model.model.embed_tokens.weight.dtype,
                                  device=dev)
        self.cu_a = torch.arange(n + 1, dtype=torch.int32, device=dev) * S
        self.cu_b = torch.arange(n + 1, dtype=torch.int32, device=dev)

    def _views(self, b: int) -> dict[str, torch.Tensor]:
        """The inputs of padded size b as views of the flat device buffers (prefixes, in `load`'s order)."""
        S, nd, P = self.S, self.num_draft, self.max_pages_per_seq
        d, off = {}, 0
        for name, m in (("ids", b * S), ("pos", b * S), ("slots", b * S), ("last", b), ("draft_pos", (nd - 1) * b),
                        ("draft_slots", (nd - 1) * b)):
            d[name], off = self._long[off : off + m], off + m
        off = 0
        for name, m in (("seq_lens", b), ("draft_seq_lens", (nd - 1) * b), ("table", b * P)):
            d[name], off = self._int[off : off + m], off + m
        for name in ("draft_pos", "draft_slots", "draft_seq_lens"):
            d[name] = d[name].view(nd - 1, b)
        d["table"] = d["table"].view(b, P)
        return d

    def pad(self, b: int) -> None:
        self.load(self.hidden[:0], [], [], [], [], [], [], [], [], pad_to=b)

    # ---- the step ------------------------------------------------------------------------------
    def _forward(self, b: int) -> torch.Tensor:
        model, pool, S, P = self.model, self.pool, self.S, self.max_pages_per_seq
        d = self._views(b)
        table = d["table"]
        meta = AttentionMetadata(
            positions=d["pos"], cu_seqlens_q=self.cu_a[: b + 1], seq_lens=d["seq_lens"], max_seqlen_q=S,
            max_seqlen_kv=P * pool.page_size, slot_mapping=d["slots"], block_table=table, decode_query_len=S,
            kv_format=pool.kv_format,
        )
        draft_metas = [AttentionMetadata(
            positions=d["draft_pos"][j - 1], cu_seqlens_q=self.cu_b[: b + 1], seq_lens=d["draft_seq_lens"][j - 1],
            max_seqlen_q=1, max_seqlen_kv=P * pool.page_size, slot_mapping=d["draft_slots"][j - 1],
            block_table=table, decode_query_len=1, kv_format=pool.kv_format,
        ) for j in range(1, self.num_draft)]
        return mtp_draft_chain(model, pool.caches, d["ids"], self.hidden[: b * S], meta, d["last"], draft_metas)

    def load(self, hidden: torch.Tensor, input_ids: list[int], positions: list[int], slots: list[int],
             seq_lens: list[int], last: list[int], draft_positions: list[list[int]], draft_slots: list[list[int]],
             tables: list[list[int]], pad_to: int | None = None) -> int:
        """Copy one batch into the static buffers; returns the padded size.

        hidden [B·S, hidden]: the verify step's trunk states (S rows per request); input_ids /
        positions / slots: S per request, flattened; seq_lens: start + S per request; last: the row
        (0..S-1) of each request whose MTP state drafts; draft_positions / draft_slots: num_draft - 1 per
        request (draft step j at position total_len - 2 + j); tables: each request's pages. pad_to: a padded
        size to fill up to instead of B's (an empty batch of size pad_to: a capture's inputs)."""
        B, S, P = len(seq_lens), self.S, self.max_pages_per_seq
        b = self.padded_size(B) if pad_to is None else pad_to
        if (b is None or len(input_ids) != B * S or hidden.shape[0] != B * S
                or any(len(t) > P for t in tables)):
            raise ValueError("batch does not fit the graphed MTP drafter")
        long_host, int_host = self._staging()
        ps, scratch = self.pool.page_size, self.pool.scratch_page
        pad = b - B
        # one list per flat buffer, in `_views`' order; padded requests use positions 0.. and the scratch page
        longs = (input_ids + [0] * (pad * S)
                 + positions + list(range(S)) * pad
                 + slots + [scratch * ps + j % ps for j in range(S)] * pad
                 + [i * S + r for i, r in enumerate(last)] + [i * S for i in range(B, b)])
        ints = seq_lens + [S] * pad
        steps = range(1, self.num_draft)  # draft step j's rows: its positions, slots and lengths per request
        draft_pos_rows = [[p[j - 1] for p in draft_positions] for j in steps]
        for j, row in zip(steps, draft_pos_rows):
            longs += [*row, *[j] * pad]
        for j in steps:
            longs += [*(d[j - 1] for d in draft_slots), *[scratch * ps + j % ps] * pad]
        for j, row in zip(steps, draft_pos_rows):
            ints += [p + 1 for p in row] + [j + 1] * pad
        for t in tables:
            ints += t + [scratch] * (P - len(t))
        ints += [scratch] * (P * pad)
        nl, ni = len(longs), len(ints)
        long_host[:nl] = torch.tensor(longs, dtype=torch.long)
        int_host[:ni] = torch.tensor(ints, dtype=torch.int32)
        self._upload(nl, ni)
        self.hidden[: B * S].copy_(hidden)
        return b

    @torch.inference_mode()
    def run(self, hidden, input_ids, positions, slots, seq_lens, last, draft_positions, draft_slots,
            tables) -> torch.Tensor:
        """Drafts [B, num_draft] (int64, on the device) of one step, replayed from a graph on CUDA."""
        B = len(seq_lens)
        drafts = self._replay(self.load(hidden, input_ids, positions, slots, seq_lens, last, draft_positions,
                                        draft_slots, tables))
        return drafts[:B]
