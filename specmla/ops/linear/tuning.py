"""Measured launch knobs of `fp8_block_linear_triton`, shipped as data per device ("fp8_linear" table, `ops.tuned`:
the user's file from `specmla tune --ops fp8`, else `configs/<device>.json`, else the kernel's rules).

The table maps "N,K" (the weight's shape) to [max_rows, knobs] rows in increasing max_rows; a call with M rows takes
the first row with max_rows ≥ M. Rows with max_rows ≤ DECODE_MAX_M serve the split-K kernel and hold "split",
"BLOCK_N", "num_warps", "num_stages" and optionally "PREFETCH"; rows above serve the tiled GEMM and hold "BLOCK_M",
"BLOCK_N", "GROUP_M", "num_warps", "num_stages". A call past the last row takes it when it is a GEMM row. A row
that names another knob, a value outside the kernels' range (`check_row`) or a pipeline past the shared memory is
an error naming the table's file: a bad table is reported, not run. A row's split sets the order of the K sum, so
the output equals the rules' up to fp32 rounding, and can differ in its last bits between row buckets (as the decode
routes' kernels do between batch sizes).
"""

from __future__ import annotations

import functools

import torch

from specmla.ops import tuned

DECODE_MAX_M = 64  # rows served by the split-K kernel; the tiled GEMM above
DECODE_KNOBS = {"split", "BLOCK_N", "num_warps", "num_stages", "PREFETCH"}
GEMM_KNOBS = {"BLOCK_M", "BLOCK_N", "GROUP_M", "num_warps", "num_stages"}
POWERS_OF_TWO = {"BLOCK_M", "BLOCK_N", "num_warps"}


def shape_key(N: int, K: int) -> str:
    return f"{N},{K}"


def block_rows(M: int) -> int:
    """The split-K kernel's token tile at M ≤ DECODE_MAX_M rows: the power of two ≥ M, at least 16."""
    return max(16, 1 << (M - 1).bit_length())


LIMITS = {"BLOCK_M": (16, 256), "BLOCK_N": (16, 256), "num_warps": (1, 8), "num_stages": (1, 8), "PREFETCH": (0, 16),
          "GROUP_M": (1, 64), "split": (1, 1024)}
SHARED_MEMORY = 227 * 1024  # bytes a program may hold on Hopper


def stage_bytes(knobs: dict, rows: int) -> int:
    """Shared memory of a configuration's pipeline: per stage an e4m3 weight tile and an e4m3 row tile of 128
    K columns (`rows`: the token tile, the split-K kernel's power of two ≥ 16 or the GEMM's BLOCK_M)."""
    return knobs["num_stages"] * (knobs["BLOCK_N"] + knobs.get("BLOCK_M", rows)) * 128


def check_row(row, where: str) -> tuple[int, dict]:
    """(max_rows, knobs) of a table row [max_rows, {knob: value}]; ValueError naming `where` unless the kernels
    take it: the regime's knobs, integers within LIMITS (powers of two for tiles, warps and PREFETCH), and a
    pipeline that fits the shared memory at the row's largest call."""
    try:
        max_rows, knobs = row
    except (TypeError, ValueError):
        raise ValueError(f"{where}: a row must be [max_rows, {{knob: value}}], got {row!r}") from None
    if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1:
        raise ValueError(f"{where}: max_rows must be a positive integer, got {max_rows!r}")
    if not isinstance(knobs, dict):
        raise ValueError(f"{where}: the knobs of max_rows {max_rows} must be an object, got {knobs!r}")
    allowed = DECODE_KNOBS if max_rows <= DECODE_MAX_M else GEMM_KNOBS
    need = allowed - {"PREFETCH"}
    if set(knobs) - allowed or need - set(knobs):
        raise ValueError(f"{where}: a row of max_rows {max_rows} takes {sorted(need)} (and optionally PREFETCH "
                         f"up to {DECODE_MAX_M} rows), got {sorted(knobs)}")
    for name, v in knobs.items():
        low, high = LIMITS[name]
        if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
            raise ValueError(f"{where}: {name} must be an integer from {low} to {high}, got {v!r}")
        if (name in POWERS_OF_TWO or name == "PREFETCH") and v & (v - 1):
            raise ValueError(f"{where}: {name} must be a power of two, got {v}")
    rows = block_rows(min(max_rows, DECODE_MAX_M))
    if stage_bytes(knobs, rows) > SHARED_MEMORY:
        raise ValueError(f"{where}: the row of max_rows {max_rows} needs {stage_bytes(knobs, rows)} bytes of shared "
                         f"memory for its pipeline (at most {SHARED_MEMORY})")
    return max_rows, dict(knobs)


@functools.lru_cache(maxsize=16)
def _rows(stem: str | None, generation: int) -> dict[str, list[tuple[int, dict]]]:
    data = tuned.load("fp8_linear", stem)
    where = str(tuned.source("fp8_linear", stem))
    out = {}
    for key, rows in data.items():
        if not isinstance(rows, list):
            raise ValueError(f"{where} [{key}]: the rows must be a list, got {rows!r}")
        out[key] = sorted((check_row(row, f"{where} [{key}]") for row in rows), key=lambda r: r[0])
    return out


def pick(rows: list[tuple[int, dict]], M: int) -> dict | None:
    """The knobs of the first row covering M rows, within M's regime (split-K up to DECODE_MAX_M, GEMM above);
    past the last row, the last one if it is a GEMM row; None where the table has no row for M's regime."""
    for max_rows, knobs in rows:
        if M <= max_rows:
            same_regime = (M <= DECODE_MAX_M) == (max_rows <= DECODE_MAX_M)
            return dict(knobs) if same_regime else None
    if rows and M > DECODE_MAX_M and rows[-1][0] > DECODE_MAX_M:
        return dict(rows[-1][1])
    return None


def lookup(N: int, K: int, M: int, device: torch.device) -> dict | None:
    """The measured knobs for an (N, K) weight at M rows on `device`, or None (rules): no table for the device (or
    not a CUDA device), no row for the shape, or none for M's regime."""
    rows = _rows(tuned.cuda_device_key(device), tuned.generation()).get(shape_key(N, K))
    return pick(rows, M) if rows else None
