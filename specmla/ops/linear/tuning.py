"""Measured launch knobs of `fp8_block_linear_triton`, shipped as data per device ("fp8_linear" table, `ops.tuned`:
the user's file from `specmla tune --ops fp8`, else `configs/<device>.json`, else the kernel's rules).

The table maps "N,K" (the weight's shape) to [max_rows, knobs] rows in increasing max_rows; a call with M rows takes
the first row with max_rows ≥ M. Rows with max_rows ≤ DECODE_MAX_M serve the split-K kernel and hold "split",
"BLOCK_N", "num_warps", "num_stages" and optionally "PREFETCH"; rows above serve the tiled GEMM and hold "BLOCK_M",
"BLOCK_N", "GROUP_M", "num_warps", "num_stages". A call past the last row takes it when it is a GEMM row. A row
that names another knob, or a value that is not a positive integer (a power of two for the tiles), is an error
naming the table's file: a bad table is reported, not run.
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


def check_row(max_rows: int, knobs: dict, where: str) -> None:
    """Raise ValueError naming `where` unless the row is one the kernels take."""
    allowed = DECODE_KNOBS if max_rows <= DECODE_MAX_M else GEMM_KNOBS
    need = allowed - {"PREFETCH"}
    if not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"{where}: max_rows must be a positive integer, got {max_rows!r}")
    if set(knobs) - allowed or need - set(knobs):
        raise ValueError(f"{where}: a row of max_rows {max_rows} takes {sorted(need)} (and optionally PREFETCH "
                         f"up to {DECODE_MAX_M} rows), got {sorted(knobs)}")
    for name, v in knobs.items():
        low = 0 if name == "PREFETCH" else 1
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ValueError(f"{where}: {name} must be an integer ≥ {low}, got {v!r}")
        if (name in POWERS_OF_TWO or name == "PREFETCH") and v & (v - 1):
            raise ValueError(f"{where}: {name} must be a power of two, got {v}")


@functools.lru_cache(maxsize=16)
def _rows(stem: str | None, generation: int) -> dict[str, list[tuple[int, dict]]]:
    data = tuned.load("fp8_linear", stem)
    where = str(tuned.source("fp8_linear", stem))
    out = {}
    for key, rows in data.items():
        parsed = [(m, dict(knobs)) for m, knobs in rows]
        for m, knobs in parsed:
            check_row(m, knobs, f"{where} [{key}]")
        out[key] = sorted(parsed, key=lambda r: r[0])
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
