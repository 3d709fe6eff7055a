"""The FP8 linear's launch search on the GPU it runs on (`specmla tune --ops fp8`): per weight shape (N, K) and row
bucket, the knobs that run `fp8_block_linear_triton` (activation quantisation included) fastest, for the
"fp8_linear" table (`tuning`).

- Up to DECODE_MAX_M rows (the split-K kernel, bound by the weight stream): coarse over BLOCK_N ∈ {32, 64, 128} ×
  the K splits that give 0.8, 1.6, 3.2 or 6.4 programs per SM (and 1), at the rules' warps and stages; then fine
  around the two best: num_warps ∈ {4, 8} × num_stages ∈ {3, 4, 6, 8} × PREFETCH ∈ {0, 4}.
- Above (the tiled GEMM): coarse over BLOCK_M ∈ {64, 128} × BLOCK_N ∈ {64, 128, 256} at 4 warps, 3 stages, GROUP_M
  16; then fine around the two best: num_warps ∈ {4, 8} × num_stages ∈ {3, 4, 5} × GROUP_M ∈ {8, 16}.

Configurations whose pipeline buffers pass the shared memory are skipped; compile or launch errors skip one. A
candidate's time: a CUDA graph of calls over weight copies rotated past 4× L2, replayed; the median per call. A time
budget bounds the search: each (shape, bucket) gets an equal share of what is left and keeps its best so far.
"""

from __future__ import annotations

import time

import torch
import triton

from specmla.ops.linear.reference import BLOCK
from specmla.ops.linear.tuning import DECODE_MAX_M, SHARED_MEMORY, block_rows, stage_bytes
from specmla.ops.timing import graph_call_time

BUCKETS = (1, 4, 16, 64, 256, 1024, 4096)
DECODE_BLOCK_N = (32, 64, 128)
DECODE_WAVES = (0.8, 1.6, 3.2, 6.4)
DECODE_WARPS = (4, 8)
DECODE_STAGES = (3, 4, 6, 8)
PREFETCH = (0, 4)
GEMM_BLOCK_M = (64, 128)
GEMM_BLOCK_N = (64, 128, 256)
GEMM_WARPS = (4, 8)
GEMM_STAGES = (3, 4, 5)
GEMM_GROUP_M = (8, 16)
MAX_COPIES = 64  # weight copies rotated through a timed graph (V3's kv_a, 4 MB, needs ~50 to pass 4x L2)


# ---- the search space (pure python) --------------------------------------------------------------------
def fits(knobs: dict, M: int) -> bool:
    """Whether the pipeline buffers (e4m3 tiles of 128 K columns: a weight tile and a row tile per stage) fit."""
    return stage_bytes(knobs, block_rows(M)) <= SHARED_MEMORY


