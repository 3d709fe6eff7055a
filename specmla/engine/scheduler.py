"""Which requests run in this step, and how many tokens each computes.

Each step fills a token budget (`max_num_batched_tokens`): first one token for every running
request that is decoding, then prefill chunks — running requests part-way through their prompt,
then waiting requests in arrival order — so a long prompt is cut into chunks and never stalls the
decodes. When a decode needs a page and none is free, the newest running request is preempted: its
pages are released and it goes back to the head of the waiting queue, to be recomputed (prefix
caching usually brings most of its pages back).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specmla.engine.kv_pool import KVPool
from specmla.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    decode: list[Sequence] = field(default_factory=list)  # one new token each
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (request, chunk length)
    rejected: list[tuple[Sequence, str]] = field(default_factory=list)  # can never run: (request, why)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.decode or self.prefill)

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)


# tokens per step by default: the knee of prompt tok/s against the chunk size on a DeepSeek-V2-Lite-shaped model
# (docs/benchmarks.md, section 6); larger steps gain little and hold decodes longer while a long prompt prefills
DEFAULT_MAX_NUM_BATCHED_TOKENS = 4096


class Scheduler:
    def __init__(self, pool: KVPool, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                 lookahead: int = 0):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lookahead = lookahead  # speculative decoding: each decode also verifies this many drafts
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted (holding pages), oldest first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Forget a finished or aborted request and release its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.free(seq.seq_id)

    @staticmethod
    def is_decoding(seq: Sequence) -> bool:
        return seq.num_cached == seq.total_len - 1 and bool(seq.output_ids)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.pool.free(seq.seq_id)
        seq.num_cached = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledBatch:
        batch = self._schedule_once()
        while batch.is_empty and len(self.running) > 1:
            # every admitted request is stuck waiting for pages the others hold: release the newest
            newest = self.running[-1]
            preempted = batch.preempted + [newest]
            self._preempt(newest, ScheduledBatch())
            batch = self._schedule_once()
            batch.preempted = preempted + batch.preempted
        return batch

    def _schedule_once(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        pool, page = self.pool, self.pool.page_size

        # 1. decodes, oldest first; make room by preempting the newest running requests
        need = 1 + self.lookahead
        decoding: set[int] = set()  # seq_ids in batch.decode
        for seq in list(self.running):
            if budget < need:
                break
            if seq.status is not Status.RUNNING or not self.is_decoding(seq):  # preempted in this pass
                continue
            while not pool.can_allocate(seq.seq_id, seq.total_len + self.lookahead):
                victims = [s for s in self.running if s is not seq and s.seq_id not in decoding]
                self._preempt(victims[-1] if victims else seq, batch)
                if not victims:
                    break
            if seq.status is not Status.RUNNING:
                continue
            pool.allocate(seq.seq_id, seq.total_len + self.lookahead)
            batch.decode.append(seq)
            decoding.add(seq.seq_id)
            budget -= need

        # 2. prefill chunks of admitted requests, then admit waiting ones in arrival order
        for seq in self.running:
            if budget == 0:
                break
            if seq.seq_id in decoding or self.is_decoding(seq):
                continue
            chunk = self._fit_chunk(seq, budget)
            if chunk == 0:
                break
            batch.prefill.append((seq, chunk))
            budget -= chunk
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if -(-seq.total_len // page) > pool.num_pages:
                self.waiting.popleft()
                batch.rejected.append(
                    (seq, f"the request needs {-(-seq.total_len // page)} KV pages; the pool has {pool.num_pages}")
                )
                continue
            if not pool.pages_of(seq.seq_id):
                seq.num_cached = pool.match_prefix(seq.seq_id, seq.all_ids)
            chunk = self._fit_chunk(seq, budget)
            if chunk == 0:  # no room: do not sit on the matched prefix pages while waiting
                pool.free(seq.seq_id)
                seq.num_cached = 0
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.prefill.append((seq, chunk))
            budget -= chunk
        return batch

    def _fit_chunk(self, seq: Sequence, budget: int) -> int:
        """Largest chunk ≤ budget of seq's uncomputed tokens that the free pages can hold; allocates it."""
        pool = self.pool
        chunk = min(seq.total_len - seq.num_cached, budget)
        room = (len(pool.pages_of(seq.seq_id)) + pool.num_free_pages()) * pool.page_size - seq.num_cached
        chunk = max(0, min(chunk, room))
        if chunk:
            pool.allocate(seq.seq_id, seq.num_cached + chunk)
        return chunk
