"""N-gram drafts from a request's own tokens on the host, kept incrementally.

The drafts are `ops.ngram_propose`'s (contract C3): for n from max_ngram down to min_ngram, the earliest earlier
occurrence of the last n tokens, followed by up to `cap` of the tokens after it. The index maps every n-gram to the
position of its first occurrence and grows by one entry per n as each token is appended, so a draft costs
O(max_ngram) dictionary lookups, not a pass over the whole context (nor a copy of it to the device) every step.
"""

from __future__ import annotations


class NgramIndex:
    def __init__(self, min_ngram: int, max_ngram: int):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = []
        self._first: dict[int, dict[tuple, int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}

    def sync(self, tokens: list[int]) -> None:
        """Index `tokens` (the request's prompt and output so far): appended tokens are added; tokens that changed
        (a step undone) rebuild the index."""
        have = len(self.tokens)
        if len(tokens) < have or tokens[have - 1 : have] != self.tokens[have - 1 : have]:
            self.tokens = []
            for d in self._first.values():
                d.clear()
            have = 0
        row = self.tokens
        for t in tokens[have:]:
            row.append(t)
            end = len(row)
            for n, first in self._first.items():
                if n <= end:
                    first.setdefault(tuple(row[end - n :]), end - n)

    def draft(self, cap: int) -> list[int]:
        """Up to `cap` draft tokens after the indexed tokens ([] when no n-gram recurs)."""
        row, L = self.tokens, len(self.tokens)
        if cap <= 0:
            return []
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if n >= L:
                continue
            start = self._first[n].get(tuple(row[L - n :]))
            if start is not None and start < L - n:
                return row[start + n : min(start + n + cap, L)]
        return []
