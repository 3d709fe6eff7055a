"""One-shot all-reduce: the Triton kernel and its torch reference, each rank a forked process over shared CPU
memory (the kernel in the interpreter), against the rank-ordered fp32 sum; on GPUs (`-m gpu`) through
`specmla.distributed`'s symmetric buffers and `model.tp_reduce` against NCCL, eagerly and in CUDA-graph
replays."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from specmla.ops.all_reduce import (BLOCK, MAX_PROGRAMS, PeerBuffers, one_shot_all_reduce, one_shot_all_reduce_torch,
                                    symmetric_bytes)

IMPLS = {"triton": one_shot_all_reduce, "torch": one_shot_all_reduce_torch}


def _shared_buffers(world: int):
    """Every rank's raw buffer in memory that forked processes share, as `distributed` maps them on GPUs: the
    flag bytes zero, the data NaN-poisoned."""
    raw = [torch.full((symmetric_bytes(world),), 0xFF, dtype=torch.uint8).share_memory_() for _ in range(world)]
    for b in raw:
        b[: world * MAX_PROGRAMS * 8] = 0
    return raw


def _inputs(rank: int, sizes, dtype):
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(n, generator=g).to(dtype) for n in sizes]


def _rank_main(rank, impls, sizes, dtype, raw, outs, counters_out):
    torch.set_num_threads(1)
    bufs = PeerBuffers.split(rank, raw)
    for i, x in enumerate(_inputs(rank, sizes, dtype)):
        IMPLS[impls[rank]](x, bufs)
        outs[rank][i][: x.numel()] = x
    counters_out[rank].copy_(bufs.counters)


def _run(world, impls, sizes, dtype):
    raw = _shared_buffers(world)
    outs = [[torch.full((n,), float("nan"), dtype=dtype).share_memory_() for n in sizes] for _ in range(world)]
    counters = [torch.zeros(MAX_PROGRAMS, dtype=torch.int64).share_memory_() for _ in range(world)]
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank_main, args=(r, impls, sizes, dtype, raw, outs, counters))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung in the all-reduce"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return outs, counters


@pytest.mark.parametrize("world,impls,sizes,dtype", [
    (2, ["triton", "triton"], [2048, 1, 2 * BLOCK + 37, 5, 3 * BLOCK], torch.float32),
    (2, ["triton", "torch"], [BLOCK + 1, 7, BLOCK + 1], torch.float16),
    (3, ["torch", "triton", "triton"], [300, 2 * BLOCK - 1, 300], torch.float32),
    (4, ["triton"] * 4, [BLOCK * 3 + 11, 5], torch.float32),
])
def test_one_shot_all_reduce_equals_rank_ordered_sum(world, impls, sizes, dtype):
    outs, counters = _run(world, impls, sizes, dtype)
    xs = [_inputs(r, sizes, dtype) for r in range(world)]
    for i, n in enumerate(sizes):
        want = torch.zeros(n, dtype=torch.float32)
        for r in range(world):
            want += xs[r][i].float()
        want = want.to(dtype)
        for r in range(world):  # every rank holds the same bits: the rank-ordered fp32 sum
            assert torch.equal(outs[r][i], want), (i, r)
        exact = sum(xs[r][i].double() for r in range(world))
        assert torch.allclose(outs[0][i].double(), exact, rtol=1e-2 if dtype == torch.float16 else 1e-6, atol=1e-2)
    # each program's epoch counts the calls it took part in, alike on every rank
    calls = torch.zeros(MAX_PROGRAMS, dtype=torch.int64)
    for n in sizes:
        calls[: -(-n // BLOCK)] += 1
    for r in range(world):
        assert torch.equal(counters[r], calls)


MIXED = [(1, torch.float16), (2 * BLOCK, torch.float16), (2 * BLOCK, torch.float16), (BLOCK, torch.float32)]


def _slow_reader_rank(rank, raw, outs):
    """Rank 0 runs the kernel; rank 1 the reference, which sees call 2's flags late: rank 0 is in call 3 (another
    dtype, other byte offsets if regions moved with the dtype) while rank 1 still reads call 2's data."""
    import specmla.ops.all_reduce as ar

    torch.set_num_threads(1)
    bufs = PeerBuffers.split(rank, raw)
    real_sleep = ar.time.sleep
    for i, (n, dtype) in enumerate(MIXED):
        x = torch.randn(n, generator=torch.Generator().manual_seed(50 * rank + i)).to(dtype)
        if rank == 0:
            if i == 2:
                real_sleep(0.3)  # rank 1 waits in call 2 first
            one_shot_all_reduce(x, bufs)
        else:
            first = [True]

            def slow(sec, i=i):
                if i == 2 and first[0]:
                    first[0] = False
                    real_sleep(2.0)
                else:
                    real_sleep(sec)

            ar.time.sleep = slow
            one_shot_all_reduce_torch(x, bufs)
            ar.time.sleep = real_sleep
        outs[rank][i].copy_(x.float())


