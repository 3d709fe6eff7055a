"""Paged latent KV cache: pages of [page_size, Dc+Dr] per layer, a free list, a page list per request.

Memory is claimed as a sequence grows (one page at a time) and returned when it finishes, instead
of a static max_batch × max_len slab (see `memory_saving_ratio`, the ShallowMLA report's Table 4).
"""

from __future__ import annotations

from collections import deque

import torch


class OutOfPages(RuntimeError):
    """The pool has too few free pages for the request."""


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        latent_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        fill: float | None = None,
    ):
        if min(num_layers, num_pages, page_size, latent_dim) < 1:
            raise ValueError(
                f"num_layers, num_pages, page_size and latent_dim must be >= 1, got "
                f"{num_layers}, {num_pages}, {page_size}, {latent_dim}"
            )
        self.num_pages, self.page_size, self.latent_dim = num_pages, page_size, latent_dim
        self.device = torch.device(device)
        alloc = torch.empty if fill is None else (lambda *s, **kw: torch.full(s, fill, **kw))
        self.caches = [alloc(num_pages, page_size, latent_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free: deque[int] = deque(range(num_pages))
        self._pages: dict[int, list[int]] = {}
        self.peak_pages_used = 0

    # ---- accounting -------------------------------------------------------------------------
    def num_free_pages(self) -> int:
        return len(self._free)

    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def pages_of(self, seq_id: int) -> list[int]:
        return self._pages.get(seq_id, [])

    def pages_needed(self, seq_id: int, num_tokens: int) -> int:
        """Extra pages `seq_id` needs so that `num_tokens` tokens fit."""
        have = len(self._pages.get(seq_id, ()))
        return max(0, -(-num_tokens // self.page_size) - have)

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        return self.pages_needed(seq_id, num_tokens) <= len(self._free)

    # ---- allocation -------------------------------------------------------------------------
    def allocate(self, seq_id: int, num_tokens: int) -> None:
        """Grow `seq_id`'s page list to hold `num_tokens` tokens; all-or-nothing."""
        need = self.pages_needed(seq_id, num_tokens)
        if need > len(self._free):
            raise OutOfPages(f"request {seq_id} needs {need} more page(s), {len(self._free)} free")
        pages = self._pages.setdefault(seq_id, [])
        for _ in range(need):
            pages.append(self._free.popleft())
        self.peak_pages_used = max(self.peak_pages_used, self.num_used_pages())

    def free(self, seq_id: int) -> None:
        for p in self._pages.pop(seq_id, []):
            self._free.append(p)

    # ---- addressing -------------------------------------------------------------------------
    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Cache slots (page * page_size + offset) of token positions start..end-1."""
        pages, ps = self._pages[seq_id], self.page_size
        return [pages[p // ps] * ps + p % ps for p in range(start, end)]

    def block_table(self, seq_ids: list[int], width: int | None = None) -> torch.Tensor:
        """int32 [B, width] page table (rows padded with page 0, which the length masks out)."""
        rows = [self._pages.get(s, []) for s in seq_ids]
        width = width or max((len(r) for r in rows), default=1) or 1
        table = torch.zeros(len(rows), width, dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        return table.to(self.device)

    def bytes_per_page(self) -> int:
        c = self.caches[0]
        return self.page_size * self.latent_dim * c.element_size() * len(self.caches)


def memory_saving_ratio(seq_lens: list[int], page_size: int, max_batch: int, max_len: int) -> float:
    """1 - (pages in use · page_size) / (max_batch · max_len): the ShallowMLA report's eq. (17)."""
    used = sum(-(-n // page_size) for n in seq_lens)
    return 1.0 - used * page_size / (max_batch * max_len)
