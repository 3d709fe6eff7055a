"""The fused MoE's tile search on the GPU it runs on: per GEMM shape and token bucket, the up and down
configurations that run `fused_moe_triton` fastest (`specmla tune`, `benchmarks/tune_moe.py`).

For each token bucket max_tokens (a call with T tokens takes the first row with max_tokens ≥ T) the whole op runs
at T = max_tokens on random uniform routings, with the shape's shared experts, once per candidate configuration:

1. block_m candidates by the mean rows per expert m = T·k/E: 16 only at T = 1 (each pair is its own block there);
   else 16..128 up to max(16, 8·m), without 16 and 32 once m ≥ 128; tried nearest first to tuning.default_config's;
2. per block_m, the gate‖up GEMM is tuned with the down GEMM fixed, then the down GEMM with the best up: coarse over
   block_n ∈ {32, 64, 128, 256} × block_k ∈ {64, 128, 256} (group_m, num_warps, num_stages by rule of thumb), then
   fine around the two best: num_warps ∈ {4, 8} × num_stages ∈ {2, 3, 4, 5}, then group_m ∈ {1, 8}.
   Configurations whose pipeline buffers exceed the shared memory or whose accumulators exceed 128 fp32 registers
   per thread are skipped; compile or launch errors skip the configuration;
3. up and down share block_m (the op aligns pairs once): the block_m whose best up + best down runs fastest wins.

FP8 experts (`fused_moe_fp8_triton`, kinds "up_fp8" / "down_fp8") search the same way over what their kernels take:
block_k 128 (one scale block a K step), gate‖up's block_n 128 (one quantisation group of the intermediate), the down
GEMM's block_n ∈ {32, 64, 128, 256}; shared memory counted in e4m3 bytes.

A candidate's time: a CUDA graph of n calls (n = 8 at small T, fewer at large T), each on its own random routing so
that weights are not re-read from L2, replayed; median of the replays per call. A time budget bounds the search:
each bucket gets an equal share of what is left, and a search out of time keeps its best so far.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from specmla.ops.moe.tuning import SHARED_MEMORY, Config, default_config, default_fp8_config, shape_key
from specmla.ops.timing import graph_call_time

BUCKETS = [1, 8, 32, 128, 512, 2048, 8192, 16384]
BLOCK_M = (16, 32, 64, 128)
BLOCK_N = (32, 64, 128, 256)
BLOCK_K = (64, 128, 256)
WARPS = (4, 8)
STAGES = (2, 3, 4, 5)
SMEM_BYTES = SHARED_MEMORY
MAX_ACC_REGS = 128  # fp32 accumulator registers per thread
FP8_BLOCK = 128  # the fp8 kernels' block_k, and gate‖up's block_n
# ---- the search space (pure python) --------------------------------------------------------------------
def is_up(kind: str) -> bool:
    return kind.startswith("up")


def is_fp8(kind: str) -> bool:
    return kind.endswith("_fp8")


def smem_bytes(kind: str, c: Config) -> int:
    """Shared memory of the pipeline buffers: per stage an A tile [bm, bk] and one (down) or two (up, gate
    and up) B tiles [bk, bn], of 2-byte elements (1 for the fp8 kinds)."""
    b_tiles = 2 if is_up(kind) else 1
    elem = 1 if is_fp8(kind) else 2
    return c.num_stages * (c.block_m * c.block_k + b_tiles * c.block_k * c.block_n) * elem


def acc_regs(kind: str, c: Config) -> float:
    """fp32 accumulator registers per thread (up holds gate and up accumulators)."""
    return (2 if is_up(kind) else 1) * c.block_m * c.block_n / (32 * c.num_warps)


def feasible(kind: str, c: Config) -> bool:
    if is_fp8(kind) and (c.block_k != FP8_BLOCK or (is_up(kind) and c.block_n != FP8_BLOCK)):
        return False
    return smem_bytes(kind, c) <= SMEM_BYTES and acc_regs(kind, c) <= MAX_ACC_REGS


def block_m_candidates(T: int, k: int, E: int, kind: str = "up") -> list[int]:
    """Row-block sizes worth trying at T tokens: 16 alone at T = 1; else up to max(16, 8·T·k/E), without the
    narrow ones once the GEMMs are compute-bound (T·k/E ≥ 128 rows per expert)."""
    if T <= 1:
        return [16]
    rows = T * k / E
    out = [bm for bm in BLOCK_M if bm <= max(16, 8 * rows)]
    if rows >= 128:
        out = [bm for bm in out if bm >= 64]
    first = rule(kind, T, k, E).block_m  # the likeliest first: a search cut short keeps a sound one
    return sorted(out, key=lambda bm: (abs(math.log2(bm / first)), bm))


def rule_of_thumb(kind: str, T: int, bm: int, bn: int, bk: int) -> Config | None:
    """The coarse stage's configuration for a tile: group_m 8 once there are several row blocks per expert
    (else 1), 8 warps for large accumulators, the deepest pipeline (≤ 4 stages) that fits; None if none fits."""
    group_m = 8 if T >= 128 else 1
    acc = (2 if is_up(kind) else 1) * bm * bn
    warps = 8 if acc >= 2 * 128 * 128 else 4
    for stages in (4, 3, 2):
        c = Config(bm, bn, bk, group_m, warps, stages)
        if feasible(kind, c):
            return c
    c = Config(bm, bn, bk, group_m, 8, 2)
    return c if feasible(kind, c) else None


def tiles(kind: str) -> list[tuple[int, int]]:
    """The (block_n, block_k) tiles a kind's kernel takes."""
    if is_fp8(kind):
        return [(FP8_BLOCK, FP8_BLOCK)] if is_up(kind) else [(n, FP8_BLOCK) for n in BLOCK_N]
    return [(n, k) for n in BLOCK_N for k in BLOCK_K]


