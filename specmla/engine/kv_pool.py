"""Paged latent KV cache: pages of [page_size, Dc+Dr] per layer, a free list, a page list per request,
and prefix caching.

Memory is claimed as a sequence grows (one page at a time) and returned when it finishes, instead
of a static max_batch × max_len slab (see `memory_saving_ratio`, the ShallowMLA report's Table 4).

Prefix caching: a page whose tokens are all computed is registered under a hash of its tokens
chained with the previous page's hash, so the hash names the whole prefix up to that page. A new
request walks its prompt page by page and takes every page already registered (reference count +1)
instead of recomputing it. A page whose last user finishes goes back to the free list but keeps its
hash: it can still be revived by a later request until it is handed out for new tokens.
"""

from __future__ import annotations

import torch

from specmla.ops.kv_cache import row_spec


class OutOfPages(RuntimeError):
    """The pool has too few free pages for the request."""


def page_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
    return hash((prev, tokens))


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
        enable_prefix_caching: bool = True,
        scratch_page: bool = False,
        kv_format: str = "auto",
        kv_lora_rank: int | None = None,
    ):
        """latent_dim = Dc + Dr; kv_format fp8 / fp8_ds_mla / tbq4 stores quantised rows (needs
        kv_lora_rank = Dc)."""
        if min(num_layers, num_pages, page_size, latent_dim) < 1:
            raise ValueError(
                f"num_layers, num_pages, page_size and latent_dim must be >= 1, got "
                f"{num_layers}, {num_pages}, {page_size}, {latent_dim}"
            )
        self.num_pages, self.page_size, self.latent_dim = num_pages, page_size, latent_dim
        self.device = torch.device(device)
        self.enable_prefix_caching = enable_prefix_caching
        # one extra physical page, owned by nobody, for the padded rows of graphed decode batches
        self.scratch_page = num_pages if scratch_page else None
        physical = num_pages + (1 if scratch_page else 0)
        self.kv_format = kv_format
        dc = latent_dim - 64 if kv_lora_rank is None else kv_lora_rank
        width, row_dtype = row_spec(kv_format, dc, latent_dim - dc, dtype)
        if row_dtype == torch.uint8 and fill is not None:
            fill = 255  # an all-ones byte pattern (NaN scales / norms) poisons quantised rows
        alloc = torch.empty if fill is None else (lambda *s, **kw: torch.full(s, fill, **kw))
        self.caches = [alloc(physical, page_size, width, dtype=row_dtype, device=device) for _ in range(num_layers)]
        self._free: dict[int, None] = dict.fromkeys(range(num_pages))  # insertion-ordered: oldest first
        self._ref = [0] * num_pages
        self._hash: list[int | None] = [None] * num_pages
        self._tokens: list[tuple[int, ...] | None] = [None] * num_pages
        self._by_hash: dict[int, int] = {}
        self._pages: dict[int, list[int]] = {}
        self._registered: dict[int, tuple[int, int | None]] = {}  # seq_id → (pages registered, chain hash)
        self.peak_pages_used = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

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
    def _take(self, page: int) -> None:
        if self._ref[page] == 0:
            del self._free[page]
        self._ref[page] += 1

    def _take_fresh(self) -> int:
        page = next(iter(self._free))
        del self._free[page]
        if self._hash[page] is not None:  # its cached prefix is overwritten from now on
            if self._by_hash.get(self._hash[page]) == page:
                del self._by_hash[self._hash[page]]
            self._hash[page] = self._tokens[page] = None
        self._ref[page] = 1
        return page

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        """Grow `seq_id`'s page list to hold `num_tokens` tokens; all-or-nothing."""
        need = self.pages_needed(seq_id, num_tokens)
        if need > len(self._free):
            raise OutOfPages(f"request {seq_id} needs {need} more page(s), {len(self._free)} free")
        pages = self._pages.setdefault(seq_id, [])
        for _ in range(need):
            pages.append(self._take_fresh())
        self.peak_pages_used = max(self.peak_pages_used, self.num_used_pages())

    def free(self, seq_id: int) -> None:
        """Drop `seq_id`'s references; pages nobody uses return to the free list (hash kept)."""
        for p in self._pages.pop(seq_id, []):
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._free[p] = None
        self._registered.pop(seq_id, None)

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Release `seq_id`'s pages beyond those holding its first `num_tokens` tokens (rejected
        speculative tokens leave pages that are no longer needed)."""
        pages = self._pages.get(seq_id)
        if not pages:
            return
        keep = -(-num_tokens // self.page_size)
        while len(pages) > keep:
            p = pages.pop()
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._free[p] = None

    # ---- prefix caching ---------------------------------------------------------------------
    def match_prefix(self, seq_id: int, token_ids: list[int]) -> int:
        """Attach the longest cached prefix of `token_ids` to `seq_id` (which holds no pages yet);
        returns the number of tokens whose latents are already in the cache. The last token is
        never taken from the cache: its logits are needed, so it is always computed."""
        if seq_id in self._pages:
            raise ValueError(f"request {seq_id} already holds pages")
        full = (len(token_ids) - 1) // self.page_size
        self.prefix_query_tokens += len(token_ids)
        if not self.enable_prefix_caching:
            return 0
        pages, prev = [], None
        for i in range(full):
            toks = tuple(token_ids[i * self.page_size : (i + 1) * self.page_size])
            h = page_hash(prev, toks)
            page = self._by_hash.get(h)
            if page is None or self._tokens[page] != toks:
                break
            self._take(page)
            pages.append(page)
            prev = h
        if pages:
            self._pages[seq_id] = pages
            self._registered[seq_id] = (len(pages), prev)
            self.peak_pages_used = max(self.peak_pages_used, self.num_used_pages())
        hit = len(pages) * self.page_size
        self.prefix_hit_tokens += hit
        return hit

    def register_computed(self, seq_id: int, token_ids: list[int], num_computed: int) -> None:
        """Register every page of `seq_id` whose tokens are now all computed."""
        if not self.enable_prefix_caching:
            return
        pages = self._pages.get(seq_id, [])
        done, prev = self._registered.get(seq_id, (0, None))
        full = min(num_computed // self.page_size, len(pages))
        for i in range(done, full):
            toks = tuple(token_ids[i * self.page_size : (i + 1) * self.page_size])
            h = page_hash(prev, toks)
            page = pages[i]
            if h not in self._by_hash:
                self._by_hash[h] = page
                self._hash[page], self._tokens[page] = h, toks
            prev = h
        if full > done:
            self._registered[seq_id] = (full, prev)

    def forget_prefixes(self) -> None:
        """Drop every registered prefix and reset the counters (pages in use keep their contents but are no longer
        found by `match_prefix`)."""
        self._hash = [None] * self.num_pages
        self._tokens = [None] * self.num_pages
        self._by_hash.clear()
        self._registered.clear()
        self.peak_pages_used = self.num_used_pages()
        self.prefix_query_tokens = self.prefix_hit_tokens = 0

    # ---- addressing -------------------------------------------------------------------------
    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Cache slots (page * page_size + offset) of token positions start..end-1."""
        pages, ps = self._pages[seq_id], self.page_size
        return [pages[p // ps] * ps + p % ps for p in range(start, end)]

    def block_table_rows(self, seq_ids: list[int], width: int | None = None) -> tuple[list[int], int]:
        """The page table [B, width] flattened on the host (rows padded with page 0, which the length masks out),
        and its width (default: the longest row's, at least 1)."""
        rows = [self._pages.get(s, []) for s in seq_ids]
        width = width or max((len(r) for r in rows), default=1) or 1
        return [page for r in rows for page in r + [0] * (width - len(r))], width

    def block_table(self, seq_ids: list[int], width: int | None = None) -> torch.Tensor:
        """int32 [B, width] page table on the pool's device (`block_table_rows`)."""
        flat, width = self.block_table_rows(seq_ids, width)
        return torch.tensor(flat, dtype=torch.int32).view(len(seq_ids), width).to(self.device)

    def bytes_per_page(self) -> int:
        """Bytes one page holds over every layer, at the cache format's row size (1152 bf16, 608 fp8, 400 tbq4 for
        DeepSeek's 512 + 64)."""
        c = self.caches[0]
        return c[0].numel() * c.element_size() * len(self.caches)


def memory_saving_ratio(seq_lens: list[int], page_size: int, max_batch: int, max_len: int) -> float:
    """1 - (pages in use · page_size) / (max_batch · max_len): the ShallowMLA report's eq. (17)."""
    used = sum(-(-n // page_size) for n in seq_lens)
    return 1.0 - used * page_size / (max_batch * max_len)
