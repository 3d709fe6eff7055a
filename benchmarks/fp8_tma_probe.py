"""Issue-7 probe: can bulk copies (TMA) feed an fp8 decode kernel's producer at the copy bandwidth?

The fp8 kernel (`ops.mla_decode_gluon_quant`) loads each key block's codes into registers two blocks ahead;
alone (its consumers skip their matmuls) it reached 325 µs at B=32 T=32k, 1.27× bf16, with 76 % of its
stall samples waiting on those loads (docs/benchmarks.md). The 1.7× goal needs about 240 µs for the whole
kernel. This probe times the producer's half as a standalone Gluon kernel built the other way: a ring of
NUM_RAW raw 64-key blocks filled by TMA (three copies per paged block: codes, scales + rope, the rope's
last 16 bytes; boxes over the rows seen as [rows, 41, 16] bytes) and,
with UNPACK, 8 warps turning each block into the consumers' bf16 tile (the kernel's integer unpacking, scales
and rope copied beside it). No matmuls: the figures are ceilings for a producer, not attention timings.

    PYTHONPATH=.:benchmarks python3 benchmarks/fp8_tma_probe.py [--out DIR]

The unpacked tile of each program's last block is written out and checked against torch's e4m3 → bf16
(subnormal codes aside, which the kernel rounds to 2⁻⁷·(1 + m/8), see the kernel's docstring).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from specmla.ops.decode.hopper import common as G
from specmla.ops.decode.hopper import dequant as F

if G.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

ROW, PAGE, BLOCK_N = 656, 64, 64  # fp8 row bytes; keys per page and per block (one page = one block)


if G.HAVE_GLUON:

    @gluon.jit
    def _load_block(codes_desc, tail_desc, last_desc, row, bar, raw_c, raw_t, raw_u, WIDE: gl.constexpr):
        """The three copies of one 64-key block (its first cache row `row`), completing on `bar`."""
        if WIDE:
            _tma_load(codes_desc, [row, 0], bar, raw_c)
            _tma_load(tail_desc, [row, 128], bar, raw_t)
            _tma_load(last_desc, [row, 160], bar, raw_u)
        else:
            _tma_load(codes_desc, [row, 0, 0], bar, raw_c)
            _tma_load(tail_desc, [row, 32, 0], bar, raw_t)
            _tma_load(last_desc, [row, 40, 0], bar, raw_u)

    @gluon.jit
    def _tma_producer_kernel(codes_desc, tail_desc, last_desc, BT, OUT, stride_btb, blocks_per_split,
                             NUM_RAW: gl.constexpr, UNPACK: gl.constexpr, WIDE: gl.constexpr,
                             BLOCK_N: gl.constexpr, SOURCE_KEY: gl.constexpr, num_warps: gl.constexpr):
        b = gl.program_id(0)
        split = gl.program_id(1)
        first = split * blocks_per_split
        # boxes must have power-of-two sides, so each block is three copies: codes (bytes 0-511), scales + rope
        # (512-639), the rope's last 16 bytes. WIDE: the rows as 164 32-bit words (boxes 512, 128 and 16 bytes
        # wide); else as 41 16-byte units (every box row 16 bytes wide)
        if WIDE:
            RAW: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
            raw_c = gl.allocate_shared_memory(gl.int32, [NUM_RAW, BLOCK_N, 128], RAW)
            raw_t = gl.allocate_shared_memory(gl.int32, [NUM_RAW, BLOCK_N, 32], RAW)
            raw_u = gl.allocate_shared_memory(gl.int32, [NUM_RAW, BLOCK_N, 4], RAW)
        else:
            RAW: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3)
            raw_c = gl.allocate_shared_memory(gl.uint8, [NUM_RAW, BLOCK_N, 32, 16], RAW)
            raw_t = gl.allocate_shared_memory(gl.uint8, [NUM_RAW, BLOCK_N, 8, 16], RAW)
            raw_u = gl.allocate_shared_memory(gl.uint8, [NUM_RAW, BLOCK_N, 1, 16], RAW)
        PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        TILE: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        tile32 = gl.allocate_shared_memory(gl.int32, [BLOCK_N, 256], TILE)
        tail32 = gl.allocate_shared_memory(gl.int32, [BLOCK_N, 32], PLAIN)
        last32 = gl.allocate_shared_memory(gl.int32, [BLOCK_N, 4], PLAIN)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_RAW, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_RAW):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        WORDS: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[4, 8],
                                               warps_per_cta=[num_warps, 1], order=[1, 0])
        LAST: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32, 1],
                                              warps_per_cta=[num_warps, 1], order=[1, 0])
        for i in gl.static_range(NUM_RAW):  # the ring starts full
            row = gl.load(BT + b * stride_btb + first + i) * BLOCK_N
            mbarrier.expect(bars.index(i), BLOCK_N * 656)
            _load_block(codes_desc, tail_desc, last_desc, row, bars.index(i), raw_c.index(i), raw_t.index(i),
                        raw_u.index(i), WIDE)
        for j in range(blocks_per_split):
            st = j % NUM_RAW
            mbarrier.wait(bars.index(st), (j // NUM_RAW) & 1)
            if UNPACK:
                words = G._reinterpret(raw_c.index(st), gl.int32, [BLOCK_N, 128], PLAIN)
                for c in gl.static_range(4):
                    w = words.slice(32 * c, 32, dim=1).load(WORDS)
                    lo, hi = gl.inline_asm_elementwise(F._E4M3_TO_BF16, "=r,=r,r", [w], dtype=(gl.int32, gl.int32),
                                                       is_pure=True, pack=1)
                    tile32.slice(64 * c, 32, dim=1).store(lo)
                    tile32.slice(64 * c + 32, 32, dim=1).store(hi)
                tail32.store(G._reinterpret(raw_t.index(st), gl.int32, [BLOCK_N, 32], PLAIN).load(WORDS))
                last32.store(G._reinterpret(raw_u.index(st), gl.int32, [BLOCK_N, 4], PLAIN).load(LAST))
            G._cta_barrier()  # every warp has read stage st: it may be refilled
            nxt = j + NUM_RAW
            if nxt < blocks_per_split:
                row = gl.load(BT + b * stride_btb + first + nxt) * BLOCK_N
                mbarrier.expect(bars.index(st), BLOCK_N * 656)
                _load_block(codes_desc, tail_desc, last_desc, row, bars.index(st), raw_c.index(st), raw_t.index(st),
                            raw_u.index(st), WIDE)
        if UNPACK:  # the last block's tile, for the check
            ROWS: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[1, 32],
                                                  warps_per_cta=[num_warps, 1], order=[1, 0])
            r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ROWS))
            cidx = gl.arange(0, 256, layout=gl.SliceLayout(0, ROWS))
            pid = b * gl.num_programs(1) + split
            at = OUT + pid * BLOCK_N * 256 + gl.expand_dims(r, 1) * 256 + gl.expand_dims(cidx, 0)
            gl.store(at, tile32.load(ROWS))


def run_producer(cache: torch.Tensor, table: torch.Tensor, splits: int, num_raw: int, unpack: bool,
                 out: torch.Tensor, wide: bool = True) -> None:
    """One call: every request's blocks split `splits` ways, each program streaming its blocks."""
    B, pages = table.shape
    if wide:  # [rows, 164] 32-bit words
        view, boxes = cache.view(-1, ROW).view(torch.int32), ([BLOCK_N, 128], [BLOCK_N, 32], [BLOCK_N, 4])
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    else:  # [rows, 41, 16] bytes
        view, boxes = cache.view(-1, 41, 16), ([BLOCK_N, 32, 16], [BLOCK_N, 8, 16], [BLOCK_N, 1, 16])
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3)
    descs = [TensorDescriptor.from_tensor(view, box, layout) for box in boxes]
    _tma_producer_kernel[(B, splits)](*descs, table, out, table.stride(0), pages // splits, NUM_RAW=num_raw,
                                      UNPACK=unpack, WIDE=wide, BLOCK_N=BLOCK_N, SOURCE_KEY=G.source_key(__file__),
                                      num_warps=8)