def rule(kind: str, T: int, k: int, E: int) -> Config:
    """`tuning`'s rule for a kind at T tokens (the fp8 kinds' by rows per expert, the others' by pairs)."""
    return default_fp8_config(kind, T * k / E) if is_fp8(kind) else default_config(kind, T * k)


def coarse_space(kind: str, T: int, bm: int, k: int, E: int) -> list[Config]:
    """Every tile the kind takes at block_m = bm by rule of thumb, after the rule's own tile (with bm)."""
    d = rule(kind, T, k, E)
    first = dataclasses.replace(d, block_m=bm)
    out = [first] if feasible(kind, first) else []
    for bn, bk in sorted(tiles(kind), key=lambda t: t != (d.block_n, d.block_k)):
        c = rule_of_thumb(kind, T, bm, bn, bk)
        if c is not None and c not in out:
            out.append(c)
    return out


def fine_space(kind: str, c: Config) -> list[Config]:
    """num_warps × num_stages around a tile (the tile's own configuration excluded)."""
    out = []
    for w in WARPS:
        for s in STAGES:
            d = dataclasses.replace(c, num_warps=w, num_stages=s)
            if d != c and feasible(kind, d):
                out.append(d)
    return out


def other_kind(kind: str) -> str:
    return kind.replace("up", "down") if is_up(kind) else kind.replace("down", "up")


def fixed_other(kind: str, T: int, k: int, E: int, bm: int) -> Config:
    """The configuration the other GEMM keeps while `kind` is searched: its rule with block_m = bm."""
    other = other_kind(kind)
    c = dataclasses.replace(rule(other, T, k, E), block_m=bm)
    if not feasible(other, c):
        c = rule_of_thumb(other, T, bm, *(tiles(other)[0] if is_fp8(other) else (64, 64)))
    return c


