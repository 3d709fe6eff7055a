"""KVPool: on-demand page allocation, all-or-nothing OutOfPages, slot addressing, block tables,
accounting under random alloc/free churn (hypothesis), memory_saving_ratio, constructor checks."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specmla.engine.kv_pool import KVPool, OutOfPages, memory_saving_ratio


def _pool(num_pages=16, page_size=4, latent_dim=8, num_layers=2, dtype=torch.float32, fill=None):
    return KVPool(num_layers, num_pages, page_size, latent_dim, dtype, "cpu", fill=fill)


def _churn(pool: KVPool, seed: int) -> None:
    """Take every page one at a time and give them back in random order: the free list is shuffled."""
    rng = random.Random(seed)
    ids = [10_000 + i for i in range(pool.num_free_pages())]
    for s in ids:
        pool.allocate(s, 1)
    rng.shuffle(ids)
    for s in ids:
        pool.free(s)
    assert pool.num_free_pages() == pool.num_pages


def _check_invariants(pool: KVPool, live: list[int]) -> None:
    pages = [p for s in live for p in pool.pages_of(s)]
    assert len(pages) == len(set(pages)), "a page is assigned twice"
    assert all(0 <= p < pool.num_pages for p in pages)
    assert pool.num_used_pages() == len(pages)
    assert pool.num_free_pages() == pool.num_pages - len(pages)
    assert pool.peak_pages_used >= pool.num_used_pages()


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
def test_allocate_on_demand_grows_exactly_ceil(page_size):
    pool = _pool(num_pages=40, page_size=page_size)
    prev: list[int] = []
    for n in range(0, 5 * page_size + 2):
        expect = math.ceil(n / page_size)
        assert pool.pages_needed(7, n) == expect - len(prev)
        assert pool.can_allocate(7, n)
        pool.allocate(7, n)
        pages = pool.pages_of(7)
        assert len(pages) == expect
        assert pages[: len(prev)] == prev, "existing pages must never move"
        assert pool.num_free_pages() == 40 - expect and pool.num_used_pages() == expect
        prev = list(pages)
    # asking for fewer tokens never shrinks the list
    pool.allocate(7, 1)
    assert pool.pages_of(7) == prev
    assert pool.pages_needed(7, 1) == 0
    assert pool.peak_pages_used == len(prev)


def test_free_returns_pages():
    pool = _pool(num_pages=20, page_size=4)
    lens = {1: 5, 2: 16, 3: 1, 4: 0}
    for s, n in lens.items():
        pool.allocate(s, n)
    assert pool.num_used_pages() == 2 + 4 + 1 + 0
    peak = pool.peak_pages_used
    pool.free(2)
    assert pool.pages_of(2) == [] and pool.num_free_pages() == 20 - 3
    pool.free(2)  # double free is a no-op
    pool.free(999)  # unknown id is a no-op
    assert pool.num_free_pages() == 17
    for s in (1, 3, 4):
        pool.free(s)
    assert pool.num_free_pages() == 20 and pool.num_used_pages() == 0
    assert pool.peak_pages_used == peak == 7
    # every page can be handed out again, exactly once
    pool.allocate(5, 20 * 4)
    assert sorted(pool.pages_of(5)) == list(range(20))


def test_out_of_pages_is_all_or_nothing_and_clear():
    pool = _pool(num_pages=5, page_size=4)
    pool.allocate(1, 12)  # 3 pages
    a_pages = list(pool.pages_of(1))
    with pytest.raises(OutOfPages) as ei:
        pool.allocate(2, 12)  # needs 3, only 2 free
    msg = str(ei.value)
    assert "2" in msg and "3" in msg and "free" in msg  # request id, pages needed, pages free
    assert isinstance(ei.value, RuntimeError)
    assert pool.pages_of(2) == [] and pool.num_free_pages() == 2 and pool.pages_of(1) == a_pages
    assert not pool.can_allocate(2, 12) and pool.can_allocate(2, 8)

    # growing an existing request past the pool: nothing taken either
    with pytest.raises(OutOfPages, match="request 1 needs 3 more page"):
        pool.allocate(1, 24)
    assert pool.pages_of(1) == a_pages and pool.num_free_pages() == 2

    # a request that fits still succeeds afterwards; then the pool is exactly full
    pool.allocate(2, 8)
    assert len(pool.pages_of(2)) == 2 and pool.num_free_pages() == 0
    assert pool.can_allocate(3, 0)
    with pytest.raises(OutOfPages, match="0 free"):
        pool.allocate(3, 1)
    assert pool.pages_of(3) == []
    _check_invariants(pool, [1, 2, 3])


@pytest.mark.parametrize("page_size", [1, 4, 7])
def test_slots_map_positions_through_page_list(page_size):
    pool = _pool(num_pages=32, page_size=page_size)
    _churn(pool, seed=page_size)
    lens = {1: 3 * page_size + 2, 2: page_size, 3: 1}
    for s, n in lens.items():
        pool.allocate(s, n)
    all_pages = [p for s in lens for p in pool.pages_of(s)]
    assert all_pages != sorted(all_pages), "churn should leave pages out of order"
    seen = set()
    for s, n in lens.items():
        pages = pool.pages_of(s)
        slots = pool.slots(s, 0, n)
        assert len(slots) == n
        for pos, slot in enumerate(slots):
            assert slot // page_size == pages[pos // page_size]
            assert slot % page_size == pos % page_size
        assert not seen & set(slots)
        seen |= set(slots)
        # sub-ranges agree with the full range
        assert pool.slots(s, 1, n) == slots[1:]
        assert pool.slots(s, n - 1, n) == slots[-1:]
        assert pool.slots(s, 2, 2) == []

    # writing through slots and reading back through the block table round-trips
    cache = pool.caches[0]
    flat = cache.view(-1, pool.latent_dim)
    for s, n in lens.items():
        flat[torch.tensor(pool.slots(s, 0, n))] = torch.arange(n, dtype=cache.dtype)[:, None] + 1000 * s
    table = pool.block_table(list(lens))
    for i, (s, n) in enumerate(lens.items()):
        rows = cache[table[i].long()].reshape(-1, pool.latent_dim)[:n, 0]
        assert torch.equal(rows, torch.arange(n, dtype=cache.dtype) + 1000 * s)


def test_block_table_padding():
    pool = _pool(num_pages=30, page_size=4)
    _churn(pool, seed=3)
    lens = {5: 9, 6: 1, 7: 0, 8: 20}  # 3, 1, 0, 5 pages
    for s, n in lens.items():
        pool.allocate(s, n)
    t = pool.block_table([5, 6, 7, 8])
    assert t.dtype == torch.int32 and t.shape == (4, 5) and t.device == pool.device
    for i, s in enumerate([5, 6, 7, 8]):
        pages = pool.pages_of(s)
        assert t[i, : len(pages)].tolist() == pages
        assert (t[i, len(pages) :] == 0).all()
    wide = pool.block_table([8, 5], width=9)
    assert wide.shape == (2, 9)
    assert wide[0, :5].tolist() == pool.pages_of(8) and (wide[0, 5:] == 0).all()
    assert wide[1, :3].tolist() == pool.pages_of(5) and (wide[1, 3:] == 0).all()
    # unknown / empty sequences still give a usable (width >= 1) table
    assert pool.block_table([7]).shape == (1, 1)
    assert pool.block_table([12345]).tolist() == [[0]]
    assert pool.block_table([]).shape[0] == 0


@settings(max_examples=150, deadline=None)
@given(
    num_pages=st.integers(1, 12),
    page_size=st.sampled_from([1, 2, 3, 8]),
    ops=st.lists(
        st.tuples(st.sampled_from(["alloc", "alloc", "free"]), st.integers(0, 5), st.integers(0, 40)),
        max_size=60,
    ),
)
def test_random_alloc_free_never_double_assigns(num_pages, page_size, ops):
    pool = KVPool(1, num_pages, page_size, 4, torch.float32, "cpu")
    model: dict[int, int] = {}  # seq -> pages it must hold
    peak = 0
    for op, s, n in ops:
        before = {k: list(pool.pages_of(k)) for k in range(6)}
        free_before = pool.num_free_pages()
        if op == "free":
            pool.free(s)
            model.pop(s, None)
            assert pool.pages_of(s) == []
        else:
            want = max(model.get(s, 0), math.ceil(n / page_size))
            need = want - model.get(s, 0)
            assert pool.pages_needed(s, n) == need
            assert pool.can_allocate(s, n) == (need <= free_before)
            if need > free_before:
                with pytest.raises(OutOfPages):
                    pool.allocate(s, n)
                assert {k: pool.pages_of(k) for k in range(6)} == before  # nothing taken
                assert pool.num_free_pages() == free_before
            else:
                pool.allocate(s, n)
                model[s] = want
                got = pool.pages_of(s)
                assert got[: len(before[s])] == before[s]
                others = {p for k in range(6) if k != s for p in pool.pages_of(k)}
                assert not others & set(got[len(before[s]) :]), "a live page was handed out again"
        for k in range(6):
            assert len(pool.pages_of(k)) == model.get(k, 0)
        peak = max(peak, sum(model.values()))
        assert pool.peak_pages_used == peak
        _check_invariants(pool, list(range(6)))
    # the free list holds every remaining page exactly once
    for k in range(6):
        pool.free(k)
    assert pool.num_free_pages() == num_pages
    pool.allocate(99, num_pages * page_size)
    assert sorted(pool.pages_of(99)) == list(range(num_pages))
    with pytest.raises(OutOfPages):
        pool.allocate(98, 1)


def test_memory_saving_ratio_formula():
    assert memory_saving_ratio([512] * 4, 1024, 32, 16384) == pytest.approx(1 - 4 * 1024 / (32 * 16384))
    # partial pages count as whole pages; empty sequences take nothing
    assert memory_saving_ratio([1, 1024, 1025, 0], 1024, 4, 4096) == pytest.approx(1 - 4 * 1024 / (4 * 4096))
    assert memory_saving_ratio([], 16, 8, 128) == 1.0
    assert memory_saving_ratio([128] * 8, 16, 8, 128) == pytest.approx(0.0)
    assert memory_saving_ratio([17, 3], 16, 2, 64) == pytest.approx(1 - 3 * 16 / 128)


@pytest.mark.parametrize("num_pages,page_size", [(0, 4), (-1, 4), (8, 0), (8, -2), (0, 0)])
def test_invalid_constructor_args_raise(num_pages, page_size):
    with pytest.raises(ValueError):
        KVPool(1, num_pages, page_size, 8, torch.float32, "cpu")


@pytest.mark.parametrize("num_layers,latent_dim", [(1, 0), (1, -4), (0, 8)])
def test_invalid_latent_dim_or_layers_raise(num_layers, latent_dim):
    with pytest.raises(ValueError):
        KVPool(num_layers, 4, 4, latent_dim, torch.float32, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fill_initialises_caches(dtype):
    pool = _pool(num_pages=6, page_size=5, latent_dim=12, num_layers=3, dtype=dtype, fill=float("nan"))
    assert len(pool.caches) == 3
    for c in pool.caches:
        assert c.shape == (6, 5, 12) and c.dtype == dtype and c.device == torch.device("cpu")
        assert c.isnan().all()
    # layers are separate tensors
    pool.caches[0][0, 0, 0] = 1.0
    assert pool.caches[1].isnan().all() and pool.caches[2].isnan().all()
    assert len({c.data_ptr() for c in pool.caches}) == 3
    zeros = _pool(num_pages=2, page_size=2, latent_dim=3, fill=0.0)
    assert all((c == 0).all() for c in zeros.caches)
    assert pool.bytes_per_page() == 5 * 12 * torch.tensor([], dtype=dtype).element_size() * 3


@pytest.mark.parametrize("kv_format,row", [("auto", 1152), ("fp8", 608), ("fp8_ds_mla", 656), ("tbq4", 400)])
def test_bytes_per_page_counts_the_format_row(kv_format, row):
    """A page's bytes over every layer at the format's row size (DeepSeek's 512 + 64 latent), not latent_dim values."""
    pool = KVPool(3, 4, 16, 576, torch.bfloat16, "cpu", kv_format=kv_format)
    assert pool.bytes_per_page() == 3 * 16 * row
    assert pool.bytes_per_page() == sum(c[0].numel() * c.element_size() for c in pool.caches)
