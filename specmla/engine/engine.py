"""The generation loop: admit requests, prefill, decode, sample, detokenise, finish, free pages.

This is the simple foundation loop (whole-prompt prefill, then batched decode of every running
request); the continuous-batching scheduler replaces `_schedule` later without touching the rest.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from specmla.engine.kv_pool import KVPool, OutOfPages
from specmla.engine.runner import ModelRunner
from specmla.engine.sequence import Sequence, Status
from specmla.model.deepseek import DeepseekForCausalLM
from specmla.sampling_params import SamplingParams
from specmla.tokenizer import Tokenizer


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


class LLMEngine:
    def __init__(
        self,
        model: DeepseekForCausalLM,
        tokenizer: Tokenizer | None,
        pool: KVPool,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
    ):
        self.model, self.tokenizer, self.pool = model, tokenizer, pool
        self.runner = ModelRunner(model, pool)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or model.max_positions
        cfg = model.config
        eos = set(cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = eos
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.naive_decode = False  # tests: run decode through the MHA form instead of the absorbed one

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids")
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            ids, text = list(prompt), None
        if not ids:
            raise ValueError("empty prompt")
        vocab = self.model.config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context is {self.max_model_len}")
        seq = Sequence(prompt_ids=ids, params=params, prompt=text)
        self.waiting.append(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------------------
    def _schedule(self) -> tuple[list[Sequence], bool]:
        """Prefill newly admitted requests if any fit, else decode every running request."""
        admitted = []
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            seq = self.waiting[0]
            pages_for_all = sum(self.pool.pages_needed(s.seq_id, s.total_len) for s in admitted)
            need = -(-seq.total_len // self.pool.page_size)
            if need > self.pool.num_pages:
                self.waiting.popleft()
                self._finish(seq, "error")
                seq.text = f"prompt needs {need} KV pages; the pool has {self.pool.num_pages}"
                continue
            if pages_for_all + need > self.pool.num_free_pages():
                break
            admitted.append(self.waiting.popleft())
        if admitted:
            return admitted, True
        return list(self.running), False

    def step(self) -> list[Sequence]:
        """Run one forward; returns the sequences that got a new token (or finished)."""
        seqs, is_prefill = self._schedule()
        if not seqs:
            return []
        if not is_prefill:
            short = sum(self.pool.pages_needed(s.seq_id, s.total_len) for s in seqs)
            if short > self.pool.num_free_pages():
                raise OutOfPages(
                    f"decode needs {short} more KV page(s), {self.pool.num_free_pages()} free; "
                    "raise num_pages or lower max_num_seqs"
                )
        logits = self.runner.forward_logits(seqs, naive_context=self.naive_decode and not is_prefill)
        out = self.runner.sample(seqs, logits)
        tokens = out.tokens.tolist()
        lps = out.logprobs.tolist() if any(s.params.logprobs is not None for s in seqs) else None
        top = None
        if out.top_token_ids is not None:
            top = (out.top_token_ids.tolist(), out.top_logprobs.tolist())
        now = time.perf_counter()
        for i, s in enumerate(seqs):
            if is_prefill:
                s.status = Status.RUNNING
                self.running.append(s)
            if s.first_token_time is None:
                s.first_token_time = now
            s.output_ids.append(tokens[i])
            if s.params.logprobs is not None:
                entry = {"token_id": tokens[i], "logprob": lps[i]}
                if s.params.logprobs and top is not None:
                    n = s.params.logprobs
                    entry["top"] = dict(zip(top[0][i][:n], top[1][i][:n]))
                s.logprobs.append(entry)
            self._check_finish(s, tokens[i])
        return seqs

    def _check_finish(self, s: Sequence, token: int) -> None:
        p = s.params
        if self.tokenizer is not None:
            text = self.tokenizer.decode(s.output_ids)
            if not text.endswith("\ufffd"):  # hold back a partial UTF-8 character
                s.text = text
            for stop in p.stop:
                idx = text.find(stop)
                if idx != -1:
                    s.text = text[:idx]
                    return self._finish(s, "stop")
        if not p.ignore_eos and token in self.eos_ids:
            return self._finish(s, "stop")
        if len(s.output_ids) >= p.max_tokens or s.total_len >= self.max_model_len:
            return self._finish(s, "length")

    def _finish(self, s: Sequence, reason: str) -> None:
        s.status, s.finish_reason, s.finish_time = Status.FINISHED, reason, time.perf_counter()
        if s in self.running:
            self.running.remove(s)
        self.pool.free(s.seq_id)

    def abort(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if not seq.is_finished:
            self._finish(seq, "abort")

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
            },
            finished=s.is_finished,
        )


def default_num_pages(model: DeepseekForCausalLM, page_size: int, dtype: torch.dtype, device: torch.device,
                      max_num_seqs: int, max_model_len: int, gpu_memory_utilization: float = 0.9) -> int:
    """Pages for max_num_seqs × max_model_len tokens, capped by memory (1 GiB on CPU; a share of free GPU memory)."""
    per_page = page_size * model.config.latent_dim * torch.empty((), dtype=dtype).element_size() * model.num_cache_layers
    want = max_num_seqs * (-(-max_model_len // page_size))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = max(0, free - (1 - gpu_memory_utilization) * total)
    else:
        budget = 1 << 30
    return max(1, min(want, int(budget // per_page)))