class Search:
    """The search of one (shape, bucket): `timer(up, down)` gives seconds per call, or None for a
    configuration that fails; `deadline` (time.monotonic()) stops it, keeping the best so far."""

    def __init__(self, timer, T: int, k: int, E: int, deadline: float, on_step=None, fp8: bool = False):
        self.timer, self.T, self.k, self.E, self.deadline = timer, T, k, E, deadline
        self.up, self.down = ("up_fp8", "down_fp8") if fp8 else ("up", "down")
        self.on_step = on_step or (lambda: None)
        self.cache: dict[tuple[Config, Config], float | None] = {}
        self.timed = 0

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def time(self, up: Config, down: Config) -> float | None:
        key = (up, down)
        if key not in self.cache:
            self.cache[key] = self.timer(up, down)
            self.timed += 1
            self.on_step()
        return self.cache[key]

    def _best(self, kind: str, candidates: list[Config], other: Config, best=None):
        """(seconds, config) of the fastest candidate, starting from `best`; stops when out of time."""
        for c in candidates:
            if best is not None and self.out_of_time():
                break
            t = self.time(c, other) if is_up(kind) else self.time(other, c)
            if t is not None and (best is None or t < best[0]):
                best = (t, c)
        return best

    def tune_kind(self, kind: str, bm: int, other: Config):
        """(seconds, config) of the best `kind` configuration with block_m = bm, the other GEMM at `other`."""
        timed = []
        for c in coarse_space(kind, self.T, bm, self.k, self.E):
            if timed and self.out_of_time():
                break
            t = self.time(c, other) if is_up(kind) else self.time(other, c)
            if t is not None:
                timed.append((t, c))
        if not timed:
            return None
        timed.sort(key=lambda tc: tc[0])
        best = timed[0]
        for _, c in timed[:2]:
            best = self._best(kind, fine_space(kind, c), other, best)
        if self.T >= 128:  # group_m only matters with several row blocks per expert
            flip = dataclasses.replace(best[1], group_m=1 if best[1].group_m > 1 else 8)
            best = self._best(kind, [flip], other, best)
        return best

    def run(self) -> dict:
        """{"block_m", "up", "down", "seconds", "per_block_m": {bm: seconds}, "timed"} of this bucket."""
        results = {}
        for bm in block_m_candidates(self.T, self.k, self.E, self.up):
            if results and self.out_of_time():
                break
            up = self.tune_kind(self.up, bm, fixed_other(self.up, self.T, self.k, self.E, bm))
            if up is None:
                continue
            down = self.tune_kind(self.down, bm, up[1])
            if down is None:
                continue
            t = self.time(up[1], down[1])
            if t is not None:
                results[bm] = (t, up[1], down[1])
        if not results:
            raise RuntimeError(f"no configuration ran at T={self.T}")
        bm = min(results, key=lambda b: results[b][0])
        t, up, down = results[bm]
        return {"block_m": bm, "up": up, "down": down, "seconds": t,
                "per_block_m": {b: r[0] for b, r in results.items()}, "timed": self.timed}


def merge_rows(table: dict, key: str, rows: list[tuple[int, Config]]) -> None:
    """Put rows [max_tokens, config] into table[key], replacing rows of the same max_tokens, sorted."""
    merged = {int(m): cfg for m, cfg in table.get(key, [])}
    merged.update({m: c.to_dict() for m, c in rows})
    table[key] = [[m, merged[m]] for m in sorted(merged)]


# ---- timing on the GPU ---------------------------------------------------------------------------------
class OpTimer:
    """Times `fused_moe_triton` (or, given `scales`, `fused_moe_fp8_triton`) for one shape at T tokens with given up /
    down configurations."""

    def __init__(self, E, k, H, I, Is, T, dev, weights, reps: int = 5, seed: int = 0, scales=None):
        from specmla.ops.moe.triton import fused_moe_fp8_triton, fused_moe_triton

        self.scales = scales  # (gate‖up, down, (shared gate‖up, shared down) or None) for fp8 experts
        self.op = fused_moe_triton if scales is None else fused_moe_fp8_triton
        g = torch.Generator(device=dev).manual_seed(seed + T)
        self.w_gate_up, self.w_down, self.shared = weights
        self.n = 8 if T <= 512 else (4 if T <= 2048 else 2 if T <= 8192 else 1)
        self.reps = reps if T <= 2048 else 3
        self.x = torch.empty(T, H, dtype=torch.bfloat16, device=dev).normal_(0.0, 1.0, generator=g)
        self.routings = [(torch.randn(T, k, device=dev, generator=g).softmax(-1),
                          torch.rand(T, E, device=dev, generator=g).topk(k, dim=1).indices) for _ in range(self.n)]

    def _call(self, i, up, down):
        w, ids = self.routings[i]
        kw = {} if self.scales is None else dict(w_gate_up_scale=self.scales[0], w_down_scale=self.scales[1],
                                                 shared_scales=self.scales[2])
        return self.op(self.x, self.w_gate_up, self.w_down, w, ids, shared=self.shared, up_config=up,
                       down_config=down, **kw)

    def __call__(self, up: Config, down: Config) -> float | None:
        return graph_call_time(lambda i: self._call(i, up, down), self.n, self.reps, f"up={fmt(up)} down={fmt(down)}")


