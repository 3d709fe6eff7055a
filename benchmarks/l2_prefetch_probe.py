"""Can one warpgroup per SM stream a paged fp8 cache at the copy rate through registers, if each page is first
prefetched into L2 by one bulk copy (`cp.async.bulk.prefetch.L2`)? The question behind a decode kernel whose
producer dequantises rows in registers (no shared-memory ring for the raw bytes: shared memory holds bf16 stages).

Each program (4 warps, one per SM as the decode kernels' grid: B requests × splits) reads its pages of 608-byte rows
(64 keys, 38,912 contiguous bytes) through registers, XOR-folding them, and prefetches the page `DIST` pages ahead.
Variants: DIST (0 = no prefetch) and how many 4 KB chunks of a page are in registers at once (UNROLL = all 10, or
one at a time). Timed in CUDA graphs against the device copy rate (`limits.copy_bandwidth`); the XOR fold is checked
against torch. GPU only.

    PYTHONPATH=.:benchmarks python3 benchmarks/l2_prefetch_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl
from bench_mla_decode import time_fn
from limits import copy_bandwidth

ROW = 608
PAGE = 64
WORDS = ROW * PAGE // 4  # int32 words of a page (9728)
CHUNK = 1024  # words per load step (8 per thread)
CHUNKS = triton.cdiv(WORDS, CHUNK)


@triton.jit
def _prefetch_page(ptr, lane):
    """One thread of the program asks L2 for the whole page at ptr (a bulk prefetch: no registers, no shared
    memory; the later loads hit L2)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.eq.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], 38912; mov.b32 $0, 0; }",
        "=r,l,r", [ptr, lane], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _stream_kernel(CACHE, BT, OUT, stride_bt, pages_per_prog, SPLITS: tl.constexpr, DIST: tl.constexpr,
                   UNROLL: tl.constexpr, WORDS: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // SPLITS
    first = (pid % SPLITS) * pages_per_prog
    lane = tl.arange(0, 128)
    sink = tl.zeros([128], tl.int32)
    for p in range(DIST):
        page = tl.load(BT + b * stride_bt + first + p)
        sink += _prefetch_page(CACHE + page.to(tl.int64) * WORDS + lane * 0, lane)
    acc = tl.zeros([CHUNK], tl.int32)
    for i in range(pages_per_prog):
        if DIST > 0:
            ahead = tl.minimum(i + DIST, pages_per_prog - 1)
            nxt = tl.load(BT + b * stride_bt + first + ahead)
            sink += _prefetch_page(CACHE + nxt.to(tl.int64) * WORDS + lane * 0, lane)
        page = tl.load(BT + b * stride_bt + first + i)
        base = CACHE + page.to(tl.int64) * WORDS
        if UNROLL:
            for c in tl.static_range(CHUNKS):
                offs = c * CHUNK + tl.arange(0, CHUNK)
                acc ^= tl.load(base + offs, mask=offs < WORDS, other=0)
        else:
            for c in range(CHUNKS):
                offs = c * CHUNK + tl.arange(0, CHUNK)
                acc ^= tl.load(base + offs, mask=offs < WORDS, other=0)
    tl.store(OUT + pid * CHUNK + tl.arange(0, CHUNK), acc)
    tl.store(OUT + tl.num_programs(0) * CHUNK + pid * 128 + lane, sink)


def stream(cache_words, table, out, splits, dist, unroll):
    B, pages = table.shape
    _stream_kernel[(B * splits,)](cache_words, table, out, table.stride(0), pages // splits, SPLITS=splits, DIST=dist,
                                  UNROLL=unroll, WORDS=WORDS, CHUNK=CHUNK, CHUNKS=CHUNKS, num_warps=4)


def reference(cache_words, table, splits):
    """The XOR fold of each program's pages, as the kernel lays it out [programs, CHUNK]."""
    B, pages = table.shape
    per = pages // splits
    padded = torch.zeros(cache_words.shape[0], CHUNKS * CHUNK, dtype=torch.int32, device=cache_words.device)
    padded[:, :WORDS] = cache_words
    folded = padded.view(-1, CHUNKS, CHUNK)
    out = torch.empty(B * splits, CHUNK, dtype=torch.int32, device=cache_words.device)
    for pid in range(B * splits):
        pg = table[pid // splits, (pid % splits) * per:(pid % splits + 1) * per].long()
        x = folded[pg].reshape(-1, CHUNK)
        acc = torch.zeros(CHUNK, dtype=torch.int32, device=x.device)
        for row in x:
            acc ^= row
        out[pid] = acc
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=32)
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--splits", type=int, default=4)
    ap.add_argument("--variants", default="0:1,0:0,2:1,4:1,8:1,4:0,8:0,16:0")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    pages_per = args.T // PAGE
    n_pages = args.B * pages_per
    copies = 2
    caches = [torch.randint(-2**31, 2**31 - 1, (n_pages, WORDS), dtype=torch.int32, device="cuda")
              for _ in range(copies)]
    table = torch.randperm(n_pages, device="cuda", dtype=torch.int32).view(args.B, pages_per)
    out = torch.empty(args.B * args.splits * (CHUNK + 128), dtype=torch.int32, device="cuda")
    nbytes = n_pages * WORDS * 4
    copy = copy_bandwidth()  # bytes/s
    floor = nbytes / copy
    print(f"copy {copy / 1e9:.0f} GB/s; {nbytes / 1e6:.1f} MB → {floor * 1e6:.1f} us at the copy rate", flush=True)
    small = table[:2, :8].contiguous()
    rows = []
    for item in args.variants.split(","):
        dist, unroll = (int(x) for x in item.split(":"))
        stream(caches[0], small, out, 2, dist, bool(unroll))
        ok = torch.equal(out[:4 * CHUNK].view(4, CHUNK), reference(caches[0], small, 2))
        t = time_fn(lambda i: stream(caches[i], table, out, args.splits, dist, bool(unroll)), copies, graph=True)
        row = dict(dist=dist, unroll=bool(unroll), correct=ok, us=t * 1e6, pct_of_copy=100 * floor / t)
        print(row, flush=True)
        rows.append(row)
    with open(os.path.join(args.out, "l2_prefetch_probe.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": copy / 1e9, "bytes": nbytes, "B": args.B,
                   "T": args.T, "splits": args.splits, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
