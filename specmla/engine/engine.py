"""The generation loop: admit requests, prefill, decode, sample, detokenise, finish, free pages.

Continuous batching: every step the scheduler picks decode tokens and prefill chunks under a token
budget; the decode part runs the absorbed attention over the paged cache, the prefill part the MHA
form; requests that finish free their pages at once and new ones join the next step.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specmla.engine.detokenizer import IncrementalDetokenizer
from specmla.engine.draft_policy import DraftPolicy
from specmla.engine.kv_pool import KVPool
from specmla.engine.runner import ModelRunner, to_device_ints
from specmla.engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, ScheduledBatch, Scheduler
from specmla.engine.sequence import Sequence, Status
from specmla.engine.spec import SpecStats, greedy_accept, verify
from specmla.model.deepseek import DeepseekForCausalLM
from specmla.ops.kv_cache import row_spec
from specmla.sampling_params import SamplingParams
from specmla.tokenizer import Tokenizer

log = logging.getLogger("specmla.engine")


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list | None = None
    metrics: dict = field(default_factory=dict)
    finished: bool = True
    error: str | None = None  # finish_reason "error": why (also in `text`)
    error_reason: str | None = None  # finish_reason "error": a metrics label, one of LLMEngine.FAILURE_REASONS


@dataclass
class _Snapshot:
    """What a step may change in one request, taken before the step so a failed step can be undone."""

    num_output: int
    num_logprobs: int
    num_cached: int
    text: str
    detok: tuple | None
    drafts: list[int]

    @classmethod
    def of(cls, s: Sequence) -> "_Snapshot":
        d = s.detok
        return cls(len(s.output_ids), len(s.logprobs), s.num_cached, s.text,
                   None if d is None else (d.prefix, d.read, d.text), list(s.drafts))

    def restore(self, s: Sequence) -> None:
        s.truncate(self.num_output)
        del s.logprobs[self.num_logprobs :]
        s.num_cached, s.text, s.drafts = self.num_cached, self.text, list(self.drafts)
        if self.detok is None:
            s.detok = None
        else:
            s.detok.prefix, s.detok.read, s.detok.text = self.detok


@dataclass
class _Ahead:
    """A decode step launched before the step it follows had its tokens on the host (`LLMEngine.pipeline_decode`):
    row of each request in `tokens` (its sampled tokens, on the device) and its num_cached at the launch."""

    rows: dict[int, int]
    cached: dict[int, int]
    tokens: torch.Tensor

    def rows_for(self, seqs: list[Sequence]) -> list[int] | None:
        """The rows of `seqs`, or None when one of them is not in this step or moved since (preempted)."""
        rows = []
        for s in seqs:
            r = self.rows.get(s.seq_id)
            if r is None or self.cached[s.seq_id] != s.num_cached:
                return None
            rows.append(r)
        return rows


@dataclass
class _SpecAhead:
    """A greedy MTP step launched before the step it follows was read (`LLMEngine._whole_spec_step`): the requests
    it runs (in order), their cache lengths once that step's tokens were taken, and its result on the device."""

    seq_ids: list[int]
    cached: list[int]
    out: torch.Tensor

    def take(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """Its result, when `seqs` are exactly its requests, unchanged since (not preempted, not ended)."""
        if [s.seq_id for s in seqs] != self.seq_ids or [s.num_cached for s in seqs] != self.cached:
            return None
        return self.out


class LLMEngine:
    # labels of `failures` and of Sequence.error_reason
    FAILURE_REASONS = ("invalid_request", "kv_capacity", "step_error")

    def __init__(
        self,
        model: DeepseekForCausalLM,
        tokenizer: Tokenizer | None,
        pool: KVPool,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        proposer=None,
        fault_hook: Callable[[list[Sequence]], None] | None = None,
        pipeline_decode: bool = True,
        policy: DraftPolicy | None = None,
    ):
        """`fault_hook` (tests): called with the requests about to be sampled in every model call; an
        exception it raises is handled like any failure inside a step.

        `pipeline_decode`: in a step without speculation or logprobs, launch the next (graphed) decode step of
        the requests sampled here that can go on, before this step's tokens come back to the host, feeding it
        those tokens on the device; the next step's decodes take its result when they are among those requests.
        The host's bookkeeping and the next graph's launch then overlap the GPU's work instead of leaving it idle
        between steps. A request that finishes on a token the host has not seen yet
        (EOS, a stop string) had one extra token computed, which is dropped; its cache write lands on its own
        pages, beyond its computed tokens.

        `policy` (with a proposer): the `auto` draft length; each decode step speculates or runs plainly (and then
        pipelined) as it chooses. None: every decode step speculates."""
        self.model, self.tokenizer, self.pool = model, tokenizer, pool
        self.runner = ModelRunner(model, pool)
        self.proposer = proposer  # speculative decoding when set
        self.policy = policy if proposer is not None else None
        self.spec_stats = SpecStats()
        self.scheduler = Scheduler(pool, max_num_seqs, max_num_batched_tokens,
                                   lookahead=proposer.k if proposer else 0)
        self.max_model_len = max_model_len or model.max_positions
        cfg = model.config
        eos = set(cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = eos
        self.naive_decode = False  # tests: run decode through the MHA form instead of the absorbed one
        self.fault_hook = fault_hook
        self.failures: Counter[str] = Counter()  # requests ended with an error, by FAILURE_REASONS label
        self.num_failed_steps = 0  # steps that raised and were retried request by request
        self._unfinished: dict[int, Sequence] = {}  # request_id → its sequence, until it finishes
        self.pipeline_decode = pipeline_decode
        self._ahead: _Ahead | None = None  # the decode step launched ahead, if any
        self._spec_ahead: _SpecAhead | None = None  # the greedy MTP step launched ahead, if any
        self._step_speculated: bool | None = None  # the policy's choice for this step's decodes (None: no choice)
        self._prompt_seen: set[int] = set()  # requests whose prompt's MTP catch-up the policy has decided

    @property
    def max_total_tokens(self) -> int:
        """The most tokens (prompt + max_tokens) one request may ever hold: the context, or less where
        the KV pool (with the speculative lookahead) is smaller."""
        lookahead = self.scheduler.lookahead
        return min(self.max_model_len, self.pool.num_pages * self.pool.page_size - lookahead + 1)

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams, admit_unfittable: bool = False
                    ) -> Sequence:
        """Admit one request, or raise ValueError (naming the bad field) before any engine state changes.

        A request whose prompt + max_tokens (capped by the context) can never fit in the KV pool is
        rejected here too; with `admit_unfittable` (offline `LLM.generate`) it is returned instead,
        already finished with finish_reason "error" and the reason in `error`."""
        try:
            ids, text = self._check_request(prompt, params)
        except ValueError:
            self.failures["invalid_request"] += 1
            raise
        seq = Sequence(prompt_ids=ids, params=params, prompt=text)
        why = self._never_fits(seq)
        if why is not None:
            if not admit_unfittable:
                self.failures["kv_capacity"] += 1
                raise ValueError(why)
            self._fail(seq, why, "kv_capacity")
            return seq
        self._unfinished[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq

    def _never_fits(self, seq: Sequence) -> str | None:
        total = min(seq.total_len + seq.params.max_tokens, self.max_model_len)
        if total <= self.max_total_tokens:
            return None
        page = self.pool.page_size
        need = -(-(total - 1 + self.scheduler.lookahead) // page)
        return (f"the request needs {need} KV pages (prompt {seq.total_len} + max_tokens {seq.params.max_tokens} "
                f"tokens); the pool has {self.pool.num_pages}: at most {self.max_total_tokens} tokens per request")

    def _check_request(self, prompt, params) -> tuple[list[int], str | None]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()  # fields may have changed since construction
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids")
            ids, text = self.tokenizer.encode(prompt), prompt
        elif isinstance(prompt, (list, tuple)):
            ids, text = list(prompt), None
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("empty prompt")
        vocab = self.model.config.vocab_size
        if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context is {self.max_model_len}")
        return ids, text

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self):
        return self.scheduler.running

    # ---- one step ----------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Schedule, run the decode and prefill parts, sample where a request's tokens are all
        computed; returns the sequences that got a new token or finished.

        A step that raises is undone and its requests run again one at a time, so the failure is
        attributed: a request that fails alone finishes with finish_reason "error" (its pages freed),
        the others advance exactly as they would have."""
        step_start = time.perf_counter()
        batch = self.scheduler.schedule()
        for seq, why in batch.rejected:
            self._fail(seq, why, "kv_capacity")
        members = batch.decode + [s for s, _ in batch.prefill]
        snaps = {s.seq_id: _Snapshot.of(s) for s in members}
        self._step_speculated = None
        try:
            ready = self._run(batch)
            out = batch.decode + ready
            if self.policy is not None and self._step_speculated is not None and not batch.prefill:
                self.policy.record(self._step_speculated, len(batch.decode), time.perf_counter() - step_start)
        except Exception:
            log.exception("an engine step over %d requests failed; retrying them one by one", len(members))
            self._ahead = self._spec_ahead = None
            self.num_failed_steps += 1
            out = self._retry_alone(batch, snaps)
        out += [s for s, _ in batch.rejected]
        self._stamp_handed_back(out, step_start)
        return out

    def _run(self, batch: ScheduledBatch, pipelined: bool = True) -> list[Sequence]:
        """One model pass over the batch's decodes and prefill chunks; returns the requests sampled."""
        self._decide_prompt_catch_up(batch)
        speculate = self._speculates(batch)
        if pipelined and self._pipelines(batch, speculate):
            return self._run_pipelined(batch)
        self._ahead = None
        ready: list[Sequence] = []
        logits = []
        if batch.decode and speculate:
            self._speculative_decode(batch.decode, pipelined)
        elif batch.decode:
            dec = self.runner.forward_logits(batch.decode, [1] * len(batch.decode), naive_context=self.naive_decode)
            # graphed logits live in the graph's output buffer, which the prefill part's one-token chunks (they
            # replay the decode graphs) may overwrite before the sampling below
            logits.append(dec.clone() if batch.prefill else dec)
            ready += batch.decode
        prefill_hidden = None
        if batch.prefill:
            seqs = [s for s, _ in batch.prefill]
            out = self.runner.forward_logits(seqs, [n for _, n in batch.prefill])
            prefill_hidden = self.runner.last_hidden
            done = [i for i, s in enumerate(seqs) if s.num_cached == s.total_len]
            if done:
                logits.append(out[done])
                ready += [seqs[i] for i in done]
        if ready:
            self._sample_and_append(ready, torch.cat(logits))
        if prefill_hidden is not None and self.proposer is not None and self.proposer.uses_mtp:
            hidden, starts, q_lens = prefill_hidden
            rows = hidden.split(q_lens)
            stale = self.policy.stale if self.policy is not None else ()
            items = [(s, st, h) for (s, _), st, h in zip(batch.prefill, starts, rows)
                     if not s.is_finished and s.seq_id not in stale]
            if items:
                self.runner.mtp_catch_up_and_draft(items, self._drafts_after_prefill())
        return ready

    def _retry_alone(self, batch: ScheduledBatch, snaps: dict[int, "_Snapshot"]) -> list[Sequence]:
        """Undo a failed step and run each of its unfinished requests as a batch of one, in the step's
        order; one that fails again is the culprit and finishes with an error. A request that finished
        in the failed step keeps its (complete, valid) result. Returns the requests handed back."""
        out: list[Sequence] = []
        items = [(s, 0) for s in batch.decode] + list(batch.prefill)
        for seq, _ in items:
            if seq.is_finished:
                out.append(seq)
            else:
                snaps[seq.seq_id].restore(seq)
        lookahead = self.scheduler.lookahead
        for seq, chunk in items:
            if seq.is_finished:
                continue
            snap = snaps[seq.seq_id]
            try:
                if chunk == 0:  # a decode: its slots (and the speculative lookahead's) again
                    self.pool.allocate(seq.seq_id, seq.total_len + lookahead)
                    alone = ScheduledBatch(decode=[seq])
                else:
                    self.pool.allocate(seq.seq_id, seq.num_cached + chunk)
                    alone = ScheduledBatch(prefill=[(seq, chunk)])
                self._run(alone, pipelined=False)
            except Exception as e:
                log.exception("request %d failed inside an engine step", seq.seq_id)
                if not seq.is_finished:
                    snap.restore(seq)
                    self._fail(seq, f"the request failed inside the engine ({type(e).__name__})", "step_error")
            out.append(seq)
        return out

    def _speculates(self, batch: ScheduledBatch) -> bool:
        """Whether this step's decodes speculate: always with a proposer and no policy; else the policy's choice
        (a step without decodes counts as speculative: it runs as before, not pipelined). A plain step under an MTP
        proposer leaves its requests without the MTP module's rows of that position: they draft no more."""
        if self.proposer is None:
            return False
        if self.policy is None or not batch.decode:
            return True
        spec = self.policy.choose([s.seq_id for s in batch.decode])
        self._step_speculated = spec
        if not spec:
            self._spec_ahead = None
            if self.proposer.uses_mtp:
                for s in batch.decode:
                    self.policy.mark_stale(s.seq_id)
                    s.drafts = []
        return spec

    def _decide_prompt_catch_up(self, batch: ScheduledBatch) -> None:
        """Under an MTP proposer with a policy: at a request's first prefill chunk, whether the MTP module catches up
        on its prompt (`DraftPolicy.admit`). A request refused is stale from its start: it decodes plainly, its
        prefill chunks skip the MTP pass and no longer keep the step from running pipelined."""
        if self.policy is None or not self.proposer.uses_mtp:
            return
        for s, _ in batch.prefill:
            if s.seq_id not in self._prompt_seen:
                self._prompt_seen.add(s.seq_id)
                if not self.policy.admit(len(self.scheduler.running)):
                    self.policy.mark_stale(s.seq_id)

    def _pipelines(self, batch: ScheduledBatch, speculate: bool) -> bool:
        """Whether this step runs pipelined (see `pipeline_decode`): a plain step, without logprobs, and without a
        prefill chunk whose prompt the MTP module must catch up on."""
        stale = self.policy.stale if self.policy is not None else ()
        mtp_prefill = (self.proposer is not None and self.proposer.uses_mtp
                       and any(s.seq_id not in stale for s, _ in batch.prefill))
        return (self.pipeline_decode and not speculate and not mtp_prefill and not self.naive_decode
                and all(s.params.logprobs is None for s in batch.decode)
                and all(s.params.logprobs is None for s, _ in batch.prefill))

    def _run_pipelined(self, batch: ScheduledBatch) -> list[Sequence]:
        """A step whose decodes take the step launched ahead when it covers them (else run now), and whose
        prefill chunks run now; then the next decode step of every request sampled here is launched before this
        step's tokens are brought to the host and appended."""
        ahead, self._ahead = self._ahead, None
        parts: list[tuple[list[Sequence], torch.Tensor]] = []  # requests sampled, their tokens on the device
        if batch.decode:
            seqs = batch.decode
            rows = ahead.rows_for(seqs) if ahead is not None else None
            if rows is not None:
                whole = rows == list(range(len(ahead.rows)))
                tokens = ahead.tokens if whole else ahead.tokens[_index(rows, ahead.tokens)]
                self.runner.commit_ahead(seqs)
            else:
                tokens = self.runner.sample(seqs, self.runner.forward_logits(seqs, [1] * len(seqs))).tokens
            parts.append((seqs, tokens))
        if batch.prefill:
            seqs = [s for s, _ in batch.prefill]
            logits = self.runner.forward_logits(seqs, [n for _, n in batch.prefill])
            done = [i for i, s in enumerate(seqs) if s.num_cached == s.total_len]
            if done:
                ready = [seqs[i] for i in done]
                rows = logits if len(done) == len(seqs) else logits[_index(done, logits)]
                parts.append((ready, self.runner.sample(ready, rows).tokens))
        if not parts:
            return []
        ready = [s for seqs, _ in parts for s in seqs]
        tokens = parts[0][1] if len(parts) == 1 else torch.cat([t for _, t in parts])
        host = tokens.to("cpu", non_blocking=tokens.is_cuda)  # queued before the next step's launch
        copied = None
        if tokens.is_cuda:
            copied = torch.cuda.Event()
            copied.record()
        self._ahead = self._launch_ahead(ready, tokens)
        if copied is not None:
            copied.synchronize()
        if self.fault_hook is not None:
            self.fault_hook(ready)
        for s, t in zip(ready, host.tolist()):
            self._append(s, t, None)
        return ready

    def _launch_ahead(self, seqs: list[Sequence], tokens: torch.Tensor) -> _Ahead | None:
        """Launch the step after this one for the requests of `seqs` that its tokens cannot end by length,
        when the pool has their next pages and the graphs take them; None otherwise."""
        keep = [i for i, s in enumerate(seqs)
                if len(s.output_ids) + 1 < s.params.max_tokens and s.total_len + 1 < self.max_model_len]
        if not keep:
            return None
        nxt = [seqs[i] for i in keep]
        if self.runner.graphed is None or self.runner.graphed.padded_size(len(nxt)) is None:
            return None
        pool = self.pool
        if sum(pool.pages_needed(s.seq_id, s.total_len + 1) for s in nxt) > pool.num_free_pages():
            return None  # the next step's scheduling decides who gets pages
        for s in nxt:
            pool.allocate(s.seq_id, s.total_len + 1)
        if not self.runner._graphable(nxt, [1] * len(nxt), False):
            return None
        ids = tokens if len(keep) == len(seqs) else tokens[_index(keep, tokens)]
        out = self.runner.decode_ahead(nxt, ids)
        return _Ahead({s.seq_id: i for i, s in enumerate(nxt)}, {s.seq_id: s.num_cached for s in nxt}, out)

    @staticmethod
    def _stamp_handed_back(seqs: list[Sequence], step_start: float) -> None:
        """A token reaches the caller (stream, server, generate) when step() returns, so a request's
        first-token time is taken here, and a finish time taken during this step moves here: work the
        step does after sampling (the MTP catch-up over a new prompt) is time the caller waits for that
        token. vLLM's TTFT too is taken from a step's outputs, after the whole step."""
        now = time.perf_counter()
        for s in seqs:
            if s.first_token_time is None and s.output_ids:
                s.first_token_time = now
            if s.finish_time is not None and s.finish_time >= step_start:
                s.finish_time = now

    def _drafts_after_prefill(self) -> int:
        """Tokens the MTP module drafts right after a prefill step. That drafting runs eagerly, so each
        draft past the first costs an eager MTP pass, many times a graphed decode step's, for about one
        accepted token once per request. So with graphed decode steps only the catch-up's own draft is
        kept; eager engines (CPU) draft them all, since every pass costs the same there."""
        n = self.proposer.num_mtp_drafts
        graphs = self.runner.graphed_mtp
        return min(n, 1) if graphs is not None and graphs.use_graphs else n

    def _speculative_decode(self, seqs: list[Sequence], pipelined: bool = True) -> None:
        """Draft, verify all drafts in one S = 1 + k pass, keep the accepted prefix + one token."""
        if self.fault_hook is not None:
            self.fault_hook(seqs)
        k = self.proposer.k
        stale = self.policy.stale if self.policy is not None else ()
        caps = [0 if s.seq_id in stale else
                max(0, min(k, s.params.max_tokens - len(s.output_ids) - 1, self.max_model_len - s.total_len - 1))
                for s in seqs]
        all_greedy = all(s.params.temperature < 1e-5 for s in seqs)  # then no sampling tensors (host → device copies)
        want_lp = any(s.params.logprobs is not None for s in seqs)
        host_accept = all_greedy and not want_lp
        if host_accept and self._all_mtp(seqs) and self._whole_spec_step(seqs, caps, pipelined):
            return  # verify, accept and next drafts: one replay (and the next step launched before this one's read)
        drafts, num = self.proposer.propose_for(seqs, caps, self.pool.device)
        if host_accept:  # read the (already computed) drafts before the verify pass, so this waits on nothing
            drafts_l, num_l = drafts.tolist(), num.tolist()
        logits = self.runner.forward_verify(seqs, drafts)
        verify_hidden, starts, _ = self.runner.last_hidden
        logp = None
        if host_accept:  # greedy: one [B, S] argmax comes back and the prefix match runs on the host
            tokens_l, emitted_l = greedy_accept(drafts_l, num_l, logits.argmax(-1).tolist())
        else:
            st = None if all_greedy else self.runner.sampling_tensors(seqs, logits.device)
            tokens, emitted = verify(drafts, num, logits, st, all_greedy=all_greedy)
            logp = logits.float().log_softmax(-1) if want_lp else None
            tokens_l, emitted_l, num_l = tokens.tolist(), emitted.tolist(), num.tolist()
        launched = None  # the graphed MTP drafter starts now; the bookkeeping below overlaps its replay
        if self.proposer.uses_mtp:
            launched = self.runner.mtp_launch_after_verify(seqs, tokens_l, emitted_l, verify_hidden, k,
                                                           self.proposer.num_mtp_drafts)
        self._accept(seqs, tokens_l, emitted_l, num_l, logp)
        if self.proposer.uses_mtp:  # the MTP module catches up on the verified positions, then drafts
            self.runner.mtp_draft_after_verify(seqs, starts, emitted_l, verify_hidden, k, launched,
                                               self.proposer.num_mtp_drafts)

    def _all_mtp(self, seqs: list[Sequence]) -> bool:
        """Whether every request's drafts this step come from the MTP module and the proposer runs such steps as one
        replay (the hybrid proposer: when each request prefers its MTP drafts)."""
        return self.proposer.whole_step_graph and all(self.proposer.prefers_mtp(s) for s in seqs)

    def _whole_spec_step(self, seqs: list[Sequence], caps: list[int], pipelined: bool = True) -> bool:
        """A greedy MTP step as one replay of `graphed_spec`; False (nothing done) where the graph does not take
        the batch. Pipelined (`pipeline_decode`): the step after it is launched before this one's result is read,
        its inputs derived on the device (`ModelRunner.launch_chained_mtp_step`), when no request can end by
        length in this step; the next engine step takes it if its decodes are the same requests with the cache
        lengths this step left (else it is dropped, as when a request ends here on EOS or a stop string, which the
        device cannot see)."""
        runner, k = self.runner, self.proposer.k
        ahead, self._spec_ahead = self._spec_ahead, None
        out = ahead.take(seqs) if ahead is not None else None
        drafts = self.proposer.candidates(seqs, caps)  # also what the hybrid scores its unused n-gram drafts by
        remaining = [min(s.params.max_tokens - len(s.output_ids), self.max_model_len - s.total_len) for s in seqs]
        if out is None:
            out = runner.launch_greedy_mtp_step(seqs, drafts, remaining)
            if out is None:
                return False
        # queued before the next step's launch, which overwrites the result buffer (a copy on CPU too)
        host = out.to("cpu", non_blocking=True) if out.is_cuda else out.clone()
        copied = None
        if out.is_cuda:
            copied = torch.cuda.Event()
            copied.record()
        nxt = None
        if pipelined and self.pipeline_decode and min(remaining) > k + 1 and self._all_mtp(seqs):
            nxt = runner.launch_chained_mtp_step(seqs)
        if copied is not None:
            copied.synchronize()
        S = k + 1
        rows = host.tolist()
        self._accept(seqs, [r[:S] for r in rows], [r[S] for r in rows], [r[S + 1] for r in rows],
                     trim=nxt is None)
        for s, r in zip(seqs, rows):
            if not s.is_finished:
                s.drafts = r[S + 2 :]
        if nxt is not None:
            if any(s.is_finished for s in seqs):  # the launched step cannot be used: give back its pages
                for s in seqs:
                    if not s.is_finished:
                        self.pool.trim(s.seq_id, s.num_cached)
            else:
                self._spec_ahead = _SpecAhead([s.seq_id for s in seqs], [s.num_cached for s in seqs], nxt)
        return True

    def _accept(self, seqs: list[Sequence], tokens_l: list[list[int]], emitted_l: list[int], num_l: list[int],
                logp: torch.Tensor | None = None, trim: bool = True) -> None:
        """Append each request's emitted tokens (stopping at a finish), count its drafts, move its
        cache length past the accepted ones and release pages the rejected ones held (unless `trim` is False: a
        step launched ahead writes there)."""
        for i, s in enumerate(seqs):
            accepted = emitted_l[i] - 1
            s.spec_stats.add(num_l[i], accepted)
            self.spec_stats.add(num_l[i], accepted)
            if self.policy is not None:
                self.policy.observe(s.seq_id, num_l[i], accepted)
            self.proposer.observe(s, tokens_l[i][: emitted_l[i]])
            s.num_cached = s.total_len + accepted  # the last token and the accepted drafts are cached
            for j in range(emitted_l[i]):
                entry = None
                if s.params.logprobs is not None:
                    entry = self._logprob_entry(s, tokens_l[i][j], logp[i, j])
                self._append(s, tokens_l[i][j], entry)
                if s.is_finished:
                    break
            if not s.is_finished:
                self.pool.register_computed(s.seq_id, s.all_ids, s.num_cached)
                if trim:
                    self.pool.trim(s.seq_id, s.num_cached)

    @staticmethod
    def _logprob_entry(s: Sequence, token: int, logp_row: torch.Tensor) -> dict:
        entry = {"token_id": token, "logprob": logp_row[token].item()}
        if s.params.logprobs:
            vals, ids = logp_row.topk(s.params.logprobs)
            entry["top"] = dict(zip(ids.tolist(), vals.tolist()))
        return entry

    def _append(self, s: Sequence, token: int, logprob_entry: dict | None) -> None:
        s.append_token(token)
        if logprob_entry is not None:
            s.logprobs.append(logprob_entry)
        self._check_finish(s, token)

    def _sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        if self.fault_hook is not None:
            self.fault_hook(seqs)
        out = self.runner.sample(seqs, logits)
        tokens = out.tokens.tolist()
        lps = out.logprobs.tolist() if any(s.params.logprobs is not None for s in seqs) else None
        top = None
        if out.top_token_ids is not None:
            top = (out.top_token_ids.tolist(), out.top_logprobs.tolist())
        for i, s in enumerate(seqs):
            entry = None
            if s.params.logprobs is not None:
                entry = {"token_id": tokens[i], "logprob": lps[i]}
                if s.params.logprobs and top is not None:
                    n = s.params.logprobs
                    entry["top"] = dict(zip(top[0][i][:n], top[1][i][:n]))
            self._append(s, tokens[i], entry)

    def _check_finish(self, s: Sequence, token: int) -> None:
        p = s.params
        if not p.ignore_eos and token in self.eos_ids:
            done = "stop"
        elif len(s.output_ids) >= p.max_tokens or s.total_len >= self.max_model_len:
            done = "length"
        else:
            done = None
        if self.tokenizer is not None:
            if s.detok is None:
                s.detok = IncrementalDetokenizer(self.tokenizer)
            old_len = len(s.detok.text)
            # a partial UTF-8 character waits for its next token, unless this is the last one
            if s.detok.update(s.output_ids, final=done is not None):
                s.text = s.detok.text
                for stop in p.stop:  # earlier text held none of them: search only where a new one can end
                    idx = s.text.find(stop, max(0, old_len - len(stop) + 1))
                    if idx != -1:
                        s.text = s.text[:idx]
                        return self._finish(s, "stop")
        if done is not None:
            return self._finish(s, done)

    def _finish(self, s: Sequence, reason: str) -> None:
        s.status, s.finish_reason, s.finish_time = Status.FINISHED, reason, time.perf_counter()
        self._unfinished.pop(s.seq_id, None)
        self.scheduler.remove(s)
        if self.policy is not None:
            self.policy.forget(s.seq_id)
        if self.proposer is not None:
            self.proposer.forget(s.seq_id)
        self._prompt_seen.discard(s.seq_id)

    def _fail(self, s: Sequence, why: str, reason: str) -> None:
        """Finish `s` with finish_reason "error": `why` (client-safe) in `error` and `text`, `reason` a
        FAILURE_REASONS label counted in `failures`."""
        s.error, s.error_reason, s.text = why, reason, why
        self.failures[reason] += 1
        self._finish(s, "error")

    def abort(self, request: Sequence | int) -> bool:
        """End a request (a Sequence or its request_id) with finish_reason "abort", waiting or running,
        and free its KV pages at once; False when it is unknown or already finished. Call it between
        steps (the thread that steps the engine)."""
        seq = self._unfinished.get(request) if isinstance(request, int) else request
        if seq is None or seq.is_finished:
            return False
        self._finish(seq, "abort")
        return True

    def forget_history(self) -> None:
        """Reset what finished requests left behind (counters, speculative statistics, the prefix cache and its
        counters): the engine looks unused. For the warm-up's synthetic requests; every request must be done."""
        if self.has_unfinished():
            raise RuntimeError("forget_history needs an idle engine")
        self._ahead = self._spec_ahead = None
        self.spec_stats = SpecStats()
        if self.policy is not None:
            self.policy.forget_history()
        self.failures.clear()
        self.num_failed_steps = 0
        self.scheduler.num_preemptions = 0
        self.pool.forget_prefixes()

    # ---- outputs -----------------------------------------------------------------------------------
    @staticmethod
    def output_of(s: Sequence) -> RequestOutput:
        end = s.finish_time or time.perf_counter()
        n = len(s.output_ids)
        ttft = (s.first_token_time - s.arrival) if s.first_token_time else None
        decode_time = end - s.first_token_time if s.first_token_time else 0.0
        return RequestOutput(
            request_id=s.seq_id,
            prompt=s.prompt,
            prompt_token_ids=s.prompt_ids,
            text=s.text,
            token_ids=list(s.output_ids),
            finish_reason=s.finish_reason,
            logprobs=list(s.logprobs) if s.params.logprobs is not None else None,
            metrics={
                "prompt_tokens": len(s.prompt_ids),
                "generated_tokens": n,
                "ttft_s": ttft,
                "e2e_s": end - s.arrival,
                "tpot_s": decode_time / (n - 1) if n > 1 else None,
                "spec": s.spec_stats.as_dict(),
            },
            finished=s.is_finished,
            error=s.error,
            error_reason=s.error_reason,
        )


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    """rows as an index tensor on like's device, copied without waiting for the device's queued work."""
    return to_device_ints(like.device, rows)[0]


def default_num_pages(model: DeepseekForCausalLM, page_size: int, dtype: torch.dtype, device: torch.device,
                      max_num_seqs: int, max_model_len: int, gpu_memory_utilization: float = 0.9,
                      kv_format: str = "auto", reserved_bytes: int = 0, free_bytes: int | None = None) -> int:
    """Pages for max_num_seqs × max_model_len tokens, capped by memory (1 GiB on CPU; on a GPU what is left of
    gpu_memory_utilization × its memory once `reserved_bytes` (graphs, activations) are set aside from the free
    memory, `free_bytes` or measured now)."""
    cfg = model.config
    width, row_dtype = row_spec(kv_format, cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype)
    per_page = page_size * width * torch.empty((), dtype=row_dtype).element_size() * model.num_cache_layers
    want = max_num_seqs * (-(-max_model_len // page_size))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        free = free if free_bytes is None else free_bytes
        budget = max(0, free - reserved_bytes - (1 - gpu_memory_utilization) * total)
    else:
        budget = 1 << 30
    return max(1, min(want, int(budget // per_page)))