def test_one_shot_all_reduce_slow_reader_across_dtypes():
    raw = _shared_buffers(2)
    outs = [[torch.zeros(n).share_memory_() for n, _ in MIXED] for _ in range(2)]
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_slow_reader_rank, args=(r, raw, outs)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    for i, (n, dtype) in enumerate(MIXED):
        xs = [torch.randn(n, generator=torch.Generator().manual_seed(50 * r + i)).to(dtype) for r in range(2)]
        want = (xs[0].float() + xs[1].float()).to(dtype).float()
        for r in range(2):
            assert torch.equal(outs[r][i], want), (i, r)


def test_one_shot_all_reduce_refuses_bad_input_unchanged():
    raw = _shared_buffers(2)
    bufs = PeerBuffers.split(0, raw)
    before = [b.clone() for b in raw]
    x = torch.randn(bufs.capacity(torch.float32) + 1)
    for impl in IMPLS.values():
        with pytest.raises(ValueError, match="capacity"):
            impl(x.clone(), bufs)
        with pytest.raises(ValueError, match="contiguous"):
            impl(torch.randn(8, 4).t(), bufs)
    assert all(torch.equal(a, b) for a, b in zip(before, raw))
    assert torch.equal(bufs.counters, torch.zeros(MAX_PROGRAMS, dtype=torch.int64))
    with pytest.raises(ValueError, match="ranks"):
        one_shot_all_reduce(torch.randn(4), PeerBuffers(0, bufs.data * 5, bufs.flags * 5, bufs.counters))
    with pytest.raises(ValueError, match="bytes"):
        PeerBuffers.split(0, [b[:-1] for b in raw])


def _gpu_rank(rank, world, init_file, q):
    import torch.distributed as dist

    from specmla import distributed
    from specmla.model.tp_reduce import tp_all_reduce_
    from specmla.ops.all_reduce import symmetric_bytes

    try:
        distributed.init_group(rank, world, init_file, "cuda", symmetric_bytes(world))
        assert distributed.symmetric_buffers() is not None, "no symmetric buffers were mapped"
        g = torch.Generator(device="cuda").manual_seed(rank)
        for dtype in (torch.bfloat16, torch.float32):
            for n in (2048, 2048 * 32 + 3, 2048 * 128):
                x = torch.randn(n, generator=g, device="cuda").to(dtype)
                want = x.clone()
                dist.all_reduce(want)
                got = tp_all_reduce_(x.clone())
                same = torch.empty(world * n, dtype=dtype, device="cuda")
                dist.all_gather_into_tensor(same, got)
                assert all(torch.equal(c, got) for c in same.view(world, n)), "ranks hold different sums"
                tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
                assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
        # in a CUDA graph: 5 calls per replay, the inputs changing between replays
        x = torch.empty(2048 * 8, dtype=torch.bfloat16, device="cuda")
        y = torch.empty_like(x)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y.copy_(x)
            tp_all_reduce_(y)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y.copy_(x)
            for _ in range(5):
                tp_all_reduce_(y)
        for _ in range(20):
            x.copy_(torch.randn(x.numel(), generator=g, device="cuda"))
            want = x.float()
            for _ in range(5):
                want = want.to(torch.bfloat16)
                dist.all_reduce(want)
                want = want.float()
            graph.replay()
            assert torch.allclose(y.float(), want, rtol=5e-2, atol=5e-2)
        torch.cuda.synchronize()
        del graph
        distributed.destroy_group()
        q.put((rank, "ok"))
    except BaseException as e:  # reported to the parent
        q.put((rank, repr(e)))


@pytest.mark.gpu
def test_gpu_one_shot_all_reduce_matches_nccl(tmp_path):
    world = 2
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_gpu_rank, args=(r, world, str(tmp_path / "init"), q)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results == {r: "ok" for r in range(world)}, results
