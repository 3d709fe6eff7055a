"""Per-request generation parameters (contract C4), vLLM's names and defaults.

Every field is checked for type and range when the object is built and again when the engine admits
the request (`validate`), so a bad value is a ValueError naming the field before it reaches a batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
MAX_LOGPROBS = 20  # the most alternatives per token a request may ask for (vLLM's default cap)
MAX_STOP_STRINGS = 64  # stop list limits: matching costs O(count × length) per new token
MAX_STOP_LENGTH = 1024
FLOAT32_TINY = 2.0**-126  # the smallest normal float32: a top_p below it is 0 or subnormal in the sampler


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    max_tokens: int = 16  # >= 1
    temperature: float = 1.0  # finite, >= 0; 0 → greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = -1  # -1 (or 0) → disabled; else >= 1 (values >= the vocabulary disable it too)
    seed: int | None = None  # an int64
    stop: list[str] | str | None = None  # at most MAX_STOP_STRINGS non-empty strings of <= MAX_STOP_LENGTH chars
    logprobs: int | None = None  # None: none; 0: the chosen token's; n <= MAX_LOGPROBS: plus the n most likely
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        elif self.stop is None:
            self.stop = []
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field whose type or range is wrong."""
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.top_p < FLOAT32_TINY:  # the sampler holds it in float32, where it would be 0 (or lose precision)
            raise ValueError(f"top_p must be at least {FLOAT32_TINY:.3g} (the sampler's float32 would take "
                             f"{self.top_p!r} as 0), got {self.top_p!r}")
        if not _is_int(self.top_k) or not (self.top_k in (-1, 0) or 1 <= self.top_k <= INT64_MAX):
            raise ValueError(f"top_k must be -1 (disabled) or an integer >= 1 within int64, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise ValueError(f"seed must be null or an integer within int64, got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be null or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        stop = self.stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ValueError("stop must be a string or a list of strings")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_LENGTH for s in stop):
            raise ValueError(f"stop strings may be at most {MAX_STOP_LENGTH} characters long")