def splits(N: int, K: int, block_n: int, sms: int) -> list[int]:
    """The distinct K splits (no empty program) that give DECODE_WAVES programs per SM, and 1."""
    kb = triton.cdiv(K, BLOCK)
    out = {1}
    for w in DECODE_WAVES:
        s = max(1, min(kb, -(-int(w * sms) // triton.cdiv(N, block_n))))
        out.add(triton.cdiv(kb, triton.cdiv(kb, s)))
    return sorted(out)


def rules(N: int, K: int, M: int, sms: int) -> dict:
    """The knobs `fp8_block_linear_triton` takes without a table (its `plan_split`, `_decode_config`, `_gemm_config`)."""
    from specmla.ops.linear.triton import PREFETCH_BLOCKS, _decode_config, _gemm_config, plan_split

    if M > DECODE_MAX_M:
        return _gemm_config(M, N)
    split = plan_split(N, K, 64, sms)
    c = _decode_config(M, split)
    return dict(split=split, BLOCK_N=c["BLOCK_N"], num_warps=c["num_warps"], num_stages=c["num_stages"],
                PREFETCH=PREFETCH_BLOCKS)


def coarse_space(N: int, K: int, M: int, sms: int) -> list[dict]:
    """The rules' knobs first (a search cut short keeps them unless beaten), then every tile (and, up to
    DECODE_MAX_M rows, every split) at the rules' warps and stages."""
    from specmla.ops.linear.triton import _decode_config

    first = rules(N, K, M, sms)
    if M > DECODE_MAX_M:
        out = [dict(first, BLOCK_M=bm, BLOCK_N=bn) for bm in GEMM_BLOCK_M for bn in GEMM_BLOCK_N]
    else:
        out = [dict(first, split=s, BLOCK_N=bn, num_warps=c["num_warps"], num_stages=c["num_stages"])
               for bn in DECODE_BLOCK_N for s in splits(N, K, bn, sms) for c in [_decode_config(M, s)]]
    return [c for c in [first] + [c for c in out if c != first] if fits(c, M)]


def fine_space(c: dict, M: int) -> list[dict]:
    """Warps × stages (× PREFETCH for the split-K kernel, × GROUP_M for the GEMM) around a tile, c itself left out."""
    if M > DECODE_MAX_M:
        out = [dict(c, num_warps=w, num_stages=s, GROUP_M=g)
               for w in GEMM_WARPS for s in GEMM_STAGES for g in GEMM_GROUP_M]
    else:
        out = [dict(c, num_warps=w, num_stages=s, PREFETCH=p)
               for w in DECODE_WARPS for s in DECODE_STAGES for p in PREFETCH]
    return [d for d in out if d != c and fits(d, M)]


def search(timer, N: int, K: int, M: int, sms: int, deadline: float, on_step=None) -> tuple[float, dict, int]:
    """(seconds, knobs, configurations timed) of the fastest candidate; out of time, the best so far (at least one
    candidate is timed). `timer(knobs)` gives seconds per call or None for one that fails."""
    on_step = on_step or (lambda: None)
    seen: dict[str, float | None] = {}

    def time_of(c: dict) -> float | None:
        key = repr(sorted(c.items()))
        if key not in seen:
            seen[key] = timer(c)
            on_step()
        return seen[key]

    timed = []
    for c in coarse_space(N, K, M, sms):
        if timed and time.monotonic() > deadline:
            break
        t = time_of(c)
        if t is not None:
            timed.append((t, c))
    if not timed:
        raise RuntimeError(f"no configuration of the FP8 linear ran at N={N} K={K} M={M}")
    timed.sort(key=lambda tc: tc[0])
    best = timed[0]
    for _, c in timed[:2]:
        for d in fine_space(c, M):
            if time.monotonic() > deadline:
                break
            t = time_of(d)
            if t is not None and t < best[0]:
                best = (t, d)
    return best[0], best[1], len(seen)


# ---- timing on the GPU ---------------------------------------------------------------------------------
class LinearTimer:
    """Times `fp8_block_linear_triton` for an (N, K) weight at M rows with given knobs, over weight copies rotated
    past 4× L2 (a step streams other layers' weights between two calls of this one; at most MAX_COPIES)."""

    def __init__(self, N: int, K: int, M: int, device: torch.device, reps: int = 5, seed: int = 0):
        from specmla.ops.linear.reference import weight_quant

        g = torch.Generator(device=device).manual_seed(seed + N + K)
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        self.copies = max(1, min(MAX_COPIES, -(-4 * l2 // (N * K))))  # 4x L2 of weight bytes, small weights too
        self.weights = [weight_quant(torch.empty(N, K, device=device).normal_(0.0, 0.02, generator=g))
                        for _ in range(self.copies)]
        self.x = torch.empty(M, K, dtype=torch.bfloat16, device=device).normal_(0.0, 1.0, generator=g)
        self.out = torch.empty(M, N, dtype=torch.bfloat16, device=device)
        self.n = max(self.copies, 8 if M <= DECODE_MAX_M else 2)
        self.reps = reps

    def _call(self, i: int, knobs: dict) -> None:
        from specmla.ops.linear.triton import fp8_block_linear_triton

        w, s = self.weights[i % self.copies]
        knobs = dict(knobs)
        split = knobs.pop("split", None)
        fp8_block_linear_triton(self.x, w, s, out=self.out, split=split, config=knobs)

    def __call__(self, knobs: dict) -> float | None:
        return graph_call_time(lambda i: self._call(i, knobs), self.n, self.reps, str(knobs))


def tune_shapes(shapes: list[tuple[int, int]], buckets, budget_s: float, device: torch.device, timer_factory=None,
                sms: int | None = None, on_bucket=None) -> tuple[dict, list[dict]]:
    """The search over (N, K) `shapes` × row `buckets` in about `budget_s` seconds: ({"N,K": [(max_rows, knobs)]},
    a report row per (shape, bucket)). `timer_factory(N, K, M)` gives that point's `timer(knobs)` (default
    `LinearTimer` on `device`); `sms` the device's SM count (default: the device's)."""
    from specmla.ops.linear.tuning import shape_key

    if timer_factory is None:
        timer_factory = lambda N, K, M: LinearTimer(N, K, M, device)  # noqa: E731
    if sms is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    points = [(N, K, M) for N, K in dict.fromkeys(shapes) for M in sorted(set(buckets))]
    end = time.monotonic() + budget_s
    rows: dict[str, list[tuple[int, dict]]] = {}
    report = []
    for i, (N, K, M) in enumerate(points):
        share = max(0.0, end - time.monotonic()) / (len(points) - i)
        seconds, knobs, n = search(timer_factory(N, K, M), N, K, M, sms, time.monotonic() + share)
        rows.setdefault(shape_key(N, K), []).append((M, knobs))
        row = {"N": N, "K": K, "M": M, "us": seconds * 1e6, "knobs": knobs, "timed": n,
               "GBps": N * K / seconds / 1e9}
        report.append(row)
        if on_bucket is not None:
            on_bucket(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, report
