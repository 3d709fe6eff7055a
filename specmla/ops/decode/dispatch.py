"""The decode route: which kernel runs a call, and its plan (row tiles, key blocks, splits).

Pure functions of shapes and device facts, so the route table is testable on a CPU. The caller answers
tensor-level questions (contiguity, alignment, dtypes) through `supports(kernel, block_m)`.

Kernels (module names under `specmla.ops.decode`):
- "triton": the portable split-KV kernel (`triton.py`), every format, every device, the interpreter too.
- "bf16" / "bf16_seesaw": Hopper wgmma kernels for 16-bit caches (`hopper/bf16.py`, `hopper/bf16_seesaw.py`).
- "fp8" / "tbq4": Hopper 16-row e4m3 kernels for quantised caches (`hopper/fp8.py`, `hopper/tbq4.py`).
- "dequant": Hopper kernel that dequantises fp8_ds_mla / tbq4 blocks to bf16 tiles, up to 32 rows.
- "dequant_seesaw": Hopper kernel that dequantises fp8 / fp8_ds_mla / tbq4 blocks once into fp16 tiles for up to
  64 rows (S > 1 tokens folded), consumed by the seesaw schedule.
- "fp8_folded": Hopper kernel for fp8 / fp8_ds_mla / tbq4 caches at up to 64 rows (S > 1 tokens folded): Q·Kᵀ as
  e4m3 matmuls on the codes (tbq4: decoded to e4m3 centroids), P·V from Vᵀ built in registers.

The split count comes from shapes only (B, S, H, SM count, the block table's capacity), never from the
device-side lengths: no host synchronisation, a fixed workspace, and graph-capturable launches.

Measured routes: the "decode_routes" table of `ops.tuned` (the user's file from `specmla tune`, else the shipped
`routes/<device>.json`, written by `benchmarks/bench_mla_decode.py --routes`) holds, per
(format, S, H), the kernel that ran fastest at each measured (B, T); an automatic call takes the kernel of the
nearest measured point (in log B and log T) where its format, S and H were measured, and the rules below
elsewhere.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping

from triton import cdiv, next_power_of_2

from specmla.ops import tuned
from specmla.ops.kv_cache.layout import QUANTIZED

KERNELS = ("triton", "bf16", "bf16_seesaw", "dequant", "dequant_seesaw", "fp8", "fp8_folded", "tbq4")
E4M3_KERNEL = {"fp8": "fp8", "fp8_ds_mla": "fp8", "tbq4": "tbq4"}  # the 16-row Hopper kernel of each format
E4M3_ROWS = 16
MAX_ROWS = 64  # rows (folded tokens × heads) per program
FOLD_KERNELS = ("dequant_seesaw", "fp8_folded")  # the quantised-cache kernels that fold S > 1 tokens into 64 rows
FOLD_KERNEL = "fp8_folded"  # the rules' folded kernel (e4m3 scores: faster than dequant_seesaw's tiles at S ≥ 2)
HOPPER_BLOCK_N = 64  # keys per block of the Hopper kernels for quantised caches
# auto rule: quantised calls of S ≥ FOLD_MIN_S tokens fold them onto FOLD_KERNEL (the codes read once)
# where the folded splits hold FOLD_MIN_KEYS keys, twice that at S = 2 (one token per program reads the keys only
# twice); on shorter splits one token per program wins (its extra reads cost less than the folded kernel's start)
FOLD_MIN_S, FOLD_MIN_KEYS = 2, 1024
MIN_HOPPER_KEYS = 2 * HOPPER_BLOCK_N  # auto route: fp8 Hopper kernels at S = 1 take splits of two blocks or more
# fp8 formats at S = 1 on dequant_seesaw (rows past the e4m3 and dequant kernels' tiles): splits of 8 blocks or more
# (its producer's start costs more than the Triton kernel's whole split below that)
DEQUANT_SEESAW_MIN_KEYS = 8 * HOPPER_BLOCK_N


def min_hopper_keys(kv_format: str, S: int, H: int) -> int:
    """The shortest split (keys) the auto route gives a Hopper kernel: any for tbq4 (its Triton kernel is the slower
    one on one-block splits too), and for fp8 formats at S > 1 with H ≤ E4M3_ROWS (one token per program on the
    16-row kernel beats the Triton kernel there); DEQUANT_SEESAW_MIN_KEYS for fp8 formats at S = 1 on more rows than
    the e4m3 kernel (fp8) or the dequant kernel (fp8_ds_mla) takes; else MIN_HOPPER_KEYS (shorter splits run faster
    on Triton)."""
    if kv_format == "tbq4" or S > 1 and H <= E4M3_ROWS:
        return 0
    if S == 1 and H > (E4M3_ROWS if kv_format == "fp8" else 2 * E4M3_ROWS):
        return DEQUANT_SEESAW_MIN_KEYS
    return MIN_HOPPER_KEYS


# 16-bit caches take the seesaw kernel from splits of SEESAW_MIN_KEYS keys (its overlap of one warpgroup's softmax
# with the other's matmuls pays once a split is long), from SEESAW_MIN_KEYS_SHARED where several head blocks read the
# same keys (the later reads hit L2, so the call leans on the tensor cores)
SEESAW_MIN_KEYS, SEESAW_MIN_KEYS_SHARED = 512, 128
SMEM_BUDGET = 224 * 1024  # the Triton kernel's K pipeline plus its query tile must fit this


@dataclasses.dataclass(frozen=True)
class Route:
    """A call's kernel, its plan (`plan()`'s dict) and, for "triton", the tiles (`default_tiles()`)."""

    kernel: str
    plan: dict
    tiles: dict


def fold_factor(S: int, block_h: int, max_rows: int = MAX_ROWS) -> int:
    """Largest F dividing S with F·block_h ≤ max_rows: F query tokens share one pass over the keys."""
    for f in range(S, 0, -1):
        if S % f == 0 and f * block_h <= max_rows:
            return f
    return 1


def row_tile(S: int, H: int, max_rows: int = MAX_ROWS) -> int:
    """Rows of one program: F folded query tokens × the head block, padded to a power of two ≥ 16."""
    block_h = min(max_rows, next_power_of_2(H))
    return max(16, next_power_of_2(fold_factor(S, block_h, max_rows) * block_h))


def default_tiles(block_m: int, d: int, elem: int, kv_format: str = "auto") -> dict:
    """The Triton kernel's key block, warps and pipeline stages, shrunk until the K-tile pipeline
    (stages × block_n × d) plus the query tile fits the shared-memory budget. tbq4's small tiles run
    unpipelined: only the rope part would ride the pipeline, and its stages cost occupancy."""
    if block_m >= 64:
        block_n, warps, stages = 64, 8, 2
    elif kv_format == "tbq4":
        block_n, warps, stages = 32, 4, 1
    else:
        block_n, warps, stages = 32, 4, 5
    while stages * block_n * d * elem + block_m * d * elem > SMEM_BUDGET and (stages > 1 or block_n > 16):
        if stages > 2:
            stages -= 1
        elif block_n > 16:
            block_n //= 2
        else:
            stages -= 1
    return dict(block_n=block_n, num_warps=warps, num_stages=stages)


def plan(B: int, S: int, H: int, max_seq_len: int, sm_count: int, block_n: int = 32, max_rows: int = MAX_ROWS,
         waves: int | None = None) -> dict:
    """Tile shapes and the split count, from shapes only. `waves`: how many waves of programs to fill
    (default: two for large batches of tiles under 64 rows, which balances them; else one)."""
    block_h = min(max_rows, next_power_of_2(H))
    fold = fold_factor(S, block_h, max_rows)
    block_m = max(16, next_power_of_2(fold * block_h))
    head_blocks = cdiv(H, block_h)
    programs = B * (S // fold) * head_blocks
    # one program per SM at a time (the K pipeline takes most of the shared memory): split only as far
    # as the waves allow, at least one key block per split
    max_useful = max(1, cdiv(max_seq_len, block_n))
    if waves is None:
        waves = 2 if programs >= 32 and block_m < 64 else 1
    splits = max(1, min(waves * sm_count // programs, max_useful, 128))
    return dict(BLOCK_H=block_h, FOLD=fold, BLOCK_M=block_m, head_blocks=head_blocks, num_splits=splits,
                BLOCK_N=block_n, keys_per_split=cdiv(cdiv(max_seq_len, block_n), splits) * block_n)


def route_key(kv_format: str, S: int, H: int) -> str:
    """The measured-routes table's key of a call's format, query tokens and heads."""
    return f"{kv_format},{S},{H}"


def measured_point(routes: Mapping[str, list] | None, kv_format: str, B: int, S: int, H: int,
                   max_seq: int) -> list | None:
    """The measured point [B, T, kernel] nearest (B, max_seq) in log B + log T among the table's rows for this
    format, S and H; None where they were not measured (or the call has no request or key)."""
    rows = (routes or {}).get(route_key(kv_format, S, H))
    if not rows or B < 1 or max_seq < 1:
        return None
    return min(rows, key=lambda r: abs(math.log2(B / r[0])) + abs(math.log2(max_seq / r[1])))


def measured_kernel(routes: Mapping[str, list] | None, kv_format: str, B: int, S: int, H: int,
                    max_seq: int) -> str | None:
    """The kernel of `measured_point`; None where none."""
    point = measured_point(routes, kv_format, B, S, H, max_seq)
    return None if point is None else point[2]


def load_routes(device_key: str | None) -> dict:
    """The measured routes of a device (the "routes" entry of its "decode_routes" table: the user's file, else the
    shipped `routes/<device_key>.json`; see `ops.tuned`), {} where the rules apply."""
    return tuned.load("decode_routes", device_key).get("routes", {})


def select_kernel(B: int, S: int, H: int, D: int, kv_format: str, *, hopper: bool, sm_count: int, max_seq: int,
                  elem: int, supports: Callable[[str, int], bool], backend: str = "auto",
                  kernel: str | None = None, block_n: int | None = None, max_rows: int = MAX_ROWS,
                  routes: Mapping[str, list] | None = None) -> Route:
    """The kernel and plan for a call of q [B, S, H, D] on a `kv_format` cache addressing up to `max_seq`
    keys. `hopper`: a Hopper GPU outside the interpreter with Gluon; `elem`: the larger element size of q
    and the cache; `supports(kernel, block_m)`: whether that Hopper kernel takes these tensors with
    `block_m` rows. backend "auto" takes the table below, "triton" the portable kernel, "hopper" a Hopper
    kernel wherever one takes the call (ValueError if none); `kernel` names one kernel to run.

    `routes`: measured routes (`load_routes`); in "auto" their kernel takes the call where they cover it, the
    kernel supports it and (a quantised Hopper kernel) its splits hold `min_hopper_keys` keys or the measured
    point's own splits were as short. The rules (auto):
    16-bit caches → bf16_seesaw when its splits hold SEESAW_MIN_KEYS keys (SEESAW_MIN_KEYS_SHARED with several head
    blocks), else bf16. Quantised caches → S > 1 tokens folded into up to 64 rows on FOLD_KERNEL (the codes read
    once for all of them) from FOLD_MIN_S tokens a request where those splits hold FOLD_MIN_KEYS keys (twice that
    at S = 2) and S · H passes 16 (else they fold into the format's 16-row e4m3 kernel), else one token per program on
    the format's 16-row e4m3 kernel; S = 1: the e4m3 kernel when the rows fit 16, else dequant (fp8_ds_mla, tbq4 up to 32 rows), else
    dequant_seesaw (up to 64 rows); a quantised Hopper kernel needs splits of `min_hopper_keys` keys, else triton."""
    if backend not in ("auto", "triton", "hopper"):
        raise ValueError(f"unknown backend {backend!r} (auto | torch | triton | hopper)")
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r} ({' | '.join(KERNELS)})")
    if backend == "auto" and kernel is None:
        point = measured_point(routes, kv_format, B, S, H, max_seq)
        measured = None if point is None else point[2]
        if measured is not None and (hopper or measured == "triton"):
            # the rules' conditions but the choice of kernel hold, except that splits shorter than `min_hopper_keys`
            # are taken where the measured point's own splits were that short (the benchmark names the kernel,
            # so it times them); a measured kernel that does not take the tensors leaves the call to the rules
            short_measured = False
            if measured != "triton":  # the measured point planned as the benchmark ran it (the kernel named)
                try:
                    at_point = _select(point[0], S, H, D, kv_format, hopper, sm_count, point[1], elem, supports,
                                       measured, block_n, max_rows, forced=True)
                    short_measured = at_point.plan["keys_per_split"] < min_hopper_keys(kv_format, S, H)
                except ValueError:
                    pass
            try:
                route = _select(B, S, H, D, kv_format, hopper and measured != "triton", sm_count, max_seq, elem,
                                supports, measured, block_n, max_rows, forced=short_measured)
            except ValueError:
                route = None
            if route is not None and route.kernel == measured:
                return route
    if kernel == "triton":
        backend = "triton"
    elif kernel is not None:
        backend = "hopper"
    return _select(B, S, H, D, kv_format, hopper and backend != "triton", sm_count, max_seq, elem, supports, kernel,
                   block_n, max_rows, forced=backend == "hopper")


def _select(B: int, S: int, H: int, D: int, kv_format: str, on_hopper: bool, sm_count: int, max_seq: int, elem: int,
            supports: Callable[[str, int], bool], kernel: str | None, block_n: int | None, max_rows: int, *,
            forced: bool) -> Route:
    """`select_kernel`'s rules for `kernel` (None: any); forced: a Hopper kernel or an error, short splits
    included (else the Triton kernel where no Hopper kernel qualifies)."""
    quant = kv_format in QUANTIZED
    e4m3 = E4M3_KERNEL.get(kv_format)
    min_keys = min_hopper_keys(kv_format, S, H)
    fold_plan = plan(B, S, H, max_seq, sm_count, HOPPER_BLOCK_N, max_rows, waves=1)
    fold_keys = FOLD_MIN_KEYS * (2 if S == 2 else 1)
    fold_kernel = kernel if kernel in FOLD_KERNELS else FOLD_KERNEL
    # S · H ≤ 16 rows: the tokens fold into the 16-row e4m3 kernel itself (the codes read once, no empty rows)
    fits_e4m3 = quant and S * H <= E4M3_ROWS and supports(e4m3, E4M3_ROWS)
    folded = (on_hopper and quant and S > 1 and kernel in (None, *FOLD_KERNELS)
              and (kernel is not None or S >= FOLD_MIN_S and fold_plan["FOLD"] > 1 and not fits_e4m3
                   and fold_plan["keys_per_split"] >= fold_keys)
              and supports(fold_kernel, row_tile(S, H, max_rows))
              and (forced or fold_plan["keys_per_split"] >= min_keys))
    if (on_hopper and quant and S > 1 and H <= E4M3_ROWS and not folded and kernel in (None, e4m3)
            and supports(e4m3, E4M3_ROWS)):
        # one query token per program on the 16-row kernel (each token reads the keys again), where the folded
        # rows' splits would be short
        unfolded = plan(B, S, H, max_seq, sm_count, HOPPER_BLOCK_N, E4M3_ROWS, waves=1)
        if forced or unfolded["keys_per_split"] >= min_keys:
            max_rows = E4M3_ROWS
    block_m = row_tile(S, H, max_rows)
    tiles = default_tiles(block_m, D, elem, kv_format)
    hopper_block_n = block_n if block_n in (32, 64) else 64
    triton_plan = plan(B, S, H, max_seq, sm_count, block_n or tiles["block_n"], max_rows)
    tiles = dict(tiles, block_n=block_n or tiles["block_n"])
    choice = None
    if on_hopper:
        if quant:
            candidates = (fold_kernel,) if folded else ((e4m3,) + (("dequant",) if kv_format != "fp8" else ())
                                                        + ("dequant_seesaw", "fp8_folded"))
        else:
            candidates = ("bf16",)
        if kernel is not None:
            candidates = (kernel,) if kernel in candidates or kernel == "bf16_seesaw" and not quant else ()
        for name in candidates:
            if supports("bf16" if name == "bf16_seesaw" else name, block_m):
                choice = name
                break
    if choice is None:
        if forced:
            raise ValueError(f"no Hopper decode kernel{' ' + repr(kernel) if kernel else ''} takes this call: "
                             "a 16-bit cache with Dc a multiple of 64 up to 512 and Dr a multiple of 16 up to 64, "
                             "or an fp8 / fp8_ds_mla / tbq4 cache with Dc=512, Dr=64 and at most 64 rows, "
                             "on a Hopper GPU")
        return Route("triton", triton_plan, tiles)
    hopper_plan = plan(B, S, H, max_seq, sm_count, HOPPER_BLOCK_N if quant else hopper_block_n, max_rows, waves=1)
    if quant and not forced and hopper_plan["keys_per_split"] < min_keys:
        return Route("triton", triton_plan, tiles)
    if choice == "bf16" and kernel is None:
        seesaw_keys = SEESAW_MIN_KEYS_SHARED if hopper_plan["head_blocks"] > 1 else SEESAW_MIN_KEYS
        if (hopper_plan["BLOCK_N"] == 64 and supports("bf16_seesaw", hopper_plan["BLOCK_M"])
                and hopper_plan["keys_per_split"] >= seesaw_keys):
            choice = "bf16_seesaw"
    elif choice == "bf16_seesaw" and not (hopper_plan["BLOCK_N"] == 64 and supports("bf16_seesaw", block_m)):
        raise ValueError("the seesaw kernel takes 64-key blocks with Dr = 64 and Dc a multiple of 128 up to 512")
    return Route(choice, hopper_plan, tiles)


def decode_bytes(seq_lens_sum: int, B: int, S: int, H: int, D: int = 576, dv: int = 512, elem: int = 2) -> int:
    """FlashMLA's byte count of a call: every cached row once, q in, out back."""
    return (seq_lens_sum * D + B * S * H * (D + dv)) * elem


def decode_flops(seq_lens_sum: int, S: int, H: int, D: int = 576, dv: int = 512) -> float:
    return 2.0 * S * seq_lens_sum * H * (D + dv)
