"""Decode steps replayed from CUDA graphs.

A decode step (one new token per request) launches hundreds of small kernels; replaying a captured
graph removes their launch cost. One graph is captured per padded batch size (1, 2, 4, 8, then
multiples of 16) by the engine's warm-up (`capture`), over static input buffers: a batch of B
requests is copied into the buffers, padded to the next captured size, and the graph is replayed.
Padded rows read and write only a scratch page that no request owns, with length 1, so they cannot
disturb real requests.

With `use_graphs=False` (CPU) the same static-buffer path runs eagerly, which lets the padding logic
be tested without a GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from specmla.engine import compile_guard
from specmla.engine.kv_pool import KVPool
from specmla.model.deepseek import DeepseekForCausalLM
from specmla.model.metadata import AttentionMetadata


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] < max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class BatchGraphs:
    """What every static-buffer step shares: padded batch sizes, one CUDA graph per padded size
    (captured by `capture` at warm-up, or on first use; replayed; run eagerly on CPU), and the step's
    integer inputs in two flat device buffers (int64 and int32) uploaded from pinned host twins: two
    copies per step. The twins come in two sets used in turn, so filling step n + 1's waits only for
    step n - 1's copies (a pipelined engine launches step n + 1 while step n's upload may still sit
    behind queued work)."""

    def __init__(self, pool: KVPool, max_num_seqs: int, use_graphs: bool, n_long: int, n_int: int):
        """n_long / n_int: the buffers' lengths per request of the largest padded size."""
        if pool.scratch_page is None:
            raise ValueError(f"{type(self).__name__} needs a KV pool with a scratch page")
        self.pool = pool
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.use_graphs = use_graphs
        n, dev, pin = self.sizes[-1], pool.device, pool.device.type == "cuda"
        self._hosts = [(torch.zeros(n * n_long, dtype=torch.long, pin_memory=pin),
                        torch.zeros(n * n_int, dtype=torch.int32, pin_memory=pin)) for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]  # recorded after each set's last upload
        self._turn = 0  # the set the next step fills
        self._long = torch.zeros(n * n_long, dtype=torch.long, device=dev)
        self._int = torch.zeros(n * n_int, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, object] = {}
        self.mempool = torch.cuda.graph_pool_handle() if use_graphs else None

    def padded_size(self, batch: int) -> int | None:
        return next((b for b in self.sizes if b >= batch), None)

    def _forward(self, b: int):
        raise NotImplementedError

    def _staging(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's pinned host twins, once the copies that last read them have finished."""
        done = self._copied[self._turn]
        if done is not None:
            done.synchronize()
        return self._hosts[self._turn]

    def _upload(self, n_long: int | None = None, n_int: int | None = None) -> None:
        """Copy the first n_long / n_int entries (default all) of this step's host twins to the device; the next
        step fills the other set."""
        nb = self._long.is_cuda  # from pinned memory, asynchronously
        long_host, int_host = self._hosts[self._turn]
        self._long[:n_long].copy_(long_host[:n_long], non_blocking=nb)
        self._int[:n_int].copy_(int_host[:n_int], non_blocking=nb)
        if nb:
            self._copied[self._turn] = torch.cuda.Event()
            self._copied[self._turn].record()
        self._turn ^= 1

    def _fill_queries(self, ids, pos, slot, input_ids: list[int], positions: list[int], slots: list[int],
                      S: int) -> None:
        """Write a batch's query rows (S per request) into host views of padded length b·S; padded
        requests take token 0 at positions 0..S-1 of the scratch page, which no request owns."""
        m, ps = len(input_ids), self.pool.page_size
        pad = np.arange(m, len(ids)) % S
        ids[:m], ids[m:] = input_ids, 0
        pos[:m], pos[m:] = positions, pad
        slot[:m], slot[m:] = slots, self.pool.scratch_page * ps + pad % ps

    def _fill_tables(self, table, tables: list[list[int]]) -> None:
        """Write the requests' page lists into the host view `table` [b, P], the rest pointing at the
        scratch page."""
        table[:] = self.pool.scratch_page
        for i, t in enumerate(tables):
            table[i, : len(t)] = t

    def pad(self, b: int) -> None:
        """Fill the static inputs as a batch of padded size b with no request in it (every row writes and reads
        only the scratch page): what a capture runs on."""
        raise NotImplementedError

    @torch.inference_mode()
    def capture(self, b: int) -> None:
        """Capture padded size b's graph (once; nothing on CPU), on an empty batch of that size. The warm-up
        captures every size, largest first, so the smaller graphs' intermediates reuse the largest's blocks of
        the shared memory pool."""
        if self.use_graphs and b not in self.graphs:
            self.pad(b)
            self._capture(b)

    def _capture(self, b: int) -> None:
        compile_guard.note(f"CUDA graph capture of {type(self).__name__} at batch {b}")
        torch.cuda.synchronize()
        self._forward(b)  # warm-up: compile kernels, settle allocations outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            self.outputs[b] = self._forward(b)
        self.graphs[b] = graph

    def _replay(self, b: int):
        """The outputs of padded size b for the loaded inputs: a graph replay, or eager on CPU."""
        if not self.use_graphs:
            return self._forward(b)
        if b not in self.graphs:
            self._capture(b)
        self.graphs[b].replay()
        return self.outputs[b]


class GraphedDecoder(BatchGraphs):
    """Static-buffer decode forward for a fixed number S of query tokens per request (S = 1 for
    plain decode, 1 + k for speculative verification), captured per padded batch size."""

    def __init__(self, model: DeepseekForCausalLM, pool: KVPool, max_num_seqs: int, max_pages_per_seq: int,
                 use_graphs: bool = True, query_len: int = 1):
        S, P = query_len, max_pages_per_seq
        # int64: ids | positions | slots; int32: lengths | page table
        super().__init__(pool, max_num_seqs, use_graphs, n_long=3 * S, n_int=1 + P)
        self.model, self.S = model, S
        n, dev = self.sizes[-1], pool.device
        self.input_ids, self.positions, self.slot_mapping = self._long.view(3, n * S).unbind(0)
        self.seq_lens = self._int[:n]
        self.block_table = self._int[n:].view(n, P)
        self.seq_lens.fill_(S)
        self.block_table.fill_(pool.scratch_page)
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=dev) * S

    @property
    def max_pages_per_seq(self) -> int:
        return self.block_table.shape[1]

    def _meta(self, b: int) -> AttentionMetadata:
        S = self.S
        return AttentionMetadata(
            positions=self.positions[: b * S], cu_seqlens_q=self.cu_seqlens[: b + 1], seq_lens=self.seq_lens[:b],
            max_seqlen_q=S, max_seqlen_kv=self.max_pages_per_seq * self.pool.page_size,
            slot_mapping=self.slot_mapping[: b * S], block_table=self.block_table[:b], decode_query_len=S,
            kv_format=self.pool.kv_format,
        )

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(self.input_ids[: b * self.S], self._meta(b), self.pool.caches)
        return hidden, self.model.compute_logits(hidden)

    def pad(self, b: int) -> None:
        self.load([], [], [], [], [], pad_to=b)

    def load(self, input_ids: list[int] | torch.Tensor, positions: list[int], slots: list[int], seq_lens: list[int],
             tables: list[list[int]], pad_to: int | None = None) -> int:
        """Copy one batch (S tokens per request, flattened) into the static buffers; returns the
        padded size (pad_to: that one instead of B's). Padded requests write only the scratch page and read only
        it. input_ids may be a device tensor (a previous step's tokens, not on the host yet): copied on the device
        after the upload."""
        B, S = len(seq_lens), self.S
        b = self.padded_size(B) if pad_to is None else pad_to
        on_device = isinstance(input_ids, torch.Tensor)
        if b is None or len(input_ids) != B * S or any(len(t) > self.max_pages_per_seq for t in tables):
            raise ValueError("batch does not fit the graphed decoder")
        n, P = self.sizes[-1], self.max_pages_per_seq
        long_host, int_host = self._staging()
        longs = long_host.numpy().reshape(3, n * S)[:, : b * S]
        self._fill_queries(longs[0], longs[1], longs[2], [0] * (B * S) if on_device else input_ids, positions,
                           slots, S)
        ints = int_host.numpy()
        ints[:B], ints[B:b] = seq_lens, S
        self._fill_tables(ints[n:].reshape(n, P)[:b], tables)
        self._upload()
        if on_device:  # ordered after the upload on the stream
            self.input_ids[: B * S].copy_(input_ids)
        return b

    @torch.inference_mode()
    def run(self, input_ids, positions, slots, seq_lens, tables) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [B·S, hidden], logits [B·S, V]) of one step (replayed from a graph on CUDA)."""
        n = len(seq_lens) * self.S
        hidden, logits = self._replay(self.load(input_ids, positions, slots, seq_lens, tables))
        return hidden[:n], logits[:n]