def fmt(c: Config) -> str:
    return f"{c.block_m}x{c.block_n}x{c.block_k} g{c.group_m} w{c.num_warps} s{c.num_stages}"


def _quantised(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn weights [..., N, K] and their 128 × 128 block scales (`weight_quant`), one expert at a time:
    V3's stacks through weight_quant's fp32 copy at once would take 30 GB."""
    from specmla.ops.linear.reference import weight_quant

    if w.dim() == 2:
        return weight_quant(w)
    pairs = [weight_quant(x) for x in w]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def tune_shape(E: int, k: int, H: int, I: int, Is: int, buckets: list[int], budget_s: float,
               device: torch.device, reps: int = 5, timer_factory=None, on_bucket=None,
               fp8: bool = False) -> tuple[dict, list[dict]]:
    """The search of one MoE shape (E experts of top-k, hidden H, expert width I, shared width Is, 0 for none) over
    `buckets`, in about `budget_s` seconds: ({table key: [(max_tokens, Config)]} for "up" and "down" ("up_fp8" and
    "down_fp8" with `fp8`: float8_e4m3fn experts with block scales), a report row per bucket).
    `timer_factory(T)` gives a bucket's `timer(up, down)` (default: `OpTimer` on `device`); `on_bucket(report_row)`
    is called after each bucket."""
    buckets = sorted(set(buckets))
    up_kind, down_kind = ("up_fp8", "down_fp8") if fp8 else ("up", "down")
    if timer_factory is None:
        g = torch.Generator(device=device).manual_seed(0)

        def make(*shape):
            return torch.empty(*shape, dtype=torch.bfloat16, device=device).normal_(0, 0.02, generator=g)

        weights = (make(E, 2 * I, H), make(E, H, I), (make(2 * Is, H), make(H, Is)) if Is else None)
        scales = None
        if fp8:
            (gu, gu_s), (dn, dn_s) = _quantised(weights[0]), _quantised(weights[1])
            shared = [_quantised(w) for w in weights[2]] if Is else None
            weights = (gu, dn, tuple(q for q, _ in shared) if shared else None)
            scales = (gu_s, dn_s, tuple(s for _, s in shared) if shared else None)
        timer_factory = lambda T: OpTimer(E, k, H, I, Is, T, device, weights, reps=reps, scales=scales)  # noqa: E731
    end = time.monotonic() + budget_s
    up_rows, down_rows, report = [], [], []
    for i, T in enumerate(buckets):
        share = max(0.0, end - time.monotonic()) / (len(buckets) - i)
        r = Search(timer_factory(T), T, k, E, deadline=time.monotonic() + share, fp8=fp8).run()
        up_rows.append((T, r["up"]))
        down_rows.append((T, r["down"]))
        row = {"E": E, "k": k, "H": H, "I": I, "Is": Is, "T": T, "fp8": fp8, "us": r["seconds"] * 1e6,
               "up": r["up"].to_dict(), "down": r["down"].to_dict(), "timed": r["timed"],
               "per_block_m_us": {str(b): t * 1e6 for b, t in r["per_block_m"].items()}}
        report.append(row)
        if on_bucket is not None:
            on_bucket(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {shape_key(up_kind, E, I, H): up_rows, shape_key(down_kind, E, H, I): down_rows}, report
