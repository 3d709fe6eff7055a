"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
import itertools
import random
import time
from dataclasses import dataclass, field

from specmla.engine.spec import SpecStats
from specmla.sampling_params import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a request is itself: identity equality keeps `seq in running` O(1) per entry
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_cached: int = 0  # tokens whose latents are in the KV cache
    text: str = ""  # detokenised output (stop strings cut off)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    spec_stats: SpecStats = field(default_factory=SpecStats)  # speculative decoding counters
    drafts: list[int] = field(default_factory=list)  # the MTP proposer's drafts for the next step
    detok: object | None = None  # the engine's IncrementalDetokenizer for `text`
    error: str | None = None  # why the request ended with finish_reason "error" (safe to show a client)
    error_reason: str | None = None  # a short label for metrics: LLMEngine.FAILURE_REASONS

    def __post_init__(self):
        # A seed per request makes sampling reproducible and independent of batch composition.
        self.seed = self.params.seed if self.params.seed is not None else random.randrange(2**31)
        self._all_ids = list(self.prompt_ids) + list(self.output_ids)

    def append_token(self, token: int) -> None:
        self.output_ids.append(token)
        self._all_ids.append(token)

    def truncate(self, num_output: int) -> None:
        """Drop output tokens beyond the first `num_output` (a failed step's partial work)."""
        del self.output_ids[num_output:]
        del self._all_ids[len(self.prompt_ids) + num_output :]

    @property
    def all_ids(self) -> list[int]:
        """Prompt then output tokens, kept up to date by `append_token` (read-only: it is not a copy,
        so the per-step callers do not rebuild an O(length) list)."""
        return self._all_ids

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