def reference_tile(cache: torch.Tensor, page: int) -> torch.Tensor:
    """The tile the kernel writes for one page, as int32 words of bf16 pairs (the kernel's column order)."""
    codes = cache[page, :, :512].contiguous().view(torch.float8_e4m3fn).to(torch.bfloat16)  # [64, 512]
    c = codes.view(BLOCK_N, 4, 32, 4)  # chunk, word, byte
    pair0 = c[..., 0:2].reshape(BLOCK_N, 4, 64)  # bytes 0, 1 of each word → tile words 64c + v
    pair1 = c[..., 2:4].reshape(BLOCK_N, 4, 64)
    return torch.cat([pair0, pair1], dim=2).reshape(BLOCK_N, 512).view(torch.int32)


def main() -> None:
    from bench_mla_decode import make_problem, time_fn
    from limits import copy_bandwidth

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cases", default="32x32768,4x81920")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for case in args.cases.split(","):
        B, T = (int(x) for x in case.split("x"))
        caches, table, _, _ = make_problem(16, B, T, 1, 2, "fp8_ds_mla")
        nbytes = B * T * ROW
        # the same pages gathered by torch (read + write counted, as the copy bandwidth counts them)
        order, buf = table.flatten().long(), torch.empty_like(caches[0])
        t = time_fn(lambda i, c=caches: torch.index_select(c[i], 0, order, out=buf), 2, graph=True)
        row = dict(B=B, T=T, variant="torch page gather", us=t * 1e6, pct_copy=100 * 2 * nbytes / t / bw)
        print(json.dumps(row), flush=True)
        rows.append(row)
        # the raw ring alone up to 4 stages; beside the 64 KB bf16 tile, 3 at most fit in 227 KB
        variants = [(s, w, n, u) for s in ((4, 8) if B >= 32 else (32,)) for w in (False, True)
                    for n, u in ((2, False), (4, False), (2, True), (3, True))]
        for splits, wide, num_raw, unpack in variants:
            out = torch.zeros(B * splits, BLOCK_N, 256, dtype=torch.int32, device="cuda")
            run_producer(caches[0], table, splits, num_raw, unpack, out, wide)
            torch.cuda.synchronize()
            check = None
            if unpack:  # program (b=0, split s) ends on page table[0, (s+1)·per - 1]
                per = table.shape[1] // splits
                ref = reference_tile(caches[0], int(table[0, per - 1]))
                got = out[0]
                check = (got != ref).float().mean().item()
            t = time_fn(lambda i, c=caches, a=(splits, num_raw, unpack, out, wide): run_producer(c[i], table, *a), 2,
                        graph=True)
            row = dict(B=B, T=T, splits=splits, wide=wide, num_raw=num_raw, unpack=unpack, us=t * 1e6,
                       pct_copy=100 * nbytes / t / bw, mismatch_words=check)
            print(json.dumps(row), flush=True)
            rows.append(row)
        del caches
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "fp8_tma_probe.json"), "w") as f:
        json.dump({"copy_GBps": bw / 1e9, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
